"""The CuPy backend: the Backend protocol on a real NVIDIA GPU, through ``cupy.cuda.runtime``.

``import kvoffload_ref.backends.cupy`` never imports CuPy (it is imported lazily), so :func:`gpu_usable` can say
*why* no GPU is usable, and ``CupyBackend()`` raises ``ImportError`` without CuPy or ``DeviceError`` without a
device. Every CUDA failure of every method becomes ``DeviceError(message, status)`` raised ``from`` the CuPy error.
Streams and events are raw runtime handles.

Seams (docs/backends.md has the map): ``_cupy_runtime`` (import, probe, handles, error mapping), ``_cupy_copy``
(kernel source, path choice; pure), ``_cupy_kernel`` (compile, launch, memcpy runs), ``_cupy_descriptors`` (the
pinned descriptor pool), ``_cupy_interop`` (tensors and streams of any framework; pure), ``_cupy_tensors`` (a
tensor as bytes on the device), ``_cupy_streams`` (the stream and event calls). This module owns the state and issues
the other CUDA calls. Memory that synchronizes the
device on free is never freed on a path that may run while the device hangs (R11).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends import _cupy_runtime as _cuda_rt
from kvoffload_ref.backends._cupy_copy import (
    DEFAULT_KERNEL_MAX_MEAN_BYTES,
    DEFAULT_KERNEL_MIN_COUNT,
    KERNEL_SOURCE,
    CopyPath,
    SpanSet,
    choose_path,
)
from kvoffload_ref.backends._cupy_descriptors import DescriptorPool
from kvoffload_ref.backends._cupy_interop import check_shape, describe, tensor_name
from kvoffload_ref.backends._cupy_kernel import CopyEngine
from kvoffload_ref.backends._cupy_runtime import CudaCalls, CupyEvent, CupyStream, gpu_usable, status_of
from kvoffload_ref.backends._cupy_streams import StreamsMixin
from kvoffload_ref.backends._cupy_tensors import copy_from_host, copy_to_host, view_tensor
from kvoffload_ref.backends._cupy_trace import TracingMixin
from kvoffload_ref.backends.base import DescriptorBuffer, Ledger, Stream, Tag, record_and_poll
from kvoffload_ref.backends.copy_paths import check_copy_path
from kvoffload_ref.errors import (
    CUDA_ERROR_NOT_SUPPORTED,
    DeviceError,
    InvalidTransferError,
    LifecycleError,
    RegistrationRefused,
)
from kvoffload_ref.specs import TensorGeometry
from kvoffload_ref.validate import INT64_MAX, check_int

__all__ = ["DEFAULT_KERNEL_MAX_MEAN_BYTES", "DEFAULT_KERNEL_MIN_COUNT", "KERNEL_SOURCE", "CopyPath", "CupyBackend",
           "CupyEvent", "CupyStream", "gpu_usable"]

_log = logging.getLogger(__name__)


class CupyBackend(StreamsMixin, TracingMixin):
    """The Backend protocol (``kvoffload_ref.backends.base.Backend``) on one CUDA device through CuPy.

    Construction compiles and loads the copy kernel (``warm_up``; NVRTC, cached on disk by CuPy) unless
    ``copy_path="memcpy"``, and synchronizes the compute stream once. If the kernel cannot be compiled, the backend
    logs a warning and uses the memcpy path only. ``start_trace()`` records a timeline of the copies
    (``_cupy_trace``; the simulated device's format). The stream and event calls are :class:`~kvoffload_ref.backends.
    _cupy_streams.StreamsMixin`'s.

    Thread-safe: CUDA calls are thread-safe, the ledger locks itself, and the backend's own tables are guarded by
    a lock. Every call makes ``device`` current for its duration and restores the caller's device afterwards.
    ``current_stream()`` is the calling thread's current CuPy stream on ``device`` (CuPy's current stream is
    thread-local); :meth:`compute_stream` turns any framework's stream into a handle usable from any thread.

    Args:
        device: CUDA device ordinal.
        copy_path: ``"auto"`` (default), ``"kernel"`` or ``"memcpy"`` (see ``_cupy_copy``).
        kernel_min_count: ``auto`` uses the kernel only for at least this many descriptors.
        kernel_max_mean_bytes: ``auto`` uses the kernel only if the mean descriptor size is at most this.
        _cupy_module: for tests only: a stand-in for the ``cupy`` module (a fake runtime on a CPU machine).

    Raises:
        ImportError: CuPy is not installed.
        DeviceError: no usable device (``.status`` from CUDA, the CuPy error as ``__cause__``).
        ValueError: an invalid ``copy_path`` or threshold.
    """

    name = "cupy"
    #: A copy to or from pageable (unregistered) host memory would block the host (CUDA's ``cudaMemcpyAsync``
    #: does), so ``copy_batch`` refuses it and a worker on this backend requires its region pinned (R11).
    pageable_copies_block = True

    def __init__(self, device: int = 0, *, copy_path: CopyPath = "auto",
                 kernel_min_count: int = DEFAULT_KERNEL_MIN_COUNT,
                 kernel_max_mean_bytes: int = DEFAULT_KERNEL_MAX_MEAN_BYTES,
                 _cupy_module: Any = None) -> None:
        copy_path = check_copy_path(copy_path)
        if kernel_min_count < 1 or kernel_max_mean_bytes < 0:
            raise ValueError(f"kernel_min_count must be >= 1 and kernel_max_mean_bytes >= 0, got kernel_min_count="
                             f"{kernel_min_count!r}, kernel_max_mean_bytes={kernel_max_mean_bytes!r} (e.g. "
                             f"{DEFAULT_KERNEL_MIN_COUNT} and {DEFAULT_KERNEL_MAX_MEAN_BYTES})")
        self._cp: Any = _cupy_module if _cupy_module is not None else _cuda_rt.import_cupy()
        self._device = int(device)
        self._cuda = CudaCalls(self._cp, self._device)
        self._rt: Any = self._cuda.rt
        self.copy_path: CopyPath = copy_path
        self.kernel_min_count = int(kernel_min_count)
        self.kernel_max_mean_bytes = int(kernel_max_mean_bytes)
        self._ledger = Ledger()
        self._lock = threading.Lock()
        # Invariant: at most one (unowned) handle per compute-stream pointer; see current_stream().
        self._compute_handles: dict[int, CupyStream] = {}
        # Invariant: _mappings maps a tracked range's start to its size (the ledger's "mapping" entries); _spans
        # holds the registered ("pinned") ranges, what the copy kernel may dereference, and their seams (the
        # memcpy path merges no run across one, R25).
        self._mappings: dict[int, int] = {}
        # Invariant: the start -> size of every live pinned allocation (alloc_pinned, not yet freed: the ledger's
        # "pinned_alloc" entries); each is also in _spans as a pinned range.
        self._allocs: dict[int, int] = {}
        # Invariant: True once hostRegister answered 801 (cudaErrorNotSupported): the platform refuses every
        # registration (confidential computing, vLLM #55428); a shared region then refuses at once.
        self.refuses_registration = False
        self._spans = SpanSet()
        self._descriptors = DescriptorPool(self._cuda)
        self._engine = CopyEngine(self._cp, self._cuda)
        self._path_counts = {"kernel": 0, "memcpy": 0}
        self.last_copy_path: str | None = None
        self._host_ptr_ok, self.sm_count, self.device_name = self._probe()
        if copy_path != "memcpy":
            self.warm_up()

    def _probe(self) -> tuple[bool, int, str]:
        try:
            count = int(self._rt.getDeviceCount())
        except self._cuda.errors as exc:
            raise DeviceError(f"no usable CUDA device: {exc}", status_of(exc)) from exc
        if not 0 <= self._device < count:
            raise DeviceError(f"cuda:{self._device} does not exist ({count} device(s))",
                              _cuda_rt.CUDA_ERROR_INVALID_DEVICE)
        with self._cuda("probe device"):
            host_ptr_ok = int(self._rt.deviceGetAttribute(_cuda_rt.ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                                          self._device)) == 1
            sm_count = int(self._rt.deviceGetAttribute(_cuda_rt.ATTR_MULTIPROCESSOR_COUNT, self._device))
            ptr = int(self._rt.malloc(256))
            self._rt.free(ptr)
        return host_ptr_ok, sm_count, _cuda_rt.device_name(self._rt, self._device)

    def __repr__(self) -> str:
        return f"<CupyBackend cuda:{self._device} {self.device_name!r} copy_path={self.copy_path!r}>"

    @property
    def ledger(self) -> Ledger:
        """The resources the library acquired through this backend (R16)."""
        return self._ledger

    @property
    def hang_horizon(self) -> None:
        """None: a real device's waits have no hang horizon."""
        return None

    def check_unbounded_wait(self, started: float, now: float, what: str) -> None:
        """Never raises: a real device's wait without a timeout waits as long as the work takes."""

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
        rows, cols = check_shape(shape)
        with self._cuda("empty_device"):
            array = self._cp.empty((rows, cols), dtype=np.uint8)
        self._note_geometry(TensorGeometry(int(array.data.ptr), rows, cols, cols))
        return array

    def from_host(self, array: npt.NDArray[np.uint8]) -> object:
        """A new device array (2-D uint8 ``cupy.ndarray``) holding a copy of a 2-D uint8 host array.

        Synchronous: the copy is queued on the calling thread's current stream, which is then synchronized.

        Raises:
            InvalidTransferError: not a 2-D uint8 numpy array.
            DeviceError: a CUDA call failed.
        """
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 2:
            raise InvalidTransferError(f"from_host: array must be a 2-D uint8 numpy array (e.g. "
                                       f"np.zeros((4, 64), np.uint8)), got {describe(array)}")
        host = np.ascontiguousarray(array)
        dev = copy_from_host(self._cp, self._cuda, host, self._current_ptr("from_host"))
        self._note_geometry(TensorGeometry(int(dev.data.ptr), host.shape[0], host.shape[1], host.shape[1]))
        return dev

    def to_host(self, array: object) -> npt.NDArray[np.uint8]:
        """A host copy of a GPU tensor's bytes, shape ``(blocks, block_bytes)`` (padding between blocks left out).

        Synchronous: the copy is queued on the calling thread's current stream, which is then synchronized (so it
        sees the work queued there before it).

        Args:
            array: any GPU tensor :meth:`array_info` accepts.

        Raises:
            InvalidTransferError: as :meth:`array_info`.
            DeviceError: a CUDA call failed.
        """
        return copy_to_host(self._cuda, self.array_info(array), self._current_ptr("to_host"))

    def array_info(self, array: object, *, index: int | None = None) -> TensorGeometry:
        """The byte geometry of a GPU tensor on this device, zero copy: ``rows = shape[0]`` blocks of
        ``itemsize * prod(shape[1:])`` bytes, ``row_stride`` bytes apart (padding between blocks is allowed).

        Accepts any object exposing ``__cuda_array_interface__`` (preferred: no conversion) or ``__dlpack__``
        (then viewed through ``cupy.from_dlpack``): CuPy, torch, JAX, Numba arrays of any dtype whose dimensions
        after the first are C-contiguous. Also records the tensor's address range as device memory the copy
        kernel may touch.

        Args:
            array: the tensor.
            index: its position in the worker's ``gpu_tensors``, for messages (``gpu_tensors[i]: ...``).

        Returns:
            The geometry.

        Raises:
            InvalidTransferError: the message names the tensor and why: neither interface (or both failed),
                host memory, another device, a non-contiguous block, a read-only array, a malformed interface.
            DeviceError: a CUDA call (pointer attributes) failed.
        """
        geometry = view_tensor(self._cp, self._cuda, array, tensor_name(index)).geometry
        self._note_geometry(geometry)
        return geometry

    def _note_geometry(self, g: TensorGeometry) -> None:
        if g.rows and g.row_bytes:
            with self._lock:
                self._spans.add_device(g.ptr, g.ptr + (g.rows - 1) * g.row_stride + g.row_bytes)

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
        ptr). Chunking is the caller's job; the range's bounds are seams no memcpy run crosses (R25). Nothing is
        recorded if the call fails.

        Raises:
            DeviceError: the registration failed (e.g. 712 already registered, 1 invalid value).
            RegistrationRefused: 801 (cudaErrorNotSupported): the platform refuses host registration (under
                confidential computing, for every size and flag, vLLM #55428); not sticky.
        """
        try:
            with self._cuda(f"host_register({ptr:#x}, {nbytes})"):
                self._rt.hostRegister(ptr, nbytes, _cuda_rt.HOST_REGISTER_FLAGS)
        except DeviceError as exc:
            if exc.status != CUDA_ERROR_NOT_SUPPORTED:
                raise
            self.refuses_registration = True
            raise RegistrationRefused(str(exc)) from exc.__cause__
        kernel_ok = self._host_ptr_ok or self._device_pointer_is_host(ptr)
        self._ledger.acquire("pinned", ptr)
        with self._lock:
            self._spans.add_pinned(ptr, ptr + nbytes, kernel=kernel_ok)

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
            self._spans.discard_pinned(ptr)
        self._ledger.release("pinned", ptr)

    def alloc_pinned(self, nbytes: int) -> tuple[int, npt.NDArray[np.uint8]]:
        """Allocate ``nbytes`` of pinned host memory with ``cudaHostAlloc(nbytes, 0)`` (``backends.pinned``; ledger
        "pinned_alloc", key ptr), zeroed like a fresh mapping. Straight from the runtime, not CuPy's pinned memory
        pool, which would keep freed memory cached (a release must give it back). Copies and the kernel may use it
        as a registered range (R25: its bounds are seams, none inside it).

        Returns:
            ``(ptr, buffer)``: the address and a 1-D uint8 numpy view of exactly its bytes (no owner: it must not
            be used after :meth:`free_pinned`).

        Raises:
            InvalidTransferError: ``nbytes`` is not an int in [1, 2**63 - 1] (R7).
            DeviceError: the allocation failed (e.g. 2, out of memory).
        """
        nbytes = check_int("alloc_pinned: nbytes", nbytes, minimum=1, maximum=INT64_MAX)  # the sim's check (R7)
        with self._cuda(f"alloc_pinned({nbytes})"):
            ptr = int(self._rt.hostAlloc(nbytes, 0))
        buffer = np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))
        buffer.fill(0)
        kernel_ok = self._host_ptr_ok or self._device_pointer_is_host(ptr)
        self._ledger.acquire("pinned_alloc", ptr)
        with self._lock:
            self._allocs[ptr] = nbytes
            self._spans.add_pinned(ptr, ptr + nbytes, kernel=kernel_ok)
        return ptr, buffer

    def free_pinned(self, ptr: int) -> None:
        """Free the allocation at ``ptr`` (``cudaFreeHost``). On failure it stays allocated and live in the
        ledger (the caller decides whether it is leaked). ``cudaFreeHost`` may wait for the device: the library
        frees a region only once its copies are proven complete (R12), or under ``on_unproven="release"``.

        Raises:
            LifecycleError: ptr is not a live allocation of this backend (a library bug).
            DeviceError: the free failed.
        """
        if ptr not in self._allocs:
            raise LifecycleError(f"free_pinned({ptr:#x}): not a live pinned allocation of this backend")
        with self._cuda(f"free_pinned({ptr:#x})"):
            self._rt.freeHost(ptr)
        with self._lock:
            self._allocs.pop(ptr, None)
            self._spans.discard_pinned(ptr)
        self._ledger.release("pinned_alloc", ptr)

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
        return self._descriptors.issue(capacity, tag, lambda buf: self._ledger.acquire("descriptor", id(buf)))

    def free_descriptors(self, buf: DescriptorBuffer) -> None:
        """Return a descriptor buffer to the pool (no CUDA call; never a device error). The caller guarantees no
        copy still reads it.

        Raises:
            InvalidTransferError: not a buffer of this backend.
            LifecycleError: freed twice (a library bug).
        """
        self._descriptors.retire(buf, lambda b: self._ledger.release("descriptor", id(b)))

    def release_cached_memory(self) -> int:
        """Free the pooled descriptor blocks (``cudaFreeHost``/``cudaFree``). BLOCKING: both synchronize the device,
        so never call this while work may hang. Returns the number of blocks freed.

        Raises:
            DeviceError: a free failed (the remaining blocks stay pooled).
        """
        return self._descriptors.release_cached()

    # -- streams and events: StreamsMixin (_cupy_streams) ------------------------------------------------------

    # -- copies -----------------------------------------------------------------------------------------------
    def copy_batch(self, stream: Stream, buf: DescriptorBuffer, count: int, *, tag: Tag | None = None) -> None:
        """Queue the first ``count`` copies of ``buf`` on ``stream`` as one submission (kernel or memcpy path; see
        ``_cupy_copy``). ``buf`` must stay untouched and alive until the copy is proven complete.

        Never blocks the host (R11: it runs under the worker's lock): every descriptor's source and destination
        must be device memory or registered (page-locked) host memory -- a ``cudaMemcpyAsync`` to or from pageable
        memory would block until the stream reaches it.

        Raises:
            InvalidTransferError: a foreign buffer, ``count`` out of range, a negative size, or a descriptor touching
                pageable host memory (before any work).
            DeviceError: a CUDA call failed. On the memcpy path, copies queued before the failing one still run.
        """
        s = self._stream(stream)
        block = self._descriptors.block_of(buf)
        if not 0 <= count <= buf.capacity:
            raise InvalidTransferError(f"copy_batch: count must be an int in [0, {buf.capacity}] (the buffer's "
                                       f"capacity), got {count!r} (e.g. {buf.capacity})")
        src, dst, sizes = buf.src[:count], buf.dst[:count], buf.sizes[:count]
        if count and int(sizes.min()) < 0:
            raise InvalidTransferError(f"copy_batch: descriptor sizes must be >= 0, got {int(sizes.min())} at "
                                       f"descriptor {int(np.argmin(sizes))} (e.g. 0)")
        if count == 0 or int(sizes.max()) == 0:
            return
        path = self.choose_path(src, dst, sizes)
        path = "memcpy" if path == "kernel" and not self._engine.warmed else path  # R11: no module load here
        if path == "memcpy":
            self._refuse_pageable(src, dst, sizes)  # R11 (the kernel path's descriptors are all page-locked)
        tracer = self._tracer  # read once: a stop_trace() meanwhile must not strand the start event
        traced = tracer.begin(s.ptr) if tracer is not None else None
        try:
            if path == "kernel":
                self._engine.launch(s, block, count, int(sizes.max()), tag)
            else:
                self._engine.memcpy(s, src, dst, sizes, tag, self._spans.seams)  # no run across a seam (R25)
        except BaseException:
            if tracer is not None and traced is not None:
                tracer.abandon(traced)
            raise
        if tracer is not None and traced is not None:
            tracer.end(traced, s.ptr, tag, int(sizes.sum()), count, path)
        with self._lock:
            self._path_counts[path] += 1
        self.last_copy_path = path

    def _refuse_pageable(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                         sizes: npt.NDArray[np.int64]) -> None:
        """R11: no copy of ``copy_batch`` may block the host, and a ``cudaMemcpyAsync`` to or from pageable host
        memory does (it waits for the stream, staging through the driver's pinned buffers) -- under the worker's
        lock, where a hung stream would hold ``shutdown()`` from another thread. So every byte must be device memory
        or registered (page-locked) host memory; anything else is refused before any CUDA call.

        Raises:
            InvalidTransferError: a descriptor's source or destination is pageable (not registered) host memory.
        """
        with self._lock:
            bad = [(side, self._spans.first_pageable(addrs, sizes)) for side, addrs in (("source", src),
                                                                                        ("destination", dst))]
        for side, i in bad:
            if i is not None:
                addr = int((src if side == "source" else dst)[i])
                raise InvalidTransferError(
                    f"copy_batch: descriptor {i}'s {side} [{addr:#x}, {addr + int(sizes[i]):#x}) is pageable host "
                    "memory (neither device memory nor a registered range): cudaMemcpyAsync would block the host "
                    "until the stream reaches it (R11); register the memory first (HostRegion.pin)")

    def choose_path(self, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
                    sizes: npt.NDArray[np.int64]) -> Literal["kernel", "memcpy"]:
        """The path ``copy_batch`` would take for these descriptors (``_cupy_copy.choose_path``)."""
        count = int(sizes.shape[0])
        if self.copy_path == "memcpy" or self._engine.broken is not None or count == 0:
            return "memcpy"
        with self._lock:
            legal = self._spans.contains_all(src, sizes) and self._spans.contains_all(dst, sizes)
        return choose_path(self.copy_path, count=count, total_bytes=int(sizes.sum()),
                           min_count=self.kernel_min_count, max_mean_bytes=self.kernel_max_mean_bytes, legal=legal)

    def copy_path_counts(self) -> dict[str, int]:
        """How many ``copy_batch`` submissions took each path so far."""
        with self._lock:
            return dict(self._path_counts)

    def warm_up(self) -> bool:
        """Compile and load the kernel now and launch it once with nothing to copy (on the calling thread's current
        stream), so no later launch loads a module (lazy loading may synchronize the context). Blocking
        (synchronizes that stream). Called by the constructor unless ``copy_path="memcpy"``.

        Any failure here (compile, load, launch) turns the kernel path off for good: it is logged, kept in
        :attr:`kernel_unavailable`, and ``copy_batch`` uses the memcpy path. Never raises for that reason.

        Returns:
            Whether the kernel path is available.
        """
        if not self._engine.available():
            return False
        return self._engine.warm_up(self._current_ptr("warm_up"))

    @property
    def kernel_unavailable(self) -> str | None:
        """Why the kernel path is off for good (compile, load or first launch failed), or None if it is not."""
        return self._engine.broken

    # -- clock and the device-level proof ---------------------------------------------------------------------
    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` (releases the GIL)."""
        time.sleep(max(seconds, 0.0))

    def prove_idle(self, streams: Sequence[Stream], deadline: float) -> bool:
        """The device-level proof (R13): a fresh event on each of ``streams`` (only those: the worker passes its
        compute stream first), polled strictly until ``deadline`` (at least once). Never a blocking device
        synchronize (R11). The events pass through the ledger and are destroyed before returning.

        Returns:
            True if all completed, False if the deadline passed first.

        Raises:
            DeviceError: the device failed while proving.
        """
        return record_and_poll(self, streams, deadline)


if TYPE_CHECKING:
    from kvoffload_ref.backends.base import Backend

    def _conforms(backend: CupyBackend) -> Backend:
        return backend  # mypy checks CupyBackend against the Backend protocol here
