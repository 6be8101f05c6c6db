"""Start, use and stop MetaServers and nodes from Python."""

import pytest

import kvferry


def test_metaserver_starts_on_a_free_port_and_stops(metaserver):
    host, port = metaserver.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert metaserver.running
    metaserver.shutdown()
    assert not metaserver.running
    metaserver.shutdown()  # idempotent


def test_taken_port_is_a_start_error(metaserver):
    with pytest.raises(kvferry.StartError) as e:
        kvferry.MetaServer(metaserver.address)
    assert e.value.code == "metaserver_bind"


def test_node_context_manager_shuts_down(metaserver):
    with kvferry.Node(metaserver.address) as node:
        assert node.running
        assert node.gpu == "host"
        assert node.address.startswith("127.0.0.1:")
    assert not node.running
    with pytest.raises(kvferry.ClosedError):
        node.metrics()


def test_node_accepts_a_metaserver_object(metaserver):
    with kvferry.Node(metaserver, pool_bytes=8 << 20) as node:
        assert node.metrics()["pool_used_bytes"] == 0


def test_two_nodes_in_one_process_are_independent(metaserver):
    a = kvferry.Node(metaserver.address)
    b = kvferry.Node(metaserver.address)
    assert a.address != b.address
    a.shutdown()
    # b's runtime is its own: it still works after a is gone.
    assert b.metrics()["saves"] == 0
    assert b.flush_saves_and_registrations(timeout=5).ok
    b.shutdown()


def test_bad_settings_raise_config_errors(metaserver):
    with pytest.raises(kvferry.ConfigError):
        kvferry.Node(metaserver.address, gpu="tpu")
    with pytest.raises(kvferry.ConfigError):
        kvferry.Node(metaserver.address, transport="carrier-pigeon")
    with pytest.raises(kvferry.ConfigError):
        kvferry.MetaServer("not-an-address")
    with kvferry.Node(metaserver.address) as node:
        with pytest.raises(kvferry.ConfigError):
            node.flush_saves_and_registrations(timeout=-1)


@pytest.mark.skipif(kvferry.cuda_built(), reason="this wheel has CUDA")
def test_cuda_backend_in_a_host_only_build_says_how_to_get_it(metaserver):
    with pytest.raises(kvferry.StartError, match="--features cuda"):
        kvferry.Node(metaserver.address, gpu="cuda")


def test_errors_form_a_hierarchy_with_builtin_bases():
    for cls in (kvferry.BufferError, kvferry.LayoutError, kvferry.ConfigError):
        assert issubclass(cls, kvferry.KvferryError) and issubclass(cls, ValueError)
    assert issubclass(kvferry.DeadlineError, TimeoutError)
    assert issubclass(kvferry.BlockIndexError, IndexError)


def test_help_is_useful():
    assert "k_caches" in kvferry.Node.register_kv_cache.__doc__
    assert "barrier" in kvferry.Node.flush_saves_and_registrations.__doc__
    assert "recompute" in kvferry.Node.fetch.__doc__


def test_block_hashes_are_chained_full_blocks_only(ns):
    toks = list(range(40))
    hs = kvferry.block_hashes(ns, toks, 16)
    assert len(hs) == 2 and all(len(h) == 32 for h in hs)
    # Same prefix, same hashes; a change in block 0 changes block 1's hash too.
    assert kvferry.block_hashes(ns, toks[:32], 16) == hs
    changed = kvferry.block_hashes(ns, [99] + toks[1:], 16)
    assert changed[0] != hs[0] and changed[1] != hs[1]
    # The namespace is part of the hash.
    assert kvferry.block_hashes(ns + "x", toks, 16) != hs
    assert kvferry.block_hashes(ns, toks[:15], 16) == []


def test_hash_and_namespace_match_the_rust_test_vectors():
    # docs/block-hash.md, pinned on the Rust side by hash::tests::v1_test_vectors.
    ns = kvferry.namespace("test", "bf16", block_tokens=4, tp_rank=0, tp_size=1, layers=2)
    assert ns == "kvferry1|model=test|dtype=bf16|bt=4|tp=0/1|layers=2"
    assert [h.hex() for h in kvferry.block_hashes(ns, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)] == [
        "726d2da1c87699eef98c012015b957de6bd0c719569154d9e0f6bdbb06c7268d",
        "676bd1a00ff9a69ec88251d1d77766180b56c6538f27fb2c306a1597bc13c9c3",
    ]
    assert [h.hex() for h in kvferry.block_hashes("n", [0], 1)] == [
        "0af1f7381c2ab5e5c01e4f0c2b86bb942a9275c80c161334e34e16bc13ee160c"
    ]
    with pytest.raises(kvferry.ConfigError) as e:
        kvferry.namespace("", "bf16", 4, layers=1)
    assert e.value.code.startswith("hash_")
