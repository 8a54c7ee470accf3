"""The reference direction handler: one direction of the normative worker, plainly (R4-R6, R10, R14, R26-R28).

``reference.py`` states the worker level both workers run; this is the plain handler behind its seam
(``handler_api``): one stream per direction (a fresh one once a stream is retired, R28), one query per head, no
pools, no batching. Each transfer creates its three events and its descriptor buffer (one descriptor per
``placement.Move``) and frees them once proven. What both handlers share of a running engine -- deadlines, holds,
retired streams -- lives in ``running``; the fast handler (``handler.py``) must agree with this one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload_ref import errors, lifecycle, results, tables
from kvoffload_ref.backends.base import Backend, Backoff, DescriptorBuffer, Event, Stream, poll_until
from kvoffload_ref.canonical_plan import CanonicalLayout
from kvoffload_ref.lifecycle import Action, Fate, HandlerInput
from kvoffload_ref.placement import check_transfer
from kvoffload_ref.quarantine import keeper
from kvoffload_ref.results import JobOutcome, TransferResult
from kvoffload_ref.running import Mark, Retired, Running
from kvoffload_ref.shield import Leaks, Shield, each, finish_all
from kvoffload_ref.specs import Direction, KVCacheLayout, TensorGeometry
from kvoffload_ref.validate import Int64Array

__all__ = ["ReferenceHandler"]

logger = logging.getLogger("kvoffload_ref.worker")


# -- one direction (R4, R5, R10, R14, R26-R28) ---------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Transfer:
    job_id: int
    events: list[Event]  # Invariant: (compute marker, start, end) once submitted, created for this transfer alone
    descriptors: DescriptorBuffer | None  # None for a transfer that copies nothing
    nbytes: int
    dst_blocks: Int64Array  # R22: the destination's block ids (GPU blocks of a load, CPU chunks of a store)
    gpu_ids: Int64Array  # R27: the GPU block ids of its specs
    cpu_ids: Int64Array  # R27/R29: the CPU chunk ids of its specs
    user_tag: object = None  # the submission's tag=, returned on its result
    deadline: float | None = None  # R26: seconds from its start on the device, or None
    started: float | None = None  # Invariant: the backend time a poll first saw its start event done
    late: float | None = None  # Invariant: the backend time it became late (reported failed, held, R27)
    broken: errors.DeviceError | None = None  # Invariant: its end event could not be recorded: it fails at the head
    resolved: bool = False  # Invariant: True once it left the queue (proven, failed, abandoned or late)
    warned: bool = False  # Invariant: R30's stall warning was logged for it
    dst_groups: tuple[int, ...] = ()  # R22: a load's GPU spec's group_sizes (its destination's groups); () for a store

    @property
    def start(self) -> Event:
        return self.events[1]

    @property
    def end(self) -> Event:
        return self.events[2]

    def resources(self, backend: Backend) -> list[tuple[Callable[[Any], object], str, object]]:
        """(release call, ledger kind, resource) for each of its events and its descriptor buffer."""
        held: list[tuple[Callable[[Any], object], str, object]] = [(backend.destroy_event, "event", e)
                                                                   for e in self.events]
        return held + ([] if self.descriptors is None else [(backend.free_descriptors, "descriptor",
                                                              self.descriptors)])


class ReferenceHandler:
    """One direction (R4): its stream, its FIFO of transfers, its results. The worker serialises calls (R19)."""

    def __init__(self, backend: Backend, direction: Direction, compute: Stream, layout: KVCacheLayout,
                 gpu: Sequence[TensorGeometry], cpu: Sequence[TensorGeometry], bpc: int,
                 canonical: CanonicalLayout | None, running: Running) -> None:
        self.backend, self.direction, self.compute, self.layout, self.bpc = backend, direction, compute, layout, bpc
        self.canonical = canonical  # Invariant: None (plain mode) or this rank's mappings, fitting the layout (R24)
        self.gpu, self.cpu = gpu, cpu  # R1: geometries only, never the region
        self.running = running  # Invariant: the worker's holds and stall warning, shared with the other direction
        self.leaks = Leaks(backend.ledger)  # Invariant: what a release call failed to release, leaked (R16)
        # Invariant: the stream new work goes to (R4); None after it was retired until the next submission (R28).
        self.stream: Stream | None = backend.create_stream()
        self.state = lifecycle.HandlerState.ACCEPTING  # Invariant: changed only through tables.step
        self.queue: collections.deque[_Transfer] = collections.deque()  # Invariant: on self.stream, in order, live
        self.retired: Retired[_Transfer] = Retired(backend, direction, running, self.leaks)  # R28
        self.ready: list[TransferResult] = []  # Invariant: results known, not yet handed over (R5), in order
        self.jobs: set[int] = set()  # Invariant: the ids queued live (here or retired) or in ready: R7's "in flight"
        self.spent: list[tuple[Callable[[Any], object], str, object]] = []  # Invariant: proven idle, not yet freed
        self.unproven: list[_Transfer] = []  # Invariant: abandoned or late at shutdown: kept until the proof (R13)
        self.unproven_streams: list[Stream] = []  # Invariant: retired streams the drain could not prove idle (R28)
        self.kept_streams = 0  # Invariant: retired streams release() kept (not proven idle, R28)
        self.outcomes: list[JobOutcome] = []  # Invariant: jobs the drain took over, unreported (R14)
        self.drain_error: BaseException | None = None  # Invariant: the drain's first failure
        self.kind = results.TRANSFER_TYPE[direction]
        self.counts: collections.Counter[str] = collections.Counter()

    def step(self, event: HandlerInput) -> Action:
        self.state, action = tables.step(lifecycle.HANDLER_TABLE, f"{self.direction} handler", self.state, event)
        return action

    # -- submission (R4, R7, R14, R27, R28) -------------------------------------------------------------------------
    def submit(self, job_id: int, src: object, dst: object, deadline: float | None = None, tag: object = None
               ) -> None:
        if self.step(HandlerInput.SUBMIT) is not Action.ENQUEUE:  # R8: the table refuses every other state
            return
        moves = check_transfer(self.layout, self.direction, src, dst, [g.rows for g in self.gpu],
                               [c.rows for c in self.cpu], self.bpc, self.canonical)  # R7, before any device work
        gpu_ids, cpu_ids = self.running.holds.admit(self.direction, job_id, src, dst)  # R27: nothing done if refused
        if self.stream is None:  # R28: the last stream was retired: new work goes to a fresh one
            self.stream = self.backend.create_stream()
        backend, tag_, stream = self.backend, (self.direction, job_id), self.stream
        transfer = _Transfer(job_id, [], None, sum(m.size for m in moves), dst.block_ids,  # type: ignore[attr-defined]
                             gpu_ids, cpu_ids, tag, deadline)
        if self.direction == "load":  # R22 by group: a load's destination is its GPU spec
            transfer.dst_groups = dst.group_sizes  # type: ignore[attr-defined]  # a checked GPU spec
        try:
            if moves:
                buf = transfer.descriptors = backend.alloc_descriptors(len(moves), tag=tag_)
                for i, move in enumerate(moves):  # one descriptor per move of the placement rule
                    buf.src[i], buf.dst[i], buf.sizes[i] = move.addresses(self.direction, self.gpu, self.cpu)
            while len(transfer.events) < 3:
                transfer.events.append(backend.create_event(tag=tag_))
            marker, start, end = transfer.events
            backend.record(marker, self.compute, tag=tag_)
            backend.wait_event(stream, marker)  # R4: after the compute work queued so far
            backend.record(start, stream, tag=tag_)  # R4: after this direction's previous transfer (stream order)
            if transfer.descriptors is None:
                backend.record(end, stream, tag=tag_)  # nothing to copy: until this returns, no trace is left
            else:
                backend.copy_batch(stream, transfer.descriptors, len(moves), tag=tag_)
        except BaseException:  # R14: the device did not take the copy: give everything back, the id stays free
            finish_all([(f"release a {self.direction} {kind}", functools.partial(  # R16: a failure is leaked
                self.leaks.release, release, kind, obj, f"release a {self.direction} {kind}"))
                for release, kind, obj in reversed(transfer.resources(backend))])
            raise
        shield = Shield()
        if transfer.descriptors is not None:  # R14: the device took the copy: the job is queued whole, whatever comes
            try:  # retried through interrupts; an end event never recorded makes the job fail at the head (R5)
                shield.run(functools.partial(backend.record, end, stream, tag=tag_))
            except BaseException as exc:
                transfer.broken = errors.DeviceError(f"recording the end event of {self.direction} job {job_id} "
                                                     f"failed: {exc!r}")
        self.queue.append(transfer)
        self.jobs.add(job_id)
        self.counts["submitted"] += 1
        shield.reraise()

    def knows(self, job_id: int) -> bool:
        return job_id in self.jobs

    def end_events(self, job_ids: set[int]) -> list[Event]:
        """R23: the end events of the listed jobs still queued live (a broken transfer's was never recorded)."""
        live = [*self.retired.marks(job_ids), *self.queue]
        return [t.end for t in live if t.job_id in job_ids and t.broken is None]

    def last_of(self, job_ids: set[int]) -> Mark[_Transfer] | None:
        """R6: the last listed job of the current stream and the listed live ones of retired streams."""
        last = next((t for t in reversed(self.queue) if t.job_id in job_ids), None)
        marked = [*self.retired.marks(job_ids), *([] if last is None else [last])]
        return Mark(marked) if marked else None

    def settle(self, mark: object) -> bool:
        assert isinstance(mark, Mark)  # Invariant: the worker passes what last_of returned
        self.reap(mark)
        return mark.resolved

    # -- completion (R5, R26-R28) ------------------------------------------------------------------------------------
    def reap(self, mark: Mark[_Transfer] | None = None) -> None:
        """Observe retired streams, then the heads, one ``query`` each, until one is pending or ``mark`` resolved;
        a pending head past its deadline expires (R26); free what is proven."""
        if self.retired:  # R28: their results are never held back by the current stream, nor hold it back
            self.retired.poll(self.backend.query, self._proven_retired, self._failed_retired, self._free_late,
                              self.backend.monotonic(), self._expired)
        while self.queue and not (mark is not None and mark.resolved):
            if not self._observe_head(self.backend.query):
                self._check_head()
                break
        while self.spent:  # R10: proven transfers' resources are idle; R16: a failed release is leaked, never raised
            release, kind, obj = self.spent[-1]
            self.leaks.release(release, kind, obj, f"free a proven {self.direction} transfer's {kind}")
            self.spent.pop()

    def _observe_head(self, observe: Callable[[Event], bool]) -> bool:
        """Observe the head's end event once (R5): proven, failed, or (False) still pending."""
        head = self.queue[0]
        try:
            if head.broken is not None:
                raise head.broken
            done = observe(head.end)
        except errors.DeviceError as exc:
            self._head_failed(exc)
            return True
        if done:
            self._book_proven(head)
            self.queue.popleft()  # no backend call since the timing: the head moved to the results as one step
        return done

    def _check_head(self) -> None:
        """R26/R30: the head is pending: its age on the device decides its deadline and the stall warning."""
        try:
            late = self.running.overdue(self.backend, self.direction, self.queue[0])
        except errors.DeviceError as exc:  # its start event failed: the head fails as its end event would (R5)
            self._head_failed(exc)
            return
        if late:
            self._expire(0, "deadline")

    def _book_proven(self, head: _Transfer) -> None:
        """R5/R10: the head's own end event is done: reported (open) or counted drained (shutting down). The timing
        (a backend call) is read first; the caller then removes the head from its queue (R14)."""
        action = self.step(HandlerInput.HEAD_PROVEN)
        seconds = None
        if action is Action.REPORT:
            with contextlib.suppress(errors.DeviceError):
                seconds = self.backend.elapsed(head.start, head.end)
        head.resolved = True
        self.spent += head.resources(self.backend)
        self.counts["completed"] += 1
        if action is Action.REPORT:
            self.ready.append(TransferResult(head.job_id, True, head.nbytes, seconds, transfer_type=self.kind,
                                             tag=head.user_tag))
        else:  # COUNT_DRAINED
            self.counts["drained"] += 1
            self.outcomes.append(JobOutcome(TransferResult(head.job_id, True, head.nbytes, transfer_type=self.kind,
                                                           tag=head.user_tag), "drained"))

    def _proven_retired(self, head: _Transfer) -> None:
        self._book_proven(head)  # a live job on a retired stream, proven: reported like any other

    def _free_late(self, late: _Transfer) -> None:
        """R27: a late copy was observed done: its hold ended; only now are its events and buffer freed."""
        self.spent += late.resources(self.backend)

    def _head_failed(self, exc: errors.DeviceError) -> None:
        """R5: open: the head and everything behind it are reported failed, held and their stream retired (R27,
        R28). R10: draining: the rest is abandoned."""
        now = self.backend.monotonic()  # before anything changes (R14)
        if self.step(HandlerInput.HEAD_FAILED) is Action.ABANDON:
            return self._abandon(exc, head_failed=True, current=True)
        failed, self.queue = list(self.queue), collections.deque()
        self._failed(failed, exc)
        self.retired.retire(self.stream, [], failed, now)
        self.stream = None

    def _failed_retired(self, failed: list[_Transfer], exc: errors.DeviceError, now: float) -> None:
        """R5: live jobs on a retired stream failed: reported failed and held (R27)."""
        self.step(HandlerInput.HEAD_FAILED)  # REPORT_FAILED
        self._failed(failed, exc)
        self.retired.hold(failed, now)

    def _failed(self, failed: list[_Transfer], exc: errors.DeviceError) -> None:
        """R5/R22: ``failed`` (head first) are reported failed; the caller holds them (their copies may still run)."""
        for t in failed:
            t.resolved = True
        self.counts["failed"] += len(failed)
        self.ready += results.failed_in_order(self.direction, failed, exc)  # R22

    def _expire(self, index: int, reason: str, cancelled: set[int] | frozenset[int] = frozenset()) -> None:
        """R26-R28: the queue's transfer at ``index`` and everything behind it are late: reported failed with
        ``TransferExpired`` and held; the stream is retired with the live transfers ahead of it."""
        now = self.backend.monotonic()  # the only backend call: before anything changes (R14)
        self.step(HandlerInput.EXPIRE)  # REPORT_EXPIRED
        queued, self.queue = list(self.queue), collections.deque()
        self._report_expired(*self.retired.end_stream(self.stream, queued, index, reason, cancelled, now))
        self.stream = None

    def _expired(self, late: list[_Transfer], results: list[TransferResult]) -> None:
        """R26: live jobs on a retired stream became late (cancelled, or past their deadline): reported."""
        self.step(HandlerInput.EXPIRE)  # REPORT_EXPIRED
        self._report_expired(late, results)

    def _report_expired(self, late: list[_Transfer], results: list[TransferResult]) -> None:
        self.counts["expired"] += len(late)
        self.ready += results

    def cancel(self, job_ids: set[int]) -> None:
        """R26: query first (never wait): a done job is reported as done; then every listed job still queued, and
        the jobs behind it on its stream, are late ("cancel"/"behind"); unknown or reported ids are ignored."""
        self.reap()
        self.retired.cancel(job_ids, self.backend.monotonic(), self._expired)  # live jobs on retired streams
        index = next((i for i, t in enumerate(self.queue) if t.job_id in job_ids), None)
        if index is not None:
            self._expire(index, "cancel", job_ids)

    def take_results(self) -> list[TransferResult]:
        handed, self.ready = self.ready, []  # R14: no backend call, so no interrupt splits it
        self.jobs.difference_update(r.job_id for r in handed)
        return handed

    # -- shutdown (R9-R14) -------------------------------------------------------------------------------------------
    def drain(self, deadline: float, *, interrupted: bool = False) -> None:
        self.step(HandlerInput.BEGIN_DRAIN)  # DROP_RESULTS: nothing is reported after shutdown began (R8) ...
        self.outcomes += [JobOutcome(r, "unreaped") for r in self.ready]  # ... but the report lists them (R14)
        self.ready, self.jobs = [], set()
        backend, backoff = self.backend, Backoff(to_tail=True)

        def observe(event: Event) -> bool:  # R11: a bounded poll on the backend's clock, never a blocking wait;
            # one backoff for the whole drain: the pause carries over from head to head (a pending queue of
            # thousands costs a poll per pause, not a short first sleep per transfer); on the sim each pause may run
            # on to the stream's last record (to_tail: the drain awaits it all) and ends exactly there
            return poll_until(backend, lambda: backend.query(event), deadline, backoff)

        try:
            if interrupted and (self.queue or self.retired):
                self._stop(HandlerInput.INTERRUPT, None)  # R14: stop all waiting
            while self.queue:
                if not self._observe_head(observe):  # the head is still pending at the deadline
                    self._stop(HandlerInput.DEADLINE, errors.DeadlineExceeded(f"{self.direction} job "
                               f"{self.queue[0].job_id} was not proven complete within the shutdown timeout"))
            if self.retired:  # R28: what retired streams still hold, within the same deadline
                self._drain_retired(observe)
            self._take_queue()  # late copies not observed done: unproven (R13), their streams kept for the proof
        except BaseException as exc:
            self._stop(HandlerInput.INTERRUPT, exc)  # R14: the rest is abandoned, the interrupt propagates
            raise
        finally:
            self.step(HandlerInput.QUEUE_EMPTY)

    def _drain_retired(self, observe: Callable[[Event], bool]) -> None:
        """R10/R28: prove what retired streams hold within the drain's deadline: a live job proven is drained; a
        live job failed, or pending at the deadline, abandons the rest; late copies proven end their holds."""
        failures: list[tuple[errors.DeviceError, _Transfer]] = []  # (error, the failed head of a retired stream)
        self.retired.poll(observe, self._proven_retired, lambda live, exc, _now: failures.append((exc, live[0])),
                          self._free_late, self.backend.monotonic())
        if failures and self.step(HandlerInput.HEAD_FAILED) is Action.ABANDON:
            self._abandon(failures[0][0], head_failed=True, first=failures[0][1])
        elif self.retired.has_live():
            self._stop(HandlerInput.DEADLINE, errors.DeadlineExceeded(
                f"a {self.direction} job on a retired stream was not proven complete within the shutdown timeout"))

    def abandon_undrained(self) -> None:
        if tables.allows(lifecycle.HANDLER_TABLE, self.state, HandlerInput.BEGIN_DRAIN):
            self.drain(0.0, interrupted=True)

    def _stop(self, event: HandlerInput, error: BaseException | None) -> None:
        if self.step(event) is Action.ABANDON:
            self._abandon(error)

    def _take_queue(self, current: bool = False, first: _Transfer | None = None) -> list[_Transfer]:
        """Every live transfer still queued (retired streams' first, or the current stream's when its head failed:
        R22 names that head "failed"), now unproven; late ones join them (R13)."""
        taken, late, streams = self.retired.take(self.queue, current, first)
        self.queue = collections.deque()
        for t in taken:
            t.resolved = True
        self.unproven += [*taken, *late]  # completion unknown: never freed before the device-level proof (R13)
        self.unproven_streams += streams
        return taken

    def _abandon(self, error: BaseException | None, *, head_failed: bool = False, current: bool = False,
                 first: _Transfer | None = None) -> None:
        """R10: every queued transfer's completion is unknown (but a failed head's: the current stream's when
        ``current``); R22: each names its blocks."""
        remaining = self._take_queue(current, first)
        self.counts["abandoned"] += len(remaining)
        self.drain_error = self.drain_error or error
        self.outcomes += results.stopped_outcomes(self.direction, remaining, error, head_failed=head_failed)
        if error is not None and remaining:
            logger.error("Failed to synchronize transfer end event; skipping %d remaining transfers",
                         len(remaining) - 1, exc_info=error)

    @property
    def clean(self) -> bool:
        return not self.unproven and not self.queue and not self.retired

    def streams_in_use(self) -> list[Stream]:
        current = [] if self.stream is None else [self.stream]
        return [*current, *self.retired.streams(), *self.unproven_streams]

    def unproven_chunks(self) -> set[int]:
        """R29: the CPU chunks a queued, late, failed or abandoned copy of this direction may still touch."""
        return {int(c) for t in (*self.unproven, *self.queue, *self.retired.transfers()) for c in t.cpu_ids.tolist()}

    def release(self, fate: Fate, shield: Shield | None = None, *,
                reason: str = "device not proven idle") -> tuple[int, int, list[str]]:
        """R10: destroy the stream and every event, free proven transfers' descriptor buffers, and free (RELEASE) or
        quarantine (R12) the unproven ones' and the retired streams not proven idle (R28). Every step runs whatever
        another raised (R14)."""
        if self.step(HandlerInput.RELEASE) is not Action.RELEASE_RESOURCES:
            return 0, self.kept_streams, []
        backend = self.backend
        streams = [] if self.stream is None else [self.stream]
        retired = self.unproven_streams
        events: list[object] = [e for t in self.unproven for e in t.events]
        unproven: list[object] = [t.descriptors for t in self.unproven if t.descriptors is not None]
        freed, kept = (unproven, []) if fate is Fate.RELEASE else ([], unproven)
        (streams if fate is Fate.RELEASE else []).extend(retired)
        kept_streams = [] if fate is Fate.RELEASE else retired
        self.kept_streams = len(kept_streams)
        self.stream, self.unproven, self.unproven_streams = None, [], []
        leak = self.leaks.of  # R16: a release that fails is leaked; the others still run (R10)
        failed, _ = finish_all([
            (f"destroy the {self.direction} stream", lambda: each(backend.destroy_stream, streams, leak("stream"))),
            (f"free the resources of proven {self.direction} transfers", self.reap),
            (f"destroy {len(events)} {self.direction} events", lambda: each(backend.destroy_event, events,
                                                                            leak("event"))),
            (f"free {len(freed)} {self.direction} descriptor buffers", lambda: each(backend.free_descriptors, freed,
                                                                                    leak("descriptor"))),
            ("quarantine descriptor buffers", keeper(backend.ledger.quarantine, "descriptor", kept, reason)),
            ("quarantine retired streams", keeper(backend.ledger.quarantine, "stream", kept_streams, reason)),
        ], shield)
        return len(kept), self.kept_streams, failed

    def discard(self) -> None:
        if self.stream is not None:  # R2: nothing was submitted; only the stream exists (retry-safe, R14; R16)
            self.leaks.release(self.backend.destroy_stream, "stream", self.stream,
                               f"destroy the {self.direction} stream")
            self.stream = None

    def report(self) -> results.HandlerReport:
        c = self.counts
        return results.HandlerReport(c["drained"], c["abandoned"], self.drain_error, tuple(self.outcomes),
                                     self.kept_streams)

    def stats(self) -> results.HandlerStats:
        """A snapshot; no device call but the clock (R30: the pending head's age is from the start a poll saw)."""
        head = self.queue[0] if self.state is lifecycle.HandlerState.ACCEPTING and self.queue else None
        now = self.backend.monotonic()
        health = self.retired.health(self.running.head_age(head, now), now, len(self.unproven_streams))
        c = self.counts
        return results.HandlerStats(self.direction, self.state.value, len(self.queue), len(self.ready),
                                    c["submitted"], c["completed"], c["failed"], c["abandoned"],
                                    len(self.unproven) + self.retired.late_count(),
                                    int(self.stream is not None), 0, 0, *health)
