"""Quarantine by registration (R29): what a quarantined region gives back of itself, and how, platform by platform.

At shutdown (R12) a region that cannot be proven idle is kept until process exit -- but only the part an unproven
copy may still touch needs keeping: the registrations (R25's chunks, as ``HostRegion.pin`` made them) whose bytes
meet a row, in any tensor, of the CPU chunks an unproven copy names (``DirectionHandlerAPI.unproven_chunks``).
:func:`give_back_unkept` gives back the rest, in R3's order:

1. unregister every other registration, newest first (a failure is logged and the range leaked, R16; its pages
   stay mapped: memory the driver may still have pinned is never given back);
2. give back the pages outside the kept registrations and the leaked ones, piece by piece: announce each piece to
   the backend (``untrack_host_pages`` where the backend offers it: the sim's page-granular unmap, which flags
   any copy that still touches the piece), then release its memory with ``madvise(MADV_DONTNEED)``.

What "unmap" means per platform: Python cannot unmap part of an ``mmap.mmap``, so the mapping itself stays (one
ledger "mapping", quarantined) and its pages outside the kept ranges are released with ``MADV_DONTNEED``: on Linux
an anonymous private mapping's pages go back to the system at once and read as zeros from then on (the address
range stays valid, so no stray pointer can fault). Where ``mmap.MADV_DONTNEED`` does not exist (Windows) nothing
is given back but the registrations: the whole mapping stays, and the report's kept ranges say so. An unpinned
(pageable) region has no registrations: it keeps the pages holding the rows instead (the page is the unit of
unmapping). A shared region (``shared_region.py``) keeps its whole mapping; see docs/shared-region.md.

Imports nothing of the region: it works on what a region holds through :class:`Holdings`.
"""

from __future__ import annotations

import functools
import logging
import mmap
from collections.abc import Container, Iterable, Sequence
from typing import Protocol

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.errors import DeviceError, InvalidTransferError
from kvoffload_ref.results import KeptRange
from kvoffload_ref.seams import gaps, row_pages, touched
from kvoffload_ref.shield import Shield
from kvoffload_ref.specs import TensorGeometry
from kvoffload_ref.validate import Int64Array, check_id_array, check_int

__all__ = ["NOT_GIVEN_BACK", "Holdings", "give_back_unkept", "kept_ranges", "rows_to_keep"]

logger = logging.getLogger("kvoffload_ref.region")

#: The reason of a kept range that holds no row an unproven copy may touch: a step giving it back failed (an
#: unregister, leaked, R16; an unmap), so it stays mapped; the report's errors say which.
NOT_GIVEN_BACK = "could not be given back (a release step failed; see the report's errors)"


class Holdings(Protocol):
    """What a region holds (``region_held.Held``), as far as giving part of it back needs."""

    backend: Backend
    mmap: mmap.mmap | None
    ptr: int
    nbytes: int
    pinned: dict[int, int]
    log_rank: int

    def unpin_or_leak(self, shield: Shield,
                      only: Container[int] | None = None) -> tuple[list[str], list[tuple[int, int]]]: ...


def rows_to_keep(chunks: Iterable[int], num_rows: int) -> Int64Array | None:
    """The chunk ids (rows) a quarantine keeps, sorted; None -- keep the whole region -- for ids that are not
    ints in ``[0, num_rows)`` (logged, never raised: a quarantine is a shutdown step and must never keep too
    little)."""
    try:
        rows = check_id_array("chunks", sorted(chunks), noun="chunk ids")
        check_int("chunk id", int(rows[-1]) if rows.size else 0, maximum=num_rows - 1)
    except (InvalidTransferError, TypeError) as exc:
        logger.error("Quarantine: %s; keeping the whole region", exc)
        return None
    return rows


