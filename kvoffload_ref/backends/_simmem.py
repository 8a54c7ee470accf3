"""The simulated device's memory: the address map of live spans and pinned ranges, and descriptor words.

Theory of operation
-------------------
*Spans.* Device arrays and tracked host mappings are *spans*: [start, end) address ranges, each with a writeable
1-D uint8 numpy view of exactly its bytes. :class:`Memory` keeps them (and the pinned ranges) with cached sorted
indexes; a copy's descriptors are resolved against them vectorized (``np.searchsorted``) when the copy starts,
giving a :class:`CopyPlan`. The sim never touches an address outside a live span. Which spans can make a copy
slow (host mappings that no one pinned range holds whole) is cached too: when there is none, pricing looks at
no descriptor's pinning.

*Copies.* The copy engine that moves a plan's bytes -- every source read before any destination is written -- is
``_simcopy.py`` (:class:`CopyPlan`, :class:`SmallPlan`), and ``_simsized.py`` for a copy of many descriptors of
one size, few per span pair (:class:`SizedPlan`: a one-block job over many layers), resolved in one pass.

*Descriptor words.* Descriptor buffers are host memory outside the address map: :class:`DescriptorWords` carves
small buffers' three rows out of shared zeroed blocks, so that a buffer is three views and nothing more.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simcopy import (
    EACH_MAX_PER_PAIR,
    SMALL_BATCH,
    CopyPlan,
    Grids,
    Move,
    Moves,
    SmallPlan,
    Span,
    byte_views,
)
from kvoffload_ref.backends._simsized import ByCount, Plan, SizedPlan, by_count, sized_plan
from kvoffload_ref.backends.copy_paths import registration_seams
from kvoffload_ref.errors import InvalidTransferError

__all__ = [
    "EACH_MAX_PER_PAIR", "SMALL_BATCH", "CopyPlan", "DescriptorWords", "Intervals", "Memory", "Plan", "SizedPlan",
    "SmallPlan", "Span", "address", "host_view",
]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]

#: int64 words per shared block of descriptor words (4 KiB); buffers needing more than a quarter of one get
#: their own array, so a block that one live buffer keeps alive wastes at most 4 KiB.
DESCRIPTOR_BLOCK_WORDS: Final = 512


class Intervals:
    """An immutable, sorted set of disjoint [start, end) ranges with containment lookup."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        pairs = sorted(ranges)
        # Invariant: the same sorted bounds as Python lists (scalar lookups) and int64 arrays (vectorized ones).
        self.firsts = [a for a, _ in pairs]
        self._last = [b for _, b in pairs]
        self.starts: I64 = np.array(self.firsts, dtype=np.int64)
        self.ends: I64 = np.array(self._last, dtype=np.int64)
        # Invariant: _end_by_count[c] == ends[c - 1] for c >= 1 (find reads it by how many ranges start at or
        # before an address); [0] is a placeholder (no range there: find answers -1 whatever it reads).
        self._end_by_count: I64 = np.concatenate((np.zeros(1, dtype=np.int64), self.ends))

    def find(self, addr: I64, size: I64, *, sized: bool = False) -> npt.NDArray[np.intp]:
        """Index of the range holding each [addr, addr+size) whole, or -1 (also for a negative size; ``sized``:
        the caller knows that no size is negative, so none is compared with 0)."""
        if addr.size <= SMALL_BATCH:
            found = [self.find_one(a, n) for a, n in zip(addr.tolist(), size.tolist(), strict=True)]
            return np.array(found, dtype=np.intp)
        if not self.firsts:
            return np.full(addr.shape, -1, dtype=np.intp)
        count = self.starts.searchsorted(addr, side="right")   # range count - 1 is the candidate, if count >= 1
        room = self._end_by_count.take(count) - addr   # no overflow where count >= 1: addr >= a start there
        fits = size <= room if sized else (size >= 0) & (size <= room)
        held: npt.NDArray[np.intp] = count * fits - 1   # count 0: -1 whatever room is
        return held

    def moves(self, src: list[int], dst: list[int], sizes: list[int]) -> Moves:
        """Each descriptor as a :data:`Move`: (range holding the source whole or -1, the same for the destination,
        size, offset of the source into its range, of the destination into its; an offset is -1 where the range
        is -1), with what the checks read of them (:data:`Moves`). Scalar lookups, for a few descriptors."""
        firsts, lasts, live, bad = self.firsts, self._last, 0, None
        out: list[Move] = []
        right = bisect.bisect_right
        for a, b, n in zip(src, dst, sizes, strict=True):
            i = right(firsts, a) - 1
            j = right(firsts, b) - 1
            if i >= 0 and 0 <= n <= lasts[i] - a:
                so = a - firsts[i]
            else:
                i = so = -1
            if j >= 0 and 0 <= n <= lasts[j] - b:
                do = b - firsts[j]
            else:
                j = do = -1
            if n > 0:
                live += n
                if (i < 0 or j < 0) and bad is None:
                    bad = len(out)
            elif n and bad is None:   # a negative size lies in no span (an empty copy touches nothing)
                bad = len(out)
            out.append((i, j, n, so, do))
        return out, live, bad

    def find_one(self, addr: int, size: int) -> int:
        """Scalar :meth:`find`."""
        i = bisect.bisect_right(self.firsts, addr) - 1
        return i if i >= 0 and 0 <= size <= self._last[i] - addr else -1

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """Indices of the ranges intersecting [lo, hi)."""
        return [i for i, (a, b) in enumerate(zip(self.firsts, self._last, strict=True)) if a < hi and b > lo]



