#!/usr/bin/env bash
# kvferry's MetaServer side by side with a peer MetaServer of the same wire
# protocol (e.g. `pegaflow-metaserver`) under the same msload load: per
# round a fresh peer, then a fresh `kvferry metaserver` (and a second
# kvferry binary if given), each driven by one msload run; one summary line
# per run and, per round, kvferry's query p99 over the peer's. Needs only
# prebuilt binaries, bash, coreutils and python3 (no Rust toolchain), so it
# runs on the H200 host too:
#
#   PEER=/path/pegaflow-metaserver-py KVFERRY=/path/kvferry MSLOAD=/path/msload \
#       scripts/ms-peer.sh OUT_DIR
#
# The peer is started as `$PEER --addr 127.0.0.1:P --http-addr 127.0.0.1:P+1
# --log-level warn` (the flags of PyPI `pegaflow-llm`'s binary).
# Optional:
#   KVFERRY_B=/path/other-kvferry  a second kvferry (e.g. the previous commit's)
#   ROUNDS       alternating rounds (default 3)
#   SECS         seconds of each msload phase (default 10)
#   CLIENTS      insert clients (default 4)
#   CONCURRENCY  concurrent prefix queries (default 16)
#   BATCH        hashes per insert RPC (default 16384)
#   QUERY_LEN    hashes per prefix query (default 64)
#   PORT         first port to use (default 50255; two per run)
#
# OUT_DIR gets each run's msload JSON and server log, and summary.txt.
set -euo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -eq 1 ] || usage
OUT=$1
: "${PEER:?set PEER to the peer MetaServer binary}"
: "${KVFERRY:?set KVFERRY to the kvferry binary}"
: "${MSLOAD:?set MSLOAD to the msload binary}"
for b in "$PEER" "$KVFERRY" "$MSLOAD" ${KVFERRY_B:+"$KVFERRY_B"}; do
    [ -x "$b" ] || { echo "ms-peer: $b is not an executable file" >&2; exit 2; }
done
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-10}
CLIENTS=${CLIENTS:-4}
CONCURRENCY=${CONCURRENCY:-16}
BATCH=${BATCH:-16384}
QUERY_LEN=${QUERY_LEN:-64}
PORT=${PORT:-50255}
mkdir -p "$OUT"

# shellcheck source=scripts/ms-lib.sh
. "$(dirname "$0")/ms-lib.sh"

# wait_port PORT: until something accepts on 127.0.0.1:PORT (10 s at most).
wait_port() {
    for _ in $(seq 1 100); do
        kill -0 "$server_pid" 2>/dev/null || return 1
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# run_one LABEL ROUND: one fresh server of LABEL (peer, A or B), one msload run.
run_one() {
    local label=$1 round=$2 port=$PORT
    PORT=$((PORT + 2))
    local base="$OUT/${label}-r${round}"
    case $label in
        peer) "$PEER" --addr "127.0.0.1:$port" --http-addr "127.0.0.1:$((port + 1))" --log-level warn \
                  >"$base.server.log" 2>&1 & ;;
        A) "$KVFERRY" metaserver --addr "127.0.0.1:$port" >"$base.server.log" 2>&1 & ;;
        B) "$KVFERRY_B" metaserver --addr "127.0.0.1:$port" >"$base.server.log" 2>&1 & ;;
    esac
    server_pid=$!
    wait_port "$port" || { echo "ms-peer: server $label did not come up:" >&2; cat "$base.server.log" >&2; exit 1; }
    "$MSLOAD" --addr "127.0.0.1:$port" --secs "$SECS" --clients "$CLIENTS" --concurrency "$CONCURRENCY" \
        --batch "$BATCH" --query-len "$QUERY_LEN" >"$base.json" 2>"$base.err" || true
    stop_server
}

for r in $(seq 1 "$ROUNDS"); do
    run_one peer "$r"
    run_one A "$r"
    if [ -n "${KVFERRY_B:-}" ]; then
        run_one B "$r"
    fi
done

python3 - "$OUT" "$ROUNDS" "${KVFERRY_B:+B}" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out, rounds, has_b = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "B"
labels = ["peer", "A"] + (["B"] if has_b else [])
bad = False
print("run        inserts/s  ins p50/p99 ms    queries/s  query p50/p99/p999 ms   checks  query p99 / peer's")
for r in range(1, rounds + 1):
    p99 = {}
    for l in labels:
        path = os.path.join(out, f"{l}-r{r}.json")
        try:
            d = json.load(open(path))
        except (OSError, ValueError):
            print(f"{l}-r{r}: no msload JSON (see {l}-r{r}.err)")
            bad = True
            continue
        i, q = d.get("insert", {}), d.get("query", {})
        p99[l] = q.get("p99_ms", 0.0)
        ok = "ok" if d.get("ok") else f"{d.get('mismatches', '?')} mismatches"
        bad |= l != "peer" and not d.get("ok")
        ratio = "" if l == "peer" or not p99.get("peer") else f"{p99[l] / p99['peer']:.2f}"
        print(f"{l + '-r' + str(r):<9} {i.get('hashes_per_s', 0) / 1e6:>8.2f} M  "
              f"{i.get('rpc_p50_ms', 0):>6.1f} / {i.get('rpc_p99_ms', 0):<8.1f} "
              f"{q.get('qps', 0):>9}  {q.get('p50_ms', 0):>5.2f} / {q.get('p99_ms', 0):.2f} / {q.get('p999_ms', 0):<6.2f} "
              f"{ok:>8}  {ratio}")
sys.exit(1 if bad else 0)
PY
