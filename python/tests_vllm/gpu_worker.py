#!/usr/bin/env python3
"""The connector's worker side on CUDA tensors laid out as vLLM lays them
out, for a machine with a GPU but no vLLM (the H200 here: nothing can be
installed there).

When ``vllm`` cannot be imported, a minimal stand-in for the few vLLM names
``kvferry.vllm`` imports is put in ``sys.modules`` first (the connector base
class's metadata plumbing, the role enum, ``FullAttentionSpec``): the code
under test is kvferry's own worker side, unchanged. With vLLM installed the
real classes are used.

For each layout, two worker-side connectors (P, D) in this process, each
with its own KV cache allocated as vLLM 0.33's allocator does (one flat
buffer per instance viewed per layer as ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` in a ``KVCacheLayout``: ``LBHNC`` layer-outer,
``BLHNC`` block-outer), plus the older ``[2, num_blocks, ...]`` shape: P
saves 6 blocks (``wait_for_save``, after the stream sync), runs the barrier;
D loads them into other block ids through the connector's asynchronous
load (``start_load_kv`` / ``get_finished``): bytes identical on the device,
other blocks untouched. Then a handoff with a device lease: P's producer
path grants it, D's read releases it (``get_finished`` reports P's request).

Usage: ``python gpu_worker.py [--device cuda|cpu]``; prints JSON, exits 0
when every case passed.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import time
import types
from dataclasses import dataclass


def install_vllm_stand_in() -> bool:
    """Puts a minimal ``vllm`` in sys.modules when the real one is missing.
    Returns True when it did."""
    try:
        import vllm  # noqa: F401
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401

        return False
    except ImportError:
        pass

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._kv_cache_manager = None
            self._role = role

        def bind_connector_metadata(self, m):
            self._connector_metadata = m

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None

    @dataclass(frozen=True)
    class FullAttentionSpec:
        block_size: int
        num_kv_heads: int
        head_size: int
        dtype: object

    mods = {}
    for name in [
        "vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.v1", "vllm.v1.kv_cache_interface",
    ]:
        mods[name] = sys.modules[name] = types.ModuleType(name)
    mods["vllm"].__version__ = "stand-in"
    base = mods["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    base.KVConnectorBase_V1, base.KVConnectorMetadata, base.KVConnectorRole = (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    mods["vllm.v1.kv_cache_interface"].FullAttentionSpec = FullAttentionSpec
    return True


STAND_IN = install_vllm_stand_in()

import torch  # noqa: E402

import kvferry  # noqa: E402
from kvferry.vllm import KvferryConnector, KvferryConnectorMetadata, LoadJob, SaveJob  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

NB, BS, H, D, L = 24, 16, 8, 128, 4
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def ns(**kw):
    return types.SimpleNamespace(**kw)


def configs(ms: str, role: str, layout: str, dtype):
    tc = ns(kv_connector_extra_config={"metaserver": ms, "pool_bytes": 256 << 20, "lease_ttl": 20.0},
            is_kv_producer=role in ("kv_producer", "kv_both"), is_kv_consumer=role in ("kv_consumer", "kv_both"),
            engine_id=f"{role}-{layout}-{time.monotonic_ns()}", kv_load_failure_policy="recompute")
    vc = ns(kv_transfer_config=tc, parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1),
            model_config=ns(model="gpu-worker-test"), cache_config=ns(kv_cache_layout=layout))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=dtype)
    kcc = ns(kv_cache_groups=[ns(layer_names=NAMES, kv_cache_spec=spec)], num_blocks=NB, kv_cache_layout=layout)
    return vc, kcc


def allocate(layout: str, dtype, device: str):
    """Per-layer views as vLLM 0.33's allocator makes them (one buffer)."""
    if layout == "kv_first":  # older vLLMs: one [2, num_blocks, block_size, heads, dim] tensor per layer
        return {n: torch.zeros(2, NB, BS, H, D, dtype=dtype, device=device) for n in NAMES}
    page = H * BS * 2 * D
    buf = torch.zeros(L * NB * page, dtype=dtype, device=device)
    if layout == "LBHNC":
        v = buf.view(L, NB, H, BS, 2 * D)
        return {n: v[i] for i, n in enumerate(NAMES)}
    if layout == "BLHNC":
        v = buf.view(NB, L, H, BS, 2 * D)
        return {n: v[:, i] for i, n in enumerate(NAMES)}
    raise ValueError(layout)


def blocks(t, layout, ids):
    return t[:, ids] if layout == "kv_first" else t[ids]


