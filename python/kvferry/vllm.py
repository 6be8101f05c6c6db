"""kvferry as a vLLM KV connector (vLLM v1, ``KVConnectorBase_V1``).

vLLM loads it by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"metaserver": "10.0.0.5:7000"}}'

What it does, by ``kv_role``:

- ``kv_both`` (a prefix cache shared across instances): every full prompt
  block an instance computes is saved into its node's pinned pool and
  registered at the MetaServer; a new request whose prompt prefix some
  node holds (this one or another) loads those blocks asynchronously
  (``fetch_into``) into the blocks vLLM allocated, instead of computing them.
- ``kv_producer`` (the prefill instance of a P/D pair): saves, runs the
  handoff barrier (``flush_saves_and_registrations``) before the step that
  completed a prompt returns, keeps that request's blocks under a device
  lease until the decode has read them (vLLM's delayed free), and returns
  ``kv_transfer_params`` (``{"kvferry": {...}}``, see
  :meth:`KvferryConnector.request_finished`) for the router to hand to the
  decode instance.
- ``kv_consumer`` (the decode instance): loads only.

Block hashes are kvferry's shared chained hash (:func:`kvferry.block_hashes`)
over the prompt's token ids in the connector's namespace (model id, KV
dtype, vLLM block size, number of KV layers, vLLM's KV layout), salted with
the request's ``cache_salt`` and LoRA adapter: every process computes the
same hashes from the same tokens without talking to any other. At least one
prompt token is always left to compute.

A load that stops short (the owner or the MetaServer died, a block was
evicted, the fetch timed out) is never a wrong block: the blocks that were
not loaded are reported to vLLM (``get_block_ids_with_load_errors``) and,
with ``kv_load_failure_policy: "recompute"``, vLLM recomputes them from the
first one missing (vLLM's default policy, ``"fail"``, fails the request).

Settings (``kv_connector_extra_config``; unknown keys and wrong types are
refused at start with a :class:`kvferry.ConfigError` naming the key): see
:class:`ConnectorConfig`.

Supported: vLLM 0.33.0 and 0.32.0 (:data:`VLLM_VERSIONS_SUPPORTED`; the
first is the pinned CI version, the second the CPU build the end-to-end run
uses), one KV cache group (full attention or MLA), tensor and pipeline
parallel size 1, text prompts (requests with multimodal inputs or prompt
embeddings are neither loaded nor saved). KV layouts (see
:func:`kv_layout`): vLLM 0.32/0.33's per-layer ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` views (K and V packed) in every
``KVCacheLayout`` whose blocks are one run of bytes (``LBHNC``, the CPU
default, ``LBNHC``, ``BLHNC``, ``BLNHC``), MLA's ``[num_blocks,
block_size, head_size]``, and older vLLMs' ``[2, num_blocks, block_size,
kv_heads, head_dim]`` / ``[num_blocks, 2, block_size, kv_heads,
head_dim]``; any other (``LHBNC``, ``BHLNC``, kernel blocks smaller than
vLLM's block) is refused at ``register_kv_caches`` with a
:class:`kvferry.LayoutError` naming the layer, its shape and vLLM's layout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvferry
from kvferry.errors import ConfigError, DeadlineError, KvferryError, LayoutError, MetaServerError, StartError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "ConnectorConfig",
    "LoadJob",
    "SaveJob",
    "kv_layout",
    "VLLM_VERSIONS_SUPPORTED",
]

logger = logging.getLogger("kvferry.vllm")

#: vLLM versions this connector was tested with (scripts/vllm-test.sh pins
#: the first). Others start with a warning.
VLLM_VERSIONS_SUPPORTED: Tuple[str, ...] = ("0.33.0", "0.32.0")

# The key of this connector's entry in kv_transfer_params.
PARAMS_KEY = "kvferry"


# ---------------------------------------------------------------- config
@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config``.

    Attributes:
        metaserver: the MetaServer's ``host:port`` (required).
        model_id: the model part of the namespace (default: vLLM's model
            name or path). Instances exchange blocks only when it is equal:
            set it when prefill and decode load the model from different paths.
        pool_bytes: the worker node's pinned host pool, bytes (default 1 GiB).
            Saved and fetched blocks live there; a full pool evicts the
            least recently used.
        host: the IP the worker node binds and advertises to peers (default
            ``127.0.0.1``: single host only; set the machine's address for
            P/D across hosts).
        gpu: kvferry's GPU backend, ``"host"`` (CPU tensors) or ``"cuda"``;
            default: what the KV tensors are.
        fetch_timeout: bound on one request's fetch, seconds (default 10).
        rpc_timeout: bound on each MetaServer and peer request of the worker
            node, seconds (default 2).
        query_timeout: bound on the scheduler's MetaServer prefix query,
            seconds (default 0.5; the scheduler waits for it).
        metaserver_retry: after a failed prefix query the scheduler answers
            "no hit" without asking for this many seconds (default 5).
        flush_timeout: bound on the producer's handoff barrier per step,
            seconds (default 5).
        lease_ttl: how long a producer keeps a finished request's blocks for
            the decode (delayed free), seconds; 0: no lease, free at once
            (default 30; at most 600).
        load_threads: threads running asynchronous loads (default 2).
        check_metaserver: refuse to start when the MetaServer does not
            answer (default true).
    """

    metaserver: str
    model_id: Optional[str] = None
    pool_bytes: int = 1 << 30
    host: str = "127.0.0.1"
    gpu: Optional[str] = None
    fetch_timeout: float = 10.0
    rpc_timeout: float = 2.0
    query_timeout: float = 0.5
    metaserver_retry: float = 5.0
    flush_timeout: float = 5.0
    lease_ttl: float = 30.0
    load_threads: int = 2
    check_metaserver: bool = True

    @classmethod
    def from_extra_config(cls, extra: Any) -> "ConnectorConfig":
        """Validates ``kv_connector_extra_config``.

        Raises:
            ConfigError: not a dict, an unknown key (the message lists the
                known ones), a value of the wrong type or out of range (the
                message names the key), or ``metaserver`` missing.
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(
                f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}", "vllm_config"
            )
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown key(s) {unknown} for KvferryConnector; "
                f"known keys: {sorted(known)}",
                "vllm_config",
            )
        if "metaserver" not in extra:
            raise ConfigError(
                "kv_connector_extra_config needs 'metaserver': the kvferry MetaServer's host:port", "vllm_config"
            )
        out: Dict[str, Any] = {}
        for key, value in extra.items():
            out[key] = _check_value(key, value)
        return cls(**out)


_STR_KEYS = {"metaserver", "model_id", "host", "gpu"}
_INT_KEYS = {"pool_bytes": (4096, 1 << 50), "load_threads": (1, 64)}
_FLOAT_KEYS = {
    "fetch_timeout": (0.001, 3600.0),
    "rpc_timeout": (0.001, 3600.0),
    "query_timeout": (0.001, 60.0),
    "metaserver_retry": (0.0, 3600.0),
    "flush_timeout": (0.001, 3600.0),
    "lease_ttl": (0.0, 600.0),
}


def _check_value(key: str, value: Any) -> Any:
    where = f"kv_connector_extra_config['{key}']"
    if key in _STR_KEYS:
        if key == "model_id" and value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ConfigError(
                f"{where} must be a non-empty string, got {type(value).__name__} {value!r}", "vllm_config"
            )
        if key == "gpu" and value not in ("host", "cuda"):
            raise ConfigError(f'{where} must be "host" or "cuda", got {value!r}', "vllm_config")
        if key == "metaserver":
            try:
                kvferry._check_metaserver(value)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}", "vllm_config") from None
        return value
    if key == "check_metaserver":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {type(value).__name__} {value!r}", "vllm_config")
        return value
    if key in _INT_KEYS:
        lo, hi = _INT_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {type(value).__name__} {value!r}", "vllm_config")
        if not lo <= value <= hi:
            raise ConfigError(f"{where} = {value} is out of range [{lo}, {hi}]", "vllm_config")
        return value
    lo, hi = _FLOAT_KEYS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number (seconds), got {type(value).__name__} {value!r}", "vllm_config")
    if not lo <= float(value) <= hi:
        raise ConfigError(f"{where} = {value} is out of range [{lo}, {hi}] seconds", "vllm_config")
    return float(value)


# ---------------------------------------------------------------- layouts
def kv_layout(shape: Sequence[int], num_blocks: int, block_size: int) -> str:
    """Names a vLLM per-layer KV cache tensor's layout from its shape.

    Args:
        shape: the layer's KV cache tensor shape (logical, as vLLM gives it).
        num_blocks: vLLM's number of KV blocks (``KVCacheConfig.num_blocks``).
        block_size: tokens per block.

    Returns:
        ``"block_major"``: the first axis indexes blocks and K and V live
        inside each block (vLLM 0.32/0.33's ``[num_blocks, kv_heads,
        block_size, 2 * head_dim]`` views in every ``KVCacheLayout``, MLA's
        ``[num_blocks, block_size, head_size]``): one segment per layer.
        ``"kv_first"``: ``[2, num_blocks, block_size, kv_heads, head_dim]``
        and ``"blocks_first"``: ``[num_blocks, 2, block_size, kv_heads,
        head_dim]`` (older vLLMs' FlashAttention / FlashInfer shapes): K
        and V segments.

    Raises:
        LayoutError: any other shape, e.g. kernel blocks smaller than vLLM's
            block (the first axis is not ``num_blocks``); the message names
            the shape.
    """
    s = tuple(int(x) for x in shape)
    if len(s) == 5 and s[0] == 2 and s[1] == num_blocks and s[2] == block_size:
        return "kv_first"
    if len(s) == 5 and s[0] == num_blocks and s[1] == 2 and s[2] == block_size:
        return "blocks_first"
    if len(s) >= 2 and s[0] == num_blocks and block_size in s[1:]:
        return "block_major"
    raise LayoutError(
        f"KV cache tensor of shape {list(s)} is not a layout kvferry supports (num_blocks={num_blocks}, "
        f"block_size={block_size}): the first axis must index vLLM's blocks ([num_blocks, ...] with the block's "
        "tokens inside, or [2, num_blocks, block_size, kv_heads, head_dim])",
        "vllm_layout",
    )


def _physical_block_view(t: Any) -> Any:
    """``t`` (first axis: blocks) with the other axes in memory order, so a
    block whose bytes form one run is a contiguous block for kvferry."""
    if t.dim() <= 2:
        return t
    rest = sorted(range(1, t.dim()), key=lambda a: (-t.stride(a), a))
    return t.permute(0, *rest)


# ---------------------------------------------------------------- metadata
@dataclass
class LoadJob:
    """One asynchronous load: fetch ``hashes`` into vLLM blocks ``block_ids``
    (the same length; position ``i`` of the request's prompt blocks is
    ``first_block + i``). ``owners``: the scheduler's MetaServer answer for
    these hashes as ``(node, blocks)`` counted from ``hashes[0]``, which the
    worker's fetch starts from instead of asking again (None: ask)."""

    req_id: str
    hashes: List[bytes]
    block_ids: List[int]
    first_block: int = 0
    owners: Optional[List[Tuple[str, int]]] = None


@dataclass
class SaveJob:
    """Save ``hashes`` from vLLM blocks ``block_ids`` after this step's
    forward. ``handoff``: this step completes a producer request's prompt:
    run the handoff barrier after the saves. ``lease``: also grant a device
    lease on every block of its prompt (``lease_block_ids`` /
    ``lease_hashes``) for ``lease_ttl`` seconds."""

    req_id: str
    hashes: List[bytes]
    block_ids: List[int]
    handoff: bool = False
    lease: bool = False
    lease_hashes: List[bytes] = field(default_factory=list)
    lease_block_ids: List[int] = field(default_factory=list)


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the worker side for one step."""

    loads: List[LoadJob] = field(default_factory=list)
    saves: List[SaveJob] = field(default_factory=list)
    #: requests preempted this step: their leases end before the blocks are reused
    preempted: Set[str] = field(default_factory=set)


# ---------------------------------------------------------------- helpers
def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", model_id: Optional[str]) -> Tuple[str, int, int]:
    """The kvferry namespace of this vLLM instance: ``(namespace, block_size,
    layers)``. Equal on every instance that runs the same model, KV dtype,
    block size and KV layout.

    Raises:
        ConfigError: an unsupported setup (several KV cache groups, tensor
            or pipeline parallel size above 1).
    """
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConfigError(
            f"KvferryConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only; got "
            f"{pc.tensor_parallel_size} and {pc.pipeline_parallel_size}",
            "VllmParallel",
        )
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) != 1:
        raise ConfigError(
            f"KvferryConnector supports models with one KV cache group (full attention or MLA); this one has "
            f"{len(groups)}",
            "VllmKvGroups",
        )
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not isinstance(spec, FullAttentionSpec):
        raise ConfigError(
            f"KvferryConnector supports full-attention and MLA KV caches; this model's KV cache spec is "
            f"{type(spec).__name__}",
            "VllmKvSpec",
        )
    block_size = int(spec.block_size)
    layers = len(groups[0].layer_names)
    model = model_id or str(vllm_config.model_config.model)
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    kind = type(spec).__name__
    ns = kvferry.namespace(
        f"vllm:{model}|{kind}|{layout}", _dtype_name(spec.dtype), block_size, 0, 1, layers
    )
    return ns, block_size, layers


def _hash_namespace(ns: str, request: "Request") -> str:
    """The namespace the request's hashes are computed in: the KV namespace,
    salted with what changes a block's bytes beyond its tokens (vLLM's
    ``cache_salt``, the LoRA adapter)."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    if not salt and lora is None:
        return ns
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    return f"{ns}\x00salt={salt or ''}\x00lora={lora_name or ''}"


