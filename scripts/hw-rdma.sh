#!/usr/bin/env bash
# Runs the verbs-backend tests that need a real RDMA device (the `verbs_hw_*`
# tests of src/transport/verbs/device.rs, #[ignore]d everywhere else), then
# the main job over verbs: `kvferry pd --transport verbs` on 20 requests.
# None of our machines (CI, developers', the H200 box) has an RDMA device, so
# this script has never been run by CI; it is for a machine that has one.
#
#   scripts/hw-rdma.sh                    device mlx5_0, port 1, GID index 0
#   KVFERRY_RDMA_DEVICE=mlx5_1 KVFERRY_RDMA_PORT=1 KVFERRY_RDMA_GID_INDEX=3 scripts/hw-rdma.sh
#
# Prerequisites
#   build:   cmake, libclang (Debian: apt-get install -y cmake libclang1-14
#            libclang-common-14-dev); no libibverbs-dev is needed (sideway's
#            rdma-mummy-sys loads libibverbs.so.1 at run time).
#   run:     libibverbs1 + ibverbs-providers (Debian), the kernel's ib_uverbs
#            and the NIC driver (mlx5_ib, …) loaded, an ACTIVE port
#            (`ibv_devinfo -d $KVFERRY_RDMA_DEVICE`), and a locked-memory
#            limit large enough to register the test pools (`ulimit -l
#            unlimited`, or run as root).
#   RoCE:    pick the GID index of a RoCE v2 GID with an IP address
#            (`show_gids`, or /sys/class/infiniband/DEV/ports/1/gid_attrs/types/N).
#   Soft-RoCE works too (`rdma link add rxe0 type rxe netdev eth0`, then
#            KVFERRY_RDMA_DEVICE=rxe0), where the kernel has CONFIG_RDMA_RXE.
#
# The tests connect two transports on the same device (loopback): a READ
# batch that moves bytes, a bad rkey that must fail and invalidate the
# connection, a passed deadline that must still hand back every extent, and
# an answer that matches no offer. The replay then runs 2 prefill + 2 decode
# nodes that all open the device and must verify every block.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVFERRY_RDMA_DEVICE=${KVFERRY_RDMA_DEVICE:-mlx5_0}
export KVFERRY_RDMA_PORT=${KVFERRY_RDMA_PORT:-1}
export KVFERRY_RDMA_GID_INDEX=${KVFERRY_RDMA_GID_INDEX:-0}
echo "== RDMA device ${KVFERRY_RDMA_DEVICE} port ${KVFERRY_RDMA_PORT} GID index ${KVFERRY_RDMA_GID_INDEX}"
if command -v ibv_devinfo >/dev/null 2>&1; then
  ibv_devinfo -d "$KVFERRY_RDMA_DEVICE" -i "$KVFERRY_RDMA_PORT" || true
else
  echo "(ibv_devinfo not installed: apt-get install -y ibverbs-utils to see the port state)"
fi
echo "== locked-memory limit: $(ulimit -l)"
# The device-free verbs tests first (they must pass everywhere), then the
# hardware ones, one at a time (they share the device).
cargo test --features rdma --lib transport::verbs
cargo test --features rdma --lib -- --ignored --test-threads=1 verbs_hw
# Node start-up with verbs on a device name that does not exist here:
# DeviceNotFound, listing the devices present, and nothing left running.
cargo test --features rdma --test node_transport
# The main job over verbs, when the device exists (every node opens it).
if [ -e "/sys/class/infiniband/${KVFERRY_RDMA_DEVICE}" ]; then
  echo "== kvferry pd over verbs on ${KVFERRY_RDMA_DEVICE}"
  cargo run --features rdma -- pd --transport verbs --rdma-device "$KVFERRY_RDMA_DEVICE" \
    --rdma-port "$KVFERRY_RDMA_PORT" --rdma-gid-index "$KVFERRY_RDMA_GID_INDEX" --requests 20
else
  echo "== no /sys/class/infiniband/${KVFERRY_RDMA_DEVICE}: kvferry pd --transport verbs not run"
fi
