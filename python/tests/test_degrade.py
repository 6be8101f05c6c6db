"""Fetch degrades to "k of n" when the MetaServer or the owner is gone."""

import time

import pytest

import kvferry
from conftest import BT, paged, tokens


def setup_pair(ms_addr, ns, n_blocks=3, save=True):
    p = kvferry.Node(ms_addr, pool_bytes=16 << 20, rpc_timeout=1.0)
    d = kvferry.Node(ms_addr, pool_bytes=16 << 20, rpc_timeout=1.0, fetch_timeout=3.0)
    p.register_kv_cache(ns, *paged(seed=4))
    d.register_kv_cache(ns, *paged(fill=0.0))
    hs = kvferry.block_hashes(ns, tokens(n_blocks * BT), BT)
    if save:
        p.save(ns, hs, list(range(n_blocks)))
    return p, d, hs


def test_metaserver_gone_before_the_handoff(ns):
    ms = kvferry.MetaServer()
    p, d, hs = setup_pair(ms.address, ns, save=False)
    ms.shutdown()
    t0 = time.monotonic()
    assert p.save(ns, hs, [0, 1, 2]).saved == 3
    flush = p.flush_saves_and_registrations(timeout=2)
    assert flush.timed_out or flush.dropped > 0
    f = d.fetch(ns, hs)
    assert (f.available, f.fetched) == (0, 0)
    assert f.stopped_code == "fetch_metaserver"
    with pytest.raises((kvferry.MetaServerError, kvferry.DeadlineError)):
        d.query_prefix_remote(ns, hs)
    assert time.monotonic() - t0 < 15
    p.shutdown(1)
    d.shutdown(1)


def test_owner_gone_after_the_handoff(metaserver, ns):
    p, d, hs = setup_pair(metaserver.address, ns)
    assert p.flush_saves_and_registrations(timeout=5).ok
    p.kill()  # a crash: the MetaServer still lists p's blocks
    assert d.query_prefix_remote(ns, hs)[0].blocks == 3
    t0 = time.monotonic()
    f = d.fetch(ns, hs)
    assert time.monotonic() - t0 < 10
    assert (f.available, f.fetched) == (0, 0)
    assert f.stopped is not None and f.owners == [p.address]
    d.shutdown(1)


def test_fetch_timeout_is_the_fetchs_own_deadline(ns):
    # The caller's timeout, shorter than the node's fetch and RPC bounds, is
    # passed down as the fetch's deadline: fetch_into returns its reports
    # ("0 of n", stopped) by it instead of being cut from outside.
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    with kvferry.Node(addr, rpc_timeout=5.0, fetch_timeout=10.0) as d:
        d.register_kv_cache(ns, *paged(fill=0.0))
        hs = kvferry.block_hashes(ns, tokens(2 * BT), BT)
        t0 = time.monotonic()
        f, loaded = d.fetch_into(ns, hs, [0, 1], timeout=0.5)
        took = time.monotonic() - t0
        assert took < 1.5, took
        assert f.available == 0 and f.requested == 2 and f.stopped is not None
        assert loaded.loaded == 0
        t0 = time.monotonic()
        f = d.fetch(ns, hs, timeout=0.5)
        assert time.monotonic() - t0 < 1.5
        assert f.available == 0 and f.stopped is not None
    silent.close()


def test_load_timeout_is_the_loads_own_deadline(metaserver, ns):
    # The timeout is passed down as the load's deadline: a load whose
    # deadline passes before its copies start reports every block as not
    # loaded (code "load_deadline", the cache untouched) instead of raising;
    # fetch_into's load tail likewise.
    with kvferry.Node(metaserver.address, pool_bytes=16 << 20) as n:
        n.register_kv_cache(ns, *paged(seed=4))
        hs = kvferry.block_hashes(ns, tokens(3 * BT), BT)
        assert n.save(ns, hs, [0, 1, 2]).saved == 3
        r = n.load(ns, hs, [3, 4, 5], timeout=1e-9)
        assert r.loaded == 0
        assert [(i, c) for i, _, c in r.failed] == [(0, "load_deadline"), (1, "load_deadline"), (2, "load_deadline")]
        f, r = n.fetch_into(ns, hs, [3, 4, 5], timeout=1e-9)
        assert f.available == 3 and r.loaded == 0
        assert {c for _, _, c in r.failed} == {"load_deadline"}
        assert n.load(ns, hs, [3, 4, 5], timeout=5).loaded == 3


def test_silent_metaserver_is_bounded(ns):
    # A MetaServer that accepts connections and never answers.
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    with kvferry.Node(addr, rpc_timeout=0.5) as d:
        d.register_kv_cache(ns, *paged(fill=0.0))
        hs = kvferry.block_hashes(ns, tokens(2 * BT), BT)
        t0 = time.monotonic()
        f = d.fetch(ns, hs, timeout=1.0)
        assert time.monotonic() - t0 < 5
        assert f.available == 0 and f.stopped is not None
        t0 = time.monotonic()
        with pytest.raises(kvferry.DeadlineError):
            d.query_prefix_remote(ns, hs, timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert d.flush_saves_and_registrations(timeout=0.5) is not None
    silent.close()
