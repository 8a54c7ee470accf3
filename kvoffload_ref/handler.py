"""DirectionHandler: one direction's FIFO of in-flight transfers, its pools, and its bounded drain.

Theory of operation
-------------------
``submit`` validates and plans the copies (the handler's ``layout.Planner``, built once over its geometry;
invalid input raises before any device work and before anything is taken from a pool, R7), takes a stream, two
events and a descriptor buffer from the pools (or creates them), writes the copies straight into the descriptor
buffer (no per-transfer arrays), and queues on the stream: a wait
for a marker event just recorded on the compute stream, a wait for the previous transfer's end event (R4), the
start event, one batched copy, the end event. (The marker goes back to the pool at once: a stream's wait captures
the record current when it is issued, so re-recording the marker later cannot affect it.)

A transfer leaves the queue only once *proven*: its end event was observed done without error (R5, R10). Proven
transfers give their stream, events and descriptor buffer back to the pools. When observing the head raises,
the head and everything queued behind it fail together (their data cannot be trusted) and their resources go to
the *unproven* bin: they are never reused, and at shutdown they are released only if the device-level proof
succeeds (R13), else the descriptor buffers are quarantined (a copy may still be reading them).

``drain`` is the shutdown half: head first, each wait bounded by the one shutdown deadline (R11), stopping at
the first failure and abandoning the rest (R10). ``release`` then frees the transfer-side resources and reports
what must be quarantined. The handler never holds the region (R1): it gets tensor geometries only.

All state changes go through ``lifecycle.HANDLER_TABLE``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from kvoffload_ref import lifecycle
from kvoffload_ref.backends.base import Backend, DescriptorBuffer, Event, Stream, Tag, poll_until
from kvoffload_ref.errors import DeadlineExceeded, DeviceError
from kvoffload_ref.layout import (
    CPULoadStoreSpec,
    Direction,
    GPULoadStoreSpec,
    KVCacheLayout,
    Planner,
    PreparedPlan,
    TensorGeometry,
)
from kvoffload_ref.lifecycle import Action, Fate, HandlerInput, HandlerState

__all__ = ["DirectionHandler", "DrainOutcome", "HandlerStats", "ReleaseOutcome", "TransferResult"]

logger = logging.getLogger("kvoffload_ref.handler")



@dataclasses.dataclass(frozen=True)
class TransferResult:
    """The outcome of one transfer, reported exactly once by ``get_finished`` (R5).

    Attributes:
        job_id: the caller's id.
        success: True only if the transfer's completion was proven.
        transfer_size: bytes copied (None when not proven).
        transfer_time: seconds between the transfer's start and end events (None when not proven or unknown).
        error: why it failed (None on success).
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    error: BaseException | None = None


_T = TypeVar("_T")


def _detached(exc: DeviceError) -> DeviceError:
    """The error without the tracebacks of its chain: a stored error must not keep frames (and their objects)."""
    link: BaseException | None = exc
    while link is not None:
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


class _Taken:
    """What one submission took so far (from a pool or newly created), to give back if it fails."""

    def __init__(self) -> None:
        # Invariant: (pool the item belongs to, item, created by this submission), in taking order.
        self.items: list[tuple[list[Any], Any, bool]] = []
        # Invariant: True once copy_batch accepted the copy (the device may read the descriptors from then on).
        self.copy_queued = False

    def take(self, pool: list[_T], create: Callable[[], _T]) -> _T:
        """Pop an idle item from the pool, or create one."""
        item, created = (pool.pop(), False) if pool else (create(), True)
        self.items.append((pool, item, created))
        return item

    def items_of(self, pool: list[Any]) -> list[Any]:
        return [item for p, item, _ in self.items if p is pool]


@dataclasses.dataclass
class _Transfer:
    job_id: int
    stream: Stream
    events: tuple[Event, Event]  # (start, end)
    descriptors: DescriptorBuffer | None  # None for a zero-op transfer
    nbytes: int

    @property
    def start(self) -> Event:
        return self.events[0]

    @property
    def end(self) -> Event:
        return self.events[1]


