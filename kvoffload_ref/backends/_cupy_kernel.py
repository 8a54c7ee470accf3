"""The CuPy backend's copy submissions: the kernel's compile, load and launch, and the memcpy runs.

:class:`CopyEngine` queues one submission on a stream by the path the backend chose (``_cupy_copy.choose_path``).
The kernel is compiled and loaded once, on first use (``cupy.RawModule``; NVRTC, cached on disk by CuPy). Any
failure to compile, load or first launch it turns the kernel path off for good: it is logged once, kept in
:attr:`CopyEngine.broken`, and every later submission takes the memcpy path.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._cupy_copy import (
    COPY_KERNEL,
    KERNEL_SOURCE,
    THREADS,
    coalesce,
    launch_grid,
    upload_in_one_copy,
)
from kvoffload_ref.backends._cupy_descriptors import DescriptorBlock
from kvoffload_ref.backends._cupy_runtime import MEMCPY_DEFAULT, MEMCPY_H2D, CudaCalls, CupyStream, loaded
from kvoffload_ref.backends.base import Tag
from kvoffload_ref.errors import CUDA_ERROR_UNKNOWN, DeviceError

__all__ = ["CopyEngine"]

_log = logging.getLogger("kvoffload_ref.backends.cupy")


class CopyEngine:
    """Queues copy submissions on a stream, by the memcpy path or the kernel path. Thread-safe.

    Args:
        cp: the ``cupy`` module (or a stand-in); its ``RawModule`` compiles the kernel.
        cuda: the backend's CUDA call wrapper.
    """

    def __init__(self, cp: Any, cuda: CudaCalls) -> None:
        self._cp = cp
        self._cuda = cuda
        self._lock = threading.Lock()
        self.module: Any = None  # Invariant: the compiled RawModule, once loaded.
        self._function: Any = None  # Invariant: the loaded copy kernel, once loaded.
        self._broken: str | None = None  # Invariant: why the kernel path is off for good, if it is.
        # Invariant: True once warm_up() launched the kernel (its module is loaded): only then does copy_batch take
        # the kernel path, so no submission under a worker's lock loads a module (which may synchronize, R11).
        self.warmed = False

    @property
    def broken(self) -> str | None:
        """Why the kernel path is off for good (compile, load or first launch failed), or None if it is not."""
        return self._broken

    def available(self) -> bool:
        """Compile and load the kernel if needed. Never raises.

        Returns:
            Whether the kernel path is available (False, logged once, if compiling or loading failed).
        """
        try:
            self.kernel()
        except DeviceError:
            return False
        return True

    def kernel(self) -> Any:
        """The loaded copy kernel (compiled and loaded on first use).

        Raises:
            DeviceError: the kernel path is unavailable (status 999; the original error as ``__cause__``).
        """
        with self._lock:
            if self._function is not None:
                return self._function
            if self._broken is None:
                try:
                    with self._cuda("compile kernels"):
                        module = self._cp.RawModule(code=KERNEL_SOURCE)
                        # RawModule.get_function returns a RawKernel; its .kernel (a cupy.cuda.Function) forces
                        # the compile and load now, and launches with less overhead.
                        function = loaded(module.get_function(COPY_KERNEL))
                except Exception as exc:  # CompileException, a missing libnvrtc, a PTX the driver rejects, ...
                    self.disable(exc)
                    raise DeviceError(f"kernel path unavailable: {self._broken}", CUDA_ERROR_UNKNOWN) from exc
                self.module, self._function = module, function
                return function
        raise DeviceError(f"kernel path unavailable: {self._broken}", CUDA_ERROR_UNKNOWN)

    def disable(self, exc: BaseException) -> None:
        """Turn the kernel path off for good because of ``exc`` (logged)."""
        self._broken = f"{type(exc).__name__}: {exc}"
        _log.warning("CuPy backend: copy kernel unavailable, using memcpy only: %s", self._broken)

    def warm_up(self, stream_ptr: int) -> bool:
        """Load the kernel and launch it once with nothing to copy on ``stream_ptr``, then synchronize that stream
        (blocking), so no later launch loads a module. Any failure turns the kernel path off; never raises for it.

        Returns:
            Whether the kernel path is available.
        """
        if not self.available():
            return False
        try:
            with self._cuda("warm_up"):
                zero = np.uint64(0)
                self._function((1, 1, 1), (THREADS, 1, 1), (zero, zero, zero, np.int64(0)),
                               stream=CupyStream(stream_ptr, owned=False))
                self._cuda.rt.streamSynchronize(stream_ptr)
        except Exception as exc:
            self.disable(exc)
            return False
        self.warmed = True
        return True

    def memcpy(self, s: CupyStream, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
               sizes: npt.NDArray[np.int64], tag: Tag | None, seams: npt.NDArray[np.int64] | None = None) -> None:
        """One ``cudaMemcpyAsync(cudaMemcpyDefault)`` per run of descriptors contiguous on both sides, no run
        crossing one of ``seams`` (the registration bounds, R25).

        Raises:
            DeviceError: a call failed (the copies queued before it still run).
        """
        runs_src, runs_dst, runs_size = coalesce(src, dst, sizes, seams)
        memcpy = self._cuda.rt.memcpyAsync
        with self._cuda("copy_batch (memcpy)", tag):
            for d, a, n in zip(runs_dst.tolist(), runs_src.tolist(), runs_size.tolist(), strict=True):
                if n:
                    memcpy(d, a, n, MEMCPY_DEFAULT, s.ptr)

    def launch(self, s: CupyStream, block: DescriptorBlock, count: int, max_size: int, tag: Tag | None) -> None:
        """Upload the first ``count`` descriptors to the block's device twin and launch the kernel once.

        Raises:
            DeviceError: the kernel is unavailable, or an upload or the launch failed.
        """
        function = self.kernel()
        rt = self._cuda.rt
        word = 8 * block.slots
        dev = block.dev_ptr
        args = (np.uint64(dev), np.uint64(dev + word), np.uint64(dev + 2 * word), np.int64(count))
        with self._cuda("copy_batch (kernel)", tag):
            if upload_in_one_copy(block.slots, count):
                rt.memcpyAsync(dev, block.host_ptr, 3 * word, MEMCPY_H2D, s.ptr)
            else:
                for part in range(3):
                    rt.memcpyAsync(dev + part * word, block.host_ptr + part * word, 8 * count, MEMCPY_H2D, s.ptr)
            function(launch_grid(count, max_size), (THREADS, 1, 1), args, stream=s)
