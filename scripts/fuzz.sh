#!/usr/bin/env bash
# Coverage-guided fuzzing of kvferry's library fuzz bodies (cargo-fuzz on
# stable Rust, no sanitizer: see fuzz/README.md).
#
#   scripts/fuzz.sh TARGET [SECONDS]       one campaign (default 60 s)
#   scripts/fuzz.sh smoke [SECONDS_EACH]   every target briefly (default 20 s)
#   scripts/fuzz.sh list                   print the target names
#
# TARGET is one of: registration_queue metaserver_store tcp_frame handshake
# disk_record.
# A campaign reads fuzz/corpus/TARGET (grown in place, gitignored),
# fuzz/seeds/TARGET and fuzz/regressions/TARGET (both committed, never
# written), and stops after SECONDS of fuzzing.
#
# Exit status: 0 clean; 1 a crash (or timeout/OOM) was found: the artifact
# path and the `cargo fuzz tmin` command are printed; 2 usage, install or
# build error. `smoke` exits with the worst status of its targets and runs
# every target even after a crash.
#
# Installs cargo-fuzz 0.13.2 (by exact version, --locked) when it is missing.
# The first build of the fuzz workspace compiles the whole dependency tree
# (tonic, prost, ...) with coverage instrumentation: about 2.5 min on two
# cores; later builds only recompile kvferry.
set -uo pipefail

TARGETS=(registration_queue metaserver_store tcp_frame handshake disk_record)
CARGO_FUZZ_VERSION=0.13.2
# Per-input time limit (s): a slower input is reported as a timeout crash.
INPUT_TIMEOUT_S=10
# Memory limit of the fuzzing process (MiB): libFuzzer's default.
RSS_LIMIT_MB=2048

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

usage() {
    echo "usage: scripts/fuzz.sh TARGET [SECONDS]" >&2
    echo "       scripts/fuzz.sh smoke [SECONDS_EACH]" >&2
    echo "       scripts/fuzz.sh list" >&2
    echo "targets: ${TARGETS[*]}" >&2
    exit 2
}

is_target() {
    local t
    for t in "${TARGETS[@]}"; do [[ "$1" == "$t" ]] && return 0; done
    return 1
}

is_seconds() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

ensure_cargo_fuzz() {
    if cargo fuzz --version 2>/dev/null | grep -q " ${CARGO_FUZZ_VERSION}\$"; then
        return 0
    fi
    echo "fuzz.sh: installing cargo-fuzz ${CARGO_FUZZ_VERSION}" >&2
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked || {
        echo "fuzz.sh: cargo-fuzz install failed" >&2
        return 2
    }
}

# Prints the artifacts (crash-/leak-/timeout-/oom-/slow-unit-) of TARGET, one a line.
list_artifacts() {
    local dir="fuzz/artifacts/$1"
    [[ -d "$dir" ]] || return 0
    find "$dir" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
        -o -name 'oom-*' -o -name 'slow-unit-*' \) | sort
}

# run_one TARGET SECONDS: one campaign; returns 0 / 1 / 2 as documented above.
run_one() {
    local target="$1" seconds="$2"
    mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
    local seeds=() d
    for d in "fuzz/seeds/$target" "fuzz/regressions/$target"; do
        [[ -d "$d" ]] && seeds+=("$ROOT/$d")
    done

    echo "== fuzz.sh: building $target" >&2
    if ! cargo fuzz build -s none "$target"; then
        echo "fuzz.sh: build of $target failed" >&2
        return 2
    fi

    local before log rc
    before="$(list_artifacts "$target")"
    log="fuzz/artifacts/$target/last-run.log"
    echo "== fuzz.sh: fuzzing $target for ${seconds}s (log: $log)" >&2
    # The first corpus dir is the only one libFuzzer writes to.
    cargo fuzz run -s none "$target" "$ROOT/fuzz/corpus/$target" "${seeds[@]}" -- \
        -max_total_time="$seconds" -timeout="$INPUT_TIMEOUT_S" -rss_limit_mb="$RSS_LIMIT_MB" \
        -print_final_stats=1 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}

    local stats execs
    stats="$(grep -E '^#[0-9]+' "$log" | tail -n 1)"
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
    echo "== fuzz.sh: $target rc=$rc executions=${execs:-?} last stats: ${stats:-none}" >&2

    local new
    new="$(comm -13 <(printf '%s\n' "$before") <(list_artifacts "$target") | sed '/^$/d')"
    if [[ -n "$new" ]]; then
        local a
        while IFS= read -r a; do
            echo "fuzz.sh: CRASH in $target: $a" >&2
            echo "  minimize: cargo fuzz tmin -s none $target $a" >&2
            echo "  then save the minimized input (fuzz/artifacts/$target/minimized-from-*) as" >&2
            echo "  fuzz/regressions/$target/<short-name> so 'cargo test' replays it" >&2
        done <<<"$new"
        return 1
    fi
    if [[ $rc -ne 0 ]]; then
        echo "fuzz.sh: $target exited $rc without an artifact (see $log)" >&2
        return 2
    fi
    return 0
}

[[ $# -ge 1 ]] || usage
case "$1" in
    -h | --help) usage ;;
    list)
        printf '%s\n' "${TARGETS[@]}"
        exit 0
        ;;
    smoke)
        [[ $# -le 2 ]] || usage
        each="${2:-20}"
        is_seconds "$each" || usage
        ensure_cargo_fuzz || exit 2
        worst=0
        summary=()
        for t in "${TARGETS[@]}"; do
            run_one "$t" "$each"
            s=$?
            summary+=("$t=$s")
            ((s > worst)) && worst=$s
        done
        echo "== fuzz.sh smoke: ${summary[*]} (0 clean, 1 crash, 2 error)" >&2
        exit "$worst"
        ;;
    *)
        [[ $# -le 2 ]] || usage
        is_target "$1" || usage
        seconds="${2:-60}"
        is_seconds "$seconds" || usage
        ensure_cargo_fuzz || exit 2
        run_one "$1" "$seconds"
        exit $?
        ;;
esac
