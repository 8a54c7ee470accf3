"""A running engine's safety net, written once for both handlers: deadlines, cancel, holds, retired streams.

Theory of operation
-------------------
A transfer that will not finish must not wedge its direction, and its memory must not be reused while its copy
may still run (R26-R28). Three pieces, each behind the ``handler_api`` seam so both handlers share them:

* **Deadlines** (R26). A transfer may carry a deadline in seconds of the backend clock, counted from its start
  on the device. Only a queue's head can have started (a stream runs its work in order), so a poll that finds
  the head pending asks whether its start event is done (:func:`started_age`): the first poll that sees it
  done is its start (a backend can only see it at a poll), and a later poll past ``started + deadline`` expires
  it. A copy proven complete is a success whatever its deadline said: the end event is always asked first.
* **Holds** (R27). An expired, cancelled, "behind" or failed transfer is *late*: reported (``success=False``)
  at once, but its copy may still run. :class:`Holds` (one per worker, shared by both directions) holds what a
  late copy may write for any access and what it only reads against writes, and refuses a submission that would
  conflict (:class:`~kvoffload_ref.errors.BlocksHeldError`). The check is vectorized: a count per block id.
* **Retired streams** (R28). The stream of a late transfer is retired the moment the transfer becomes late: new
  work in that direction goes to a fresh stream. :class:`Retired` keeps each retired stream with what is still
  queued on it (live transfers ahead of a cancelled one first, then the late ones) and polls it head first
  with the caller's observer: a live transfer proven is reported as usual (the handler's callback), a late one
  proven ends its hold (a :class:`~kvoffload_ref.results.ReleasedHold` for ``take_released``) and only then are
  its events and descriptor buffer freed. An emptied retired stream is destroyed (proven idle); at shutdown
  what is left is drained within the deadline and the rest handed back as unproven.

Every call here is made by the worker's lock holder (or the shutdown thread), like the handlers' own (R19).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Backend, Event, Stream
from kvoffload_ref.errors import BlocksHeldError, DeviceError, TransferExpired
from kvoffload_ref.results import (
    TRANSFER_TYPE,
    HeldBlocks,
    ReleasedHold,
    TransferResult,
    Unproven,
    destination_blocks,
    failure,
)
from kvoffload_ref.shield import Leaks
from kvoffload_ref.specs import Direction
from kvoffload_ref.validate import Int64Array

__all__ = ["Health", "Holds", "LateTransfer", "Mark", "Retired", "Running", "expire", "started_age"]

logger = logging.getLogger("kvoffload_ref.worker")


class LateTransfer(Unproven, Protocol):
    """What the shared pieces read and write of a handler's transfer record (both records have these fields):
    what a failed result is built from (``results.Unproven``: job id, destination blocks and groups, tag), and:"""

    @property
    def start(self) -> Event: ...
    @property
    def end(self) -> Event: ...
    @property
    def gpu_ids(self) -> Int64Array: ...  # the GPU block ids of its specs
    @property
    def cpu_ids(self) -> Int64Array: ...  # the CPU chunk ids of its specs
    @property
    def deadline(self) -> float | None: ...  # seconds from its device start (R26), or None
    @property
    def broken(self) -> DeviceError | None: ...  # its end event was never recorded
    started: float | None  # backend time a poll first saw its start event done, or None
    late: float | None  # backend time it became late (reported, held), or None while live
    resolved: bool  # it left its queue (or was reported late)
    warned: bool  # the stall warning was logged for it (R30)


T = TypeVar("T", bound=LateTransfer)


# -- holds (R27) --------------------------------------------------------------------------------------------------
class Holds:
    """The blocks late copies may still touch, for the whole worker (both directions), with a count per id.

    A store reads GPU blocks and writes CPU chunks; a load reads CPU chunks and writes GPU blocks. What a late copy
    writes is held for any access; what it reads is held against writes (two reads never conflict, R20).
    """

    def __init__(self, gpu_blocks: int, cpu_chunks: int) -> None:
        # Invariant: per id, the number of live holds that may write it (_any), and of all live holds (_all: those
        # that may write it and those that only read it).
        self._gpu_any = np.zeros(gpu_blocks, np.int32)
        self._gpu_all = np.zeros(gpu_blocks, np.int32)
        self._cpu_any = np.zeros(cpu_chunks, np.int32)
        self._cpu_all = np.zeros(cpu_chunks, np.int32)
        # Invariant: the number of live holds (0: the check costs one comparison).
        self.count = 0
        # Invariant: ended holds not yet handed out by take_released, in the order they ended.
        self._released: list[ReleasedHold] = []

    def admit(self, direction: Direction, job_id: int, src: object, dst: object) -> tuple[Int64Array, Int64Array]:
        """R27 at submission, for both handlers: the (GPU block ids, CPU chunk ids) of a transfer's checked specs
        (a store's GPU spec is its source, a load's its destination), once :meth:`check` found no held block in the
        way. Raises as :meth:`check` (nothing done yet)."""
        gpu_spec, cpu_spec = (src, dst) if direction == "store" else (dst, src)
        gpu_ids, cpu_ids = gpu_spec.block_ids, cpu_spec.block_ids  # type: ignore[attr-defined]  # checked specs
        self.check(direction, job_id, gpu_ids, cpu_ids)
        return gpu_ids, cpu_ids

    def check(self, direction: Direction, job_id: int, gpu_ids: Int64Array, cpu_ids: Int64Array) -> None:
        """R27: refuse a submission that would touch a held block the wrong way. With holds present a submission that
        conflicts with none costs two gathers (``kvoffload-ref bench``: running_held_submit).

        Raises:
            BlocksHeldError: a block it writes is held at all, or a block it reads is held for any access.
        """
        if not self.count:
            return
        store = direction == "store"  # a store reads GPU blocks and writes CPU chunks; a load the other way round
        reads, writes = (gpu_ids, cpu_ids) if store else (cpu_ids, gpu_ids)
        held_any, held_all = (self._gpu_any, self._cpu_all) if store else (self._cpu_any, self._gpu_all)
        if not np.count_nonzero(held_any.take(reads)) and not np.count_nonzero(held_all.take(writes)):
            return  # the common case: no conflict
        read_hit, write_hit = held_any[reads] > 0, held_all[writes] > 0
        names = ("GPU block", "CPU chunk") if store else ("CPU chunk", "GPU block")
        for access, what, hit in (("read", names[0], reads[read_hit]), ("write", names[1], writes[write_hit])):
            if len(hit):
                raise BlocksHeldError(
                    f"{direction} job {job_id} would {access} {what}s {sorted({int(i) for i in hit})}, held by a late "
                    "copy that may still run (R27); submit again once worker.take_released() handed out their "
                    "release, or use other blocks")

    def hold_many(self, direction: Direction, gpu_ids: Sequence[Int64Array], cpu_ids: Sequence[Int64Array]) -> None:
        """Hold the blocks of ``len(gpu_ids)`` late copies (one entry per copy in each list), in one update."""
        self._add(direction, _joined(gpu_ids), _joined(cpu_ids), 1)
        self.count += len(gpu_ids)

    def end(self, direction: Direction, transfer: LateTransfer) -> None:
        """The late copy was observed done: its hold ends, and a release record waits for take_released."""
        self._add(direction, transfer.gpu_ids, transfer.cpu_ids, -1)
        self.count -= 1
        self._released.append(ReleasedHold(transfer.job_id, direction, destination_blocks(transfer.gpu_ids),
                                           destination_blocks(transfer.cpu_ids), transfer.user_tag))

    def _add(self, direction: Direction, gpu_ids: Int64Array, cpu_ids: Int64Array, delta: int) -> None:
        np.add.at(self._gpu_all, gpu_ids, delta)
        np.add.at(self._cpu_all, cpu_ids, delta)
        written, ids = (self._cpu_any, cpu_ids) if direction == "store" else (self._gpu_any, gpu_ids)
        np.add.at(written, ids, delta)  # a store's late copy may write CPU chunks; a load's, GPU blocks

    def held(self) -> HeldBlocks:
        """A snapshot of what is held (R27)."""
        def ids(mask: npt.NDArray[np.bool_]) -> tuple[int, ...]:
            return tuple(int(i) for i in np.flatnonzero(mask))
        gpu_any, gpu_all = self._gpu_any > 0, self._gpu_all > 0
        cpu_any, cpu_all = self._cpu_any > 0, self._cpu_all > 0
        return HeldBlocks(ids(gpu_all), ids(cpu_all), ids(gpu_all & ~gpu_any), ids(cpu_all & ~cpu_any))

    def take_released(self) -> list[ReleasedHold]:
        """Hand out each ended hold once (R27)."""
        released, self._released = self._released, []
        return released


def _joined(arrays: Sequence[Int64Array]) -> Int64Array:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


# -- deadlines (R26) ----------------------------------------------------------------------------------------------
def started_age(backend: Backend, head: LateTransfer, now: float) -> float | None:
    """How long ``head`` has run on the device at ``now`` (None: not started yet). Its start is the first poll
    that sees its start event done (only a queue's head can have started).

    Raises:
        DeviceError: the start event's query failed (the head fails as its end event's would, R5).
    """
    if head.started is None:
        if not backend.query(head.start):
            return None
        head.started = now
    return now - head.started


def expire(direction: Direction, late: Sequence[LateTransfer], reason: str, cancelled: Iterable[int] = ()
           ) -> list[TransferResult]:
    """R26/R22: the results of transfers that became late, in queue order: the first with ``reason``, those behind it
    "behind" naming it, unless cancelled themselves (``cancelled``). One loop, its texts prepared once: expiring the
    head of 10,000 queued transfers is one reap (``kvoffload-ref bench``: running_expiry)."""
    kind, asked, head = TRANSFER_TYPE[direction], set(cancelled), late[0]
    first, held = head.job_id, _HELD_TEXT
    text = (f"{direction} job {first} passed its deadline of {head.deadline} s on the device"
            if reason == "deadline" else f"{direction} job {first} was cancelled")
    results = [failure(kind, head, TransferExpired(text + held, reason, first))]  # R22: blocks, groups, tag
    behind = f" was queued behind job {first}, which {_ENDED[reason]}{held}"
    for transfer in itertools.islice(late, 1, None):
        job = transfer.job_id
        error = (TransferExpired(f"{direction} job {job} was cancelled{held}", "cancel", job) if job in asked else
                 TransferExpired(f"{direction} job {job}{behind}", "behind", job, first))
        results.append(failure(kind, transfer, error))
    return results


_HELD_TEXT: Final = ("; its copy may still run: its blocks are held until it is observed done (worker.held(), "
                     "worker.take_released())")
_ENDED: Final = {"deadline": "passed its deadline", "cancel": "was cancelled"}


@dataclasses.dataclass(eq=False)
class Mark(Generic[T]):
    """What a wait settles on (R6): the last listed job of the current stream and the listed live jobs of retired
    streams (each stream is FIFO; a retired one never holds the current one back, R28)."""

    transfers: list[T]

    @property
    def job_id(self) -> int:
        return self.transfers[-1].job_id

    @property
    def resolved(self) -> bool:
        return all(t.resolved for t in self.transfers)


# -- retired streams (R28) ----------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Lane(Generic[T]):
    stream: Stream  # Invariant: retired: no new work is ever queued on it
    queue: collections.deque[T]  # Invariant: submission order; live (unreported) transfers first, then late ones


class Retired(Generic[T]):
    """One handler's retired streams and what is still queued on them (see the module docstring)."""

    def __init__(self, backend: Backend, direction: Direction, running: Running, leaks: Leaks) -> None:
        self._backend, self._direction, self._leaks = backend, direction, leaks
        self._running, self._holds = running, running.holds
        # Invariant: oldest first; each has something queued (an emptied lane's stream is destroyed at once).
        self.lanes: list[_Lane[T]] = []

    def __bool__(self) -> bool:
        return bool(self.lanes)

    def retire(self, stream: Stream | None, live: Sequence[T], late: Sequence[T], now: float) -> None:
        """Retire ``stream``: ``live`` (ahead, still to be reported) and ``late`` (reported, now held) stay on it."""
        self.hold(late, now)
        if stream is None:  # nothing was ever queued on it (a handler without a stream has no transfers)
            return
        if not live and not late:
            self._destroy(stream)
            return
        self.lanes.append(_Lane(stream, collections.deque([*live, *late])))

    def hold(self, late: Iterable[T], now: float) -> None:
        """Mark transfers late (their results are reported by the caller) and hold their blocks (R27), all of them
        in one vectorized update."""
        new = [t for t in late if t.late is None]
        for transfer in new:
            transfer.late = now
        if new:
            self._holds.hold_many(self._direction, [t.gpu_ids for t in new], [t.cpu_ids for t in new])

    def poll(self, observe: Callable[[Event], bool], proven: Callable[[T], None],
             failed: Callable[[list[T], DeviceError, float], None], free: Callable[[T], None], now: float,
             expired: Callable[[list[T], list[TransferResult]], None] | None = None) -> None:
        """Observe each retired stream head first until a head is pending: a live head proven goes to ``proven``
        (reported or counted drained by the handler's table, before it leaves its stream: R14), a late one ends its
        hold and goes to ``free``; a head whose observation fails hands the live transfers of that stream to
        ``failed`` (with ``now``, when the poll began) and the stream waits for the next poll. With ``expired`` (a
        running engine's polls, not a drain's), a pending live head past its deadline (R26) makes it and the live
        ones behind it late: their results go to ``expired``, then they are held."""
        for lane in list(self.lanes):
            queue = lane.queue
            while queue:
                head = queue[0]
                try:
                    if head.broken is not None:
                        raise head.broken
                    done = observe(head.end)
                    if not done and expired is not None and head.late is None and self._running.overdue(
                            self._backend, self._direction, head):
                        self._end(queue, head, "deadline", (), now, expired)
                except DeviceError as exc:
                    live = [t for t in queue if t.late is None]
                    if live:
                        failed(live, exc, now)
                    break
                if not done:
                    break
                if head.late is None:
                    proven(head)
                    queue.popleft()
                else:
                    queue.popleft()
                    self._holds.end(self._direction, head)
                    free(head)
                head.resolved = True
            if not queue and lane in self.lanes:  # proven idle: destroyed, then forgotten (an interrupt in the
                self._destroy(lane.stream)  # destroy leaves it listed: the next poll, or shutdown, releases it, R14)
                self.lanes.remove(lane)

    def end_stream(self, stream: Stream | None, queued: Sequence[T], index: int, reason: str,
                   cancelled: Iterable[int], now: float) -> tuple[list[T], list[TransferResult]]:
        """R26-R28: ``queued[index:]`` (the live transfers of the current ``stream``, in order) became late: their
        results (``expire``), held; the stream is retired with the ones ahead, still live. Returns (late, results)
        for the handler to report (its table step taken)."""
        ahead, late = list(queued[:index]), list(queued[index:])
        for transfer in late:
            transfer.resolved = True
        results = expire(self._direction, late, reason, cancelled)
        self.retire(stream, ahead, late, now)
        return late, results

    def cancel(self, job_ids: set[int], now: float, expired: Callable[[list[T], list[TransferResult]], None]
               ) -> None:
        """R26: on each retired stream, the first listed live job and the live ones behind it become late: their
        results go to ``expired`` (the handler reports them), then they are held."""
        for lane in self.lanes:
            head = next((t for t in lane.queue if t.late is None and t.job_id in job_ids), None)
            if head is not None:
                self._end(lane.queue, head, "cancel", job_ids, now, expired)

    def _end(self, queue: Iterable[T], first: T, reason: str, cancelled: Iterable[int], now: float,
             expired: Callable[[list[T], list[TransferResult]], None]) -> None:
        """``first`` and the live transfers behind it on a retired stream became late: reported, then held."""
        live = [t for t in queue if t.late is None]
        late = live[live.index(first):]
        for transfer in late:
            transfer.resolved = True
        expired(late, expire(self._direction, late, reason, cancelled))
        self.hold(late, now)

    def has_live(self) -> bool:
        """Whether a live (unreported) transfer is still queued on a retired stream."""
        return any(t.late is None for lane in self.lanes for t in lane.queue)

    def marks(self, job_ids: set[int]) -> list[T]:
        """The live transfers among ``job_ids`` on retired streams (a wait settles once they are resolved)."""
        return [t for lane in self.lanes for t in lane.queue if t.late is None and t.job_id in job_ids]

    def transfers(self) -> list[T]:
        """Everything still queued on retired streams, oldest stream first."""
        return [t for lane in self.lanes for t in lane.queue]

    def streams(self) -> list[Stream]:
        """The retired streams not yet proven idle."""
        return [lane.stream for lane in self.lanes]

    def take(self, queue: Sequence[T], current: bool = False, first: T | None = None
             ) -> tuple[list[T], list[T], list[Stream]]:
        """Shutdown: hand over what the drain could not prove, none kept here: (live, late, the retired streams).
        ``live`` holds the current stream's ``queue`` too: the retired streams' first, or the queue's when its head
        failed (``current``); R22 names a retired stream's failed head (``first``) first."""
        queued, streams = self.transfers(), self.streams()
        self.lanes = []
        retired = [t for t in queued if t.late is None]
        live = [*queue, *retired] if current else [*retired, *queue]
        if first is not None and first in live:  # R22: the failed head of a retired stream is named first
            live.remove(first)
            live.insert(0, first)
        return live, [t for t in queued if t.late is not None], streams

    def late_count(self) -> int:
        """How many late transfers (held, not yet observed done) are queued on retired streams."""
        return sum(t.late is not None for lane in self.lanes for t in lane.queue)

    def health(self, head_age: float | None, now: float, unproven_streams: int = 0) -> Health:
        """R30: this direction's health at ``now``: ``head_age`` is the current stream's head's device age (None:
        no head, or not started); the live heads of retired streams count as last seen started; the holds are this
        direction's late copies'; ``unproven_streams`` retired streams the shutdown drain could not prove idle."""
        ages = [now - lane.queue[0].started for lane in self.lanes
                if lane.queue[0].late is None and lane.queue[0].started is not None]
        if head_age is not None:
            ages.append(head_age)
        late = [t for t in self.transfers() if t.late is not None]
        oldest = min((t.late for t in late if t.late is not None), default=None)  # the oldest hold's start
        return Health(max(ages, default=None), _distinct(t.gpu_ids for t in late), _distinct(t.cpu_ids for t in late),
                      None if oldest is None else now - oldest, len(self.lanes) + unproven_streams)

    def _destroy(self, stream: Stream) -> None:
        """A retired stream proven idle (nothing left on it) is destroyed; a failure is leaked (R16)."""
        self._leaks.release(self._backend.destroy_stream, "stream", stream,
                            f"destroy a retired {self._direction} stream")