class _SpanIndex(NamedTuple):
    """A snapshot of the live spans, sorted by address."""

    intervals: Intervals
    spans: list[Span]
    # Invariant: data[k] is spans[k].data; views[k] a byte memoryview of it (byte_views).
    data: list[Bytes]
    views: list[memoryview]
    # Invariant: the grid views the copies over these spans made of their data (CopyPlan.grids).
    grids: Grids
    # Invariant: the same spans indexed by how many start at or before an address (what sized_plan reads).
    by_count: ByCount


class Memory:
    """The address map: live spans and pinned ranges, with cached sorted indexes for lookup."""

    def __init__(self) -> None:
        # Invariant: start -> span for every live span; spans never overlap.
        self._spans: dict[int, Span] = {}
        # Invariant: start of a host span that is a piece of a larger mapping (what untrack_host_pages left of it)
        # -> that mapping's start (its ledger key); a span without an entry is a whole mapping (R29).
        self.mapping_of: dict[int, int] = {}
        # Invariant: start -> end for every pinned range; each lies in a host mapping when pinned; none overlap.
        self.pinned: dict[int, int] = {}
        # Invariant: caches of sorted indexes over _spans / pinned; None when stale.
        self._span_index: _SpanIndex | None = None
        self._pin_index: Intervals | None = None
        self._seams: I64 | None = None  # registration_seams of pinned (R25); None when stale
        # Invariant: None when stale (spans or pins changed); else, per span of _index() plus a trailing False
        # (what index -1, no span, reads), whether it is a host mapping that no one pinned range holds whole:
        # only a copy touching such a span can have slow bytes. _any_slow: whether any span is one (when fresh).
        self._slow: npt.NDArray[np.bool_] | None = None
        self._any_slow = False

    def add(self, span: Span) -> None:
        """Add a span. Raises InvalidTransferError if it overlaps a live one."""
        index = self._index()
        clash = index.intervals.overlapping(span.start, span.end)
        if clash:
            other = index.spans[clash[0]]
            raise InvalidTransferError(f"ptr, nbytes: the range [{span.start:#x}, {span.end:#x}) overlaps live memory "
                                       f"[{other.start:#x}, {other.end:#x}): expected a range outside it (e.g. "
                                       f"ptr={max(other.end, span.start):#x})")
        self._spans[span.start] = span
        self._span_index = self._slow = None

    def remove(self, start: int) -> None:
        """Forget the span starting at ``start``."""
        del self._spans[start]
        self.mapping_of.pop(start, None)
        self._span_index = self._slow = None

    def mapping_pieces(self, mapping: int) -> list[Span]:
        """The host spans left of the mapping tracked at ``mapping`` (itself whole, or its pieces), by address."""
        return sorted((s for start, s in self._spans.items() if s.is_host and self.mapping_of.get(start, start) ==
                       mapping), key=lambda s: s.start)

    def cut(self, lo: int, hi: int) -> Span | None:
        """Forget ``[lo, hi)`` of the host span holding it whole (R29: a page-granular unmap); what is left of the
        span stays live as up to two pieces of the same mapping. Returns the span cut, or None (nothing changed)
        when no host span holds the range whole."""
        span = self.span_holding(lo, hi - lo)
        if span is None or not span.is_host:
            return None
        mapping = self.mapping_of.pop(span.start, span.start)
        del self._spans[span.start]
        for a, b in ((span.start, lo), (hi, span.end)):
            if a < b:
                self._spans[a] = Span(a, b, True, span.data[a - span.start: b - span.start])
                self.mapping_of[a] = mapping
        self._span_index = self._slow = None
        return span

    def host_span_at(self, start: int) -> Span | None:
        """The host mapping starting exactly at ``start``."""
        span = self._spans.get(start)
        return span if span is not None and span.is_host else None

    def span_holding(self, addr: int, size: int) -> Span | None:
        """The live span holding [addr, addr+size) whole, or None."""
        index = self._index()
        idx = index.intervals.find_one(addr, size)
        return index.spans[idx] if idx >= 0 else None

    def pin(self, start: int, end: int) -> None:
        self.pinned[start] = end
        self._pin_index = self._seams = self._slow = None

    def unpin(self, start: int) -> int:
        """Unpin the range at ``start``; returns its end."""
        self._pin_index = self._seams = self._slow = None
        return self.pinned.pop(start)

    def seams(self) -> I64:
        """Where the pinned ranges begin and end, sorted: the seams no memcpy run crosses (R25)."""
        if self._seams is None:
            self._seams = registration_seams(self.pinned.items())
        return self._seams

    def pins_overlapping(self, lo: int, hi: int) -> list[int]:
        """Starts of the pinned ranges intersecting [lo, hi)."""
        index = self._pins()
        return [int(index.starts[i]) for i in index.overlapping(lo, hi)]

    def first_crossing(self, addr: I64, sizes: I64) -> tuple[int, int, int] | None:
        """The first non-empty range among [addr, addr+sizes) that meets two or more pinned ranges (R25: a copy
        spanning two registrations), as (descriptor index, start of the first pinned range it meets, start of the
        next one); None when there is none (at once when at most one range is pinned)."""
        if len(self.pinned) <= 1 or addr.size == 0:
            return None
        index = self._pins()
        first = np.searchsorted(index.ends, addr, side="right")   # the first pinned range ending after addr
        beyond = np.searchsorted(index.starts, addr + sizes, side="left")   # how many start before the end
        crossing = (beyond - first >= 2) & (sizes > 0)
        if not crossing.any():
            return None
        k = int(crossing.argmax())
        return k, int(index.starts[first[k]]), int(index.starts[first[k] + 1])

    def plan(self, src: I64, dst: I64, sizes: I64) -> tuple[Plan, int]:
        """Resolve descriptors against the live spans (they are read here: the caller may pass views of a
        descriptor buffer's rows).

        Returns:
            The plan (a :class:`SmallPlan` for at most SMALL_BATCH descriptors; for more, a :class:`SizedPlan` when
            ``_simsized.sized_plan`` makes one, else a :class:`CopyPlan`), and how many of its bytes are slow: a
            host side not inside one pinned range (a copy between two unpinned host ranges counts its bytes
            twice).
        """
        index = self._index()
        plan: Plan
        if src.size <= SMALL_BATCH:   # in Python ints: the per-descriptor path
            values = src.tolist(), dst.tolist(), sizes.tolist()
            plan = SmallPlan(values, index.intervals.moves(*values), index.spans, index.data, index.views)
        else:
            words = np.concatenate((src, dst, sizes))   # the snapshot, in one array
            sized = sized_plan(words, index.by_count)   # one size, few per pair: resolved in one pass
            if sized is not None:
                plan = sized
            else:
                n = src.size
                src, dst, sizes = words[:n], words[n:2 * n], words[2 * n:]
                smallest, largest = sizes.item(sizes.argmin()), sizes.item(sizes.argmax())   # n > SMALL_BATCH
                intervals, nonnegative = index.intervals, smallest >= 0
                si = intervals.find(src, sizes, sized=nonnegative)
                di = intervals.find(dst, sizes, sized=nonnegative)
                plan = CopyPlan(src, dst, sizes, index.spans, si, di, intervals.starts, index.grids, index.data,
                                index.views)
                plan.bound(smallest, largest)
        slow = self._slow if self._slow is not None else self._slow_spans()
        slow_bytes = 0
        if self._any_slow:   # else every host side lies in a span one pinned range holds whole
            src, dst, sizes = plan.src, plan.dst, plan.sizes
            slow_bytes = (self._unpinned_bytes(src, sizes, slow[plan.si]) +
                          self._unpinned_bytes(dst, sizes, slow[plan.di]))
        return plan, slow_bytes

    def _unpinned_bytes(self, addr: I64, sizes: I64, maybe: npt.NDArray[np.bool_]) -> int:
        """Bytes of the ranges among [addr, addr+sizes) that no pinned range holds whole, counting only those
        marked ``maybe`` (the others lie in spans that are device memory or held whole by one pinned range)."""
        if not maybe.any():
            return 0
        addr, sizes = addr[maybe], sizes[maybe]
        slow = (self._pins().find(addr, sizes) < 0) & (sizes > 0)
        return int(sizes[slow].sum())

    def _index(self) -> _SpanIndex:
        if self._span_index is None:
            spans = sorted(self._spans.values(), key=lambda s: s.start)
            data = [s.data for s in spans]
            views = byte_views(data)
            intervals = Intervals((s.start, s.end) for s in spans)
            self._span_index = _SpanIndex(intervals, spans, data, views, {}, by_count(spans, views, data))
        return self._span_index

    def _slow_spans(self) -> npt.NDArray[np.bool_]:
        """Refresh ``_slow`` and ``_any_slow`` (see their invariant); returns ``_slow``."""
        pins = self._pins()
        flags = [s.is_host and pins.find_one(s.start, s.end - s.start) < 0 for s in self._index().spans]
        self._slow, self._any_slow = np.array([*flags, False], dtype=bool), any(flags)
        return self._slow

    def _pins(self) -> Intervals:
        if self._pin_index is None:
            self._pin_index = Intervals(self.pinned.items())
        return self._pin_index


