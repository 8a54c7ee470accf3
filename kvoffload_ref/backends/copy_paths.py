"""Which copy path one batched submission takes: the rule the CuPy backend applies and the simulated device's
cost profiles model (one function, one set of thresholds).

Pure: numpy only, no CuPy, nothing of the package. ``_cupy_copy`` re-exports these names for the CuPy backend;
``_simcost`` calls :func:`choose_path` and counts :func:`run_starts` when a profile with copy paths prices a copy.

* ``"memcpy"``: one ``cudaMemcpyAsync`` per run of descriptors contiguous on both sides (:func:`run_starts`); a
  run never crosses a registration seam (R25: the driver refuses a copy whose host span lies in two
  registrations; :func:`registration_seams`). Legal for any memory.
* ``"kernel"``: one gather/scatter kernel launch over all descriptors. Legal only when every descriptor lies in
  device memory or registered host memory the kernel may dereference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.errors import InvalidTransferError

__all__ = ["COPY_PATHS", "DEFAULT_KERNEL_MAX_MEAN_BYTES", "DEFAULT_KERNEL_MIN_COUNT", "CopyPath", "check_copy_path",
           "choose_path", "registration_seams", "run_starts"]

I64 = npt.NDArray[np.int64]

CopyPath = Literal["auto", "kernel", "memcpy"]
COPY_PATHS: Final[tuple[CopyPath, ...]] = ("auto", "kernel", "memcpy")


def check_copy_path(copy_path: object) -> CopyPath:
    """A backend's ``copy_path`` argument, checked (R7; one check and one message for every backend).

    Raises:
        InvalidTransferError: (a ValueError) not one of :data:`COPY_PATHS`.
    """
    for path in COPY_PATHS:
        if copy_path is path or (isinstance(copy_path, str) and copy_path == path):
            return path
    raise InvalidTransferError(f"copy_path must be 'auto', 'kernel' or 'memcpy'; got {copy_path!r}")

#: Thresholds for ``copy_path="auto"``, measured on an H200 (docs/gpu-check.md; scripts/gpu_bench.py's crossover:
#: the kernel wins or ties within 5 % in both directions from 16 descriptors of up to 1 MiB).
DEFAULT_KERNEL_MIN_COUNT: Final = 16
DEFAULT_KERNEL_MAX_MEAN_BYTES: Final = 1 << 20  # 1 MiB


def choose_path(copy_path: CopyPath, *, count: int, total_bytes: int, legal: bool,
                min_count: int = DEFAULT_KERNEL_MIN_COUNT,
                max_mean_bytes: int = DEFAULT_KERNEL_MAX_MEAN_BYTES) -> Literal["kernel", "memcpy"]:
    """The path of one submission.

    Args:
        copy_path: the backend's setting: ``"memcpy"`` never takes the kernel, ``"kernel"`` whenever legal,
            ``"auto"`` when legal, ``count >= min_count`` and the mean size ``<= max_mean_bytes``.
        count: number of descriptors.
        total_bytes: the sum of their sizes.
        legal: whether every descriptor lies where the kernel may read and write (on both sides).
        min_count: ``auto``'s minimum descriptor count.
        max_mean_bytes: ``auto``'s largest mean descriptor size.

    Returns:
        ``"kernel"`` or ``"memcpy"``.
    """
    if copy_path == "memcpy" or count == 0 or not legal:
        return "memcpy"
    if copy_path == "auto" and (count < min_count or total_bytes > count * max_mean_bytes):
        return "memcpy"
    return "kernel"


def registration_seams(registered: Iterable[tuple[int, int]]) -> I64:
    """Where registrations begin and end, sorted: the addresses a merged run must not cross (R25).

    Args:
        registered: each registered range as ``(start, end)``.

    Returns:
        The distinct starts and ends, sorted (int64).
    """
    bounds = {bound for start, end in registered for bound in (start, end)}
    return np.array(sorted(bounds), np.int64)


def run_starts(src: I64, dst: I64, sizes: I64, seams: I64 | None = None) -> npt.NDArray[np.intp]:
    """Where the memcpy path's runs begin: the indices of the descriptors that do not continue the previous one on
    both sides, or that start at a seam on either side (the first descriptor always begins one).

    Args:
        src, dst, sizes: the descriptors.
        seams: sorted addresses no run may cross (:func:`registration_seams`); None or empty: no seams.

    Returns:
        The sorted indices (empty for no descriptors).
    """
    if src.shape[0] <= 1:
        return np.zeros(src.shape[0], dtype=np.intp)
    breaks = (src[1:] != src[:-1] + sizes[:-1]) | (dst[1:] != dst[:-1] + sizes[:-1])
    if seams is not None and seams.size and not breaks.all():
        breaks |= _at(seams, src[1:]) | _at(seams, dst[1:])
    return np.concatenate(([0], np.flatnonzero(breaks) + 1))


def _at(sorted_values: I64, addrs: I64) -> npt.NDArray[np.bool_]:
    """Whether each of ``addrs`` is one of ``sorted_values``."""
    idx = np.minimum(np.searchsorted(sorted_values, addrs), sorted_values.size - 1)
    return sorted_values[idx] == addrs  # type: ignore[no-any-return]  # an array of bools
