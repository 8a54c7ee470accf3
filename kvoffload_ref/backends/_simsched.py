"""The simulated device's scheduler: streams, event records, ops, and the heap of ops due by virtual time.

Theory of operation
-------------------
*Clock.* A virtual clock starts at 0.0. Only the backend's ``sleep`` / ``clock_advance`` move it forward freely;
``synchronize`` (and ``to_host``) move it to the moment what they wait for completes, or by the hang horizon when
it never can; a poll pause (``poll_sleep``) by at most its pause, stopping at an op for which ``run``'s ``stops``
holds. Nothing else advances it, so every deadline a test sets is exact and repeatable. The schedule span's
counters (:meth:`Scheduler.mark`) follow the device ops (not records or waits) as they start and finish.

*Streams.* Each stream is a FIFO of ops (record, wait, copy, compute write, hang, slow stall). The head op of a stream
starts when the op before it finished (never before it was submitted) and, for a wait, once the awaited event record has
completed. A started op sits in one global heap keyed by its finish time; its *effect* (bytes moved, event completed) is
applied when the heap pops it. Ops finishing at the same virtual time pop latest-submitted first (the *tie order*), so
code that forgot a wait sees stale data instead of the convenient order. Work runs lazily: whenever a call observes the
device, the heap is drained up to the current time. A hang op never finishes, so everything behind it on its stream, and
every stream waiting on an event recorded behind it, never runs either -- until the hang is *ended*
(:meth:`Scheduler.end_hang`, the backend's ``end_hangs``): it then finishes at the current time (at once if it is its
stream's head, else as soon as it becomes it) and the work behind it runs as the clock advances. A slow op is a stall
that ends by itself: it takes its ``duration``, like a compute op. Draining costs O(log n) per op (a heap, never a scan
of the streams); an instant op (a record, a satisfied wait) that a finish makes its stream's head is finished next
without the heap when no heap entry comes before it -- the order the heap would give, without the push and pop.

Nothing here touches memory or knows about faults: :class:`Scheduler` calls back ``duration`` when an op starts
and ``apply`` when it finishes.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends._simsized import Plan
from kvoffload_ref.backends.base import DescriptorBuffer, Tag

__all__ = [
    "ComputeOp", "CopyOp", "HangOp", "Op", "Record", "RecordOp", "Scheduler", "SimEvent", "SimStream", "SlowOp",
    "WaitOp", "descriptor_rows",
]

I64 = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]

#: A happens-before clock (see ``_simrace.py``): lane -> the count of that lane's last op known to precede.
Clock = dict[int, int]
_EMPTY: Clock = {}


class Record:
    """One generation of an event: completes when its record op runs."""

    __slots__ = ("clock", "done", "done_at", "stream", "waiters")

    def __init__(self, stream: SimStream | None = None) -> None:
        # Invariant: the stream it was recorded on (a batched query observes the latest done record per stream).
        self.stream = stream
        # Invariant: what the record's stream had been ordered after when it was recorded (the race detector's
        # snapshot; never mutated, may be shared with the stream).
        self.clock: Clock = _EMPTY
        # Invariant: None until the record op ran; then the virtual time it completed. Never reset. ``done`` says
        # the same as a bool (a drain asking about thousands of records then touches no float).
        self.done_at: float | None = None
        self.done = False
        # Invariant: the streams whose head op is a wait on this record (None: none, the common case, so that
        # most records allocate no list); None again once the record completed.
        self.waiters: list[SimStream] | None = None


class SimStream:
    """A stream handle of one SimBackend."""

    __slots__ = ("clock", "compute", "destroyed", "hang_tag", "label", "lane", "last_record", "owner", "queue")

    def __init__(self, owner: object, label: str, *, compute: bool = False) -> None:
        self.owner = owner
        self.label = label
        # Invariant: True for a compute stream (the default one or a named one): never destroyed, not in the ledger.
        self.compute = compute
        # Invariant: the race detector's clock of what the next op on this stream is ordered after (replaced,
        # never mutated) and the lane that op continues (-1: none yet).
        self.clock: Clock = _EMPTY
        self.lane = -1
        # Invariant: under a fault plan, the tag of the transfer whose start was recorded here and whose end was not
        # yet (its start was offered to hang selection), else None (without a plan nothing is offered: always None).
        self.hang_tag: Tag | None = None
        # Invariant: ops not yet finished, in submission order; queue[0] is running or blocked (wait/hang).
        self.queue: collections.deque[Op] = collections.deque()
        # Invariant: True once destroyed; queued work still runs (as CUDA) but no new work is accepted.
        self.destroyed = False
        # Invariant: the record op submitted last on this stream (None: none yet); records finish in stream order, so
        # once it finished, no record is left in the queue.
        self.last_record: RecordOp | None = None

    def __repr__(self) -> str:
        return f"<SimStream {self.label}{' destroyed' if self.destroyed else ''}>"


class SimEvent:
    """An event handle of one SimBackend."""

    __slots__ = ("key", "latest", "number", "owner", "tag")

    def __init__(self, owner: object, number: int) -> None:
        # Invariant: the device that created it; the event is live while that device's event table holds it.
        self.owner = owner
        # Invariant: id(self), made once: the very int the device's tables and ledger key it by (a teardown of
        # thousands then makes no int per event).
        self.key = id(self)
        # Invariant: the device's label counter when it was created (the label is built only when shown).
        self.number = number
        # Invariant: the current generation; None while never recorded (such an event counts as complete).
        self.latest: Record | None = None
        # Invariant: the tag of the latest record (fault selectors match it).
        self.tag: Tag | None = None

    @property
    def label(self) -> str:
        return f"e{self.number}"

    def __repr__(self) -> str:
        return f"<SimEvent {self.label} tag={self.tag}>"


class Op:
    """One unit of stream work; subclasses say what it does."""

    __slots__ = ("seq", "stream", "submitted_at")
    #: Whether the op takes no time (a record, a wait): the scheduler asks no duration for it.
    instant = False

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        # Invariant: seq and submitted_at are set once, by Scheduler.submit; seq is unique and increases in
        # submission order.
        self.seq = -1
        self.submitted_at = 0.0


class RecordOp(Op):
    __slots__ = ("record",)
    instant = True

    def __init__(self, stream: SimStream, record: Record) -> None:
        # Op's fields set here, not through super(): a job submits three records and a wait (one call less each).
        self.stream, self.seq, self.submitted_at, self.record = stream, -1, 0.0, record


class WaitOp(Op):
    __slots__ = ("record",)
    instant = True

    def __init__(self, stream: SimStream, record: Record) -> None:
        self.stream, self.seq, self.submitted_at, self.record = stream, -1, 0.0, record


class HangOp(Op):
    """Never finishes by itself: blocks its stream until ended (:meth:`Scheduler.end_hang`)."""

    __slots__ = ("ended", "tag")

    def __init__(self, stream: SimStream, tag: Tag | None) -> None:
        super().__init__(stream)
        # Invariant: the tag of the transfer whose start it follows (end_hangs selects by it).
        self.tag = tag
        # Invariant: None while hung; once ended, the virtual time it was ended at (never reset).
        self.ended: float | None = None


class SlowOp(Op):
    """A stall that ends by itself: takes ``duration`` virtual seconds, touches nothing (a slow fault)."""

    __slots__ = ("duration", "tag")

    def __init__(self, stream: SimStream, tag: Tag | None, duration: float) -> None:
        super().__init__(stream)
        # Invariant: the tag of the transfer whose start it follows, and the finite seconds > 0 it lasts.
        self.tag, self.duration = tag, duration


class ComputeOp(Op):
    __slots__ = ("delay", "rows", "target", "value")

    def __init__(self, stream: SimStream, target: Bytes, rows: I64, value: int, delay: float) -> None:
        super().__init__(stream)
        self.target, self.rows, self.value, self.delay = target, rows, value, delay


class CopyOp(Op):
    __slots__ = ("buf", "count", "flow", "plan", "poison", "tag")

    def __init__(self, stream: SimStream, buf: DescriptorBuffer, count: int, tag: Tag | None) -> None:
        # Op's fields set here, not through super() (one call less per copy; as RecordOp).
        self.stream, self.seq, self.submitted_at = stream, -1, 0.0
        self.buf, self.count, self.tag = buf, count, tag
        # Invariant: None unless a cost profile priced the op when it started (then a ``_simcost.Flow``).
        self.flow: object | None = None
        # Invariant: None until the op starts; then the descriptors as read at start, resolved to spans.
        self.plan: Plan | None = None
        # Invariant: why the op must not touch memory (a range it uses was unmapped/unpinned), or None.
        self.poison: str | None = None

    def descriptors(self) -> tuple[I64, I64, I64]:
        """The (src, dst, sizes) this copy uses: the snapshot once started, else the buffer's current rows."""
        if self.plan is not None:
            return self.plan.src, self.plan.dst, self.plan.sizes
        return descriptor_rows(self.buf, self.count)

    def touches(self, lo: int, hi: int) -> bool:
        """Whether any descriptor's source or destination intersects [lo, hi)."""
        src, dst, sizes = self.descriptors()
        live = sizes > 0
        return bool(np.any(live & (src < hi) & (src + sizes > lo)) or
                    np.any(live & (dst < hi) & (dst + sizes > lo)))


