"""Test helper for the CuPy backend: a transfer that never completes until the host says so.

:func:`enqueue_spin` queues a one-thread kernel that spins on ``volatile`` reads of an int in mapped pinned host
memory (``cudaHostAlloc(Portable | Mapped)``, device pointer from ``cudaPointerGetAttributes``) until the host
calls :meth:`SpinFlag.release`; everything queued behind it on that stream waits. The kernel writes
``flag.state`` = 1 when released, 2 if it gave up after ``timeout`` seconds of GPU time (``%globaltimer``), a
safety net so a failing test cannot hang the process. Launch it once in advance (:func:`warm_spin`): no module may
load while a spin runs (lazy loading may synchronize the context). Free a flag only after its kernel has ended.

Not part of the package: it reaches into the backend's private CUDA wrapper on purpose.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._cupy_runtime import HOST_ALLOC_FLAGS, host_words, loaded
from kvoffload_ref.backends.base import Event, Stream, poll_until
from kvoffload_ref.backends.cupy import CupyBackend

SPIN_KERNEL: Final = "kvoffload_spin"

SPIN_SOURCE: Final = r"""
__device__ __forceinline__ unsigned long long kv_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spins until the host sets flag[0] != 0 (then writes flag[1] = 1) or timeout_ns passes (flag[1] = 2;
// 0 = no timeout). flag lives in mapped pinned host memory.
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

_kernels: weakref.WeakKeyDictionary[CupyBackend, Any] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)
class SpinFlag:
    """Two int32 words in mapped pinned host memory: word 0 is the release flag the host sets; word 1 is the
    kernel's report (0 = not finished, 1 = released by the flag, 2 = gave up after its timeout)."""

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
        """0 = not finished, 1 = released by the flag, 2 = timed out (read after the kernel's event completed)."""
        if self.freed:
            raise RuntimeError("SpinFlag used after free_spin_flag()")
        return int(self.words[1])


def alloc_spin_flag(backend: CupyBackend) -> SpinFlag:
    """A zeroed flag in mapped pinned host memory (not in the ledger)."""
    cuda = backend._cuda
    with cuda("alloc_spin_flag"):
        host_ptr = int(cuda.rt.hostAlloc(64, HOST_ALLOC_FLAGS))
        dev_ptr = int(cuda.rt.pointerGetAttributes(host_ptr).devicePointer)
    words = host_words(host_ptr, 16, np.int32)
    words[:] = 0
    return SpinFlag(host_ptr, dev_ptr, words)


def free_spin_flag(backend: CupyBackend, flag: SpinFlag) -> None:
    """Free a flag (``cudaFreeHost``: BLOCKING, and only once the spin kernel has ended)."""
    if flag.freed:
        return
    with backend._cuda("free_spin_flag"):
        backend._cuda.rt.freeHost(flag.host_ptr)
    flag.freed = True


def enqueue_spin(backend: CupyBackend, stream: Stream, flag: SpinFlag, *, timeout: float = 30.0) -> None:
    """Queue the spin kernel on ``stream`` until ``flag.release()`` or ``timeout`` seconds of GPU time (0 = never)."""
    s = backend._stream(stream)
    function = _kernels.get(backend)
    if function is None:
        with backend._cuda("compile spin kernel"):
            function = loaded(backend._cp.RawModule(code=SPIN_SOURCE).get_function(SPIN_KERNEL))
        _kernels[backend] = function
    args = (np.uint64(flag.dev_ptr), np.uint64(int(timeout * 1e9)))
    with backend._cuda("enqueue_spin"):
        function((1, 1, 1), (1, 1, 1), args, stream=s)


def warm_spin(backend: CupyBackend) -> None:
    """Launch the spin kernel once, released in advance: no module may load while a spin runs (lazy loading)."""
    flag = alloc_spin_flag(backend)
    flag.release()
    stream, end = backend.create_stream(), backend.create_event()
    enqueue_spin(backend, stream, flag, timeout=5.0)
    backend.record(end, stream)
    backend.synchronize(end)
    if flag.state != 1:
        raise RuntimeError(f"the warm-up spin reported state {flag.state}")
    backend.destroy_event(end)
    backend.destroy_stream(stream)
    free_spin_flag(backend, flag)


def assert_quarantined_while_spinning(backend: CupyBackend, report: Any, flag: SpinFlag, spin_done: Event,
                                      deadline: float) -> None:
    """A shutdown under a spin that still runs: it timed out and quarantined, and the spin was really running
    (then it is released and must end within ``deadline`` seconds)."""
    assert report.region == "quarantined"
    assert report.device_sync == "timeout"
    assert backend.query(spin_done) is False, "the spin ended early: the test proved nothing"
    flag.release()
    assert poll_until(backend, lambda: backend.query(spin_done), backend.monotonic() + deadline)
    assert flag.state == 1, "the spin kernel timed out instead of being released"