def host_view(ptr: int, nbytes: int) -> Bytes:
    """A writeable numpy view of raw host memory [ptr, ptr+nbytes) (the caller vouches that it is mapped)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


def address(array: npt.NDArray[np.uint8]) -> int:
    """The address of an array's first byte."""
    return int(array.__array_interface__["data"][0])


class DescriptorWords:
    """Zeroed ``(src, dst, sizes)`` rows for descriptor buffers, carved from shared blocks. Not thread-safe (the
    sim calls it under its lock).

    A small buffer's rows are three adjacent views into the current block: no array of its own, so allocating
    and freeing thousands of buffers makes and frees a quarter fewer numpy objects. Words are never handed out
    twice: a block is zero where it was never carved, and numpy frees it once no view of it is left.
    """

    __slots__ = ("_block", "_used")

    def __init__(self) -> None:
        # Invariant: the block small buffers are carved from; words [_used:] of it were never handed out (zero).
        self._block: I64 = np.zeros(0, dtype=np.int64)
        self._used = 0

    def carve(self, capacity: int) -> tuple[I64, I64, I64]:
        """Three new zeroed int64 arrays of ``capacity`` words each, sharing no word with any other buffer's.

        Args:
            capacity: words per row, >= 0 (checked by the caller).

        Raises:
            ValueError, MemoryError: numpy cannot allocate ``3 * capacity`` words (what ``np.zeros`` raises).
        """
        words = 3 * capacity
        if words > DESCRIPTOR_BLOCK_WORDS // 4:
            src, dst, sizes = np.zeros((3, capacity), dtype=np.int64)  # one allocation, three rows
            return src, dst, sizes
        if self._used + words > self._block.shape[0]:
            self._block, self._used = np.zeros(DESCRIPTOR_BLOCK_WORDS, dtype=np.int64), 0
        block, first = self._block, self._used
        self._used = first + words
        second, third = first + capacity, first + 2 * capacity  # where the dst and sizes rows start
        return block[first:second], block[second:third], block[third:first + words]
