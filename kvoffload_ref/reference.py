"""The reference worker: the normative statement of what a KV-cache offloading worker does.

**This file is the rule; ``worker.py`` is the fast implementation.** Its worker level (``build_core``, ``Core``) is
the one both run: ``CPUOffloadingWorker`` is the same ``Core`` over its fast handler (pools, batched calls, the
vectorized planner), and ``facade.py`` is the public face of both. The conformance kit, the call-point explorer and
the differential test run both; where they disagree, the reference is right. Read it top to bottom with
``lifecycle.py``: every transition goes through a lifecycle table (the region's through its own methods), every
shutdown decision through ``PROOF_DECISION`` and ``FATE``, and each rule is carried out where its R-number stands.
One stream per direction, one lock, no pools, no batching: each transfer creates its three events and its
descriptor buffer (one descriptor per ``placement.Move``) and frees them once proven.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from kvoffload_ref import errors, handler_api, lifecycle, lockcheck, results, tables
from kvoffload_ref.backends.base import Backend, Stream, wait_polling
from kvoffload_ref.canonical import PageMapping
from kvoffload_ref.canonical_plan import CanonicalLayout, check_canonical, cpu_pages
from kvoffload_ref.facade import Pinning, WorkerFacade, WorkerOptions, build_with_region, check_options
from kvoffload_ref.handler_api import DirectionHandlerAPI, NewHandler
from kvoffload_ref.lifecycle import Action, Fate, ProofOutcome, RegionState, WorkerInput, WorkerState
from kvoffload_ref.process import CallGuard, ProcessOwner, finalize_safely, sigint_deferred
from kvoffload_ref.reference_handler import ReferenceHandler
from kvoffload_ref.region import DEFAULT_PIN_CHUNK_BYTES, HostRegion
from kvoffload_ref.results import HeldBlocks, ReleasedHold, ShutdownPolicy, ShutdownReport, ShutdownRun, TransferResult
from kvoffload_ref.running import Holds, Running
from kvoffload_ref.shield import Shield, finish_all
from kvoffload_ref.specs import DIRECTIONS, Direction, KVCacheLayout, check_geometry
from kvoffload_ref.validate import ByteArray, check_int, check_job_ids, check_positive, check_timeout

__all__ = ["Core", "ReferenceHandler", "ReferenceWorker", "build_core", "create_reference_worker"]

logger = logging.getLogger("kvoffload_ref.worker")

# The inputs and the action every call reads, bound once: reading a member through its enum class runs the
# metaclass's slot hook (``EnumType`` defines ``__getattr__``, which puts a Python-level hook on every lookup:
# ~65 ns a read against ~6 ns for a bound name, on CPython 3.11.7).
_SUBMIT, _WAIT, _GET_FINISHED = WorkerInput.SUBMIT, WorkerInput.WAIT, WorkerInput.GET_FINISHED
_RETURN_EMPTY = Action.RETURN_EMPTY
#: The worker table's legal steps, read once (``Core.transition``: one dict read a call; a refused pair goes to
#: ``tables.step``, which raises).
_WORKER_MOVES: Final = tables.moves(lifecycle.WORKER_TABLE, WorkerState)


class ReferenceWorker(WorkerFacade):
    """The reference worker: ``WorkerFacade``'s calls over a :class:`Core` with :class:`ReferenceHandler` s. The
    arguments and errors: ``WorkerFacade``'s (this worker has no pools, so no ``prewarm``)."""

    def __init__(self, backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                 blocks_per_chunk: int, region: HostRegion, policy: ShutdownPolicy | None = None,
                 pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES, require_pinned: bool = False,
                 compute_stream: object | None = None,
                 canonical: CanonicalLayout | Sequence[PageMapping] | None = None,
                 stall_warning: float | None = None, pinning: Pinning = "auto") -> None:
        options = check_options(blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, compute_stream, canonical,
                                stall_warning, pinning)
        self._attach(build_core(backend, gpu_tensors, layout, region, options, ReferenceHandler, type(self).__name__))


