"""Where a host region's registrations begin and end (R25): chunks of at most a cap, seams on row boundaries.

One ``cudaHostRegister`` of a very large range fails on current drivers (vLLM #51080: at 512 GiB and above, whatever
memory is free), so a region is registered in chunks of at most ``max_register_bytes`` (64 GiB by default, as vLLM
#51081). The driver refuses a copy whose host span lies in two registrations, so no CPU row may straddle a seam:
every seam lies outside every row of every CPU tensor of the region (on a row boundary, or in the padding between
rows or between tensors). Seams are also page-aligned, because registrations are page-granular and two of them must
never share a page.

The chunk ending at a seam is the longest one that fits in the cap. When no position within the cap is a seam (a
single row larger than the cap, or rows whose boundaries rarely meet a page boundary), the chunk runs on to the
first position that is one: a row larger than the cap is registered whole, never split.

Pure (no backend, no memory): :func:`register_chunks` only computes ``(address, size)`` pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvoffload_ref.specs import TensorGeometry
from kvoffload_ref.validate import check_int

__all__ = ["DEFAULT_MAX_REGISTER_BYTES", "register_chunks"]

#: vLLM #51081 registers at most 64 GiB per cudaHostRegister call (one call of 512 GiB or more fails).
DEFAULT_MAX_REGISTER_BYTES: Final = 64 << 30


def _row_holding(addr: int, g: TensorGeometry) -> int | None:
    """The start of the row of ``g`` that holds ``addr`` strictly inside it (not at its start), or None."""
    off = addr - g.ptr
    if off <= 0:
        return None
    i = off // g.row_stride
    if i >= g.rows:
        return None
    start = g.ptr + i * g.row_stride
    return start if 0 < addr - start < g.row_bytes else None


def _seam_at_or_below(limit: int, low: int, tensors: Sequence[TensorGeometry], page: int) -> int | None:
    """The largest seam in (``low``, ``limit``], or None."""
    addr = limit // page * page
    while addr > low:
        moved = False
        for g in tensors:
            start = _row_holding(addr, g)
            if start is not None:  # inside a row: the seam can be no later than the row's start
                addr, moved = start // page * page, True
        if not moved:
            return addr
    return None


def _seam_above(limit: int, high: int, tensors: Sequence[TensorGeometry], page: int) -> int:
    """The smallest seam in (``limit``, ``high``] (``high``, the region's end, always is one)."""
    addr = -(-(limit + 1) // page) * page
    while addr < high:
        moved = False
        for g in tensors:
            start = _row_holding(addr, g)
            if start is not None:  # inside a row: the seam can be no earlier than the row's end
                addr, moved = -(-(start + g.row_bytes) // page) * page, True
        if not moved:
            return addr
    return high


def register_chunks(ptr: int, nbytes: int, tensors: Sequence[TensorGeometry], max_register_bytes: int,
                    page: int) -> list[tuple[int, int]]:
    """The ``(address, size)`` of each registration of ``[ptr, ptr + nbytes)``, in address order (R25).

    Args:
        ptr: the region's first byte (page-aligned).
        nbytes: the region's size (its end is the last seam).
        tensors: the region's CPU tensors (rows inside ``[ptr, ptr + nbytes)``); no seam falls inside a row.
        max_register_bytes: the most bytes per registration (an int >= 1), exceeded only where no seam lies
            within it (a row larger than it is registered whole).
        page: the page size (every seam but the region's end is a multiple of it).

    Returns:
        Contiguous chunks covering the region exactly once.

    Raises:
        InvalidTransferError: ``max_register_bytes`` is not an int >= 1 (R7).
    """
    cap = check_int("max_register_bytes", max_register_bytes, minimum=1)
    end = ptr + nbytes
    chunks: list[tuple[int, int]] = []
    low = ptr
    while low < end:
        if end - low <= cap:
            high = end
        else:
            below = _seam_at_or_below(low + cap, low, tensors, page)
            high = below if below is not None else _seam_above(low + cap, end, tensors, page)
        chunks.append((low, high - low))
        low = high
    return chunks
