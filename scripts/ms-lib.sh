# Shared by ms-scale.sh and ms-peer.sh (sourced, not run): the one server
# a run starts, stopped at the end of the run and on any exit.
server_pid=
stop_server() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=
    fi
}
trap stop_server EXIT
