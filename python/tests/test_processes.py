"""Two engines in two OS processes, and Ctrl-C during a wait."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

import kvferry
from conftest import BT, LAYERS, SHAPE, paged, tokens

PREFILL = textwrap.dedent(
    """
    import sys, numpy as np, kvferry
    ms, ns, bt = sys.argv[1], sys.argv[2], int(sys.argv[3])
    shape = tuple(int(x) for x in sys.argv[4].split(","))
    rng = np.random.default_rng(7)
    k = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    v = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    with kvferry.Node(ms) as node:
        node.register_kv_cache(ns, k, v)
        hs = kvferry.block_hashes(ns, list(range(4 * bt)), bt)
        node.save(ns, hs, [0, 1, 2, 3])
        assert node.flush_saves_and_registrations(timeout=5).ok
        np.save(sys.argv[5], np.stack(k + v)[:, :4])
        print("ready", flush=True)
        sys.stdin.readline()   # serve until told to stop
    """
)


def test_two_engines_in_two_processes(metaserver, ns, tmp_path):
    ref = tmp_path / "ref.npy"
    proc = subprocess.Popen(
        [sys.executable, "-c", PREFILL, metaserver.address, ns, str(BT), ",".join(map(str, SHAPE)), str(ref)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with kvferry.Node(metaserver.address) as d:
            dk, dv = paged(fill=0.0)
            d.register_kv_cache(ns, dk, dv)
            hs = kvferry.block_hashes(ns, list(range(4 * BT)), BT)
            f, l = d.fetch_into(ns, hs, [4, 5, 6, 7])
            assert f.available == 4 and f.fetched == 4 and l.loaded == 4
            np.testing.assert_array_equal(np.stack(dk + dv)[:, 4:8], np.load(ref))
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert proc.returncode == 0


CTRL_C = textwrap.dedent(
    """
    import signal, socket, sys, time, kvferry
    # Python's Ctrl-C handler even where the parent ignores SIGINT (a
    # background job of a shell passes SIG_IGN on, and Python keeps it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A "MetaServer" that accepts connections and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    addr = "127.0.0.1:%d" % silent.getsockname()[1]
    with kvferry.Node(addr, rpc_timeout=60) as node:
        print("waiting", flush=True)
        try:
            node.query_prefix_remote("ns", [b"x" * 32], timeout=60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """
)


def test_ctrl_c_interrupts_a_wait():
    # A query to a MetaServer that never answers waits up to 60 s;
    # SIGINT must end it promptly.
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert time.monotonic() - t0 < 10
        assert "interrupted" in out
    finally:
        if proc.poll() is None:
            proc.kill()
