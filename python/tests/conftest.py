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
