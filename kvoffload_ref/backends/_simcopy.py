"""The simulated device's copy engine: a copy's descriptors resolved against the live spans (:class:`CopyPlan`,
:class:`SmallPlan`) and the moves that copy their bytes.

Theory of operation
-------------------
*Spans.* Device arrays and tracked host mappings are *spans* (:class:`Span`): [start, end) address ranges, each
with a writeable 1-D uint8 numpy view of exactly its bytes. The address map that keeps them and resolves a
copy's descriptors against them is ``_simmem.py``; a plan only reads the spans of one snapshot of it.

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
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

__all__ = [
    "EACH_MAX_PER_PAIR", "SMALL_BATCH", "CopyPlan", "Grids", "Move", "Moves", "SmallPlan", "Span", "byte_views",
    "move_sized",
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
#: An array's min() and max() without their Python wrappers (half a microsecond each on a copy's start).
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


#: One descriptor, as Python ints: (source span, destination span, size, source offset, destination offset).
Move = tuple[int, int, int, int, int]


#: A few descriptors resolved in Python ints (:meth:`Intervals.moves`): (each descriptor as a :data:`Move`, in
#: descriptor order -- an offset is -1 where its span is -1 (none holds that side whole: never moved) --, the
#: non-empty descriptors' bytes, the first non-empty descriptor outside every span or None). A plain tuple: one is
#: made per copy's start, and a named tuple's constructor is a Python call.
Moves = tuple[list[Move], int, int | None]


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
    # Invariant: None until ``smallest`` is first read (or :meth:`bound` told it), then its value (a cache; not
    # copied by replace()).
    _smallest: int | None = dataclasses.field(default=None, init=False, repr=False)
    # Invariant: None until ``largest`` is first read (or told), then its value (the same kind of cache).
    _largest: int | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def smallest(self) -> int:
        """The smallest size (0 when there is no descriptor)."""
        if self._smallest is None:   # a plain cache: a cached_property's lookup costs a copy's start more
            self._smallest = int(_MIN(self.sizes)) if self.sizes.size else 0
        return self._smallest

    @property
    def largest(self) -> int:
        """The largest size (0 when there is no descriptor)."""
        if self._largest is None:
            self._largest = int(_MAX(self.sizes)) if self.sizes.size else 0
        return self._largest

    def bound(self, smallest: int, largest: int) -> None:
        """Seed :attr:`smallest` and :attr:`largest` with what the maker of the plan already computed (they must be
        the sizes' minimum and maximum: ``tests/test_backends_sim_copy.py`` holds the plans to them)."""
        self._smallest, self._largest = smallest, largest

    def live_bytes(self) -> int:
        """How many bytes the non-empty descriptors copy."""
        smallest = self.smallest
        if smallest > 0:   # one size: no sum (the largest is read again when the bytes move)
            return smallest * int(self.sizes.size) if smallest == self.largest else int(self.sizes.sum())
        return int(self.sizes[self.sizes > 0].sum())

    def first_bad(self) -> int | None:
        """The first non-empty descriptor touching memory outside every live span, or None."""
        si, di = self.si, self.di
        if not si.size or (_MIN(si) >= 0 and _MIN(di) >= 0):
            return None
        worst = np.minimum(si, di)
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
        starts = self.starts
        so, do = so - starts.take(si), do - starts.take(di)
        views = self.views or byte_views(data)
        if sizes.size and self.smallest == self.largest:   # one size: the group order is the key's order
            if _MIN(steps) < 0:   # out of group order: the columns permuted by a stable argsort, in C
                order = key.argsort(kind="stable")   # stable: descriptor order within a group
                si, di, so, do = si.take(order), di.take(order), so.take(order), do.take(order)
            sources, destinations = si.tolist(), di.tolist()
            move_sized(views, zip(sources, destinations, so.tolist(), do.tolist(), strict=True), int(sizes[0]),
                       set(sources).isdisjoint(destinations), data)
            return
        sources, destinations = si.tolist(), di.tolist()
        moves = sorted(zip(sources, destinations, sizes.tolist(), so.tolist(), do.tolist(), strict=True),
                       key=_GROUP)   # stable: descriptor order within a group
        _move_each(data, views, moves, set(sources).isdisjoint(destinations))


#: The grouped path's order of descriptors: (source span, destination span, size).
_GROUP = operator.itemgetter(0, 1, 2)
#: A move's source span and destination span (the disjointness test runs in C, no comprehension).
_SOURCE, _DESTINATION = operator.itemgetter(0), operator.itemgetter(1)


class SmallPlan:
    """A copy of at most SMALL_BATCH descriptors as read when it started: its descriptors as Python ints
    (:meth:`Intervals.moves`), moved descriptor by descriptor, and a :class:`CopyPlan`'s arrays (``src``,
    ``dst``, ``sizes``, ``si``, ``di``) made only when something asks for them (a cost profile, a trace, a
    pending copy's overlap check) -- most copies never need them."""

    __slots__ = ("_arrays", "_first_bad", "_live_bytes", "data", "each", "spans", "values", "views")

    def __init__(self, values: tuple[list[int], list[int], list[int]], moves: Moves, spans: Sequence[Span],
                 data: Sequence[Bytes], views: Sequence[memoryview]) -> None:
        # Invariant: the descriptors' (src, dst, sizes) as read when the copy started; never changed.
        self.values = values
        # Invariant: the same descriptors resolved against ``spans`` (the snapshot live then; data[k] its data,
        # views[k] a byte memoryview of it): each one's Move, their live bytes, the first bad one (Moves).
        self.each, self._live_bytes, self._first_bad = moves
        self.spans, self.data, self.views = spans, data, views
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
            self._arrays = (src, dst, sizes, np.array([m[0] for m in self.each], dtype=np.intp),
                            np.array([m[1] for m in self.each], dtype=np.intp))
        return self._arrays

    def live_bytes(self) -> int:
        """How many bytes the non-empty descriptors copy."""
        return self._live_bytes

    def first_bad(self) -> int | None:
        """The first non-empty descriptor touching memory outside every live span, or None."""
        return self._first_bad

    def execute(self) -> None:
        """Move the bytes, descriptor by descriptor, in :class:`CopyPlan`'s order. Needs first_bad() None."""
        moves = [m for m in self.each if m[2] > 0]
        moves.sort(key=_GROUP)   # stable: descriptor order within a group
        _move_each(self.data, self.views, moves, set(map(_SOURCE, moves)).isdisjoint(map(_DESTINATION, moves)))


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


def move_sized(views: Sequence[memoryview], moves: Iterable[tuple[int, int, int, int]], n: int, disjoint: bool,
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
