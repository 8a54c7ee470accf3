"""The simulated device's memory: the address map of live spans, and the copy engine that moves the bytes.

Theory of operation
-------------------
*Spans.* Device arrays and tracked host mappings are *spans*: [start, end) address ranges, each with a writeable
1-D uint8 numpy view of exactly its bytes. :class:`Memory` keeps them (and the pinned ranges) with cached sorted
indexes; a copy's descriptors are resolved against them vectorized (``np.searchsorted``) when the copy starts,
giving a :class:`CopyPlan`. The sim never touches an address outside a live span.

*Copies.* :meth:`CopyPlan.execute` moves the bytes, every source read before any destination is written. Small
batches go descriptor by descriptor. Otherwise the descriptors are grouped by (source span, destination span,
size) with one integer key per descriptor; the groups run in key order, each group's descriptors in descriptor
order (as a sort by key would order them). A planner's output already lists each group as one contiguous
segment, so usually no sort and no gather of the descriptors is needed: a group is a slice. What the row copies
need is computed once per copy, vectorized over all descriptors: where each side's offsets stop advancing by
exactly one row (run breaks), and whether they sit on one row grid. Per group then:

* both sides one run of adjacent rows: one slice assignment;
* the destination advances in long runs: each run is a contiguous block filled in one ``np.take`` from the
  source's row grid (or gathered from ``sliding_window_view`` windows when the source is off any grid);
* the source advances in long runs: each run is scattered with one fancy assignment into the destination's
  row grid (or windows);
* otherwise large rows move one slice assignment each, small rows by chunked fancy indexing over windows.

When a span is both read and written by one copy, every group's rows are gathered first, then written.

*Descriptor words.* Descriptor buffers are host memory outside the address map: :class:`DescriptorWords` carves
small buffers' three rows out of shared zeroed blocks, so that a buffer is three views and nothing more.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from kvoffload_ref.backends.copy_paths import registration_seams
from kvoffload_ref.errors import InvalidTransferError

__all__ = ["SMALL_BATCH", "CopyPlan", "DescriptorWords", "Intervals", "Memory", "Span", "address", "host_view"]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]

#: Rows at least this long are copied with one slice assignment each; shorter ones with chunked fancy indexing.
_LOOP_MIN_BYTES: Final = 32 * 1024
#: Copies with at most this many descriptors are resolved and moved descriptor by descriptor.
SMALL_BATCH: Final = 16
#: A side of a copy whose adjacent-row runs average at least this many rows is copied run by run, in one pass.
_MIN_RUN_ROWS: Final = 32
#: Bytes gathered per fancy-indexing chunk: large enough to amortize the call, small enough to stay in cache.
_CHUNK_BYTES: Final = 2 * 1024 * 1024
#: int64 words per shared block of descriptor words (4 KiB); buffers needing more than a quarter of one get
#: their own array, so a block that one live buffer keeps alive wastes at most 4 KiB.
DESCRIPTOR_BLOCK_WORDS: Final = 512


class Intervals:
    """An immutable, sorted set of disjoint [start, end) ranges with containment lookup."""

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        pairs = sorted(ranges)
        # Invariant: the same sorted bounds as Python lists (scalar lookups) and int64 arrays (vectorized ones).
        self._first = [a for a, _ in pairs]
        self._last = [b for _, b in pairs]
        self.starts: I64 = np.array(self._first, dtype=np.int64)
        self.ends: I64 = np.array(self._last, dtype=np.int64)

    def find(self, addr: I64, size: I64) -> npt.NDArray[np.intp]:
        """Index of the range holding each [addr, addr+size) whole, or -1 (also for a negative size)."""
        if addr.size <= SMALL_BATCH:
            found = [self.find_one(a, n) for a, n in zip(addr.tolist(), size.tolist(), strict=True)]
            return np.array(found, dtype=np.intp)
        if not self._first:
            return np.full(addr.shape, -1, dtype=np.intp)
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        room = self.ends[np.maximum(idx, 0)] - addr   # no overflow: addr >= a start wherever idx >= 0
        ok = (idx >= 0) & (size >= 0) & (size <= room)
        return np.where(ok, idx, -1)

    def find_one(self, addr: int, size: int) -> int:
        """Scalar :meth:`find`."""
        i = bisect.bisect_right(self._first, addr) - 1
        return i if i >= 0 and 0 <= size <= self._last[i] - addr else -1

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """Indices of the ranges intersecting [lo, hi)."""
        return [i for i, (a, b) in enumerate(zip(self._first, self._last, strict=True)) if a < hi and b > lo]


@dataclasses.dataclass(frozen=True, eq=False)
class Span:
    """A live piece of memory the device may touch: a device array or a tracked host mapping."""

    start: int
    end: int
    is_host: bool
    # Invariant: a writeable 1-D uint8 view of exactly [start, end).
    data: Bytes


@dataclasses.dataclass(frozen=True, eq=False)
class CopyPlan:
    """A copy's descriptors as read when it started, resolved against the spans live then."""

    src: I64
    dst: I64
    sizes: I64
    # Invariant: spans[si[k]] holds descriptor k's source whole (di: destination), or si[k] == -1.
    spans: Sequence[Span]
    si: npt.NDArray[np.intp]
    di: npt.NDArray[np.intp]
    # Invariant: starts[k] == spans[k].start.
    starts: I64

    def first_bad(self) -> int | None:
        """The first non-empty descriptor touching memory outside every live span, or None."""
        bad = ((self.si < 0) | (self.di < 0)) & (self.sizes != 0)   # an empty copy touches nothing
        return int(bad.argmax()) if bad.any() else None

    def execute(self) -> None:
        """Move the bytes (all sources are read before any destination is written). Needs first_bad() None."""
        if self.sizes.size <= SMALL_BATCH:
            self._execute_each()
            return
        live = self.sizes > 0
        if not live.all():
            dataclasses.replace(self, src=self.src[live], dst=self.dst[live], sizes=self.sizes[live],
                                si=self.si[live], di=self.di[live]).execute()
            return
        batch = _Batch(self.si, self.di, self.sizes, self.src - self.starts[self.si],
                       self.dst - self.starts[self.di], len(self.spans))
        data = [s.data for s in self.spans]
        if batch.read_and_written():   # a span is read and written: stage all reads
            staged = [sliding_window_view(data[g.src], g.size)[batch.so[g.a:g.b]] for g in batch.groups]
            for g, rows in zip(batch.groups, staged, strict=True):
                _window(data[g.dst], g.size)[batch.do[g.a:g.b]] = rows
            return
        for i, g in enumerate(batch.groups):
            batch.copy(i, data[g.src], data[g.dst])

    def _execute_each(self) -> None:
        """Descriptor by descriptor, for small batches (no per-call numpy setup)."""
        moves = [(self.spans[i], src, self.spans[j], dst, n) for i, j, src, dst, n in zip(
            self.si.tolist(), self.di.tolist(), self.src.tolist(), self.dst.tolist(), self.sizes.tolist(),
            strict=True) if n > 0]
        staged = {id(m[0]) for m in moves} & {id(m[2]) for m in moves}   # read and written: copy reads first
        reads = [a.data[src - a.start:src - a.start + n] for a, src, _, _, n in moves]
        if staged:
            reads = [r.copy() for r in reads]
        for (_, _, b, dst, n), data in zip(moves, reads, strict=True):
            b.data[dst - b.start:dst - b.start + n] = data


