"""GPU tensors and streams from any framework, without importing one: pure parsing for the CuPy backend.

A GPU tensor is any object exposing ``__cuda_array_interface__`` (versions 0 to 3; torch, CuPy, Numba, JAX) or
``__dlpack__`` (torch, JAX, CuPy), of any dtype, whose first dimension is the block index and whose remaining
dimensions are C-contiguous within a block. The backend sees it as bytes: ``rows = shape[0]`` blocks of
``row_bytes = itemsize * prod(shape[1:])`` bytes, ``row_stride`` bytes apart (``>= row_bytes``: padding between
blocks is allowed). Nothing is copied or converted when the interface is there.

A compute stream is a raw ``cudaStream_t`` int, or an object with ``__cuda_stream__`` (the CUDA stream protocol:
``(version, handle)``), ``.cuda_stream`` (torch) or ``.ptr`` (CuPy).

Every function here is pure (no CuPy, no CUDA call), so every refusal is testable without a GPU. What needs the
device (the memory type and device of a pointer, ``cupy.from_dlpack``) is the backend's job.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeGuard

import numpy as np

from kvoffload_ref.errors import InvalidTransferError
from kvoffload_ref.specs import TensorGeometry
from kvoffload_ref.validate import short_repr

__all__ = [
    "ByteView",
    "check_dlpack_device",
    "check_shape",
    "describe",
    "parse_cuda_array_interface",
    "parse_stream_object",
    "tensor_name",
]

# DLPack device types (dlpack.h, DLDeviceType).
DL_CPU: Final = 1
DL_CUDA: Final = 2
DL_CUDA_HOST: Final = 3
DL_CUDA_MANAGED: Final = 13
# cudaStreamPerThread: names a different stream in every thread, so it cannot be used from another thread.
STREAM_PER_THREAD: Final = 2
_MAX_INTERFACE_VERSION: Final = 3
_TYPESTR: Final = re.compile(r"^[<>|=]?[a-zA-Z](\d+)$")


@dataclasses.dataclass(frozen=True)
class ByteView:
    """A device tensor seen as bytes, one row per block (zero copy: the addresses are the tensor's).

    Attributes:
        ptr: the address of block 0.
        rows: the number of blocks (``shape[0]``).
        row_bytes: bytes per block, ``itemsize * prod(shape[1:])``.
        row_stride: bytes between the starts of consecutive blocks (``>= row_bytes``).
    """

    ptr: int
    rows: int
    row_bytes: int
    row_stride: int

    @property
    def geometry(self) -> TensorGeometry:
        """The view as the planner's :class:`~kvoffload_ref.specs.TensorGeometry`."""
        return TensorGeometry(ptr=self.ptr, rows=self.rows, row_bytes=self.row_bytes, row_stride=self.row_stride)

    @property
    def nbytes(self) -> int:
        """Bytes the view spans, from block 0 to the end of the last block (0 if empty)."""
        if self.rows == 0 or self.row_bytes == 0:
            return 0
        return (self.rows - 1) * self.row_stride + self.row_bytes


def tensor_name(index: int | None) -> str:
    """``gpu_tensors[i]`` for messages, or ``the tensor`` when the index is unknown."""
    return "the tensor" if index is None else f"gpu_tensors[{index}]"


def describe(obj: object) -> str:
    """A short description of an object for messages: its type, and its shape and dtype if it has them."""
    shape = getattr(obj, "shape", None)
    dtype = getattr(obj, "dtype", None)
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return kind + (f" {tuple(shape)} {dtype}" if isinstance(shape, Sequence) else "")


def _is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _refuse(name: str, why: str) -> InvalidTransferError:
    return InvalidTransferError(f"{name}: {why}")


def parse_cuda_array_interface(interface: object, *, name: str = "the tensor") -> ByteView:
    """View a ``__cuda_array_interface__`` dict as bytes ``(shape[0], itemsize * prod(shape[1:]))``.

    ``strides`` absent or None means C-contiguous. Dimensions of size 1 may have any stride (frameworks report
    arbitrary strides for them). The v3 ``stream`` entry is not used: the worker orders its copies after the
    compute stream (R4), which must be the stream the producer writes on.

    Args:
        interface: the dict (a mapping with ``shape``, ``typestr``, ``data`` and ``version``).
        name: what to call the tensor in messages (e.g. ``gpu_tensors[3]``).

    Returns:
        The byte view.

    Raises:
        InvalidTransferError: not a mapping, an unknown version, a malformed shape, typestr, data or strides entry,
            a read-only or masked array, a null pointer for a non-empty array, a block whose inner dimensions are
            not C-contiguous, or a block stride smaller than the block (negative or overlapping blocks).
    """
    if not isinstance(interface, Mapping):
        raise _refuse(name, f"__cuda_array_interface__ is not a dict: {type(interface).__name__}")
    version = interface.get("version")
    if not _is_int(version) or not 0 <= int(version) <= _MAX_INTERFACE_VERSION:
        raise _refuse(name, f"unsupported __cuda_array_interface__ version {version!r} (0 to 3 are supported)")
    if interface.get("mask") is not None:
        raise _refuse(name, "masked arrays are not supported")
    shape = _shape(interface.get("shape"), name)
    itemsize = _itemsize(interface.get("typestr"), name)
    ptr = _data_pointer(interface.get("data"), name)
    strides = _strides(interface.get("strides"), shape, itemsize, name)
    row_bytes = itemsize * math.prod(shape[1:])
    rows = shape[0]
    _check_block_contiguous(shape, strides, itemsize, name)
    row_stride = strides[0] if rows > 1 else row_bytes
    if row_stride < row_bytes:
        raise _refuse(name, f"the block stride {row_stride} bytes is smaller than a block ({row_bytes} bytes): "
                            "blocks must not overlap or run backwards")
    if ptr == 0 and rows * row_bytes:
        raise _refuse(name, "null data pointer for a non-empty array")
    return ByteView(ptr=ptr, rows=rows, row_bytes=row_bytes, row_stride=row_stride)


def _shape(shape: object, name: str) -> tuple[int, ...]:
    if (not isinstance(shape, (tuple, list)) or not shape
            or not all(_is_int(n) and int(n) >= 0 for n in shape)):
        raise _refuse(name, f"shape must be a non-empty tuple of non-negative ints (first dimension = block); "
                            f"got {shape!r}")
    return tuple(int(n) for n in shape)


def _itemsize(typestr: object, name: str) -> int:
    match = _TYPESTR.match(typestr) if isinstance(typestr, str) else None
    if match is None or int(match.group(1)) <= 0:
        raise _refuse(name, f"unsupported typestr {typestr!r}")
    return int(match.group(1))


def _data_pointer(data: object, name: str) -> int:
    if not isinstance(data, (tuple, list)) or len(data) != 2 or not _is_int(data[0]) or int(data[0]) < 0:
        raise _refuse(name, f"data must be (pointer, read_only); got {data!r}")
    if data[1] is not False and data[1] != 0:
        raise _refuse(name, "the array is read-only; a load writes into the GPU tensors")
    return int(data[0])


def _strides(strides: object, shape: tuple[int, ...], itemsize: int, name: str) -> tuple[int, ...]:
    if strides is None:
        return _c_strides(shape, itemsize)
    if (not isinstance(strides, (tuple, list)) or len(strides) != len(shape)
            or not all(_is_int(s) for s in strides)):
        raise _refuse(name, f"strides must be None or {len(shape)} ints (bytes); got {strides!r}")
    return tuple(int(s) for s in strides)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = [itemsize] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * shape[k + 1]
    return tuple(out)


def _check_block_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, name: str) -> None:
    expected = _c_strides(shape, itemsize)
    for k in range(1, len(shape)):
        if shape[k] > 1 and strides[k] != expected[k]:
            raise _refuse(name, f"a block is not contiguous: dimension {k} has stride {strides[k]} bytes, "
                                f"C order needs {expected[k]} (shape {shape}, strides {strides}, "
                                f"itemsize {itemsize}); only the block dimension (0) may be strided")


