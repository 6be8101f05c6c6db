"""Exceptions raised by kvferry.

Every exception derives from :class:`KvferryError` and carries ``cause``: the
name of the Rust error variant behind it (for example
``"EngineError::BlockIndex"`` or ``"GpuError::OutOfRange"``), so code can
branch on the typed cause without parsing messages. Messages say what to do.

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
]


class KvferryError(Exception):
    """Base class of every kvferry error.

    Attributes:
        cause: the Rust error variant behind this exception (``"Enum::Variant"``),
            or a short tag for errors found in Python before calling Rust.
    """

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause

    def __str__(self) -> str:  # the message, then the cause in brackets
        msg = super().__str__()
        return f"{msg} [{self.cause}]" if self.cause else msg


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
