"""The simulated device's memory: the address map of live spans, and the copy engine that moves the bytes.

Theory of operation
-------------------
*Spans.* Device arrays and tracked host mappings are *spans*: [start, end) address ranges, each with a writeable
1-D uint8 numpy view of exactly its bytes. :class:`Memory` keeps them (and the pinned ranges) with cached sorted
indexes; a copy's descriptors are resolved against them vectorized (``np.searchsorted``) when the copy starts,
giving a :class:`CopyPlan`. The sim never touches an address outside a live span. Which spans can make a copy
slow (host mappings that no one pinned range holds whole) is cached too: when there is none, pricing looks at
no descriptor's pinning.

*Copies.* :meth:`CopyPlan.execute` moves the bytes, every source read before any destination is written. The
descriptors are grouped by (source span, destination span, size) with one integer key per descriptor; the groups
run in key order, each group's descriptors in descriptor order (as a sort by key would order them), whichever way
they are moved. Small batches, and batches whose (source span, destination span) pairs -- a worker's tensor
pairs -- hold few descriptors each (a one-block job over many layers: one per pair), go descriptor by descriptor
in that order: one slice assignment each, no numpy call per copy or per group. Otherwise group by group. A
planner's output already lists each group as one contiguous segment, so usually no sort and no gather of the
descriptors is needed: a group is a slice. What the row copies need is computed once per copy, vectorized over
all descriptors: where each side's offsets stop advancing by exactly one row (run breaks), and whether they sit
on one row grid. Per group then:

* both sides one run of adjacent rows: one slice assignment;
* the destination one run (the worker's stores) or long runs: each run is a contiguous block filled in one
  ``np.take`` from the source's row grid (or gathered from ``sliding_window_view`` windows when the source is
  off any grid);
* the source one run (the worker's loads) or long runs: each run is scattered onto the destination's row grid
  with one ``put`` of whole rows -- the grid seen as one void item per row, which numpy moves as one block,
  faster than a 2-D fancy assignment; ``put`` assigns in order, so a later row wins -- or, off any grid, with
  one fancy assignment into windows;
* otherwise large rows move one slice assignment each, small rows by chunked fancy indexing over windows.

The grid views are cached per span snapshot (:data:`Grids`), so a copy of many groups makes no view per group.
When a span is both read and written by one copy, every group's rows are gathered first, then written.

*Descriptor words.* Descriptor buffers are host memory outside the address map: :class:`DescriptorWords` carves
small buffers' three rows out of shared zeroed blocks, so that a buffer is three views and nothing more.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from kvoffload_ref.backends.copy_paths import registration_seams
from kvoffload_ref.errors import InvalidTransferError

__all__ = [
    "EACH_MAX_PER_PAIR", "SMALL_BATCH", "CopyPlan", "DescriptorWords", "Intervals", "Memory", "Plan", "SmallPlan",
    "Span", "address", "host_view",
]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]

#: Rows at least this long are copied with one slice assignment each; shorter ones with chunked fancy indexing.
_LOOP_MIN_BYTES: Final = 32 * 1024
#: Copies with at most this many descriptors are resolved and moved descriptor by descriptor.
SMALL_BATCH: Final = 16
#: Larger copies are moved descriptor by descriptor too when their (source span, destination span) pairs -- a
#: worker's tensor pairs -- hold at most this many descriptors each on average: a one-block job over many layers
#: is one descriptor per tensor pair, where the grouped path's per-copy and per-group numpy calls cost more than
#: the copies themselves.
EACH_MAX_PER_PAIR: Final = 4
#: A side of a copy whose adjacent-row runs average at least this many rows is copied run by run, in one pass.
_MIN_RUN_ROWS: Final = 32
#: Bytes gathered per fancy-indexing chunk: large enough to amortize the call, small enough to stay in cache.
_CHUNK_BYTES: Final = 2 * 1024 * 1024
#: Grid views one snapshot of the spans keeps at most (a cache: emptied when full, rather than grown).
_MAX_GRIDS: Final = 256
#: int64 words per shared block of descriptor words (4 KiB); buffers needing more than a quarter of one get
#: their own array, so a block that one live buffer keeps alive wastes at most 4 KiB.
DESCRIPTOR_BLOCK_WORDS: Final = 512


#: One descriptor, as Python ints: (source span, destination span, size, source offset, destination offset).
Move = tuple[int, int, int, int, int]


class Moves(NamedTuple):
    """A few descriptors resolved in Python ints (:meth:`Intervals.moves`)."""

    each: list[Move]  # in descriptor order (an offset is -1 where its span is -1: never moved)
    si: list[int]  # each's source spans (-1: none holds it whole)
    di: list[int]  # each's destination spans
    live_bytes: int  # the non-empty descriptors' bytes
    first_bad: int | None  # the first non-empty descriptor outside every span


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

    def find(self, addr: I64, size: I64) -> npt.NDArray[np.intp]:
        """Index of the range holding each [addr, addr+size) whole, or -1 (also for a negative size)."""
        if addr.size <= SMALL_BATCH:
            found = [self.find_one(a, n) for a, n in zip(addr.tolist(), size.tolist(), strict=True)]
            return np.array(found, dtype=np.intp)
        if not self.firsts:
            return np.full(addr.shape, -1, dtype=np.intp)
        count = self.starts.searchsorted(addr, side="right")   # range count - 1 is the candidate, if count >= 1
        room = self._end_by_count.take(count) - addr   # no overflow where count >= 1: addr >= a start there
        held: npt.NDArray[np.intp] = count * ((size >= 0) & (size <= room)) - 1   # count 0: -1 whatever room is
        return held

    def moves(self, src: list[int], dst: list[int], sizes: list[int]) -> Moves:
        """Each descriptor as a :data:`Move`: (range holding the source whole or -1, the same for the destination,
        size, offset of the source into its range, of the destination into its; an offset is -1 where the range
        is -1), with what the checks read of them. Scalar lookups, for a few descriptors."""
        firsts, lasts, live, bad = self.firsts, self._last, 0, None
        out: list[Move] = []
        si: list[int] = []
        di: list[int] = []
        right = bisect.bisect_right
        for a, b, n in zip(src, dst, sizes, strict=True):
            i, j = right(firsts, a) - 1, right(firsts, b) - 1
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
            si.append(i)
            di.append(j)
        return Moves(out, si, di, live, bad)

    def find_one(self, addr: int, size: int) -> int:
        """Scalar :meth:`find`."""
        i = bisect.bisect_right(self.firsts, addr) - 1
        return i if i >= 0 and 0 <= size <= self._last[i] - addr else -1

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """Indices of the ranges intersecting [lo, hi)."""
        return [i for i, (a, b) in enumerate(zip(self.firsts, self._last, strict=True)) if a < hi and b > lo]


@dataclasses.dataclass(frozen=True, eq=False)
class Span:
    """A live piece of memory the device may touch: a device array or a tracked host mapping."""

    start: int
    end: int
    is_host: bool
    # Invariant: a writeable 1-D uint8 view of exactly [start, end).
    data: Bytes


class _Grid(NamedTuple):
    """A span's bytes from one first byte on, as whole rows of one size (the tail shorter than a row left out)."""

    # Invariant: a C-contiguous 2-D uint8 view (rows x size); items: the same bytes as a 1-D array of one void
    # item per row (numpy moves an item as one block: ``put`` of whole rows beats a 2-D fancy assignment).
    rows: Bytes
    items: npt.NDArray[np.void]


