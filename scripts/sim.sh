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
# 4. every starred contract (C1 C2 C4 C6 C8 C9 C10 C11 C15 C16 C17 C18 C19) has
#    invariants that checked at least one case over the sweep (the per-seed
#    `checks=` counts, summed); a starred invariant that checked nothing
#    fails the sweep, so the suite cannot pass vacuously; likewise issue
#    29's reach counters (SIM-SUMMARY `c8_partial_read_errors`,
#    `c9_deadline_fetches`, `c9_connects_deadline` (a `connect_peer` that
#    ended on its timeout), `c13_expired_reads`, `c15_busy_refusals`, and
#    issue 28's `c19_device_reads`, `c9_known_owner_fetches` (a
#    fetch started from the decode's own MetaServer answer) and
#    `c8_ticket_fetches` (one that read from the prefill's transfer
#    ticket), issue 32's
#    `c17_disk_staged`, `c18_disk_recovered`, `c18_peer_disk_staged`,
#    `disk_verify_failures`, and the reads served from a write's buffer,
#    `disk_queue_reads` and `disk_after_write_reads`: the
#    paths its four bug classes live on) must each be non-zero over the
#    sweep, and the seeds with a deadline-bound fetch are counted;
# 5. canaries (skip with SIM_BROKEN=0): the `--features canaries` build is
#    built once and every `broken_<canary>_is_caught` test runs (each switches
#    one deliberate breakage of one contract on, src/canary.rs, sweeps at
#    most 50 seeds in-process and passes only if an invariant named for that
#    contract fired). Prints the canary table: contract, canary, first catching seed.
#
# Env: SIM_SEED_START (default 0), DET_SEEDS, SIM_BROKEN, SIM_SEED_TIMEOUT_S
# (wall-clock limit per seed process, default 120), SIM_TARGET_DIR (the
# madsim target dir, default target-sim; e.g. a shared one), SIM_LOGS (where
# logs and the summary go, default $SIM_TARGET_DIR/sim-logs: give each
# concurrent sweep over a shared target dir its own).
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

SEEDS=${1:-500}
JOBS=${2:-2}
START=${SIM_SEED_START:-0}
DET_SEEDS=${DET_SEEDS:-6}
SEED_TIMEOUT=${SIM_SEED_TIMEOUT_S:-120}
export CARGO_TARGET_DIR=${SIM_TARGET_DIR:-target-sim}
# Prepend, never replace: an inherited RUSTFLAGS would otherwise drop the cfg.
export RUSTFLAGS="--cfg madsim ${RUSTFLAGS:-}"
LOGS=${SIM_LOGS:-$CARGO_TARGET_DIR/sim-logs}
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
        } else if (kv[1] == "c9_overrun_max_us") {
            if (kv[2] > tot[kv[1]]) tot[kv[1]] = kv[2]
        } else if (kv[1] == "done" || kv[1] == "lost" || kv[1] == "reused" || kv[1] == "saved" || kv[1] == "fetched" || kv[1] == "verified" || kv[1] == "recomputed" || kv[1] ~ /^corrupt_/ || kv[1] == "checksum_rejected" || kv[1] == "poisoned_frees" || kv[1] ~ /^c[0-9]+_/ || kv[1] ~ /^disk_/) {
            tot[kv[1]] += kv[2]
            if (kv[1] == "c9_deadline_fetches" && kv[2] > 0) tot["seeds_with_c9_deadline_fetch"]++
        } else if (kv[1] == "repair_restart" && kv[2] == "true") { tot["repair_restart"]++ }
        else if (kv[1] == "probe" && kv[2] == "true") { tot["probe_conclusive"]++ }
    } }
    END {
        printf "totals:"; for (k in tot) printf " %s=%d", k, tot[k]; printf "\n"
        for (k in sum) printf "  %-60s %d\n", k, sum[k]
    }' "$SUMMARY" | sort | tee "$LOGS/totals.txt"
