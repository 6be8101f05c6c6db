"""kvferry: KV-cache storage and transfer for disaggregated (prefill/decode)
LLM serving, embedded in your Python process.

A prefill process saves the KV blocks of a prompt from its own paged cache
into a pinned host pool and registers them in a cluster-wide MetaServer; a
decode process looks the prompt's blocks up, fetches them from the owner
(verifying every byte's checksum) into its own pool and loads them into its
own paged cache. Anything that fails degrades to "k of n blocks fetched":
the caller recomputes the rest.

Quick start (one process, numpy, the ``host`` backend)::

    import numpy as np, kvferry
    with kvferry.MetaServer() as ms, kvferry.Node(ms.address) as node:
        ns = kvferry.namespace("toy", "float32", block_tokens=16, layers=1)
        k = np.zeros((8, 16, 2, 64), np.float32)   # [blocks, tokens, heads, dim]
        v = np.zeros_like(k)
        node.register_kv_cache(ns, [k], [v])
        hashes = kvferry.block_hashes(ns, list(range(40)), 16)   # 2 full blocks
        node.save(ns, hashes, [0, 1])
        node.flush_saves_and_registrations(timeout=5)
        print(node.query_prefix(ns, hashes))                     # 2

Objects: :class:`MetaServer`, :class:`Node`; functions :func:`block_hashes`,
:func:`namespace`; reports :class:`SaveReport`, :class:`FlushReport`,
:class:`FetchReport`, :class:`LoadReport`, :class:`PrefixOwner`,
:class:`KvCacheInfo`; exceptions in :mod:`kvferry.errors` (all derive from
:class:`KvferryError` and carry ``code``, the error's stable code).

vLLM: :mod:`kvferry.vllm` is a vLLM v1 KV connector (``KvferryConnector``,
loaded by vLLM by module path; importing it needs vLLM, nothing else here does).

Every blocking call releases the GIL, takes a ``timeout`` in seconds, and can
be interrupted with Ctrl-C. Each MetaServer and Node owns its own Rust
runtime: several can live in one process. Runtime threads do not survive a
``fork``: create nodes in the process that uses them (with
``multiprocessing``, use the ``spawn`` start method or create them in the
child).
"""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _native
from ._tensors import TensorInfo, block_geometry, describe
from .errors import (
    BlockIndexError,
    BufferError,
    ClosedError,
    ConfigError,
    DeadlineError,
    GpuError,
    KvferryError,
    LayoutError,
    MetaServerError,
    PeerError,
    PoolFullError,
    StartError,
    UnknownNamespaceError,
)
from .errors import __all__ as _error_names

__all__ = [
    "MetaServer",
    "Node",
    "block_hashes",
    "namespace",
    "cuda_built",
    "SaveReport",
    "FlushReport",
    "FetchReport",
    "LoadReport",
    "PrefixOwner",
    "TransferAsk",
    "KvCacheInfo",
    "TensorInfo",
    "describe",
    *_error_names,
]

__version__ = "0.1.0"

BlockHashes = Sequence[bytes]

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
# The smallest pool a node starts with: one page. Real KV blocks are larger;
# a pool smaller than the cache's blocks is refused by register_kv_cache.
_POOL_BYTES_MIN = 4096
# Smallest disk tier (bytes): kvferry::limits::DISK_CAPACITY_BYTES_MIN.
_SSD_BYTES_MIN = 1 << 20
# The tier's largest size (kvferry::limits::DISK_CAPACITY_BYTES_MAX).
_SSD_BYTES_MAX = 1 << 46


def _int_arg(value: Any, name: str, lo: int, hi: int, cls: type = ConfigError) -> int:
    """``value`` as an int in ``[lo, hi]``, else ``cls`` naming ``name``
    (instead of Python's ``OverflowError`` from the native layer)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__} {value!r}", "type") from None
    if not lo <= v <= hi:
        raise cls(f"{name} = {v} is out of range: it must be in [{lo}, {hi}]", "range")
    return v


def _seconds(value: Any, name: str = "timeout") -> float:
    """``value`` as a float of seconds, else ``ConfigError`` naming ``name``
    (instead of Python's ``ValueError`` or ``TypeError`` from ``float``);
    the native layer checks its range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}", "bad_timeout")
    return float(value)


def _block_ids(block_ids: Sequence[int], *, distinct: bool = False) -> List[int]:
    """Block indices as ints in u64 range, each named ``block_ids[i]`` in the
    error; ``distinct``: a destination named twice is refused (it would
    receive only the last of its blocks)."""
    # Read once (a generator is consumed by the first pass).
    block_ids = block_ids if isinstance(block_ids, (list, tuple, range)) else list(block_ids)
    try:
        out = [operator.index(b) for b in block_ids]
        bad = bool(out) and (min(out) < 0 or max(out) > _U64_MAX)
    except TypeError:
        bad = True
    if bad:
        # The slow path names the first bad entry (one f-string per id
        # cost ~0.1 ms per 500 ids on every call).
        out = [_int_arg(b, f"block_ids[{i}]", 0, _U64_MAX, BlockIndexError) for i, b in enumerate(block_ids)]
    if distinct and len(set(out)) != len(out):
        seen: Dict[int, int] = {}
        for i, b in enumerate(out):
            if b in seen:
                raise ConfigError(
                    f"block_ids[{seen[b]}] and block_ids[{i}] both name destination block {b}: each destination "
                    "block can receive one block, pass distinct block ids",
                    "duplicate_block",
                )
            seen[b] = i
    return out