#: Grid views of span data, shared by the plans made over one snapshot of the spans: (span index, first byte,
#: row size) -> that span's grid from ``first`` on.
Grids = dict[tuple[int, int, int], _Grid]


@dataclasses.dataclass(eq=False)
class CopyPlan:
    """A copy's descriptors as read when it started, resolved against the spans live then (never changed after
    it is made; not frozen only because a frozen dataclass costs a copy's start a microsecond)."""

    src: I64
    dst: I64
    sizes: I64
    # Invariant: spans[si[k]] holds descriptor k's source whole (di: destination), or si[k] == -1.
    spans: Sequence[Span]
    si: npt.NDArray[np.intp]
    di: npt.NDArray[np.intp]
    # Invariant: starts[k] == spans[k].start.
    starts: I64
    # Invariant: grid views of the data of ``spans`` (shared by the plans over one snapshot; a cache only).
    grids: Grids = dataclasses.field(default_factory=dict)
    # Invariant: data[k] is spans[k].data (the snapshot's list, shared by its plans); empty: build it.
    data: Sequence[Bytes] = ()
    # Invariant: views[k] is a byte memoryview of spans[k].data (the snapshot's list); empty: build it.
    views: Sequence[memoryview] = ()
    # Invariant: None until ``smallest`` is first read, then its value (a cache; not copied by replace()).
    _smallest: int | None = dataclasses.field(default=None, init=False, repr=False)
    # Invariant: None until ``largest`` is first read, then its value (the same kind of cache).
    _largest: int | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def smallest(self) -> int:
        """The smallest size (0 when there is no descriptor)."""
        if self._smallest is None:   # a plain cache: a cached_property's lookup costs a copy's start more
            self._smallest = int(self.sizes.min()) if self.sizes.size else 0
        return self._smallest

    @property
    def largest(self) -> int:
        """The largest size (0 when there is no descriptor)."""
        if self._largest is None:
            self._largest = int(self.sizes.max()) if self.sizes.size else 0
        return self._largest

    def live_bytes(self) -> int:
        """How many bytes the non-empty descriptors copy."""
        smallest = self.smallest
        if smallest > 0:   # one size: no sum (the largest is read again when the bytes move)
            return smallest * int(self.sizes.size) if smallest == self.largest else int(self.sizes.sum())
        return int(self.sizes[self.sizes > 0].sum())

    def first_bad(self) -> int | None:
        """The first non-empty descriptor touching memory outside every live span, or None."""
        worst = np.minimum(self.si, self.di)
        if not worst.size or worst.min() >= 0:
            return None
        bad = (worst < 0) & (self.sizes != 0)   # an empty copy touches nothing
        return int(bad.argmax()) if bad.any() else None

    def execute(self) -> None:
        """Move the bytes (all sources are read before any destination is written). Needs first_bad() None.

        Descriptor by descriptor when its (source span, destination span) pairs hold few descriptors each
        (EACH_MAX_PER_PAIR); else group by group (:class:`_Batch`). Both write in the same order, so the choice
        changes nothing but the speed (a copy of at most SMALL_BATCH descriptors is a :class:`SmallPlan`)."""
        data = self.data or [s.data for s in self.spans]
        key = self.si * len(self.spans) + self.di
        steps = key[1:] - key[:-1]   # where the (source span, destination span) pair changes, and which way (np.diff
        # costs a microsecond more)
        if self.sizes.size <= EACH_MAX_PER_PAIR * (1 + int(np.count_nonzero(steps))):
            self._move_each(data, key, steps)
            return
        smallest = self.smallest
        if smallest <= 0:   # some are empty: copy the others
            live = self.sizes > 0
            dataclasses.replace(self, src=self.src[live], dst=self.dst[live], sizes=self.sizes[live],
                                si=self.si[live], di=self.di[live]).execute()
            return
        batch = _Batch(self.si, self.di, self.sizes, self.src - self.starts.take(self.si),
                       self.dst - self.starts.take(self.di), len(self.spans), smallest == self.largest)
        if not set(batch.src).isdisjoint(batch.dst):   # a span is read and written: stage all reads
            groups = list(zip(batch.src, batch.dst, batch.size, batch.a, batch.b, strict=True))
            staged = [sliding_window_view(data[s], n)[batch.so[a:b]] for s, _, n, a, b in groups]
            for (_, d, n, a, b), rows in zip(groups, staged, strict=True):
                _window(data[d], n)[batch.do[a:b]] = rows
            return
        batch.run(data, self.grids)

    def _move_each(self, data: Sequence[Bytes], key: npt.NDArray[np.intp], steps: npt.NDArray[np.intp]) -> None:
        """Move the non-empty descriptors one by one, in the grouped path's order (``key``: source span x
        destination span, per descriptor; ``steps``: its differences)."""
        si, di, sizes, so, do = self.si, self.di, self.sizes, self.src, self.dst
        if self.smallest <= 0:
            live = sizes > 0
            si, di, sizes, so, do, key = si[live], di[live], sizes[live], so[live], do[live], key[live]
            steps = key[1:] - key[:-1]
        so, do = so - self.starts.take(si), do - self.starts.take(di)
        views = self.views or byte_views(data)
        if sizes.size and self.smallest == self.largest:   # one size: the group order is the key's order
            if int(steps.min()) < 0:   # out of group order: the columns permuted by a stable argsort, in C
                order = key.argsort(kind="stable")   # stable: descriptor order within a group
                si, di, so, do = si.take(order), di.take(order), so.take(order), do.take(order)
            sources, destinations = si.tolist(), di.tolist()
            _move_sized(views, zip(sources, destinations, so.tolist(), do.tolist(), strict=True), int(sizes[0]),
                        set(sources).isdisjoint(destinations), data)
            return
        sources, destinations = si.tolist(), di.tolist()
        moves = sorted(zip(sources, destinations, sizes.tolist(), so.tolist(), do.tolist(), strict=True),
                       key=_GROUP)   # stable: descriptor order within a group
        _move_each(data, views, moves, set(sources).isdisjoint(destinations))


