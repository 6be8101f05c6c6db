"""Bad input is a clear error at start, naming the key or the layout: vLLM
loads the connector by module path and gets a KvferryConnector, or a
kvferry error that says what to fix."""

import socket

import pytest
import torch
from conftest import BS, LAYERS, Instance, extra, kv_cache_config, vllm_config

import kvferry
from kvferry.vllm import ConnectorConfig, KvferryConnector, kv_layout
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole


def connector(tiny_model, ex, role=KVConnectorRole.SCHEDULER, kv_role="kv_both", blocks=16):
    return KvferryConnector(vllm_config(tiny_model, kv_role, ex), role, kv_cache_config(blocks))


def test_vllm_loads_the_connector_by_module_path(tiny_model, metaserver):
    inst = Instance(tiny_model, "kv_both", extra(metaserver))
    try:
        assert type(inst.connector) is KvferryConnector
        assert inst.connector.ns == inst.worker.ns
        assert inst.worker.kv_layout == "block_major"  # vLLM 0.33: [num_blocks, kv_heads, block_size, 2 * head_dim]
    finally:
        inst.close()


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"metaserver": "x:1", "pool_size": 1}, "pool_size"),
        ({"metaserver": "x:1", "pool_bytes": "1G"}, "pool_bytes"),
        ({"metaserver": "x:1", "pool_bytes": True}, "pool_bytes"),
        ({"metaserver": "x:1", "pool_bytes": 10}, "pool_bytes"),
        ({"metaserver": "x:1", "fetch_timeout": "5s"}, "fetch_timeout"),
        ({"metaserver": "x:1", "lease_ttl": 601}, "lease_ttl"),
        ({"metaserver": "x:1", "gpu": "rocm"}, "gpu"),
        ({"metaserver": "x:1", "check_metaserver": "no"}, "check_metaserver"),
        ({"metaserver": 7000}, "metaserver"),
        ({"metaserver": "http://h:1"}, "metaserver"),
        ({"pool_bytes": 1 << 20}, "metaserver"),
    ],
)
def test_bad_extra_config_names_the_key(tiny_model, bad, key):
    with pytest.raises(kvferry.ConfigError) as e:
        ConnectorConfig.from_extra_config(bad)
    assert key in str(e.value)
    # The same error through vLLM's constructor path.
    with pytest.raises(kvferry.ConfigError) as e:
        connector(tiny_model, bad)
    assert key in str(e.value)


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(kvferry.ConfigError) as e:
        ConnectorConfig.from_extra_config({"metaserver": "h:1", "metasever": "h:1"})
    assert "metasever" in str(e.value) and "fetch_timeout" in str(e.value)


def test_metaserver_down_at_start(tiny_model):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    ex = {"metaserver": f"127.0.0.1:{port}", "query_timeout": 0.5, "rpc_timeout": 0.5}
    with pytest.raises(kvferry.StartError) as e:
        connector(tiny_model, ex)
    assert f"127.0.0.1:{port}" in str(e.value) and "metaserver" in str(e.value)
    # Opting out starts anyway (no remote hits until it is up).
    c = connector(tiny_model, dict(ex, check_metaserver=False))
    c.shutdown()


def test_unsupported_layout_names_layer_and_shape(tiny_model, metaserver):
    w = connector(tiny_model, extra(metaserver), role=KVConnectorRole.WORKER, blocks=16)
    # kernel blocks of 8 tokens: twice as many blocks as vLLM's block table has
    bad = {f"model.layers.{i}.self_attn.attn": torch.zeros(32, 2, 8, 64) for i in range(LAYERS)}
    with pytest.raises(kvferry.LayoutError) as e:
        w.register_kv_caches(bad)
    assert "model.layers.0.self_attn.attn" in str(e.value) and "[32, 2, 8, 64]" in str(e.value)
    mixed = {
        "model.layers.0.self_attn.attn": torch.zeros(2, 16, BS, 2, 32),
        "model.layers.1.self_attn.attn": torch.zeros(16, 2, BS, 64),
    }
    with pytest.raises(kvferry.LayoutError) as e:
        w.register_kv_caches(mixed)
    assert "model.layers.1.self_attn.attn" in str(e.value)
    few = {"model.layers.0.self_attn.attn": torch.zeros(2, 16, BS, 2, 32)}
    with pytest.raises(kvferry.LayoutError, match="1 KV layers"):
        w.register_kv_caches(few)
    assert w.node is None  # nothing left running
    w.shutdown()


def test_kv_layout_names():
    assert kv_layout((2, 10, 16, 8, 128), 10, 16) == "kv_first"
    assert kv_layout((10, 2, 16, 8, 128), 10, 16) == "blocks_first"
    assert kv_layout((10, 16, 576), 10, 16) == "block_major"  # MLA
    assert kv_layout((10, 8, 16, 256), 10, 16) == "block_major"  # vLLM 0.32/0.33: [B, H, N, 2 * head_dim]
    with pytest.raises(kvferry.LayoutError):
        kv_layout((2, 10, 32, 8, 128), 10, 16)  # block size differs


def test_tensor_parallel_is_refused(tiny_model, metaserver):
    cfg = vllm_config(tiny_model, "kv_both", extra(metaserver))
    cfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(kvferry.ConfigError, match="tensor_parallel_size"):
        KvferryConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(16))