def _owners(owners: Any) -> List[Tuple[str, int]]:
    """``query_prefix_remote``'s answer as ``(node, blocks)`` pairs, else
    ``ConfigError`` naming ``owners`` or ``owners[i]``."""
    if isinstance(owners, (str, bytes)) or not isinstance(owners, Iterable):
        raise ConfigError(
            f"owners must be a sequence of PrefixOwner (as query_prefix_remote returns), got {type(owners).__name__}",
            "type",
        )
    out = []
    for i, o in enumerate(owners):
        if not isinstance(o, PrefixOwner) or not isinstance(o.node, str):
            raise ConfigError(
                f"owners[{i}] must be a PrefixOwner with a str node (as query_prefix_remote returns), got {o!r}", "type"
            )
        out.append((o.node, _int_arg(o.blocks, f"owners[{i}].blocks", 0, _U32_MAX)))
    return out


def _check_metaserver(addr: str) -> str:
    """A ``host:port`` MetaServer address, else ``ConfigError`` naming
    ``metaserver`` (the node would otherwise start and only fail later)."""
    if not isinstance(addr, str):
        raise ConfigError(f"metaserver must be a host:port string or a MetaServer, got {type(addr).__name__}", "type")
    _native.check_metaserver_address(addr)
    return addr


def _check_peer(addr: Any) -> str:
    """A peer's ``host:port`` (no scheme, port 1-65535), else ``ConfigError``
    naming ``addr``."""
    if not isinstance(addr, str):
        raise ConfigError(f"addr must be a host:port string, got {type(addr).__name__}", "type")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or "/" in addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"addr must be host:port (no scheme, port 1-65535), got {addr!r}", "addr_parse")
    return addr


def block_hashes(namespace: str, tokens: Sequence[int], block_tokens: int) -> List[bytes]:
    """Chained hashes of the *full* blocks of ``tokens``.

    Block ``i`` covers ``tokens[i*block_tokens:(i+1)*block_tokens]``; its
    hash depends on the namespace and on every token up to the end of the
    block, so equal hashes mean equal prefixes. A trailing partial block gets
    no hash. The hash is the one kvferry's Rust side computes, so processes
    (and Rust embedders) agree.

    Args:
        namespace: the KV layout family (see :func:`namespace`).
        tokens: token ids (each ``0 <= t < 2**32``).
        block_tokens: tokens per block (>= 1).

    Returns:
        ``len(tokens) // block_tokens`` hashes of 32 bytes.
    """
    bt = _int_arg(block_tokens, "block_tokens", 1, _U32_MAX)
    try:
        return _native.block_hashes(namespace, [operator.index(t) for t in tokens], bt)
    except (OverflowError, TypeError):
        # Find the token the native layer could not take, and name it.
        for i, t in enumerate(tokens):
            _int_arg(t, f"tokens[{i}]", 0, _U32_MAX)
        raise


def namespace(
    model: str,
    dtype: str,
    block_tokens: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: Optional[int] = None,
) -> str:
    """The namespace naming one KV layout family.

    Blocks are only exchanged between nodes that use the same namespace, so
    it must change whenever the bytes of a block would: model, dtype, tokens
    per block, tensor-parallel rank and size, number of layers.

    Args:
        layers: the model's number of layers (required: the namespace names
            it, and :meth:`Node.register_kv_cache` checks that one K (and V)
            tensor per layer is given).

    Raises:
        ConfigError: ``layers`` missing, or an argument out of range (each
            integer is in ``[0, 2**32)``; block_tokens, tp_size and layers at
            least 1; tp_rank below tp_size).
    """
    if layers is None:
        raise ConfigError(
            "namespace() needs layers=N, the model's number of layers (part of the namespace, checked against the "
            "tensors given to register_kv_cache)",
            "layers",
        )
    return _native.namespace(
        model,
        dtype,
        _int_arg(block_tokens, "block_tokens", 1, _U32_MAX),
        _int_arg(tp_rank, "tp_rank", 0, _U32_MAX),
        _int_arg(tp_size, "tp_size", 1, _U32_MAX),
        _int_arg(layers, "layers", 1, _U32_MAX),
    )


def cuda_built() -> bool:
    """Whether this build of the package has the ``cuda`` GPU backend."""
    return bool(_native.cuda_built())


@dataclass(frozen=True)
class SaveReport:
    """Result of :meth:`Node.save`.

    Attributes:
        saved: blocks copied into the pool, sealed and registered.
        already_resident: blocks skipped because the pool already held them.
        no_space: blocks not saved because the pool was full.
    """

    saved: int
    already_resident: int
    no_space: int


@dataclass(frozen=True)
class FlushReport:
    """Result of :meth:`Node.flush_saves_and_registrations`.

    Attributes:
        delivered: registrations the MetaServer accepted.
        dropped: registrations lost (queue full, MetaServer down, shutdown).
        timed_out: the barrier gave up at its timeout.
    """

    delivered: int
    dropped: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        """Every registration was delivered in time."""
        return not self.timed_out and self.dropped == 0


