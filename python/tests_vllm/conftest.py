"""Harness for the vLLM connector tests: vLLM's real v1 ``Scheduler`` (on
CPU) drives the connector's scheduler side; the connector's worker side runs
in the same process on the KV cache tensors vLLM's own planner and allocator
make for the installed version (``get_kv_cache_config_from_groups``,
``allocate_kv_cache``: per layer a ``[num_blocks, kv_heads, block_size,
2 * head_dim]`` view, K and V packed, in the chosen ``KVCacheLayout``), with
a stand-in for the model runner (:class:`Instance.step`).

The stand-in "model" writes into the paged cache, for every token it
computes, KV that is a function of the whole prefix up to that token (a
chained value per position), and before computing a request's new tokens it
checks that every earlier position of the request holds exactly that KV:
a block loaded wrong, or a block freed and reused under a request, fails
the step. Its next token is a function of the last position's value, so a
request decodes the same tokens wherever its prefix came from.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvferry  # noqa: E402
from kvferry.vllm import KvferryConnector  # noqa: E402

BS = 16  # tokens per block
LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 32
VOCAB = 1000
_MODEL_DIR: Optional[str] = None


def model_dir(tmp_root: str) -> str:
    """A local model directory with only a config.json (no weights, no hub)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = os.path.join(tmp_root, "tiny-llama")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": KV_HEADS * 2 * HEAD_DIM,
                    "intermediate_size": 256,
                    "num_attention_heads": KV_HEADS * 2,
                    "num_key_value_heads": KV_HEADS,
                    "head_dim": HEAD_DIM,
                    "num_hidden_layers": LAYERS,
                    "vocab_size": VOCAB,
                    "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-5,
                    "torch_dtype": "float32",
                    "tie_word_embeddings": False,
                },
                f,
            )
        _MODEL_DIR = d
    return _MODEL_DIR


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return model_dir(str(tmp_path_factory.mktemp("model")))


_MODEL_CONFIG = {}


