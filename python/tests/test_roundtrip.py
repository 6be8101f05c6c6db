"""save → flush → fetch → load with numpy on the host backend."""

import time

import numpy as np
import pytest

import kvferry
from conftest import BT, LAYERS, SHAPE, paged, prefill_pair, tokens


def two_nodes(ms, **kw):
    return kvferry.Node(ms.address, pool_bytes=16 << 20, **kw), kvferry.Node(ms.address, pool_bytes=16 << 20, **kw)


def test_local_save_then_load_restores_the_bytes(metaserver, ns):
    with kvferry.Node(metaserver.address, pool_bytes=16 << 20) as node:
        k, v = paged(seed=1)
        node.register_kv_cache(ns, k, v)
        hs = kvferry.block_hashes(ns, tokens(3 * BT), BT)
        want = [x[[2, 0, 5]].copy() for x in k + v]
        rep = node.save(ns, hs, [2, 0, 5])
        assert (rep.saved, rep.already_resident, rep.no_space) == (3, 0, 0)
        assert node.query_prefix(ns, hs) == 3
        for x in k + v:
            x[:] = 0
        lrep = node.load(ns, hs, [1, 3, 4])
        assert lrep.ok and lrep.loaded == 3
        for x, w in zip(k + v, want):
            np.testing.assert_array_equal(x[[1, 3, 4]], w)
        assert node.save(ns, hs, [2, 0, 5]).already_resident == 3


def test_fetch_from_a_peer_then_load_is_bit_identical(metaserver, ns):
    p, d = two_nodes(metaserver)
    with p, d:
        pk, pv = paged(seed=2)
        dk, dv = paged(fill=0.0)
        p.register_kv_cache(ns, pk, pv)
        d.register_kv_cache(ns, dk, dv)
        hs = kvferry.block_hashes(ns, tokens(5 * BT + 3), BT)
        assert len(hs) == 5
        p.save(ns, hs, [0, 1, 2, 3, 4])
        flush = p.flush_saves_and_registrations(timeout=5)
        assert flush.ok and flush.delivered >= 5
        owners = d.query_prefix_remote(ns, hs)
        assert owners == [kvferry.PrefixOwner(p.address, 5)]
        f, l = d.fetch_into(ns, hs, [7, 6, 5, 4, 3])
        assert (f.requested, f.available, f.fetched, f.stopped) == (5, 5, 5, None)
        assert f.bytes == 5 * d.kv_cache(ns).block_bytes
        assert f.owners == [p.address]
        assert str(f).startswith("5 of 5 blocks")
        # Where the fetch's time went: every phase named, the data moved
        # in `read` under the transfer lock taken in `lock`.
        assert list(f.phases_ms) == [
            "stage", "query", "handshake", "lock", "read", "verify", "seal", "release", "load_tail",
        ]
        assert all(v >= 0.0 for v in f.phases_ms.values())
        assert f.phases_ms["read"] > 0.0 and f.phases_ms["lock"] > 0.0
        assert l.loaded == 5
        for src, dst in zip(pk + pv, dk + dv):
            np.testing.assert_array_equal(dst[[7, 6, 5, 4, 3]], src[:5])
        m = d.metrics()
        assert m["fetched_blocks"] == 5 and m["fetched_bytes"] == f.bytes and m["loaded_blocks"] == 5
        # Fetched blocks are registered as owned by d too.
        assert d.flush_saves_and_registrations(timeout=5).ok


