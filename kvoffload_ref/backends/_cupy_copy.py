"""The CuPy backend's copy paths: the gather/scatter kernel source, the span set that says where the kernel may
read and write, and the coalescing of contiguous runs. The choice between the kernel and one ``cudaMemcpyAsync``
per run, and its thresholds, live in :mod:`kvoffload_ref.backends.copy_paths` (re-exported here), which the
simulated device's cost profiles call too.

Pure: numpy only, no CuPy and no CUDA call, so every decision here is testable without a GPU. The backend
(``kvoffload_ref.backends.cupy``) owns the state (the spans, the thresholds) and issues the CUDA calls.

* ``"memcpy"``: one ``cudaMemcpyAsync(kind=cudaMemcpyDefault)`` per run of descriptors that are contiguous on both
  sides (:func:`coalesce`). Legal for any memory, pinned or not. A run never crosses a registration seam (R25: the
  driver refuses a copy whose host span lies in two registrations; :func:`registration_seams`).
* ``"kernel"``: the descriptor words are uploaded to a device twin of the descriptor buffer, then one launch of
  ``kvoffload_copy_batch`` copies every descriptor, with 16-byte vector accesses when a descriptor's addresses and
  size allow it (else 8, 4 or 1 byte). The kernel dereferences host pointers directly, which is legal only for
  *registered* host memory whose device pointer equals its host pointer, so it is chosen only when every
  descriptor lies inside a :class:`SpanSet` interval (registered ranges and device arrays the backend has seen).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.copy_paths import (
    DEFAULT_KERNEL_MAX_MEAN_BYTES,
    DEFAULT_KERNEL_MIN_COUNT,
    CopyPath,
    choose_path,
    registration_seams,
    run_starts,
)

__all__ = [
    "DEFAULT_KERNEL_MAX_MEAN_BYTES",
    "DEFAULT_KERNEL_MIN_COUNT",
    "KERNEL_SOURCE",
    "CopyPath",
    "SpanSet",
    "choose_path",
    "coalesce",
    "launch_grid",
    "registration_seams",
    "upload_in_one_copy",
]

I64 = npt.NDArray[np.int64]

#: The copy kernel's name in :data:`KERNEL_SOURCE`.
COPY_KERNEL: Final = "kvoffload_copy_batch"

# Kernel launch geometry: 256 threads x 16 bytes x 4 unrolled loads = 16 KiB per block per round.
THREADS: Final = 256
_BYTES_PER_BLOCK_ROUND: Final = THREADS * 16 * 4
_MAX_GRID_X: Final = 1024
_MAX_GRID_Y: Final = 65535
# Descriptor upload: one copy of the whole buffer if it is small or mostly used, else three copies of ``count``.
_SINGLE_UPLOAD_MAX_BYTES: Final = 64 * 1024
#: The smallest descriptor block (slots per array).
MIN_DESCRIPTOR_SLOTS: Final = 16

#: The copy kernel (CUDA C++, compiled by CuPy with NVRTC when the backend warms up).
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
"""