def vllm_config(
    model: str, role: str, extra: Dict, *, max_tokens_per_step: int = 512, policy: str = "recompute", layout: str = "LBHNC"
) -> VllmConfig:
    """A VllmConfig for ``model`` with kvferry as its KV connector and vLLM's
    KV cache layout ``layout`` (what the engine core resolves; LBHNC on CPU)."""
    if model not in _MODEL_CONFIG:  # building a ModelConfig takes seconds
        _MODEL_CONFIG[model] = ModelConfig(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=2048)
    cfg = VllmConfig(
        model_config=_MODEL_CONFIG[model],
        cache_config=CacheConfig(block_size=BS, cache_dtype="auto"),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_tokens_per_step,
            max_model_len=2048,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvferryConnector",
            kv_connector_module_path="kvferry.vllm",
            kv_role=role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    cfg.cache_config.kv_cache_layout = layout
    return cfg


def kv_cache_config(num_blocks: int, cfg: Optional[VllmConfig] = None, dtype=torch.float32) -> KVCacheConfig:
    """vLLM's KV cache config for the tiny model: planned by vLLM itself
    (``get_kv_cache_config_from_groups``) when ``cfg`` is given (its
    ``cache_config.kv_cache_layout`` chooses the layout), else without tensors."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=dtype)
    groups = [KVCacheGroupSpec(names, spec)]
    if cfg is None:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    out = get_kv_cache_config_from_groups(cfg, groups, available_memory=num_blocks * LAYERS * spec.page_size_bytes)
    out.kv_cache_layout = cfg.cache_config.kv_cache_layout
    assert out.num_blocks == num_blocks
    return out


def allocate(kcc: KVCacheConfig, cfg: VllmConfig) -> Dict[str, torch.Tensor]:
    """The per-layer KV tensors vLLM's model runner would register."""
    return allocate_kv_cache(kcc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())


# ---------------------------------------------------------------- the "model"
_M = (1 << 31) - 1


def prefix_values(tokens: List[int]) -> List[int]:
    """A chained value per position: position i's depends on tokens[:i+1]."""
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _M
        out.append(h)
    return out


_BASE = torch.arange(KV_HEADS * 2 * HEAD_DIM, dtype=torch.float32).reshape(KV_HEADS, 2 * HEAD_DIM)


def token_kv(value: int, layer: int) -> torch.Tensor:
    """The K and V (``[kv_heads, 2 * head_dim]``, packed as vLLM's view
    does) the model writes for a position of chained value ``value``."""
    return _BASE + float((value * 3 + layer * 7) % 65_521)


def next_token(value: int) -> int:
    return (value * 17 + 5) % VOCAB


class Instance:
    """One vLLM instance: the real Scheduler and both sides of the connector,
    with a stand-in model runner (see the module's docstring)."""

    def __init__(self, model: str, role: str, extra: Dict, num_blocks: int = 64, **kw) -> None:
        self.vllm_config = vllm_config(model, role, extra, **kw)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.kv_cache_config = kv_cache_config(num_blocks, self.vllm_config)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BS, hash_fn)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BS,
            log_stats=False,
        )
        self.connector: KvferryConnector = self.scheduler.get_kv_connector()  # the scheduler side
        self.worker = KvferryConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = allocate(self.kv_cache_config, self.vllm_config)  # [num_blocks, kv_heads, BS, 2 * head_dim] views
        self.worker.register_kv_caches(self.kv)
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.free_at_start = self.block_pool.get_num_free_blocks()
        self.computed: Dict[str, int] = {}  # tokens the "model" computed per request
        self.outputs: Dict[str, List[int]] = {}
        self.finished: Dict[str, object] = {}  # req id -> its last EngineCoreOutput
        self.steps = 0
        self.hook = None  # called with the SchedulerOutput before the forward

    # -- requests ----------------------------------------------------------
    def add(self, req_id: str, prompt: List[int], max_tokens: int = 4, params: Optional[Dict] = None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params}
        req = Request(req_id, list(prompt), sp, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(req)
        self.outputs[req_id] = []
        return req

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    # -- one engine step ---------------------------------------------------
    def step(self):
        so = self.scheduler.schedule()
        self.steps += 1
        for r in so.preempted_req_ids or ():
            self.computed.pop(r, None)  # its next forward checks every position again
        w = self.worker
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if self.hook is not None:
            self.hook(so)
        sampled = self._forward(so)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
        )
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=out,
        )
        eco = self.scheduler.update_from_output(so, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        return so

    def _forward(self, so) -> Dict[str, List[int]]:
        sampled = {}
        reqs = self.scheduler.requests
        for req_id, n in so.num_scheduled_tokens.items():
            r = reqs[req_id]
            start = r.num_computed_tokens - n  # the scheduler advanced it already
            tokens = list(r.all_token_ids)
            values = prefix_values(tokens[: start + n])
            (ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            # A model reads every earlier position: check they hold the right
            # KV. All of them when the request (re)starts here (after a load,
            # a local prefix hit, a preemption); else the positions since the
            # last full check's block (what this stand-in wrote itself).
            lo = 0 if self.computed.get(req_id) != start else max(0, start - 2 * BS)
            self.check_positions(req_id, ids, values, lo, start)
            for pos in range(start, start + n):
                self.write_position(ids, pos, values[pos])
            self.computed[req_id] = start + n
            if start + n >= r.num_tokens:
                sampled[req_id] = [next_token(values[start + n - 1])]
        return sampled

    def write_position(self, ids: List[int], pos: int, value: int) -> None:
        b, o = ids[pos // BS], pos % BS
        for li, t in enumerate(self.kv.values()):
            t[b, :, o, :] = token_kv(value, li)

    def check_positions(self, req_id: str, ids: List[int], values: List[int], lo: int, hi: int) -> None:
        for pos in range(lo, hi):
            b, o = ids[pos // BS], pos % BS
            for li, t in enumerate(self.kv.values()):
                if not torch.equal(t[b, :, o, :], token_kv(values[pos], li)):
                    raise AssertionError(f"{req_id}: position {pos} (block {b}) of layer {li} holds wrong KV")

    def run(self, max_steps: int = 400, until=None, timeout: float = 60.0) -> None:
        """Steps until nothing is left to do (or ``until()`` is true); a step
        that scheduled no token (everything waits for loads or leases) is
        followed by a short sleep, as an idle engine loop would wait."""
        end = time.monotonic() + timeout
        steps = 0
        while time.monotonic() < end:
            if until is not None and until():
                return
            if until is None and not self.scheduler.has_requests():
                return
            so = self.step()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.005)
            else:
                steps += 1
                if steps > max_steps:
                    break
        raise AssertionError(f"not done after {steps} steps with tokens, {timeout}s")

    def free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def expected_tokens(prompt: List[int], max_tokens: int) -> List[int]:
    """The tokens a single instance decodes for ``prompt`` (the stand-in model, no cache)."""
    toks = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(prefix_values(toks)[-1])
        out.append(t)
        toks.append(t)
    return out


def prompt(n: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(0, VOCAB, (n,), generator=g)]


@pytest.fixture
def metaserver():
    with kvferry.MetaServer() as ms:
        yield ms


def extra(ms, **kw) -> Dict:
    d = {"metaserver": ms.address if hasattr(ms, "address") else ms, "pool_bytes": 64 << 20, "fetch_timeout": 5.0,
         "rpc_timeout": 1.0, "lease_ttl": 5.0}
    d.update(kw)
    return d