def create_reference_worker(backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                            blocks_per_chunk: int, num_cpu_chunks: int, policy: ShutdownPolicy | None = None,
                            region: HostRegion | None = None, pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
                            require_pinned: bool = False, compute_stream: object | None = None,
                            canonical: CanonicalLayout | Sequence[PageMapping] | None = None,
                            stall_warning: float | None = None, pinning: Pinning = "auto") -> ReferenceWorker:
    """Build the region (``num_cpu_chunks`` rows per tensor; canonical rows in canonical mode, R24) unless ``region``
    is given, then the worker (R1, R2). The rest: as for :class:`ReferenceWorker` and ``worker.create_worker``."""
    options = check_options(blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, None, canonical,
                            stall_warning, pinning)  # R7 first
    return build_with_region(
        lambda r: ReferenceWorker(backend, gpu_tensors, layout, blocks_per_chunk=blocks_per_chunk, region=r,
                                  policy=policy, pin_chunk_bytes=pin_chunk_bytes, require_pinned=require_pinned,
                                  compute_stream=compute_stream, canonical=options.canonical,
                                  stall_warning=stall_warning, pinning=options.pinning),
        backend, layout, blocks_per_chunk, num_cpu_chunks, region, check_canonical(layout, options.canonical),
        options.pinning)


def build_core(backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, region: HostRegion,
               options: WorkerOptions, new_handler: NewHandler, name: str) -> Core:
    """R1/R2/R7: check everything, then pin the region, build both handlers and adopt the region; a failure gives
    back what was acquired, in reverse order, and the original exception propagates."""
    region.check_backend(backend)
    gpu = [backend.array_info(t) for t in gpu_tensors]
    bpc = options.blocks_per_chunk
    canonical = check_canonical(layout, options.canonical)  # R7/R24: the mappings verified and fitting the layout
    check_geometry(layout, gpu, region.geometries(), bpc, cpu_pages(layout, canonical))  # R7: before device work
    if options.pinning == "alloc" and not region.allocated:  # R7: the region is as the option says
        raise errors.InvalidTransferError(
            "pinning='alloc' needs a region of pinned allocated memory: build it with HostRegion.allocate(..., "
            "pinning='alloc'), or let create_worker build it")
    if region.state is not RegionState.CALLER_OWNED:  # R1: only a caller-owned region is handed over
        tables.step(lifecycle.REGION_TABLE, "region", region.state, lifecycle.RegionInput.ADOPT)
    compute = backend.compute_stream(options.compute_stream)
    logger.info("Allocating %d CPU tensors...", layout.num_tensors)
    undo: list[tuple[str, Callable[[], object]]] = []  # R2: what to give back, in acquisition order
    try:
        # R11: on a backend whose copies to pageable memory block the host, no pageable fallback (a copy under the
        # lock must never block); elsewhere a failure leaves the region pageable (a warning), unless required.
        # "auto": a refusal of registration is raised, so that create_* can fall back to an allocation.
        required = options.require_pinned or bool(getattr(backend, "pageable_copies_block", False))
        if not region.pinned and region.pin(options.pin_chunk_bytes, required=required,
                                            raise_refused=options.pinning == "auto"):
            undo.append(("unpin the region", region.unpin))
        handlers = []
        running = Running(Holds(max(g.rows for g in gpu), max(c.rows for c in region.geometries())),
                          options.stall_warning)  # R27/R30: shared by both directions
        for direction in DIRECTIONS:  # R4: one handler, with its own stream, per direction
            handlers.append(new_handler(backend, direction, compute, layout, gpu, region.geometries(), bpc, canonical,
                                        running))
            undo.append((f"discard the {direction} handler", handlers[-1].discard))
        region.adopt()  # R1: from here on the worker is the region's only owner
    except BaseException:
        finish_all(reversed(undo))  # R2: reverse order, every step; then the original exception propagates
        raise
    return Core(backend, region, handlers[0], handlers[1], options.policy, compute, name, running)


