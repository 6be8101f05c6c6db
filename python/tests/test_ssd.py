"""The disk tier below the pool: ``Node(..., ssd_dir=..., ssd_bytes=...)``."""

import os
import select
import signal
import subprocess
import sys
import textwrap
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


# A node that saves `n` blocks through a 16-block pool into its disk tier,
# waits until every evicted block's record is written, says how many, and
# serves until it is killed. It saves no faster than the disk writes (at
# most 32 evicted blocks waiting for their records, half the default
# write-behind queue): a full queue refuses victims, and on a slow or busy
# disk (CI's) the refused blocks would leave holes in the prefix and fewer
# records than the registration queue holds.
FILLER = textwrap.dedent(
    """
    import sys, time, numpy as np, kvferry
    ms, ns, d, n, bt, bb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    shape = (8, bt, 2, 16)
    rng = np.random.default_rng(5)
    k = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    v = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    node = kvferry.Node(ms, pool_bytes=16 * bb, ssd_dir=d, ssd_bytes=64 << 20)
    node.register_kv_cache(ns, k, v)
    hs = kvferry.block_hashes(ns, list(range(n * bt)), bt)
    pace = time.monotonic() + 100
    for i in range(0, n, 8):
        assert node.save(ns, hs[i : i + 8], list(range(8))).saved == 8
        while time.monotonic() < pace:
            m = node.metrics()
            if m["evicted"] - m["ssd_written_blocks"] - m["ssd_write_refused"] <= 32:
                break
            time.sleep(0.002)
    assert node.flush_saves_and_registrations(timeout=10).ok
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = node.metrics()
        if m["ssd_written_blocks"] == m["ssd_records"] and m["evicted"] >= n - 16:
            break
        time.sleep(0.05)
    print(m["ssd_records"], m["ssd_write_refused"], flush=True)
    sys.stdin.readline()
    """
)


def test_a_node_killed_and_restarted_readvertises_what_it_had_written(metaserver, ns, tmp_path):
    """Issue 32's restart target: a node SIGKILLed after its records were
    written, restarted on the same directory, re-advertises >= 99 % of them
    (here all) — more blocks than the registration queue holds (4,096), so
    the re-advertising must wait for room rather than drop the rest."""
    n = 5000
    proc = subprocess.Popen(
        [sys.executable, "-c", FILLER, metaserver.address, ns, str(tmp_path), str(n), str(BT), str(BLOCK_BYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Bounded: a child that hangs before it reports fails the test.
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the filling node reported nothing within 120 s"
        line = proc.stdout.readline().split()
        assert len(line) == 2, line
        written, refused = int(line[0]), int(line[1])
        assert written >= n - 16 - refused and written > 4096, (written, refused)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    with kvferry.Node(metaserver.address, pool_bytes=16 * BLOCK_BYTES, ssd_dir=tmp_path, ssd_bytes=64 << 20) as node:
        m = node.metrics()
        assert m["ssd_recovered"] >= 0.99 * written, (m, written)
        deadline = time.monotonic() + 30
        while node.metrics()["ssd_recovered_advertised"] < m["ssd_recovered"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.flush_saves_and_registrations(timeout=10).ok
        m = node.metrics()
        assert m["ssd_recovered_advertised"] == m["ssd_recovered"], m
        assert m["registrations_dropped"] == 0, m
        hs = kvferry.block_hashes(ns, list(range(n * BT)), BT)
        owners = {o.node: o.blocks for o in node.query_prefix_remote(ns, hs, timeout=10)}
        # The oldest blocks were evicted first: the recovered ones are a
        # prefix of the hashes, now advertised by the new node.
        assert owners.get(node.address, 0) >= 0.99 * written, (owners, written)
