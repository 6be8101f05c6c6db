#!/usr/bin/env bash
# The module layers, bottom to top; a module may import only from layers
# below it (or its own). Fails, naming the file and line, when an import
# runs upward. Comments and doc links are not imports.
#
#   0  types, limits, proto, rt,       ids, bounds, generated messages, runtime glue,
#      canary, tls                     the canary seam, TLS settings
#   1  memory                            the pinned pool, the device-buffer registry
#   2  gpu, transport, hash              the two doors and their backends; the block hash
#   3  client, metaserver                the registration queue and the index
#   4  engine                            layouts, cache, locks, save/load, fetch
#   5  p2p, node                         the transfer service; a whole node
#   6  replay, bench, exporter, logging  the binary's jobs
set -euo pipefail
cd "$(dirname "$0")/.."
bad=0
# forbid PATHS... -- MODULES...: no non-comment line of PATHS names crate::MODULE.
forbid() {
    local paths=() mods=()
    while [ "$1" != "--" ]; do paths+=("$1"); shift; done
    shift
    mods=("$@")
    local re
    re="crate::($(IFS='|'; echo "${mods[*]}"))\b"
    if grep -rnE "$re" "${paths[@]}" | grep -vE '^[^:]+:[0-9]+:\s*//' ; then
        echo "layers: the lines above import upward (${paths[*]} must not use ${mods[*]})" >&2
        bad=1
    fi
}
above_1=(gpu transport hash client metaserver engine p2p node replay bench exporter logging)
above_2=(client metaserver engine p2p node replay bench exporter logging)
above_4=(p2p node replay bench exporter logging)
forbid src/types.rs src/limits.rs src/canary.rs src/tls.rs -- memory "${above_1[@]}"
forbid src/memory -- "${above_1[@]}"
forbid src/gpu src/transport src/hash.rs -- "${above_2[@]}"
forbid src/client src/metaserver -- engine "${above_4[@]}"
forbid src/engine -- "${above_4[@]}"
if [ "$bad" = 0 ]; then
    echo "layers: no upward imports"
fi
exit "$bad"