@dataclasses.dataclass(frozen=True)
class HandlerStats:
    """A frozen snapshot of one handler (never a view of its private fields)."""

    direction: str
    state: str
    queued: int  # submitted, completion not yet known
    unreported: int  # completion known, not yet returned by get_finished
    submitted: int
    completed: int  # proven complete
    failed: int  # reported success=False
    abandoned: int  # left unproven by the shutdown drain
    unproven: int  # transfers whose resources wait for the device-level proof
    pooled_streams: int
    pooled_events: int
    pooled_descriptors: int


@dataclasses.dataclass(frozen=True)
class DrainOutcome:
    """What one handler's shutdown drain established (R10).

    Attributes:
        drained: transfers proven complete during the drain.
        abandoned: transfers left with unknown completion.
        error: the first failure (a DeviceError, DeadlineExceeded, or the interrupting BaseException), or None.
        clean: every transfer this handler ever submitted was proven complete by its own event (R13).
    """

    drained: int
    abandoned: int
    error: BaseException | None
    clean: bool


@dataclasses.dataclass(frozen=True)
class ReleaseOutcome:
    """What ``release`` did with the unproven transfers' descriptor buffers."""

    quarantined: tuple[DescriptorBuffer, ...]


class DirectionHandler:
    """One direction (store: GPU->CPU, or load: CPU->GPU) of a worker. Built and driven by the worker."""

    def __init__(self, backend: Backend, direction: Direction, layout: KVCacheLayout,
                 gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry], blocks_per_chunk: int,
                 *, prewarm: int = 0) -> None:
        """Build a handler; ``prewarm`` streams (and three events each) are created up front.

        Raises:
            InvalidTransferError: the geometry does not fit the layout (nothing was created).
            DeviceError: creating a prewarmed stream or event failed (what was created is destroyed).
        """
        self._backend = backend
        self.direction: Direction = direction
        self._machine = f"{direction} handler"  # the lifecycle machine's name in error messages
        # Invariant: holds geometry only (addresses and strides, validated once here), never the region (R1).
        self._planner = Planner(layout, gpu, cpu, blocks_per_chunk)
        # Invariant: submission order; each waits on its predecessor's end event (R4); none is proven yet.
        self._queue: collections.deque[_Transfer] = collections.deque()
        # Invariant: completion known (proven or failed), not yet reported; in resolution (= submission) order.
        self._resolved: list[TransferResult] = []
        # Invariant: job ids in _queue or _resolved (the ids "in flight" for R7's duplicate check).
        self._jobs: set[int] = set()
        # Invariant: transfers whose completion is unknown; their resources are never reused.
        self._unproven: list[_Transfer] = []
        # Invariant: pooled objects are idle (their last use was proven complete); LIFO.
        self._streams: list[Stream] = []
        self._events: list[Event] = []
        self._descriptors: list[DescriptorBuffer] = []
        self._counts = collections.Counter[str]()
        # Invariant: the first failure of the shutdown drain (None before it or if there was none).
        self._drain_error: BaseException | None = None
        # Invariant: changed only through lifecycle.step(HANDLER_TABLE, ...).
        self.state = HandlerState.ACCEPTING
        self._prewarm(prewarm)

    # -- submission -----------------------------------------------------------------------------------------------
    def submit(self, job_id: int, src: GPULoadStoreSpec | CPULoadStoreSpec,
               dst: GPULoadStoreSpec | CPULoadStoreSpec) -> None:
        """Queue one transfer (see the module docstring for what is queued).

        Raises:
            InvalidTransferError: the specs do not fit the layout (nothing changed, R7).
            WorkerClosedError: the handler is draining or closed (R8).
            DeviceError: a device call failed; nothing was queued and what was taken for it is given back.
        """
        self._check_state(HandlerInput.SUBMIT)
        plan = self._planner.prepare(self.direction, src, dst)  # R7: every check happens here, before any take
        taken = _Taken()
        try:
            transfer = self._enqueue(job_id, plan, taken)
        except BaseException:
            self._undo(taken)
            raise
        self._step(HandlerInput.SUBMIT)
        self._queue.append(transfer)
        self._jobs.add(job_id)
        self._counts["submitted"] += 1

    def _enqueue(self, job_id: int, plan: PreparedPlan, taken: _Taken) -> _Transfer:
        backend, tag = self._backend, (self.direction, job_id)
        descriptors = None
        if plan.num_ops:
            descriptors = self._take_descriptors(plan.num_ops, tag, taken)
            plan.write(descriptors.src, descriptors.dst, descriptors.sizes)
        stream = taken.take(self._streams, lambda: backend.create_stream(tag=tag))
        marker, start, end = (taken.take(self._events, lambda: backend.create_event(tag=tag)) for _ in range(3))
        backend.record(marker, backend.current_stream(), tag=tag)
        backend.wait_event(stream, marker)  # R4: after the compute work queued so far
        if self._queue:
            backend.wait_event(stream, self._queue[-1].end)  # R4: after this handler's previous transfer
        backend.record(start, stream, tag=tag)
        if descriptors is not None:
            backend.copy_batch(stream, descriptors, plan.num_ops, tag=tag)
            taken.copy_queued = True
        backend.record(end, stream, tag=tag)
        self._events.append(marker)  # reusable at once: the stream's wait captured the record it needs
        return _Transfer(job_id, stream, (start, end), descriptors, plan.nbytes)

    def _take_descriptors(self, count: int, tag: Tag, taken: _Taken) -> DescriptorBuffer:
        while self._descriptors and self._descriptors[-1].capacity < count:
            self._backend.free_descriptors(self._descriptors.pop())  # idle but too small: drop it, as upstream
        return taken.take(self._descriptors, lambda: self._backend.alloc_descriptors(count, tag=tag))

    def _undo(self, taken: _Taken) -> None:
        """Give back what a failed submission took (newest first). Once its copy is queued, the device may still
        read its descriptors: then nothing is reusable and it all waits for the device-level proof."""
        if taken.copy_queued:
            stream = cast(Stream, taken.items_of(self._streams)[0])
            marker, start, end = (cast(Event, e) for e in taken.items_of(self._events))
            descriptors = cast(DescriptorBuffer, taken.items_of(self._descriptors)[0])
            self._unproven.append(_Transfer(-1, stream, (start, end), descriptors, 0))
            self._events.append(marker)
            return
        release: dict[int, Callable[[Any], None]] = {
            id(self._streams): self._backend.destroy_stream,
            id(self._events): self._backend.destroy_event,
            id(self._descriptors): self._backend.free_descriptors,
        }
        for pool, item, created in reversed(taken.items):
            # A stream may already hold waits queued for this submission; if what they wait for never completes,
            # a stream given back to the pool would hang every later transfer on it: destroy it instead (R4).
            if created or pool is self._streams:
                release[id(pool)](item)
            else:
                pool.append(item)

    # -- completion -----------------------------------------------------------------------------------------------
    def knows(self, job_id: int) -> bool:
        """Whether the job is in flight here or completed but not yet reported."""
        return job_id in self._jobs

    def get_finished(self) -> list[TransferResult]:
        """Reap what is proven (or failed) without blocking; report each job once, in submission order (R5)."""
        if self.state is not HandlerState.ACCEPTING:
            return []
        while self._queue and self._observe_head(self._backend.query):
            pass
        results, self._resolved = self._resolved, []
        self._jobs.difference_update(r.job_id for r in results)
        return results

    def wait(self, job_ids: Iterable[int], deadline: float | None) -> None:
        """Block until each listed job here is proven or failed (R6); reports nothing.

        Args:
            job_ids: ids to wait for; unknown or already-resolved ids are ignored.
            deadline: absolute time on the backend clock, or None for no bound (then a blocking synchronize).

        Raises:
            DeadlineExceeded: the deadline passed first (what was proven so far stays proven).
        """
        if self.state is not HandlerState.ACCEPTING:
            return
        targets = {t.job_id for t in self._queue} & set(job_ids)
        while targets and self._queue:
            head = self._queue[0]
            observed = self._observe_head(self._blocking_observer(deadline))
            if not observed:
                raise DeadlineExceeded(f"{self.direction} job {head.job_id} not proven complete by the deadline")
            targets.discard(head.job_id)
            targets &= {t.job_id for t in self._queue}

    def _blocking_observer(self, deadline: float | None) -> Callable[[Event], bool]:
        if deadline is None:
            def synchronize(event: Event) -> bool:
                self._backend.synchronize(event)
                return True
            return synchronize
        return lambda event: poll_until(self._backend, lambda: self._backend.query(event), deadline)

    def _observe_head(self, observe: Callable[[Event], bool]) -> bool:
        """Observe the head's end event once: prove it, fail the queue, or (False) leave it pending."""
        head = self._queue[0]
        try:
            done = observe(head.end)
        except DeviceError as exc:
            self._fail_queue(exc)
            return True
        if done:
            self._prove_head()
        return done

    def _prove_head(self) -> None:
        self._step(HandlerInput.HEAD_PROVEN)
        head = self._queue.popleft()
        if self.state is HandlerState.ACCEPTING:  # after shutdown began nothing is reported (R8)
            self._resolved.append(TransferResult(head.job_id, True, head.nbytes, self._seconds(head)))
        self._recycle(head)
        self._counts["completed"] += 1

    def _seconds(self, transfer: _Transfer) -> float | None:
        try:
            return self._backend.elapsed(transfer.start, transfer.end)
        except DeviceError:
            logger.warning("Could not read the timing of %s job %d", self.direction, transfer.job_id,
                           exc_info=True)
            return None

    def _fail_queue(self, exc: DeviceError) -> None:
        """R5/R10: observing the head raised. It and everything behind it have unknown completion: their
        resources go to the unproven bin. While accepting, they are reported failed; while draining, abandoned."""
        self._step(HandlerInput.HEAD_FAILED)
        failed = list(self._queue)
        if self.state is HandlerState.ABANDONED:
            self._queue.clear()
            self._unproven.extend(failed)
            self._counts["abandoned"] += len(failed)
            self._drain_error = self._drain_error or exc
            logger.error("Failed to synchronize transfer end event; skipping %d remaining transfers",
                         len(failed) - 1, exc_info=exc)
            return
        self._queue.clear()
        self._unproven.extend(failed)
        self._counts["failed"] += len(failed)
        head = failed[0]
        exc = _detached(exc)  # a stored error must not keep the frames (and the worker) it was raised through
        self._resolved.append(TransferResult(head.job_id, False, error=exc))
        for transfer in failed[1:]:
            behind = DeviceError(f"{self.direction} job {transfer.job_id} was queued behind job "
                                 f"{head.job_id}, which failed: its data cannot be trusted", exc.status)
            behind.__cause__ = exc
            self._resolved.append(TransferResult(transfer.job_id, False, error=behind))

    def _recycle(self, transfer: _Transfer) -> None:
        self._streams.append(transfer.stream)
        self._events.extend(reversed(transfer.events))
        if transfer.descriptors is not None:
            self._descriptors.append(transfer.descriptors)

    # -- shutdown -------------------------------------------------------------------------------------------------
    def drain(self, deadline: float, *, interrupted: bool = False) -> DrainOutcome:
        """Shutdown drain (R10): prove transfers head first within the deadline; stop at the first failure.

        Args:
            deadline: absolute time on the backend clock shared by the whole shutdown (R11). Each wait polls at
                least once, so completed work is still proven when the budget is spent.
            interrupted: a BaseException already stopped the shutdown (R14): abandon everything, wait for nothing.

        Returns:
            The outcome. A BaseException raised while waiting abandons the rest and is re-raised (R14).
        """
        self._step(HandlerInput.BEGIN_DRAIN)
        self._resolved.clear()  # nothing is reported after shutdown began (R8)
        self._jobs.clear()
        drained = 0
        try:
            if interrupted and self._queue:
                self._abandon(HandlerInput.INTERRUPT, None)
            observe = self._blocking_observer(deadline)
            while self._queue:
                head = self._queue[0]
                if self._observe_head(observe):
                    drained += self.state is HandlerState.DRAINING
                    continue
                timeout = DeadlineExceeded(f"{self.direction} job {head.job_id} was not proven complete "
                                           "within the shutdown timeout")
                self._abandon(HandlerInput.DEADLINE, timeout)
        except BaseException as exc:
            if self.state is HandlerState.DRAINING and self._queue:
                self._abandon(HandlerInput.INTERRUPT, exc)
            raise
        finally:
            if self.state is HandlerState.DRAINING:
                self._step(HandlerInput.QUEUE_EMPTY)
        return DrainOutcome(drained, self._counts["abandoned"], self._drain_error, not self._unproven)

    def _abandon(self, event: HandlerInput, error: BaseException | None) -> None:
        """Stop draining: every queued transfer's completion is unknown (R10)."""
        self._step(event)
        remaining = list(self._queue)
        self._queue.clear()
        self._unproven.extend(remaining)
        self._counts["abandoned"] += len(remaining)
        self._drain_error = self._drain_error or error
        if error is not None:
            logger.error("Failed to synchronize transfer end event; skipping %d remaining transfers",
                         len(remaining) - 1, exc_info=error)

    def streams_in_use(self) -> list[Stream]:
        """Every stream this handler still holds (pooled and unproven): what the device-level proof covers."""
        return [*self._streams, *(t.stream for t in self._unproven)]

    @property
    def clean(self) -> bool:
        """Every transfer ever submitted here was proven complete by its own event (R13's clean path)."""
        return not self._unproven and not self._queue

    def release(self, fate: Fate) -> ReleaseOutcome:
        """Release the transfer-side resources after the drain (R10).

        Streams, events and the descriptor buffers of proven transfers are always released. The descriptor
        buffers of unproven transfers are freed if ``fate`` is RELEASE, else returned for quarantine (and
        marked quarantined in the ledger). Idempotent.
        """
        _, action = lifecycle.step(lifecycle.HANDLER_TABLE, self._machine, self.state, HandlerInput.RELEASE)
        if action is Action.NOTHING:
            return ReleaseOutcome(())
        self._step(HandlerInput.RELEASE)
        backend = self._backend
        destroy_stream, destroy_event, free = backend.destroy_stream, backend.destroy_event, backend.free_descriptors
        for stream in self.streams_in_use():
            destroy_stream(stream)
        for event in [*self._events, *(e for t in self._unproven for e in t.events)]:
            destroy_event(event)
        for buf in self._descriptors:
            free(buf)
        unproven = [t.descriptors for t in self._unproven if t.descriptors is not None]
        self._streams, self._events, self._descriptors, self._unproven = [], [], [], []
        if fate is Fate.RELEASE:
            for buf in unproven:
                backend.free_descriptors(buf)
            return ReleaseOutcome(())
        for buf in unproven:
            backend.ledger.quarantine("descriptor", id(buf))
        return ReleaseOutcome(tuple(unproven))

    def discard(self) -> None:
        """Construction rollback (R2): destroy what the constructor created; nothing was ever submitted."""
        for stream in self._streams:
            self._backend.destroy_stream(stream)
        for event in self._events:
            self._backend.destroy_event(event)
        self._streams, self._events = [], []

    # -- snapshots and helpers ------------------------------------------------------------------------------------
    def stats(self) -> HandlerStats:
        """A frozen snapshot of this handler."""
        c = self._counts
        return HandlerStats(
            direction=self.direction, state=self.state.value, queued=len(self._queue),
            unreported=len(self._resolved), submitted=c["submitted"], completed=c["completed"],
            failed=c["failed"], abandoned=c["abandoned"], unproven=len(self._unproven),
            pooled_streams=len(self._streams), pooled_events=len(self._events),
            pooled_descriptors=len(self._descriptors),
        )

    def _prewarm(self, count: int) -> None:
        try:
            for _ in range(count):
                self._streams.append(self._backend.create_stream())
                for _ in range(3):
                    self._events.append(self._backend.create_event())
        except BaseException:
            self.discard()
            raise

    def _check_state(self, event: HandlerInput) -> None:
        lifecycle.step(lifecycle.HANDLER_TABLE, self._machine, self.state, event)

    def _step(self, event: HandlerInput) -> None:
        self.state, _ = lifecycle.step(lifecycle.HANDLER_TABLE, self._machine, self.state, event)
