"""Issue 30: a careless caller's addresses and integers become kvferry
errors that name the argument, at the call that got them (not Python's
OverflowError, not a node that starts and fails later)."""

import numpy as np
import pytest

import kvferry
from conftest import BT, LAYERS, paged, tokens


@pytest.fixture
def node(metaserver):
    with kvferry.Node(metaserver.address, pool_bytes=16 << 20) as n:
        yield n


@pytest.mark.parametrize(
    "addr, says",
    [
        ("not-an-address:xx", "port 'xx'"),
        ("127.0.0.1:99999", "port '99999'"),
        ("127.0.0.1", "has no port"),
        ("foo", "has no port"),
        ("[::1]:x", "port 'x'"),
        ("http://127.0.0.1:5", "without a scheme"),
        ("ftp://127.0.0.1:5", 'scheme "ftp"'),
        ("", "has no port"),
    ],
)
def test_bad_metaserver_address_is_refused_at_construction(addr, says):
    with pytest.raises(kvferry.ConfigError) as e:
        kvferry.Node(addr)
    assert str(e.value).startswith("metaserver: "), str(e.value)
    assert says.replace("'", '"') in str(e.value).replace("'", '"'), str(e.value)
    assert e.value.code == "client_address"


def test_good_metaserver_addresses_start(metaserver):
    port = metaserver.address.rsplit(":", 1)[1]
    for addr in (metaserver.address, f"localhost:{port}"):
        with kvferry.Node(addr) as n:
            assert n.running


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"pool_bytes": -1}, "pool_bytes"),
        ({"pool_bytes": 2**64}, "pool_bytes"),
        ({"pool_bytes": 100}, "pool_bytes"),
        ({"device": -1}, "device"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"data_port": -5}, "data_port"),
    ],
)
def test_node_integers_out_of_range(metaserver, kw, name):
    with pytest.raises(kvferry.ConfigError, match=f"^{name} = .* out of range") as e:
        kvferry.Node(metaserver.address, **kw)
    assert e.value.code == "range"


def test_metaserver_integers_out_of_range():
    with pytest.raises(kvferry.ConfigError, match="^ttl_s = -1 is out of range"):
        kvferry.MetaServer(ttl_s=-1)


def test_namespace_needs_layers_and_sane_integers():
    with pytest.raises(kvferry.ConfigError, match="needs layers=N") as e:
        kvferry.namespace("m", "float32", 16)
    assert e.value.code == "layers"
    for kw, name in (
        ({"layers": -1}, "layers"),
        ({"layers": 0}, "layers"),
        ({"layers": 2**70}, "layers"),
        ({"layers": 2, "tp_size": 0}, "tp_size"),
        ({"layers": 2, "tp_rank": -1}, "tp_rank"),
    ):
        with pytest.raises(kvferry.ConfigError, match=f"^{name} = "):
            kvferry.namespace("m", "float32", 16, **kw)
    with pytest.raises(kvferry.ConfigError, match="^block_tokens = 0"):
        kvferry.namespace("m", "float32", 0, layers=1)
    assert kvferry.namespace("m", "float32", 16, layers=2).endswith("layers=2")


def test_tokens_and_block_tokens_out_of_range(ns):
    with pytest.raises(kvferry.ConfigError, match=r"^tokens\[2\] = 4294967296 is out of range"):
        kvferry.block_hashes(ns, [1, 2, 2**32, 4], 2)
    with pytest.raises(kvferry.ConfigError, match=r"^tokens\[0\] = -1 is out of range"):
        kvferry.block_hashes(ns, [-1], 1)
    with pytest.raises(kvferry.ConfigError, match=r"^tokens\[1\] must be an integer"):
        kvferry.block_hashes(ns, [1, 2.5], 1)
    with pytest.raises(kvferry.ConfigError, match="^block_tokens = -3"):
        kvferry.block_hashes(ns, [1, 2], -3)
    # numpy integers are integers.
    assert kvferry.block_hashes(ns, np.arange(2 * BT), BT) == kvferry.block_hashes(ns, list(range(2 * BT)), BT)


@pytest.mark.parametrize("bad, at", [(-1, 1), (2**70, 0), (2**64, 2)])
def test_block_ids_out_of_range(node, ns, bad, at):
    k, v = paged()
    node.register_kv_cache(ns, k, v)
    hs = kvferry.block_hashes(ns, tokens(3 * BT), BT)
    ids = [0, 1, 2]
    ids[at] = bad
    for call in (node.save, node.load, node.fetch_into, node.grant_device_lease):
        with pytest.raises(kvferry.BlockIndexError, match=rf"^block_ids\[{at}\] = {bad} is out of range") as e:
            call(ns, hs, ids)
        assert e.value.code == "range"


def test_duplicate_destinations_are_refused(node, ns):
    k, v = paged(seed=2)
    node.register_kv_cache(ns, k, v)
    hs = kvferry.block_hashes(ns, tokens(3 * BT), BT)
    assert node.save(ns, hs, [0, 1, 2]).saved == 3
    for call in (node.load, node.fetch_into):
        with pytest.raises(kvferry.ConfigError, match=r"block_ids\[0\] and block_ids\[1\] both name destination block 4") as e:
            call(ns, hs, [4, 4, 4])
        assert e.value.code == "duplicate_block"
    # Nothing was loaded.
    assert node.metrics()["loaded_blocks"] == 0
    # Saving from one source block twice is fine (a source may be read twice).
    hs2 = kvferry.block_hashes(ns, tokens(2 * BT, seed=7), BT)
    assert node.save(ns, hs2, [5, 5]).saved == 2


def test_pool_smaller_than_one_block_is_refused(metaserver, ns):
    # One block of the conftest cache: LAYERS x K and V x 2 KiB = 8 KiB.
    k, v = paged()
    with kvferry.Node(metaserver.address, pool_bytes=4096) as small:
        with pytest.raises(kvferry.ConfigError, match="pool_bytes") as e:
            small.register_kv_cache(ns, k, v)
        assert e.value.code == "pool_too_small"
        with pytest.raises(kvferry.UnknownNamespaceError):
            small.kv_cache(ns)
    with kvferry.Node(metaserver.address, pool_bytes=LAYERS * 2 * k[0][0].nbytes) as one:
        one.register_kv_cache(ns, k, v)
        assert one.save(ns, kvferry.block_hashes(ns, tokens(BT), BT), [0]).saved == 1


def test_codes_choose_the_exception_class():
    # The class of a native error comes from its stable code alone.
    from kvferry import errors

    assert errors.class_for("engine_unknown_namespace") is kvferry.UnknownNamespaceError
    assert errors.class_for("engine_block_index") is kvferry.BlockIndexError
    assert errors.class_for("layout_overlap") is kvferry.LayoutError
    assert errors.class_for("pool_exhausted") is kvferry.PoolFullError
    assert errors.class_for("gpu_out_of_range") is kvferry.GpuError
    assert errors.class_for("id_hash_length") is kvferry.ConfigError
    assert errors.class_for("client_rpc") is kvferry.MetaServerError
    assert errors.class_for("deadline") is kvferry.DeadlineError
    assert errors.class_for("something_new") is kvferry.KvferryError
    e = errors.error_for("pool_exhausted", "full")
    assert isinstance(e, kvferry.PoolFullError) and e.code == "pool_exhausted" and e.cause == "pool_exhausted"
    e = errors.error_for("pool_exhausted", "full", "StartError")
    assert isinstance(e, kvferry.StartError) and e.code == "pool_exhausted"