class SpanSet:
    """Address ranges the copy kernel may dereference, merged into sorted disjoint intervals; and the seams of all
    registrations (R25), which the memcpy path merges no run across.

    Not thread-safe; the backend holds its lock around every use.
    """

    def __init__(self) -> None:
        # Invariant: _pinned maps a registered range's start to its end (only ranges whose device pointer equals
        # the host pointer); _device maps a seen device array's start to the largest end seen for it.
        self._pinned: dict[int, int] = {}
        self._device: dict[int, int] = {}
        # Invariant: _registered maps every registered range's start to its end (kernel-usable or not); seams is
        # registration_seams of its items, rebuilt (a new array, never changed in place) whenever it changes.
        self._registered: dict[int, int] = {}
        self.seams: I64 = registration_seams(())
        # Invariant: the union of both dicts' intervals, merged; _starts sorted, _ends[i] the end of interval i.
        self._starts: npt.NDArray[np.int64] = np.empty(0, np.int64)
        self._ends: npt.NDArray[np.int64] = np.empty(0, np.int64)
        # Invariant: the same for _registered and _device: memory a cudaMemcpyAsync reaches without blocking the
        # host (device memory, page-locked host memory); anything else is taken as pageable (R11).
        self._locked_starts: npt.NDArray[np.int64] = np.empty(0, np.int64)
        self._locked_ends: npt.NDArray[np.int64] = np.empty(0, np.int64)

    def add_pinned(self, start: int, end: int, *, kernel: bool = True) -> None:
        """Add a registered host range: its bounds become seams; with ``kernel`` (its device pointer equals its
        host pointer) the kernel may dereference it."""
        self._registered[start] = end
        self.seams = registration_seams(self._registered.items())
        if kernel:
            self._pinned[start] = end
        self._rebuild()

    def discard_pinned(self, start: int) -> None:
        """Remove the registered range that starts at ``start`` (no-op if there is none)."""
        if self._registered.pop(start, None) is not None:
            self.seams = registration_seams(self._registered.items())
        self._pinned.pop(start, None)
        self._rebuild()

    def add_device(self, start: int, end: int) -> None:
        """Add (or widen) a device array's range."""
        if end > self._device.get(start, start):
            self._device[start] = end
            self._rebuild()

    def _rebuild(self) -> None:
        self._starts, self._ends = _merged([*self._pinned.items(), *self._device.items()])
        self._locked_starts, self._locked_ends = _merged([*self._registered.items(), *self._device.items()])

    def contains_all(self, addrs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]) -> bool:
        """Whether every ``[addrs[i], addrs[i] + sizes[i])`` lies inside one interval the kernel may dereference."""
        return _inside(self._starts, self._ends, addrs, sizes)

    def first_pageable(self, addrs: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]) -> int | None:
        """The first ``i`` whose ``[addrs[i], addrs[i] + sizes[i])`` is not inside device memory or one registered
        (page-locked) host range -- pageable memory, as far as this set knows -- or None if there is none (R11: a
        ``cudaMemcpyAsync`` to or from pageable memory blocks the calling thread)."""
        if _inside(self._locked_starts, self._locked_ends, addrs, sizes):
            return None
        if self._locked_starts.size == 0:
            return 0
        idx = np.searchsorted(self._locked_starts, addrs, side="right") - 1
        inside = (idx >= 0) & (addrs + sizes <= self._locked_ends[np.maximum(idx, 0)])
        return int(np.flatnonzero(~inside)[0])


def _merged(items: list[tuple[int, int]]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Intervals ``(start, end)`` merged into sorted disjoint ones: (starts, ends)."""
    merged: list[list[int]] = []
    for start, end in sorted(items):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return np.array([m[0] for m in merged], np.int64), np.array([m[1] for m in merged], np.int64)


def _inside(starts: npt.NDArray[np.int64], ends_of: npt.NDArray[np.int64], addrs: npt.NDArray[np.int64],
            sizes: npt.NDArray[np.int64]) -> bool:
    """Whether every ``[addrs[i], addrs[i] + sizes[i])`` lies inside one of the sorted disjoint intervals."""
    if addrs.size == 0:
        return True
    if starts.size == 0:
        return False
    ends = addrs + sizes
    # Fast path: the whole batch inside the interval that holds its lowest address.
    i = int(np.searchsorted(starts, addrs.min(), side="right")) - 1
    if i >= 0 and int(ends.max()) <= int(ends_of[i]):
        return True
    idx = np.searchsorted(starts, addrs, side="right") - 1
    if bool((idx < 0).any()):
        return False
    return bool((ends <= ends_of[idx]).all())


def launch_grid(count: int, max_size: int) -> tuple[int, int, int]:
    """The copy kernel's grid: x splits the largest descriptor (16 KiB per block, at most 1024), y strides over
    the descriptors (at most 65535)."""
    grid_x = min(_MAX_GRID_X, max(1, -(-max_size // _BYTES_PER_BLOCK_ROUND)))
    return grid_x, min(count, _MAX_GRID_Y), 1


def upload_in_one_copy(slots: int, count: int) -> bool:
    """Whether the descriptor words go up in one copy of the whole block (small or mostly used), rather than
    three copies of ``count`` words."""
    return 3 * 8 * slots <= _SINGLE_UPLOAD_MAX_BYTES or 2 * count >= slots


def coalesce(src: I64, dst: I64, sizes: I64, seams: I64 | None = None) -> tuple[I64, I64, I64]:
    """Merge runs of descriptors that are contiguous on both sides into single copies.

    Args:
        src: source addresses.
        dst: destination addresses.
        sizes: sizes in bytes.
        seams: sorted addresses no run may cross (:func:`registration_seams`; R25): a descriptor that starts at
            one, on either side, starts a new run. None: no seams.

    Returns:
        ``(src, dst, sizes)`` of the runs.
    """
    if src.shape[0] <= 1:
        return src, dst, sizes
    starts = run_starts(src, dst, sizes, seams)
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)