class _Group(NamedTuple):
    """The descriptors ``a..b-1`` of a :class:`_Batch`: one source span, one destination span, one size."""

    src: int
    dst: int
    size: int
    a: int
    b: int


class _Side:
    """One side (source or destination) of a batch: offsets into the spans and, per group, what the row copies
    need, computed once, vectorized over the whole batch: its first offset, how many run breaks it has, and
    (lazily) whether it lies on one row grid.

    A *run break* is a descriptor whose offset does not follow the previous one's by exactly one row (a group
    without run breaks is one contiguous run of rows); a *phase change* is one whose offset differs from the
    previous one's modulo the row size (a group without phase changes lies on one row grid).
    """

    def __init__(self, offsets: I64, sizes: I64, starts: npt.NDArray[np.intp], ends: npt.NDArray[np.intp]) -> None:
        self.offsets = offsets
        self._sizes = sizes
        self._starts, self._ends = starts, ends   # the groups' [a, b) bounds, in group order
        # Invariant: firsts[i] is group i's first offset; breaks[i] how many run breaks group i has.
        self.firsts: list[int] = offsets[starts].tolist()
        self._positions = np.flatnonzero(offsets[1:] - offsets[:-1] != sizes[1:]) + 1
        self.breaks = self._per_group(self._positions)
        self._position_list: list[int] | None = None
        self._phases: tuple[list[int], I64] | None = None   # (phase changes per group, row numbers)

    def runs(self, i: int, a: int, b: int) -> list[tuple[int, int]] | None:
        """The [a, b) index ranges (relative to ``a``) over which the offsets of group i (descriptors a..b-1,
        with run breaks) advance by exactly one row, if they average at least _MIN_RUN_ROWS rows (else None:
        per-run calls would cost more than they save)."""
        if (self.breaks[i] + 1) * _MIN_RUN_ROWS > b - a:
            return None
        if self._position_list is None:
            self._position_list = self._positions.tolist()
        positions = self._position_list
        inner = positions[bisect.bisect_right(positions, a):bisect.bisect_left(positions, b)]
        return list(itertools.pairwise([0, *(k - a for k in inner), b - a]))

    def grid(self, i: int, g: _Group, data: Bytes) -> tuple[Bytes, I64] | None:
        """If group i's offsets lie on one row grid of ``data``: that grid as a C-contiguous 2-D array and their
        row numbers on it; else None."""
        if self._phases is None:
            phase = self.offsets % self._sizes
            self._phases = self._per_group(np.flatnonzero(phase[1:] != phase[:-1]) + 1), self.offsets // self._sizes
        changes, rows = self._phases
        if changes[i]:
            return None
        size = g.size
        first = self.firsts[i] % size
        return data[first:first + (data.size - first) // size * size].reshape(-1, size), rows[g.a:g.b]

    def _per_group(self, positions: npt.NDArray[np.intp]) -> list[int]:
        """How many of the sorted ``positions`` lie strictly inside each group (a group's first descriptor
        breaks nothing)."""
        inside = np.searchsorted(positions, self._ends, "left") - np.searchsorted(positions, self._starts, "right")
        return inside.tolist()  # type: ignore[no-any-return]  # a list of ints


class _Batch:
    """The live descriptors of one copy, ordered group by group (see the module docstring)."""

    def __init__(self, si: npt.NDArray[np.intp], di: npt.NDArray[np.intp], sizes: I64, so: I64, do: I64,
                 num_spans: int) -> None:
        key = si * num_spans + di
        if not (sizes == sizes[0]).all():
            values, rank = np.unique(sizes, return_inverse=True)
            key = key * values.size + rank.reshape(-1)
        cuts = (np.flatnonzero(key[1:] != key[:-1]) + 1).tolist()
        bounds = [0, *cuts, int(key.size)]
        heads = key[bounds[:-1]].tolist()
        if len(set(heads)) == len(heads):   # every group is one segment: order the segments by key
            order = sorted(range(len(heads)), key=heads.__getitem__)
            segments = [(bounds[k], bounds[k + 1]) for k in order]
        else:   # a group in several pieces: sort the descriptors by key (stable: descriptor order within)
            perm = np.argsort(key, kind="stable")
            si, di, sizes, so, do, key = si[perm], di[perm], sizes[perm], so[perm], do[perm], key[perm]
            cuts = (np.flatnonzero(key[1:] != key[:-1]) + 1).tolist()
            segments = list(itertools.pairwise([0, *cuts, int(key.size)]))
        starts = np.array([a for a, _ in segments], dtype=np.intp)
        ends = np.array([b for _, b in segments], dtype=np.intp)
        self.groups = [_Group(s, d, n, a, b) for (a, b), s, d, n in zip(
            segments, si[starts].tolist(), di[starts].tolist(), sizes[starts].tolist(), strict=True)]
        self.so, self.do = so, do
        self._src, self._dst = _Side(so, sizes, starts, ends), _Side(do, sizes, starts, ends)

    def read_and_written(self) -> bool:
        """Whether some span is both a source and a destination of this copy."""
        return bool({g.src for g in self.groups} & {g.dst for g in self.groups})

    def copy(self, i: int, src: Bytes, dst: Bytes) -> None:
        """Copy group i from span data ``src`` to span data ``dst`` (which do not overlap).

        Every path writes the group's descriptors in order (a later one wins where destinations overlap), so
        which path runs changes nothing but the speed.
        """
        g, from_, to = self.groups[i], self._src, self._dst
        size, n = g.size, g.b - g.a
        if not to.breaks[i]:   # the destination is one run of rows: a contiguous block (the worker's stores)
            d = to.firsts[i]
            if not from_.breaks[i]:   # and so is the source: one slice assignment
                s = from_.firsts[i]
                dst[d:d + n * size] = src[s:s + n * size]
            else:
                self._gather(i, g, src, dst[d:d + n * size].reshape(n, size), 0, n)
        elif not from_.breaks[i]:   # the source is one run (the worker's loads): one fancy assignment
            s = from_.firsts[i]
            grid = to.grid(i, g, dst)
            target, rows = grid if grid is not None else (_window(dst, size), self.do[g.a:g.b])
            target[rows] = src[s:s + n * size].reshape(n, size)
        elif (runs := to.runs(i, g.a, g.b)) is not None:
            do = self.do[g.a:g.b]
            for a, b in runs:
                self._gather(i, g, src, dst[int(do[a]):int(do[a]) + (b - a) * size].reshape(b - a, size), a, b)
        elif (runs := from_.runs(i, g.a, g.b)) is not None:
            so = self.so[g.a:g.b]
            grid = to.grid(i, g, dst)
            target, rows = grid if grid is not None else (_window(dst, size), self.do[g.a:g.b])
            for a, b in runs:
                target[rows[a:b]] = src[int(so[a]):int(so[a]) + (b - a) * size].reshape(b - a, size)
        elif size >= _LOOP_MIN_BYTES:
            for s, d in zip(self.so[g.a:g.b].tolist(), self.do[g.a:g.b].tolist(), strict=True):
                dst[d:d + size] = src[s:s + size]
        else:
            so, do = self.so[g.a:g.b], self.do[g.a:g.b]
            windows, target, step = sliding_window_view(src, size), _window(dst, size), _chunk_rows(size)
            for k in range(0, n, step):
                target[do[k:k + step]] = windows[so[k:k + step]]

    def _gather(self, i: int, g: _Group, src: Bytes, out: Bytes, a: int, b: int) -> None:
        """out[:] = the source rows of group i's descriptors a..b-1 (relative to the group)."""
        grid = self._src.grid(i, g, src)
        if grid is not None:
            grid[0].take(grid[1][a:b], axis=0, out=out, mode="clip")
        else:
            _gather(src, g.size, self.so[g.a + a:g.a + b], out)


def _window(data: Bytes, size: int) -> npt.NDArray[np.uint8]:
    """Every ``size``-byte window of ``data``, writeable (row k starts at byte k)."""
    return sliding_window_view(data, size, writeable=True)


def _chunk_rows(size: int) -> int:
    """Rows of ``size`` bytes per fancy-indexing chunk."""
    return max(1, _CHUNK_BYTES // size)


def _gather(src: Bytes, size: int, so: I64, out: Bytes) -> None:
    """out[k] = src[so[k]:so[k]+size] for every k, a cache-sized chunk at a time (``so`` off any row grid)."""
    windows, step = sliding_window_view(src, size), _chunk_rows(size)
    for i in range(0, so.size, step):
        out[i:i + step] = windows[so[i:i + step]]


class _SpanIndex(NamedTuple):
    """A snapshot of the live spans, sorted by address."""

    intervals: Intervals
    spans: list[Span]
    # Invariant: is_host[k] == spans[k].is_host, plus a trailing False so that index -1 (no span) reads False.
    is_host: npt.NDArray[np.bool_]


class Memory:
    """The address map: live spans and pinned ranges, with cached sorted indexes for lookup."""

    def __init__(self) -> None:
        # Invariant: start -> span for every live span; spans never overlap.
        self._spans: dict[int, Span] = {}
        # Invariant: start -> end for every pinned range; each lies in a host mapping when pinned; none overlap.
        self.pinned: dict[int, int] = {}
        # Invariant: caches of sorted indexes over _spans / pinned; None when stale.
        self._span_index: _SpanIndex | None = None
        self._pin_index: Intervals | None = None
        self._seams: I64 | None = None  # registration_seams of pinned (R25); None when stale

    def add(self, span: Span) -> None:
        """Add a span. Raises InvalidTransferError if it overlaps a live one."""
        index = self._index()
        clash = index.intervals.overlapping(span.start, span.end)
        if clash:
            other = index.spans[clash[0]]
            raise InvalidTransferError(f"[{span.start:#x}, {span.end:#x}) overlaps live memory "
                                       f"[{other.start:#x}, {other.end:#x})")
        self._spans[span.start] = span
        self._span_index = None

    def remove(self, start: int) -> None:
        """Forget the span starting at ``start``."""
        del self._spans[start]
        self._span_index = None

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
        self._pin_index = self._seams = None

    def unpin(self, start: int) -> int:
        """Unpin the range at ``start``; returns its end."""
        self._pin_index = self._seams = None
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

    def plan(self, src: I64, dst: I64, sizes: I64) -> tuple[CopyPlan, int]:
        """Resolve descriptors against the live spans.

        Returns:
            The plan, and how many of its bytes are slow: a host side not inside one pinned range (a copy
            between two unpinned host ranges counts its bytes twice).
        """
        index = self._index()
        si, di = index.intervals.find(src, sizes), index.intervals.find(dst, sizes)
        slow_bytes = (self._unpinned_bytes(src, sizes, index.is_host[si]) +
                      self._unpinned_bytes(dst, sizes, index.is_host[di]))
        return CopyPlan(src, dst, sizes, index.spans, si, di, index.intervals.starts), slow_bytes

    def _unpinned_bytes(self, addr: I64, sizes: I64, on_host: npt.NDArray[np.bool_]) -> int:
        """Bytes of the host-side ranges among [addr, addr+sizes) that no pinned range holds whole."""
        if not on_host.any():
            return 0
        addr, sizes = addr[on_host], sizes[on_host]
        slow = (self._pins().find(addr, sizes) < 0) & (sizes > 0)
        return int(sizes[slow].sum())

    def _index(self) -> _SpanIndex:
        if self._span_index is None:
            spans = sorted(self._spans.values(), key=lambda s: s.start)
            self._span_index = _SpanIndex(Intervals((s.start, s.end) for s in spans), spans,
                                          np.array([s.is_host for s in spans] + [False], dtype=bool))
        return self._span_index

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
