"""P/D through vLLM's real Scheduler: a prefill instance (kv_producer) and a
decode instance (kv_consumer). The prefill keeps a finished request's blocks
under a device lease until the decode has read them (vLLM's delayed free),
and hands the decode the params it needs."""

import time

import torch
from conftest import BS, Instance, expected_tokens, extra, prompt


def capture(inst, what):
    """Records the connector metadata of every step of ``inst``."""
    seen = []

    def hook(so):
        seen.append(so.kv_connector_metadata)

    inst.hook = hook
    return seen


def prefill(p_inst, req_id, tokens):
    p_inst.add(req_id, tokens, max_tokens=1)
    p_inst.run(until=lambda: req_id in p_inst.finished, timeout=30)
    return p_inst.finished[req_id].kv_transfer_params


def test_pd_handoff_delayed_free_and_identical_kv(tiny_model, metaserver):
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=30.0))
    D = Instance(tiny_model, "kv_consumer", extra(metaserver))
    try:
        p_meta, d_meta = capture(P, "p"), capture(D, "d")
        tokens = prompt(6 * BS + 5, seed=21)
        params = prefill(P, "r", tokens)
        kp = params["kvferry"]
        assert kp["blocks"] == 6 and kp["owner"] == P.worker.node.address
        assert kp["namespace"] == D.connector.ns
        assert P.worker.stats["flushes"] == 1 and P.worker.stats["leases_granted"] == 1
        # Delayed free: the prefill still holds the request's blocks.
        for _ in range(5):
            P.step()
        assert P.free_blocks() < P.free_at_start
        # The decode loads 6 blocks asynchronously, then decodes.
        D.add("r", tokens, max_tokens=5, params=params)
        D.run()
        assert D.outputs["r"] == expected_tokens(tokens, 5)
        loads = [j for m in d_meta for j in m.loads]
        assert [len(j.hashes) for j in loads] == [6]
        assert D.worker.stats["loaded_blocks"] == 6
        # Fetched KV is bit-identical to the prefill's blocks.
        leased = [j for m in p_meta for j in m.saves if j.lease]
        assert len(leased) == 1 and len(leased[0].lease_block_ids) == 6
        for name in P.kv:
            src = P.kv[name][leased[0].lease_block_ids]
            dst = D.kv[name][loads[0].block_ids]
            assert torch.equal(src, dst)
        # The decode's read released the lease: the prefill frees long
        # before lease_ttl (30 s).
        t0 = time.monotonic()
        P.run(until=lambda: P.free_blocks() == P.free_at_start, timeout=10)
        assert time.monotonic() - t0 < 10
        assert D.free_blocks() == D.free_at_start
        assert "r" not in P.scheduler.requests
    finally:
        P.close()
        D.close()


def test_pd_lease_expires_when_no_decode_reads(tiny_model, metaserver):
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=1.0))
    try:
        tokens = prompt(3 * BS + 1, seed=22)
        t0 = time.monotonic()  # before the lease is granted
        prefill(P, "r", tokens)
        P.step()
        assert P.free_blocks() < P.free_at_start
        P.run(until=lambda: P.free_blocks() == P.free_at_start, timeout=10)
        held = time.monotonic() - t0
        assert 1.0 <= held < 5, held  # held for the lease's ttl (1 s), then freed
    finally:
        P.close()


def test_pd_without_lease_frees_at_once(tiny_model, metaserver):
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=0))
    D = Instance(tiny_model, "kv_consumer", extra(metaserver))
    try:
        tokens = prompt(3 * BS + 1, seed=23)
        params = prefill(P, "r", tokens)
        assert P.free_blocks() == P.free_at_start  # freed with the request
        assert P.worker.stats["flushes"] == 1 and P.worker.stats["leases_granted"] == 0  # the barrier still ran
        D.add("r", tokens, max_tokens=3, params=params)
        D.run()
        assert D.outputs["r"] == expected_tokens(tokens, 3)
        assert D.worker.stats["loaded_blocks"] == 3
    finally:
        P.close()
        D.close()


