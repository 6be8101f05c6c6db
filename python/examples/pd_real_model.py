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

The reference (single instance, no kvferry) runs in the decode process and
takes **the P/D path's exact operations**: the prefill forward over the
whole prompt (as the prefill process computes it), its first blocks written
into a paged cache shaped like kvferry's (``to_paged``, as prefill does),
read back with the same ``from_paged``, then the same continuation: one
forward over the same uncached suffix with the same cache length, then the
same greedy steps. The P/D path differs only in where the prefix blocks'
bytes come from (fetched from prefill instead of computed here), so with
bit-identical KV the two must give bit-identical logits, not merely the
same tokens (a reference that ran the whole prompt in one forward instead
would run other GEMM and attention shapes, round bf16 differently, and
could flip a near-tie of random weights). What this rules out: on the H200
the ``long`` case failed token identity with fetched KV bit-identical to the
prefill's (2026-12-02), and the decode process's own recompute changed
between two runs in one process (2026-12-01); neither the reference's
reproducibility nor its KV was checked then.

That equality is proved in the run, per case, before it judges:

1. Reference A (untimed, before the handoff; it also warms the kernels for
   the prompt's shapes) and reference B (timed, after it: the local
   recompute T9 divides by) must agree bit for bit: tokens, every step's
   logits, prefix KV. If not, the reference judges nothing: the case is a
   **harness failure** (``HARNESS`` line, ``harness_failure`` in the JSON,
   exit status 3), not a kvferry failure.
2. The reference's prefix KV must be bit-identical to the prefill
   process's (the same forward in another process); if not, a harness
   failure too.
3. kvferry's checks: the fetched blocks' digests equal the prefill's
   (``kv_identical``, every case that fetched); what the decode step read
   equals reference A's input bit for bit (``decode_input_identical``);
   tokens (``token_identical``) and logits (``logits_identical``) equal
   reference A's.

A fetch that stops short (fault) falls back to that same local recompute,
so its tokens must still be identical (the engine can continue from the
fetched prefix; this harness recomputes everything to keep the comparison
exact).

Library settings on CUDA (``pd_models.cuda_determinism``, the reasons
there): ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before CUDA starts in every
process (cuBLAS is reproducible with several active streams, such as
kvferry's, only with it); ``torch.use_deterministic_algorithms(True,
warn_only=True)`` (warnings reported in the JSON's ``determinism``); TF32
off; no autotuning (cuDNN benchmark, TunableOp); attention ``sdpa`` with
PyTorch's flash / memory-efficient kernels (deterministic forwards; cuDNN's
SDPA backend off), not ``eager``, which is no more deterministic but
materialises the scores (slower at 8,192 tokens, so it would inflate the
recompute T9 divides by). On the CPU the numpy model runs with one BLAS
thread per process.

With ``--handoff ticket`` the prefill also locks its saved blocks for the
decode node (``Node.grant_transfer``) and "KV ready" carries that ticket;
the decode's ``fetch_into(ticket=...)`` then reads at once, with no
MetaServer query and no lock round trip, so the handoff needs no
MetaServer at all: the ``metaserver-killed`` case is then expected to
fetch, not to recompute.

Reported per case (JSON): ``handoff_ms`` (``barrier``, ``ticket``, ``query``,
``fetch``, ``load``; ``fetch_phases_ms`` splits ``fetch`` by
``FetchReport.phases_ms``), ``handoff_total_ms`` and ``handoff_ratio`` (the
handoff, barrier call to KV in the decode's cache, ÷ the local recompute's
time to first token ``ttft_recompute_ms``), ``ttft_fetch_ms`` and ``t9``
(``ttft_fetch_ms`` ÷ ``ttft_recompute_ms``). The recompute's time includes
the reference's paged write and read, as an engine's forward writes its
own paged cache; ``reference_paged_ms`` is that round trip alone (timed in
reference A).

Usage::

    python pd_real_model.py --device cpu --json out.json     # numpy model (CI)
    python pd_real_model.py --device cuda --json out.json    # Qwen3, bf16, H200
    python pd_real_model.py --device cpu --model qwen        # Qwen3 on the CPU (slow; a check of that path)
    python pd_real_model.py --device cuda --device-lease     # decode copies the KV device to device (CUDA IPC)

