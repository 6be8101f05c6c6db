#!/usr/bin/env bash
# A seed sweep of a prebuilt simulation binary (no Rust toolchain needed:
# for a many-core machine such as the H200 host). Build and copy it first:
#   RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target-sim cargo test --test sim --no-run
#   cp target-sim/debug/deps/sim-<hash> .bin/sim && strip .bin/sim
# then: scripts/sweep-prebuilt.sh BIN FIRST_SEED COUNT JOBS OUT_DIR
# Writes OUT_DIR/summary.txt (one SIM-SUMMARY line per passing seed),
# OUT_DIR/failed.txt (failing seeds, their first violation) and prints the
# per-invariant check totals (the same sums scripts/sim.sh prints); each
# failing seed with its replay command. Exits 1 when a seed failed.
set -uo pipefail
BIN=$1 START=$2 COUNT=$3 JOBS=$4 OUT=$5
mkdir -p "$OUT"
: >"$OUT/summary.txt"
: >"$OUT/failed.txt"
export BIN OUT
t0=$(date +%s)
seq "$START" $((START + COUNT - 1)) | xargs -P "$JOBS" -I{} sh -c '
    out=$(MADSIM_TEST_SEED={} timeout 120 "$BIN" main_scenario --exact --nocapture 2>&1)
    if printf "%s\n" "$out" | grep -q "^test result: ok. 1 passed"; then
        printf "%s\n" "$out" | grep "^SIM-SUMMARY" >>"$OUT/summary.txt"
    else
        echo "{} $(printf "%s\n" "$out" | grep -m1 -E "VIOLATION|panicked")" >>"$OUT/failed.txt"
    fi
'
echo "seeds $START..$((START + COUNT - 1)): $(wc -l <"$OUT/summary.txt") passed, $(wc -l <"$OUT/failed.txt") failed, $(($(date +%s) - t0)) s wall, $JOBS jobs"
awk '{ for (i = 1; i <= NF; i++) { split($i, kv, "=")
        if (kv[1] == "checks") { n = split(kv[2], items, ","); for (j = 1; j <= n; j++) { m = split(items[j], p, ":"); if (m >= 2) sum[p[1]] += p[2] } }
        else if (kv[1] == "c9_overrun_max_us") { if (kv[2] > tot[kv[1]]) tot[kv[1]] = kv[2] }
        else if (kv[1] ~ /^(corrupt_|checksum_rejected|poisoned_frees|done|fetched|verified|c[0-9]+_)/) tot[kv[1]] += kv[2] } }
     END { for (k in sum) printf "  %-58s %d\n", k, sum[k]; printf "totals:"; for (k in tot) printf " %s=%d", k, tot[k]; printf "\n" }' "$OUT/summary.txt" | sort
# Issue 29: each bug class's path was reached somewhere in the sweep, and
# how many seeds had a deadline-bound fetch (C9).
REACH_FAIL=0
for ck in C8:c8_partial_read_errors C9:c9_deadline_fetches C13:c13_expired_reads C15:c15_busy_refusals; do
    k=${ck#*:}
    n=$(grep -o " $k=[0-9]*" "$OUT/summary.txt" | awk -F= '{ s += $2 } END { print s + 0 }')
    if [ "$n" -eq 0 ] && [ -s "$OUT/summary.txt" ]; then
        echo "FAIL: ${ck%%:*} reach counter $k is 0 over the sweep"
        REACH_FAIL=1
    fi
done
echo "C9: $(grep -o ' c9_deadline_fetches=[0-9]*' "$OUT/summary.txt" | awk -F= '$2 > 0' | wc -l) of $(wc -l <"$OUT/summary.txt") seeds had a fetch end on its deadline"
sort -n "$OUT/failed.txt" | head -20 | while read -r seed why; do
    echo "FAILED seed $seed: $why"
    echo "  replay: MADSIM_TEST_SEED=$seed RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target-sim cargo test --test sim -- main_scenario --exact --nocapture"
done
[ ! -s "$OUT/failed.txt" ] && [ "$REACH_FAIL" = 0 ]
