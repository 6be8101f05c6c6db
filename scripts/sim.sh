#!/usr/bin/env bash
# The deterministic simulation tier (design.md §4, sim/).
#
#   scripts/sim.sh [SEEDS] [JOBS]
#
# 1. builds the madsim test binary (target-sim/, never the normal target/);
#    fails if it contains no simulation test (the RUSTFLAGS pitfall: a build
#    without `--cfg madsim` compiles sim/ to zero tests and "passes");
# 2. sweeps SEEDS seeds (default 500) of `main_scenario`, JOBS processes at
#    a time (default 2), one process per seed; logs are kept only for
#    failing seeds (target-sim/sim-logs/), each failure prints its replay
#    command; the regression seeds run too;
# 3. determinism sample: DET_SEEDS seeds (default 6) under
#    MADSIM_TEST_CHECK_DETERMINISM=1 (madsim checks one seed per run), and
#    each run twice more with byte-identical output required;
# 4. broken builds (skip with SIM_BROKEN=0): with `--features broken-flush`,
#    `broken-release` and `broken-session-ids` the suite must FAIL (the tests
#    broken_*_is_caught run 20 seeds in-process and pass only if the named
#    invariant fired).
#
# Env: SIM_SEED_START (default 0), DET_SEEDS, SIM_BROKEN, SIM_SEED_TIMEOUT_S
# (wall-clock limit per seed process, default 120).
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

SEEDS=${1:-500}
JOBS=${2:-2}
START=${SIM_SEED_START:-0}
DET_SEEDS=${DET_SEEDS:-6}
SEED_TIMEOUT=${SIM_SEED_TIMEOUT_S:-120}
export CARGO_TARGET_DIR=target-sim
# Prepend, never replace: an inherited RUSTFLAGS would otherwise drop the cfg.
export RUSTFLAGS="--cfg madsim ${RUSTFLAGS:-}"
LOGS=target-sim/sim-logs
mkdir -p "$LOGS"
FAIL=0

say() { printf '\n== %s\n' "$*"; }

# build FEATURES -> prints the sim test binary path
build() {
    local feat=()
    [ -n "$1" ] && feat=(--features "$1")
    cargo test --test sim "${feat[@]}" --no-run >&2
    cargo test --test sim "${feat[@]}" --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | grep '/sim-' | tail -1
}

# require_tests BIN NAME...: the binary lists every named test
require_tests() {
    local bin=$1
    shift
    local list
    list=$("$bin" --list 2>/dev/null)
    local n
    n=$(printf '%s\n' "$list" | grep -c ': test$' || true)
    if [ "$n" -eq 0 ]; then
        echo "FAIL: $bin contains no tests: was it built without --cfg madsim?" >&2
        exit 1
    fi
    for t in "$@"; do
        if ! printf '%s\n' "$list" | grep -qx "$t: test"; then
            echo "FAIL: $bin lacks test $t (found: $n tests)" >&2
            exit 1
        fi
    done
}

replay() {
    echo "MADSIM_TEST_SEED=$1 RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target-sim cargo test --test sim -- main_scenario --exact --nocapture"
}

say "build (madsim)"
BIN=$(build "")
require_tests "$BIN" main_scenario
echo "binary: $BIN ($("$BIN" --list 2>/dev/null | grep -c ': test$') tests)"

say "regression seeds"
if ! "$BIN" regression_ --test-threads="$JOBS" >"$LOGS/regressions.log" 2>&1; then
    grep -E '^test .*FAILED|VIOLATION|replay:' "$LOGS/regressions.log" || true
    echo "FAIL: a regression seed failed (log: $LOGS/regressions.log)"
    FAIL=1
else
    grep -E '^test result' "$LOGS/regressions.log"
fi

say "sweep: seeds $START..$((START + SEEDS - 1)), $JOBS jobs"
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"
rm -f "$LOGS"/seed-*.log "$LOGS"/failed.txt
export BIN LOGS SUMMARY SEED_TIMEOUT
t0=$(date +%s)
seq "$START" $((START + SEEDS - 1)) | xargs -P "$JOBS" -I{} sh -c '
    log=$LOGS/seed-{}.log
    if MADSIM_TEST_SEED={} timeout "$SEED_TIMEOUT" "$BIN" main_scenario --exact --nocapture >"$log" 2>&1 \
        && grep -q "^test result: ok. 1 passed" "$log"; then
        grep "^SIM-SUMMARY" "$log" >>"$SUMMARY"
        rm -f "$log"
    else
        echo {} >>"$LOGS/failed.txt"
    fi
