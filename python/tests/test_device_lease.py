"""Device leases: a decode node in the same process copies leased blocks
straight from the owner's cache (the host backend's in-process kind of the
device-direct path; CUDA IPC runs the same engine code on a GPU)."""

import time

import numpy as np
import pytest

import kvferry
from conftest import BT, paged, prefill_pair, tokens


def test_leased_blocks_are_copied_cache_to_cache_and_the_lease_ends_released(metaserver, ns):
    p = kvferry.Node(metaserver.address, pool_bytes=16 << 20)
    d = kvferry.Node(metaserver.address, pool_bytes=16 << 20)
    with p, d:
        pk, pv, dk, dv, hs = prefill_pair(p, d, ns, 4, seed=11)
        lease = p.grant_device_lease(ns, hs, [0, 1, 2, 3], ttl=30)
        assert len(lease) == 32
        f, lrep = d.fetch_into(ns, hs, [4, 5, 6, 7])
        assert (f.available, lrep.loaded) == (4, 4)
        for src, dst in zip(pk + pv, dk + dv):
            np.testing.assert_array_equal(dst[4:8], src[:4])
        m = d.metrics()
        assert m["path_ipc_blocks"] == 4 and m["path_ipc_fallbacks"] == 0
        assert m["fetched_bytes"] == 0, "nothing went through the pool"
        ended = []
        for _ in range(200):
            ended += p.ended_device_leases()
            if ended:
                break
            time.sleep(0.01)
        assert ended == [(lease, ns, [0, 1, 2, 3], "released")]
        assert p.ended_device_leases() == []
        assert not p.end_device_lease(lease)


def test_bad_lease_requests_raise_clear_errors(metaserver, ns):
    with kvferry.Node(metaserver.address, pool_bytes=16 << 20) as p:
        p.register_kv_cache(ns, *paged(seed=12))
        hs = kvferry.block_hashes(ns, tokens(2 * BT), BT)
        with pytest.raises(kvferry.ConfigError):
            p.grant_device_lease(ns, hs, [0, 1], ttl=0)
        with pytest.raises(kvferry.ConfigError):
            p.grant_device_lease(ns, hs, [0, 0], ttl=1)
        with pytest.raises(kvferry.BlockIndexError):
            p.grant_device_lease(ns, hs, [0, 99], ttl=1)
        with pytest.raises(kvferry.UnknownNamespaceError):
            p.grant_device_lease("nope", hs, [0, 1], ttl=1)
        with pytest.raises(kvferry.ConfigError):
            p.end_device_lease("not-hex")
        lease = p.grant_device_lease(ns, hs, [0, 1], ttl=30)
        assert p.end_device_lease(lease)
        assert [(i, how) for i, _, _, how in p.ended_device_leases()] == [(lease, "revoked")]