def test_fetch_into_starts_from_the_owners_the_caller_asked_for(metaserver, ns):
    p, d = two_nodes(metaserver)
    with p, d:
        pk, pv, dk, dv, hs = prefill_pair(p, d, ns, 3, seed=4)
        owners = d.query_prefix_remote(ns, hs)
        for bad, named in [
            ([(p.address, 3)], r"owners\[0\]"),
            (p.address, "owners must"),
            (5, "owners must"),
            ([kvferry.PrefixOwner(p.address, -1)], r"owners\[0\]\.blocks = -1"),
            ([owners[0], kvferry.PrefixOwner(p.address, 2**32)], r"owners\[1\]\.blocks"),
            ([kvferry.PrefixOwner(7, 3)], r"owners\[0\]"),
        ]:
            with pytest.raises(kvferry.ConfigError, match=named):
                d.fetch_into(ns, hs, [0, 1, 2], owners=bad)
        assert d.metrics()["fetches"] == 0, "refused before anything was fetched"
        # Any iterable of PrefixOwner (a generator is read once).
        f, l = d.fetch_into(ns, hs, [5, 6, 7], owners=(o for o in owners))
        assert (f.available, f.owners, l.loaded) == (3, [p.address], 3)
        # The caller's answer stood in for the fetch's own MetaServer query.
        assert f.phases_ms["query"] == 0.0
        assert d.metrics()["fetch_known_owners"] == 1
        for src, dst in zip(pk + pv, dk + dv):
            np.testing.assert_array_equal(dst[[5, 6, 7]], src[:3])


