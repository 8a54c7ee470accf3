"""The CuPy backend: the Backend protocol on a real NVIDIA GPU, through ``cupy.cuda.runtime``.

Import design: this module imports **without** CuPy. CuPy is imported lazily, the first time a function needs it,
so ``import kvoffload_ref.backends.cupy`` always works and :func:`gpu_usable` can say *why* no GPU is usable:

* CuPy missing            -> ``gpu_usable() == (False, "CuPy not installed: ...")``; ``CupyBackend()`` raises
  ``ImportError`` (a packaging problem: install the ``cuda12`` or ``cuda13`` extra).
* CuPy present, no device -> ``gpu_usable() == (False, "... status 35/100 ...")``; ``CupyBackend()`` raises
  ``DeviceError`` whose ``.status`` is CUDA's and whose ``__cause__`` is CuPy's ``CUDARuntimeError``.

Every CUDA failure of every method becomes ``DeviceError(message, status)`` raised ``from`` the CuPy error. The
probe never constructs CuPy objects that can fail inside ``__init__`` (a failed ``cupy.cuda.Stream()`` prints
"Exception ignored in Stream.__del__"); it uses plain runtime calls. Streams and events are raw runtime handles.

Copies (``copy_batch``) take one of two paths per transfer (docs/backends.md has the measurements):

* ``"memcpy"``: one ``cudaMemcpyAsync(kind=cudaMemcpyDefault)`` per run of descriptors that are contiguous on both
  sides (adjacent descriptors are coalesced). Legal for any memory, pinned or not.
* ``"kernel"``: the three descriptor arrays are uploaded with one async H2D copy on the transfer stream to a device
  twin of the descriptor buffer, then one gather/scatter kernel launch copies every descriptor, with 16-byte vector
  accesses when a descriptor's addresses and size allow it (else 8, 4 or 1 byte). The kernel dereferences host
  pointers directly, which is legal only for *registered* host memory whose device pointer equals its host pointer
  (``cudaDevAttrCanUseHostPointerForRegisteredMem``, or ``pointerGetAttributes(ptr).devicePointer == ptr``). So the
  kernel path is taken only if every descriptor lies entirely inside a range registered through this backend (with
  that property) or inside a device array this backend has seen (``empty_device``, ``from_host``, ``array_info``);
  anything else (unpinned host memory, unknown addresses) silently uses the memcpy path. A kernel can never touch
  pageable memory.

``copy_path="auto"`` takes the kernel path when it is legal, ``count >= kernel_min_count`` and the mean descriptor
size is ``<= kernel_max_mean_bytes``; ``"kernel"`` takes it whenever it is legal; ``"memcpy"`` never.

Memory that device-synchronizes on free (``cudaFree``, ``cudaFreeHost``) is never freed on a path that may run while
the device hangs: descriptor buffers go back to a per-backend pool (R11); :meth:`CupyBackend.release_cached_memory`
frees the pool and is blocking.

Host registration: ``host_register(ptr, nbytes)`` registers exactly the range it is given
(``cudaHostRegisterPortable | cudaHostRegisterMapped``); chunking to ``pin_chunk_bytes`` and the reverse rollback
are the region's job, not the backend's.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import DescriptorBuffer, Event, Ledger, Stream, Tag, record_and_poll
from kvoffload_ref.errors import (
    CUDA_ERROR_INVALID_RESOURCE_HANDLE,
    CUDA_ERROR_MEMORY_ALLOCATION,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_UNKNOWN,
    CUDA_SUCCESS,
    DeviceError,
    InvalidTransferError,
    LifecycleError,
)
from kvoffload_ref.layout import TensorGeometry

__all__ = [
    "DEFAULT_KERNEL_MAX_MEAN_BYTES",
    "DEFAULT_KERNEL_MIN_COUNT",
    "KERNEL_SOURCE",
    "CopyPath",
    "CupyBackend",
    "CupyEvent",
    "CupyStream",
    "SpinFlag",
    "gpu_usable",
]

_log = logging.getLogger(__name__)

CopyPath = Literal["auto", "kernel", "memcpy"]
_Word = TypeVar("_Word", np.int32, np.int64)

#: Placeholder thresholds for ``copy_path="auto"`` (see docs/backends.md; scripts/gpu_bench.py measures them).
DEFAULT_KERNEL_MIN_COUNT: Final = 16
DEFAULT_KERNEL_MAX_MEAN_BYTES: Final = 1 << 20  # 1 MiB

# CUDA constants CuPy does not export (values from the CUDA runtime headers).
_HOST_REGISTER_FLAGS: Final = 1 | 2        # cudaHostRegisterPortable | cudaHostRegisterMapped
_HOST_ALLOC_FLAGS: Final = 1 | 2           # cudaHostAllocPortable | cudaHostAllocMapped
_STREAM_NON_BLOCKING: Final = 1            # cudaStreamNonBlocking
_EVENT_DEFAULT: Final = 0                  # timing enabled, spin on synchronize
_MEMCPY_H2D: Final = 1
_MEMCPY_D2H: Final = 2
_MEMCPY_DEFAULT: Final = 4                 # cudaMemcpyDefault: direction inferred (UVA)
_ATTR_MULTIPROCESSOR_COUNT: Final = 16
_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: Final = 91
_CUDA_ERROR_INVALID_DEVICE: Final = 101

# Kernel launch geometry: 256 threads x 16 bytes x 4 unrolled loads = 16 KiB per block per round.
_THREADS: Final = 256
_BYTES_PER_BLOCK_ROUND: Final = _THREADS * 16 * 4
_MAX_GRID_X: Final = 1024
_MAX_GRID_Y: Final = 65535
# Descriptor upload: one copy of the whole buffer if it is small or mostly used, else three copies of ``count``.
_SINGLE_UPLOAD_MAX_BYTES: Final = 64 * 1024
_MIN_DESCRIPTOR_SLOTS: Final = 16

KERNEL_SOURCE: Final = r"""
// kvoffload_ref CuPy backend kernels (compiled by CuPy with NVRTC).

