"""The CuPy backend's GPU tensors: any framework's tensor viewed as bytes on the device, and synchronous host copies.

:func:`view_tensor` prefers ``__cuda_array_interface__`` (no conversion, parsed by
``_cupy_interop.parse_cuda_array_interface``), falls back to ``__dlpack__`` through ``cupy.from_dlpack`` (after
checking ``__dlpack_device__``), then checks with ``cudaPointerGetAttributes`` that the memory is device (or
managed) memory of the backend's device. Every refusal is an :class:`InvalidTransferError` that names the tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._cupy_interop import ByteView, check_dlpack_device, describe, parse_cuda_array_interface
from kvoffload_ref.backends._cupy_runtime import (
    MEMCPY_D2H,
    MEMCPY_H2D,
    MEMORY_TYPE_DEVICE,
    MEMORY_TYPE_MANAGED,
    CudaCalls,
)
from kvoffload_ref.errors import DeviceError, InvalidTransferError
from kvoffload_ref.specs import TensorGeometry

__all__ = ["copy_from_host", "copy_to_host", "view_tensor"]


def view_tensor(cp: Any, cuda: CudaCalls, array: object, name: str) -> ByteView:
    """View a GPU tensor of ``cuda.device`` as bytes, zero copy.

    Args:
        cp: the ``cupy`` module (for ``from_dlpack``).
        cuda: the backend's CUDA call wrapper.
        array: any object with ``__cuda_array_interface__`` or ``__dlpack__``.
        name: what to call it in messages (``gpu_tensors[i]``).

    Returns:
        The byte view.

    Raises:
        InvalidTransferError: neither interface works, host memory, another device, a non-contiguous block, a
            read-only array or a malformed interface (the message names the tensor and says why).
        DeviceError: a CUDA call failed.
    """
    cai_error = "no __cuda_array_interface__"
    try:
        interface = getattr(array, "__cuda_array_interface__", None)
    except Exception as exc:  # torch raises for e.g. requires_grad, or a dtype it cannot describe
        interface, cai_error = None, f"__cuda_array_interface__ raised {type(exc).__name__}: {exc}"
    if interface is not None:
        view = parse_cuda_array_interface(interface, name=name)
    elif callable(getattr(array, "__dlpack__", None)):
        view = _dlpack_view(cp, cuda, array, name, cai_error)
    else:
        raise InvalidTransferError(f"{name}: expected a GPU tensor with __cuda_array_interface__ or __dlpack__ "
                                   f"(e.g. a torch.cuda tensor or a cupy array), got {describe(array)} ({cai_error})")
    if view.nbytes:
        _check_device_pointer(cuda, view.ptr, name)
    return view


def _dlpack_view(cp: Any, cuda: CudaCalls, array: Any, name: str, cai_error: str) -> ByteView:
    try:
        dl_device = array.__dlpack_device__()
    except Exception as exc:
        raise InvalidTransferError(f"{name}: {describe(array)}.__dlpack_device__() failed: {type(exc).__name__}: "
                                   f"{exc}; expected a GPU tensor (e.g. a torch.cuda tensor)") from exc
    check_dlpack_device(dl_device, cuda.device, name=name)
    try:
        with cuda("from_dlpack"):
            arr = cp.from_dlpack(array)
    except DeviceError:
        raise
    except Exception as exc:  # CuPy refuses e.g. a dtype it does not know
        raise InvalidTransferError(f"{name}: cupy.from_dlpack({describe(array)}) failed ({cai_error}): "
                                   f"{type(exc).__name__}: {exc}; expected a dtype CuPy knows: a byte view of the "
                                   "tensor (e.g. torch's t.view(torch.uint8)) avoids the dtype") from exc
    interface = {"shape": tuple(arr.shape), "strides": tuple(arr.strides), "typestr": f"|V{int(arr.itemsize)}",
                 "data": (int(arr.data.ptr), False), "version": 3}
    return parse_cuda_array_interface(interface, name=name)


def _check_device_pointer(cuda: CudaCalls, ptr: int, name: str) -> None:
    with cuda("pointerGetAttributes"):
        attrs = cuda.rt.pointerGetAttributes(ptr)
    kind, device = int(attrs.type), int(attrs.device)
    if kind not in (MEMORY_TYPE_DEVICE, MEMORY_TYPE_MANAGED):
        raise InvalidTransferError(f"{name}: the memory at {ptr:#x} is cudaMemoryType {kind}: expected device or "
                                   f"managed memory ({MEMORY_TYPE_DEVICE} or {MEMORY_TYPE_MANAGED}, e.g. a torch.cuda "
                                   "tensor)")
    if device != cuda.device:
        raise InvalidTransferError(f"{name}: is on cuda:{device}: expected a tensor on the backend's device, "
                                   f"cuda:{cuda.device}")


def copy_to_host(cuda: CudaCalls, g: TensorGeometry, stream_ptr: int) -> npt.NDArray[np.uint8]:
    """A host copy ``(rows, row_bytes)`` of a device geometry (padding left out), queued on ``stream_ptr`` and
    waited for (``cudaStreamSynchronize``; blocking).

    Raises:
        DeviceError: a CUDA call failed.
    """
    out = np.empty((g.rows, g.row_bytes), dtype=np.uint8)
    if out.nbytes == 0:
        return out
    dst, rt = int(out.ctypes.data), cuda.rt
    with cuda("to_host"):
        if g.row_stride == g.row_bytes or g.rows == 1:
            rt.memcpyAsync(dst, g.ptr, out.nbytes, MEMCPY_D2H, stream_ptr)
        else:
            rt.memcpy2DAsync(dst, g.row_bytes, g.ptr, g.row_stride, g.row_bytes, g.rows, MEMCPY_D2H, stream_ptr)
        rt.streamSynchronize(stream_ptr)
    return out


def copy_from_host(cp: Any, cuda: CudaCalls, host: npt.NDArray[np.uint8], stream_ptr: int) -> Any:
    """A new 2-D uint8 ``cupy.ndarray`` holding a copy of a C-contiguous 2-D uint8 host array, queued on
    ``stream_ptr`` and waited for (blocking).

    Raises:
        DeviceError: the allocation or a copy failed.
    """
    with cuda("from_host"):
        dev = cp.empty(host.shape, dtype=np.uint8)
        if host.nbytes:
            cuda.rt.memcpyAsync(int(dev.data.ptr), int(host.ctypes.data), host.nbytes, MEMCPY_H2D, stream_ptr)
            cuda.rt.streamSynchronize(stream_ptr)
    return dev