def _cacheable(request: "Request") -> bool:
    return (
        request.prompt_token_ids is not None
        and not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )


def _check_vllm_version() -> None:
    v = getattr(vllm, "__version__", "unknown")
    if v not in VLLM_VERSIONS_SUPPORTED:
        logger.warning(
            "kvferry.vllm was tested with vLLM %s; this is vLLM %s", ", ".join(VLLM_VERSIONS_SUPPORTED), v
        )


def _probe_metaserver(node: "kvferry.Node", ns: str, cfg: ConnectorConfig) -> None:
    """Raises StartError when the MetaServer does not answer a prefix query."""
    if not cfg.check_metaserver:
        return
    try:
        node.query_prefix_remote(ns, [bytes(32)], timeout=max(cfg.rpc_timeout, cfg.query_timeout))
    except (MetaServerError, DeadlineError) as e:
        raise StartError(
            f"the kvferry MetaServer at {cfg.metaserver} (kv_connector_extra_config['metaserver']) does not "
            f"answer: {e}. Start it first, or set check_metaserver: false to start anyway",
            "VllmMetaServer",
        ) from None


# Worker nodes of this process, by vLLM engine id: a scheduler in the same
# process as its worker (vLLM's default for one GPU) also asks the worker's
# pool directly, and names that node as the owner in kv_transfer_params.
_LOCAL_NODES: Dict[str, "kvferry.Node"] = {}
_LOCAL_LOCK = threading.Lock()


