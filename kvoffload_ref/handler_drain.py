"""The fast handler's shutdown half (:class:`DrainHalf`, a base of ``handler.DirectionHandler``): the bounded drain
(R10, R11), what it abandons (R14, R22), the report, and the release of what the handler held (R12, R13, R16, R28).

``drain`` proves transfers head first within the one shutdown deadline (a prefix query proves a run of completed
heads in one call; one backoff for the whole drain), then what retired streams still hold (R28); whatever it cannot
prove is *unproven*: its descriptor buffer is quarantined unless the device-level proof succeeds (R13), and the
registrations it may touch are kept (R29, ``unproven_chunks``). ``release`` frees the pools and the unproven
transfers' resources in a few batched calls (``handler_pools.release_pools``); a BaseException arriving in the
middle does not stop it (R14). The fields and the completion calls it uses are the handler's (declared below).
"""

from __future__ import annotations

import array
import collections
import itertools
import logging
from collections.abc import Callable

import numpy as np

from kvoffload_ref import lifecycle, tables
from kvoffload_ref.backends.base import Backend, Backoff, DescriptorBuffer, Event, Stream, poll_until
from kvoffload_ref.errors import DeadlineExceeded, DeviceError
from kvoffload_ref.handler_pools import Transfer, release_pools
from kvoffload_ref.lifecycle import Action, Fate, HandlerInput, HandlerState
from kvoffload_ref.results import HandlerReport, JobOutcome, JobOutcomes, TransferResult, stopped_outcomes
from kvoffload_ref.running import Retired
from kvoffload_ref.shield import Leaks, Shield, each, finish_all
from kvoffload_ref.specs import Direction

__all__ = ["DrainHalf"]

logger = logging.getLogger("kvoffload_ref.handler")