def test_fetch_into_reads_from_the_prefills_transfer_ticket(metaserver, ns):
    p, d = two_nodes(metaserver)
    with p, d:
        pk, pv, dk, dv, hs = prefill_pair(p, d, ns, 3, seed=6)
        ask = d.transfer_ask()
        assert ask.requester == d.address
        ticket = p.grant_transfer(ns, hs, ask)
        assert isinstance(ticket, bytes) and ticket
        with pytest.raises(kvferry.ConfigError, match="not both"):
            d.fetch_into(ns, hs, [0, 1, 2], owners=d.query_prefix_remote(ns, hs), ticket=ticket)
        with pytest.raises(kvferry.ConfigError) as e:
            d.fetch_into(ns, hs, [0, 1, 2], ticket=b"not a ticket")
        assert e.value.code == "ticket_decode"
        with pytest.raises(kvferry.ConfigError, match="TransferAsk"):
            p.grant_transfer(ns, hs, d.address)
        assert d.metrics()["fetches"] == 0, "refused before anything was fetched"
        created = p.metrics()["transfer_locks_created"]
        f, l = d.fetch_into(ns, hs, [4, 5, 6], ticket=ticket)
        assert (f.available, f.owners, l.loaded) == (3, [p.address], 3)
        # No MetaServer query and no lock request: the ticket's lock was the one.
        assert f.phases_ms["query"] == 0.0
        assert p.metrics()["transfer_locks_created"] == created
        assert d.metrics()["fetch_tickets"] == 1
        for src, dst in zip(pk + pv, dk + dv):
            np.testing.assert_array_equal(dst[[4, 5, 6]], src[:3])
        # The reader released the ticket's lock (its release runs on a task
        # of its own: a moment, far below the lock timeout).
        deadline = time.monotonic() + 2.0
        while p.metrics()["active_transfer_locks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.metrics()["active_transfer_locks"] == 0
        assert p.metrics()["transfer_locks_expired"] == 0
        # A ticket that will not reach its reader: its owner ends it.
        unsent = p.grant_transfer(ns, hs, ask)
        assert p.metrics()["active_transfer_locks"] == 1
        assert p.release_ticket(unsent) == 3
        assert p.release_ticket(unsent) == 0, "idempotent"
        assert p.metrics()["active_transfer_locks"] == 0
        with pytest.raises(kvferry.ConfigError, match="not this node"):
            d.release_ticket(unsent)
        # A ticket for another node is released unread; the fetch goes on.
        other = p.grant_transfer(ns, hs, kvferry.TransferAsk("127.0.0.1:9"))
        f, l = d.fetch_into(ns, hs, [4, 5, 6], ticket=other)
        assert (f.available, l.loaded) == (3, 3)
        assert d.metrics()["fetch_tickets_unused"] == 1


def test_connect_peer_opens_the_same_host_pool_before_the_first_fetch(metaserver, ns):
    p, d = two_nodes(metaserver)
    with p, d:
        pk, pv, dk, dv, hs = prefill_pair(p, d, ns, 4, seed=3)
        # Same host, shared pool: opened now, so the very first fetch copies
        # every block from the peer's pool straight into d's cache.
        assert d.connect_peer(p.address, timeout=10) == "ready"
        f, l = d.fetch_into(ns, hs, [4, 5, 6, 7])
        assert (f.available, l.loaded) == (4, 4)
        for src, dst in zip(pk + pv, dk + dv):
            np.testing.assert_array_equal(dst[[4, 5, 6, 7]], src[:4])
        m = d.metrics()
        assert m["path_shm_direct_blocks"] == 4 and m["fetched_blocks"] == 0
        # The shared pool's path counts its one-step copies (as pd does).
        assert (m["path_shm_blocks"], m["path_tcp_blocks"]) == (4, 0)
        # Nothing listens there: tried again until the timeout, then a
        # DeadlineError that names the peer.
        t0 = time.monotonic()
        with pytest.raises(kvferry.DeadlineError, match="127.0.0.1:1.*last try"):
            d.connect_peer("127.0.0.1:1", timeout=2)
        assert 1.9 <= time.monotonic() - t0 < 3
        for bad in [-1, 0, float("nan"), "5", None, True]:
            with pytest.raises(kvferry.ConfigError, match="timeout"):
                d.connect_peer(p.address, timeout=bad)
        for bad in ["", "127.0.0.1", "127.0.0.1:99999", "http://" + p.address, None]:
            with pytest.raises(kvferry.ConfigError, match="addr"):
                d.connect_peer(bad)


def test_partial_prefix_is_k_of_n(metaserver, ns):
    p, d = two_nodes(metaserver)
    with p, d:
        pk, pv = paged(seed=3)
        p.register_kv_cache(ns, pk, pv)
        d.register_kv_cache(ns, *paged(fill=0.0))
        hs = kvferry.block_hashes(ns, tokens(4 * BT), BT)
        p.save(ns, hs[:2], [0, 1])
        assert p.flush_saves_and_registrations(timeout=5).ok
        f = d.fetch(ns, hs)
        assert (f.requested, f.available, f.fetched) == (4, 2, 2)
        assert f.stopped_code == "fetch_no_owner"
        assert not f.complete
        lrep = d.load(ns, hs, [0, 1, 2, 3])
        assert lrep.loaded == 2
        assert [(i, c) for i, _, c in lrep.failed] == [(2, "load_not_resident"), (3, "load_not_resident")]


def test_save_releases_the_gil(metaserver, ns):
    # Another Python thread runs while a node waits on the barrier.
    import threading

    with kvferry.Node(metaserver.address) as node:
        ticks = []
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.001)

        t = threading.Thread(target=tick)
        t.start()
        node.flush_saves_and_registrations(timeout=1)
        k, v = paged()
        node.register_kv_cache(ns, k, v)
        node.save(ns, kvferry.block_hashes(ns, tokens(8 * BT), BT), list(range(8)))
        stop.set()
        t.join()
        assert ticks