template <typename T, int U>
__device__ __forceinline__ void kv_copy_words(const T* __restrict__ s, T* __restrict__ d, long long n) {
    // Thread t of the grid's x dimension copies words t, t + total, t + 2 * total, ...; U loads are in flight
    // before the first store, so reads across PCIe overlap.
    const long long total = (long long)gridDim.x * blockDim.x;
    for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x; base < n; base += total * U) {
        T v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long i = base + u * total;
            if (i < n) v[u] = s[i];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long i = base + u * total;
            if (i < n) d[i] = v[u];
        }
    }
}

// Copies count descriptors (src[k] -> dst[k], sizes[k] bytes); blockIdx.y strides over descriptors and the
// x dimension splits one descriptor. Host pointers must be registered and device-accessible.
extern "C" __global__ void kvoffload_copy_batch(const long long* __restrict__ src,
                                                const long long* __restrict__ dst,
                                                const long long* __restrict__ sizes,
                                                long long count) {
    for (long long k = blockIdx.y; k < count; k += gridDim.y) {
        const unsigned long long s = (unsigned long long)src[k];
        const unsigned long long d = (unsigned long long)dst[k];
        const long long n = sizes[k];
        if (n <= 0) continue;
        const unsigned long long a = s | d | (unsigned long long)n;
        if ((a & 15ULL) == 0ULL) {
            kv_copy_words<uint4, 4>((const uint4*)s, (uint4*)d, n >> 4);
        } else if ((a & 7ULL) == 0ULL) {
            kv_copy_words<unsigned long long, 4>((const unsigned long long*)s, (unsigned long long*)d, n >> 3);
        } else if ((a & 3ULL) == 0ULL) {
            kv_copy_words<unsigned int, 4>((const unsigned int*)s, (unsigned int*)d, n >> 2);
        } else {
            kv_copy_words<unsigned char, 4>((const unsigned char*)s, (unsigned char*)d, n);
        }
    }
}

__device__ __forceinline__ unsigned long long kv_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Test helper: spins until the host sets flag[0] != 0 (then writes flag[1] = 1) or timeout_ns passes
// (flag[1] = 2; 0 = no timeout). flag lives in mapped pinned host memory.
extern "C" __global__ void kvoffload_spin(volatile int* flag, unsigned long long timeout_ns) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const unsigned long long start = kv_globaltimer();
    while (flag[0] == 0) {
        if (timeout_ns != 0ULL && kv_globaltimer() - start > timeout_ns) {
            flag[1] = 2;
            __threadfence_system();
            return;
        }
#if __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
    }
    flag[1] = 1;
    __threadfence_system();
}
"""

_COPY_KERNEL: Final = "kvoffload_copy_batch"
_SPIN_KERNEL: Final = "kvoffload_spin"


def _import_cupy() -> Any:
    """Import CuPy (lazily; see the module docstring). Raises ImportError with install advice."""
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
        cp = _import_cupy()
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
        name = _device_name(rt, device)
    finally:
        rt.setDevice(prev)
    return True, f"cuda:{device} {name}"


def _device_name(rt: Any, device: int) -> str:
    try:
        name = rt.getDeviceProperties(device)["name"]
    except Exception:  # the name is cosmetic
        return "<unknown>"
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _status_of(exc: BaseException) -> int:
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    if isinstance(exc, MemoryError):
        return CUDA_ERROR_MEMORY_ALLOCATION
    return CUDA_ERROR_UNKNOWN


def _tag_text(tag: Tag | None) -> str:
    return "" if tag is None else f" (tag {tag[0]}:{tag[1]})"


@dataclasses.dataclass(eq=False)
class CupyStream:
    """A stream handle of :class:`CupyBackend` (opaque to the library).

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
    """An event handle of :class:`CupyBackend` (opaque to the library).

    Attributes:
        ptr: the raw ``cudaEvent_t`` (a timing event).
        tag: the tag of its latest ``record`` (for error messages), or None.
        destroyed: set once destroyed; a destroyed handle is refused before any CUDA call.
    """

    ptr: int
    tag: Tag | None = None
    destroyed: bool = False


@dataclasses.dataclass(eq=False)
class _DescriptorBlock:
    """Pinned host words ``[src | dst | sizes]`` (``slots`` each) and their device twin for the kernel path."""

    owner: int          # id() of the backend that made it
    host_ptr: int
    dev_ptr: int
    slots: int
    words: npt.NDArray[np.int64]
    # Invariant: the DescriptorBuffer this block is issued to, or None while it is in the pool.
    issued_to: DescriptorBuffer | None = None


@dataclasses.dataclass(eq=False)
class SpinFlag:
    """Test helper: two int32 words in mapped pinned host memory for :meth:`CupyBackend.enqueue_spin`.

    Word 0 is the release flag the host sets; word 1 is the kernel's report: 0 = not finished, 1 = released by
    the flag, 2 = gave up after its timeout. Made by :meth:`CupyBackend.alloc_spin_flag`, freed by
    :meth:`CupyBackend.free_spin_flag` (only once the kernel has ended). Not in the ledger.
    """

    host_ptr: int
    dev_ptr: int
    words: npt.NDArray[np.int32]
    freed: bool = False

    def release(self) -> None:
        """Let the spinning kernel finish (the GPU sees the write within microseconds). No-op once freed."""
        if not self.freed:
            self.words[0] = 1

    @property
    def state(self) -> int:
        """0 = not finished, 1 = released by the flag, 2 = timed out (read after the kernel's event completed).

        Raises:
            RuntimeError: the flag was freed (its memory is gone).
        """
        if self.freed:
            raise RuntimeError("SpinFlag used after free_spin_flag()")
        return int(self.words[1])


