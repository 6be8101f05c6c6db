#!/usr/bin/env bash
# Builds the kvferry Python wheel (abi3, Python >= 3.9) into .bin/.
#
#   scripts/build-wheel.sh          host backend only
#   scripts/build-wheel.sh --cuda   with the CUDA backend (for the H200; no CUDA needed to build)
#
# Uses the venv at .venv (maturin from PyPI): python3 -m venv .venv &&
# .venv/bin/pip install maturin
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
if [ "${1:-}" = "--cuda" ]; then features=(--features cuda); fi
py=${PYTHON:-.venv/bin/python}
mkdir -p .bin
rm -f .bin/kvferry-*.whl
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-python/target} "$py" -m maturin build --release --strip \
    -m python/Cargo.toml "${features[@]}" --out .bin
ls -l .bin/kvferry-*.whl
