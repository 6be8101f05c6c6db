#!/usr/bin/env bash
# The Python tier: builds the kvferry wheel, installs it into a venv with
# one `pip install ./python`, and runs the package's pytest suite (lifecycle,
# bad inputs, round trips on the host backend, degrade paths, two
# processes, and the P/D example on CPU with the numpy model).
#
#   scripts/python-test.sh [pytest args...]
#
# VENV (default target/py-venv) is created if missing; maturin, numpy and
# pytest come from PyPI. The Rust build goes to python/target.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-target/py-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "maturin>=1.16,<2" numpy pytest
CARGO_TARGET_DIR=${CARGO_TARGET_DIR_PY:-$PWD/python/target} "$venv/bin/pip" install -q --force-reinstall --no-deps ./python
"$venv/bin/python" -m pytest -q python/tests "$@"
