"""The CUDA backend with torch tensors (runs on a GPU machine; skipped
elsewhere). Also runnable without pytest: ``python test_cuda.py``."""

import gc
import sys

try:
    import torch
except ImportError:  # CI: no torch
    torch = None

import kvferry

NEEDS = torch is not None and torch.cuda.is_available() and kvferry.cuda_built()
BT = 16
SHAPE = (32, BT, 8, 128)  # [num_blocks, block_tokens, kv_heads, head_dim]

if "pytest" in sys.modules:
    import pytest

    pytestmark = pytest.mark.skipif(not NEEDS, reason="needs torch with CUDA and a wheel built with --features cuda")
    raises = pytest.raises
else:
    import contextlib

    @contextlib.contextmanager
    def raises(cls, match=None):
        try:
            yield
        except cls as e:
            assert match is None or match in str(e), (match, str(e))
        else:
            raise AssertionError(f"{cls.__name__} not raised")


def _caches(fill=None, layers=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = (lambda: torch.randn(SHAPE, generator=g, device="cuda", dtype=torch.bfloat16)) if fill is None else (
        lambda: torch.full(SHAPE, fill, device="cuda", dtype=torch.bfloat16)
    )
    return [mk() for _ in range(layers)], [mk() for _ in range(layers)]


def test_cuda_round_trip_between_two_nodes_is_bit_identical():
    ns = kvferry.namespace("cuda-test", "bfloat16", BT, 0, 1, 2)
    with kvferry.MetaServer() as ms, kvferry.Node(ms, gpu="cuda", pool_bytes=256 << 20) as p, kvferry.Node(
        ms, gpu="cuda", pool_bytes=256 << 20
    ) as d:
        pk, pv = _caches(seed=1)
        dk, dv = _caches(fill=0.0)
        p.register_kv_cache(ns, pk, pv, dtype="bfloat16")
        d.register_kv_cache(ns, dk, dv, dtype="bfloat16")
        hs = kvferry.block_hashes(ns, list(range(6 * BT)), BT)
        torch.cuda.synchronize()
        assert p.save(ns, hs, [3, 4, 5, 6, 7, 8]).saved == 6
        assert p.flush_saves_and_registrations(timeout=5).ok
        f, l = d.fetch_into(ns, hs, [0, 1, 2, 3, 4, 5])
        assert f.available == 6 and l.loaded == 6, (f, l)
        for a, b in zip(pk + pv, dk + dv):
            assert torch.equal(a[3:9].view(torch.int16), b[0:6].view(torch.int16))


def test_host_tensor_on_a_cuda_node():
    ns = kvferry.namespace("cuda-test", "bfloat16", BT, 0, 1, 1)
    with kvferry.MetaServer() as ms, kvferry.Node(ms, gpu="cuda", pool_bytes=64 << 20) as n:
        with raises(kvferry.BufferError, match="host memory but this node's backend is 'cuda'"):
            n.register_kv_cache(ns, [torch.zeros(SHAPE, dtype=torch.bfloat16)], [torch.zeros(SHAPE, dtype=torch.bfloat16)])


def test_freed_cuda_memory_is_refused():
    ns = kvferry.namespace("cuda-test", "bfloat16", BT, 0, 1, 1)
    with kvferry.MetaServer() as ms, kvferry.Node(ms, gpu="cuda", pool_bytes=64 << 20) as n:

        class Stale:
            """Looks like a CUDA array, points at memory that was freed."""

        t = torch.empty((1 << 30,), dtype=torch.uint8, device="cuda")
        ptr = t.data_ptr()
        del t
        gc.collect()
        torch.cuda.empty_cache()  # the caching allocator gives the segment back to the driver
        stale = Stale()
        stale.__cuda_array_interface__ = {"shape": SHAPE, "typestr": "<V2", "data": (ptr, False), "version": 3}
        with raises(kvferry.BufferError, match="not device memory"):
            n.register_kv_cache(ns, [stale])


def test_per_layer_tensors_allocated_back_to_back_register():
    # Issue 30, the engine's shape: 16 layers x K and V of [2048, 32, 4, 128]
    # bf16 (64 MiB each) from torch.zeros. PyTorch's caching allocator places
    # them back to back; each is its own allocation, so each must be its own
    # buffer (one buffer spanning two allocations is refused by the driver
    # check). K and V halves of one [2, ...] tensor touch inside one
    # allocation and share a buffer.
    layers, shape = 16, (2048, 32, 4, 128)
    ns = kvferry.namespace("cuda-b2b", "bfloat16", 32, 0, 1, layers)
    ks = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    vs = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    touching = sum(
        1 for a, b in zip(ks + vs, (ks + vs)[1:]) if a.data_ptr() + a.numel() * 2 == b.data_ptr()
    )
    with kvferry.MetaServer() as ms, kvferry.Node(ms, gpu="cuda", pool_bytes=1 << 30) as n:
        info = n.register_kv_cache(ns, ks, vs, dtype="bfloat16")
        assert info.buffers == 2 * layers, (info, touching)
        for t in ks + vs:
            t.fill_(1.5)
        torch.cuda.synchronize()
        hs = kvferry.block_hashes(ns, list(range(4 * 32)), 32)
        assert n.save(ns, hs, [0, 1, 2, 3]).saved == 4
        for t in ks + vs:
            t.zero_()
        torch.cuda.synchronize()
        assert n.load(ns, hs, [10, 11, 12, 13]).loaded == 4
        torch.cuda.synchronize()
        assert all(bool((t[10:14] == 1.5).all()) and bool((t[:10] == 0).all()) for t in ks + vs)
        n.unregister_kv_cache(ns)
        kv = torch.zeros((2, 8) + shape[1:], device="cuda", dtype=torch.bfloat16)
        ns2 = kvferry.namespace("cuda-b2b-kv", "bfloat16", 32, 0, 1, 1)
        info2 = n.register_kv_cache(ns2, [kv[0]], [kv[1]])
        assert info2.buffers == 1, info2


def test_cuda_tensor_on_a_host_node():
    ns = kvferry.namespace("cuda-test", "bfloat16", BT, 0, 1, 1)
    with kvferry.MetaServer() as ms, kvferry.Node(ms, gpu="host") as n:
        k, v = _caches(layers=1)
        with raises(kvferry.BufferError, match="CUDA tensor but this node's backend is 'host'"):
            n.register_kv_cache(ns, k, v)


if __name__ == "__main__":
    if not NEEDS:
        print("skipped: needs torch with CUDA and a wheel built with --features cuda")
        sys.exit(0)
    failed = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Exception as e:  # report every test
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