def check_dlpack_device(dl_device: object, device: int, *, name: str = "the tensor") -> None:
    """Check a ``__dlpack_device__()`` result: a CUDA (or CUDA managed) tensor on ``device``.

    Args:
        dl_device: the ``(device_type, device_id)`` pair.
        device: the backend's CUDA device ordinal.
        name: what to call the tensor in messages.

    Raises:
        InvalidTransferError: malformed, host memory, another device type, or another device.
    """
    if not isinstance(dl_device, (tuple, list)) or len(dl_device) != 2 or not all(_is_int(v) for v in dl_device):
        raise _refuse(name, f"__dlpack_device__() must return (device_type, device_id); got {dl_device!r}")
    kind, ordinal = (int(v) for v in dl_device)
    if kind in (DL_CPU, DL_CUDA_HOST):
        raise _refuse(name, f"is in host memory (DLPack device type {kind}), not on cuda:{device}")
    if kind not in (DL_CUDA, DL_CUDA_MANAGED):
        raise _refuse(name, f"is not a CUDA tensor (DLPack device type {kind})")
    if ordinal != device:
        raise _refuse(name, f"is on cuda:{ordinal}, the backend on cuda:{device}")


def parse_stream_object(stream: object) -> tuple[int, int | None]:
    """The raw ``cudaStream_t`` of a compute-stream object, and its device ordinal when the object says.

    Accepted: a raw handle (int), an object with ``__cuda_stream__`` (a method or attribute giving
    ``(0, handle)``), ``.cuda_stream`` (torch) or ``.ptr`` (CuPy), tried in that order. The device comes from
    ``.device_index`` (torch) or ``.device_id`` (CuPy) when that is a non-negative int.

    Args:
        stream: the object.

    Returns:
        ``(handle, device or None)``.

    Raises:
        InvalidTransferError: none of the above, a negative handle, an unknown ``__cuda_stream__`` version, or
            the per-thread default stream (handle 2), which names a different stream in every thread.
    """
    if isinstance(stream, bool):
        raise _refuse("compute_stream", "a bool is not a stream")
    if _is_int(stream):
        return _handle(stream, "the handle"), None
    handle = _stream_handle(stream)
    device: int | None = None
    for attr in ("device_index", "device_id"):
        value = getattr(stream, attr, None)
        if _is_int(value) and int(value) >= 0:
            device = int(value)
            break
    return handle, device