def give_back_unkept(held: Holdings, tensors: Sequence[TensorGeometry], rows: Int64Array, shield: Shield,
                     given_back: list[tuple[int, int]]) -> list[str]:
    """R29: give back every part of the region but what holds ``rows`` (see the module docstring).

    Args:
        held: what the region holds; its pins and leaks are updated in place.
        tensors: the region's CPU tensors.
        rows: the CPU chunk ids an unproven copy may still touch (non-empty, each in range).
        shield: collects interrupts (R14): each backend call is retried; an interrupt past the retries propagates
            and what was not given back yet stays kept.
        given_back: receives each ``(start, end)`` address range given back (announced and released), in order.

    Returns:
        Descriptions of the steps that failed (each also logged).
    """
    if held.pinned:
        failures, stay = _unregister_unkept(held, tensors, rows, shield)
    else:  # pageable: nothing registered; the pages holding the rows stay
        failures, stay = [], row_pages(tensors, rows, mmap.PAGESIZE)
    if held.mmap is None or getattr(mmap, "MADV_DONTNEED", None) is None:
        return failures  # the platform cannot give back part of a mapping: the whole mapping stays
    for start, end in gaps(held.ptr, held.ptr + held.nbytes, stay):
        failure = _give_back_pages(held, start, end, shield)
        if failure is None:
            given_back.append((start, end))
        else:
            failures.append(failure)
    return failures


def _unregister_unkept(held: Holdings, tensors: Sequence[TensorGeometry], rows: Int64Array,
                       shield: Shield) -> tuple[list[str], list[tuple[int, int]]]:
    """R3 step 1 for the registrations no row of ``rows`` meets; returns (failures, what stays mapped)."""
    registrations = sorted(held.pinned.items())
    drop = {ptr for (ptr, _), keep in zip(registrations, touched(registrations, tensors, rows), strict=True)
            if not keep}
    failures, leaked = held.unpin_or_leak(shield, drop)  # a failed unregister: leaked (R16), its pages stay
    stay = [(ptr, ptr + size) for ptr, size in (*held.pinned.items(), *leaked)]
    return failures, stay


def _give_back_pages(held: Holdings, start: int, end: int, shield: Shield) -> str | None:
    """R3 step 3 for the pages ``[start, end)``: announce them unmapped, then release their memory. Returns what
    failed (the pages then stay mapped and kept), or None."""
    untrack = getattr(held.backend, "untrack_host_pages", None)
    try:
        if untrack is not None:
            shield.run(functools.partial(untrack, start, end - start))
    except DeviceError as exc:
        logger.warning("Unmapping [%#x, %#x) of the region failed for rank=%d (code=%d); those pages stay kept",
                       start, end, held.log_rank, exc.status)
        return f"unmap of [{start:#x}, {end:#x}) failed (status {exc.status})"
    assert held.mmap is not None  # Invariant: checked by the caller; a quarantine never closes the mapping
    try:
        held.mmap.madvise(mmap.MADV_DONTNEED, start - held.ptr, end - start)
    except OSError as exc:  # the pages stay mapped (and kept); the device was told they are gone: none is used
        logger.warning("Releasing [%#x, %#x) of the region failed for rank=%d: %s", start, end, held.log_rank, exc)
        return f"madvise of [{start:#x}, {end:#x}) failed: {exc}"
    return None


def kept_ranges(ptr: int, nbytes: int, tensors: Sequence[TensorGeometry], rows: Int64Array | None,
                given_back: Sequence[tuple[int, int]], reason: str) -> tuple[KeptRange, ...]:
    """R29: what a quarantine keeps of the region ``[ptr, ptr + nbytes)``: every maximal range not given back, as
    (offset, length), with ``reason`` if it holds a row of ``rows`` (None: every row), else :data:`NOT_GIVEN_BACK`.
    """
    kept = gaps(ptr, ptr + nbytes, given_back)
    holds = [True] * len(kept) if rows is None else touched([(a, b - a) for a, b in kept], tensors, rows)
    return tuple(KeptRange(a - ptr, b - a, reason if held else NOT_GIVEN_BACK)
                 for (a, b), held in zip(kept, holds, strict=True))
