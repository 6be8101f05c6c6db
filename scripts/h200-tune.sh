#!/usr/bin/env bash
# Sweeps the CUDA backend's tuning knobs (CudaConfig::from_env) with
# `kvferry bench gpu`, one line of T1/T2/T3 per setting, all in one run on
# the same device so the settings compare side by side. Usage, on the GPU
# machine from the repository root (binary built as in scripts/h200.sh):
#   scripts/h200-tune.sh [OUT_DIR]
set -uo pipefail
BIN=${KVFERRY_BIN:-.bin/kvferry}
OUT=${1:-${OUT:-/tmp/kvferry-h200-tune}}
mkdir -p "$OUT"
run() { # name, then VAR=value settings
  local name=$1; shift
  echo "== $name: $*"
  env "$@" "$BIN" bench gpu --json "$OUT/tune_$name.json" 2>&1 | grep -E "T1|T2|T3|raw|tuning|checksummed" || echo "FAILED"
}
run default
run zero_copy KVFERRY_CUDA_STAGING_BYTES=0
run stage16m KVFERRY_CUDA_STAGING_BYTES=16777216
run cpu_seal KVFERRY_CUDA_DEVICE_CHECKSUMS=0