# Starred contracts and the invariants named for them: each must have
# checked at least one case over the sweep.
STARRED="C1:inv_flush_visibility C2:inv_flush_terminates C4:inv_accounting C4:inv_index_matches_engine
C6:inv_index_converges C8:inv_pins_exact C8:inv_no_lock_leak_eventual C8:inv_no_lock_leak_prompt
C9:inv_degrade_bounded C9:inv_fetch_progress C10:inv_corruption_rejected C10:inv_fetch_integrity
C11:inv_no_early_free_pool C11:inv_no_early_free_lease C11:inv_no_early_free_load
C11:inv_no_early_free_checksum C11:inv_no_early_free_resident C15:inv_embedder_memory
C16:inv_session_ids_unique C8:inv_lock_released_once C8:inv_no_lock_expiry_after_fetch
C16:inv_no_read_after_expiry C15:inv_no_access_after_unregister
C19:inv_device_read_under_lease C19:inv_lease_ends_once
C17:inv_disk_staged_verified C18:inv_disk_recovery_verified"
if [ "$passed" -gt 0 ]; then
    for ci in $STARRED; do
        inv=${ci#*:}
        n=$(awk -v k="$inv" '$1 == "checks" && $2 == k { print $3 }' "$LOGS/totals.txt")
        if [ -z "$n" ] || [ "$n" -eq 0 ]; then
            echo "FAIL: ${ci%%:*} invariant $inv checked 0 cases over the sweep (vacuous pass)"
            FAIL=1
        fi
    done
    # Issue 29: the path each of its bug classes lives on was reached.
    for ck in C8:c8_partial_read_errors C9:c9_deadline_fetches C9:c9_connects_deadline C13:c13_expired_reads C15:c15_busy_refusals C19:c19_device_reads C9:c9_known_owner_fetches C8:c8_ticket_fetches \
        C17:c17_disk_staged C18:c18_disk_recovered C18:c18_peer_disk_staged C17:disk_verify_failures \
        C17:disk_queue_reads C17:disk_after_write_reads; do
        k=${ck#*:}
        n=$(grep -o " $k=[0-9]*" "$LOGS/totals.txt" | cut -d= -f2)
        if [ -z "$n" ] || [ "$n" -eq 0 ]; then
            echo "FAIL: ${ck%%:*} reach counter $k is 0 over the sweep (the workload never reached that path)"
            FAIL=1
        fi
    done
    with=$(grep -o " seeds_with_c9_deadline_fetch=[0-9]*" "$LOGS/totals.txt" | cut -d= -f2)
    echo "C9: ${with:-0} of $passed seeds had a fetch end on its deadline"
fi
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
    say "canaries: --features canaries, every broken_*_is_caught test"
    CB=$(build canaries)
    canaries=$("$CB" --list 2>/dev/null | grep -o '^broken_[a-z0-9]*_is_caught' || true)
    require_tests "$CB" $canaries
    n_canaries=$(printf '%s\n' $canaries | grep -c . || true)
    if [ "$n_canaries" -lt 16 ]; then
        echo "FAIL: the canary build lists $n_canaries canary tests, expected one per starred contract"
        FAIL=1
    fi
    if ! "$CB" broken_ --test-threads="$JOBS" --nocapture >"$LOGS/canaries.log" 2>&1; then
        grep -E '^test .*FAILED|NOT caught|panicked' "$LOGS/canaries.log" || true
        echo "FAIL: a canary was NOT caught (log: $LOGS/canaries.log)"
        FAIL=1
    fi
    say "canary table (contract, canary, first catching seed, invariant)"
    grep '^CANARY' "$LOGS/canaries.log" \
        | awk '{ printf "  %-4s %-22s seed %-3s %s\n", $2, $3, $7, $8 }' | sort -V
fi

if [ "$FAIL" != 0 ]; then
    say "SIMULATION FAILED"
    exit 1
fi
say "simulation OK"
