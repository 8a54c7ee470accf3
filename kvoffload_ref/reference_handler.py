"""The reference worker's one direction: a FIFO of transfers on one stream, proven head first (R4, R5, R10, R14).

Part of the reference worker (``reference.py`` is the entry point and reads on from here): no pools, no batching,
one query per head; every transition through ``lifecycle.HANDLER_TABLE``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload_ref import errors, lifecycle, results
from kvoffload_ref.backends import base
from kvoffload_ref.backends.base import Backend, Event, Stream, poll_until
from kvoffload_ref.lifecycle import Action, Fate, HandlerInput
from kvoffload_ref.placement import check_transfer
from kvoffload_ref.quarantine import QuarantinedItem, quarantine
from kvoffload_ref.results import JobOutcome, TransferResult
from kvoffload_ref.shield import Shield, finish_all
from kvoffload_ref.specs import Direction, KVCacheLayout

__all__ = ["ReferenceHandler"]

logger = logging.getLogger("kvoffload_ref.reference")


@dataclasses.dataclass(eq=False)
class _Transfer:
    job_id: int
    events: tuple[Event, Event, Event]  # (compute marker, start, end), created for this transfer alone
    descriptors: base.DescriptorBuffer | None  # None for a transfer that copies nothing
    nbytes: int
    # Invariant: why its end event could not be recorded after the device took its copy; it then fails at the head.
    broken: errors.DeviceError | None = None
    # Invariant: True once the transfer left the queue (proven, failed or abandoned).
    resolved: bool = False


def _each(release: Callable[[Any], object], items: list[object]) -> None:
    """Release items from the end; an item leaves the list only once released (an interrupted retry resumes)."""
    while items:
        release(items[-1])
        items.pop()


class ReferenceHandler:
    """One direction (R4): its stream, its FIFO of transfers, its results. The worker serialises calls (R19)."""

    def __init__(self, backend: Backend, direction: Direction, stream: Stream, compute: Stream,
                 layout: KVCacheLayout, gpu: Sequence[base.TensorGeometry], cpu: Sequence[base.TensorGeometry],
                 bpc: int) -> None:
        self.backend, self.direction, self.compute, self.layout, self.bpc = backend, direction, compute, layout, bpc
        self.gpu, self.cpu = gpu, cpu  # R1: geometries only, never the region
        # Invariant: every transfer of this direction runs on this one stream (R4); None once released.
        self.stream: Stream | None = stream
        # Invariant: changed only through lifecycle.step(HANDLER_TABLE, ...).
        self.state = lifecycle.HandlerState.ACCEPTING
        # Invariant: submission order; none proven yet.
        self.queue: collections.deque[_Transfer] = collections.deque()
        # Invariant: completion known, not yet handed over by get_finished (R5), in submission order.
        self.results: list[TransferResult] = []
        # Invariant: the ids in the queue or in results: "in flight" for R7's duplicate check.
        self.jobs: set[int] = set()
        # Invariant: (release call, resource) of proven transfers, not yet freed: they are idle (R10).
        self.spent: list[tuple[Callable[[Any], None], object]] = []
        # Invariant: failed or abandoned transfers: their resources wait for the device-level proof (R10, R13).
        self.unproven: list[_Transfer] = []
        # Invariant: the jobs the shutdown drain took over without reporting them, in submission order (R14).
        self.outcomes: list[JobOutcome] = []
        # Invariant: the first failure of the shutdown drain, or None.
        self.error: BaseException | None = None
        self.counts: collections.Counter[str] = collections.Counter()

    def step(self, event: HandlerInput) -> Action:
        self.state, action = lifecycle.step(lifecycle.HANDLER_TABLE, f"{self.direction} handler", self.state, event)
        return action

    # -- submission (R4, R7, R14) ----------------------------------------------------------------------------------
    def submit(self, job_id: int, src: object, dst: object) -> None:
        if self.step(HandlerInput.SUBMIT) is not Action.ENQUEUE:  # R8: the table refuses every other state
            return
        moves = check_transfer(self.layout, self.direction, src, dst, [g.rows for g in self.gpu],
                               [c.rows for c in self.cpu], self.bpc)  # R7: every check, before any device work
        backend, tag, stream = self.backend, (self.direction, job_id), self.stream
        assert stream is not None  # Invariant: an accepting handler has its stream
        created: list[tuple[Callable[[Any], None], object]] = []  # what to give back if the copy is not queued
        try:
            buf = None
            if moves:
                buf = backend.alloc_descriptors(len(moves), tag=tag)
                created.append((backend.free_descriptors, buf))
                for i, move in enumerate(moves):  # one descriptor per move of the placement rule
                    buf.src[i], buf.dst[i], buf.sizes[i] = move.addresses(self.direction, self.gpu, self.cpu)
            events = []
            for _ in range(3):
                events.append(backend.create_event(tag=tag))
                created.append((backend.destroy_event, events[-1]))
            marker, start, end = events
            backend.record(marker, self.compute, tag=tag)
            backend.wait_event(stream, marker)  # R4: after the compute work queued so far
            backend.record(start, stream, tag=tag)  # R4: after this direction's previous transfer (stream order)
            transfer = _Transfer(job_id, (marker, start, end), buf, sum(m.size for m in moves))
            if buf is None:
                backend.record(end, stream, tag=tag)  # nothing to copy: until this returns, no trace is left
            else:
                backend.copy_batch(stream, buf, len(moves), tag=tag)
        except BaseException:
            # R14: the device did not take the copy: give back everything (an interrupt meanwhile does not stop
            # it), the id stays free, and the original exception propagates.
            finish_all([(f"release a {self.direction} {type(obj).__name__}", functools.partial(release, obj))
                        for release, obj in reversed(created)])
            raise
        shield = Shield()
        if buf is not None:  # R14: the device took the copy: the job is queued whole, whatever is raised now
            try:  # retried through interrupts; an end event never recorded makes the job fail at the head (R5)
                shield.run(functools.partial(backend.record, end, stream, tag=tag))
            except BaseException as exc:
                transfer.broken = errors.DeviceError(f"recording the end event of {self.direction} job {job_id} "
                                                     f"failed: {exc!r}")
        self.queue.append(transfer)
        self.jobs.add(job_id)
        self.counts["submitted"] += 1
        shield.reraise()

    # -- completion (R5, R6, R14) ----------------------------------------------------------------------------------
    def reap(self, until: _Transfer | None = None) -> None:
        """Observe heads without blocking, one ``query`` each, until one is pending (or ``until`` is resolved)."""
        while self.queue and (until is None or not until.resolved):
            if not self._observe_head(self.backend.query):
                return

    def _observe_head(self, observe: Callable[[Event], bool]) -> bool:
        """Observe the head's end event once: proven, failed, or (False) still pending."""
        head = self.queue[0]
        try:
            if head.broken is not None:
                raise head.broken
            done = observe(head.events[2])
        except errors.DeviceError as exc:
            self._head_failed(exc)
            return True
        if done:
            self._head_proven(head)
        return done

    def _head_proven(self, head: _Transfer) -> None:
        """R5/R10: the head's own end event is done: reported (open) or counted drained (shutting down)."""
        action = self.step(HandlerInput.HEAD_PROVEN)
        seconds = None
        if action is Action.REPORT:  # R14: the timing (a backend call) is read before the head moves
            with contextlib.suppress(errors.DeviceError):
                seconds = self.backend.elapsed(head.events[1], head.events[2])
        self.queue.popleft()  # from here on no backend call: the head moves to the results as one step
        head.resolved = True
        self.spent += [(self.backend.destroy_event, e) for e in head.events]
        if head.descriptors is not None:
            self.spent.append((self.backend.free_descriptors, head.descriptors))
        self.counts["completed"] += 1
        if action is Action.REPORT:
            self.results.append(TransferResult(head.job_id, True, head.nbytes, seconds))
        elif action is Action.COUNT_DRAINED:
            self.counts["drained"] += 1
            self.outcomes.append(JobOutcome(TransferResult(head.job_id, True, head.nbytes), "drained"))

    def _head_failed(self, exc: errors.DeviceError) -> None:
        """R5: open: the head and everything behind it are reported failed. R10: draining: the rest is abandoned."""
        action = self.step(HandlerInput.HEAD_FAILED)
        if action is Action.ABANDON:
            self._abandon(exc)
            return
        failed = self._take_queue()
        self.counts["failed"] += len(failed)
        exc.__traceback__ = None  # a stored error must not keep the frames it was raised through
        self.results.append(TransferResult(failed[0].job_id, False, error=exc))
        for t in failed[1:]:
            behind = errors.DeviceError(f"{self.direction} job {t.job_id} was queued behind job "
                                        f"{failed[0].job_id}, which failed: its data cannot be trusted", exc.status)
            behind.__cause__ = exc
            self.results.append(TransferResult(t.job_id, False, error=behind))

    def _take_queue(self) -> list[_Transfer]:
        taken = list(self.queue)
        self.queue.clear()
        for t in taken:
            t.resolved = True
        self.unproven.extend(taken)  # completion unknown: never freed before the device-level proof (R13)
        return taken

    def free_spent(self) -> None:
        """Free the events and descriptor buffers of proven transfers (each leaves the list once freed)."""
        while self.spent:
            release, resource = self.spent[-1]
            release(resource)
            self.spent.pop()

    def take_results(self) -> list[TransferResult]:
        """Hand the waiting results over: no backend call, so no interrupt splits it (R14)."""
        handed, self.results = self.results, []
        self.jobs.difference_update(r.job_id for r in handed)
        return handed

    # -- shutdown (R10, R11, R14) ----------------------------------------------------------------------------------
    def drain(self, deadline: float, *, interrupted: bool = False) -> None:
        """R10: prove head first within the one deadline (R11); stop at the first failure, abandon the rest."""
        self.step(HandlerInput.BEGIN_DRAIN)  # DROP_RESULTS: nothing is reported after shutdown began (R8) ...
        self.outcomes += [JobOutcome(r, "unreaped") for r in self.results]  # ... but the report lists them (R14)
        self.results, self.jobs = [], set()
        backend = self.backend

        def observe(event: Event) -> bool:  # R11: a bounded poll on the backend's clock, never a blocking wait
            return poll_until(backend, lambda: backend.query(event), deadline)

        try:
            if interrupted and self.queue:
                self._stop(HandlerInput.INTERRUPT, None)  # R14: stop all waiting
            while self.queue:
                head = self.queue[0]
                if not self._observe_head(observe):
                    self._stop(HandlerInput.DEADLINE, errors.DeadlineExceeded(
                        f"{self.direction} job {head.job_id} was not proven complete within the shutdown timeout"))
        except BaseException as exc:
            self._stop(HandlerInput.INTERRUPT, exc)  # R14: the rest is abandoned, the interrupt propagates
            raise
        finally:
            self.step(HandlerInput.QUEUE_EMPTY)

    def abandon_undrained(self) -> None:
        """R14: the interrupt came before this handler's drain began: begin it now, abandoning without a wait."""
        if isinstance(lifecycle.HANDLER_TABLE[(self.state, HandlerInput.BEGIN_DRAIN)], lifecycle.Transition):
            self.drain(0.0, interrupted=True)

    def _stop(self, event: HandlerInput, error: BaseException | None) -> None:
        if self.step(event) is Action.ABANDON:
            self._abandon(error)

    def _abandon(self, error: BaseException | None) -> None:
        """R10: every queued transfer's completion is unknown."""
        remaining = self._take_queue()
        self.counts["abandoned"] += len(remaining)
        self.error = self.error or error
        self.outcomes += [JobOutcome(TransferResult(t.job_id, False, error=error), "abandoned") for t in remaining]
        if error is not None and remaining:
            logger.error("Failed to synchronize transfer end event; skipping %d remaining transfers",
                         len(remaining) - 1, exc_info=error)

    @property
    def clean(self) -> bool:
        """R13's clean path: every transfer submitted here was proven by its own end event."""
        return not self.unproven and not self.queue

    def release(self, fate: Fate, shield: Shield, reason: str) -> tuple[int, list[str]]:
        """R10: destroy the stream and every event, free proven transfers' descriptor buffers, and free (RELEASE) or
        keep for quarantine (QUARANTINE) the unproven ones'. Every step runs whatever another raised (R14).

        Returns:
            (how many descriptor buffers were quarantined, descriptions of the steps that failed).
        """
        if self.step(HandlerInput.RELEASE) is not Action.RELEASE_RESOURCES:
            return 0, []
        backend = self.backend
        streams: list[object] = [] if self.stream is None else [self.stream]
        events: list[object] = [e for t in self.unproven for e in t.events]
        unproven = [t.descriptors for t in self.unproven if t.descriptors is not None]
        freed: list[object] = list(unproven) if fate is Fate.RELEASE else []
        kept = [] if fate is Fate.RELEASE else unproven
        marked: list[object] = list(kept)
        registered: list[object] = list(kept)
        self.stream, self.unproven = None, []
        failed, _ = finish_all([
            (f"destroy the {self.direction} stream", lambda: _each(backend.destroy_stream, streams)),
            (f"free the resources of proven {self.direction} transfers", self.free_spent),
            (f"destroy {len(events)} {self.direction} events", lambda: _each(backend.destroy_event, events)),
            (f"free {len(freed)} {self.direction} descriptor buffers",
             lambda: _each(backend.free_descriptors, freed)),
            ("quarantine descriptor buffers",
             lambda: _each(lambda buf: backend.ledger.quarantine("descriptor", id(buf)), marked)),
            ("register quarantined descriptor buffers",  # R12: a kernel may still read them: alive until exit
             lambda: _each(lambda b: quarantine(QuarantinedItem("descriptor", repr(b), reason, b)), registered)),
        ], shield)
        return len(kept), failed

    def report(self) -> results.HandlerReport:
        c = self.counts
        return results.HandlerReport(c["drained"], c["abandoned"], self.error, tuple(self.outcomes))

    def stats(self) -> results.HandlerStats:
        c = self.counts
        return results.HandlerStats(self.direction, self.state.value, len(self.queue), len(self.results),
                                    c["submitted"], c["completed"], c["failed"], c["abandoned"], len(self.unproven),
                                    int(self.stream is not None), 0, 0)