def worker(ms, role, layout, dtype, device):
    vc, kcc = configs(ms, role, layout, dtype)
    w = KvferryConnector(vc, KVConnectorRole.WORKER, kcc)
    caches = allocate(layout, dtype, device)
    w.register_kv_caches(caches)
    return w, caches


def step(w, meta, finished=()):
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    out = w.get_finished(set(finished))
    w.clear_connector_metadata()
    return out


def wait_for(w, pred, timeout=20.0, finished=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sending, recving = step(w, KvferryConnectorMetadata(), finished)
        if pred(sending or set(), recving or set()):
            return True
        time.sleep(0.01)
    return False


def case(ms, layout, dtype, device):
    p, pc = worker(ms, "kv_both", layout, dtype, device)
    d, dc = worker(ms, "kv_both", layout, dtype, device)
    try:
        g = torch.Generator(device=device).manual_seed(3)
        for t in pc.values():
            t.copy_(torch.randn(t.shape, generator=g, device=device).to(dtype))
        hashes = kvferry.block_hashes(p.ns, list(range(100, 100 + 6 * BS)), BS)
        src, dst = [3, 17, 5, 9, 22, 0], [11, 2, 19, 7, 14, 20]
        step(p, KvferryConnectorMetadata(saves=[SaveJob("r", hashes, src)]))
        assert p.node.flush_saves_and_registrations(timeout=5).ok
        before = {n: t.clone() for n, t in dc.items()}
        step(d, KvferryConnectorMetadata(loads=[LoadJob("r", hashes, dst)]))
        got = wait_for(d, lambda s, r: "r" in r)
        errors = d.get_block_ids_with_load_errors()
        others = [b for b in range(NB) if b not in dst]
        same = all(torch.equal(blocks(dc[n], layout, dst), blocks(pc[n], layout, src)) for n in pc)
        untouched = all(torch.equal(blocks(dc[n], layout, others), blocks(before[n], layout, others)) for n in pc)
        return {"layout": layout, "dtype": str(dtype), "gpu": p.node.gpu, "kv_layout": p.kv_layout,
                "buffers": p.kv_info.buffers, "loaded": d.stats["loaded_blocks"], "load_errors": sorted(errors),
                "identical": same, "others_untouched": untouched,
                "ok": bool(got and same and untouched and not errors and d.stats["loaded_blocks"] == 6)}
    finally:
        p.shutdown()
        d.shutdown()


def lease_case(ms, dtype, device):
    """A producer's handoff: save + lease + barrier; the consumer's read
    releases the lease, and P reports the request finished sending."""
    p, pc = worker(ms, "kv_producer", "LBHNC", dtype, device)
    d, dc = worker(ms, "kv_consumer", "LBHNC", dtype, device)
    try:
        for t in pc.values():
            t.copy_(torch.randn(t.shape, device=device).to(dtype))
        hashes = kvferry.block_hashes(p.ns, list(range(7, 7 + 4 * BS)), BS)
        src, dst = [1, 2, 3, 4], [5, 6, 7, 8]
        step(p, KvferryConnectorMetadata(saves=[SaveJob("r", hashes, src, handoff=True, lease=True,
                                                        lease_hashes=hashes, lease_block_ids=src)]))
        step(d, KvferryConnectorMetadata(loads=[LoadJob("r", hashes, dst)]))
        got = wait_for(d, lambda s, r: "r" in r)
        released = wait_for(p, lambda s, r: "r" in s, finished={"r"})
        same = all(torch.equal(dc[n][dst], pc[n][src]) for n in pc)
        m = d.node.metrics()
        return {"leases_granted": p.stats["leases_granted"], "leases_released": p.stats.get("leases_released", 0),
                "flushes": p.stats["flushes"], "identical": same,
                "paths": {k: v for k, v in m.items() if k.startswith("path_")},
                "ok": bool(got and released and same and p.stats.get("leases_released", 0) == 1)}
    finally:
        p.shutdown()
        d.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    res = {"vllm_stand_in": STAND_IN, "device": a.device, "cuda_built": kvferry.cuda_built(), "cases": []}
    with kvferry.MetaServer() as ms:
        for layout in ("LBHNC", "BLHNC", "kv_first"):
            for dtype in (torch.bfloat16, torch.float16):
                try:
                    res["cases"].append(case(ms.address, layout, dtype, a.device))
                except Exception as e:
                    res["cases"].append({"layout": layout, "dtype": str(dtype), "ok": False, "error": repr(e)})
        try:
            res["lease"] = lease_case(ms.address, torch.bfloat16, a.device)
        except Exception as e:
            res["lease"] = {"ok": False, "error": repr(e)}
    res["ok"] = all(c["ok"] for c in res["cases"]) and res["lease"]["ok"]
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
