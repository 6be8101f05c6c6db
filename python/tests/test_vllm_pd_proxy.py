"""The P/D router example (python/examples/vllm_pd_proxy.py) against two
stand-in vLLM servers: prefill gets one output token and no stream, decode
gets the client's request plus the prefill's kv_transfer_params, and the
decode's (streamed) answer reaches the client unchanged; a prefill that is
down still gets the request decoded."""

import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import vllm_pd_proxy  # noqa: E402

PARAMS = {"kvferry": {"namespace": "ns", "owner": "127.0.0.1:1", "blocks": 3, "last_hash": "ab" * 32}}


def serve(handler_cls):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def upstreams():
    seen = {"prefill": [], "decode": []}

    class Prefill(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["prefill"].append((self.path, body))
            data = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Decode(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["decode"].append((self.path, body))
            chunks = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(sum(map(len, chunks))))
            self.end_headers()
            for c in chunks:
                self.wfile.write(c)

    p, purl = serve(Prefill)
    d, durl = serve(Decode)
    yield seen, purl, durl
    p.shutdown()
    d.shutdown()


def proxy(prefill, decode):
    vllm_pd_proxy.Handler.prefill, vllm_pd_proxy.Handler.decode = prefill, decode
    vllm_pd_proxy.Handler.timeout = 10
    return serve(vllm_pd_proxy.Handler)


def ask(url, path, body):
    r = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=10) as resp:
        return resp.status, resp.read()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_routes_prefill_then_decode(upstreams, path):
    seen, purl, durl = upstreams
    srv, url = proxy(purl, durl)
    try:
        body = {"model": "m", "prompt": "hello", "max_tokens": 50, "max_completion_tokens": 50, "stream": True}
        status, out = ask(url, path, body)
        assert status == 200 and out == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
        (ppath, pbody), = seen["prefill"]
        assert ppath == path and pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1
        assert pbody["stream"] is False and pbody["prompt"] == "hello"
        (dpath, dbody), = seen["decode"]
        assert dpath == path and dbody["kv_transfer_params"] == PARAMS
        assert dbody["max_tokens"] == 50 and dbody["stream"] is True
    finally:
        srv.shutdown()


def test_prefill_down_still_decodes(upstreams):
    seen, _, durl = upstreams
    srv, url = proxy("http://127.0.0.1:9", durl)  # nothing listens on the discard port
    try:
        status, _ = ask(url, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 5})
        assert status == 200
        (_, dbody), = seen["decode"]
        assert "kv_transfer_params" not in dbody and dbody["max_tokens"] == 5
    finally:
        srv.shutdown()


def test_unknown_route_is_404(upstreams):
    _, purl, durl = upstreams
    srv, url = proxy(purl, durl)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            ask(url, "/v1/embeddings", {})
        assert e.value.code == 404
    finally:
        srv.shutdown()
