"""The worker side on real torch tensors in the layouts vLLM uses: the
installed vLLM's own planner and allocator in each of its ``KVCacheLayout``s
(per layer ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` views,
layer-outermost or block-outermost), plus the 5-D K/V-split shapes of older
vLLMs: save on one node, fetch into another node's cache through the
connector's own load path, bytes identical, other blocks untouched; layouts
whose blocks are not one run of bytes are refused with a clear error."""

import time

import pytest
import torch
from conftest import BS, LAYERS, allocate, extra, kv_cache_config, vllm_config

import kvferry
from kvferry.vllm import KvferryConnector, KvferryConnectorMetadata, LoadJob, SaveJob
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

NB = 12
HEADS, DIM = 2, 32

LEGACY = {
    # older vLLMs' FlashAttention / Triton shape
    "kv_first": lambda dt: torch.zeros(2, NB, BS, HEADS, DIM, dtype=dt),
    # older vLLMs' FlashInfer shape
    "blocks_first": lambda dt: torch.zeros(NB, 2, BS, HEADS, DIM, dtype=dt),
    # MLA: one latent vector per token
    "mla": lambda dt: torch.zeros(NB, BS, 576, dtype=dt),
}
# vLLM's KVCacheLayouts whose per-layer blocks are one run of bytes.
VLLM_LAYOUTS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
# ... and those where heads are outside blocks (refused).
VLLM_LAYOUTS_REFUSED = ["LHBNC", "BHLNC"]


def worker(tiny_model, ms, layout, dtype, role="kv_both"):
    """A worker-side connector with its KV cache: vLLM's own allocation for a
    KVCacheLayout name, else plain tensors of a legacy shape."""
    if layout in LEGACY:
        cfg = vllm_config(tiny_model, role, extra(ms))
        w = KvferryConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(NB))
        caches = {f"model.layers.{i}.self_attn.attn": LEGACY[layout](dtype) for i in range(LAYERS)}
    else:
        cfg = vllm_config(tiny_model, role, extra(ms), layout=layout)
        kcc = kv_cache_config(NB, cfg, dtype=dtype)
        w = KvferryConnector(cfg, KVConnectorRole.WORKER, kcc)
        caches = allocate(kcc, cfg)
    w.register_kv_caches(caches)
    return w, caches


def run_step(w, meta):
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    w.clear_connector_metadata()


def wait_recv(w, req_id, timeout=10):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        w.bind_connector_metadata(KvferryConnectorMetadata())
        _, recv = w.get_finished(set())
        w.clear_connector_metadata()
        if recv and req_id in recv:
            return w.get_block_ids_with_load_errors()
        time.sleep(0.01)
    raise AssertionError("load did not finish")


def blocks(t, layout, ids):
    if layout == "kv_first":
        return t[:, ids]
    return t[ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", VLLM_LAYOUTS + sorted(LEGACY))
def test_save_then_fetch_into_is_bit_identical(tiny_model, metaserver, layout, dtype):
    p, pc = worker(tiny_model, metaserver, layout, dtype)
    d, dc = worker(tiny_model, metaserver, layout, dtype)
    try:
        assert p.kv_layout == (layout if layout in ("kv_first", "blocks_first") else "block_major")
        g = torch.Generator().manual_seed(1)
        for t in pc.values():  # every layer's view, whatever its strides
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
        hashes = kvferry.block_hashes(p.ns, list(range(4 * BS)), BS)
        src_ids, dst_ids = [7, 2, 9, 4], [1, 10, 3, 6]
        run_step(p, KvferryConnectorMetadata(saves=[SaveJob("r", hashes, src_ids)]))
        assert p.stats["saved_blocks"] == 4
        assert p.node.flush_saves_and_registrations(timeout=5).ok
        before = {n: t.clone() for n, t in dc.items()}
        run_step(d, KvferryConnectorMetadata(loads=[LoadJob("r", hashes, dst_ids)]))
        assert wait_recv(d, "r") == set()
        assert d.stats["loaded_blocks"] == 4
        for name in pc:
            assert torch.equal(blocks(dc[name], layout, dst_ids), blocks(pc[name], layout, src_ids))
            others = [b for b in range(NB) if b not in dst_ids]
            assert torch.equal(blocks(dc[name], layout, others), blocks(before[name], layout, others))
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("layout", VLLM_LAYOUTS_REFUSED)
def test_layouts_with_heads_outside_blocks_are_refused(tiny_model, metaserver, layout):
    with pytest.raises(kvferry.LayoutError) as e:
        worker(tiny_model, metaserver, layout, torch.float32)
    msg = str(e.value)
    assert layout in msg and "model.layers.0.self_attn.attn" in msg and "one run of bytes" in msg


def test_missing_blocks_are_reported_as_load_errors(tiny_model, metaserver):
    p, pc = worker(tiny_model, metaserver, "LBHNC", torch.float32)
    d, dc = worker(tiny_model, metaserver, "LBHNC", torch.float32)
    try:
        hashes = kvferry.block_hashes(p.ns, list(range(5 * BS)), BS)
        run_step(p, KvferryConnectorMetadata(saves=[SaveJob("r", hashes[:2], [0, 1])]))  # only 2 of 5 exist
        assert p.node.flush_saves_and_registrations(timeout=5).ok
        run_step(d, KvferryConnectorMetadata(loads=[LoadJob("r", hashes, [5, 6, 7, 8, 9])]))
        assert wait_recv(d, "r") == {7, 8, 9}
        assert (d.stats["loaded_blocks"], d.stats["failed_blocks"]) == (2, 3)
    finally:
        p.shutdown()
        d.shutdown()