#: The worker's fields the lock check guards (R19, ``lockcheck``): written by the lock's holder, or by the shutdown
#: thread once the worker is SHUTTING_DOWN.
GUARDED: Final = ("state", "report", "shutdown_thread", "shutdown_requested")


class Core:
    """Everything a worker holds; the finalizer references this, never the worker (R15)."""

    def __init__(self, backend: Backend, region: HostRegion, store: DirectionHandlerAPI, load: DirectionHandlerAPI,
                 policy: ShutdownPolicy, compute: Stream, name: str, running: Running) -> None:
        self.backend, self.store, self.load, self.policy, self.compute = backend, store, load, policy, compute
        self.running = running  # Invariant: the holds (R27) and stall warning (R30) both handlers share
        self.name = name  # the worker's class, for the finalizer's log line
        self.region = region  # Invariant: WORKER_OWNED until shutdown releases or quarantines it (R1)
        self.state = WorkerState.OPEN  # Invariant: changed only through tables.step(WORKER_TABLE), under lock
        self.report: ShutdownReport | None = None  # Invariant: set once, under lock, as the sequence ends
        self.shutdown_thread: int | None = None  # Invariant: the thread running the sequence (None before)
        # Invariant: reentrant, so a signal handler's shutdown() on a thread inside a call finds it owned (R19).
        self.lock = threading.RLock()
        self.done = threading.Condition(self.lock)
        self.shutdown_requested = False  # Invariant: a signal handler's shutdown() inside a call (R19)
        # Invariant: the ids a signal handler's cancel() asked for inside a call (R26); carried out as it returns.
        self.deferred_cancel: set[int] = set()
        self.owner = ProcessOwner()  # Invariant: the building process; in a forked child all is inert (R21)
        self.call = CallGuard(self)  # R19/R21: every public call enters through it
        lockcheck.bind(self, self, GUARDED)  # R19: from here on, these change under the lock (or by the shutdown)
        for handler in (store, load):
            lockcheck.bind(handler, self, handler_api.GUARDED)

    def transition(self, event: WorkerInput) -> Action:
        move = _WORKER_MOVES.get((self.state, event))
        if move is None:  # a refused pair: step raises its error
            move = tables.step(lifecycle.WORKER_TABLE, "worker", self.state, event)
        self.state, action = move
        return action

    # -- the calls (R4-R8, R19) -------------------------------------------------------------------------------------
    def submit(self, direction: Direction, job_id: int, src: object, dst: object, deadline: object = None,
               tag: object = None) -> bool:
        with self.call:  # R19: one step under the lock
            self.transition(_SUBMIT)  # R8: refused once shutdown began
            job = check_int("job_id", job_id)  # R7
            limit = None if deadline is None else check_positive("deadline", deadline, unit="seconds")  # R7/R26
            if self.store.knows(job) or self.load.knows(job):  # R7: an id in flight in either direction
                raise errors.InvalidTransferError(f"job_id {job} is already in flight; reuse an id only after "
                                                  "get_finished() reported it")
            (self.store if direction == "store" else self.load).submit(job, src, dst, limit, tag)  # R27: holds checked
        return True

    def cancel(self, job_ids: Iterable[int]) -> None:
        self.owner.check("this worker")  # R21
        ids = check_job_ids(job_ids)  # R7: nothing cancelled on bad input
        if self.lock._is_owned():  # type: ignore[attr-defined]  # a signal handler inside a call of this thread:
            self.deferred_cancel |= ids  # R19/R26: carried out as that call returns (never blocks, never re-enters)
            return
        with self.call:
            if self.transition(WorkerInput.CANCEL) is Action.RETURN_EMPTY:
                return  # R26: after shutdown began a no-op (the report says what became of each job)
            for handler in (self.store, self.load):  # R26: queries, never waits
                handler.cancel(ids)

    def held(self) -> HeldBlocks:
        with self.call:
            return self.running.holds.held()

    def take_released(self) -> list[ReleasedHold]:
        with self.call:
            return self.running.holds.take_released()

    def get_finished(self) -> list[TransferResult]:
        with self.call:
            if self.transition(_GET_FINISHED) is _RETURN_EMPTY:
                return []
            self.store.reap()  # backend calls: an interrupt here leaves every result where it waits (R14)
            self.load.reap()
            return [*self.store.take_results(), *self.load.take_results()]  # R14: no backend call: one step

    def wait(self, job_ids: Iterable[int], timeout: float | None) -> None:
        self.owner.check("this worker")  # R21
        ids, limit = check_job_ids(job_ids), None if timeout is None else check_timeout(timeout)  # R7
        started = self.backend.monotonic()
        deadline = None if limit is None else started + limit
        with self.call:
            if self.transition(_WAIT) is _RETURN_EMPTY:
                return
            awaited: list[tuple[DirectionHandlerAPI, object]] = []
            for handler in (self.store, self.load):
                mark = handler.last_of(ids)  # R6: FIFO: in each direction the last listed job queued settles them all
                if mark is not None:
                    awaited.append((handler, mark))
            # R19: the first awaited direction's first poll is one more non-blocking step of this hold, on the clock
            # reading just made; every later poll is a step of its own (a later direction's first on a new reading).
            polled = bool(awaited) and not awaited[0][0].settle(awaited[0][1])
        for handler, mark in awaited[0 if polled else 1:]:  # R19: the lock is held for each poll, never across a sleep
            wait_polling(self.backend, self._settle, started, deadline,
                         f"{handler.direction} job {getattr(mark, 'job_id', '?')}", now=started if polled else None,
                         polled=polled, args=(handler, mark))
            polled = False

    def _settle(self, handler: DirectionHandlerAPI, mark: object) -> bool:
        with self.call:  # True once ``mark`` resolved, or shutdown began in another thread (R19)
            return self.transition(_WAIT) is _RETURN_EMPTY or handler.settle(mark)

    def order_after(self, job_ids: Iterable[int], stream: object | None) -> None:
        self.owner.check("this worker")  # R21
        ids = check_job_ids(job_ids)  # R7
        target = self.compute if stream is None else self.backend.compute_stream(stream)  # R7: refused if not one
        with self.call:  # R19: one non-blocking step under the lock
            if self.transition(WorkerInput.ORDER) is Action.RETURN_EMPTY:
                return  # R23: after shutdown began it orders nothing (the report says what became of each job)
            for handler in (self.store, self.load):
                for end in handler.end_events(ids):  # R23: only jobs still queued; the rest order nothing
                    self.backend.wait_event(target, end)  # on the device: the host never blocks

    def snapshot(self) -> list[ByteArray]:
        with self.call:
            self.transition(WorkerInput.SNAPSHOT)
            return self.region.snapshot()

    def stats(self) -> results.WorkerStats:
        with self.call:
            return results.WorkerStats(self.state.value, self.store.stats(), self.load.stats(),
                                       self.region.state.value, self.region.pinned, self.backend.ledger.live(),
                                       self.region.quarantined_bytes,  # R30: the bytes kept in quarantine
                                       self.region.pinning)

    def finalize(self) -> None:
        """R15: shut down a worker dropped (or alive at exit) without shutdown(), safely from the collector; R21:
        inert in a forked child. The lock cannot be held here: a thread inside a call keeps the worker alive."""
        if not self.owner.inherited() and self.state is WorkerState.OPEN:
            finalize_safely(self.shutdown, self.policy.timeout, self.name)

    def carry_out_deferred(self) -> None:
        ids, self.deferred_cancel = self.deferred_cancel, set()
        if ids:
            self.cancel(ids)  # R26: the cancel a signal handler asked for while a call held the lock
        if self.shutdown_requested and self.state is WorkerState.OPEN:
            self.shutdown()  # R19: the shutdown a signal handler asked for while a call held the lock

    # -- the shutdown sequence (R8-R14, R19) ------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        self.owner.check("this worker")  # R21
        me = threading.get_ident()
        if self.lock._is_owned() or (self.shutdown_thread == me and self.report is None):  # type: ignore[attr-defined]
            self.shutdown_requested = self.shutdown_thread is None  # R19: carried out as the call returns
            raise errors.ShutdownDeferred("shutdown() was called on a thread inside a call of this worker (a signal "
                                          "handler?); it shuts down as that call returns, and a later shutdown() "
                                          "returns the report")
        run = ShutdownRun()
        try:
            with self.lock:
                state, action = tables.step(lifecycle.WORKER_TABLE, "worker", self.state, WorkerInput.SHUTDOWN)
                # R14: the state and the running thread change together: an interrupt after this finds it begun
                self.state, self.shutdown_thread = state, me if action is Action.RUN_SHUTDOWN else self.shutdown_thread
                if action is Action.AWAIT_REPORT:  # R8/R19: a second shutdown waits for the first (bounded, R11)
                    while self.report is None:
                        self.done.wait()
                    return self.report
                if action is Action.RETURN_REPORT:  # R8: the first call's report
                    assert self.report is not None  # Invariant: CLOSED implies a report
                    return self.report
            run.started = self.backend.monotonic()
            deadline = run.started + self.policy.timeout  # R11: one deadline for the drains and the proof
            self._drain_both(deadline, run)
            self._prove(deadline, run)
        except BaseException as exc:  # R14: an interrupt anywhere before the release (the clock read included)
            if self.shutdown_thread != me or self.report is not None:
                raise  # not this thread's sequence
            run.interrupt = run.interrupt or exc
        return self._finish(run)

    def _drain_both(self, deadline: float, run: ShutdownRun) -> None:
        """R9: store first, then load, whatever either raises; R14: an interrupt stops all waiting."""
        for name, handler in (("store", self.store), ("load", self.load)):
            try:
                handler.drain(deadline, interrupted=run.interrupt is not None)
            except BaseException as exc:  # the handler abandoned what it could not prove; teardown goes on (R9)
                if not isinstance(exc, Exception):
                    run.interrupt = run.interrupt or exc
            run.clean &= handler.clean
            if handler.drain_error is not None and handler.drain_error is not run.interrupt:
                logger.error("Failed to shut down %s offloading handler", name, exc_info=handler.drain_error)
                run.errors.append(f"{name}: {handler.drain_error!r}")

    def _prove(self, deadline: float, run: ShutdownRun) -> None:
        """R13: the device-level proof, only off the clean path (it shares the drains' deadline); R14: skipped after
        an interrupt."""
        decided = lifecycle.PROOF_DECISION[(run.clean, run.interrupt is not None)]
        if decided is not None:  # NOT_NEEDED on the clean path, SKIPPED after an interrupt
            run.proof = decided
            return
        streams = [self.compute, *self.store.streams_in_use(), *self.load.streams_in_use()]
        try:
            run.proof = ProofOutcome.OK if self.backend.prove_idle(streams, deadline) else ProofOutcome.TIMEOUT
        except errors.DeviceError as exc:
            run.proof = ProofOutcome.FAILED
            run.errors.append(f"device_sync: {exc!r}")
        except BaseException as exc:
            run.proof, run.interrupt = ProofOutcome.SKIPPED, exc  # R14
        if run.proof in (ProofOutcome.TIMEOUT, ProofOutcome.FAILED):
            if self.policy.policy is lifecycle.Policy.RELEASE:  # R12: vLLM #51622's behaviour, on request
                logger.warning("Device sync before mmap cleanup failed; proceeding with cleanup anyway")
            else:
                logger.warning("Device could not be proven idle (%s); quarantining what may still be under DMA",
                               run.proof.value)

    def _finish(self, run: ShutdownRun) -> ShutdownReport:
        """R14: release or quarantine everything, store the report and close, whatever is raised meanwhile; a
        Ctrl-C is held back until the release is done."""
        shield = Shield()
        try:
            if run.interrupt is not None:
                self._stop_waiting(run, shield)
            with sigint_deferred() as deferred:
                run.errors += finish_all([("release the worker's resources", lambda: self._release(run, shield))],
                                         shield)[0]
            run.interrupt = run.interrupt or shield.interrupt or deferred.interrupt
        except BaseException as exc:  # a second interrupt after the release
            run.interrupt = run.interrupt or exc
        finally:
            self._close(run, shield)
        if run.interrupt is not None:
            raise run.interrupt  # R14: propagates once everything is finished
        assert self.report is not None  # Invariant: _close stored it
        return self.report

    def _stop_waiting(self, run: ShutdownRun, shield: Shield) -> None:
        """R14: the interrupt may have come before a drain began: such a handler abandons everything now, without a
        wait, and the proof is decided as skipped unless the clean path held."""
        finish_all([(f"abandon the {h.direction} handler", h.abandon_undrained) for h in (self.store, self.load)],
                   shield)
        run.clean = run.clean and self.store.clean and self.load.clean
        if run.proof is ProofOutcome.NOT_NEEDED:
            run.proof = lifecycle.PROOF_DECISION[(run.clean, True)] or ProofOutcome.SKIPPED  # never None here

    def _release(self, run: ShutdownRun, shield: Shield) -> None:
        """R10/R12/R3: both handlers, then the region, released or quarantined as FATE says. Never waits."""
        fate = lifecycle.FATE[(run.proof, self.policy.policy)]
        reason = f"device not proven idle (device_sync={run.proof.value})"
        chunks = handler_api.unproven_chunks(self.store, self.load) if fate is Fate.QUARANTINE else None  # R29
        for name, handler in (("store", self.store), ("load", self.load)):
            kept, kept_streams, failed = handler.release(fate, shield, reason=reason)
            run.errors.extend(f"{name} release: {f}" for f in [*handler.leaks.errors, *failed])
            run.add("quarantined", "descriptor", kept)
            run.add("quarantined", "stream", kept_streams)  # R28: retired, not proven idle
            for kind, count in handler.leaks.counts.items():  # R16: release calls that failed, now or earlier
                run.add("leaked", kind, count)
        wait = self._wait_left(run, shield)  # R11: a shared file's lock is waited for within the same timeout
        if fate is Fate.RELEASE:  # R3 (R12: everything was proven idle, or the release policy)
            failed = self.region.release_by_owner(shield, wait=wait)
        else:  # R12/R29: what an unproven copy may touch is kept, mapped and pinned, until process exit
            failed = self.region.quarantine_by_owner(reason, wait=wait, chunks=chunks, shield=shield)
        run.errors.extend(f"region: {f}" for f in failed)
        for table, kinds in (("quarantined", self.region.quarantined_resources), ("leaked", self.region.leaked)):
            for kind, count in kinds.items():  # R16: what is kept, and what a failed release step left
                run.add(table, kind, count)
        run.kept, run.pinning = self.region.kept_ranges, self.region.pinning

    def _wait_left(self, run: ShutdownRun, shield: Shield) -> float:
        """R11: the seconds the release may still wait (a shared file's lock): what is left of the policy's timeout
        on the backend clock; none after an interrupt (R14) or when the clock cannot be read."""
        if run.interrupt is not None:
            return 0.0
        try:
            now = shield.run(self.backend.monotonic)
        except BaseException:  # a failed clock read waits for nothing; the shield keeps an interrupt (R14)
            return 0.0
        return max(0.0, run.started + self.policy.timeout - now)

    def _close(self, run: ShutdownRun, shield: Shield) -> None:
        """Store the report and close (no backend call but the clock, retried through interrupts)."""
        try:
            elapsed = shield.run(self.backend.monotonic) - run.started
        except BaseException as exc:
            run.interrupt, elapsed = run.interrupt or exc, self.policy.timeout
        run.interrupt = run.interrupt or shield.interrupt
        with self.lock:
            self.report = run.report(self.store.report(), self.load.report(), self.region.state, elapsed)
            self.transition(WorkerInput.INTERRUPTED if run.interrupt else WorkerInput.SHUTDOWN_COMPLETE)
            self.done.notify_all()