def _stream_handle(stream: object) -> int:
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        try:
            value = protocol() if callable(protocol) else protocol
        except Exception as exc:
            raise _refuse("compute_stream", f"__cuda_stream__() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, tuple) or len(value) != 2 or not all(_is_int(v) for v in value):
            raise _refuse("compute_stream", f"__cuda_stream__ must give (version, handle); got {value!r}")
        if int(value[0]) != 0:
            raise _refuse("compute_stream", f"unsupported __cuda_stream__ version {value[0]} (0 is supported)")
        return _handle(int(value[1]), "__cuda_stream__")
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if _is_int(value):
            return _handle(value, f".{attr}")
    raise _refuse("compute_stream", "expected a cudaStream_t int, or an object with __cuda_stream__, "
                                    f".cuda_stream (torch) or .ptr (CuPy); got {describe(stream)}")


def _handle(value: int | np.integer[Any], source: str) -> int:
    handle = int(value)
    if handle < 0:
        raise _refuse("compute_stream", f"{source} is negative: {handle}")
    if handle == STREAM_PER_THREAD:
        raise _refuse("compute_stream", f"{source} is the per-thread default stream (2), which names a different "
                                        "stream in every thread; pass the stream the model computes on")
    return handle


def check_shape(shape: object) -> tuple[int, int]:
    """``shape`` as two non-negative ints.

    Raises:
        InvalidTransferError: it is not.
    """
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise InvalidTransferError(f"shape must be a tuple of two non-negative ints (e.g. (4, 64)), got "
                                   f"{type(shape).__name__} {short_repr(shape)}")
    return int(shape[0]), int(shape[1])