Per case, ``paths`` says how many fetched blocks each path moved (``ipc``:
device to device from the prefill's cache under its device lease; ``shm``:
the prefill's shared pool; ``tcp``).

Exits 1 when any case fails, 3 when the reference was not reproducible
(harness failure).
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
    model = pd_models.build(opts["device"], opts["size"], opts["paged_device"], opts["model"])
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
    # The decode side's references run through paged caches of their own,
    # shaped like the one kvferry fetches into (see _reference).
    # Three: reference A, the degrade path's recompute, reference B.
    scratch = [model.new_paged(opts["num_blocks"], bt) for _ in range(3)] if role == "decode" else None
    # Warm the model (first CUDA forward compiles kernels); report what the
    # deterministic-algorithms switch warned about.
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.decode(model.prefill(list(range(1, 2 * bt + 2))), list(range(1, 2 * bt + 3)), 2)
        model.sync()
    det = dict(model.determinism(), warnings=sorted({str(w.message)[:300] for w in seen}))
    ask = node.transfer_ask()
    conn.send(("up", {"fingerprint": model.fingerprint(), "node": node.address, "block_bytes": info.block_bytes,
                      "determinism": det, "transfer_ask": (ask.requester, ask.device)}))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "stop":
            break
        if msg[0] == "prefill":
            conn.send(("ready", _prefill(kvferry, node, model, ns, pk, pv, bt, msg[1], msg[2], opts)))
        elif msg[0] == "decode":
            conn.send(("decoded", _decode(kvferry, node, model, ns, pk, pv, scratch, bt, msg[1], msg[2], opts)))
    node.shutdown()


_LEASES: List[str] = []  # the prefill's device leases not yet seen ended


def _wait_for_leases(node, ttl: float) -> None:
    """Blocks the leased cache blocks were promised for stay untouched until
    their lease ended (the decode read them, or the ttl passed)."""
    end = time.monotonic() + ttl + 1.0
    while _LEASES and time.monotonic() < end:
        for lease_id, _ns, _blocks, _how in node.ended_device_leases():
            if lease_id in _LEASES:
                _LEASES.remove(lease_id)
        if _LEASES:
            time.sleep(0.001)


def _prefill(kvferry, node, model, ns, pk, pv, bt, tokens, ask, opts) -> Dict[str, Any]:
    if opts["device_lease"]:
        _wait_for_leases(node, opts["lease_ttl"])
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
    if opts["device_lease"] and full:
        # A same-host decode may copy these blocks straight from this cache
        # (CUDA IPC) until it is done or the lease's ttl passes.
        _LEASES.append(node.grant_device_lease(ns, hashes, list(range(full)), ttl=opts["lease_ttl"]))
    t3 = now_ms()
    # --handoff ticket: "KV ready" carries the decode's transfer lock, on
    # the blocks the decode will fetch (it computes the last token itself).
    usable = (len(tokens) - 1) // bt
    ticket = None
    if ask is not None and usable:
        ticket = node.grant_transfer(ns, hashes[:usable], kvferry.TransferAsk(*ask))
    t4 = now_ms()
    return {
        "ticket": ticket,
        "ticket_ms": t4 - t3 if ticket is not None else 0.0,
        "blocks_saved": save.saved + save.already_resident,
        "compute_ms": t1 - t0,
        "save_ms": t2 - t1,
        "barrier_ms": t3 - t2,
        "flush": {"delivered": flush.delivered, "dropped": flush.dropped, "timed_out": flush.timed_out},
        "digests": model.block_digests(pk, pv, full),
    }


def _continue(model, kv, tokens, n, t0):
    """The decode step both paths share: from a prefix cache (per-layer K, V
    as ``from_paged`` made it), the forward over the rest of the prompt,
    then greedy steps. Returns tokens, time to first token since ``t0``,
    and every step's logits."""
    first: Dict[str, float] = {}
    logits: List[Any] = []
    out = model.decode(kv, tokens, n, on_first=lambda: first.setdefault("t", now_ms()), logits=logits)
    return out, first["t"] - t0, logits


def _reference(
    model, paged, tokens, usable, bt, n, t0: Optional[float] = None, drift: bool = False, measure: bool = False
) -> Dict[str, Any]:
    """Single instance, no kvferry, and the P/D path's exact operations.

    The prompt's prefill as the prefill process computes it (one forward
    over the whole prompt), its first ``usable`` blocks written into a
    paged cache of the same shape as kvferry's (``to_paged``, as prefill
    does), read back with the same ``from_paged`` the P/D path uses, then
    the same :func:`_continue`. So the decode step sees the same shapes,
    layouts and kernels in both paths, and with the same KV bytes it must
    produce the same logits bit for bit. Time to first token counts from
    ``t0`` (default: now). ``drift`` (the canary ``--inject
    reference-drift``) changes one prefix KV value, as a nondeterministic
    model would. ``measure`` (reference A, untimed) times the paged write
    and read on their own (synchronised), to show what of the recompute's
    time they are (an engine's own forward writes its paged cache too).
    """
    sk, sv = paged
    t0 = now_ms() if t0 is None else t0
    kv = model.prefill(tokens)
    paged_ms = None
    if usable:
        if measure:
            model.sync()
            p0 = now_ms()
        model.to_paged(kv, sk, sv, usable, bt)
        if drift:
            sk[0][0, 0, 0, 0] += 1.0
        kv = model.from_paged(sk, sv, usable, bt)
        if measure:
            model.sync()
            paged_ms = now_ms() - p0
    else:
        kv = []
    out, ttft, logits = _continue(model, kv, tokens, n, t0)
    return {"tokens": out, "ttft_ms": ttft, "logits": logits, "kv": kv, "paged": paged, "paged_ms": paged_ms}


def _decode(kvferry, node, model, ns, pk, pv, scratch, bt, tokens, ready, opts) -> Dict[str, Any]:
    n = opts["decode_tokens"]
    usable = (len(tokens) - 1) // bt
    hashes = kvferry.block_hashes(ns, tokens, bt)[:usable]
    r: Dict[str, Any] = {"blocks_total": usable, "query_error": None, "fetch": None}
    # Reference A first, untimed: it also warms the kernels for this
    # prompt's shapes, so neither timed path pays that.
    ref_a = _reference(model, scratch[0], tokens, usable, bt, n, measure=True)
    model.sync()
    t0 = now_ms()
    k = 0
    handoff = {"ticket": ready["ticket_ms"] if ready else 0.0, "query": 0.0, "fetch": 0.0, "load": 0.0}
    m0 = node.metrics()
    ticket = ready.get("ticket") if ready else None
    if usable:
        q0 = now_ms()
        owners = []
        if ticket is None:
            try:
                owners = node.query_prefix_remote(ns, hashes, timeout=opts["rpc_timeout"])
                r["owners"] = [(o.node, o.blocks) for o in owners]
            except kvferry.KvferryError as e:
                r["query_error"] = f"{type(e).__name__}: {e}"
        q1 = now_ms()
        handoff["query"] = q1 - q0 if ticket is None else 0.0
        if owners or ticket is not None:
            # fetch_into: each verified part is loaded into the paged cache
            # while the next is read, so "fetch" covers the loads too and
            # "load" is what the device still had to finish afterwards. It
            # starts from the owners just asked for (no second query), or
            # from the prefill's ticket (no query, no lock round trip).
            rep, lrep = node.fetch_into(
                ns, hashes, list(range(usable)), timeout=opts["fetch_timeout"],
                owners=None if ticket is not None else owners, ticket=ticket,
            )
            f1 = now_ms()
            handoff["fetch"] = f1 - q1
            model.sync()
            handoff["load"] = now_ms() - f1
            r["fetch"] = str(rep)
            r["fetch_phases_ms"] = {k: round(v, 3) for k, v in rep.phases_ms.items()}
            r["bytes"] = rep.bytes
            k = rep.available
            r["blocks_fetched"] = rep.fetched
            if k and not lrep.ok:
                r["load_failed"] = [list(f) for f in lrep.failed]
                k = 0
    r.setdefault("blocks_fetched", 0)
    r.setdefault("bytes", 0)
    m1 = node.metrics()
    # Which path moved the fetched blocks: device to device from the
    # prefill's cache (ipc), its shared pool (shm) or TCP.
    r["paths"] = {
        p: m1.get(f"path_{p}_blocks", 0) - m0.get(f"path_{p}_blocks", 0) for p in ("ipc", "shm", "tcp")
    }
    r["ipc_fallbacks"] = m1.get("path_ipc_fallbacks", 0) - m0.get("path_ipc_fallbacks", 0)
    if k == usable and usable:
        kv = model.from_paged(pk, pv, k, bt)
        out, ttft, logits = _continue(model, kv, tokens, n, t0)
        r["path"] = "fetched"
    else:
        # Degrade: recompute locally, the reference's own path (everything,
        # see the module doc).
        rec = _reference(model, scratch[1], tokens, usable, bt, n, t0=t0)
        out, kv, logits, ttft = rec["tokens"], rec["kv"], rec["logits"], rec["ttft_ms"]
        r["path"] = "recomputed" if usable else "nothing-cacheable"
    r["ttft_fetch_ms"] = ttft
    r["decode_wall_ms"] = now_ms() - t0
    r["handoff_ms"] = dict(handoff, barrier=ready["barrier_ms"] if ready else None)
    # Reference B, timed: the local recompute T9 and the handoff ratio
    # divide by.
    model.sync()
    ref_b = _reference(model, scratch[2], tokens, usable, bt, n, drift=opts["inject"] == "reference-drift")
    r["ttft_recompute_ms"] = ref_b["ttft_ms"]
    r["tokens"] = out
    r["baseline_tokens"] = ref_a["tokens"]
    r["recompute_tokens"] = ref_b["tokens"]
    r["reference_paged_ms"] = ref_a["paged_ms"]
    r.update(_judge(model, r, ready, usable, kv, logits, ref_a, ref_b, pk, pv))
    return r


def _judge(model, r, ready, usable, kv, logits, ref_a, ref_b, pk, pv) -> Dict[str, Any]:
    """Bit-for-bit comparisons, after everything timed has run."""
    j: Dict[str, Any] = {}
    # 1. The reference must reproduce itself: same tokens, same logits bit
    #    for bit, same prefix KV bit for bit.
    same = {
        "tokens": ref_a["tokens"] == ref_b["tokens"],
        "logits": model.logits_equal(ref_a["logits"], ref_b["logits"]),
        "prefix KV": model.kv_equal(ref_a["kv"], ref_b["kv"]),
    }
    j["reference_reproducible"] = all(same.values())
    j["reference_differs"] = [what for what, ok in same.items() if not ok]
    # 2. kvferry's byte check: the fetched blocks are the prefill's. And
    #    what the decode step consumed is, bit for bit, what reference A's
    #    did (for the fetched path: the fetched blocks as the decode step
    #    read them, not only as the cache holds them now).
    prefill_digests = ready["digests"][:usable] if ready else None
    fetched = r["path"] == "fetched"
    j["kv_identical"] = model.block_digests(pk, pv, usable) == prefill_digests if fetched else None
    j["decode_input_identical"] = model.kv_equal(kv, ref_a["kv"])
    # 3. The reference's prefix KV (this process's prefill of the prompt)
    #    must be the prefill process's, or the comparison is not exact.
    #    Digested only when it does not follow from 2 (1.2 GB at 8 k tokens).
    if not usable or prefill_digests is None:
        j["reference_kv_identical"] = None
    elif fetched and j["kv_identical"] and j["decode_input_identical"]:
        j["reference_kv_identical"] = True  # reference A's KV = fetched = prefill's
    else:
        sk, sv = ref_a["paged"]
        j["reference_kv_identical"] = model.block_digests(sk, sv, usable) == prefill_digests
    j["logits_identical"] = model.logits_equal(logits, ref_a["logits"])
    j["token_identical"] = r["tokens"] == ref_a["tokens"] and j["reference_reproducible"]
    return j


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
        self.decode_ask = up_d["transfer_ask"]
        self.determinism = {"prefill": up_p["determinism"], "decode": up_d["determinism"]}

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
    ask = cluster.decode_ask if opts["handoff"] == "ticket" else None
    cluster.prefill.conn.send(("prefill", tokens, ask))
    ready = cluster.prefill.recv()[1]
    if fault == "prefill":
        cluster.prefill.kill()
    cluster.decode.conn.send(("decode", tokens, ready))
    d = cluster.decode.recv()[1]
    wall = time.monotonic() - t0
    ttft_f, ttft_r = d["ttft_fetch_ms"], d["ttft_recompute_ms"]
    h = d["handoff_ms"]
    # The handoff: the prefill's barrier call until the KV is in the decode's
    # cache (barrier + query + fetch with its loads + the load tail).
    handoff_total = (
        (h["barrier"] or 0.0) + h["ticket"] + h["query"] + h["fetch"] + h["load"] if d["path"] == "fetched" else None
    )
    case.update(
        token_identical=d["token_identical"],
        kv_identical=d["kv_identical"],
        blocks_fetched=d["blocks_fetched"],
        blocks_total=d["blocks_total"],
        bytes=d["bytes"],
        handoff_ms=d["handoff_ms"],
        handoff_total_ms=round(handoff_total, 3) if handoff_total is not None else None,
        handoff_ratio=round(handoff_total / ttft_r, 4) if handoff_total is not None and ttft_r > 0 else None,
        ttft_fetch_ms=round(ttft_f, 3),
        ttft_recompute_ms=round(ttft_r, 3),
        t9=round(ttft_f / ttft_r, 4) if ttft_r > 0 else None,
        path=d["path"],
        paths=d["paths"],
        ipc_fallbacks=d["ipc_fallbacks"],
        fetch=d["fetch"],
        fetch_phases_ms=d.get("fetch_phases_ms"),
        query_error=d["query_error"],
        flush=ready["flush"],
        prefill_ms={"compute": ready["compute_ms"], "save": ready["save_ms"], "barrier": ready["barrier_ms"]},
        decode_tokens=d["tokens"],
        reference_tokens=d["baseline_tokens"],
        reference_reproducible=d["reference_reproducible"],
        reference_differs=d["reference_differs"],
        reference_kv_identical=d["reference_kv_identical"],
        decode_input_identical=d["decode_input_identical"],
        logits_identical=d["logits_identical"],
        reference_paged_ms=round(d["reference_paged_ms"], 3) if d["reference_paged_ms"] is not None else None,
        decode_wall_ms=round(d["decode_wall_ms"], 3),
        case_wall_s=round(wall, 3),
    )
    # Harness failures first: when the reference cannot judge, say so, and
    # say it is not kvferry's.
    harness = []
    if not d["reference_reproducible"]:
        harness.append(
            "HARNESS: the reference is not reproducible: two single-instance recomputes of this prompt in one "
            f"process differ in {' and '.join(d['reference_differs'])} (tokens {d['baseline_tokens']} vs "
            f"{d['recompute_tokens']}); the model is not deterministic here, so token identity judges nothing"
        )
    if d["reference_kv_identical"] is False:
        harness.append(
            "HARNESS: the decode process's prefill of the prompt is not bit-identical to the prefill process's "
            "(same model, same forward): the model is not deterministic across processes"
        )
    why = list(harness)
    if d["kv_identical"] is False:
        why.append("fetched KV differs from the prefill's")
    if not harness and d["kv_identical"] is not False and not d["decode_input_identical"]:
        why.append("the decode step read other KV than reference A's, though the cache holds the prefill's blocks "
                   "(changed after the decode read it?)")
    if d["tokens"] != d["baseline_tokens"]:
        why.append(f"tokens differ: {d['tokens']} vs reference {d['baseline_tokens']}")
    elif not harness and d["decode_input_identical"] and not d["logits_identical"]:
        why.append("logits differ bit for bit from reference A's on bit-identical input KV (the tokens agree): "
                   "the decode step is not deterministic next to kvferry's activity")
    if fault is None and d["blocks_fetched"] + 0 < d["blocks_total"]:
        why.append(f"only {d['blocks_fetched']} of {d['blocks_total']} blocks fetched: {d['fetch'] or d['query_error']}")
    if fault is not None:
        # A ticket needs no MetaServer: that handoff still fetches.
        expect = "fetched" if fault == "metaserver" and opts["handoff"] == "ticket" else "recomputed"
        if d["path"] != expect:
            why.append(f"expected path {expect} after the {fault} was killed, got path {d['path']}")
        if d["decode_wall_ms"] > FAULT_DECODE_BOUND_S * 1000:
            why.append(f"decode took {d['decode_wall_ms']:.0f} ms (bound {FAULT_DECODE_BOUND_S} s)")
    case["harness_failure"] = bool(harness)
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
    ap.add_argument("--model", choices=["numpy", "qwen"],
                    help="model (default: cpu numpy, cuda qwen; qwen on the cpu checks that path, slowly)")
    ap.add_argument("--device-lease", action="store_true",
                    help="the prefill grants a device lease on what it saved, so the decode (same host) copies "
                    "the KV device to device from the prefill's cache (CUDA IPC with --kvferry-gpu cuda)")
    ap.add_argument("--handoff", choices=["query", "ticket"], default="query",
                    help="query: the decode asks the MetaServer who holds the prompt and locks the blocks there; "
                    "ticket: the prefill locks its blocks for the decode as it says KV ready and hands it the lock "
                    "(no query, no lock round trip; the handoff then needs no MetaServer)")
    ap.add_argument("--inject", choices=["reference-drift"],
                    help="canary: reference B drifts (one prefix KV value changed); "
                    "the run must end in a harness failure")
    args = ap.parse_args(argv)
    run_t0 = time.monotonic()

    cuda = args.device == "cuda"
    model_kind = args.model or ("qwen" if cuda else "numpy")
    if cuda and model_kind != "qwen":
        ap.error("--device cuda runs the qwen model")
    bt = args.block_tokens
    long_n = args.long_tokens or (8192 if cuda else 64 * bt + 7)
    kv_gpu = args.kvferry_gpu or ("cuda" if cuda else "host")
    opts = {
        "device_lease": args.device_lease,
        "handoff": args.handoff,
        "lease_ttl": 30.0,
        "device": args.device,
        "size": args.size or ("large" if cuda else "small"),
        "model": model_kind,
        "inject": args.inject,
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
    vocab = 32000 if model_kind == "qwen" else 512
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
        # machine's cores, timings stay comparable, and a BLAS library's
        # split of the work (and so its rounding) cannot vary.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    else:
        import pd_models

        pd_models.cuda_determinism_env()  # before any worker starts CUDA
    ctx = mp.get_context("spawn")
    results = []
    clusters: List[Dict[str, Any]] = []
    cluster = None
    print(f"pd_real_model: device={args.device} model={model_kind} {opts['size']} kvferry gpu={kv_gpu} "
          f"block_tokens={bt}", flush=True)
    try:
        for i, (name, n, fault) in enumerate(cases):
            # A fault case breaks its cluster: it runs on the current one (or a
            # fresh one), and the case after it gets a fresh one.
            if cluster is None:
                c0 = time.monotonic()
                cluster = Cluster(ctx, opts)
                clusters.append({"start_s": round(time.monotonic() - c0, 3), "determinism": cluster.determinism})
                if len(clusters) == 1:
                    print(f"determinism: {json.dumps(cluster.determinism['decode'], sort_keys=True)}", flush=True)
            try:
                case = run_case(cluster, name, prompt(1000 + i, n, vocab), fault, opts)
            except Exception as e:  # a hang or a crashed worker fails the case, not the run
                case = {"name": name, "prompt_tokens": n, "fault": fault, "passed": False, "why": [repr(e)],
                        "harness_failure": False, "token_identical": False, "kv_identical": None,
                        "blocks_fetched": 0, "blocks_total": None, "handoff_ms": None, "handoff_ratio": None,
                        "ttft_fetch_ms": None, "ttft_recompute_ms": None, "t9": None}
            if fault is not None:
                cluster.close()
                cluster = None
            results.append(case)
            h = case.get("handoff_ms") or {}
            verdict = "HARNESS" if case.get("harness_failure") else "PASS" if case["passed"] else "FAIL"
            print(
                f"{verdict} {name:18} tokens={n:6} blocks={case.get('blocks_fetched')}/"
                f"{case.get('blocks_total')} bytes={case.get('bytes', 0)} handoff(ms) barrier={h.get('barrier') or 0:.1f} "
                f"query={h.get('query', 0):.1f} fetch={h.get('fetch', 0):.1f} load={h.get('load', 0):.1f} "
                f"ttft fetch={case.get('ttft_fetch_ms')} recompute={case.get('ttft_recompute_ms')} "
                f"T9={case.get('t9')} handoff/recompute={case.get('handoff_ratio')} paths={case.get('paths')} "
                f"{'; '.join(case['why'])}",
                flush=True,
            )
    finally:
        if cluster is not None:
            cluster.close()
    wall = round(time.monotonic() - run_t0, 3)
    harness = [c["name"] for c in results if c.get("harness_failure")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "options": opts, "run_wall_s": wall, "clusters": clusters,
                       "harness_failures": harness, "cases": results}, f, indent=1)
    failed = [c["name"] for c in results if not c["passed"]]
    print(f"{len(results) - len(failed)} of {len(results)} cases passed" + (f"; failed: {failed}" if failed else "")
          + f" (run {wall:.1f} s, {len(clusters)} cluster starts)")
    if harness:
        # Loudly, and with its own exit status: not a kvferry failure.
        print(f"HARNESS FAILURE: the single-instance reference could not judge cases {harness} (not reproducible "
              "in one process, or its KV not the prefill process's); their token comparison judged nothing "
              "(not a kvferry failure)", flush=True)
        return 3
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
