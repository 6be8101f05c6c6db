import numpy as np
import pytest

import kvferry

BT = 16  # tokens per block
LAYERS = 2
SHAPE = (8, BT, 2, 16)  # [num_blocks, block_tokens, kv_heads, head_dim]


@pytest.fixture
def metaserver():
    with kvferry.MetaServer() as ms:
        yield ms


@pytest.fixture
def ns():
    return kvferry.namespace("test-model", "float32", BT, 0, 1, LAYERS)


def paged(fill=None, seed=0, shape=SHAPE, dtype=np.float32):
    """Per layer K and V caches; random when ``fill`` is None."""
    rng = np.random.default_rng(seed)
    mk = (lambda: rng.standard_normal(shape).astype(dtype)) if fill is None else (lambda: np.full(shape, fill, dtype))
    return [mk() for _ in range(LAYERS)], [mk() for _ in range(LAYERS)]


def tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, n)]


def prefill_pair(p, d, ns, n, seed):
    """Random caches on ``p`` and zeroed ones on ``d``, both registered in
    ``ns``; the ``n`` blocks of an ``n``-block prompt saved on ``p`` from
    cache blocks ``0..n`` and registered at the MetaServer. Returns
    ``(pk, pv, dk, dv, hashes)``."""
    pk, pv = paged(seed=seed)
    dk, dv = paged(fill=0.0)
    p.register_kv_cache(ns, pk, pv)
    d.register_kv_cache(ns, dk, dv)
    hs = kvferry.block_hashes(ns, tokens(n * BT), BT)
    p.save(ns, hs, list(range(n)))
    assert p.flush_saves_and_registrations(timeout=5).ok
    return pk, pv, dk, dv, hs