class DrainHalf:
    """The shutdown half of ``handler.DirectionHandler`` (see the module docstring)."""

    # -- the handler's fields and calls this half uses (``DirectionHandler`` sets and defines them) ---------------
    _backend: Backend
    direction: Direction
    state: HandlerState
    leaks: Leaks
    _kind: tuple[str, str]
    _stream: Stream | None
    _queue: collections.deque[Transfer]
    _resolved: list[TransferResult]
    _jobs: set[int]
    _retired: Retired[Transfer]
    _unproven: list[Transfer]
    _unproven_streams: list[Stream]
    _kept_streams: int
    _events: list[Event]
    _descriptors: list[DescriptorBuffer]
    _counts: collections.Counter[str]
    _drain_error: BaseException | None
    _outcomes: list[JobOutcome]
    _drained_ids: list[int]
    _drained_bytes: array.array[int]
    _drained_tags: list[object]
    _stopped: list[JobOutcome]

    def _step(self, event: HandlerInput) -> Action:
        raise NotImplementedError

    def _leave(self, run: list[Transfer]) -> None:
        raise NotImplementedError

    def _prove_prefix(self) -> int:
        raise NotImplementedError

    def _observe_head(self, observe: Callable[[Event], bool]) -> bool:
        raise NotImplementedError

    def _proven_retired(self, head: Transfer) -> None:
        raise NotImplementedError

    def _free_late(self, transfer: Transfer) -> None:
        raise NotImplementedError

    # -- the drain (R10, R11, R14, R28) ----------------------------------------------------------------------------
    def _take_queue(self, current: bool = False, first: Transfer | None = None) -> list[Transfer]:
        """Empty the queue and the retired streams' (theirs first; the queue's if its failed head is R22's "failed")
        into the unproven bin; returns the live ones; the retired streams are kept for the proof (R13, R28)."""
        taken, late, streams = self._retired.take(self._queue, current, first)
        self._leave(taken)
        self._queue.clear()
        self._unproven += taken
        self._unproven += late
        self._unproven_streams += streams
        return taken

    def drain(self, deadline: float, *, interrupted: bool = False) -> HandlerReport:
        """Shutdown drain (R10): prove transfers head first within the deadline; stop at the first failure.

        Args:
            deadline: absolute time on the backend clock shared by the whole shutdown (R11). Each wait polls at
                least once, so completed work is still proven when the budget is spent.
            interrupted: a BaseException already stopped the shutdown (R14): abandon everything, wait for nothing.

        Returns:
            The drain's report. A BaseException raised while waiting abandons the rest and is re-raised (R14);
            :meth:`report` then still says what was drained before it.
        """
        self._step(HandlerInput.BEGIN_DRAIN)  # DROP_RESULTS: nothing is reported after shutdown began (R8)
        self._outcomes += [JobOutcome(r, "unreaped") for r in self._resolved]  # ... but the report lists them
        self._resolved, self._jobs = [], set()
        try:
            if interrupted and (self._queue or self._retired):
                self._stop_drain(HandlerInput.INTERRUPT, None)
            backend, backoff = self._backend, Backoff(to_tail=True)

            def observe(event: Event) -> bool:  # R11; the backoff carries over from head to head (the reference's);
                # each pause may run on to the stream's last record (to_tail: the drain awaits it all)
                return poll_until(backend, lambda: backend.query(event), deadline, backoff)

            while self._queue:
                if self._prove_prefix():
                    continue
                head = self._queue[0]
                if not self._observe_head(observe):
                    self._stop_drain(HandlerInput.DEADLINE, DeadlineExceeded(
                        f"{self.direction} job {head.job_id} was not proven complete within the shutdown timeout"))
            if self._retired:  # R28: what retired streams still hold, within the same deadline
                self._drain_retired(observe)
            self._take_queue()  # late copies not observed done: unproven (R13), their streams kept for the proof
        except BaseException as exc:
            self._stop_drain(HandlerInput.INTERRUPT, exc)
            raise
        finally:
            self._step(HandlerInput.QUEUE_EMPTY)
        return self.report()

    def _drain_retired(self, observe: Callable[[Event], bool]) -> None:
        """R10/R28: prove what retired streams hold within the drain's deadline: a live job proven is drained; a
        live job failed, or pending at the deadline, abandons the rest; late copies proven end their holds."""
        failures: list[tuple[DeviceError, Transfer]] = []  # (error, the failed head of a retired stream)
        self._retired.poll(observe, self._proven_retired, lambda live, exc, _now: failures.append((exc, live[0])),
                           self._free_late, self._backend.monotonic())
        if failures and self._step(HandlerInput.HEAD_FAILED) is Action.ABANDON:
            self._abandon(failures[0][0], head_failed=True, first=failures[0][1])
        elif self._retired.has_live():
            self._stop_drain(HandlerInput.DEADLINE, DeadlineExceeded(
                f"a {self.direction} job on a retired stream was not proven complete within the shutdown timeout"))

    def abandon_undrained(self) -> None:
        """R14: an interrupt arrived before this handler's drain began: begin it now and abandon everything, without
        a wait (the table says whether the drain can still begin)."""
        if tables.allows(lifecycle.HANDLER_TABLE, self.state, HandlerInput.BEGIN_DRAIN):
            self.drain(0.0, interrupted=True)

    def _stop_drain(self, event: HandlerInput, error: BaseException | None) -> None:
        if self._step(event) is Action.ABANDON:
            self._abandon(error)

    def _abandon(self, error: BaseException | None, *, head_failed: bool = False, current: bool = False,
                 first: Transfer | None = None) -> None:
        """Stop draining: every queued transfer's completion is unknown (R10), but a failed head's (the queue's if
        ``current``); each names the blocks it poisoned (R22)."""
        remaining = self._take_queue(current, first)
        self._counts["abandoned"] += len(remaining)
        self._drain_error = self._drain_error or error
        self._stopped += stopped_outcomes(self.direction, remaining, error, head_failed=head_failed)
        if error is not None and remaining:
            logger.error("Failed to synchronize transfer end event; skipping %d remaining transfers",
                         len(remaining) - 1, exc_info=error)

    def report(self) -> HandlerReport:
        """What the shutdown drain established so far (also after an interrupt)."""
        jobs = JobOutcomes(self._outcomes, self._drained_ids, self._drained_bytes, self._kind, self._stopped,
                           self._drained_tags)
        return HandlerReport(self._counts["drained"], self._counts["abandoned"], self._drain_error, jobs,
                             self._kept_streams)

    @property
    def drain_error(self) -> BaseException | None:
        """The first failure of the shutdown drain (None before it or if there was none)."""
        return self._drain_error

    @property
    def clean(self) -> bool:
        """Every transfer ever submitted here was proven complete by its own event (R13's clean path)."""
        return not self._unproven and not self._queue and not self._retired

    def unproven_chunks(self) -> set[int]:
        """R29: the CPU chunks an unproven copy of this handler (queued, late on a retired stream, failed or
        abandoned) may still touch: one concatenation and one ``np.unique`` however many transfers are unproven."""
        ids = [t.cpu_ids for t in itertools.chain(self._unproven, self._queue, self._retired.transfers())]
        return set(np.unique(np.concatenate(ids)).tolist()) if ids else set()

    def streams_in_use(self) -> list[Stream]:
        """The streams this handler still holds, retired ones included: what the device-level proof covers."""
        current = [] if self._stream is None else [self._stream]
        return [*current, *self._retired.streams(), *self._unproven_streams]

    def release(self, fate: Fate, shield: Shield | None = None, *,
                reason: str = "device not proven idle") -> tuple[int, int, list[str]]:
        """Release the transfer-side resources after the drain (R10); idempotent.

        The stream, the events and the descriptor buffers of proven transfers are always released. The descriptor
        buffers of unproven transfers are freed if ``fate`` is RELEASE, else quarantined: marked quarantined in the
        ledger and kept alive in the quarantine registry (:func:`kvoffload_ref.quarantine.quarantine`) until
        process exit. Every step runs, whatever an earlier one raised (R14).

        Args:
            fate: what happens to the unproven transfers' descriptor buffers.
            shield: collects the interrupts that arrive meanwhile, for the caller to re-raise once its own release
                is done (R14); None: they are dropped after the release finished.
            reason: why the kept buffers are quarantined (for the registry).

        Returns:
            (how many descriptor buffers were quarantined, how many retired streams were (the report's
            ``retired_streams``), descriptions of the steps that failed).
        """
        if self._step(HandlerInput.RELEASE) is not Action.RELEASE_RESOURCES:
            return 0, self._kept_streams, []
        # The pools' own lists are taken over (a copy of thousands would touch each); the handler holds none after.
        stream, events, freed, unproven = self._stream, self._events, self._descriptors, self._unproven
        retired, self._unproven_streams = self._unproven_streams, []
        self._kept_streams = 0 if fate is Fate.RELEASE else len(retired)
        self._stream, self._events, self._descriptors, self._unproven = None, [], [], []
        kept, failed = release_pools(self._backend, self.direction, self.leaks, stream, events, freed, unproven, fate,
                                     shield, reason, retired)
        return kept, self._kept_streams, failed

    def discard(self) -> None:
        """Construction rollback (R2): destroy what the constructor created; nothing was ever submitted. An
        interrupt meanwhile does not stop it (R14); it propagates once everything is destroyed. What cannot be
        destroyed is leaked (R16)."""
        events, streams = self._events, [] if self._stream is None else [self._stream]
        self._stream, self._events = None, []
        backend = self._backend
        _, interrupt = finish_all([(f"destroy {self.direction} events",
                                    lambda: each(backend.destroy_event, events, self.leaks.of("event"))),
                                   (f"destroy the {self.direction} stream",
                                    lambda: each(backend.destroy_stream, streams, self.leaks.of("stream")))])
        if interrupt is not None:
            raise interrupt

