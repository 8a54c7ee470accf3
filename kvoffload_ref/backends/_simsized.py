"""The simulated device's copies of many descriptors of one size over few descriptors per span pair: resolved in
one pass when the copy starts (:func:`sized_plan`), moved descriptor by descriptor (:class:`SizedPlan`).

Theory of operation
-------------------
A worker's one-block job over many layers is a copy of tens to hundreds of descriptors of one size, one per
(source span, destination span) pair -- more than :data:`SMALL_BATCH`, so its descriptors are resolved
vectorized, and too few per pair for the grouped path to pay (:data:`EACH_MAX_PER_PAIR`). For such a copy the
start does, in one pass over both sides laid end to end (one ``searchsorted``), everything its move needs: each
side's candidate span and offset into it, whether every descriptor lies inside its span (then none is bad), the
group order test and the count of pair changes that chooses the path. The move then only turns the two columns
into lists (in group order: a stable ``argsort`` of the pair keys when out of it) and copies them one slice
assignment each, exactly as :meth:`CopyPlan.execute` moves such a copy: the same bytes in the same order.

Any other copy -- sizes that differ, an empty, negative or outside descriptor, many descriptors per pair -- gets
None here and a :class:`CopyPlan` from ``_simmem.Memory.plan``: this is a fast path of the same result, held to
that plan by ``tests/test_backends_sim_copy.py``. Like :class:`SmallPlan`, the arrays the cost model, the trace
and a pending copy's overlap check read (``src``, ``dst``, ``sizes``, ``si``, ``di``) are views made when asked.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simcopy import EACH_MAX_PER_PAIR, SMALL_BATCH, CopyPlan, SmallPlan, Span, move_sized

__all__ = ["FIRST", "ByCount", "Plan", "SizedPlan", "by_count", "sized_plan"]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]
Counts = npt.NDArray[np.intp]

INT64_MIN: Final = -(2**63)


#: The count (how many ranges of :attr:`ByCount.firsts` start at or before an address) of the first span: counts
#: 1 and 2 are the two sentinel ranges before every span (0 is never seen).
FIRST: Final = 3


class ByCount(NamedTuple):
    """A span snapshot indexed by how many ranges start at or before an address (its *count* ``c``: span ``c -
    FIRST`` may hold it): what :func:`sized_plan` reads, so that its columns need no shift.

    Two sentinel ranges come before every span: [INT64_MIN, 0) and [0, first span), whose room is below 1 from
    every address in them (no overflow: see :func:`by_count`), so one comparison of the room with the size tells
    whether a side lies inside a span, and no address has count 0.
    """

    # Invariant: firsts[c - 1] is where count c begins (sorted); starts[c] is what a side of count c is offset
    # from, sizes[c] the room from there; [0] placeholders.
    firsts: I64
    starts: I64
    sizes: I64
    # Invariant: [number of counts, 1] (a pair key is this row times a (2, n) column of counts).
    weights: I64
    spans: Sequence[Span]
    # Invariant: views[c] is a byte memoryview of span c - FIRST's data, data[c] that data (placeholders below
    # FIRST).
    views: Sequence[memoryview]
    data: Sequence[Bytes]


def by_count(spans: Sequence[Span], views: Sequence[memoryview], data: Sequence[Bytes]) -> ByCount:
    """The :class:`ByCount` of ``spans`` (sorted by address, starting above 0 as real memory does; ``views`` and
    ``data``: their byte memoryviews and data).

    The sentinels, offset from 0: [INT64_MIN, 0) has room INT64_MIN - a, in [INT64_MIN + 1, 0] for its
    addresses; [0, first span) has room -1 - a, in [-first, -1]."""
    assert not spans or spans[0].start > 0   # Invariant: the second sentinel is not empty
    count = len(spans) + FIRST
    firsts = np.array([INT64_MIN, 0, *(s.start for s in spans)], dtype=np.int64)
    starts = np.array([0, 0, 0, *(s.start for s in spans)], dtype=np.int64)
    sizes = np.array([0, INT64_MIN, -1, *(s.end - s.start for s in spans)], dtype=np.int64)
    none, empty = memoryview(b""), np.empty(0, dtype=np.uint8)
    return ByCount(firsts, starts, sizes, np.array([count, 1], dtype=np.int64), spans,
                   [none] * FIRST + list(views), [empty] * FIRST + list(data))


class SizedPlan:
    """A copy resolved by :func:`sized_plan` (read its docstring). Never changed after it is made."""

    __slots__ = ("_count", "_key", "_offsets", "_ordered", "_snapshot", "_words", "size")

    def __init__(self, words: I64, count: Counts, offsets: I64, key: I64, ordered: bool, size: int,
                 snapshot: ByCount) -> None:
        # Invariant: the descriptors as read when the copy started: words[:n] the sources, [n:2n] the
        # destinations, [2n:] the sizes, every one ``size`` (> 0).
        self._words, self.size = words, size
        # Invariant: count[0, k] (count[1, k]) is the count of descriptor k's source (destination) in ``snapshot``
        # (>= FIRST: span count - FIRST holds it whole); offsets[0, k] (offsets[1, k]) its offset into that span.
        self._count, self._offsets, self._snapshot = count, offsets, snapshot
        # Invariant: key[k] is descriptor k's (source span, destination span) pair as one int that sorts in group
        # order; ordered: the key never decreases (the descriptors are in group order already).
        self._key, self._ordered = key, ordered

    @property
    def spans(self) -> Sequence[Span]:
        return self._snapshot.spans

    @property
    def src(self) -> I64:
        return self._words[:self._key.size]

    @property
    def dst(self) -> I64:
        n = self._key.size
        return self._words[n:2 * n]

    @property
    def sizes(self) -> I64:
        return self._words[2 * self._key.size:]

    @property
    def si(self) -> Counts:
        spans: Counts = self._count[0] - FIRST
        return spans

    @property
    def di(self) -> Counts:
        spans: Counts = self._count[1] - FIRST
        return spans

    def live_bytes(self) -> int:
        """How many bytes the descriptors copy (none is empty)."""
        return self.size * int(self._key.size)

    def first_bad(self) -> None:
        """None: every descriptor lies inside a live span (else the copy is a :class:`CopyPlan`)."""
        return None

    def execute(self) -> None:
        """Move the bytes as :meth:`CopyPlan.execute` moves a copy of one size descriptor by descriptor: in group
        order (descriptor order within a group), every source read before any destination is written."""
        n, count, offsets = self._key.size, self._count, self._offsets
        if not self._ordered:   # the columns permuted by a stable argsort, in C
            order = self._key.argsort(kind="stable")   # stable: descriptor order within a group
            count, offsets = count.take(order, axis=1), offsets.take(order, axis=1)   # (take: a third of [:, order])
        sources, destinations = count.tolist()
        from_, to = offsets.tolist()
        snapshot = self._snapshot
        assert len(sources) == n   # Invariant: two rows of n
        move_sized(snapshot.views, zip(sources, destinations, from_, to, strict=True), self.size,
                   _disjoint(sources, destinations), snapshot.data)


def _disjoint(sources: list[int], destinations: list[int]) -> bool:
    """Whether no span is among both ``sources`` and ``destinations`` (the spans of a copy's descriptors, in group
    order: the sources never decrease, nor the destinations of one source). A copy from one span, or to one span,
    (a worker's load, a store) is answered by one bisection of the other side's sorted list."""
    first = sources[0]
    if first == sources[-1]:   # one source span: the destinations are sorted
        at = bisect.bisect_left(destinations, first)
        return at == len(destinations) or destinations[at] != first
    target = destinations[0]
    if destinations.count(target) == len(destinations):   # one destination span (the sources are sorted)
        at = bisect.bisect_left(sources, target)
        return at == len(sources) or sources[at] != target
    return set(sources).isdisjoint(destinations)


#: What a copy resolved when it started.
Plan = CopyPlan | SmallPlan | SizedPlan


def sized_plan(words: I64, snapshot: ByCount) -> SizedPlan | None:
    """The copy of descriptors ``words`` (sources, destinations, sizes laid end to end: a snapshot the plan keeps)
    as a :class:`SizedPlan`, if it is one: more than SMALL_BATCH descriptors, all of one size > 0, each side inside
    one span of ``snapshot``, and at most EACH_MAX_PER_PAIR descriptors per (source span, destination span) pair
    on average (CopyPlan's choice of its per-descriptor path). Else None: the copy is a :class:`CopyPlan`."""
    n = words.size // 3
    if n <= SMALL_BATCH:
        return None
    rows = words.reshape(3, n)
    sizes = rows[2]
    size, raw = sizes.item(0), sizes.tobytes()
    if size <= 0 or raw != raw[:8] * n:   # not one size > 0 (one size: every word's bytes are the first's)
        return None
    sides = rows[:2]
    count = snapshot.firsts.searchsorted(sides, side="right")   # both sides in one search, each count >= 1
    offsets = sides - snapshot.starts.take(count)
    room = snapshot.sizes.take(count) - offsets   # no overflow (ByCount's sentinels)
    if room.item(room.argmin()) < size:   # a side outside every span
        return None
    key = snapshot.weights.dot(count)   # as CopyPlan's si * spans + di, plus a constant
    steps = key[1:] - key[:-1]
    least = steps.item(steps.argmin())
    # Every step up: one descriptor per pair, in group order. Else CopyPlan's choice, by its pair changes.
    if least <= 0 and n > EACH_MAX_PER_PAIR * (1 + np.count_nonzero(steps)):   # many per pair: the grouped path
        return None
    return SizedPlan(words, count, offsets, key, least >= 0, size, snapshot)
