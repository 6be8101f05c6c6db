"""The P/D example on CPU: three processes, the numpy model."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "examples", "pd_real_model.py")


def test_pd_real_model_on_cpu(tmp_path):
    out = tmp_path / "pd.json"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    cases = {c["name"]: c for c in json.loads(out.read_text())["cases"]}
    assert set(cases) == {
        "block-1", "block", "block+1", "several-blocks", "long", "metaserver-killed", "prefill-killed"
    }
    for c in cases.values():
        for key in ("name", "prompt_tokens", "token_identical", "kv_identical", "blocks_fetched", "blocks_total",
                    "handoff_ms", "ttft_fetch_ms", "ttft_recompute_ms", "fault"):
            assert key in c, (c["name"], key)
        assert c["token_identical"] is True, c
        assert c["passed"], c
    bt = cases["block"]["block_tokens"]
    # A prompt of exactly one block leaves its only block uncached (one token must be computed).
    assert cases["block"]["blocks_total"] == 0 and cases["block"]["kv_identical"] is None
    assert cases["block+1"]["blocks_fetched"] == 1 and cases["block+1"]["kv_identical"] is True
    long = cases["long"]
    assert long["blocks_fetched"] == long["blocks_total"] == (long["prompt_tokens"] - 1) // bt
    assert long["kv_identical"] is True
    for fault in ("metaserver-killed", "prefill-killed"):
        assert cases[fault]["blocks_fetched"] == 0 and cases[fault]["kv_identical"] is None
        assert cases[fault]["fault"] in ("metaserver", "prefill")
