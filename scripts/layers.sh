#!/usr/bin/env bash
# The module layers (tier 0 of the test command): checks the library's real
# module graph — every module, every `use`, path and macro path, `super::`
# included — against the one layer table, scripts/layers.txt: no module
# uses a module above its layer, and no level of the module tree has a
# cycle. The checker is tests/layers.rs (it parses the sources with `syn`);
# a failure names the file and line of each offending use.
#
#   scripts/layers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test -q --test layers -- --nocapture --test-threads 1