class _SpanSet:
    """Address ranges the copy kernel may dereference, merged into sorted disjoint intervals.

    Not thread-safe; the backend holds its lock around every use.
    """

    def __init__(self) -> None:
        # Invariant: _pinned maps a registered range's start to its end (only ranges whose device pointer equals
        # the host pointer); _device maps a seen device array's start to the largest end seen for it.
        self._pinned: dict[int, int] = {}
        self._device: dict[int, int] = {}
        # Invariant: the union of both dicts' intervals, merged; _starts sorted, _ends[i] the end of interval i.
        self._starts: npt.NDArray[np.int64] = np.empty(0, np.int64)
        self._ends: npt.NDArray[np.int64] = np.empty(0, np.int64)

    def add_pinned(self, start: int, end: int) -> None:
        self._pinned[start] = end
        self._rebuild()

    def discard_pinned(self, start: int) -> None:
        if self._pinned.pop(start, None) is not None:
            self._rebuild()

    def add_device(self, start: int, end: int) -> None:
        if end > self._device.get(start, start):
            self._device[start] = end
            self._rebuild()

    def _rebuild(self) -> None:
        merged: list[list[int]] = []
        for start, end in sorted([*self._pinned.items(), *self._device.items()]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = np.array([m[0] for m in merged], np.int64)
        self._ends = np.array([m[1] for m in merged], np.int64)

    def contains_all(self, addrs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]) -> bool:
        """Whether every ``[addrs[i], addrs[i] + sizes[i])`` lies inside one interval."""
        if addrs.size == 0:
            return True
        if self._starts.size == 0:
            return False
        ends = addrs + sizes
        # Fast path: the whole batch inside the interval that holds its lowest address.
        i = int(np.searchsorted(self._starts, addrs.min(), side="right")) - 1
        if i >= 0 and int(ends.max()) <= int(self._ends[i]):
            return True
        idx = np.searchsorted(self._starts, addrs, side="right") - 1
        if bool((idx < 0).any()):
            return False
        return bool((ends <= self._ends[idx]).all())


