"""The disk tier below the pool: ``Node(..., ssd_dir=..., ssd_bytes=...)``."""

import time

import numpy as np
import pytest

import kvferry
from conftest import BT, paged, tokens

# 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 B.
BLOCK_BYTES = 2 * 2 * BT * 2 * 16 * 4


def test_blocks_evicted_to_disk_load_back_bit_identical(metaserver, ns, tmp_path):
    with kvferry.Node(metaserver.address, pool_bytes=3 * BLOCK_BYTES, ssd_dir=tmp_path, ssd_bytes=8 << 20) as node:
        k, v = paged(seed=7)
        node.register_kv_cache(ns, k, v)
        hs = kvferry.block_hashes(ns, tokens(8 * BT, seed=3), BT)
        want = [x.copy() for x in k + v]
        for i in range(0, 8, 2):
            node.save(ns, hs[i : i + 2], [i, i + 1])
        # The pool holds 3 blocks; the rest went to disk and still count.
        deadline = time.monotonic() + 5
        while node.query_prefix(ns, hs) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.query_prefix(ns, hs) == 8
        for x in k + v:
            x[:] = 0
        for i in range(0, 8, 2):
            rep = node.load(ns, hs[i : i + 2], [i, i + 1])
            assert rep.ok and rep.loaded == 2
        for x, w in zip(k + v, want):
            np.testing.assert_array_equal(x, w)


def test_a_missing_ssd_dir_is_a_start_error(metaserver, tmp_path):
    with pytest.raises(kvferry.StartError):
        kvferry.Node(metaserver.address, ssd_dir=tmp_path / "missing", ssd_bytes=8 << 20)


def test_ssd_bytes_is_checked(metaserver, tmp_path):
    with pytest.raises(kvferry.ConfigError):
        kvferry.Node(metaserver.address, ssd_dir=tmp_path, ssd_bytes=-1)


def test_ssd_bytes_without_ssd_dir_is_a_value_error(metaserver):
    with pytest.raises(ValueError, match="ssd_bytes.*ssd_dir"):
        kvferry.Node(metaserver.address, ssd_bytes=8 << 20)


@pytest.mark.parametrize("bad", [0, 1000, (1 << 46) + 4096])
def test_an_ssd_size_out_of_range_names_ssd_bytes(metaserver, tmp_path, bad):
    with pytest.raises(kvferry.ConfigError, match="ssd_bytes"):
        kvferry.Node(metaserver.address, ssd_dir=tmp_path, ssd_bytes=bad)


def test_two_nodes_on_one_ssd_dir_is_a_start_error(metaserver, tmp_path):
    with kvferry.Node(metaserver.address, ssd_dir=tmp_path, ssd_bytes=8 << 20):
        with pytest.raises(kvferry.StartError, match="in use"):
            kvferry.Node(metaserver.address, ssd_dir=tmp_path, ssd_bytes=8 << 20)
