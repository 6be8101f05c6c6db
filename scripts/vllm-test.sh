#!/usr/bin/env bash
# The vLLM connector tier: kvferry.vllm (KvferryConnector) under vLLM's
# real v1 Scheduler on the CPU, its worker side on real torch tensors in
# vLLM's KV layouts, and its bad-input errors (python/tests_vllm/).
#
#   scripts/vllm-test.sh [pytest args...]
#
# VLLM_VENV (default target/vllm-venv) is created if missing and gets
# vllm==0.33.0 with every dependency pinned by
# python/tests_vllm/constraints-vllm-0.33.0.txt (about 4.6 GB of downloads,
# 9.5 GB installed: CUDA torch comes with it; no GPU is needed or used),
# then the kvferry wheel (Rust build in python/target, shared with
# scripts/python-test.sh). No pip cache is kept (disk).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.33.0
venv=${VLLM_VENV:-target/vllm-venv}
constraints=python/tests_vllm/constraints-vllm-$VLLM_VERSION.txt
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --no-cache-dir --upgrade pip
if ! "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    "$venv/bin/pip" install -q --no-cache-dir -c "$constraints" "vllm==$VLLM_VERSION" pytest
fi
CARGO_TARGET_DIR=${CARGO_TARGET_DIR_PY:-$PWD/python/target} \
    "$venv/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps ./python
py=$(cd "$venv" && pwd)/bin/python
# Run from the tests' folder so `import kvferry` is the installed wheel,
# not the source tree's python/kvferry (which has no native module).
cd python/tests_vllm
VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} "$py" -m pytest -q -p no:cacheprovider . "$@"