#: The grouped path's order of descriptors: (source span, destination span, size).
_GROUP = operator.itemgetter(0, 1, 2)


class SmallPlan:
    """A copy of at most SMALL_BATCH descriptors as read when it started: its descriptors as Python ints
    (:meth:`Intervals.moves`), moved descriptor by descriptor, and a :class:`CopyPlan`'s arrays (``src``,
    ``dst``, ``sizes``, ``si``, ``di``) made only when something asks for them (a cost profile, a trace, a
    pending copy's overlap check) -- most copies never need them."""

    __slots__ = ("_arrays", "data", "moves", "spans", "values", "views")

    def __init__(self, values: tuple[list[int], list[int], list[int]], moves: Moves, spans: Sequence[Span],
                 data: Sequence[Bytes], views: Sequence[memoryview]) -> None:
        # Invariant: the descriptors' (src, dst, sizes) as read when the copy started; never changed.
        self.values = values
        # Invariant: the same descriptors resolved against ``spans`` (the snapshot live then; data[k] its data,
        # views[k] a byte memoryview of it).
        self.moves, self.spans, self.data, self.views = moves, spans, data, views
        self._arrays: tuple[I64, I64, I64, npt.NDArray[np.intp], npt.NDArray[np.intp]] | None = None

    @property
    def src(self) -> I64:
        return self._made()[0]

    @property
    def dst(self) -> I64:
        return self._made()[1]

    @property
    def sizes(self) -> I64:
        return self._made()[2]

    @property
    def si(self) -> npt.NDArray[np.intp]:
        return self._made()[3]

    @property
    def di(self) -> npt.NDArray[np.intp]:
        return self._made()[4]

    def _made(self) -> tuple[I64, I64, I64, npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        if self._arrays is None:
            src, dst, sizes = (np.array(v, dtype=np.int64) for v in self.values)
            self._arrays = src, dst, sizes, np.array(self.moves.si, dtype=np.intp), np.array(self.moves.di,
                                                                                             dtype=np.intp)
        return self._arrays

    def live_bytes(self) -> int:
        """How many bytes the non-empty descriptors copy."""
        return self.moves.live_bytes

    def first_bad(self) -> int | None:
        """The first non-empty descriptor touching memory outside every live span, or None."""
        return self.moves.first_bad

    def execute(self) -> None:
        """Move the bytes, descriptor by descriptor, in :class:`CopyPlan`'s order. Needs first_bad() None."""
        moves = [m for m in self.moves.each if m[2] > 0]
        moves.sort(key=_GROUP)   # stable: descriptor order within a group
        _move_each(self.data, self.views, moves, {m[0] for m in moves}.isdisjoint([m[1] for m in moves]))


#: What a copy resolved when it started.
Plan = CopyPlan | SmallPlan


def byte_views(data: Sequence[Bytes]) -> list[memoryview]:
    """A byte memoryview of each span's data (what :func:`_move_each` slices: a memoryview slice and its
    assignment cost about half a numpy one's, for the same bytes)."""
    return [d.data.cast("B") for d in data]


def _move_each(data: Sequence[Bytes], views: Sequence[memoryview], moves: Iterable[Move], disjoint: bool) -> None:
    """Copy ``moves`` (non-empty, in order) between the spans' ``data`` (``views``: the same bytes as
    memoryviews), every source read before any destination is written (reads are staged unless ``disjoint``: no
    span among the moves' sources is among their destinations)."""
    if disjoint:
        for i, j, n, src, dst in moves:   # distinct spans: no byte is both read and written
            views[j][dst:dst + n] = views[i][src:src + n]
        return
    staged = list(moves)
    reads = [data[i][src:src + n].copy() for i, _, n, src, _ in staged]
    for (_, j, n, _, dst), read in zip(staged, reads, strict=True):
        data[j][dst:dst + n] = read


def _move_sized(views: Sequence[memoryview], moves: Iterable[tuple[int, int, int, int]], n: int, disjoint: bool,
                data: Sequence[Bytes]) -> None:
    """:func:`_move_each` of moves that all copy ``n`` bytes, given as (source span, destination span, source
    offset, destination offset): the same writes in the same order, with no size per move."""
    if disjoint:
        for i, j, src, dst in moves:   # distinct spans: no byte is both read and written
            views[j][dst:dst + n] = views[i][src:src + n]
        return
    staged = list(moves)
    reads = [data[i][src:src + n].copy() for i, _, src, _ in staged]
    for (_, j, _, dst), read in zip(staged, reads, strict=True):
        data[j][dst:dst + n] = read


class _Side:
    """One side (source or destination) of a batch: offsets into the spans and, per group, what the row copies
    need, computed once, vectorized over the whole batch: its first offset, how many run breaks it has, and
    (lazily) whether it lies on one row grid and the row numbers on it.

    A *run break* is a descriptor whose offset does not follow the previous one's by exactly one row (a group
    without run breaks is one contiguous run of rows); a *phase change* is one whose offset differs from the
    previous one's modulo the row size (a group without phase changes lies on one row grid).
    """

    def __init__(self, offsets: I64, step: int | I64, starts: npt.NDArray[np.intp],
                 ends: npt.NDArray[np.intp]) -> None:
        self.offsets = offsets
        # Invariant: the row size: an int when every descriptor has it, else the sizes, descriptor by descriptor.
        self._step = step
        self._starts, self._ends = starts, ends   # the groups' [a, b) bounds, in group order
        # Invariant: firsts[i] is group i's first offset; breaks[i] how many run breaks group i has.
        self.firsts: list[int] = offsets[starts].tolist()
        self._advance = offsets[1:] - offsets[:-1]   # how far each offset is from the previous one
        self._positions = (self._advance != (step if isinstance(step, int) else step[1:])).nonzero()[0] + 1
        self.breaks = self._per_group(self._positions)
        self._position_list: list[int] | None = None
        self._changes: list[int] | None = None   # phase changes per group, once asked for
        self._rows: I64 | None = None   # offset // row size per descriptor, once asked for

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

    def grid(self, i: int, span: int, data: Bytes, size: int, grids: Grids) -> tuple[_Grid, I64] | None:
        """If group i's offsets lie on one row grid of ``data`` (the data of span number ``span``): that grid,
        and every descriptor's row number (offset // size: group i's rows on the grid are its slice); else
        None."""
        changes = self._changes if self._changes is not None else self._phase_changes()
        if changes[i]:
            return None
        grid = _grid_at(grids, span, data, self.firsts[i] % size, size)
        return grid, self._rows if self._rows is not None else self._row_numbers()

    def _row_numbers(self) -> I64:
        """offset // row size, per descriptor (kept)."""
        step = self._step
        if isinstance(step, int) and not step & (step - 1):   # a power of two: a shift is the floor division
            self._rows = self.offsets >> (step.bit_length() - 1)
        else:
            self._rows = self.offsets // step
        return self._rows

    def _phase_changes(self) -> list[int]:
        """Phase changes per group: where an offset moved by a number of bytes that is not whole rows."""
        step = self._step
        if isinstance(step, int):
            moved = self._advance & (step - 1) if not step & (step - 1) else self._advance % step
        else:
            moved = self._advance % step[1:]
        self._changes = self._per_group(moved.nonzero()[0] + 1) if moved.any() else [0] * len(self.firsts)
        return self._changes

    def _per_group(self, positions: npt.NDArray[np.intp]) -> list[int]:
        """How many of the sorted ``positions`` lie strictly inside each group (a group's first descriptor
        breaks nothing)."""
        inside = np.searchsorted(positions, self._ends, "left") - np.searchsorted(positions, self._starts, "right")
        return inside.tolist()  # type: ignore[no-any-return]  # a list of ints


class _Batch:
    """The live descriptors of one copy, ordered group by group (see the module docstring)."""

    def __init__(self, si: npt.NDArray[np.intp], di: npt.NDArray[np.intp], sizes: I64, so: I64, do: I64,
                 num_spans: int, uniform: bool) -> None:
        """``uniform``: every descriptor has the same size."""
        size = int(sizes[0])
        key = si * num_spans + di
        if not uniform:
            values, rank = np.unique(sizes, return_inverse=True)
            key = key * values.size + rank.reshape(-1)
        cuts = ((key[1:] != key[:-1]).nonzero()[0] + 1).tolist()
        bounds = [0, *cuts, int(key.size)]
        heads = key[bounds[:-1]].tolist()
        if len(set(heads)) == len(heads):   # every group is one segment: order the segments by key
            order = sorted(range(len(heads)), key=heads.__getitem__)
            a, b = [bounds[k] for k in order], [bounds[k + 1] for k in order]
        else:   # a group in several pieces: sort the descriptors by key (stable: descriptor order within)
            perm = np.argsort(key, kind="stable")
            si, di, sizes, so, do, key = si[perm], di[perm], sizes[perm], so[perm], do[perm], key[perm]
            cuts = ((key[1:] != key[:-1]).nonzero()[0] + 1).tolist()
            a, b = [0, *cuts], [*cuts, int(key.size)]
        starts, ends = np.array(a, dtype=np.intp), np.array(b, dtype=np.intp)
        # Invariant: group k is descriptors a[k]..b[k]-1 (of so, do), from span src[k] to span dst[k], size[k]
        # bytes each; the groups in key order.
        self.a, self.b = a, b
        self.src: list[int] = si[starts].tolist()
        self.dst: list[int] = di[starts].tolist()
        self.size: list[int] = [size] * len(a) if uniform else sizes[starts].tolist()
        self.so, self.do = so, do
        step = size if uniform else sizes
        self._src, self._dst = _Side(so, step, starts, ends), _Side(do, step, starts, ends)

    def run(self, data: Sequence[Bytes], grids: Grids) -> None:
        """Copy every group, in group order, from span data to span data (no span is both read and written).

        Every path writes a group's descriptors in order (a later one wins where destinations overlap), so
        which path runs changes nothing but the speed.
        """
        from_, to = self._src, self._dst
        for i, (s, d, size, a, b) in enumerate(zip(self.src, self.dst, self.size, self.a, self.b, strict=True)):
            n = b - a
            if not to.breaks[i]:   # the destination is one run of rows: a contiguous block (the worker's stores)
                first = to.firsts[i]
                block = data[d][first:first + n * size]
                if not from_.breaks[i]:   # and so is the source: one slice assignment
                    start = from_.firsts[i]
                    block[:] = data[s][start:start + n * size]
                else:
                    self._gather(i, s, data[s], size, a, b, block.reshape(n, size), grids)
            elif not from_.breaks[i]:   # the source is one run (the worker's loads): one scatter
                start = from_.firsts[i]
                grid = to.grid(i, d, data[d], size, grids)
                if grid is not None:   # the run read as items of the source's grid: no view to make per group
                    q = start // size
                    items = _grid_at(grids, s, data[s], start % size, size).items[q:q + n]
                    grid[0].items.put(grid[1][a:b], items, mode="clip")   # in order: a later row wins
                else:
                    _window(data[d], size)[self.do[a:b]] = data[s][start:start + n * size].reshape(n, size)
            else:
                self._scattered(i, s, d, data, size, a, b, grids)

    def _scattered(self, i: int, s: int, d: int, data: Sequence[Bytes], size: int, a: int, b: int,
                   grids: Grids) -> None:
        """Copy group i (descriptors a..b-1, span s to span d), both sides with run breaks."""
        src, dst = data[s], data[d]
        if (runs := self._dst.runs(i, a, b)) is not None:   # the destination in long runs: gather each
            do = self.do[a:b]
            for x, y in runs:
                block = dst[int(do[x]):int(do[x]) + (y - x) * size].reshape(y - x, size)
                self._gather(i, s, src, size, a + x, a + y, block, grids)
        elif (runs := self._src.runs(i, a, b)) is not None:   # the source in long runs: scatter each
            so = self.so[a:b]
            grid = self._dst.grid(i, d, dst, size, grids)
            rows = grid[1][a:b] if grid is not None else self.do[a:b]
            for x, y in runs:
                values = src[int(so[x]):int(so[x]) + (y - x) * size].reshape(y - x, size)
                if grid is not None:
                    _scatter(grid[0], rows[x:y], values)
                else:
                    _window(dst, size)[rows[x:y]] = values
        elif size >= _LOOP_MIN_BYTES:
            for f, t in zip(self.so[a:b].tolist(), self.do[a:b].tolist(), strict=True):
                dst[t:t + size] = src[f:f + size]
        else:
            so, do = self.so[a:b], self.do[a:b]
            windows, target, step = sliding_window_view(src, size), _window(dst, size), _chunk_rows(size)
            for k in range(0, b - a, step):
                target[do[k:k + step]] = windows[so[k:k + step]]

    def _gather(self, i: int, s: int, src: Bytes, size: int, a: int, b: int, out: Bytes, grids: Grids) -> None:
        """out[:] = the source rows of descriptors a..b-1 (of group i, from span s with data ``src``)."""
        grid = self._src.grid(i, s, src, size, grids)
        if grid is not None:
            grid[0].rows.take(grid[1][a:b], axis=0, out=out, mode="clip")
        else:
            _gather(src, size, self.so[a:b], out)


def _grid_at(grids: Grids, span: int, data: Bytes, first: int, size: int) -> _Grid:
    """The grid of span number ``span`` (data ``data``) from byte ``first`` on, in rows of ``size`` bytes (cached
    in ``grids``)."""
    grid = grids.get((span, first, size))
    if grid is None:
        if len(grids) >= _MAX_GRIDS:   # a cache, not a record: start again rather than grow
            grids.clear()
        count = (data.size - first) // size
        rows = data[first:first + count * size].reshape(count, size)
        grid = grids[span, first, size] = _Grid(rows, rows.view(np.dtype((np.void, size))).reshape(-1))
    return grid


def _scatter(grid: _Grid, rows: I64, values: Bytes) -> None:
    """grid.rows[rows] = values (C-contiguous, one row each), in order: a later row wins where rows repeat."""
    grid.items.put(rows, values.view(grid.items.dtype).reshape(-1), mode="clip")


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
    # Invariant: data[k] is spans[k].data; views[k] a byte memoryview of it (byte_views).
    data: list[Bytes]
    views: list[memoryview]
    # Invariant: the grid views the copies over these spans made of their data (CopyPlan.grids).
    grids: Grids


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
            raise InvalidTransferError(f"[{span.start:#x}, {span.end:#x}) overlaps live memory "
                                       f"[{other.start:#x}, {other.end:#x})")
        self._spans[span.start] = span
        self._span_index = self._slow = None

    def remove(self, start: int) -> None:
        """Forget the span starting at ``start``."""
        del self._spans[start]
        self._span_index = self._slow = None

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
            The plan (a :class:`SmallPlan` for at most SMALL_BATCH descriptors), and how many of its bytes are
            slow: a host side not inside one pinned range (a copy between two unpinned host ranges counts its
            bytes twice).
        """
        index = self._index()
        plan: Plan
        if src.size <= SMALL_BATCH:   # in Python ints: the per-descriptor path
            values = src.tolist(), dst.tolist(), sizes.tolist()
            plan = SmallPlan(values, index.intervals.moves(*values), index.spans, index.data, index.views)
        else:
            src, dst, sizes = src.copy(), dst.copy(), sizes.copy()
            si, di = index.intervals.find(src, sizes), index.intervals.find(dst, sizes)
            plan = CopyPlan(src, dst, sizes, index.spans, si, di, index.intervals.starts, index.grids, index.data,
                            index.views)
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
            self._span_index = _SpanIndex(Intervals((s.start, s.end) for s in spans), spans, data, byte_views(data),
                                          {})
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
