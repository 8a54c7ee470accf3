"""Which copy path one batched submission takes: the rule the CuPy backend applies and the simulated device's
cost profiles model (one function, one set of thresholds).

Pure: no CuPy, no numpy, nothing of the package. ``_cupy_copy`` re-exports these names for the CuPy backend;
``_simcost`` calls :func:`choose_path` when a profile with copy paths prices a copy.

* ``"memcpy"``: one ``cudaMemcpyAsync`` per run of descriptors contiguous on both sides. Legal for any memory.
* ``"kernel"``: one gather/scatter kernel launch over all descriptors. Legal only when every descriptor lies in
  device memory or registered host memory the kernel may dereference.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["DEFAULT_KERNEL_MAX_MEAN_BYTES", "DEFAULT_KERNEL_MIN_COUNT", "CopyPath", "choose_path"]

CopyPath = Literal["auto", "kernel", "memcpy"]

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
