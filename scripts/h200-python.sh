#!/usr/bin/env bash
# The real-model P/D run on the H200 (issue 16, part 5).
#
#   scripts/h200-python.sh OUT_DIR
#
# Installs the carried wheel (.bin/kvferry-*.whl, built on the dev machine
# with `scripts/build-wheel.sh --cuda`) into a venv that sees the system's
# torch and transformers (--system-site-packages; the H200 has no network),
# (plus the site-packages of the `python3` that has torch, when that is a
# venv of its own), then runs python/examples/pd_real_model.py with the Qwen3-architecture
# model in bf16 on cuda. Writes OUT_DIR/pd_real_model.json and
# OUT_DIR/pd_real_model.log; exits non-zero when a case fails.
#
# Environment: PD_ARGS adds flags (e.g. PD_ARGS="--size small" for a quick run).
# RUNS=N (default 1) runs the example N times in a row after one install and
# one test_cuda.py, into OUT_DIR/run-I/ (pd_real_model.json, .log), and
# appends a line per run to OUT_DIR/runs.txt; exits 0 only when all N pass
# (3 when a run's single-instance reference was not reproducible: the
# harness failed, not kvferry).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/h200-python.sh OUT_DIR}
mkdir -p "$out"
shopt -s nullglob
wheels=(.bin/kvferry-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
    echo "want exactly one .bin/kvferry-*.whl, found ${#wheels[@]} (build it with scripts/build-wheel.sh --cuda)" >&2
    exit 2
fi
venv=${VENV:-/tmp/kvferry-venv}
python3 -m venv --system-site-packages "$venv"
# torch and transformers may live in another venv (on the H200 they sit in
# /opt/torch/.venv, the `python3` on PATH), which --system-site-packages
# does not reach: point the new venv at that python's site-packages too.
torch_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null || true)
if [ -n "$torch_site" ]; then
    "$venv/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/torch-site.pth", "w").write(sys.argv[1] + "\n")' "$torch_site"
fi
"$venv/bin/pip" install --no-index --no-deps --force-reinstall -q "${wheels[0]}"
"$venv/bin/python" - <<'PY'
import kvferry, torch, transformers
print(f"kvferry {kvferry.__version__} cuda_built={kvferry.cuda_built()} torch {torch.__version__} "
      f"transformers {transformers.__version__} gpu={torch.cuda.get_device_name(0)}")
assert kvferry.cuda_built(), "the carried wheel has no CUDA backend: build it with scripts/build-wheel.sh --cuda"
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# The CUDA backend with torch tensors: round trip, wrong device, freed memory.
"$venv/bin/python" python/tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "test_cuda.py failed" >&2; exit 1; }
runs=${RUNS:-1}
if [ "$runs" -eq 1 ]; then
    # shellcheck disable=SC2086
    "$venv/bin/python" python/examples/pd_real_model.py --device cuda --json "$out/pd_real_model.json" ${PD_ARGS:-} \
        2>&1 | tee "$out/pd_real_model.log"
    exit "${PIPESTATUS[0]}"
fi
worst=0
passed=0
for i in $(seq 1 "$runs"); do
    mkdir -p "$out/run-$i"
    start=$SECONDS
    set +e
    # shellcheck disable=SC2086
    "$venv/bin/python" python/examples/pd_real_model.py --device cuda --json "$out/run-$i/pd_real_model.json" \
        ${PD_ARGS:-} 2>&1 | tee "$out/run-$i/pd_real_model.log"
    rc=${PIPESTATUS[0]}
    set -e
    echo "run $i of $runs: exit $rc, $((SECONDS - start)) s" | tee -a "$out/runs.txt"
    if [ "$rc" -eq 0 ]; then passed=$((passed + 1)); fi
    if [ "$rc" -eq 3 ] || { [ "$rc" -ne 0 ] && [ "$worst" -ne 3 ]; }; then worst=$rc; fi
done
echo "$passed of $runs runs passed" | tee -a "$out/runs.txt"
exit "$worst"