def test_pd_prefill_killed_decode_recomputes(tiny_model, metaserver):
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=30.0))
    D = Instance(tiny_model, "kv_consumer", extra(metaserver, fetch_timeout=3.0))
    try:
        tokens = prompt(5 * BS + 2, seed=24)
        params = prefill(P, "r", tokens)
        P.worker.node.kill()
        t0 = time.monotonic()
        D.add("r", tokens, max_tokens=4, params=params)
        D.run(timeout=30)
        assert time.monotonic() - t0 < 15
        assert D.outputs["r"] == expected_tokens(tokens, 4)
        assert D.worker.stats["loaded_blocks"] == 0 and D.worker.stats["failed_blocks"] == 5
        assert D.free_blocks() == D.free_at_start
    finally:
        D.close()
        P.scheduler.shutdown()


def test_pd_consumer_does_not_save_and_producer_does_not_load(tiny_model, metaserver):
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=0))
    D = Instance(tiny_model, "kv_consumer", extra(metaserver))
    try:
        tokens = prompt(3 * BS + 1, seed=25)
        D.add("d", tokens, max_tokens=2)
        D.run()
        assert D.worker.stats["saved_blocks"] == 0
        prefill(P, "a", tokens)
        prefill(P, "b", tokens)  # vLLM's own prefix cache hits; kvferry is not asked
        assert P.connector.stats["queries"] == 0 and P.worker.stats["loaded_blocks"] == 0
    finally:
        P.close()
        D.close()


def test_decode_warns_when_params_name_other_blocks(tiny_model, metaserver, caplog):
    """Params from a prefill in another namespace (or over other tokens) are
    named in a warning; the decode still answers from what it can find."""
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=0))
    D = Instance(tiny_model, "kv_consumer", extra(metaserver))
    try:
        tokens = prompt(3 * BS + 1, seed=26)
        params = prefill(P, "r", tokens)
        other = {"kvferry": dict(params["kvferry"], namespace="kvferry1|model=another")}
        with caplog.at_level("WARNING", logger="kvferry.vllm"):
            D.add("a", tokens, max_tokens=2, params=other)
            D.run()
        assert any("namespace" in r.getMessage() and "another" in r.getMessage() for r in caplog.records)
        caplog.clear()
        wrong = {"kvferry": dict(params["kvferry"], last_hash="00" * 32)}
        with caplog.at_level("WARNING", logger="kvferry.vllm"):
            D.add("b", prompt(3 * BS + 1, seed=27), max_tokens=2, params=wrong)
            D.run()
        assert any("differ" in r.getMessage() for r in caplog.records)
        assert D.outputs["a"] == expected_tokens(tokens, 2)
    finally:
        P.close()
        D.close()


def test_preempted_producer_request_revokes_its_lease(tiny_model, metaserver):
    """A producer request keeps decoding after its handoff and is preempted
    (the newest running request, on a small instance): its lease is revoked
    before vLLM reuses the blocks, it is recomputed, finishes with the right
    tokens, and every block comes back."""
    P = Instance(tiny_model, "kv_producer", extra(metaserver, lease_ttl=3.0), num_blocks=14)
    try:
        b_prompt, a_prompt = prompt(3 * BS + 2, seed=28), prompt(3 * BS + 4, seed=29)
        P.add("b", b_prompt, max_tokens=60)
        P.step()
        P.add("a", a_prompt, max_tokens=60)
        preempted = []
        P.hook = lambda so: preempted.extend(so.preempted_req_ids or ())
        P.run(timeout=60)
        assert "a" in preempted
        assert P.worker.stats["leases_granted"] >= 2 and P.worker.stats.get("leases_revoked", 0) >= 1
        assert P.outputs["a"] == expected_tokens(a_prompt, 60)
        assert P.outputs["b"] == expected_tokens(b_prompt, 60)
        assert P.free_blocks() == P.free_at_start
    finally:
        P.close()
