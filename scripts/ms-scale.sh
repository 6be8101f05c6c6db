#!/usr/bin/env bash
# MetaServer scaling with client count: for each count in CLIENTS, a fresh
# `kvferry metaserver` on loopback and one msload run (N insert clients, N
# concurrent queries); one line per (count, binary). Needs only prebuilt
# binaries, bash, coreutils and python3 (no Rust toolchain), so it runs on
# the H200 host:
#
#   KVFERRY=/path/kvferry MSLOAD=/path/msload scripts/ms-scale.sh OUT_DIR
#
# Optional:
#   KVFERRY_B=/path/other-kvferry  a second server binary (e.g. the previous
#                    commit's), run alternately with KVFERRY in every round;
#                    each line then also prints B's rate over A's
#   ARGS_A, ARGS_B   extra `kvferry metaserver` flags of each (e.g.
#                    ARGS_A="--shards 1" to measure one lock)
#   CLIENTS          client counts (default "1 2 4 8")
#   ROUNDS           alternating rounds (default 3; the median is printed)
#   SECS             seconds of each msload phase (default 5)
#   BATCH            hashes per insert RPC (default 16384)
#   QUERY_LEN        hashes per prefix query (default 64)
#   PORT             first port to use (default 50155)
#
# OUT_DIR gets each run's msload JSON and server log, and summary.txt (the
# printed lines). Exit status 1 when any msload run failed its checks.
set -euo pipefail

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -eq 1 ] || usage
OUT=$1
: "${KVFERRY:?set KVFERRY to the kvferry binary}"
: "${MSLOAD:?set MSLOAD to the msload binary}"
for b in "$KVFERRY" "$MSLOAD" ${KVFERRY_B:+"$KVFERRY_B"}; do
    [ -x "$b" ] || { echo "ms-scale: $b is not an executable file" >&2; exit 2; }
done
CLIENTS=${CLIENTS:-"1 2 4 8"}
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
BATCH=${BATCH:-16384}
QUERY_LEN=${QUERY_LEN:-64}
PORT=${PORT:-50155}
mkdir -p "$OUT"

# shellcheck source=scripts/ms-lib.sh
. "$(dirname "$0")/ms-lib.sh"

# run_one LABEL BINARY ARGS CLIENTS ROUND: one fresh server, one msload run.
run_one() {
    local label=$1 bin=$2 args=$3 n=$4 round=$5
    local port=$PORT
    PORT=$((PORT + 1))
    local base="$OUT/c${n}-${label}-r${round}"
    # shellcheck disable=SC2086
    "$bin" metaserver --addr "127.0.0.1:$port" $args >"$base.server.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 100); do
        grep -qs "metaserver ready" "$base.server.log" && break
        kill -0 "$server_pid" 2>/dev/null || { echo "ms-scale: server $label exited:" >&2; cat "$base.server.log" >&2; exit 1; }
        sleep 0.1
    done
    grep -qs "metaserver ready" "$base.server.log" || { echo "ms-scale: server $label not ready" >&2; exit 1; }
    "$MSLOAD" --addr "127.0.0.1:$port" --secs "$SECS" --clients "$n" --concurrency "$n" \
        --batch "$BATCH" --query-len "$QUERY_LEN" >"$base.json" 2>"$base.err" || true
    stop_server
}

for n in $CLIENTS; do
    for r in $(seq 1 "$ROUNDS"); do
        run_one A "$KVFERRY" "${ARGS_A:-}" "$n" "$r"
        if [ -n "${KVFERRY_B:-}" ]; then
            run_one B "$KVFERRY_B" "${ARGS_B:-}" "$n" "$r"
        fi
    done
done

python3 - "$OUT" "$CLIENTS" "$ROUNDS" "${KVFERRY_B:+B}" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys, os
out, clients, rounds, has_b = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4] == "B"
labels = ["A", "B"] if has_b else ["A"]
failed = False

def load(n, label):
    runs = []
    for r in range(1, rounds + 1):
        p = os.path.join(out, f"c{n}-{label}-r{r}.json")
        try:
            with open(p) as f:
                j = json.loads(f.read().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            j = {"ok": False}
        runs.append(j)
    return runs

def med(runs, phase, key):
    v = [j[phase][key] for j in runs if phase in j and key in j[phase]]
    return round(statistics.median(v), 3) if v else float("nan")

base = {}
for n in clients:
    for label in labels:
        runs = load(n, label)
        ok = all(j.get("ok") for j in runs)
        failed |= not ok
        ins, qps = med(runs, "insert", "hashes_per_s"), med(runs, "query", "qps")
        hashes = med(runs, "insert", "hashes")
        line = (f"clients={n} bin={label} inserts/s={ins:.0f} stored={hashes:.0f} insert_p50_ms={med(runs, 'insert', 'rpc_p50_ms')} "
                f"insert_p99_ms={med(runs, 'insert', 'rpc_p99_ms')} queries/s={qps:.0f} "
                f"query_p50_ms={med(runs, 'query', 'p50_ms')} query_p99_ms={med(runs, 'query', 'p99_ms')} "
                f"rounds={rounds} ok={ok}")
        if n == clients[0]:
            base[label] = (ins, qps)
        b1 = base.get(label)
        if b1 and b1[0] and b1[1]:
            line += f" inserts_vs_{clients[0]}={ins / b1[0]:.2f} queries_vs_{clients[0]}={qps / b1[1]:.2f}"
        if label == "B":
            a = load(n, "A")
            ia, qa = med(a, "insert", "hashes_per_s"), med(a, "query", "qps")
            line += f" B/A_inserts={ins / ia:.2f} B/A_queries={qps / qa:.2f}"
        print(line)
sys.exit(1 if failed else 0)
PY
