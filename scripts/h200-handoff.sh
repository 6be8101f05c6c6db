#!/usr/bin/env bash
# The P/D handoff figures of docs/BENCHMARKS.md ("T8") on a CUDA machine:
# bench transport (T4: the fetch with 2-16 connections per peer against the
# best raw loopback copy over 1-16), bench engine (host save/load vs memcpy), and
# `kvferry pd --gpu cuda` at --concurrency 1 (T8 and the phase split) with
# 1, 2 and 4 read parts in flight, then once at the default concurrency
# (aggregate fetch rate vs the raw copy). Build first, where Rust is:
#   cargo build --release --features cuda && mkdir -p .bin && cp target/release/kvferry .bin/ && strip .bin/kvferry
# then, on the GPU machine, from the repository root:
#   scripts/h200-handoff.sh [OUT_DIR]
# Env: KVFERRY_BIN (default .bin/kvferry), PD_REQUESTS (default 30),
# READS (default "1 2 4"), CONNS (fetch pools of bench transport, default
# 2,4,8,16).
set -uo pipefail
BIN=${KVFERRY_BIN:-.bin/kvferry}
OUT=${1:-/tmp/kvferry-handoff}
mkdir -p "$OUT"
rc=0
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } 2>&1 | tee "$OUT/machine.txt"
echo "== bench transport"
"$BIN" bench transport --connections "${CONNS:-2,4,8,16}" --json "$OUT/bench_transport.json" >"$OUT/bench_transport.txt" 2>&1 || rc=1
grep -iE "T4|raw|fetch" "$OUT/bench_transport.txt" | tail -12
echo "== bench engine"
"$BIN" bench engine --json "$OUT/bench_engine.json" >"$OUT/bench_engine.txt" 2>&1 || rc=1
grep -iE "ratio|memcpy" "$OUT/bench_engine.txt" | tail -6
PD=(pd --quiet --gpu cuda --model qwen3-8b --block-tokens 16 --max-blocks 256 --requests "${PD_REQUESTS:-30}" --pool-size 8GiB)
for r in ${READS:-1 2 4}; do
    echo "== pd --concurrency 1 --reads-in-flight $r"
    "$BIN" "${PD[@]}" --concurrency 1 --reads-in-flight "$r" --json "$OUT/pd_c1_r$r.json" >"$OUT/pd_c1_r$r.txt" 2>&1 || rc=1
    grep -iE "T8|raw|fetch aggregate|handoff|^ *(save_barrier|registration_barrier|decode_wait|fetch|load|query|handshake|lock|read|verify|seal|release|load_tail) " "$OUT/pd_c1_r$r.txt" | head -24
done
echo "== pd --concurrency 4 --reads-in-flight 2"
"$BIN" "${PD[@]}" --reads-in-flight 2 --json "$OUT/pd_c4_r2.json" >"$OUT/pd_c4_r2.txt" 2>&1 || rc=1
grep -iE "T8|raw|fetch aggregate|verified" "$OUT/pd_c4_r2.txt" | head -8
exit $rc
