"""Exceptions raised by kvferry.

Every exception derives from :class:`KvferryError` and carries ``code``: the
stable, snake_case code of the error behind it (the Rust error's ``code()``,
for example ``"engine_block_index"`` or ``"gpu_out_of_range"``, or a code of
the Python layer such as ``"dtype"``), so code can branch on the typed cause
without parsing messages. Messages say what to do. The class of an error
raised by the native layer is chosen from its code by :data:`CODE_CLASSES`
(exact codes) and :data:`CODE_PREFIX_CLASSES` (code families); the table of
codes is in ``docs/design.md`` ("Errors").

Where it helps, a class also derives from the matching built-in exception
(``ValueError``, ``IndexError``, ``LookupError``, ``TimeoutError``), so
``except ValueError`` keeps working for bad arguments.
"""

from __future__ import annotations

__all__ = [
    "KvferryError",
    "ConfigError",
    "StartError",
    "BufferError",
    "LayoutError",
    "UnknownNamespaceError",
    "BlockIndexError",
    "GpuError",
    "PoolFullError",
    "MetaServerError",
    "DeadlineError",
    "ClosedError",
    "PeerError",
    "CODE_CLASSES",
    "CODE_PREFIX_CLASSES",
    "class_for",
    "error_for",
]


class KvferryError(Exception):
    """Base class of every kvferry error.

    Attributes:
        code: the stable snake_case code of the error (the Rust error's
            ``code()``, or a code of the Python layer for errors found before
            calling Rust).
        cause: the same value as ``code`` (its former name).
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code

    @property
    def cause(self) -> str:
        """The error's code (kept for code written against ``cause``)."""
        return self.code

    def __str__(self) -> str:  # the message, then the code in brackets
        msg = super().__str__()
        return f"{msg} [{self.code}]" if self.code else msg


class ConfigError(KvferryError, ValueError):
    """A bad argument or setting (address, timeout, hash length, sizes)."""


class StartError(KvferryError):
    """A MetaServer or node could not start: port taken, pool allocation
    failed, GPU backend unavailable. Nothing was left running."""


class BufferError(KvferryError, ValueError):
    """A tensor or array cannot be registered: wrong dtype, not contiguous
    where the layout needs it, on another device than the node's backend,
    too small for the layout, or rejected by the GPU backend."""


class LayoutError(KvferryError, ValueError):
    """The engine rejected a KV layout (buffer too small, overlapping
    ranges, inconsistent block counts), or the namespace already has a
    different one."""


class UnknownNamespaceError(KvferryError, LookupError):
    """No KV layout is registered for the namespace on this node."""


class BlockIndexError(KvferryError, IndexError):
    """A block index is beyond the registered cache's ``num_blocks``."""


class GpuError(KvferryError):
    """The GPU backend failed (a copy, a device error)."""


class PoolFullError(KvferryError):
    """The node's pinned pool has no room even after evicting unpinned
    blocks; start the node with a larger ``pool_bytes``."""


class MetaServerError(KvferryError):
    """A MetaServer request failed (down, unreachable, refused)."""


class DeadlineError(KvferryError, TimeoutError):
    """An operation did not finish within its timeout."""


class ClosedError(KvferryError):
    """The node or MetaServer was shut down."""


class PeerError(KvferryError, ConnectionError):
    """A peer node could not be reached or refused the transfer handshake
    (:meth:`kvferry.Node.connect_peer`)."""


#: Exact code → class, for codes whose class differs from their family's.
CODE_CLASSES: dict[str, type[KvferryError]] = {
    "engine_unknown_namespace": UnknownNamespaceError,
    "engine_layout_exists": LayoutError,
    "engine_family_mismatch": LayoutError,
    "engine_buffer_in_use": LayoutError,
    "engine_namespace_mismatch": LayoutError,
    "engine_block_index": BlockIndexError,
    "engine_task": KvferryError,
    "lease_too_many": KvferryError,
    "client_address": ConfigError,
    "client_tls": ConfigError,
    "closed": ClosedError,
    "deadline": DeadlineError,
    "fetch_deadline": DeadlineError,
    "runtime": StartError,
    "task_lost": KvferryError,
    "addr_parse": ConfigError,
    "bad_timeout": ConfigError,
    "bad_transport": ConfigError,
    "bad_lease_id": ConfigError,
    "bad_block_tokens": ConfigError,
    "bad_known": ConfigError,
    "bad_ticket": ConfigError,
    "bad_transfer_ask": ConfigError,
    "engine_too_many_blocks": ConfigError,
    "length_mismatch": ConfigError,
}

#: Code family (the code's prefix) → class, for codes :data:`CODE_CLASSES`
#: does not name.
CODE_PREFIX_CLASSES: dict[str, type[KvferryError]] = {
    "layout_": LayoutError,
    "pool_": PoolFullError,
    "gpu_": GpuError,
    "id_": ConfigError,
    "hash_": ConfigError,
    "lease_": ConfigError,
    "client_": MetaServerError,
    "metaserver_": StartError,
    "node_": StartError,
    "fetch_": PeerError,
    "ticket_": ConfigError,
}


def class_for(code: str) -> type[KvferryError]:
    """The exception class of an error with ``code``: :data:`CODE_CLASSES`,
    else the class of its family in :data:`CODE_PREFIX_CLASSES`, else
    :class:`KvferryError`."""
    cls = CODE_CLASSES.get(code)
    if cls is not None:
        return cls
    for prefix, cls in CODE_PREFIX_CLASSES.items():
        if code.startswith(prefix):
            return cls
    return KvferryError


def error_for(code: str, message: str, class_name: str | None = None) -> KvferryError:
    """The exception for an error of the native layer: of class
    ``class_name`` when the call site chose one (a context such as a node's
    start or a buffer's registration), else of :func:`class_for` ``(code)``."""
    cls = globals().get(class_name) if class_name else None
    if not (isinstance(cls, type) and issubclass(cls, KvferryError)):
        cls = class_for(code)
    return cls(message, code)
