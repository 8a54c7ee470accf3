"""What the simulated device reports (:class:`Violation`), and its DMA race detector (R20).

Theory of operation
-------------------
*Happens-before.* Every device operation that touches memory (a ``copy_batch`` copy, a compute write) is an
*op* with the byte ranges it reads and writes. An op A happens before an op B when B was enqueued on A's stream
after A, or after a wait on an event recorded after A (transitively), or after the host *observed* the
completion of a record that A precedes (a ``query`` that returned True, a ``synchronize`` that returned, the
wait of ``to_host``; the device-level proof observes through ``query``). Nothing else orders ops: not virtual
time, not the order in which they happened to run.

*Clocks over lanes.* This is tracked with vector clocks. Their components are *lanes* -- chains of ops, each
totally ordered by happens-before -- rather than streams: an op continues its stream's lane, or, when its stream
has none (a fresh or recycled stream), it takes over a lane whose latest op it is ordered after (a transfer
queued behind the previous one of its handler continues that handler's lane, whatever stream it runs on), else it
starts a new lane. Each op gets ``(lane, count)``; each stream and each event record carries a clock
``{lane: count}`` of the ops known to precede it, and the host carries one of the ops it observed complete.
Enqueueing joins the host clock into the stream's; a wait joins the record's; an observation joins the record's
into the host's. ``A -> B`` iff ``clock(B)[lane(A)] >= count(A)``. Chains stay one lane, so clocks stay small.

*Held blocks (R27).* The observation edge is the one a hold relies on. A late copy (a slow one, or one behind a
hang that was ended) writes or reads rows R on a stream A; its blocks are held until the host observes A's end
event done (any polling call: ``query``, ``query_prefix``, ``synchronize``). From then on every op enqueued, on
any stream -- a fresh stream B that the worker orders only after a marker on the compute stream, or compute work
itself -- is ordered after the late copy, so touching R is no race. Before that observation nothing orders them
(not the copy having landed in virtual time, not the stream having been retired), so a caller that writes a held
block by other means -- an ``enqueue_compute_write``, a copy on another stream -- is flagged, as is a fresh-stream
copy submitted while the late copy is unobserved. A batched ``query_prefix`` may span several streams (a retired
stream's events and a fresh one's, R28): it observes the latest counted record of each stream, not only the last
one asked about.

*Memory.* An op the host has observed complete precedes everything enqueued later, so it is dropped: the
detector holds only ops not yet known complete to the host (per lane, a deque sorted by count), and clock
entries only for lanes that still hold such ops.

*The check.* When an op B is enqueued, the live ops not ordered before it are found per lane by bisection (the
suffix of the lane's deque past ``clock(B)[lane]``); each such op A whose byte ranges overlap B's, with at least
one of the two writing, is a race: a ``dma_race`` violation naming both. Overlap is tested vectorized: A's
ranges sorted by start with a running maximum of their ends, B's ranges located in them by ``np.searchsorted``.
The verdict depends only on the order of calls, never on virtual timing.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simmem import address
from kvoffload_ref.backends._simsched import Clock, Record, SimStream, descriptor_rows
from kvoffload_ref.backends.base import DescriptorBuffer, Tag

__all__ = ["Access", "RaceDetector", "Violation", "ViolationKind", "copy_access", "rows_access", "transfer_name"]

I64 = npt.NDArray[np.int64]

ViolationKind = Literal[
    "unmap_under_dma", "unregister_under_dma", "descriptor_freed_under_dma", "illegal_address",
    "double_unregister", "invalid_release", "dma_race", "crosses_registration",
]

#: Names a byte range [lo, hi) for a message, e.g. "device array 2 (64x512) rows 5..8".
Namer = Callable[[int, int], str]


@dataclasses.dataclass(frozen=True)
class Violation:
    """One misuse the simulated device detected.

    Attributes:
        time: virtual time of detection.
        kind: what happened (see :data:`ViolationKind`).
        detail: a human-readable description naming the addresses (or operations) involved.
        tag: the tag of the copy involved, if any (for ``dma_race``: the later op's tag, else the earlier's).
        pair: for ``dma_race`` only, the sequence numbers of the two racing ops (earlier, later): memory ops
            are numbered from 0 in the order they were enqueued (copies and compute writes alike).
    """

    time: float
    kind: ViolationKind
    detail: str
    tag: Tag | None = None
    pair: tuple[int, int] | None = None


class Access:
    """The byte ranges one op reads and writes, with the sorted views the overlap test needs (built lazily).

    Once :meth:`RaceDetector.on_op` enqueued its op, it is also the detector's record of that op while the op is
    not known complete to the host (its sequence number, lane count, name and tag). The ranges are kept packed in
    one ``bytes`` (its words inline, no array object): the detector may hold thousands of ops until the host
    observes them complete, and their arrays are only needed when another op is checked against them.
    """

    __slots__ = ("_descriptors", "_name", "_sorted", "count", "packed", "seq", "split", "tag")

    def __init__(self, ranges: I64 | bytes, split: int, *, descriptors: bool = False) -> None:
        """``ranges``: a (2, n) array (see ``packed``), or with ``descriptors`` the words of ``split`` copy
        descriptors of sizes > 0 (sources, destinations, sizes laid end to end, as an array or already packed: the
        ranges are made only when asked for, :func:`copy_access`)."""
        # Invariant: the words of a (2, n) int64 array, row 0 the starts and row 1 the ends of n ranges (every
        # end > start); columns [:split] are read, [split:] written. With _descriptors: the words of ``split``
        # descriptors (sources, destinations, sizes > 0), whose ranges are the sources' then the destinations'.
        self.packed = ranges if isinstance(ranges, bytes) else ranges.tobytes()
        self.split, self._descriptors = split, descriptors
        # Invariant: None until a view is asked for; then per kind ("r", "w", "rw"): (lo sorted, running max of
        # hi in that order, hi in that order).
        self._sorted: dict[str, tuple[I64, I64, I64]] | None = None
        # Invariant: set once, by on_op: the op's number (in enqueue order), its count on its lane, its tag, and
        # what it is for messages (None only with a tag: the transfer it names, a string built only for a
        # message, not for each of the thousands of ops a detector may hold). Unset before on_op.
        self.seq: int
        self.count: int
        self.tag: Tag | None
        self._name: str | None

    @property
    def name(self) -> str:
        """What the op is, in messages (set by on_op)."""
        if self._name is not None:
            return self._name
        assert self.tag is not None  # Invariant: a nameless op has a tag
        return _tag_name(self.tag)

    @property
    def ranges(self) -> I64:
        """The (2, n) ranges (a new read-only array over the packed words, or made from the descriptors)."""
        words = np.frombuffer(self.packed, dtype=np.int64)
        if self._descriptors:
            n = self.split
            starts, sizes = words[:2 * n], words[2 * n:]
            return np.concatenate((starts, starts[:n] + sizes, starts[n:] + sizes)).reshape(2, -1)
        return words.reshape(2, -1)

    def sides(self) -> tuple[tuple[I64, I64], tuple[I64, I64]]:
        """(starts, ends) of the ranges read, and of those written (the ranges made once for both)."""
        ranges, split = self.ranges, self.split
        return (ranges[0, :split], ranges[1, :split]), (ranges[0, split:], ranges[1, split:])

    @property
    def touches(self) -> bool:
        """Whether the op touches any byte."""
        return bool(self.packed)

    def view(self, which: str) -> tuple[I64, I64, I64]:
        """The ranges of ``which`` ("r", "w" or "rw") sorted by start, with the running maximum of their ends."""
        cache = self._sorted
        if cache is None:
            cache = self._sorted = {}
        found = cache.get(which)
        if found is None:
            part = slice(None, self.split) if which == "r" else slice(self.split, None) if which == "w" else slice(None)
            ranges = self.ranges
            lo, hi = ranges[0, part], ranges[1, part]
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], hi[order]
            found = (lo, np.maximum.accumulate(hi) if hi.size else hi, hi)
            cache[which] = found
        return found


def overlap(ranges: tuple[I64, I64], other: tuple[I64, I64, I64]) -> tuple[int, int] | None:
    """The hull [lo, hi) of the parts of ``ranges`` that intersect a range of ``other`` (a :meth:`Access.view`),
    or None when none does."""
    lo, hi = ranges
    olo, ohi_max, ohi = other
    if not lo.size or not olo.size:
        return None
    idx = np.searchsorted(olo, hi, side="left")   # other ranges starting before each range's end: olo[:idx]
    hit = (idx > 0) & (ohi_max[np.maximum(idx - 1, 0)] > lo)
    if not hit.any():
        return None
    first = int(np.argmax(hit))   # name the overlap of the first hit range with the other side's ranges
    a, b = int(lo[first]), int(hi[first])
    inter = (olo < b) & (ohi > a)
    return max(a, int(olo[inter].min())), min(b, int(ohi[inter].max()))


def transfer_name(tag: Tag | None, stream: SimStream) -> str:
    """A copy as messages name it: the transfer its tag names, else an untagged copy on its stream."""
    return _tag_name(tag) if tag is not None else f"an untagged copy on {stream.label}"


def _tag_name(tag: Tag) -> str:
    return f"{tag[0]} job {tag[1]}"


def _consume(calls: Iterator[object]) -> None:
    """Run an iterator of calls to the end in C, dropping what they return."""
    collections.deque(calls, maxlen=0)


class _Lane:
    """A chain of ops totally ordered by happens-before."""

    __slots__ = ("counts", "head", "live", "owner")

    def __init__(self, owner: SimStream | None) -> None:
        # Invariant: the stream that extends this lane next, or None (its stream was destroyed or moved on).
        self.owner = owner
        # Invariant: the count of the lane's latest op (0: none yet).
        self.head = 0
        # Invariant: the lane's live ops, by increasing count; counts mirrors their counts (for bisection).
        self.live: collections.deque[Access] = collections.deque()
        self.counts: collections.deque[int] = collections.deque()


class RaceDetector:
    """Happens-before tracking and the ``dma_race`` check (see the module docstring). Not thread-safe: the sim
    calls it under its own lock."""

    def __init__(self, name_range: Namer) -> None:
        self._name_range = name_range
        # Invariant: lane id -> lane, for every lane that has live ops or an owner stream.
        self._lanes: dict[int, _Lane] = {}
        self._lane_ids = itertools.count(1)
        # Invariant: the ops the host observed complete: lane -> count, only for lanes in _lanes.
        self._host: Clock = {}
        self._seq = itertools.count()

    # -- ordering edges --------------------------------------------------------------------------------------

    def on_record(self, stream: SimStream, record: Record) -> None:
        """A record captures what its stream's next op would be ordered after."""
        record.clock = stream.clock

    def on_wait(self, stream: SimStream, record: Record) -> None:
        """Later ops on ``stream`` are ordered after what ``record`` captured."""
        if record.clock:
            stream.clock = self._join(stream.clock, record.clock)

    def observe(self, record: Record) -> None:
        """The host observed ``record`` complete: what it captured precedes everything enqueued from now on."""
        clock = record.clock
        if not clock:
            return
        host = self._host
        for lane_id, count in clock.items():
            if host.get(lane_id, 0) >= count:
                continue
            lane = self._lanes.get(lane_id)
            if lane is None:
                continue
            counts, live = lane.counts, lane.live
            if counts and counts[-1] <= count:  # everything the lane holds was observed
                counts.clear()
                live.clear()
            else:  # popleft the observed ones, in C
                observed = bisect.bisect_right(counts, count)
                _consume(itertools.starmap(counts.popleft, itertools.repeat((), observed)))
                _consume(itertools.starmap(live.popleft, itertools.repeat((), observed)))
            if lane.live:
                host[lane_id] = count
            else:
                host.pop(lane_id, None)
                if lane.owner is None:
                    del self._lanes[lane_id]

    def forget_stream(self, stream: SimStream) -> None:
        """A destroyed stream extends no lane any more."""
        lane = self._lanes.get(stream.lane)
        if lane is not None and lane.owner is stream:
            lane.owner = None
            if not lane.live:
                del self._lanes[stream.lane]

    # -- ops --------------------------------------------------------------------------------------------------

    def on_op(self, stream: SimStream, name: str | None, tag: Tag | None,
              access: Access) -> list[tuple[str, Tag | None, tuple[int, int]]]:
        """Enqueue one memory op on ``stream``; returns (detail, tag, pair) for each live op it races with, in
        lane order (a list, empty in the common case: no generator per op).

        ``name`` says what the op is in messages; None for a tagged copy: the transfer its tag names
        (:func:`transfer_name`)."""
        clock = self._join(stream.clock, self._host) if self._host else dict(stream.clock)
        lane_id = self._lane_for(stream, clock)
        lane = self._lanes[lane_id]
        lane.head += 1
        clock[lane_id] = lane.head
        stream.clock = clock
        op = access
        op.seq, op.count, op.tag, op._name = next(self._seq), lane.head, tag, name
        races: list[tuple[str, Tag | None, tuple[int, int]]] = []
        if access.packed:   # it touches some byte (``touches``, without the property call)
            sides: tuple[tuple[I64, I64], tuple[I64, I64]] | None = None  # built for the first unordered op
            for other in self._unordered(clock, lane_id):
                if sides is None:
                    sides = access.sides()
                found = self._conflict(other, op, *sides)
                if found is not None:
                    races.append(found)
            lane.live.append(op)
            lane.counts.append(op.count)
        return races

    def live_ops(self) -> int:
        """How many ops the detector holds (those not yet known complete to the host)."""
        return sum(len(lane.live) for lane in self._lanes.values())

    # -- internals --------------------------------------------------------------------------------------------

    def _unordered(self, clock: Clock, own: int) -> Iterator[Access]:
        for lane_id, lane in self._lanes.items():
            if lane_id == own or not lane.live:
                continue
            known = clock.get(lane_id, 0)
            start = bisect.bisect_right(lane.counts, known) if known else 0
            yield from itertools.islice(lane.live, start, None)

    def _conflict(self, a: Access, b: Access, reads: tuple[I64, I64],
                  writes: tuple[I64, I64]) -> tuple[str, Tag | None, tuple[int, int]] | None:
        """The race between live op ``a`` and new op ``b`` (which reads ``reads`` and writes ``writes``), if their
        ranges conflict."""
        for b_ranges, b_verb, which, a_verb in ((writes, "writes", "w", "writes"),
                                                (writes, "writes", "r", "reads"),
                                                (reads, "reads", "w", "writes")):
            hull = overlap(b_ranges, a.view(which))
            if hull is not None:
                where = self._name_range(*hull)
                detail = (f"{b.name} {b_verb} {where} while {a.name} (still unordered: no stream order, event wait "
                          f"or observed completion between them) {a_verb} it")
                return detail, b.tag if b.tag is not None else a.tag, (a.seq, b.seq)
        return None

    def _lane_for(self, stream: SimStream, clock: Clock) -> int:
        """The lane ``stream``'s next op continues (see the module docstring)."""
        lane = self._lanes.get(stream.lane)
        if lane is not None and lane.owner is stream:
            return stream.lane
        for lane_id, count in clock.items():
            other = self._lanes.get(lane_id)
            if other is not None and other.head == count and (other.owner is None or not other.owner.compute):
                break
        else:
            lane_id, other = next(self._lane_ids), _Lane(None)
            self._lanes[lane_id] = other
        if other.owner is not None and other.owner.lane == lane_id:
            other.owner.lane = -1
        other.owner = stream
        old = self._lanes.get(stream.lane)
        if old is not None and old.owner is stream:   # unreachable today: a stream owns at most its own lane
            old.owner = None
        stream.lane = lane_id
        return lane_id

    def _join(self, a: Clock, b: Clock) -> Clock:
        """The pointwise maximum, keeping only lanes that still hold live ops or are owned."""
        lanes = self._lanes
        joined = {k: v for k, v in a.items() if k in lanes}
        for k, v in b.items():
            if v > joined.get(k, 0) and k in lanes:
                joined[k] = v
        return joined


def copy_access(buf: DescriptorBuffer, count: int) -> Access:
    """The ranges the first ``count`` descriptors of ``buf`` read (sources) and write (destinations) now."""
    src, dst, sizes = descriptor_rows(buf, count)
    if not count or sizes.item(sizes.argmin()) <= 0:   # some touch nothing: keep the others
        live = sizes > 0
        src, dst, sizes = src[live], dst[live], sizes[live]
    # Their words, read now, packed by one join of the three rows (int64, contiguous: a descriptor buffer's, or
    # the live ones' copies); the ranges are made from them only when another op is checked against this one.
    # (The arrays are buffers; the stubs do not say so, and ``.data`` would make a memoryview each.)
    packed = b"".join((src, dst, sizes))  # type: ignore[arg-type]
    return Access(packed, int(sizes.shape[0]), descriptors=True)


def rows_access(target: npt.NDArray[np.uint8], rows: I64) -> Access:
    """The ranges a compute write of ``rows`` of the 2-D array ``target`` writes."""
    lo = address(target) + rows * int(target.strides[0])
    return Access(np.stack((lo, lo + int(target.shape[1]))), 0)
