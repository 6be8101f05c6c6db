"""vLLM's real v1 Scheduler (CPU) drives KvferryConnector: cross-instance
prefix hits, partial hits, misses, asynchronous loads, preemption, load
failures -> recompute, delayed frees, aborts mid-load. Every test also
checks, through the stand-in model (conftest), that no request ever reads a
wrong KV block, and that every block vLLM allocated is free again at the end."""

import threading
import time

import pytest
from conftest import BS, Instance, expected_tokens, extra, prompt

from vllm.v1.request import RequestStatus


def pair(tiny_model, ms, role_a="kv_both", role_b="kv_both", blocks_a=64, blocks_b=64, layout="LBHNC", **kw):
    a = Instance(tiny_model, role_a, extra(ms, **kw), num_blocks=blocks_a, layout=layout)
    b = Instance(tiny_model, role_b, extra(ms, **kw), num_blocks=blocks_b, layout=layout)
    return a, b


def finish(inst, req_id, p, max_tokens=4):
    inst.run()
    assert inst.outputs[req_id] == expected_tokens(p, max_tokens)
    assert inst.free_blocks() == inst.free_at_start, "a block leaked"


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_hit_from_another_instance(tiny_model, metaserver, layout):
    a, b = pair(tiny_model, metaserver, layout=layout)
    try:
        p = prompt(5 * BS + 3, seed=1)  # 5 full blocks
        a.add("r1", p)
        finish(a, "r1", p)
        assert a.worker.stats["saved_blocks"] == 5
        # b has never seen the prompt: all 5 blocks come from a's node.
        b.add("r1", p)
        so = b.step()
        assert b.scheduler.requests["r1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert [len(j.hashes) for j in so.kv_connector_metadata.loads] == [5]
        # The scheduler's MetaServer answer travels with the load, and the
        # worker's fetch starts from it (no second query).
        assert so.kv_connector_metadata.loads[0].owners == [(a.worker.node.address, 5)]
        assert so.num_scheduled_tokens.get("r1", 0) == 0  # nothing computed while loading
        finish(b, "r1", p)
        assert b.worker.stats["loaded_blocks"] == 5 and b.worker.stats["failed_blocks"] == 0
        assert b.worker.node.metrics()["fetched_blocks"] == 5
        assert b.worker.node.metrics()["fetch_known_owners"] == 1
        # the stand-in model checked every loaded position before decoding
    finally:
        a.close()
        b.close()


def test_full_prompt_hit_leaves_one_token_to_compute(tiny_model, metaserver):
    a, b = pair(tiny_model, metaserver)
    try:
        p = prompt(4 * BS, seed=2)  # exactly 4 blocks
        a.add("r", p)
        finish(a, "r", p)
        b.add("r", p)
        so = b.step()
        assert [len(j.hashes) for j in so.kv_connector_metadata.loads] == [3]  # not the last block
        finish(b, "r", p)
    finally:
        a.close()
        b.close()


def test_partial_hit_and_miss(tiny_model, metaserver):
    a, b = pair(tiny_model, metaserver)
    try:
        p = prompt(3 * BS, seed=3)
        a.add("r", p)
        finish(a, "r", p)
        # A longer prompt sharing a's 2 usable... 3 full blocks, then diverging.
        q = p + prompt(2 * BS + 5, seed=4)
        b.add("q", q)
        so = b.step()
        assert [len(j.hashes) for j in so.kv_connector_metadata.loads] == [3]
        finish(b, "q", q)
        # A miss: nothing shared, nothing loaded, computed locally.
        m = prompt(3 * BS, seed=5)
        loads = b.worker.stats["loaded_blocks"]
        b.add("m", m)
        so = b.step()
        assert so.kv_connector_metadata.loads == []
        assert so.num_scheduled_tokens["m"] == len(m)
        finish(b, "m", m)
        assert b.worker.stats["loaded_blocks"] == loads
        # b saved the diverging prompt's blocks in turn: 5 full blocks of q.
        import kvferry

        assert b.worker.node.query_prefix(b.worker.ns, kvferry.block_hashes(b.worker.ns, q, BS)) == 5
    finally:
        a.close()
        b.close()


def test_local_vllm_hit_is_not_loaded_again(tiny_model, metaserver):
    """vLLM's own prefix cache covers the first request's blocks on the same
    instance: the connector asks only for blocks beyond them."""
    a, b = pair(tiny_model, metaserver)
    try:
        p = prompt(4 * BS + 1, seed=6)
        a.add("r", p)
        finish(a, "r", p)
        b.add("r0", p[: 2 * BS + 1])  # b computes 2 blocks itself
        finish(b, "r0", p[: 2 * BS + 1])
        b.add("r1", p)
        so = b.step()
        loads = so.kv_connector_metadata.loads
        assert [len(j.hashes) for j in loads] == [2] and loads[0].first_block == 2
        # The owner's 4 blocks, counted from the load's first block.
        assert loads[0].owners == [(a.worker.node.address, 2)]
        finish(b, "r1", p)
    finally:
        a.close()
        b.close()


def test_owner_killed_before_load_recomputes(tiny_model, metaserver):
    a, b = pair(tiny_model, metaserver, fetch_timeout=3.0)
    try:
        p = prompt(4 * BS + 2, seed=7)
        a.add("r", p)
        finish(a, "r", p)
        a.worker.node.kill()  # a crash: the MetaServer still lists a's blocks
        b.add("r", p)
        t0 = time.monotonic()
        so = b.step()
        assert [len(j.hashes) for j in so.kv_connector_metadata.loads] == [4]
        finish(b, "r", p)  # recomputed: the stand-in model checks every position it reads
        assert time.monotonic() - t0 < 20
        assert b.worker.stats["failed_blocks"] == 4 and b.worker.stats["loaded_blocks"] == 0
    finally:
        b.close()
        a.scheduler.shutdown()


def test_partial_load_failure_recomputes_the_rest(tiny_model, metaserver):
    """Only the first 2 of 4 blocks can be fetched (the owner evicted... here:
    only they were ever saved on a reachable node): vLLM keeps 2, recomputes 2."""
    a, b = pair(tiny_model, metaserver)
    c = Instance(tiny_model, "kv_both", extra(metaserver), num_blocks=64)
    try:
        p = prompt(4 * BS + 2, seed=8)
        a.add("short", p[: 2 * BS + 1])
        finish(a, "short", p[: 2 * BS + 1])
        c.add("r", p)
        finish(c, "r", p)
        # b sees c's 4 blocks at the MetaServer; c dies; a still holds 2.
        c.worker.node.kill()
        b.add("r", p)
        finish(b, "r", p)
        loaded, failed = b.worker.stats["loaded_blocks"], b.worker.stats["failed_blocks"]
        assert loaded + failed == 4 and loaded <= 2, (loaded, failed)
    finally:
        a.close()
        b.close()
        c.scheduler.shutdown()


def test_metaserver_down_means_no_remote_hit(tiny_model):
    import kvferry

    ms = kvferry.MetaServer()
    a, b = pair(tiny_model, ms)
    try:
        p = prompt(3 * BS + 1, seed=9)
        a.add("r", p)
        finish(a, "r", p)
        ms.shutdown()
        b.add("r", p)
        t0 = time.monotonic()
        so = b.step()
        assert time.monotonic() - t0 < 5
        assert so.kv_connector_metadata.loads == []  # no hit: computed locally
        assert b.connector.stats["query_failures"] == 1
        finish(b, "r", p)
    finally:
        a.close()
        b.close()


def test_abort_while_loading_frees_only_after_the_load(tiny_model, metaserver):
    a, b = pair(tiny_model, metaserver)
    try:
        p = prompt(6 * BS + 1, seed=10)
        a.add("r", p)
        finish(a, "r", p)
        gate = threading.Event()
        orig = b.worker._load

        def slow_load(node, job):
            gate.wait(10)
            return orig(node, job)

        b.worker._load = slow_load
        b.add("r", p)
        b.step()
        assert b.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        held = b.free_at_start - b.free_blocks()
        assert held >= 6
        b.abort("r")
        b.step()
        b.step()
        # The load still writes into those blocks: vLLM must not have them back.
        assert b.free_at_start - b.free_blocks() == held
        gate.set()
        b.run(until=lambda: b.free_blocks() == b.free_at_start, max_steps=100)
        assert "r" not in b.scheduler.requests
    finally:
        a.close()
        b.close()


def test_preemption_while_another_request_loads(tiny_model, metaserver):
    """A small instance (few blocks): a running request is preempted while a
    second loads; both finish with the right tokens and nothing leaks."""
    a = Instance(tiny_model, "kv_both", extra(metaserver), num_blocks=64)
    b = Instance(tiny_model, "kv_both", extra(metaserver), num_blocks=14)
    try:
        p1 = prompt(5 * BS + 1, seed=11)
        a.add("x", p1)
        finish(a, "x", p1, 4)
        gate = threading.Event()
        orig = b.worker._load

        def slow_load(node, job):
            gate.wait(10)
            return orig(node, job)

        b.worker._load = slow_load
        p2 = prompt(4 * BS + 8, seed=12)
        b.add("y", p2, max_tokens=70)  # grows into new blocks while decoding
        for _ in range(3):
            b.step()
        b.add("x", p1, max_tokens=4)
        preempted = []
        b.hook = lambda so: preempted.extend(so.preempted_req_ids or ())
        for _ in range(40):
            b.step()
            if preempted:
                break
        gate.set()
        b.run()
        assert preempted, "the scenario did not preempt"
        assert b.outputs["x"] == expected_tokens(p1, 4)
        assert b.outputs["y"] == expected_tokens(p2, 70)
        assert b.free_blocks() == b.free_at_start
    finally:
        a.close()
        b.close()


def test_cache_salt_isolates_blocks(tiny_model, metaserver):
    """A request with a cache_salt never hits blocks saved without it (or
    with another salt), and hits its own salt's blocks."""
    from conftest import Request
    from vllm.sampling_params import SamplingParams

    a, b = pair(tiny_model, metaserver)
    try:
        p = prompt(3 * BS + 1, seed=30)
        a.add("plain", p)
        finish(a, "plain", p)

        def salted(inst, req_id, salt):
            sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            inst.scheduler.add_request(Request(req_id, list(p), sp, None, block_hasher=inst.block_hasher, cache_salt=salt))
            inst.outputs[req_id] = []

        salted(b, "s1", "tenant-1")
        so = b.step()
        assert so.kv_connector_metadata.loads == []  # the unsalted blocks are not the tenant's
        finish(b, "s1", p)
        salted(a, "s2", "tenant-2")
        so = a.step()
        assert so.kv_connector_metadata.loads == []
        finish(a, "s2", p)
        c = Instance(tiny_model, "kv_both", extra(metaserver))
        try:
            salted(c, "s1", "tenant-1")
            so = c.step()
            assert [len(j.hashes) for j in so.kv_connector_metadata.loads] == [3]  # b saved tenant-1's
            finish(c, "s1", p)
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_chunked_prefill_saves_every_chunk(tiny_model, metaserver):
    """With 32 tokens per step the prompt is computed in chunks; each chunk's
    full blocks are saved in the step that completes them."""
    a = Instance(tiny_model, "kv_both", extra(metaserver), max_tokens_per_step=32)
    b = Instance(tiny_model, "kv_both", extra(metaserver))
    try:
        p = prompt(6 * BS + 3, seed=31)
        a.add("r", p)
        saves = []
        a.hook = lambda so: saves.append(sum(len(j.hashes) for j in so.kv_connector_metadata.saves))
        finish(a, "r", p)
        assert saves[:3] == [2, 2, 2] and sum(saves) == 6
        b.add("r", p)
        so = b.step()
        assert [len(j.hashes) for j in so.kv_connector_metadata.loads] == [6]
        finish(b, "r", p)
    finally:
        a.close()
        b.close()


def test_many_requests_share_a_prefix(tiny_model, metaserver):
    """Several requests with a shared system prompt and different suffixes:
    each loads the shared blocks once per request and decodes its own tokens."""
    a, b = pair(tiny_model, metaserver)
    try:
        system = prompt(4 * BS, seed=32)
        prompts = {f"q{i}": system + prompt(BS + 7 * i, seed=40 + i) for i in range(4)}
        a.add("sys", system + [1])
        finish(a, "sys", system + [1])
        for rid, pr in prompts.items():
            b.add(rid, pr, max_tokens=3)
        b.run()
        for rid, pr in prompts.items():
            assert b.outputs[rid] == expected_tokens(pr, 3), rid
        assert b.worker.stats["failed_blocks"] == 0 and b.worker.stats["loaded_blocks"] >= 4
        assert b.free_blocks() == b.free_at_start
    finally:
        a.close()
        b.close()