@dataclass(frozen=True)
class FetchReport:
    """Result of :meth:`Node.fetch`: "``available`` of ``requested``".

    Attributes:
        requested: blocks asked for (``n``).
        available: the verified contiguous prefix now resident on this node
            (``k``, local hits included); recompute blocks ``k..n``.
        local_hits: blocks already resident before the fetch.
        fetched: blocks read from peers and verified.
        bytes: bytes read from peers.
        owners: peers asked, in order.
        stopped: why it stopped short (``None`` when ``available == requested``).
        stopped_code: the stable code of ``stopped`` (``"fetch_no_owner"``,
            ``"fetch_metaserver"``...; ``docs/design.md``, "Errors").
        phases_ms: where the fetch's wall time went, in milliseconds, by
            phase in handoff order (``stage``, ``query``, ``handshake``,
            ``lock``, ``read``, ``verify``, ``seal``, ``release``,
            ``load_tail``; the Rust ``FetchPhases``); they add up to the
            fetch's wall time.
    """

    requested: int
    available: int
    local_hits: int
    fetched: int
    bytes: int
    owners: List[str]
    stopped: Optional[str]
    stopped_code: Optional[str]
    phases_ms: Dict[str, float] = field(default_factory=dict)

    @property
    def stopped_cause(self) -> Optional[str]:
        """``stopped_code`` (its former name)."""
        return self.stopped_code

    @property
    def complete(self) -> bool:
        """Every requested block is resident."""
        return self.available == self.requested

    def __str__(self) -> str:
        why = f", stopped: {self.stopped}" if self.stopped else ""
        return f"{self.available} of {self.requested} blocks ({self.fetched} fetched, {self.bytes} bytes{why})"


