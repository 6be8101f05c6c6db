"""Turning the caller's tensors into (address, bytes, shape) without
importing any framework.

Accepted, in this order:

1. torch-like tensors (``data_ptr()``, ``element_size()``, ``stride()``,
   ``device``): torch CPU and CUDA tensors, any dtype including bfloat16;
2. ``__cuda_array_interface__`` (CuPy, Numba, torch);
3. ``__array_interface__`` (numpy and friends);
4. the buffer protocol (``bytearray``, writable ``memoryview``, ``array``),
   read through ``memoryview`` and ``ctypes``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .errors import BufferError

# typestr kind+size → dtype name (numpy/CAI typestrs; "V2" is how
# bfloat16 shows up where it has no native typestr).
_TYPESTR = {
    "f2": "float16",
    "f4": "float32",
    "f8": "float64",
    "V2": "bfloat16",
    "i1": "int8",
    "u1": "uint8",
    "i2": "int16",
    "u2": "uint16",
    "i4": "int32",
    "u4": "uint32",
    "i8": "int64",
    "u8": "uint64",
    "b1": "bool",
}

# memoryview format → (dtype name, itemsize)
_FORMAT = {
    "B": ("uint8", 1),
    "b": ("int8", 1),
    "c": ("uint8", 1),
    "e": ("float16", 2),
    "f": ("float32", 4),
    "d": ("float64", 8),
    "h": ("int16", 2),
    "H": ("uint16", 2),
    "i": ("int32", 4),
    "I": ("uint32", 4),
    "q": ("int64", 8),
    "Q": ("uint64", 8),
}


@dataclass(frozen=True)
class TensorInfo:
    """What kvferry needs to know about one tensor.

    Attributes:
        addr: address of element 0 (host or device pointer).
        shape: the tensor's shape.
        strides: strides in **bytes**.
        itemsize: bytes per element.
        dtype: dtype name (``"float16"``, ``"bfloat16"``, ...).
        device: ``"host"`` or ``"cuda"``.
        device_index: CUDA ordinal when known, else ``None``.
        readonly: whether the memory is read-only.
    """

    addr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    dtype: str
    device: str
    device_index: Optional[int]
    readonly: bool


def _c_strides(shape: Tuple[int, ...], itemsize: int) -> Tuple[int, ...]:
    out = []
    acc = itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _from_typestr(typestr: str, what: str) -> Tuple[str, int]:
    key = typestr[1:]
    if key not in _TYPESTR:
        raise BufferError(f"{what}: unsupported element type {typestr!r}", "dtype")
    return _TYPESTR[key], int(key[1:])


def describe(obj: Any, what: str = "tensor") -> TensorInfo:
    """Describes ``obj`` (see the module doc for what is accepted).

    Raises:
        BufferError: ``obj`` exposes no memory kvferry can read, or a dtype it
            does not know.
    """
    if callable(getattr(obj, "data_ptr", None)) and hasattr(obj, "device") and callable(getattr(obj, "stride", None)):
        dev = obj.device
        kind = getattr(dev, "type", str(dev))
        if kind not in ("cpu", "cuda"):
            raise BufferError(f"{what} is on device {dev}; kvferry takes CPU or CUDA tensors", "device")
        itemsize = int(obj.element_size())
        dtype = str(obj.dtype).replace("torch.", "")
        shape = tuple(int(n) for n in obj.shape)
        strides = tuple(int(s) * itemsize for s in obj.stride())
        return TensorInfo(
            addr=int(obj.data_ptr()),
            shape=shape,
            strides=strides,
            itemsize=itemsize,
            dtype=dtype,
            device="cuda" if kind == "cuda" else "host",
            device_index=getattr(dev, "index", None) if kind == "cuda" else None,
            readonly=False,
        )
    for attr, device in (("__cuda_array_interface__", "cuda"), ("__array_interface__", "host")):
        try:
            iface = getattr(obj, attr)
        except (AttributeError, TypeError, RuntimeError):
            continue
        dtype, itemsize = _from_typestr(iface["typestr"], what)
        shape = tuple(int(n) for n in iface["shape"])
        strides = iface.get("strides")
        strides = _c_strides(shape, itemsize) if strides is None else tuple(int(s) for s in strides)
        addr, readonly = iface["data"]
        return TensorInfo(int(addr or 0), shape, strides, itemsize, dtype, device, None, bool(readonly))
    try:
        mv = memoryview(obj)
    except TypeError:
        raise BufferError(
            f"{what} of type {type(obj).__name__} exposes no memory: pass a torch tensor, a CuPy/numpy array "
            "or a writable buffer",
            "no_interface",
        ) from None
    if mv.readonly:
        raise BufferError(f"{what} is read-only; kvferry loads into it, pass writable memory", "read_only")
    if not mv.c_contiguous:
        raise BufferError(f"{what} is not C-contiguous", "not_contiguous")
    fmt = mv.format.lstrip("@=<")
    if fmt not in _FORMAT:
        raise BufferError(f"{what}: unsupported buffer format {mv.format!r}", "dtype")
    dtype, itemsize = _FORMAT[fmt]
    shape = tuple(mv.shape) if mv.ndim else (mv.nbytes // itemsize,)
    addr = ctypes.addressof((ctypes.c_char * mv.nbytes).from_buffer(mv)) if mv.nbytes else 0
    return TensorInfo(addr, shape, _c_strides(shape, itemsize), itemsize, dtype, "host", None, False)


def block_geometry(info: TensorInfo, what: str) -> Tuple[int, int, int]:
    """``(num_blocks, bytes_per_block, block_stride)`` of a paged cache
    tensor whose first axis indexes blocks and whose blocks are each
    contiguous (C order inside a block).

    Raises:
        BufferError: fewer than 2 axes, an empty or negative extent, a block
            that is not contiguous, or blocks that overlap.
    """
    if len(info.shape) < 2:
        raise BufferError(
            f"{what} has shape {info.shape}; want [num_blocks, ...] e.g. [num_blocks, block_tokens, kv_heads, head_dim]",
            "shape",
        )
    if any(n <= 0 for n in info.shape):
        raise BufferError(f"{what} has an empty axis: shape {info.shape}", "shape")
    inner_shape = info.shape[1:]
    want = _c_strides(inner_shape, info.itemsize)
    got = info.strides[1:]
    if any(s != w for s, w, n in zip(got, want, inner_shape) if n > 1):
        raise BufferError(
            f"{what} is not contiguous inside a block (strides {info.strides} bytes, shape {info.shape}); "
            "each block must be one contiguous range: pass a contiguous tensor (e.g. .contiguous())",
            "not_contiguous",
        )
    bytes_per_block = info.itemsize
    for n in inner_shape:
        bytes_per_block *= n
    num_blocks = info.shape[0]
    block_stride = info.strides[0] if num_blocks > 1 else bytes_per_block
    if block_stride < bytes_per_block:
        raise BufferError(
            f"{what}: block stride {block_stride} bytes is smaller than a block ({bytes_per_block} bytes); blocks "
            "overlap or run backwards",
            "not_contiguous",
        )
    if info.addr == 0:
        raise BufferError(f"{what} has a null data pointer (freed or empty?)", "null_pointer")
    return num_blocks, bytes_per_block, block_stride