' || true
t1=$(date +%s)
passed=$(wc -l <"$SUMMARY")
echo "passed $passed of $SEEDS seeds in $((t1 - t0)) s wall ($JOBS jobs)"
awk '
    { for (i = 1; i <= NF; i++) {
        split($i, kv, "=")
        if (kv[1] == "faults" || kv[1] == "checks") {
            n = split(kv[2], items, ",")
            for (j = 1; j <= n; j++) { m = split(items[j], p, ":"); if (m >= 2) sum[kv[1] " " p[1]] += p[2] }
        } else if (kv[1] == "done" || kv[1] == "lost" || kv[1] == "reused" || kv[1] == "saved" || kv[1] == "fetched" || kv[1] == "verified" || kv[1] == "recomputed") {
            tot[kv[1]] += kv[2]
        } else if (kv[1] == "repair_restart" && kv[2] == "true") { tot["repair_restart"]++ }
        else if (kv[1] == "probe" && kv[2] == "true") { tot["probe_conclusive"]++ }
    } }
    END {
        printf "totals:"; for (k in tot) printf " %s=%d", k, tot[k]; printf "\n"
        for (k in sum) printf "  %-60s %d\n", k, sum[k]
    }' "$SUMMARY" | sort
if [ -s "$LOGS/failed.txt" ]; then
    FAIL=1
    echo "FAILED seeds (logs in $LOGS/):"
    for s in $(sort -n "$LOGS/failed.txt"); do
        first=$(grep -m1 -E 'VIOLATION|panicked' "$LOGS/seed-$s.log" || echo "(no violation line; see log)")
        echo "  seed $s: $first"
        echo "    replay: $(replay "$s")"
    done
fi

say "determinism sample ($DET_SEEDS seeds)"
det_seeds=$(seq "$START" $((START + DET_SEEDS / 2 - 1)); for i in $(seq 1 $((DET_SEEDS - DET_SEEDS / 2))); do echo $(((START + SEEDS) * 7919 + i * 104729)); done)
for s in $det_seeds; do
    if ! MADSIM_TEST_SEED=$s MADSIM_TEST_CHECK_DETERMINISM=1 timeout "$SEED_TIMEOUT" "$BIN" main_scenario --exact >"$LOGS/det-$s.log" 2>&1; then
        echo "FAIL: determinism check, seed $s (log: $LOGS/det-$s.log); replay: MADSIM_TEST_CHECK_DETERMINISM=1 $(replay "$s")"
        FAIL=1
        continue
    fi
    a=$(MADSIM_TEST_SEED=$s "$BIN" main_scenario --exact --nocapture 2>&1 | grep -v '^test result\|finished in')
    b=$(MADSIM_TEST_SEED=$s "$BIN" main_scenario --exact --nocapture 2>&1 | grep -v '^test result\|finished in')
    if [ "$a" != "$b" ]; then
        echo "FAIL: seed $s printed different output on two runs; replay: $(replay "$s")"
        FAIL=1
        continue
    fi
    rm -f "$LOGS/det-$s.log"
    echo "seed $s: deterministic"
done

if [ "${SIM_BROKEN:-1}" != 0 ]; then
    for b in flush release session-ids; do
        say "broken build: --features broken-$b must be caught"
        BB=$(build "broken-$b")
        t=broken_${b//-/_}_is_caught
        require_tests "$BB" "$t"
        if "$BB" "$t" --exact --nocapture >"$LOGS/broken-$b.log" 2>&1 \
            && grep -q "^test result: ok. 1 passed" "$LOGS/broken-$b.log"; then
            grep -m1 "caught by seed" "$LOGS/broken-$b.log"
        else
            echo "FAIL: broken-$b was NOT caught (log: $LOGS/broken-$b.log)"
            FAIL=1
        fi
    done
fi

if [ "$FAIL" != 0 ]; then
    say "SIMULATION FAILED"
    exit 1
fi
say "simulation OK"