class CupyBackend:
    """The Backend protocol (``kvoffload_ref.backends.base.Backend``) on one CUDA device through CuPy.

    Construction compiles and loads the copy kernel (``warm_up``; NVRTC, cached on disk by CuPy) unless
    ``copy_path="memcpy"``, and synchronizes the compute stream once. If the kernel cannot be compiled, the backend
    logs a warning and uses the memcpy path only.

    Thread-safe: CUDA calls are thread-safe, the ledger locks itself, and the backend's own tables are guarded by
    a lock. Every call makes ``device`` current for its duration and restores the caller's device afterwards.
    ``current_stream()`` is the calling thread's current CuPy stream on ``device`` (CuPy's current stream is
    thread-local), i.e. the compute stream.

    Args:
        device: CUDA device ordinal.
        copy_path: ``"auto"`` (default), ``"kernel"`` or ``"memcpy"``; see the module docstring.
        kernel_min_count: ``auto`` uses the kernel only for at least this many descriptors.
        kernel_max_mean_bytes: ``auto`` uses the kernel only if the mean descriptor size is at most this.
        _cupy_module: for tests only: a stand-in for the ``cupy`` module (a fake runtime on a CPU machine).

    Raises:
        ImportError: CuPy is not installed.
        DeviceError: no usable device (``.status`` from CUDA, the CuPy error as ``__cause__``).
        ValueError: an invalid ``copy_path`` or threshold.
    """

    name = "cupy"

    def __init__(self, device: int = 0, *, copy_path: CopyPath = "auto",
                 kernel_min_count: int = DEFAULT_KERNEL_MIN_COUNT,
                 kernel_max_mean_bytes: int = DEFAULT_KERNEL_MAX_MEAN_BYTES,
                 _cupy_module: Any = None) -> None:
        if copy_path not in ("auto", "kernel", "memcpy"):
            raise ValueError(f"copy_path must be 'auto', 'kernel' or 'memcpy'; got {copy_path!r}")
        if kernel_min_count < 1 or kernel_max_mean_bytes < 0:
            raise ValueError("kernel_min_count must be >= 1 and kernel_max_mean_bytes >= 0")
        self._cp: Any = _cupy_module if _cupy_module is not None else _import_cupy()
        self._rt: Any = self._cp.cuda.runtime
        self._errors: tuple[type[BaseException], ...] = self._error_types()
        self._device = int(device)
        self.copy_path: CopyPath = copy_path
        self.kernel_min_count = int(kernel_min_count)
        self.kernel_max_mean_bytes = int(kernel_max_mean_bytes)
        self._ledger = Ledger()
        self._lock = threading.Lock()
        # Invariant: at most one (unowned) handle per compute-stream pointer; see current_stream().
        self._compute_handles: dict[int, CupyStream] = {}
        # Invariant: _mappings / _pinned map a tracked / registered range's start to its size (what the ledger's
        # "mapping" / "pinned" entries describe); _spans is what the copy kernel may dereference.
        self._mappings: dict[int, int] = {}
        self._pinned: dict[int, int] = {}
        self._spans = _SpanSet()
        # Invariant: free descriptor blocks by slot count; never freed except by release_cached_memory().
        self._descriptor_pool: dict[int, list[_DescriptorBlock]] = {}
        self._module: Any = None           # the compiled RawModule, once loaded
        self._functions: dict[str, Any] = {}  # kernel name -> loaded function
        self._kernel_broken: str | None = None  # why the kernel path is off for good, if it is
        self._path_counts = {"kernel": 0, "memcpy": 0}
        self.last_copy_path: str | None = None
        self._host_ptr_ok, self.sm_count, self.device_name = self._probe()
        if copy_path != "memcpy":
            self.warm_up()

    def _error_types(self) -> tuple[type[BaseException], ...]:
        found: list[type[BaseException]] = [self._rt.CUDARuntimeError]
        driver = getattr(self._cp.cuda, "driver", None)
        memory = getattr(self._cp.cuda, "memory", None)
        for owner, name in ((driver, "CUDADriverError"), (memory, "OutOfMemoryError")):
            err = getattr(owner, name, None)
            if isinstance(err, type) and issubclass(err, BaseException):
                found.append(err)
        return tuple(found)

    def _probe(self) -> tuple[bool, int, str]:
        try:
            count = int(self._rt.getDeviceCount())
        except self._errors as exc:
            raise DeviceError(f"no usable CUDA device: {exc}", _status_of(exc)) from exc
        if not 0 <= self._device < count:
            raise DeviceError(f"cuda:{self._device} does not exist ({count} device(s))", _CUDA_ERROR_INVALID_DEVICE)
        with self._cuda("probe device"):
            host_ptr_ok = int(self._rt.deviceGetAttribute(_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                                          self._device)) == 1
            sm_count = int(self._rt.deviceGetAttribute(_ATTR_MULTIPROCESSOR_COUNT, self._device))
            ptr = int(self._rt.malloc(256))
            self._rt.free(ptr)
        return host_ptr_ok, sm_count, _device_name(self._rt, self._device)

    def __repr__(self) -> str:
        return f"<CupyBackend cuda:{self._device} {self.device_name!r} copy_path={self.copy_path!r}>"

    @contextlib.contextmanager
    def _cuda(self, what: str, tag: Tag | None = None) -> Iterator[None]:
        """Run CUDA calls on this device; map CuPy's errors to DeviceError (CuPy's error as __cause__)."""
        try:
            prev = int(self._rt.getDevice())
            switch = prev != self._device
            if switch:
                self._rt.setDevice(self._device)
            try:
                yield
            finally:
                if switch:
                    self._rt.setDevice(prev)
        except self._errors as exc:
            raise DeviceError(f"{what} failed on cuda:{self._device}{_tag_text(tag)}: {exc}",
                              _status_of(exc)) from exc

    @property
    def ledger(self) -> Ledger:
        """The resources the library acquired through this backend (R16)."""
        return self._ledger

    @property
    def device(self) -> int:
        """The CUDA device ordinal."""
        return self._device

    # -- device memory ----------------------------------------------------------------------------------------
    def empty_device(self, shape: tuple[int, int]) -> object:
        """A new 2-D uint8 ``cupy.ndarray`` on the device (contents unspecified).

        Raises:
            InvalidTransferError: ``shape`` is not two non-negative ints.
            DeviceError: the allocation failed (status 2 for out of memory).
        """
        rows, cols = _check_shape(shape)
        with self._cuda("empty_device"):
            array = self._cp.empty((rows, cols), dtype=np.uint8)
        self._note_device_array(array)
        return array

    def from_host(self, array: npt.NDArray[np.uint8]) -> object:
        """A new device array holding a copy of a 2-D uint8 host array.

        Synchronous: the copy is queued on the compute stream, which is then synchronized.

        Raises:
            InvalidTransferError: not a 2-D uint8 numpy array.
            DeviceError: a CUDA call failed.
        """
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 2:
            raise InvalidTransferError(f"from_host needs a 2-D uint8 numpy array; got {_describe(array)}")
        host = np.ascontiguousarray(array)
        with self._cuda("from_host"):
            dev = self._cp.empty(host.shape, dtype=np.uint8)
            if host.nbytes:
                compute = self._compute_ptr()
                self._rt.memcpyAsync(int(dev.data.ptr), int(host.ctypes.data), host.nbytes, _MEMCPY_H2D, compute)
                self._rt.streamSynchronize(compute)
        self._note_device_array(dev)
        return dev

    def to_host(self, array: object) -> npt.NDArray[np.uint8]:
        """A host copy of a device array; waits for the compute stream (synchronous).

        Raises:
            InvalidTransferError: not a 2-D uint8 device array of this backend.
            DeviceError: a CUDA call failed.
        """
        self.array_info(array)
        dev: Any = array
        out = np.empty(tuple(dev.shape), dtype=np.uint8)
        if out.nbytes == 0:
            return out
        with self._cuda("to_host"):
            src = dev if dev.flags.c_contiguous else self._cp.ascontiguousarray(dev)
            compute = self._compute_ptr()
            self._rt.memcpyAsync(int(out.ctypes.data), int(src.data.ptr), out.nbytes, _MEMCPY_D2H, compute)
            self._rt.streamSynchronize(compute)
        return out

    def array_info(self, array: object) -> TensorGeometry:
        """Geometry of a 2-D uint8 ``cupy.ndarray`` on this device (rows may be padded: row_stride >= row_bytes).

        Also records the array's address range as device memory the copy kernel may touch.

        Raises:
            InvalidTransferError: not a cupy array, not uint8, not 2-D, a non-unit inner stride, a negative or
                overlapping row stride, or another device's array.
        """
        if not isinstance(array, self._cp.ndarray):
            raise InvalidTransferError(f"expected a cupy.ndarray; got {_describe(array)}")
        dev: Any = array
        if dev.dtype != np.uint8 or dev.ndim != 2:
            raise InvalidTransferError(f"expected a 2-D uint8 array; got {dev.ndim}-D {dev.dtype}")
        rows, cols = (int(n) for n in dev.shape)
        row_stride, inner = (int(s) for s in dev.strides)
        if cols > 1 and inner != 1:
            raise InvalidTransferError(f"rows must be contiguous bytes (inner stride 1); got strides {dev.strides}")
        if rows > 1 and row_stride < cols:
            raise InvalidTransferError(f"row stride {row_stride} is smaller than the row ({cols} bytes)")
        device_id = getattr(getattr(dev, "device", None), "id", self._device)
        if int(device_id) != self._device:
            raise InvalidTransferError(f"array is on cuda:{device_id}, backend on cuda:{self._device}")
        row_stride = max(row_stride, cols) if rows <= 1 else row_stride
        geometry = TensorGeometry(ptr=int(dev.data.ptr), rows=rows, row_bytes=cols, row_stride=row_stride)
        self._note_geometry(geometry)
        return geometry

    def _note_device_array(self, array: Any) -> None:
        rows, cols = (int(n) for n in array.shape)
        self._note_geometry(TensorGeometry(int(array.data.ptr), rows, cols, max(int(array.strides[0]), cols)))

    def _note_geometry(self, g: TensorGeometry) -> None:
        if g.rows and g.row_bytes:
            with self._lock:
                self._spans.add_device(g.ptr, g.ptr + (g.rows - 1) * g.row_stride + g.row_bytes)

    def _compute_ptr(self) -> int:
        return int(self._cp.cuda.get_current_stream().ptr)

    # -- host memory ------------------------------------------------------------------------------------------
    def track_host(self, ptr: int, nbytes: int) -> None:
        """Announce a host mapping ``[ptr, ptr + nbytes)`` (ledger kind "mapping", key ptr). No CUDA call.

        Raises:
            LifecycleError: ptr is already tracked (a library bug).
        """
        self._ledger.acquire("mapping", ptr)
        with self._lock:
            self._mappings[ptr] = nbytes

    def untrack_host(self, ptr: int) -> None:
        """Announce that the mapping at ptr is about to be unmapped. No CUDA call; no device error.

        Raises:
            LifecycleError: ptr is not tracked (a library bug).
        """
        self._ledger.release("mapping", ptr)
        with self._lock:
            self._mappings.pop(ptr, None)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Pin exactly ``[ptr, ptr + nbytes)`` with ``cudaHostRegister(Portable | Mapped)`` (ledger "pinned", key
        ptr). Chunking is the caller's job. Nothing is recorded if the call fails.

        Raises:
            DeviceError: the registration failed (e.g. 712 already registered, 1 invalid value).
        """
        with self._cuda(f"host_register({ptr:#x}, {nbytes})"):
            self._rt.hostRegister(ptr, nbytes, _HOST_REGISTER_FLAGS)
        kernel_ok = self._host_ptr_ok or self._device_pointer_is_host(ptr)
        self._ledger.acquire("pinned", ptr)
        with self._lock:
            self._pinned[ptr] = nbytes
            if kernel_ok:
                self._spans.add_pinned(ptr, ptr + nbytes)

    def _device_pointer_is_host(self, ptr: int) -> bool:
        try:
            with self._cuda("pointerGetAttributes"):
                return int(self._rt.pointerGetAttributes(ptr).devicePointer) == ptr
        except DeviceError as exc:  # then only the memcpy path may touch the range
            _log.warning("cannot tell the device pointer of registered memory at %#x: %s", ptr, exc)
            return False

    def host_unregister(self, ptr: int) -> None:
        """Unpin the range registered at ptr (``cudaHostUnregister``). On failure the range stays pinned and live
        in the ledger (the caller decides whether it is leaked).

        Raises:
            DeviceError: the unregistration failed (e.g. 713 not registered).
        """
        with self._cuda(f"host_unregister({ptr:#x})"):
            self._rt.hostUnregister(ptr)
        with self._lock:
            self._pinned.pop(ptr, None)
            self._spans.discard_pinned(ptr)
        self._ledger.release("pinned", ptr)

    # -- descriptor buffers -----------------------------------------------------------------------------------
    def alloc_descriptors(self, capacity: int, *, tag: Tag | None = None) -> DescriptorBuffer:
        """A descriptor buffer for ``capacity`` copies: int64 ``src``/``dst``/``sizes`` arrays of exactly that
        length in pinned host memory (plus a device twin for the kernel path). Ledger kind "descriptor", key
        ``id(buffer)`` (as the simulated device; the handler quarantines by that key).

        Blocks are pooled by power-of-two size and reused; they are never freed on the transfer or shutdown path.

        Raises:
            InvalidTransferError: a negative capacity.
            DeviceError: the pinned or device allocation failed.
        """
        if capacity < 0:
            raise InvalidTransferError(f"descriptor capacity must be >= 0; got {capacity}")
        slots = max(_MIN_DESCRIPTOR_SLOTS, 1 << max(capacity - 1, 0).bit_length())
        block = self._take_block(slots, tag)
        words = block.words
        buf = DescriptorBuffer(words[0:capacity], words[slots:slots + capacity],
                               words[2 * slots:2 * slots + capacity], block)
        try:
            self._ledger.acquire("descriptor", id(buf))
        except BaseException:
            self._return_block(block)
            raise
        block.issued_to = buf
        return buf

    def _take_block(self, slots: int, tag: Tag | None) -> _DescriptorBlock:
        with self._lock:
            free = self._descriptor_pool.get(slots)
            if free:
                return free.pop()
        nbytes = 3 * 8 * slots
        host_ptr = dev_ptr = 0
        try:
            with self._cuda("alloc_descriptors", tag):
                host_ptr = int(self._rt.hostAlloc(nbytes, _HOST_ALLOC_FLAGS))
                dev_ptr = int(self._rt.malloc(nbytes))
        except DeviceError:
            if host_ptr:
                with contextlib.suppress(DeviceError), self._cuda("freeHost"):
                    self._rt.freeHost(host_ptr)
            raise
        words = _host_words(host_ptr, 3 * slots, np.int64)
        return _DescriptorBlock(id(self), host_ptr, dev_ptr, slots, words)

    def _return_block(self, block: _DescriptorBlock) -> None:
        with self._lock:
            self._descriptor_pool.setdefault(block.slots, []).append(block)

    def free_descriptors(self, buf: DescriptorBuffer) -> None:
        """Return a descriptor buffer to the pool (no CUDA call; never a device error). The caller guarantees no
        copy still reads it.

        Raises:
            InvalidTransferError: not a buffer of this backend.
            LifecycleError: freed twice (a library bug).
        """
        block = self._block_of(buf)
        if block.issued_to is not buf:  # a second free, possibly after the block was issued again: refuse
            raise LifecycleError(f"{buf!r} was already freed")
        self._ledger.release("descriptor", id(buf))
        block.issued_to = None
        self._return_block(block)

    def _block_of(self, buf: DescriptorBuffer) -> _DescriptorBlock:
        block = getattr(buf, "handle", None)
        if not isinstance(block, _DescriptorBlock) or block.owner != id(self):
            raise InvalidTransferError(f"{buf!r} was not allocated by this backend")
        return block

    def release_cached_memory(self) -> int:
        """Free the pooled descriptor blocks (``cudaFreeHost``/``cudaFree``). BLOCKING: both synchronize the device,
        so never call this while work may hang. Returns the number of blocks freed.

        Raises:
            DeviceError: a free failed (the remaining blocks stay pooled).
        """
        with self._lock:
            blocks = [b for pool in self._descriptor_pool.values() for b in pool]
            self._descriptor_pool.clear()
        for i, block in enumerate(blocks):
            try:
                with self._cuda("release_cached_memory"):
                    self._rt.free(block.dev_ptr)
                    self._rt.freeHost(block.host_ptr)
            except DeviceError:
                for rest in blocks[i:]:
                    self._return_block(rest)
                raise
        return len(blocks)

    # -- streams and events -----------------------------------------------------------------------------------
    def current_stream(self) -> Stream:
        """The compute stream: the calling thread's current CuPy stream on this device (not owned)."""
        with self._cuda("current_stream"):
            ptr = self._compute_ptr()
        # One handle per compute stream, so callers (e.g. FaultyBackend) can tell it apart by identity.
        return self._compute_handles.setdefault(ptr, CupyStream(ptr, owned=False))

    def create_stream(self, *, tag: Tag | None = None) -> Stream:
        """A new non-blocking stream (``cudaStreamCreateWithFlags(cudaStreamNonBlocking)``; ledger "stream", key
        ``id(handle)``).

        Raises:
            DeviceError: the creation failed (nothing recorded).
        """
        with self._cuda("create_stream", tag):
            ptr = int(self._rt.streamCreateWithFlags(_STREAM_NON_BLOCKING))
        handle = CupyStream(ptr, owned=True)
        self._ledger.acquire("stream", id(handle))
        return handle

    def destroy_stream(self, stream: Stream) -> None:
        """Destroy a stream this backend created (queued work still runs; returns at once). A failure is logged,
        never raised. The compute stream (not owned) is left alone.

        Raises:
            InvalidTransferError: not a stream handle of this backend.
            LifecycleError: destroyed twice (a library bug).
        """
        handle = self._stream(stream, allow_destroyed=True)
        if not handle.owned:
            return
        if not handle.destroyed:
            handle.destroyed = True
            try:
                with self._cuda("destroy_stream"):
                    self._rt.streamDestroy(handle.ptr)
            except DeviceError as exc:
                _log.warning("%s; the stream is forgotten", exc)
        self._ledger.release("stream", id(handle))

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Later work on ``stream`` waits (on the device) for the event's latest record.

        Raises:
            DeviceError: the call failed, or a handle was already destroyed (status 400).
        """
        s, e = self._stream(stream), self._event(event)
        with self._cuda("wait_event", e.tag):
            self._rt.streamWaitEvent(s.ptr, e.ptr, 0)

    def create_event(self, *, tag: Tag | None = None) -> Event:
        """A new timing event (``cudaEventCreateWithFlags(0)``; ledger "event", key ``id(handle)``).

        Raises:
            DeviceError: the creation failed (nothing recorded).
        """
        with self._cuda("create_event", tag):
            ptr = int(self._rt.eventCreateWithFlags(_EVENT_DEFAULT))
        handle = CupyEvent(ptr)
        self._ledger.acquire("event", id(handle))
        return handle

    def destroy_event(self, event: Event) -> None:
        """Destroy an event (returns at once even if its record is pending). A failure is logged, never raised.

        Raises:
            InvalidTransferError: not an event handle of this backend.
            LifecycleError: destroyed twice (a library bug).
        """
        handle = self._event(event, allow_destroyed=True)
        if not handle.destroyed:
            handle.destroyed = True
            try:
                with self._cuda("destroy_event"):
                    self._rt.eventDestroy(handle.ptr)
            except DeviceError as exc:
                _log.warning("%s; the event is forgotten", exc)
        self._ledger.release("event", id(handle))

    def record(self, event: Event, stream: Stream, *, tag: Tag | None = None) -> None:
        """Record the event on the stream (``cudaEventRecord``); remembers ``tag`` for the event's errors.

        Raises:
            DeviceError: the call failed, or a handle was already destroyed (status 400).
        """
        e, s = self._event(event), self._stream(stream)
        with self._cuda("record", tag):
            self._rt.eventRecord(e.ptr, s.ptr)
        e.tag = tag

    def query(self, event: Event) -> bool:
        """Strict, non-blocking poll: ``cudaEventQuery`` 0 -> True, 600 (not ready) -> False, anything else is an
        error (CuPy's ``Event.done`` would hide it as "pending").

        Raises:
            DeviceError: any other status (the CUDARuntimeError for it as ``__cause__``), or a destroyed handle.
        """
        e = self._event(event)
        with self._cuda("event query", e.tag):
            status = int(self._rt.eventQuery(e.ptr))
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        cause = self._rt.CUDARuntimeError(status)
        raise DeviceError(f"event query failed on cuda:{self._device}{_tag_text(e.tag)}: {cause}", status) from cause

    def synchronize(self, event: Event) -> None:
        """Block (GIL released) until the event completes. Unbounded: never used on the shutdown path.

        Raises:
            DeviceError: the device reported an error.
        """
        e = self._event(event)
        with self._cuda("event synchronize", e.tag):
            self._rt.eventSynchronize(e.ptr)

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds between two completed timing events (``cudaEventElapsedTime`` gives milliseconds).

        Raises:
            DeviceError: e.g. status 600 if an event has not completed.
        """
        a, b = self._event(start), self._event(end)
        with self._cuda("elapsed", b.tag):
            return float(self._rt.eventElapsedTime(a.ptr, b.ptr)) / 1000.0

    def _stream(self, stream: Stream, *, allow_destroyed: bool = False) -> CupyStream:
        if not isinstance(stream, CupyStream):
            raise InvalidTransferError(f"not a stream of the CuPy backend: {stream!r}")
        if stream.destroyed and not allow_destroyed:
            raise DeviceError(f"stream {stream.ptr:#x} was destroyed", CUDA_ERROR_INVALID_RESOURCE_HANDLE)
        return stream

    def _event(self, event: Event, *, allow_destroyed: bool = False) -> CupyEvent:
        if not isinstance(event, CupyEvent):
            raise InvalidTransferError(f"not an event of the CuPy backend: {event!r}")
        if event.destroyed and not allow_destroyed:
            raise DeviceError(f"event {event.ptr:#x} was destroyed", CUDA_ERROR_INVALID_RESOURCE_HANDLE)
        return event

    # -- copies -----------------------------------------------------------------------------------------------
    def copy_batch(self, stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
        """Queue the first ``count`` copies of ``buf`` on ``stream`` as one submission (kernel or memcpy path; see
        the module docstring). ``buf`` must stay untouched and alive until the copy is proven complete.

        Raises:
            InvalidTransferError: a foreign buffer, ``count`` out of range, or a negative size (before any work).
            DeviceError: a CUDA call failed. On the memcpy path, copies queued before the failing one still run.
        """
        s = self._stream(stream)
        block = self._block_of(buf)
        if not 0 <= count <= buf.capacity:
            raise InvalidTransferError(f"count {count} outside [0, {buf.capacity}]")
        src, dst, sizes = buf.src[:count], buf.dst[:count], buf.sizes[:count]
        if count and int(sizes.min()) < 0:
            raise InvalidTransferError("descriptor sizes must be >= 0")
        if count == 0 or int(sizes.max()) == 0:
            return
        path = self.choose_path(src, dst, sizes)
        if path == "kernel" and not self._kernel_available():
            path = "memcpy"
        if path == "kernel":
            self._copy_kernel(s, block, count, int(sizes.max()), tag)
        else:
            self._copy_memcpy(s, src, dst, sizes, tag)
        with self._lock:
            self._path_counts[path] += 1
        self.last_copy_path = path

    def choose_path(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                    sizes: npt.NDArray[np.int64]) -> Literal["kernel", "memcpy"]:
        """The path ``copy_batch`` would take for these descriptors (see the module docstring)."""
        count = int(sizes.shape[0])
        if self.copy_path == "memcpy" or self._kernel_broken is not None or count == 0:
            return "memcpy"
        if self.copy_path == "auto" and (
            count < self.kernel_min_count or int(sizes.sum()) > count * self.kernel_max_mean_bytes
        ):
            return "memcpy"
        with self._lock:
            legal = self._spans.contains_all(src, sizes) and self._spans.contains_all(dst, sizes)
        return "kernel" if legal else "memcpy"

    def _kernel_available(self) -> bool:
        """Compile and load the kernels if needed; False (logged once) if that failed, so callers fall back."""
        try:
            self._function(_COPY_KERNEL)
        except DeviceError:
            return False
        return True

    def copy_path_counts(self) -> dict[str, int]:
        """How many ``copy_batch`` submissions took each path so far."""
        with self._lock:
            return dict(self._path_counts)

    def _copy_memcpy(self, s: CupyStream, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                     sizes: npt.NDArray[np.int64], tag: Tag | None) -> None:
        runs_src, runs_dst, runs_size = _coalesce(src, dst, sizes)
        memcpy = self._rt.memcpyAsync
        with self._cuda("copy_batch (memcpy)", tag):
            for d, a, n in zip(runs_dst.tolist(), runs_src.tolist(), runs_size.tolist(), strict=True):
                if n:
                    memcpy(d, a, n, _MEMCPY_DEFAULT, s.ptr)

    def _copy_kernel(self, s: CupyStream, block: _DescriptorBlock, count: int, max_size: int,
                     tag: Tag | None) -> None:
        function = self._function(_COPY_KERNEL)
        grid_x = min(_MAX_GRID_X, max(1, -(-max_size // _BYTES_PER_BLOCK_ROUND)))
        grid_y = min(count, _MAX_GRID_Y)
        word = 8 * block.slots
        dev = block.dev_ptr
        args = (np.uint64(dev), np.uint64(dev + word), np.uint64(dev + 2 * word), np.int64(count))
        with self._cuda("copy_batch (kernel)", tag):
            if 3 * word <= _SINGLE_UPLOAD_MAX_BYTES or 2 * count >= block.slots:
                self._rt.memcpyAsync(dev, block.host_ptr, 3 * word, _MEMCPY_H2D, s.ptr)
            else:
                for part in range(3):
                    self._rt.memcpyAsync(dev + part * word, block.host_ptr + part * word, 8 * count,
                                         _MEMCPY_H2D, s.ptr)
            function((grid_x, grid_y, 1), (_THREADS, 1, 1), args, stream=s)

    # -- kernels ----------------------------------------------------------------------------------------------
    def warm_up(self) -> bool:
        """Compile and load the kernels now and launch the copy kernel once with nothing to copy (on the compute
        stream), so no later launch loads a module (lazy loading may synchronize the context). Blocking
        (synchronizes the compute stream). Called by the constructor unless ``copy_path="memcpy"``.

        Any failure here (compile, load, launch) turns the kernel path off for good: it is logged, kept in
        :attr:`kernel_unavailable`, and ``copy_batch`` uses the memcpy path. Never raises for that reason.

        Returns:
            Whether the kernel path is available.
        """
        if not self._kernel_available():
            return False
        function = self._functions[_COPY_KERNEL]
        try:
            with self._cuda("warm_up"):
                compute = CupyStream(self._compute_ptr(), owned=False)
                zero = np.uint64(0)
                function((1, 1, 1), (_THREADS, 1, 1), (zero, zero, zero, np.int64(0)), stream=compute)
                self._rt.streamSynchronize(compute.ptr)
        except Exception as exc:
            self._disable_kernels(exc)
            return False
        return True

    @property
    def kernel_unavailable(self) -> str | None:
        """Why the kernel path is off for good (compile, load or first launch failed), or None if it is not."""
        return self._kernel_broken

    def _disable_kernels(self, exc: BaseException) -> None:
        self._kernel_broken = f"{type(exc).__name__}: {exc}"
        _log.warning("CuPy backend: copy kernel unavailable, using memcpy only: %s", self._kernel_broken)

    def _function(self, name: str) -> Any:
        """A kernel of KERNEL_SOURCE (both are compiled and loaded on first use). Any failure to compile or load
        turns the kernel path off for good.

        Raises:
            DeviceError: the kernels are unavailable (status 999; the original error as ``__cause__``).
        """
        function = self._functions.get(name)
        if function is not None:
            return function
        if self._kernel_broken is None:
            try:
                with self._cuda("compile kernels"):
                    module = self._cp.RawModule(code=KERNEL_SOURCE)
                    # RawModule.get_function returns a RawKernel; its .kernel (a cupy.cuda.Function) forces the
                    # compile and load now, and launches with less overhead.
                    loaded = {n: _loaded(module.get_function(n)) for n in (_COPY_KERNEL, _SPIN_KERNEL)}
            except Exception as exc:  # CompileException, a missing libnvrtc, a PTX the driver rejects, ...
                self._disable_kernels(exc)
                raise DeviceError(f"kernel path unavailable: {self._kernel_broken}", CUDA_ERROR_UNKNOWN) from exc
            self._module = module
            self._functions.update(loaded)
            return loaded[name]
        raise DeviceError(f"kernel path unavailable: {self._kernel_broken}", CUDA_ERROR_UNKNOWN)

    # -- test helpers: a transfer that never completes until the host says so ----------------------------------
    def alloc_spin_flag(self) -> SpinFlag:
        """Test helper: a zeroed :class:`SpinFlag` in mapped pinned host memory (not in the ledger).

        Raises:
            DeviceError: the allocation failed.
        """
        with self._cuda("alloc_spin_flag"):
            host_ptr = int(self._rt.hostAlloc(64, _HOST_ALLOC_FLAGS))
            dev_ptr = int(self._rt.pointerGetAttributes(host_ptr).devicePointer)
        words = _host_words(host_ptr, 16, np.int32)
        words[:] = 0
        return SpinFlag(host_ptr, dev_ptr, words)

    def free_spin_flag(self, flag: SpinFlag) -> None:
        """Test helper: free a flag (``cudaFreeHost``: BLOCKING, and only once the spin kernel has ended).

        Raises:
            DeviceError: the free failed.
        """
        if flag.freed:
            return
        with self._cuda("free_spin_flag"):
            self._rt.freeHost(flag.host_ptr)
        flag.freed = True

    def enqueue_spin(self, stream: Stream, flag: SpinFlag, *, timeout: float = 30.0) -> None:
        """Test helper: queue a one-thread kernel on ``stream`` that spins (volatile reads of mapped host memory)
        until ``flag.release()`` or, as a safety net, ``timeout`` seconds of GPU time (0 = never); everything
        queued behind it waits. Call :meth:`warm_up` first so no module loads while it spins.

        Raises:
            DeviceError: the launch failed.
        """
        s = self._stream(stream)
        function = self._function(_SPIN_KERNEL)
        args = (np.uint64(flag.dev_ptr), np.uint64(int(timeout * 1e9)))
        with self._cuda("enqueue_spin"):
            function((1, 1, 1), (1, 1, 1), args, stream=s)

    # -- clock and the device-level proof ---------------------------------------------------------------------
    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` (releases the GIL)."""
        time.sleep(max(seconds, 0.0))

    def prove_idle(self, streams: Sequence[Stream], deadline: float) -> bool:
        """The device-level proof (R13): fresh events on the compute stream and each stream, polled strictly
        until ``deadline`` (at least once). Never a blocking device synchronize (R11).

        Returns:
            True if all completed, False if the deadline passed first.

        Raises:
            DeviceError: the device failed while proving.
        """
        return record_and_poll(self, streams, deadline)


def _host_words(ptr: int, count: int, dtype: type[_Word]) -> npt.NDArray[_Word]:
    """A numpy view of ``count`` words of host memory at ``ptr`` (the caller keeps the memory alive)."""
    raw = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype)


def _loaded(kernel: Any) -> Any:
    """The loaded ``cupy.cuda.Function`` of a ``RawKernel`` (compiling it now), or the object itself."""
    return getattr(kernel, "kernel", kernel)


def _check_shape(shape: object) -> tuple[int, int]:
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise InvalidTransferError(f"shape must be two non-negative ints; got {shape!r}")
    return int(shape[0]), int(shape[1])


def _describe(obj: object) -> str:
    shape = getattr(obj, "shape", None)
    dtype = getattr(obj, "dtype", None)
    return f"{type(obj).__module__}.{type(obj).__qualname__}" + (f" {shape} {dtype}" if shape is not None else "")


def _coalesce(src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
              sizes: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                                     npt.NDArray[np.int64]]:
    """Merge runs of descriptors that are contiguous on both sides into single copies."""
    if src.shape[0] <= 1:
        return src, dst, sizes
    breaks = (src[1:] != src[:-1] + sizes[:-1]) | (dst[1:] != dst[:-1] + sizes[:-1])
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


if TYPE_CHECKING:
    from kvoffload_ref.backends.base import Backend

    def _conforms(backend: CupyBackend) -> Backend:
        return backend  # mypy checks CupyBackend against the Backend protocol here