# -- health (R30) -------------------------------------------------------------------------------------------------
class Health(NamedTuple):
    """R30: the health fields of one direction's ``HandlerStats`` (its last five, in order)."""

    oldest_unproven_age: float | None  # device age of the oldest queued transfer not yet proven, or None
    held_gpu_blocks: int  # distinct GPU blocks this direction's late copies hold
    held_cpu_chunks: int  # distinct CPU chunks this direction's late copies hold
    oldest_hold_age: float | None  # seconds since the oldest of them became late, or None
    retired_streams: int  # retired streams not yet proven idle


def _distinct(ids: Iterable[Int64Array]) -> int:
    arrays = list(ids)
    return len(np.unique(np.concatenate(arrays))) if arrays else 0


class Running:
    """What both handlers of one worker share of a running engine: the holds (R27) and the stall warning (R30)."""

    def __init__(self, holds: Holds, stall_warning: float | None = None) -> None:
        self.holds = holds  # Invariant: one per worker, shared by both directions
        self.stall_warning = stall_warning  # Invariant: None (off) or seconds > 0

    @property
    def watches(self) -> bool:
        """Whether a pending head's device age matters without a deadline (the stall warning is on)."""
        return self.stall_warning is not None

    @staticmethod
    def head_age(head: LateTransfer | None, now: float) -> float | None:
        """R30: the device age at ``now`` of the current stream's pending head, from the start a poll saw (None: no
        head, or no poll saw it start). ``stats()`` asks the device nothing: a snapshot observes nothing the caller
        did not, consumes no fault and fails no job; the polls that watch a head (a deadline on it, the stall
        warning on) see its start (R26)."""
        return None if head is None or head.started is None else now - head.started

    def overdue(self, backend: Backend, direction: Direction, head: LateTransfer) -> bool:
        """R26/R30: whether a pending head passed its deadline (counted from the first poll that saw it start); a
        head unproven longer than the stall warning is logged once. Asks nothing without either.

        Raises:
            DeviceError: its start event's query failed (the head fails as its end event's would, R5).
        """
        if head.deadline is None and not self.watches:
            return False
        age = started_age(backend, head, backend.monotonic())
        if age is None:
            return False
        if head.deadline is not None and age >= head.deadline:
            return True
        self.check_stall(direction, head, age)
        return False

    def check_stall(self, direction: Direction, head: LateTransfer, age: float) -> None:
        """R30: log a transfer unproven for longer than ``stall_warning`` once, naming it, its direction and age."""
        if self.stall_warning is not None and age > self.stall_warning and not head.warned:
            head.warned = True
            logger.warning("%s job %d has not completed %.3f s after it started on the device (stall_warning=%s s)",
                           direction, head.job_id, age, self.stall_warning)