@pytest.mark.parametrize("arrangement", ["kv-axis-first", "kv-axis-inside-block"])
def test_k_and_v_in_one_allocation(metaserver, ns, arrangement):
    # [2, num_blocks, ...] per layer, and [num_blocks, 2, ...] (K and V
    # interleaved per block): one registered buffer, K and V at offsets.
    # The pool format depends only on the family, so a peer with separate
    # K and V tensors exchanges blocks with it.
    shape = (8, BT, 2, 16)
    rng = np.random.default_rng(9)
    if arrangement == "kv-axis-first":
        whole = [rng.standard_normal((2,) + shape).astype(np.float32) for _ in range(2)]
        k, v = [w[0] for w in whole], [w[1] for w in whole]
    else:
        whole = [rng.standard_normal((shape[0], 2) + shape[1:]).astype(np.float32) for _ in range(2)]
        k, v = [w[:, 0] for w in whole], [w[:, 1] for w in whole]
    p, d = two_nodes(metaserver)
    with p, d:
        info = p.register_kv_cache(ns, k, v)
        if arrangement == "kv-axis-inside-block":
            assert info.block_stride == 2 * info.bytes_per_block
            assert info.buffers == 2  # K and V overlap: one buffer per layer
        else:
            # K and V only touch, and the host backend cannot see numpy's
            # allocations: separate buffers (issue 30).
            assert info.buffers == 4
        dk, dv = paged(fill=0.0)
        d.register_kv_cache(ns, dk, dv)
        hs = kvferry.block_hashes(ns, tokens(3 * BT), BT)
        p.save(ns, hs, [5, 6, 7])
        assert p.flush_saves_and_registrations(timeout=5).ok
        f, l = d.fetch_into(ns, hs, [0, 1, 2])
        assert f.available == 3 and l.loaded == 3
        for src, dst in zip(k + v, dk + dv):
            np.testing.assert_array_equal(dst[:3], src[5:8])


def test_unregister_kv_cache_then_register_again(metaserver, ns):
    with kvferry.Node(metaserver.address) as node:
        k, v = paged(seed=5)
        node.register_kv_cache(ns, k, v)
        hs = kvferry.block_hashes(ns, tokens(2 * BT), BT)
        node.save(ns, hs, [0, 1])
        node.unregister_kv_cache(ns)
        with pytest.raises(kvferry.UnknownNamespaceError):
            node.load(ns, hs, [0, 1])
        # A new cache of the same shape: the pooled blocks load into it.
        k2, v2 = paged(fill=0.0)
        node.register_kv_cache(ns, k2, v2)
        assert node.load(ns, hs, [3, 4]).loaded == 2
        for a, b in zip(k + v, k2 + v2):
            np.testing.assert_array_equal(b[3:5], a[0:2])


def test_per_layer_tensors_back_to_back(metaserver, ns):
    # Issue 30: an engine's per-layer K and V tensors that its allocator
    # placed back to back (here: consecutive slices of one numpy array, so
    # each ends where the next starts). Registration must not merge them into
    # one buffer unless the backend places them in one allocation (on CUDA,
    # separate torch allocations are refused as one buffer); the host backend
    # cannot tell, so each tensor is a buffer of its own, and the round trip
    # works.
    n = SHAPE[0]
    rng = np.random.default_rng(3)
    whole = rng.standard_normal((2 * LAYERS * n,) + SHAPE[1:]).astype(np.float32)
    parts = [whole[i * n : (i + 1) * n] for i in range(2 * LAYERS)]
    k, v = parts[0::2], parts[1::2]
    for a, b in zip(parts, parts[1:]):
        assert a.__array_interface__["data"][0] + a.nbytes == b.__array_interface__["data"][0]
    p, d = two_nodes(metaserver)
    with p, d:
        info = p.register_kv_cache(ns, k, v)
        assert info.buffers == 2 * LAYERS
        dk, dv = paged(fill=0.0)
        d.register_kv_cache(ns, dk, dv)
        hs = kvferry.block_hashes(ns, tokens(3 * BT), BT)
        assert p.save(ns, hs, [1, 4, 7]).saved == 3
        assert p.flush_saves_and_registrations(timeout=5).ok
        f, l = d.fetch_into(ns, hs, [0, 1, 2])
        assert f.available == 3 and l.loaded == 3
        for src, dst in zip(k + v, dk + dv):
            np.testing.assert_array_equal(dst[:3], src[[1, 4, 7]])
        # The same tensors again are the same registration.
        assert p.register_kv_cache(ns, k, v) == info
