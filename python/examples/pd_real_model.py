#!/usr/bin/env python3
"""Prefill/decode disaggregation of a real model through kvferry.

Three OS processes, each embedding kvferry through the Python package:

- **metaserver**: ``kvferry.MetaServer`` (the block index);
- **prefill**: a ``kvferry.Node`` and the model; computes a prompt, copies
  its KV into its own paged cache, saves the full blocks, runs the handoff
  barrier (``flush_saves_and_registrations``) and reports "KV ready";
- **decode**: a ``kvferry.Node`` and the same model; looks the prompt's
  blocks up in the MetaServer, fetches them from the prefill node into
  its own paged cache (``fetch_into``: each part loaded while the next is
  read), converts that into the model's cache and decodes greedily.

This process plays the router of a P/D deployment: it sends each request to
prefill, relays prefill's "KV ready" (with the barrier's report and a digest
of every saved block) to decode, and injects the faults.

Each paged cache is per layer K and V ``[num_blocks, block_tokens,
kv_heads, head_dim]`` (vLLM's "NHD"), registered with kvferry.

Cached prefix: the decode side reuses ``(len(prompt) - 1) // block_tokens``
blocks, so at least one prompt token is always computed.

The single-instance baseline runs in the decode process without kvferry:
the same prefill forward over the whole prompt, its cache cut to the same
prefix, then the same continuation. Greedy decoding is deterministic, so
"token identical" is exact equality, and "KV identical" compares a digest of
every fetched block's bytes with the prefill's. A fetch that stops short
(fault) falls back to that same local recompute, so its tokens must still be
identical (the engine can continue from the fetched prefix; this harness
recomputes everything to keep the comparison exact).

Usage::

    python pd_real_model.py --device cpu --json out.json     # numpy model (CI)
    python pd_real_model.py --device cuda --json out.json    # Qwen3, bf16, H200

Exits non-zero when any case fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# Bound on any one reply from a worker (seconds): a hung side fails the case
# instead of hanging the run.
REPLY_TIMEOUT_S = 300.0
# Bound on the decode side's whole handoff + decode in a fault case.
FAULT_DECODE_BOUND_S = 60.0


def now_ms() -> float:
    return time.perf_counter() * 1000.0


# ---------------------------------------------------------------- workers
def metaserver_main(conn) -> None:
    import kvferry

    ms = kvferry.MetaServer("127.0.0.1:0", stale_after_s=30, ttl_s=120)
    conn.send(ms.address)
    try:
        conn.recv()
    except EOFError:
        pass
    ms.shutdown()


def node_main(role: str, conn, opts: Dict[str, Any]) -> None:
    try:
        _node_loop(role, conn, opts)
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _node_loop(role: str, conn, opts: Dict[str, Any]) -> None:
    import kvferry
    import pd_models

    bt = opts["block_tokens"]
    model = pd_models.build(opts["device"], opts["size"], opts["paged_device"])
    ns = kvferry.namespace(
        f"pd-{opts['device']}-{opts['size']}", model.dtype_name, bt, 0, 1, model.num_layers
    )
    node = kvferry.Node(
        opts["metaserver"],
        pool_bytes=opts["pool_bytes"],
        gpu=opts["kvferry_gpu"],
        fetch_timeout=opts["fetch_timeout"],
        rpc_timeout=opts["rpc_timeout"],
    )
    pk, pv = model.new_paged(opts["num_blocks"], bt)
    info = node.register_kv_cache(ns, pk, pv, dtype=model.dtype_name)
    # Warm the model (first CUDA forward compiles kernels).
    model.decode(model.prefill(list(range(1, 2 * bt + 2))), list(range(1, 2 * bt + 3)), 2)
    conn.send(("up", {"fingerprint": model.fingerprint(), "node": node.address, "block_bytes": info.block_bytes}))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "stop":
            break
        if msg[0] == "prefill":
            conn.send(("ready", _prefill(kvferry, node, model, ns, pk, pv, bt, msg[1], opts)))
        elif msg[0] == "decode":
            conn.send(("decoded", _decode(kvferry, node, model, ns, pk, pv, bt, msg[1], msg[2], opts)))
    node.shutdown()


def _prefill(kvferry, node, model, ns, pk, pv, bt, tokens, opts) -> Dict[str, Any]:
    t0 = now_ms()
    kv = model.prefill(tokens)
    full = len(tokens) // bt
    model.to_paged(kv, pk, pv, full, bt)
    model.sync()
    t1 = now_ms()
    hashes = kvferry.block_hashes(ns, tokens, bt)
    assert len(hashes) == full
    save = node.save(ns, hashes, list(range(full)))
    t2 = now_ms()
    flush = node.flush_saves_and_registrations(timeout=opts["barrier_timeout"])
    t3 = now_ms()
    return {
        "blocks_saved": save.saved + save.already_resident,
        "compute_ms": t1 - t0,
        "save_ms": t2 - t1,
        "barrier_ms": t3 - t2,
        "flush": {"delivered": flush.delivered, "dropped": flush.dropped, "timed_out": flush.timed_out},
        "digests": model.block_digests(pk, pv, full),
    }


def _recompute(model, tokens, cached, n):
    """Single instance, no kvferry: prefill the prompt, keep ``cached``
    tokens of cache, continue."""
    t0 = now_ms()
    first = {}
    kv = model.prefill(tokens)
    kv = [(k[:, :cached], v[:, :cached]) for k, v in kv]
    out = model.decode(kv, tokens, n, on_first=lambda: first.setdefault("t", now_ms()))
    return out, first["t"] - t0


def _decode(kvferry, node, model, ns, pk, pv, bt, tokens, ready, opts) -> Dict[str, Any]:
    n = opts["decode_tokens"]
    usable = (len(tokens) - 1) // bt
    cached = usable * bt
    hashes = kvferry.block_hashes(ns, tokens, bt)[:usable]
    r: Dict[str, Any] = {"blocks_total": usable, "query_error": None, "fetch": None}
    # The single-instance baseline first, untimed: it also warms the
    # kernels for this prompt's shapes, so neither timed path pays that.
    base, _ = _recompute(model, tokens, cached, n)
    model.sync()
    t0 = now_ms()
    k = 0
    handoff = {"query": 0.0, "fetch": 0.0, "load": 0.0}
    if usable:
        q0 = now_ms()
        try:
            owners = node.query_prefix_remote(ns, hashes, timeout=opts["rpc_timeout"])
            r["owners"] = [(o.node, o.blocks) for o in owners]
        except kvferry.KvferryError as e:
            owners = []
            r["query_error"] = f"{type(e).__name__}: {e}"
        q1 = now_ms()
        handoff["query"] = q1 - q0
        if owners:
            # fetch_into: each verified part is loaded into the paged cache
            # while the next is read, so "fetch" covers the loads too and
            # "load" is what the device still had to finish afterwards.
            rep, lrep = node.fetch_into(ns, hashes, list(range(usable)), timeout=opts["fetch_timeout"])
            f1 = now_ms()
            handoff["fetch"] = f1 - q1
            model.sync()
            handoff["load"] = now_ms() - f1
            r["fetch"] = str(rep)
            r["bytes"] = rep.bytes
            k = rep.available
            r["blocks_fetched"] = rep.fetched
            if k and not lrep.ok:
                r["load_failed"] = [list(f) for f in lrep.failed]
                k = 0
    r.setdefault("blocks_fetched", 0)
    r.setdefault("bytes", 0)
    first = {}
    if k == usable and usable:
        kv = model.from_paged(pk, pv, k, bt)
        out = model.decode(kv, tokens, n, on_first=lambda: first.setdefault("t", now_ms()))
        r["path"] = "fetched"
        r["kv_identical"] = model.block_digests(pk, pv, k) == ready["digests"][:k]
    else:
        # Degrade: recompute locally (everything, see the module doc).
        kv = model.prefill(tokens)
        kv = [(kk[:, :cached], vv[:, :cached]) for kk, vv in kv]
        out = model.decode(kv, tokens, n, on_first=lambda: first.setdefault("t", now_ms()))
        r["path"] = "recomputed" if usable else "nothing-cacheable"
        r["kv_identical"] = None
    r["ttft_fetch_ms"] = first["t"] - t0
    r["decode_wall_ms"] = now_ms() - t0
    r["handoff_ms"] = dict(handoff, barrier=ready["barrier_ms"] if ready else None)
    r["tokens"] = out
    again, ttft_rec = _recompute(model, tokens, cached, n)
    r["baseline_tokens"] = base
    r["recompute_identical"] = again == base
    r["ttft_recompute_ms"] = ttft_rec
    r["token_identical"] = out == base and again == base
    return r


# ------------------------------------------------------------ orchestrator
class Proc:
    """A worker process and our end of its pipe."""

    def __init__(self, conn, p):
        self.conn, self.p = conn, p

    def recv(self, timeout: float = REPLY_TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no reply within {timeout} s")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise RuntimeError(f"worker failed:\n{msg[1]}")
        return msg

    def kill(self) -> None:
        if self.p.is_alive():
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.join(10)

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.p.join(30)
        if self.p.is_alive():
            self.kill()


class Cluster:
    """MetaServer, prefill and decode processes."""

    def __init__(self, ctx, opts: Dict[str, Any]):
        self.ms_conn, child = ctx.Pipe()
        self.ms = ctx.Process(target=metaserver_main, args=(child,), daemon=True)
        self.ms.start()
        child.close()
        if not self.ms_conn.poll(60):
            raise RuntimeError("metaserver did not start")
        opts = dict(opts, metaserver=self.ms_conn.recv())
        self.prefill = _spawn_node(ctx, "prefill", opts)
        self.decode = _spawn_node(ctx, "decode", opts)
        up_p = self.prefill.recv()[1]
        up_d = self.decode.recv()[1]
        if up_p["fingerprint"] != up_d["fingerprint"]:
            raise RuntimeError(f"prefill and decode built different models: {up_p} vs {up_d}")
        self.info = up_p

    def kill_metaserver(self) -> None:
        if self.ms.is_alive():
            os.kill(self.ms.pid, signal.SIGKILL)
        self.ms.join(10)

    def close(self) -> None:
        for p in (self.prefill, self.decode):
            if p.p.is_alive():
                p.stop()
        try:
            self.ms_conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.ms.join(10)
        if self.ms.is_alive():
            self.kill_metaserver()


def _spawn_node(ctx, role: str, opts: Dict[str, Any]) -> Proc:
    conn, child = ctx.Pipe()
    p = ctx.Process(target=node_main, args=(role, child, opts), daemon=True, name=role)
    p.start()
    child.close()
    return Proc(conn, p)


def run_case(cluster: Cluster, name: str, tokens: List[int], fault: Optional[str], opts) -> Dict[str, Any]:
    case: Dict[str, Any] = {"name": name, "prompt_tokens": len(tokens), "block_tokens": opts["block_tokens"], "fault": fault}
    t0 = time.monotonic()
    if fault == "metaserver":
        cluster.kill_metaserver()
    cluster.prefill.conn.send(("prefill", tokens))
    ready = cluster.prefill.recv()[1]
    if fault == "prefill":
        cluster.prefill.kill()
    cluster.decode.conn.send(("decode", tokens, ready))
    d = cluster.decode.recv()[1]
    wall = time.monotonic() - t0
    ttft_f, ttft_r = d["ttft_fetch_ms"], d["ttft_recompute_ms"]
    case.update(
        token_identical=d["token_identical"],
        kv_identical=d["kv_identical"],
        blocks_fetched=d["blocks_fetched"],
        blocks_total=d["blocks_total"],
        bytes=d["bytes"],
        handoff_ms=d["handoff_ms"],
        ttft_fetch_ms=round(ttft_f, 3),
        ttft_recompute_ms=round(ttft_r, 3),
        t9=round(ttft_f / ttft_r, 4) if ttft_r > 0 else None,
        path=d["path"],
        fetch=d["fetch"],
        query_error=d["query_error"],
        flush=ready["flush"],
        prefill_ms={"compute": ready["compute_ms"], "save": ready["save_ms"], "barrier": ready["barrier_ms"]},
        decode_tokens=d["tokens"],
        decode_wall_ms=round(d["decode_wall_ms"], 3),
        case_wall_s=round(wall, 3),
    )
    why = []
    if not d["token_identical"]:
        why.append(f"tokens differ: {d['tokens']} vs baseline {d['baseline_tokens']}")
    if d["kv_identical"] is False:
        why.append("fetched KV differs from the prefill's")
    if fault is None and d["blocks_fetched"] + 0 < d["blocks_total"]:
        why.append(f"only {d['blocks_fetched']} of {d['blocks_total']} blocks fetched: {d['fetch'] or d['query_error']}")
    if fault is not None:
        if d["path"] != "recomputed":
            why.append(f"expected a local recompute after the {fault} was killed, got path {d['path']}")
        if d["decode_wall_ms"] > FAULT_DECODE_BOUND_S * 1000:
            why.append(f"decode took {d['decode_wall_ms']:.0f} ms (bound {FAULT_DECODE_BOUND_S} s)")
    case["passed"] = not why
    case["why"] = why
    return case


def prompt(seed: int, n: int, vocab: int) -> List[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", metavar="PATH", help="write {'cases': [...]} here")
    ap.add_argument("--size", choices=["small", "large"], help="model size (default: cpu small, cuda large)")
    ap.add_argument("--kvferry-gpu", choices=["host", "cuda"], help="kvferry backend (default: cpu host, cuda cuda)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, help="greedy tokens per request (default: cpu 8, cuda 16)")
    ap.add_argument("--long-tokens", type=int, help="prompt length of the long case (default: cpu 1031, cuda 8192)")
    ap.add_argument("--cases", help="comma-separated case names to run (default: all)")
    args = ap.parse_args(argv)

    cuda = args.device == "cuda"
    bt = args.block_tokens
    long_n = args.long_tokens or (8192 if cuda else 64 * bt + 7)
    kv_gpu = args.kvferry_gpu or ("cuda" if cuda else "host")
    opts = {
        "device": args.device,
        "size": args.size or ("large" if cuda else "small"),
        "kvferry_gpu": kv_gpu,
        "paged_device": "cuda" if kv_gpu == "cuda" else "cpu",
        "block_tokens": bt,
        "decode_tokens": args.decode_tokens or (16 if cuda else 8),
        "num_blocks": long_n // bt + 8,
        "pool_bytes": (3 << 30) if cuda else (256 << 20),
        "fetch_timeout": 30.0 if cuda else 10.0,
        "rpc_timeout": 2.0,
        "barrier_timeout": 5.0,
    }
    vocab = 32000 if cuda else 512
    several = 4 * bt + 5
    cases = [
        ("block-1", bt - 1, None),
        ("block", bt, None),
        ("block+1", bt + 1, None),
        ("several-blocks", several, None),
        ("long", long_n, None),
        ("metaserver-killed", several, "metaserver"),
        ("prefill-killed", several, "prefill"),
    ]
    if args.cases:
        keep = set(args.cases.split(","))
        cases = [c for c in cases if c[0] in keep]
    if not cuda:
        # One BLAS thread per worker: the two model processes share the
        # machine's cores, and timings stay comparable.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    ctx = mp.get_context("spawn")
    results = []
    cluster = None
    print(f"pd_real_model: device={args.device} model={opts['size']} kvferry gpu={kv_gpu} block_tokens={bt}", flush=True)
    try:
        for i, (name, n, fault) in enumerate(cases):
            # A fault case breaks its cluster: it gets a fresh one, and so does the case after it.
            if cluster is None or fault is not None:
                if cluster is not None:
                    cluster.close()
                cluster = Cluster(ctx, opts)
            try:
                case = run_case(cluster, name, prompt(1000 + i, n, vocab), fault, opts)
            except Exception as e:  # a hang or a crashed worker fails the case, not the run
                case = {"name": name, "prompt_tokens": n, "fault": fault, "passed": False, "why": [repr(e)],
                        "token_identical": False, "kv_identical": None, "blocks_fetched": 0, "blocks_total": None,
                        "handoff_ms": None, "ttft_fetch_ms": None, "ttft_recompute_ms": None}
            if fault is not None:
                cluster.close()
                cluster = None
            results.append(case)
            h = case.get("handoff_ms") or {}
            print(
                f"{'PASS' if case['passed'] else 'FAIL'} {name:18} tokens={n:6} blocks={case.get('blocks_fetched')}/"
                f"{case.get('blocks_total')} bytes={case.get('bytes', 0)} handoff(ms) barrier={h.get('barrier') or 0:.1f} "
                f"query={h.get('query', 0):.1f} fetch={h.get('fetch', 0):.1f} load={h.get('load', 0):.1f} "
                f"ttft fetch={case.get('ttft_fetch_ms')} recompute={case.get('ttft_recompute_ms')} "
                f"T9={case.get('t9')} {'; '.join(case['why'])}",
                flush=True,
            )
    finally:
        if cluster is not None:
            cluster.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "options": opts, "cases": results}, f, indent=1)
    failed = [c["name"] for c in results if not c["passed"]]
    print(f"{len(results) - len(failed)} of {len(results)} cases passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
