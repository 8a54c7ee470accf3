"""The CuPy backend's contact with CuPy itself: the lazy import, the usability probe, CUDA constants, handles.

Nothing here holds backend state. ``import kvoffload_ref.backends._cupy_runtime`` never imports CuPy; CuPy is
imported by :func:`import_cupy` the first time a function needs it, so :func:`gpu_usable` can say *why* no GPU is
usable. The probe uses plain runtime calls only: a failed ``cupy.cuda.Stream()`` prints "Exception ignored in
Stream.__del__" (an unraisable exception, which breaks ``pytest -W error``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Tag
from kvoffload_ref.errors import CUDA_ERROR_MEMORY_ALLOCATION, CUDA_ERROR_UNKNOWN, DeviceError

__all__ = ["CudaCalls", "CupyEvent", "CupyStream", "gpu_usable", "import_cupy"]

_Word = TypeVar("_Word", np.int32, np.int64)

# CUDA constants CuPy does not export (values from the CUDA runtime headers).
HOST_REGISTER_FLAGS: Final = 1 | 2        # cudaHostRegisterPortable | cudaHostRegisterMapped
HOST_ALLOC_FLAGS: Final = 1 | 2           # cudaHostAllocPortable | cudaHostAllocMapped
STREAM_NON_BLOCKING: Final = 1            # cudaStreamNonBlocking
EVENT_DEFAULT: Final = 0                  # timing enabled, spin on synchronize
MEMCPY_H2D: Final = 1
MEMCPY_D2H: Final = 2
MEMCPY_DEFAULT: Final = 4                 # cudaMemcpyDefault: direction inferred (UVA)
ATTR_MULTIPROCESSOR_COUNT: Final = 16
ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: Final = 91
CUDA_ERROR_INVALID_DEVICE: Final = 101
MEMORY_TYPE_DEVICE: Final = 2             # cudaMemoryTypeDevice
MEMORY_TYPE_MANAGED: Final = 3            # cudaMemoryTypeManaged


def import_cupy() -> Any:
    """Import CuPy (lazily).

    Returns:
        The ``cupy`` module.

    Raises:
        ImportError: CuPy is not installed (the message says which extra to install).
    """
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise ImportError(
            "the CuPy backend needs CuPy: pip install 'kvoffload_ref[cuda12]' (or [cuda13])"
        ) from exc


def gpu_usable(device: int = 0) -> tuple[bool, str]:
    """Whether the CuPy backend can run on ``device``, and why (not).

    Uses only runtime calls (device count, a 256-byte malloc/free on the device); constructs no CuPy objects, so
    a failure prints nothing. Never raises.

    Args:
        device: CUDA device ordinal.

    Returns:
        ``(True, "cuda:N <name>")`` if usable, else ``(False, reason)``.
    """
    try:
        cp = import_cupy()
    except ImportError as exc:
        return False, f"CuPy not installed: {exc.__cause__ or exc}"
    except Exception as exc:  # a broken CuPy install can raise anything at import
        return False, f"CuPy failed to import: {type(exc).__name__}: {exc}"
    try:
        return _probe_device(cp.cuda.runtime, device)
    except Exception as exc:  # CUDARuntimeError, or anything a broken driver stack raises
        status = getattr(exc, "status", None)
        return False, f"no usable CUDA device (status {status}): {type(exc).__name__}: {exc}"


def _probe_device(rt: Any, device: int) -> tuple[bool, str]:
    count = int(rt.getDeviceCount())
    if count <= 0:
        return False, "no CUDA device (getDeviceCount() == 0)"
    if not 0 <= device < count:
        return False, f"cuda:{device} does not exist ({count} device(s))"
    prev = int(rt.getDevice())
    rt.setDevice(device)
    try:
        ptr = int(rt.malloc(256))
        rt.free(ptr)
        name = device_name(rt, device)
    finally:
        rt.setDevice(prev)
    return True, f"cuda:{device} {name}"


def device_name(rt: Any, device: int) -> str:
    """The device's name from its properties, or ``"<unknown>"`` (the name is cosmetic; never raises)."""
    try:
        name = rt.getDeviceProperties(device)["name"]
    except Exception:  # the name is cosmetic
        return "<unknown>"
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def status_of(exc: BaseException) -> int:
    """CUDA's status of a CuPy error (``.status``), 2 for an out-of-memory error, else 999 (unknown)."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(exc, MemoryError):
        return CUDA_ERROR_MEMORY_ALLOCATION
    return CUDA_ERROR_UNKNOWN


def tag_text(tag: Tag | None) -> str:
    """`` (tag store:3)`` for error messages, or the empty string."""
    return "" if tag is None else f" (tag {tag[0]}:{tag[1]})"


def host_words(ptr: int, count: int, dtype: type[_Word]) -> npt.NDArray[_Word]:
    """A numpy view of ``count`` words of host memory at ``ptr`` (the caller keeps the memory alive)."""
    raw = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype)


def loaded(kernel: Any) -> Any:
    """The loaded ``cupy.cuda.Function`` of a ``RawKernel`` (compiling it now), or the object itself."""
    return getattr(kernel, "kernel", kernel)


@dataclasses.dataclass(eq=False)
class CupyStream:
    """A stream handle of the CuPy backend (opaque to the library).

    Attributes:
        ptr: the raw ``cudaStream_t`` (also what ``RawKernel`` launches read as ``stream.ptr``).
        owned: True if the backend created it (then it is in the ledger and ``destroy_stream`` destroys it).
        destroyed: set once destroyed; a destroyed handle is refused before any CUDA call.
    """

    ptr: int
    owned: bool
    destroyed: bool = False


@dataclasses.dataclass(eq=False)
class CupyEvent:
    """An event handle of the CuPy backend (opaque to the library).

    Attributes:
        ptr: the raw ``cudaEvent_t`` (a timing event).
        tag: the tag of its latest ``record`` (for error messages), or None.
        destroyed: set once destroyed; a destroyed handle is refused before any CUDA call.
    """

    ptr: int
    tag: Tag | None = None
    destroyed: bool = False


def error_types(cp: Any) -> tuple[type[BaseException], ...]:
    """CuPy's error types that mean a CUDA call failed: ``CUDARuntimeError``, and where CuPy has them
    ``CUDADriverError`` (a kernel launch) and ``OutOfMemoryError``."""
    found: list[type[BaseException]] = [cp.cuda.runtime.CUDARuntimeError]
    driver = getattr(cp.cuda, "driver", None)
    memory = getattr(cp.cuda, "memory", None)
    for owner, name in ((driver, "CUDADriverError"), (memory, "OutOfMemoryError")):
        err = getattr(owner, name, None)
        if isinstance(err, type) and issubclass(err, BaseException):
            found.append(err)
    return tuple(found)


class CudaCalls:
    """Runs CUDA calls on one device and maps CuPy's errors to :class:`DeviceError`.

    ``with calls("what", tag):`` makes the device current for the block, restores the caller's device afterwards,
    and turns a CuPy error into ``DeviceError("<what> failed on cuda:N (tag ...): ...", status)`` raised ``from``
    it. Thread-safe (it holds no mutable state).

    Args:
        cp: the ``cupy`` module (or a stand-in with the same runtime).
        device: the CUDA device ordinal.
    """

    def __init__(self, cp: Any, device: int) -> None:
        self.rt: Any = cp.cuda.runtime  # Invariant: CuPy's runtime module (or the stand-in's).
        self.device = device  # Invariant: the ordinal every call runs on.
        self.errors = error_types(cp)  # Invariant: the CuPy error types mapped to DeviceError.

    @contextlib.contextmanager
    def __call__(self, what: str, tag: Tag | None = None) -> Iterator[None]:
        """Run the block's CUDA calls on this device.

        Raises:
            DeviceError: a CuPy error escaped the block (CuPy's error as ``__cause__``).
        """
        try:
            prev = int(self.rt.getDevice())
            switch = prev != self.device
            if switch:
                self.rt.setDevice(self.device)
            try:
                yield
            finally:
                if switch:
                    self.rt.setDevice(prev)
        except self.errors as exc:
            raise DeviceError(f"{what} failed on cuda:{self.device}{tag_text(tag)}: {exc}", status_of(exc)) from exc