@dataclass(frozen=True)
class LoadReport:
    """Result of :meth:`Node.load`.

    Attributes:
        loaded: blocks copied into the caller's cache.
        failed: ``(position in the request, reason, code)`` per block that
            was not loaded (code ``"load_not_resident"``, ``"load_deadline"``
            for a copy not started by the call's timeout, or a GPU error's).
    """

    loaded: int
    failed: List[Tuple[int, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every block was loaded."""
        return not self.failed


@dataclass(frozen=True)
class PrefixOwner:
    """One MetaServer answer: ``node`` holds the first ``blocks`` hashes."""

    node: str
    blocks: int


@dataclass(frozen=True)
class TransferAsk:
    """Who will read a transfer ticket (:meth:`Node.transfer_ask`, passed to
    the owner's :meth:`Node.grant_transfer`): the reader's address and, when
    it copies device to device, its ``(handle kind, process id)``. Plain
    data: send it to the owner however your engines talk.
    """

    requester: str
    device: Optional[Tuple[int, int]] = None


@dataclass(frozen=True)
class KvCacheInfo:
    """What :meth:`Node.register_kv_cache` registered.

    Attributes:
        namespace: the namespace.
        layers: number of layers.
        num_blocks: blocks per layer.
        bytes_per_block: bytes of one block of one segment (K or V) of one layer.
        block_stride: bytes between consecutive blocks in the tensors.
        dtype: element type.
        block_shape: shape of one block (e.g. ``(block_tokens, kv_heads, head_dim)``).
        buffers: how many buffers the tensors were registered as: one per
            group of tensors in one allocation (tensors that overlap, or
            touch inside one allocation the backend can see); separate
            allocations, even back to back, are separate buffers.
    """

    namespace: str
    layers: int
    num_blocks: int
    bytes_per_block: int
    block_stride: int
    dtype: str
    block_shape: Tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        """Pool bytes of one block (all layers, K and V)."""
        segments = 2 if self._has_v else 1
        return self.layers * segments * self.bytes_per_block

    _has_v: bool = True
    buffers: int = 0


class MetaServer:
    """The cluster's block index, served in this process on its own runtime.

    Args:
        addr: ``ip:port`` to listen on; port 0 picks a free one (see
            :attr:`address`).
        stale_after_s: a node silent this long is invisible to queries.
        ttl_s: a node silent this long is forgotten.
        sweep_interval_s: how often forgotten nodes are swept.

    Raises:
        StartError: the port is taken or cannot be bound.
        ConfigError: a malformed address or inconsistent durations.

    Use as a context manager, or call :meth:`shutdown`.
    """

    def __init__(
        self,
        addr: str = "127.0.0.1:0",
        *,
        stale_after_s: int = 30,
        ttl_s: int = 120,
        sweep_interval_s: int = 10,
    ) -> None:
        self._ms = _native.MetaServer(
            addr,
            _int_arg(stale_after_s, "stale_after_s", 0, _U64_MAX),
            _int_arg(ttl_s, "ttl_s", 0, _U64_MAX),
            _int_arg(sweep_interval_s, "sweep_interval_s", 0, _U64_MAX),
        )

    @property
    def address(self) -> str:
        """The bound ``ip:port``; give it to :class:`Node`."""
        return self._ms.address

    @property
    def running(self) -> bool:
        """True until :meth:`shutdown`."""
        return bool(self._ms.running())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops serving (in-flight requests finish) within ``timeout``
        seconds. Idempotent."""
        self._ms.shutdown(_seconds(timeout))

    def metrics(self) -> Dict[str, Any]:
        """The store's statistics and the service's counters (as text)."""
        return dict(self._ms.metrics())

    def __enter__(self) -> "MetaServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"MetaServer({self.address!r}, running={self.running})"


class Node:
    """A kvferry node in this process: an engine with a pinned host pool, its
    MetaServer client, and the services peers fetch from. It serves peers
    from its own runtime threads as long as it runs.

    Args:
        metaserver: the MetaServer's ``host:port`` (or a :class:`MetaServer`).
        pool_bytes: size of the pinned host pool, allocated once at start.
            Every saved or fetched block takes one slot of
            ``KvCacheInfo.block_bytes``; full pools evict least-recently-used
            blocks.
        gpu: ``"host"`` (the caller's cache is host memory: numpy arrays,
            CPU tensors) or ``"cuda"`` (CUDA tensors; needs a wheel built with
            the ``cuda`` feature, see :func:`cuda_built`).
        device: CUDA device ordinal (``gpu="cuda"``).
        transport: the data plane; ``"tcp"``.
        host: IP to bind and advertise to peers.
        grpc_port, data_port: ports to bind (0: any free port).
        fetch_timeout: the engine's bound on a whole fetch (seconds).
        rpc_timeout: the bound on each MetaServer and peer request (seconds).
        ssd_dir: an existing directory on a local SSD for the disk tier
            below the pool (None: no tier). Blocks the pool evicts are
            written there and stay advertised; a lookup, load or a peer's
            fetch reads them back, verified. A node restarted on the same
            directory serves what it finds there again.
        ssd_bytes: size of the disk tier's file (bytes; with ``ssd_dir``).

    Raises:
        StartError: a port is taken, the pool cannot be allocated, the GPU
            backend is unavailable, the disk tier cannot be opened.
        ConfigError: a malformed address or setting.

    Use as a context manager, or call :meth:`shutdown`.
    """

    def __init__(
        self,
        metaserver: Union[str, MetaServer],
        *,
        pool_bytes: int = 256 << 20,
        gpu: str = "host",
        device: int = 0,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        grpc_port: int = 0,
        data_port: int = 0,
        fetch_timeout: float = 5.0,
        rpc_timeout: float = 2.0,
        ssd_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        ssd_bytes: int = 0,
    ) -> None:
        if isinstance(metaserver, MetaServer):
            metaserver = metaserver.address
        if gpu not in ("host", "cuda"):
            raise ConfigError(f'unknown gpu backend {gpu!r}: use "host" or "cuda"', "gpu")
        self._device = _int_arg(device, "device", 0, (1 << 31) - 1)
        self._fetch_timeout = _seconds(fetch_timeout, "fetch_timeout")
        self._rpc_timeout = _seconds(rpc_timeout, "rpc_timeout")
        self._pool_bytes = _int_arg(pool_bytes, "pool_bytes", _POOL_BYTES_MIN, _U64_MAX)
        if ssd_dir is None and ssd_bytes != 0:
            raise ConfigError(
                f"ssd_bytes = {ssd_bytes!r} is set but ssd_dir is not: the disk tier needs both "
                "(ssd_dir: an existing directory on a local SSD)",
                "ssd_dir",
            )
        self._node = _native.Node(
            _check_metaserver(metaserver),
            self._pool_bytes,
            gpu,
            self._device,
            transport,
            host,
            _int_arg(grpc_port, "grpc_port", 0, 65535),
            _int_arg(data_port, "data_port", 0, 65535),
            self._fetch_timeout,
            self._rpc_timeout,
            None if ssd_dir is None else os.fspath(ssd_dir),
            _int_arg(ssd_bytes, "ssd_bytes", 0 if ssd_dir is None else _SSD_BYTES_MIN, _SSD_BYTES_MAX),
        )
        # namespace -> (info, [(buffer id, owner object)]); the owners keep
        # registered memory alive while the engine may copy into it.
        self._caches: Dict[str, Tuple[KvCacheInfo, List[Tuple[int, Any]]]] = {}
        self._spans: Dict[str, List[Tuple[int, int]]] = {}

    # -- properties -----------------------------------------------------
    @property
    def address(self) -> str:
        """This node's advertise address (``host:port``) at the MetaServer."""
        return self._node.address

    @property
    def gpu(self) -> str:
        """The GPU backend (``"host"`` or ``"cuda"``)."""
        return self._node.gpu

    @property
    def running(self) -> bool:
        """True until :meth:`shutdown` or :meth:`kill`."""
        return bool(self._node.running())

    # -- registration ---------------------------------------------------
    def _check_device(self, info: TensorInfo, what: str) -> None:
        if self.gpu == "host" and info.device != "host":
            raise BufferError(
                f"{what} is a CUDA tensor but this node's backend is 'host': start the node with gpu='cuda' "
                "or pass host memory",
                "device",
            )
        if self.gpu == "cuda":
            if info.device != "cuda":
                raise BufferError(
                    f"{what} is host memory but this node's backend is 'cuda': pass CUDA tensors or use gpu='host'",
                    "device",
                )
            if info.device_index is not None and info.device_index != self._device:
                raise BufferError(
                    f"{what} is on cuda:{info.device_index} but this node uses cuda:{self._device}", "device"
                )

    def register_kv_cache(
        self,
        namespace: str,
        k_caches: Sequence[Any],
        v_caches: Optional[Sequence[Any]] = None,
        *,
        dtype: Optional[str] = None,
    ) -> KvCacheInfo:
        """Registers the caller's paged KV cache for ``namespace``.

        The cache stays the caller's: kvferry copies blocks out of it
        (:meth:`save`) and into it (:meth:`load`) and never frees it. This
        node keeps a reference to every tensor until the node shuts down.

        Args:
            namespace: the layout family (see :func:`namespace`).
            k_caches: per layer, a tensor whose first axis indexes blocks,
                e.g. vLLM's "NHD" ``[num_blocks, block_tokens, kv_heads,
                head_dim]``; each block must be contiguous. torch (CPU or
                CUDA), CuPy, numpy arrays, or writable buffers.
            v_caches: per layer, the V tensor of the same shape and dtype;
                ``None`` for single-segment caches (MLA).
            dtype: if given, every tensor must have this dtype
                (``"bfloat16"``, ``"float16"``, ``"float32"``, ...).

        Returns:
            What was registered.

        Raises:
            BufferError: a tensor of the wrong dtype, not contiguous inside a
                block, on another device than this node's backend, or
                refused by the GPU backend (e.g. freed memory on CUDA).
            LayoutError: shapes that disagree between tensors, or a namespace
                already registered with a different layout.
        """
        ks = list(k_caches)
        vs = None if v_caches is None else list(v_caches)
        if not ks:
            raise BufferError("k_caches is empty: pass one tensor per layer", "shape")
        if vs is not None and len(vs) != len(ks):
            raise LayoutError(f"{len(ks)} K tensors but {len(vs)} V tensors: pass one of each per layer", "shape")
        tensors: List[Tuple[str, Any]] = []
        for i, k in enumerate(ks):
            tensors.append((f"K of layer {i}", k))
            if vs is not None:
                tensors.append((f"V of layer {i}", vs[i]))
        infos = []
        first: Optional[TensorInfo] = None
        geometry = None
        for what, t in tensors:
            info = describe(t, what)
            self._check_device(info, what)
            if dtype is not None and info.dtype != dtype:
                raise BufferError(f"{what} has dtype {info.dtype}, expected {dtype}", "dtype")
            if info.readonly:
                raise BufferError(f"{what} is read-only; kvferry loads into it", "read_only")
            geo = block_geometry(info, what)
            if first is None:
                first, geometry = info, geo
            else:
                if info.dtype != first.dtype:
                    raise BufferError(f"{what} has dtype {info.dtype} but K of layer 0 has {first.dtype}", "dtype")
                if info.shape != first.shape:
                    raise LayoutError(f"{what} has shape {info.shape} but K of layer 0 has {first.shape}", "shape")
                if geo != geometry:
                    raise LayoutError(f"{what} has block stride {geo[2]} but K of layer 0 has {geometry[2]}", "shape")
            infos.append((info, t))
        assert first is not None and geometry is not None
        num_blocks, bytes_per_block, block_stride = geometry
        span = (num_blocks - 1) * block_stride + bytes_per_block
        if namespace in self._caches:
            known, held = self._caches[namespace]
            same = [info.addr for info, _ in infos] == [addr for addr, _ in self._spans[namespace]] and (
                known.num_blocks,
                known.bytes_per_block,
                known.block_stride,
                known.layers,
            ) == (num_blocks, bytes_per_block, block_stride, len(ks))
            if same:
                return known
            raise LayoutError(
                f"namespace {namespace!r} already has a different layout on this node: use another namespace "
                "or register the same tensors",
                "engine_layout_exists",
            )
        # A pool that cannot hold one block of this cache would report
        # "no space" for every save: refuse it now.
        block_bytes = len(ks) * (2 if vs is not None else 1) * bytes_per_block
        gauges = self._node.metrics()
        pool_capacity = int(gauges["pool_used_bytes"]) + int(gauges["pool_free_bytes"])
        if block_bytes > pool_capacity:
            raise ConfigError(
                f"one block of this KV cache takes {block_bytes} bytes of pool ({len(ks)} layers x "
                f"{2 if vs is not None else 1} segments x {bytes_per_block} bytes) but this node's pool_bytes "
                f"holds {pool_capacity}: start the node with a pool_bytes of many blocks",
                "pool_too_small",
            )
        # One registered buffer per group of tensors that lie in one
        # allocation: tensors whose memory overlaps (K and V strided views of
        # one tensor) always share one; tensors that only touch share one when
        # the backend places both in the same allocation (K and V halves of one
        # [2, num_blocks, ...] tensor on CUDA). Separate allocations an
        # allocator placed back to back (per-layer torch tensors) stay
        # separate buffers: CUDA refuses a buffer spanning two allocations.
        # Each segment is an offset into its group's buffer.
        groups = self._node.group_buffers([(info.addr, span) for info, _ in infos])
        seg: Dict[int, Tuple[int, int]] = {}
        registered: List[Tuple[int, Any]] = []
        try:
            for start, length, members in groups:
                bid = self._node.register_buffer(start, length)
                registered.append((bid, [infos[j][1] for j in members]))
                for j in members:
                    seg[j] = (bid, infos[j][0].addr - start)
            layers = []
            step = 2 if vs is not None else 1
            for i in range(len(ks)):
                kb, ko = seg[i * step]
                vb, vo = seg[i * step + 1] if vs is not None else (None, 0)
                layers.append((kb, ko, vb, vo, num_blocks, bytes_per_block, block_stride))
            self._node.register_layout(namespace, layers)
        except BaseException:
            for bid, _ in registered:
                try:
                    self._node.unregister_buffer(bid)
                except KvferryError:
                    pass
            raise
        cache = KvCacheInfo(
            namespace=namespace,
            layers=len(ks),
            num_blocks=num_blocks,
            bytes_per_block=bytes_per_block,
            block_stride=block_stride,
            dtype=first.dtype,
            block_shape=first.shape[1:],
            _has_v=vs is not None,
            buffers=len(registered),
        )
        self._caches[namespace] = (cache, registered)
        self._spans[namespace] = [(info.addr, span) for info, _ in infos]
        return cache

    def unregister_kv_cache(self, namespace: str) -> None:
        """Forgets the KV cache of ``namespace``: kvferry no longer copies
        into or out of those tensors, and this node drops its references to
        them (they may be freed afterwards). Blocks already in the pool stay
        and can still be served to peers and loaded after registering a cache
        of the same shape again.

        Raises:
            UnknownNamespaceError: nothing is registered for ``namespace``.
            LayoutError: a buffer is still in use by an in-flight copy
                (retry once the save or load finished).
        """
        self.kv_cache(namespace)
        self._node.unregister_layout(namespace)
        _, registered = self._caches.pop(namespace)
        self._spans.pop(namespace, None)
        for bid, _ in registered:
            self._node.unregister_buffer(bid)

    def kv_cache(self, namespace: str) -> KvCacheInfo:
        """What is registered for ``namespace``.

        Raises:
            UnknownNamespaceError: nothing is.
        """
        try:
            return self._caches[namespace][0]
        except KeyError:
            raise UnknownNamespaceError(
                f"no KV cache registered for namespace {namespace!r}: call register_kv_cache first", "UnknownNamespace"
            ) from None

    # -- data path ------------------------------------------------------
    def save(self, namespace: str, hashes: BlockHashes, block_ids: Sequence[int], *, timeout: float = 30.0) -> SaveReport:
        """Copies blocks from the registered cache into the pinned pool,
        seals them and queues their registrations at the MetaServer.

        Args:
            namespace: a registered namespace.
            hashes: block hashes (see :func:`block_hashes`).
            block_ids: for each hash, the index of the block in the caller's
                cache (first axis of the registered tensors).
            timeout: seconds.

        Raises:
            UnknownNamespaceError, BlockIndexError, GpuError, DeadlineError.
        """
        r = self._node.save(namespace, [bytes(h) for h in hashes], _block_ids(block_ids), _seconds(timeout))
        return SaveReport(**r)

    def flush_saves_and_registrations(self, timeout: float = 5.0) -> FlushReport:
        """The P/D handoff barrier: waits until every save started before the
        call is sealed and every registration queued before it reached the
        MetaServer (or was dropped), within ``timeout`` seconds. After it
        returns with ``ok``, a decode node's query sees the blocks. Never
        raises for a MetaServer that is down: the report says what was
        dropped."""
        delivered, dropped, timed_out = self._node.flush_saves_and_registrations(_seconds(timeout))
        return FlushReport(delivered, dropped, timed_out)

    def query_prefix(self, namespace: str, hashes: BlockHashes) -> int:
        """How many of ``hashes``, from the first, are resident in this
        node's pool (no network)."""
        return int(self._node.query_prefix(namespace, [bytes(h) for h in hashes]))

    def query_prefix_remote(
        self, namespace: str, hashes: BlockHashes, *, timeout: Optional[float] = None
    ) -> List[PrefixOwner]:
        """Asks the MetaServer which nodes hold a prefix of ``hashes``:
        longest prefix first.

        Raises:
            MetaServerError: the MetaServer is unreachable or refused.
            DeadlineError: no answer within ``timeout`` seconds (default:
                the node's ``rpc_timeout``).
        """
        t = self._rpc_timeout if timeout is None else _seconds(timeout)
        return [PrefixOwner(n, int(k)) for n, k in self._node.query_prefix_remote(namespace, [bytes(h) for h in hashes], t)]

    def fetch(self, namespace: str, hashes: BlockHashes, *, timeout: Optional[float] = None) -> FetchReport:
        """Pulls the missing prefix of ``hashes`` from the peers that own it
        into this node's pool, verifying every block's checksums.

        Never raises for a fetch that stops short (MetaServer down, owner
        dead, timeout...): the report says "``available`` of ``requested``"
        and why it stopped; recompute the rest. Use :meth:`load` to copy the
        fetched blocks into your cache.

        Args:
            timeout: seconds (default: the node's ``fetch_timeout``): the
                fetch's deadline, passed down to every step (MetaServer
                query, handshake, lock, reads, checksum pass); a fetch cut by it stops
                short with ``stopped_code`` ``"fetch_deadline"`` (or the
                timeout of the step it cut). The
                node's ``fetch_timeout`` bounds it too.

        Raises:
            DeadlineError: only when the fetch ran a second past its
                deadline (a wedged runtime).
        """
        t = self._fetch_timeout if timeout is None else _seconds(timeout)
        return FetchReport(**self._node.fetch(namespace, [bytes(h) for h in hashes], t))

    def load(self, namespace: str, hashes: BlockHashes, block_ids: Sequence[int], *, timeout: float = 30.0) -> LoadReport:
        """Copies resident blocks from the pool into the caller's cache at
        ``block_ids``. A block that is not resident is reported in
        ``failed``, not raised. ``timeout`` is the load's deadline: no copy
        starts after it (those blocks fail with code ``"load_deadline"``);
        a copy started before it is awaited, never abandoned.

        Raises:
            UnknownNamespaceError, BlockIndexError, DeadlineError (only when
            the load ran a second past its deadline: a wedged runtime).
        """
        r = self._node.load(namespace, [bytes(h) for h in hashes], _block_ids(block_ids, distinct=True), _seconds(timeout))
        return LoadReport(int(r["loaded"]), [tuple(f) for f in r["failed"]])

    def fetch_into(
        self,
        namespace: str,
        hashes: BlockHashes,
        block_ids: Sequence[int],
        *,
        timeout: Optional[float] = None,
        owners: Optional[Iterable[PrefixOwner]] = None,
        ticket: Optional[bytes] = None,
    ) -> Tuple[FetchReport, LoadReport]:
        """:meth:`fetch`, then :meth:`load` of the ``available`` prefix into
        ``block_ids[:available]``. Returns both reports. ``timeout`` is the
        deadline of the whole call as in :meth:`fetch`, load tail included:
        no copy into your cache starts after it (such blocks fail with code
        ``"load_deadline"``); copies that started before it are awaited,
        never abandoned, so the load report says exactly which blocks are in
        your cache.

        Args:
            owners: what :meth:`query_prefix_remote` just answered for the
                same ``hashes``: the fetch starts from it instead of asking
                the MetaServer again (one round trip less in the handoff).
                Its first usable owner is asked for every block left (it may
                hold more by now); one that no longer holds what the answer
                said is refused by its own transfer lock, and the fetch asks
                the MetaServer for the rest. An answer with no usable owner
                is ignored.
            ticket: the owner's transfer ticket for this node
                (:meth:`grant_transfer`'s bytes, handed over with "KV
                ready"): the fetch reads at once, with no MetaServer query
                and no lock round trip, and releases the ticket's lock
                whether it read or not. A ticket for another node, another
                namespace, another prompt (neither ``hashes`` nor the
                ticket's a prefix of the other), or blocks this node holds
                already is released unread and the
                fetch goes on as without it; one refused before the fetch
                starts (bytes that do not decode, bad arguments) is not
                released and expires at the owner.

        Raises:
            ConfigError: ``owners`` is not a sequence of :class:`PrefixOwner`
                (``owners[i]`` named), or an entry's ``node`` is not a string
                or its ``blocks`` not an integer in u32 range; both
                ``owners`` and ``ticket`` given; ``ticket`` is not bytes
                or does not decode (code ``ticket_*``).
        """
        t = self._fetch_timeout if timeout is None else _seconds(timeout)
        ids = _block_ids(block_ids, distinct=True)
        known = None if owners is None else _owners(owners)
        if ticket is not None and not isinstance(ticket, (bytes, bytearray)):
            raise ConfigError(f"ticket must be bytes, got {type(ticket).__name__}", "bad_ticket")
        tb = None if ticket is None else bytes(ticket)
        f, lrep = self._node.fetch_into(namespace, [bytes(h) for h in hashes], ids, t, known, tb)
        return FetchReport(**f), LoadReport(int(lrep["loaded"]), [tuple(x) for x in lrep["failed"]])

    def transfer_ask(self) -> TransferAsk:
        """This node as the reader of a transfer ticket: pass it to the
        owner's :meth:`grant_transfer` (a prefill engine, with the
        request)."""
        requester, device = self._node.transfer_ask()
        return TransferAsk(str(requester), None if device is None else (int(device[0]), int(device[1])))

    def grant_transfer(
        self, namespace: str, hashes: BlockHashes, to: TransferAsk, *, timeout: Optional[float] = None
    ) -> bytes:
        """Locks this node's blocks among ``hashes`` (saved with :meth:`save`)
        for the reader ``to`` and returns the transfer ticket, to send to
        that reader with "KV ready" (the P/D pattern of passing the decode
        what it pulls, as vLLM's ``kv_transfer_params``); the reader's
        :meth:`fetch_into` with ``ticket=`` then reads at once. The ticket
        holds the transfer lock the reader's own lock request would have
        taken (device ranges included only for a reader in this process or
        one proven to run on this host); it is released by the reader, or
        expires after the node's lock timeout if it never arrives. Call it
        after :meth:`flush_saves_and_registrations` (and, for device-direct
        reads, :meth:`grant_device_lease`). A ticket for blocks this node
        does not hold locks nothing. The bytes are a bearer capability
        (whoever holds them reads the locked blocks until the lock ends):
        send them to the one reader they name, and nowhere else.

        Raises:
            ConfigError: ``to`` is not a :class:`TransferAsk`, or its
                ``requester`` is not ``host:port``; malformed hashes; more
                than 16,384 hashes (code ``engine_too_many_blocks``).
            UnknownNamespaceError: no layout registered for ``namespace``.
            KvferryError: the lock table is full.
        """
        if not isinstance(to, TransferAsk):
            raise ConfigError(f"to must be a TransferAsk, got {type(to).__name__}", "bad_transfer_ask")
        t = self._rpc_timeout if timeout is None else _seconds(timeout)
        return bytes(self._node.grant_transfer(namespace, [bytes(h) for h in hashes], to.requester, to.device, t))

    def release_ticket(self, ticket: bytes) -> int:
        """Ends the transfer lock of a ticket this node granted
        (:meth:`grant_transfer`) that will not reach its reader (the request
        was cancelled, the decode node is gone), instead of letting it pin
        the blocks until the lock timeout. Returns the blocks released (0
        when the reader or the timeout already ended it). Idempotent.

        Raises:
            ConfigError: ``ticket`` is not bytes, does not decode (code
                ``ticket_*``), or another node granted it.
        """
        if not isinstance(ticket, (bytes, bytearray)):
            raise ConfigError(f"ticket must be bytes, got {type(ticket).__name__}", "bad_ticket")
        return int(self._node.release_ticket(bytes(ticket)))

    def connect_peer(self, addr: str, *, timeout: float = 30.0) -> str:
        """Connects to the peer node at ``addr`` (its ``host:port``, as the
        MetaServer names owners) before any fetch: the transfer handshake a
        fetch would make, and, when the peer runs on this host and shares its
        pool, the opening of that pool as a source of one-step copies into
        your cache (on ``cuda``: registering it, about 60 ms per GiB, which
        stalls other copies of this process meanwhile). Call it at start-up
        for the prefill nodes a decode node will read from, so no request
        pays for it. Waits at most ``timeout`` seconds.

        Returns:
            ``"ready"`` (one-step copies from the peer's pool),
            ``"not_mapped"`` (another host, or reads go over the network),
            ``"opening"`` (still being opened when ``timeout`` passed; it
            goes on in the background) or ``"refused"`` (the GPU backend
            cannot read that pool; reads copy through this node's pool).

        A peer that is not up yet (nothing listens, no answer within the
        node's ``rpc_timeout``) is tried again, after 50 ms doubling to 1 s,
        until ``timeout`` (the last try within 50 ms of it): nodes started
        in any order can call it at start-up.

        Raises:
            DeadlineError: no handshake within ``timeout`` (the message
            names the peer and the last try's failure); PeerError: the peer refused the
            handshake or answered with metadata that does not decode (at
            once, not retried); ConfigError: ``addr`` is not ``host:port``,
            or ``timeout`` is not a number of seconds in (0, 86400].
        """
        return str(self._node.connect_peer(_check_peer(addr), _seconds(timeout)))

    # -- device leases (same-host device-direct handoff) ----------------
    def grant_device_lease(
        self, namespace: str, hashes: BlockHashes, block_ids: Sequence[int], *, ttl: float = 30.0
    ) -> str:
        """Promises not to overwrite the cache blocks ``block_ids`` (which hold
        ``hashes``, saved with :meth:`save`) for up to ``ttl`` seconds, so a
        decode node on the same host can copy them device to device from
        this node's cache (CUDA IPC on the ``cuda`` backend) instead of
        reading the pool. The lease ends once: when that reader is done,
        when ``ttl`` passes, on :meth:`end_device_lease`, or when the
        namespace's cache is unregistered; :meth:`ended_device_leases` says
        when the blocks may be reused.

        Returns:
            The lease id (32 hex characters).

        Raises:
            UnknownNamespaceError, BlockIndexError;
            ConfigError: no blocks, a ttl of 0 or above 600 s, a block
            named twice or already leased;
            GpuError: the backend cannot share device memory.
        """
        return str(
            self._node.grant_device_lease(namespace, [bytes(h) for h in hashes], _block_ids(block_ids), _seconds(ttl, "ttl"))
        )

    def end_device_lease(self, lease_id: str) -> bool:
        """Ends a lease early (the blocks are needed back); ``False`` when it
        had already ended."""
        return bool(self._node.end_device_lease(str(lease_id)))

    def ended_device_leases(self) -> List[Tuple[str, str, List[int], str]]:
        """Leases that ended since the last call, oldest first:
        ``(lease_id, namespace, block_ids, how)`` with ``how`` one of
        ``"released"`` (the reader is done), ``"expired"``, ``"revoked"``.
        Those ``block_ids`` may be written again. Call it regularly: while
        65,536 ends wait undrained, new grants are refused."""
        return [(i, ns, list(b), how) for i, ns, b, how in self._node.ended_device_leases()]

    def metrics(self) -> Dict[str, int]:
        """Engine counters and gauges (saves, fetched blocks and bytes, pool
        use, registrations delivered/dropped, ...); with a disk tier also
        ``ssd_*``: records on disk and their bytes, blocks written, read and
        staged into the pool, disk evictions, verify failures, writes
        refused, and blocks recovered at start and re-advertised; per data
        path the fetched ``path_{ipc,shm,tcp}_{blocks,bytes,fallbacks}``
        (``path_shm_*`` includes the shared pool's one-step copies into
        the KV, also counted alone as ``path_shm_direct_*``)."""
        return {k: int(v) for k, v in self._node.metrics().items()}

    # -- lifecycle ------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the node within ``timeout`` seconds: unregisters it from the
        MetaServer (best effort), stops serving peers, frees the pool.
        Idempotent. The registered tensors are released afterwards."""
        self._node.shutdown(_seconds(timeout))
        self._caches.clear()

    def kill(self) -> None:
        """Stops at once as a crash would (no unregister): for tests of the
        degrade paths."""
        self._node.kill()

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Node({self.address!r}, gpu={self.gpu!r}, running={self.running})"
