#!/usr/bin/env bash
# Runs the GPU benchmarks and the main job on a CUDA machine (the H200 runs
# recorded in docs/BENCHMARKS.md). Build first, where Rust is:
#   cargo build --release --features cuda && mkdir -p .bin && cp target/release/kvferry .bin/ && strip .bin/kvferry
# then, on the GPU machine, from the repository root:
#   scripts/h200.sh [OUT_DIR]
set -uo pipefail
BIN=${KVFERRY_BIN:-.bin/kvferry}
OUT=${1:-${OUT:-/tmp/kvferry-h200}}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  nproc
} 2>&1 | tee "$OUT/machine.txt"
rc=0
echo "== kvferry bench gpu"
"$BIN" bench gpu --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt" || rc=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
PD_ARGS=(--quiet --gpu cuda --model qwen3-8b --block-tokens 16 --max-blocks 256 --requests "${PD_REQUESTS:-60}" --pool-size 8GiB)
echo "== kvferry pd --gpu cuda, every node on device 0"
"$BIN" pd "${PD_ARGS[@]}" --prefill-devices 0 --decode-devices 0 \
  --json "$OUT/pd_cuda.json" 2>&1 | tee "$OUT/pd_cuda.txt" || rc=1
if [ "$NGPU" -ge 2 ]; then
  echo "== kvferry pd --gpu cuda --prefill-devices 0 --decode-devices 1"
  "$BIN" pd "${PD_ARGS[@]}" --prefill-devices 0 --decode-devices 1 \
    --json "$OUT/pd_cuda_2gpu.json" 2>&1 | tee "$OUT/pd_cuda_2gpu.txt" || rc=1
fi
exit $rc