@dataclass
class _ReqState:
    request: Any
    hashes: Optional[List[bytes]] = None
    local_blocks: int = 0  # vLLM's own block-aligned prefix hit
    hit_blocks: int = 0  # blocks some kvferry node holds (answer of get_num_new_matched_tokens)
    saved_blocks: int = 0  # prompt blocks queued for saving
    leased: bool = False
    handed_off: bool = False  # the producer's handoff (barrier, lease) was planned
    checked_params: bool = False
    load_job: Optional[LoadJob] = None
    load_failed: bool = False  # a load stopped short: no more loads for this request
    # the last answer of _held_blocks: (monotonic time, usable blocks, held blocks)
    last_query: Optional[Tuple[float, int, int]] = None
    # the MetaServer's owners in that answer, counted from the first block
    # (None: answered locally, or the MetaServer was not asked)
    owners: Optional[List[Tuple[str, int]]] = None


# ---------------------------------------------------------------- connector
class KvferryConnector(KVConnectorBase_V1):
    """vLLM's KV connector backed by kvferry (see the module's docstring).

    vLLM builds one instance per role: the scheduler side (in the engine
    core) plans loads and saves; the worker side (in each worker) owns a
    :class:`kvferry.Node` and the registered KV cache and runs them.

    Raises (at construction):
        ConfigError: a bad ``kv_connector_extra_config`` or unsupported
            setup (named in the message).
        StartError: the MetaServer does not answer (``check_metaserver``).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _check_vllm_version()
        tc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra_config(tc.kv_connector_extra_config)
        self._saves = bool(tc.is_kv_producer)
        self._loads = bool(tc.is_kv_consumer)
        self._producer_only = self._saves and not self._loads
        self._engine_id = str(tc.engine_id)
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute" and self._loads:
            logger.warning(
                "kvferry: kv_load_failure_policy is %r: a load that stops short fails the request; set "
                '"recompute" to recompute the blocks kvferry could not load',
                tc.kv_load_failure_policy,
            )
        self.ns, self.block_size, self.layers = namespace_for(vllm_config, kv_cache_config, self.cfg.model_id)
        self._node: Optional[kvferry.Node] = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ============================================================ scheduler
    def _init_scheduler(self) -> None:
        # A query-only node (smallest pool): the scheduler asks the MetaServer.
        self._query_node = kvferry.Node(
            self.cfg.metaserver, pool_bytes=4096, host=self.cfg.host, rpc_timeout=self.cfg.query_timeout
        )
        try:
            _probe_metaserver(self._query_node, self.ns, self.cfg)
        except BaseException:
            self._query_node.shutdown(1)
            raise
        self._reqs: Dict[str, _ReqState] = {}
        self._pending_loads: List[LoadJob] = []
        self._ms_down_until = 0.0
        # first hash of a load that stopped short -> until when no load starts there
        self._failed_hashes: Dict[bytes, float] = {}
        #: counters: queries, query_failures, hit_blocks, load_jobs, failed_loads, save_blocks, leases
        self.stats: Dict[str, int] = dict(
            queries=0, query_failures=0, hit_blocks=0, load_jobs=0, failed_loads=0, save_blocks=0, leases=0
        )

    def _state(self, request: "Request") -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request)
            self._reqs[request.request_id] = st
        return st

    def _hashes(self, st: _ReqState) -> List[bytes]:
        if st.hashes is None:
            r = st.request
            st.hashes = kvferry.block_hashes(_hash_namespace(self.ns, r), list(r.prompt_token_ids), self.block_size)
        return st.hashes

    def _held_blocks(self, hashes: List[bytes]) -> Tuple[int, Optional[List[Tuple[str, int]]]]:
        """Blocks of ``hashes`` (from the first) that some node holds: this
        process's worker pool, else the MetaServer's longest owner; and the
        MetaServer's owners when it was asked (for the load to start from)."""
        local = 0
        node = _LOCAL_NODES.get(self._engine_id)
        if node is not None and node.running:
            try:
                local = node.query_prefix(self.ns, hashes)
            except KvferryError:
                local = 0
        if local == len(hashes) or time.monotonic() < self._ms_down_until:
            return local, None
        self.stats["queries"] += 1
        try:
            owners = self._query_node.query_prefix_remote(self.ns, hashes, timeout=self.cfg.query_timeout)
        except (MetaServerError, DeadlineError) as e:
            self.stats["query_failures"] += 1
            self._ms_down_until = time.monotonic() + self.cfg.metaserver_retry
            logger.warning("kvferry: MetaServer prefix query failed (%s); no remote hits for %.1fs", e, self.cfg.metaserver_retry)
            return local, None
        return max([local] + [o.blocks for o in owners]), [(o.node, o.blocks) for o in owners]

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own prefix hit, block
        aligned) that kvferry can load: whole blocks some node holds, leaving
        at least one prompt token to compute. Loads are asynchronous
        (``True``). A MetaServer that does not answer within
        ``query_timeout`` counts as no remote hit."""
        if not self._loads or not _cacheable(request):
            return 0, False
        st = self._state(request)
        if st.load_failed:
            return 0, False
        hashes = self._hashes(st)
        usable = min(len(hashes), (len(request.prompt_token_ids) - 1) // self.block_size)
        usable = self._before_failed(hashes, usable)
        local = num_computed_tokens // self.block_size
        st.local_blocks, st.hit_blocks = local, local
        if usable <= local:
            return 0, False
        self._check_params(st, hashes)
        # vLLM asks again every step while it cannot place the request:
        # answer from the last query for up to a second.
        now = time.monotonic()
        if st.last_query is not None and now - st.last_query[0] < 1.0 and st.last_query[1] == usable:
            held = st.last_query[2]
        else:
            held, st.owners = self._held_blocks(hashes[:usable])
            held = min(held, usable)
            st.last_query = (now, usable, held)
        if held <= local:
            return 0, False
        st.hit_blocks = held
        return held * self.block_size - num_computed_tokens, True

    def _before_failed(self, hashes: List[bytes], usable: int) -> int:
        """``usable`` capped before any block whose load stopped short within
        ``metaserver_retry`` seconds (the MetaServer may list a dead owner
        until it goes stale: do not ask it again and again)."""
        if not self._failed_hashes:
            return usable
        now = time.monotonic()
        for h, until in list(self._failed_hashes.items()):
            if until <= now:
                del self._failed_hashes[h]
        for i in range(usable):
            if hashes[i] in self._failed_hashes:
                return i
        return usable

    def update_connector_output(self, connector_output: Any) -> None:
        """Learns which loads stopped short (their blocks are in
        ``invalid_block_ids``): that request loads no more, and no load
        starts at that block for ``metaserver_retry`` seconds."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            st = self._reqs.get(req_id)
            if st is None or st.load_job is None:
                continue
            job, st.load_job = st.load_job, None
            bad = [i for i, b in enumerate(job.block_ids) if b in invalid]
            if bad:
                st.load_failed = True
                self._failed_hashes[job.hashes[bad[0]]] = time.monotonic() + max(self.cfg.metaserver_retry, 1.0)
                self.stats["failed_loads"] += 1

    def _check_params(self, st: _ReqState, hashes: List[bytes]) -> None:
        """A decode request from a router carries the prefill's params: warn
        when they name other blocks than this instance computes (another
        model, block size or tokens: nothing will hit)."""
        if st.checked_params:
            return
        st.checked_params = True
        params = (getattr(st.request, "kv_transfer_params", None) or {}).get(PARAMS_KEY)
        if not params:
            return
        n, last = params.get("blocks", 0), params.get("last_hash")
        if params.get("namespace") != self.ns:
            logger.warning(
                "kvferry: request %s comes from a prefill in namespace %r but this instance's is %r: no blocks "
                "will be shared (same model_id, dtype, block size and layout on both?)",
                st.request.request_id, params.get("namespace"), self.ns,
            )
        elif n and (n > len(hashes) or hashes[n - 1].hex() != last):
            logger.warning(
                "kvferry: request %s: the prefill's block hashes differ from this instance's (other tokens?)",
                st.request.request_id,
            )

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """Plans the load of the blocks :meth:`get_num_new_matched_tokens`
        promised into the blocks vLLM just allocated."""
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None or st.hashes is None:
            return
        first = st.local_blocks
        n = num_external_tokens // self.block_size
        ids = blocks.get_block_ids()[0]
        if first + n > len(ids) or first + n > len(st.hashes):
            logger.error("kvferry: request %s: %d blocks to load but %d allocated", request.request_id, first + n, len(ids))
            return
        # The owners the scheduler was told of, counted from this job's
        # first block (the worker's fetch starts from them: no second query).
        owners = None if st.owners is None else [(o, k - first) for o, k in st.owners if k > first]
        job = LoadJob(request.request_id, st.hashes[first:first + n], list(ids[first:first + n]), first, owners or None)
        self._pending_loads.append(job)
        st.load_job = job
        self.stats["load_jobs"] += 1
        self.stats["hit_blocks"] += n

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvferryConnectorMetadata:
        """This step's loads (planned since the last step), and the saves of
        prompt blocks this step completes (producers and ``kv_both``)."""
        meta = KvferryConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        if self._saves:
            for req_id, n_tokens in scheduler_output.num_scheduled_tokens.items():
                job = self._plan_save(req_id, n_tokens, scheduler_output)
                if job is not None:
                    meta.saves.append(job)
        return meta

    def _plan_save(self, req_id: str, n_tokens: int, so: "SchedulerOutput") -> Optional[SaveJob]:
        st = self._reqs.get(req_id)
        if st is None or not _cacheable(st.request):
            return None
        r = st.request
        prompt = len(r.prompt_token_ids)
        done = min(r.num_computed_tokens + n_tokens, prompt)
        full = done // self.block_size
        handoff = self._producer_only and done >= prompt and not st.handed_off
        if full <= st.saved_blocks and not handoff:
            return None
        bs = so.kv_connector_block_state
        ids = bs.get_block_ids(req_id) if bs is not None else None
        if ids is None and self._kv_cache_manager is not None:
            ids = self._kv_cache_manager.get_block_ids(req_id)
        if ids is None:
            return None
        ids = list(ids[0])
        hashes = self._hashes(st)
        full = min(full, len(ids), len(hashes))
        job = SaveJob(req_id, hashes[st.saved_blocks:full], ids[st.saved_blocks:full])
        self.stats["save_blocks"] += max(0, full - st.saved_blocks)
        st.saved_blocks = max(st.saved_blocks, full)
        if handoff:
            job.handoff = st.handed_off = True
        if handoff and full > 0 and self.cfg.lease_ttl > 0:
            job.lease = True
            job.lease_hashes = hashes[:full]
            job.lease_block_ids = ids[:full]
            st.leased = True
            self.stats["leases"] += 1
        return job if (job.hashes or job.handoff) else None

    def on_new_request(self, request: "Request") -> None:
        """Tracks the request (its prompt is hashed once, when first needed)."""
        if _cacheable(request):
            self._state(request)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """For a producer: ``(True, {"kvferry": {...}})`` when the request's
        blocks are under a device lease (vLLM frees them once the worker
        reports the lease ended: the decode read them, or ``lease_ttl``
        passed), with the params a decode instance needs: ``namespace``,
        ``owner`` (the prefill node), ``blocks`` (full prompt blocks saved)
        and ``last_hash`` (hex of the last block's chained hash: it
        identifies the whole prefix). Otherwise ``(False, None)``."""
        st = self._reqs.pop(request.request_id, None)
        if st is None or not self._saves:
            return False, None
        params = None
        if st.saved_blocks > 0 and st.hashes:
            node = _LOCAL_NODES.get(self._engine_id)
            params = {
                PARAMS_KEY: {
                    "namespace": self.ns,
                    "owner": node.address if node is not None else None,
                    "blocks": st.saved_blocks,
                    "last_hash": st.hashes[st.saved_blocks - 1].hex(),
                }
            }
        return st.leased, params

    # ============================================================ worker
    def _init_worker(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._loading: Dict[str, Tuple[Future, LoadJob]] = {}
        self._load_errors: Set[int] = set()
        self._lease_of: Dict[str, str] = {}  # lease id -> req id
        self._lease_req: Dict[str, str] = {}  # req id -> lease id
        self._lease_ended: Set[str] = set()  # req ids whose lease ended (or was never granted)
        self._finished: Set[str] = set()  # req ids vLLM reported finished, lease pending
        self._cuda = False
        #: the last 256 saves and finished loads: ``("save", req_id, hashes,
        #: block_ids, saved)`` / ``("load", req_id, hashes, block_ids, loaded)``
        self.history: Deque[Tuple[str, str, List[bytes], List[int], int]] = deque(maxlen=256)
        #: counters: loaded_blocks, failed_blocks, saved_blocks, flushes, flush_failures, leases_granted,
        #: and per lease end leases_released / leases_expired / leases_revoked
        self.stats: Dict[str, int] = dict(
            loaded_blocks=0, failed_blocks=0, saved_blocks=0, flushes=0, flush_failures=0, leases_granted=0
        )

    @property
    def node(self) -> Optional["kvferry.Node"]:
        """The worker's kvferry node (``None`` before :meth:`register_kv_caches`)."""
        return self._node

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        """Starts this worker's node and registers vLLM's KV cache with it.

        Args:
            kv_caches: layer name -> that layer's KV tensor, in one of the
                layouts :func:`kv_layout` names (all layers the same). Each
                block of a layer must be one run of bytes (vLLM's
                ``KVCacheLayout`` ``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC``;
                not ``LHBNC`` or ``BHLNC``, where heads are outside blocks).

        Raises:
            LayoutError: an unsupported layout (names the layer, its shape,
                strides and vLLM's KV cache layout), layers that disagree,
                or a layer count other than the namespace's.
            StartError: the MetaServer does not answer.
        """
        cfg = self._kv_cache_config
        names = list(cfg.kv_cache_groups[0].layer_names) if cfg is not None else []
        order = [n for n in names if n in kv_caches] + [n for n in kv_caches if n not in names]
        num_blocks = int(cfg.num_blocks) if cfg is not None else None
        vllm_layout = getattr(cfg, "kv_cache_layout", None) or getattr(
            self._vllm_config.cache_config, "kv_cache_layout", None
        )
        ks, vs = [], []
        layout = None
        for name in order:
            t = kv_caches[name]
            nb = num_blocks if num_blocks is not None else int(t.shape[0])
            try:
                this = kv_layout(t.shape, nb, self.block_size)
            except LayoutError as e:
                raise LayoutError(f"layer {name!r}: {e.args[0]}", e.code) from None
            if layout is None:
                layout = this
            elif this != layout:
                raise LayoutError(f"layer {name!r} has layout {this} but the first layer has {layout}", "vllm_layout")
            if this == "kv_first":
                ks.append(_physical_block_view(t[0]))
                vs.append(_physical_block_view(t[1]))
            elif this == "blocks_first":
                ks.append(_physical_block_view(t[:, 0]))
                vs.append(_physical_block_view(t[:, 1]))
            else:
                ks.append(_physical_block_view(t))
        if len(ks) != self.layers:
            raise LayoutError(
                f"vLLM registered {len(ks)} KV layers but its KV cache config names {self.layers}", "vllm_layout"
            )
        first = kv_caches[order[0]]
        self._cuda = first.device.type == "cuda"
        gpu = self.cfg.gpu or ("cuda" if self._cuda else "host")
        device = (first.device.index or 0) if self._cuda else 0
        node = kvferry.Node(
            self.cfg.metaserver,
            pool_bytes=self.cfg.pool_bytes,
            gpu=gpu,
            device=device,
            host=self.cfg.host,
            fetch_timeout=self.cfg.fetch_timeout,
            rpc_timeout=self.cfg.rpc_timeout,
        )
        try:
            _probe_metaserver(node, self.ns, self.cfg)
            try:
                self.kv_info = node.register_kv_cache(self.ns, ks, vs if vs else None, dtype=_dtype_name(first.dtype))
            except (kvferry.BufferError, LayoutError) as e:
                raise LayoutError(
                    f"vLLM's KV cache (KV cache layout {vllm_layout}, layer {order[0]!r} of shape "
                    f"{list(first.shape)} and strides {list(first.stride())}) cannot be registered: {e.args[0]}. "
                    "kvferry needs each block of a layer to be one run of bytes (layouts LBHNC, LBNHC, BLHNC, BLNHC)",
                    "vllm_layout",
                ) from None
        except BaseException:
            node.shutdown(1)
            raise
        self._node = node
        self.kv_layout = layout
        self._kv_caches = kv_caches
        self._pool = ThreadPoolExecutor(self.cfg.load_threads, thread_name_prefix="kvferry-load")
        with _LOCAL_LOCK:
            _LOCAL_NODES[self._engine_id] = node
        logger.info(
            "kvferry: node %s registered %d layers (%s, vLLM layout %s) in namespace %r",
            node.address, len(ks), layout, vllm_layout, self.ns,
        )

    def _require_node(self) -> "kvferry.Node":
        if self._node is None:
            raise kvferry.ClosedError(
                "KvferryConnector: register_kv_caches was not called (or shutdown was)", "vllm_state"
            )
        return self._node

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Starts this step's loads in the background (``fetch_into``: query,
        fetch from the owners, verify, copy into the allocated blocks). They
        complete between steps; :meth:`get_finished` reports them."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvferryConnectorMetadata) or not meta.loads:
            return
        node = self._require_node()
        assert self._pool is not None
        for job in meta.loads:
            self._loading[job.req_id] = (self._pool.submit(self._load, node, job), job)

    def _load(self, node: "kvferry.Node", job: LoadJob) -> int:
        """Returns how many of ``job``'s blocks (from the first) are in vLLM's cache."""
        owners = None if not job.owners else [kvferry.PrefixOwner(o, k) for o, k in job.owners]
        f, lrep = node.fetch_into(self.ns, job.hashes, job.block_ids, timeout=self.cfg.fetch_timeout, owners=owners)
        loaded = f.available
        if lrep.failed:
            loaded = min([loaded] + [pos for pos, _, _ in lrep.failed])
        if self._cuda:
            import torch

            torch.cuda.synchronize()
        if loaded < len(job.hashes):
            logger.warning("kvferry: request %s loaded %d of %d blocks (%s)", job.req_id, loaded, len(job.hashes), f.stopped)
        return loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: loads finish between steps, before vLLM schedules the request."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        """No-op: kvferry saves whole blocks (every layer) in :meth:`wait_for_save`."""
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Ends the device leases of preempted requests before vLLM reuses
        their blocks (a decode reading them falls back to the pool)."""
        if not isinstance(kv_connector_metadata, KvferryConnectorMetadata) or self._node is None:
            return
        for req_id in kv_connector_metadata.preempted:
            lease = self._lease_req.get(req_id)
            if lease is not None:
                self._node.end_device_lease(lease)

    def wait_for_save(self) -> None:
        """Saves this step's finished blocks into the pool (every layer at
        once) and registers them; for a producer request whose prompt is now
        complete, grants a device lease on its blocks and runs the handoff
        barrier before returning, so the decode's query sees the blocks."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvferryConnectorMetadata) or not meta.saves:
            return
        node = self._require_node()
        if self._cuda:
            import torch

            torch.cuda.current_stream().synchronize()
        barrier = False
        for job in meta.saves:
            if job.hashes:
                rep = node.save(self.ns, job.hashes, job.block_ids)
                self.stats["saved_blocks"] += rep.saved
                self.history.append(("save", job.req_id, job.hashes, job.block_ids, rep.saved + rep.already_resident))
            if job.lease:
                self._grant_lease(node, job)
            barrier |= job.handoff
        if barrier:
            flush = node.flush_saves_and_registrations(timeout=self.cfg.flush_timeout)
            self.stats["flushes"] += 1
            if not flush.ok:
                self.stats["flush_failures"] += 1
                logger.warning("kvferry: handoff barrier incomplete: %s", flush)

    def _grant_lease(self, node: "kvferry.Node", job: SaveJob) -> None:
        try:
            lease = node.grant_device_lease(self.ns, job.lease_hashes, job.lease_block_ids, ttl=self.cfg.lease_ttl)
        except KvferryError as e:
            logger.warning("kvferry: no device lease for request %s (%s): its blocks are freed when it finishes", job.req_id, e)
            self._lease_ended.add(job.req_id)
            return
        self.stats["leases_granted"] += 1
        self._lease_of[lease] = job.req_id
        self._lease_req[job.req_id] = lease

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """``(finished sending, finished receiving)``: requests whose lease
        ended after vLLM finished them (their blocks may be freed), and
        requests whose load completed (fully or not; the blocks that were not
        loaded are in :meth:`get_block_ids_with_load_errors`)."""
        recving: Set[str] = set()
        for req_id, (fut, job) in list(self._loading.items()):
            if not fut.done():
                continue
            del self._loading[req_id]
            try:
                loaded = fut.result()
            except Exception as e:  # a refused call: nothing loaded
                logger.warning("kvferry: load of request %s failed: %s", req_id, e)
                loaded = 0
            self.stats["loaded_blocks"] += loaded
            self.stats["failed_blocks"] += len(job.block_ids) - loaded
            self._load_errors.update(job.block_ids[loaded:])
            self.history.append(("load", req_id, job.hashes, job.block_ids, loaded))
            recving.add(req_id)
        sending: Set[str] = set()
        if self._node is not None:
            for lease, _ns, _blocks, how in self._node.ended_device_leases():
                key = f"leases_{how}"
                self.stats[key] = self.stats.get(key, 0) + 1
                req_id = self._lease_of.pop(lease, None)
                if req_id is not None:
                    self._lease_req.pop(req_id, None)
                    self._lease_ended.add(req_id)
        self._finished |= set(finished_req_ids or ())
        for req_id in list(self._finished):
            if req_id in self._lease_ended:
                sending.add(req_id)
                self._lease_ended.discard(req_id)
                self._finished.discard(req_id)
            elif req_id not in self._lease_req:
                # finished without a lease (never leased): nothing to report
                self._finished.discard(req_id)
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """vLLM block ids whose load failed since the last call (vLLM
        recomputes from the first of them on, per request)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Stops the node (waits for in-flight loads first)."""
        if self._role == KVConnectorRole.SCHEDULER:
            self._query_node.shutdown(1)
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._node is not None:
            with _LOCAL_LOCK:
                if _LOCAL_NODES.get(self._engine_id) is self._node:
                    del _LOCAL_NODES[self._engine_id]
            self._node.shutdown(2)
            self._node = None
