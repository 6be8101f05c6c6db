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
                    "handoff_ms", "handoff_total_ms", "handoff_ratio", "ttft_fetch_ms", "ttft_recompute_ms", "t9",
                    "fault", "reference_reproducible", "reference_kv_identical", "decode_input_identical",
                    "logits_identical", "harness_failure"):
            assert key in c, (c["name"], key)
        assert c["token_identical"] is True, c
        # The reference proved itself in the run, and the P/D decode step ran on
        # bit-identical input to logits bit-identical to it.
        assert c["reference_reproducible"] is True and c["harness_failure"] is False, c
        assert c["decode_input_identical"] is True and c["logits_identical"] is True, c
        assert c["reference_kv_identical"] is (None if c["blocks_total"] == 0 else True), c
        assert c["passed"], c
    bt = cases["block"]["block_tokens"]
    # A prompt of exactly one block leaves its only block uncached (one token must be computed).
    assert cases["block"]["blocks_total"] == 0 and cases["block"]["kv_identical"] is None
    assert cases["block+1"]["blocks_fetched"] == 1 and cases["block+1"]["kv_identical"] is True
    long = cases["long"]
    assert long["blocks_fetched"] == long["blocks_total"] == (long["prompt_tokens"] - 1) // bt
    assert long["kv_identical"] is True
    h = long["handoff_ms"]
    assert long["handoff_total_ms"] == round(h["barrier"] + h["ticket"] + h["query"] + h["fetch"] + h["load"], 3)
    assert h["ticket"] == 0.0
    assert long["handoff_ratio"] > 0 and long["t9"] > 0
    assert cases["block"]["handoff_ratio"] is None  # nothing fetched, no handoff
    for fault in ("metaserver-killed", "prefill-killed"):
        assert cases[fault]["blocks_fetched"] == 0 and cases[fault]["kv_identical"] is None
        assert cases[fault]["fault"] in ("metaserver", "prefill")


def test_pd_real_model_fails_loudly_when_the_reference_drifts(tmp_path):
    """Canary: a reference that does not reproduce itself ends the run as a
    harness failure (exit 3, its own message), not as a pass or a kvferry
    failure."""
    out = tmp_path / "pd.json"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--cases", "several-blocks", "--inject", "reference-drift",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "HARNESS FAILURE" in r.stdout and "HARNESS several-blocks" in r.stdout, r.stdout
    doc = json.loads(out.read_text())
    assert doc["harness_failures"] == ["several-blocks"]
    (c,) = doc["cases"]
    assert c["harness_failure"] is True and c["reference_reproducible"] is False and not c["passed"]
    # kvferry's own checks still ran and held.
    assert c["kv_identical"] is True and c["decode_input_identical"] is True


def test_pd_real_model_on_cpu_with_a_ticket_handoff(tmp_path):
    """--handoff ticket: "KV ready" carries the decode's transfer lock, so
    the long case fetches every block with no MetaServer query, and a
    killed MetaServer no longer stops the handoff (a killed prefill still
    degrades to a local recompute)."""
    out = tmp_path / "pd.json"
    r = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--handoff", "ticket", "--cases",
         "long,metaserver-killed,prefill-killed", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    cases = {c["name"]: c for c in json.loads(out.read_text())["cases"]}
    for c in cases.values():
        assert c["passed"] and c["token_identical"] is True, c
    long = cases["long"]
    assert long["blocks_fetched"] == long["blocks_total"] > 0 and long["kv_identical"] is True
    assert long["handoff_ms"]["query"] == 0.0 and long["handoff_ms"]["ticket"] > 0
    ms = cases["metaserver-killed"]
    assert ms["path"] == "fetched" and ms["blocks_fetched"] == ms["blocks_total"] > 0 and ms["kv_identical"] is True
    assert cases["prefill-killed"]["path"] == "recomputed"
