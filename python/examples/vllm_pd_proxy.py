#!/usr/bin/env python3
"""A minimal P/D router for two vLLM instances running KvferryConnector.

For each OpenAI completion or chat request it:

1. sends the request to the **prefill** instance (``kv_role``
   ``kv_producer``) with one output token (``max_tokens`` /
   ``max_completion_tokens`` = 1, no streaming): prefill computes the
   prompt, saves its blocks into its kvferry node, runs the handoff barrier
   and answers with ``kv_transfer_params`` (``{"kvferry": {...}}``);
2. sends the original request, with those ``kv_transfer_params``, to the
   **decode** instance (``kv_consumer``), which loads the prompt's blocks
   from the prefill's node through kvferry (recomputing whatever it could
   not load) and generates; its answer (streamed or not) goes back to the
   client unchanged.

If the prefill instance fails, the request still goes to decode (without
params): the decode computes the whole prompt itself.

Standard library only::

    python vllm_pd_proxy.py --prefill http://10.0.0.11:8100 --decode http://10.0.0.12:8200 --port 8000
    curl localhost:8000/v1/completions -d '{"model": "M", "prompt": "...", "max_tokens": 64}'
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_request(body: Dict[str, Any]) -> Dict[str, Any]:
    """The request prefill gets: one output token, no stream."""
    req = copy.deepcopy(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    return req


def decode_request(body: Dict[str, Any], kv_transfer_params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The request decode gets: the client's, with the prefill's params."""
    req = copy.deepcopy(body)
    if kv_transfer_params:
        req["kv_transfer_params"] = kv_transfer_params
    else:
        req.pop("kv_transfer_params", None)
    return req


def post(url: str, body: Dict[str, Any], timeout: float):
    data = json.dumps(body).encode()
    r = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(r, timeout=timeout)


def run_prefill(base: str, path: str, body: Dict[str, Any], timeout: float) -> Tuple[Optional[Dict[str, Any]], str]:
    """Returns (kv_transfer_params or None, a note for the log)."""
    try:
        with post(base + path, prefill_request(body), timeout) as resp:
            answer = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, f"prefill failed ({e}); decode computes the prompt"
    params = answer.get("kv_transfer_params")
    if not params:
        return None, "prefill returned no kv_transfer_params (prompt shorter than one block?)"
    return params, "ok"


class Handler(BaseHTTPRequestHandler):
    prefill = ""
    decode = ""
    timeout = 600.0
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quieter than the default
        sys.stderr.write("vllm_pd_proxy: " + (fmt % args) + "\n")

    def _reply(self, code: int, obj: Dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path not in ROUTES:
            self._reply(404, {"error": f"unknown route {self.path}; routes: {list(ROUTES)}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        except ValueError as e:
            self._reply(400, {"error": f"request body is not JSON: {e}"})
            return
        params, note = run_prefill(self.prefill, self.path, body, self.timeout)
        if params is None:
            self.log_message("%s", note)
        try:
            resp = post(self.decode + self.path, decode_request(body, params), self.timeout)
        except urllib.error.HTTPError as e:
            self._reply(e.code, {"error": f"decode answered {e.code}: {e.read()[:500]!r}"})
            return
        except (urllib.error.URLError, OSError) as e:
            self._reply(502, {"error": f"decode unreachable: {e}"})
            return
        with resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="prefill instance base URL, e.g. http://10.0.0.11:8100")
    ap.add_argument("--decode", required=True, help="decode instance base URL, e.g. http://10.0.0.12:8200")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    a = ap.parse_args(argv)
    Handler.prefill, Handler.decode, Handler.timeout = a.prefill.rstrip("/"), a.decode.rstrip("/"), a.timeout
    srv = ThreadingHTTPServer((a.host, a.port), Handler)
    print(f"vllm_pd_proxy: http://{a.host}:{a.port} -> prefill {a.prefill}, decode {a.decode}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
