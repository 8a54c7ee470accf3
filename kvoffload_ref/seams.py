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

Which registrations a quarantine keeps (R29): :func:`touched` picks those whose bytes meet a row, in any tensor,
that an unproven copy may still touch; an unpinned region keeps those rows' pages instead (:func:`row_pages`), and
:func:`gaps` is the rest of the region, what may be unmapped.

Pure (no backend, no memory): these functions only compute address ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref.specs import TensorGeometry
from kvoffload_ref.validate import Int64Array, check_int

__all__ = ["DEFAULT_MAX_REGISTER_BYTES", "gaps", "register_chunks", "row_pages", "touched"]

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


def _row_spans(tensors: Sequence[TensorGeometry], rows: Int64Array) -> tuple[Int64Array, Int64Array]:
    """The ``[start, end)`` of row ``r`` of every tensor, for each ``r`` in ``rows`` (empty rows left out)."""
    starts = [g.ptr + rows * g.row_stride for g in tensors if g.row_bytes]
    ends = [s + g.row_bytes for s, g in zip(starts, (g for g in tensors if g.row_bytes), strict=True)]
    if not starts:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(starts).astype(np.int64), np.concatenate(ends).astype(np.int64)


def touched(registrations: Sequence[tuple[int, int]], tensors: Sequence[TensorGeometry],
            rows: Int64Array) -> list[bool]:
    """R29: for each registration ``(address, size)`` (disjoint, in address order), whether its bytes meet row
    ``r`` of any tensor for some ``r`` in ``rows``. One ``searchsorted`` per side, however many rows.

    Args:
        registrations: the region's registrations, sorted by address, disjoint.
        tensors: the region's CPU tensors.
        rows: CPU chunk ids (rows), each in ``[0, rows of every tensor)``.
    """
    if not registrations:
        return []
    starts = np.array([a for a, _ in registrations], dtype=np.int64)
    ends = starts + np.array([n for _, n in registrations], dtype=np.int64)
    lo, hi = _row_spans(tensors, rows)
    first = np.searchsorted(ends, lo, side="right")  # the first registration ending after the row's start
    past = np.searchsorted(starts, hi, side="left")  # how many begin before the row's end
    marks = np.zeros(len(registrations) + 1, dtype=np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, past, -1)
    kept: npt.NDArray[np.bool_] = np.cumsum(marks)[:-1] > 0
    return [bool(k) for k in kept.tolist()]


def row_pages(tensors: Sequence[TensorGeometry], rows: Int64Array, page: int) -> list[tuple[int, int]]:
    """R29, an unpinned region: the ``(start, end)`` of the pages holding row ``r`` of any tensor, for each ``r``
    in ``rows``, merged, in address order."""
    lo, hi = _row_spans(tensors, rows)
    if not lo.size:
        return []
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order] // page * page, -(-hi[order] // page) * page
    reach = np.maximum.accumulate(hi)
    new = np.ones(lo.size, dtype=np.bool_)
    new[1:] = lo[1:] > reach[:-1]
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:], lo.size) - 1
    return list(zip(lo[firsts].tolist(), reach[lasts].tolist(), strict=True))


def gaps(start: int, end: int, kept: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pieces of ``[start, end)`` outside every ``(start, end)`` range of ``kept`` (any order, may overlap),
    in address order: what a quarantine by registration may unmap (R29)."""
    pieces, low = [], start
    for a, b in sorted(kept):
        if a > low:
            pieces.append((low, min(a, end)))
        low = max(low, b)
    if low < end:
        pieces.append((low, end))
    return [(a, b) for a, b in pieces if a < b]