def descriptor_rows(buf: DescriptorBuffer, count: int) -> tuple[I64, I64, I64]:
    """The first ``count`` descriptors of ``buf``: views of its (src, dst, sizes) rows, the rows themselves when it
    holds exactly ``count`` (no slicing)."""
    if count == buf.capacity:
        return buf.src, buf.dst, buf.sizes
    return buf.src[:count], buf.dst[:count], buf.sizes[:count]


class Scheduler:
    """Virtual clock, per-stream FIFOs and the heap of started ops (see the module docstring)."""

    def __init__(self, duration: Callable[[Op], float], apply: Callable[[Op, float], None],
                 halted: Callable[[], bool] | None) -> None:
        self._duration = duration
        self._apply = apply
        # Invariant: None while the device cannot be halted (no fault plan, no sticky error: the owner sets it when
        # either appears), else whether it is: no op runs once it says True.
        self.halted = halted
        # Invariant: never decreases.
        self.now = 0.0
        # Invariant: one entry per started op that will finish: (finish time, -seq, op); -seq makes ties pop
        # latest-submitted first, and seq is unique so ops themselves are never compared.
        self._heap: list[tuple[float, int, Op]] = []
        self._seq = itertools.count()
        # Invariant: _chaining is True only while run() applies ops; then _ready is None or an instant op (at
        # _ready_at) that a finish made its stream's runnable head: run() finishes it next when no heap entry
        # comes before it, else pushes it (push-then-pop without the heap). Never set outside run().
        self._chaining = False
        self._ready: Op | None = None
        self._ready_at = 0.0
        # Invariant: None, or the cost model's ``settle(op, t)``: False for a heap entry that is not the op's
        # finish (its link phase began, or a shared link moved its finish: the entry is stale).
        self.settle: Callable[[Op, float], bool] | None = None
        # Invariant: None, or called with every op as it finishes, before its effect (the timeline recorder).
        self.trace: Callable[[Op, float], None] | None = None
        # The schedule's span (``mark``): over the device ops (not records or waits) submitted with seq >= span_from.
        # Invariant: span_start is the earliest start and span_end the latest finish of those that started /
        # finished (inf / -inf while none has); span_queued counts those submitted, span_done those finished.
        self.span_from = 0
        self.span_start, self.span_end = math.inf, -math.inf
        self.span_queued = self.span_done = 0

    def push(self, op: Op, t: float) -> None:
        """Add a heap entry: ``op`` finishes at ``t`` (the cost model's re-estimates; older entries go stale)."""
        heapq.heappush(self._heap, (t, -op.seq, op))

    def mark(self) -> None:
        """Begin a new schedule span: from now on it counts only the device ops submitted after this call."""
        self.span_from = next(self._seq)
        self.span_start, self.span_end = math.inf, -math.inf
        self.span_queued = self.span_done = 0

    def submit(self, op: Op) -> None:
        """Append an op to its stream; start it now if the stream is idle."""
        op.seq = seq = next(self._seq)
        op.submitted_at = now = self.now
        queue = op.stream.queue
        queue.append(op)
        if op.__class__ is RecordOp:
            op.stream.last_record = op
        if not op.instant:
            self.span_queued += 1
        elif len(queue) == 1 and (op.__class__ is RecordOp or op.record.done):  # type: ignore[attr-defined]  # a WaitOp's
            heapq.heappush(self._heap, (now, -seq, op))   # what _start_head does for an instant op that can run now
            return
        if len(queue) == 1:
            self._start_head(op.stream, now)

    def run(self, limit: float, stops: AbstractSet[Record] | None = None) -> bool:
        """Apply, in order, the ops finishing at or before ``limit`` (none once the device is halted).

        Returns:
            True as soon as an op finished that completed a record in ``stops`` (the clock then stands at its
            finish time). A set, not a callback: a drain's pause runs tens of thousands of ops through this loop.
        """
        heap, settle, finish, pop, push = self._heap, self.settle, self._finish, heapq.heappop, heapq.heappush
        self._chaining = True
        try:
            # halted read at each op: the op before may have halted the device (a copy's illegal address)
            while heap and heap[0][0] <= limit and (self.halted is None or not self.halted()):
                t, _, op = pop(heap)
                if settle is not None and not settle(op, t):
                    continue
                while True:  # op, then the instant head its finish made ready, as long as none comes before it
                    if t > self.now:  # noqa: PLR1730  # max(now, t) without the call: a drain runs tens of thousands
                        self.now = t
                    finish(op, t)
                    if stops is not None and op.__class__ is RecordOp and op.record in stops:
                        return True
                    ready = self._ready
                    if ready is None:
                        break
                    self._ready, t = None, self._ready_at
                    if t > limit or (self.halted is not None and self.halted()) or (
                            heap and (heap[0][0] < t or (heap[0][0] == t and heap[0][1] < -ready.seq))):
                        push(heap, (t, -ready.seq, ready))  # an entry pops first (or the loop ends): as before
                        break
                    op = ready  # what popping it would give: the same op, time and order (settle: True for it)
            return False
        finally:
            self._chaining = False
            if self._ready is not None:  # a stop (or an exception) came before it ran: it waits in the heap
                push(heap, (self._ready_at, -self._ready.seq, self._ready))
                self._ready = None

    def catch_up(self) -> None:
        """:meth:`run` up to the current time (cheap when nothing is due)."""
        heap = self._heap
        if heap and heap[0][0] <= self.now:
            self.run(self.now)

    def end_hang(self, op: HangOp) -> bool:
        """End a hang op now: it finishes at the current time once it is its stream's head (at once if it is).

        Returns:
            False if it had already been ended (nothing changes), else True.
        """
        if op.ended is not None:
            return False
        op.ended = self.now
        queue = op.stream.queue
        if queue and queue[0] is op:
            heapq.heappush(self._heap, (self.now, -op.seq, op))
        return True

    def _start_head(self, stream: SimStream, t: float) -> None:
        op = stream.queue[0]
        kind = op.__class__
        start = t if t >= op.submitted_at else op.submitted_at   # never before it was submitted
        if kind is RecordOp or kind is WaitOp:  # the instant ops (tested by class: no subclass of an op exists)
            if kind is WaitOp and op.record.done_at is None:  # type: ignore[attr-defined]  # a WaitOp's record
                record: Record = op.record  # type: ignore[attr-defined]
                if record.waiters is None:
                    record.waiters = [stream]
                else:
                    record.waiters.append(stream)
                return
            # It finishes at its start (the same float, not a new one per record).
            if self._chaining and self._ready is None:  # run() finishes it next unless an entry comes first
                self._ready, self._ready_at = op, start
                return
            heapq.heappush(self._heap, (start, -op.seq, op))
            return
        if op.seq >= self.span_from and start < self.span_start:
            self.span_start = start   # a device op starts (a hang: blocks) as it becomes head
        if kind is HangOp:
            ended: float | None = op.ended  # type: ignore[attr-defined]  # a HangOp's
            if ended is not None:   # ended while queued behind other work: it finishes as it reaches the head
                heapq.heappush(self._heap, (max(t, ended), -op.seq, op))
            return
        duration = self._duration(op)
        heapq.heappush(self._heap, (start + duration if duration else start, -op.seq, op))

    def _finish(self, op: Op, t: float) -> None:
        if self.trace is not None:
            self.trace(op, t)
        stream = op.stream
        queue = stream.queue
        queue.popleft()
        kind = op.__class__
        if kind is RecordOp:
            record: Record = op.record  # type: ignore[attr-defined]  # a RecordOp's record
            record.done_at, record.done = t, True
            waiters = record.waiters
            if waiters is not None:   # (most records have none)
                record.waiters = None
                for waiter in waiters:
                    self._start_head(waiter, t)
        elif kind is not WaitOp:
            if op.seq >= self.span_from:
                self.span_done += 1
                if t > self.span_end:  # noqa: PLR1730  # max() without the call
                    self.span_end = t
            self._apply(op, t)
        if queue:
            self._start_head(stream, t)
