"""The worker's core: what a worker holds, its lock, and the shutdown sequence (R8-R15, R19, R21).

Theory of operation
-------------------
``WorkerCore`` holds everything a worker owns (region, handlers, backend, policy, compute stream, report). The
public ``CPUOffloadingWorker`` is a thin facade over it, and its finalizer references the core, never the worker
(R15).

Concurrency (R19), in six lines:

1. ``lock`` (reentrant; every public call enters through ``call``, which also refuses a forked child, R21) guards
   the worker's state and both handlers while the worker is open; each public call holds it for one non-blocking
   step (a submission, a reap, one poll of a wait), never across a sleep or a blocking wait;
2. a submission runs entirely under the lock, and shutdown begins (OPEN -> SHUTTING_DOWN) under the same lock, so a
   submission is either queued completely before shutdown begins or refused (R8);
3. from SHUTTING_DOWN on no other call touches the handlers (get_finished/wait return empty, submissions are
   refused), so the shutdown thread drains and releases them without the lock, sleeping freely;
4. a second ``shutdown()`` waits on the condition ``done`` for the report (the first is bounded, R11);
5. the finalizer never takes the lock while a worker method holds it: a thread inside a worker method keeps the
   worker alive, and a finalizer the collector runs shuts down in a thread of its own (``_finalize``);
6. a ``shutdown()`` on a thread that already holds the lock or runs the shutdown -- a signal handler that
   interrupted it -- records the request and raises ``ShutdownDeferred``; ``Call.__exit__`` carries the request
   out as the interrupted call leaves the lock, so it never deadlocks and never half-queues a submission.

Shutdown (R9-R14) runs under one deadline on the backend clock:

1. drain the store handler, then the load handler, whatever either raises (R9); each stops at its first
   failure and abandons the rest (R10);
2. if some transfer was never proven by its own event, attempt the device-level proof (R13) -- unless a
   BaseException arrived, which skips it (R14);
3. ``lifecycle.decide_fate`` turns the proof's outcome and the policy into release or quarantine (R12): the
   handlers release their stream and events and free or quarantine the descriptor buffers of unproven
   transfers, then the region is released (R3) or quarantined. This step is shielded: every part of it runs
   whatever is raised meanwhile, and a Ctrl-C (SIGINT) is held back until it is done (R14);
4. the report is stored and the worker closes; an interrupting BaseException then propagates.

The sequence is protected from its first instruction (R14): the transition to SHUTTING_DOWN and the record of the
running thread change together (``_begin``), and an interrupt anywhere after them -- the first clock read
included -- still leads to ``_finish``, where ``_stop_waiting`` abandons a handler whose drain never began.
"""

from __future__ import annotations

import logging
import threading
from typing import Final

from kvoffload_ref import lifecycle
from kvoffload_ref.backends.base import Backend, ResourceKind, Stream
from kvoffload_ref.errors import DeviceError, LifecycleError, ShutdownDeferred
from kvoffload_ref.handler import DirectionHandler
from kvoffload_ref.lifecycle import (
    Action,
    Fate,
    Policy,
    ProofOutcome,
    RegionState,
    WorkerInput,
    WorkerState,
)
from kvoffload_ref.process import ProcessOwner, finalize_safely, sigint_deferred
from kvoffload_ref.region import HostRegion
from kvoffload_ref.results import DeviceSync, RegionFate, ShutdownPolicy, ShutdownReport
from kvoffload_ref.shield import Shield, finish_all

__all__ = ["DeviceSync", "RegionFate", "ShutdownPolicy", "ShutdownReport", "WorkerCore"]

logger = logging.getLogger("kvoffload_ref.worker")

class WorkerCore:
    """Everything a worker holds. The finalizer references this, never the worker (R15). See the module
    docstring for the locking (R19)."""

    def __init__(self, backend: Backend, region: HostRegion, store: DirectionHandler,
                 load: DirectionHandler, policy: ShutdownPolicy, compute: Stream) -> None:
        self.backend = backend
        # Invariant: owned by this worker (WORKER_OWNED) from construction until shutdown releases/quarantines it.
        self.region = region
        self.store = store
        self.load = load
        self.policy = policy
        # Invariant: the stream every transfer waits for (R4) and the device-level proof covers (R13).
        self.compute = compute
        # Invariant: changed only through lifecycle.step(WORKER_TABLE, ...), under lock.
        self.state = WorkerState.OPEN
        # Invariant: set exactly once, under lock, when the shutdown sequence ends (normally or interrupted).
        self.report: ShutdownReport | None = None
        # Invariant: the thread running the shutdown sequence (None before it begins).
        self.shutdown_thread: int | None = None
        # Invariant: reentrant, so that a signal handler's shutdown() on a thread inside a worker call finds the
        # lock owned by its own thread (``_is_owned``) instead of deadlocking on it (R19).
        self.lock = threading.RLock()
        self.done = threading.Condition(self.lock)
        # Invariant: set by a shutdown() that a signal handler called on a thread inside a worker call; carried
        # out as that call leaves the lock (``Call.__exit__``), R19.
        self.shutdown_requested = False
        # Invariant: the process that built the worker; in any other (a forked child) the worker is inert (R21).
        self.owner = ProcessOwner()
        self.call = Call(self)

    def transition(self, event: WorkerInput) -> Action:
        """One step of the worker's machine; the caller holds ``lock``."""
        self.state, action = lifecycle.step(lifecycle.WORKER_TABLE, "worker", self.state, event)
        return action

    # -- the shutdown sequence ------------------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        """The shutdown sequence (R8-R14, R19); see the module docstring.

        Raises:
            ShutdownDeferred: called on a thread that is inside a call of this worker (a signal handler): the
                shutdown runs as that call returns (R19).
            WorkerClosedError: called in a forked child (R21).
            BaseException: the interrupt that cut the sequence short, once everything is finished (R14).
        """
        self.owner.check("this worker")
        me = threading.get_ident()
        if self.lock._is_owned() or (self.shutdown_thread == me and self.report is None):  # type: ignore[attr-defined]
            return self._defer()
        run = ShutdownRun()
        try:
            with self.lock:
                action = self._begin(me)
                if action is Action.AWAIT_REPORT:
                    return self._await_report()
                if action is Action.RETURN_REPORT:
                    assert self.report is not None  # Invariant: CLOSED implies a report
                    return self.report
            run.started = self.backend.monotonic()
            deadline = run.started + self.policy.timeout
            self._drain_both(deadline, run)
            self._prove(deadline, run)
        except BaseException as exc:  # R14: an interrupt anywhere before the release (e.g. reading the clock)
            if self.shutdown_thread != me or self.report is not None:
                raise  # not this thread's sequence (it was never begun here)
            run.interrupt = run.interrupt or exc
        return self._finish(run)

    def _begin(self, me: int) -> Action:
        """SHUTDOWN through the table; the state and the running thread change together (no call between them),
        so an interrupt after this returns always finds the sequence begun (R14)."""
        state, action = lifecycle.step(lifecycle.WORKER_TABLE, "worker", self.state, WorkerInput.SHUTDOWN)
        self.state, self.shutdown_thread = state, me if action is Action.RUN_SHUTDOWN else self.shutdown_thread
        return action

    def _defer(self) -> ShutdownReport:
        """R19: a signal handler's shutdown() on a thread inside a worker call: recorded, carried out as the call
        returns (or, inside the running shutdown, moot)."""
        self.shutdown_requested = self.shutdown_thread is None
        raise ShutdownDeferred("shutdown() was called on a thread that is inside a call of this worker (a signal "
                               "handler interrupted it); the worker shuts down as that call returns, and a later "
                               "shutdown() returns the report")

    def _await_report(self) -> ShutdownReport:
        """R8/R19: a second shutdown waits for the running one (bounded by its timeout, R11)."""
        while self.report is None:
            self.done.wait()
        return self.report

    def _finish(self, run: ShutdownRun) -> ShutdownReport:
        """Release or quarantine everything, store the report and close, whatever is raised meanwhile (R14): a
        real Ctrl-C waits until the release is done, then counts as an interrupt like any other."""
        shield = Shield()
        try:
            if run.interrupt is not None:
                self._stop_waiting(run, shield)
            with sigint_deferred() as deferred:
                failed, _ = finish_all([("release the worker's resources", lambda: self._release(run, shield))],
                                       shield)
                run.errors.extend(failed)
            run.interrupt = run.interrupt or shield.interrupt or deferred.interrupt
        except BaseException as exc:  # a second interrupt after the release (restoring the SIGINT handler)
            run.interrupt = run.interrupt or exc
        finally:
            self._close(run, shield)
        if run.interrupt is not None:
            raise run.interrupt
        assert self.report is not None  # Invariant: _close stored it
        return self.report

    def _stop_waiting(self, run: ShutdownRun, shield: Shield) -> None:
        """R14: the interrupt may have come before a drain began (or before the proof was decided): a handler
        whose drain never began abandons everything now, without a wait, and the proof is decided as skipped
        unless the clean path held."""
        finish_all([(f"abandon the {h.direction} handler", h.abandon_undrained) for h in (self.store, self.load)],
                   shield)
        run.clean = run.clean and self.store.clean and self.load.clean
        if run.proof is ProofOutcome.NOT_NEEDED:
            decided = lifecycle.decide_proof(run.clean, True)  # never None once interrupted
            run.proof = ProofOutcome.SKIPPED if decided is None else decided

    def _close(self, run: ShutdownRun, shield: Shield) -> None:
        """Store the report and close (no backend call but the clock, retried through interrupts)."""
        try:
            elapsed = shield.run(self.backend.monotonic) - run.started
        except BaseException as exc:
            run.interrupt, elapsed = run.interrupt or exc, self.policy.timeout
        run.interrupt = run.interrupt or shield.interrupt
        with self.lock:
            self.report = run.report(self, elapsed)
            self.transition(WorkerInput.INTERRUPTED if run.interrupt else WorkerInput.SHUTDOWN_COMPLETE)
            self.done.notify_all()

    def _drain_both(self, deadline: float, run: ShutdownRun) -> None:
        """R9: store first, then load, whatever either raises; a BaseException stops all waiting (R14)."""
        for name, handler in (("store", self.store), ("load", self.load)):
            try:
                handler.drain(deadline, interrupted=run.interrupt is not None)
            except BaseException as exc:  # the handler abandoned what it could not prove; teardown goes on (R9)
                if not isinstance(exc, Exception):
                    run.interrupt = run.interrupt or exc
            run.clean &= handler.clean
            error = handler.drain_error
            if error is not None and error is not run.interrupt:
                logger.error("Failed to shut down %s offloading handler", name, exc_info=error)
                run.errors.append(f"{name}: {error!r}")

    def _prove(self, deadline: float, run: ShutdownRun) -> None:
        """R13: the device-level proof, only off the clean path; skipped after an interrupt (R14)."""
        decided = lifecycle.decide_proof(run.clean, run.interrupt is not None)
        if decided is not None:
            run.proof = decided
            return
        streams: list[Stream] = [self.compute, *self.store.streams_in_use(), *self.load.streams_in_use()]
        try:
            run.proof = ProofOutcome.OK if self.backend.prove_idle(streams, deadline) else ProofOutcome.TIMEOUT
        except DeviceError as exc:
            run.proof = ProofOutcome.FAILED
            run.errors.append(f"device_sync: {exc!r}")
        except BaseException as exc:
            run.proof = ProofOutcome.SKIPPED
            run.interrupt = exc
        if run.proof in (ProofOutcome.TIMEOUT, ProofOutcome.FAILED):
            if self.policy.policy is Policy.RELEASE:
                logger.warning("Device sync before mmap cleanup failed; proceeding with cleanup anyway")
            else:
                logger.warning("Device could not be proven idle (%s); quarantining what may still be under DMA",
                               run.proof.value)

    def _release(self, run: ShutdownRun, shield: Shield) -> None:
        """R10/R12/R3: release or quarantine, both handlers then the region, every step whatever an earlier one
        raised (R9, R14). Never waits."""
        fate = lifecycle.decide_fate(run.proof, self.policy.policy)
        reason = f"device not proven idle (device_sync={run.proof.value})"
        for name, handler in (("store", self.store), ("load", self.load)):
            kept, failed = handler.release(fate, shield, reason=reason)
            run.errors.extend(f"{name} release: {f}" for f in failed)
            run.add("quarantined", "descriptor", kept)
        self._finish_region(fate, reason, run, shield)

    def _finish_region(self, fate: Fate, reason: str, run: ShutdownRun, shield: Shield) -> None:
        region = self.region
        if fate is Fate.RELEASE:
            run.errors.extend(f"region: {f}" for f in region.release_by_owner(shield))
            kept = region.leaked
        else:
            run.errors.extend(f"region: {f}" for f in region.quarantine_by_owner(reason))
            kept = region.quarantined_resources
        for kind, count in kept.items():
            run.add("leaked" if fate is Fate.RELEASE else "quarantined", kind, count)


class Call:
    """The worker's lock around one public call (R19, R21): refused in a forked child; refused (but for
    ``shutdown()``, which is deferred) on a thread already inside a call of this worker, i.e. from a signal handler
    that interrupted it; and on the way out, the shutdown such a handler asked for is carried out."""

    __slots__ = ("_core",)

    def __init__(self, core: WorkerCore) -> None:
        self._core = core

    def __enter__(self) -> None:
        core = self._core
        core.owner.check("this worker")
        if core.lock._is_owned():  # type: ignore[attr-defined]
            raise LifecycleError("a worker method was called from a signal handler on a thread that is inside "
                                 "another call of the same worker; only shutdown() may be called there (R19)")
        core.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        core = self._core
        core.lock.release()
        if core.shutdown_requested and core.state is WorkerState.OPEN:
            core.shutdown()  # R19: the shutdown a signal handler asked for while this call held the lock


class ShutdownRun:
    """Scratch state of one shutdown sequence, turned into the report at the end."""

    def __init__(self) -> None:
        # Invariant: the backend clock when the sequence began (0.0 until read).
        self.started = 0.0
        self.clean = True
        self.proof = ProofOutcome.NOT_NEEDED
        self.interrupt: BaseException | None = None
        self.errors: list[str] = []
        self.counts: dict[str, dict[str, int]] = {"quarantined": {}, "leaked": {}}

    def add(self, table: str, kind: ResourceKind, count: int) -> None:
        if count:
            self.counts[table][kind] = self.counts[table].get(kind, 0) + count

    def report(self, core: WorkerCore, elapsed: float) -> ShutdownReport:
        return ShutdownReport(
            store=core.store.report(), load=core.load.report(),
            device_sync=self.proof.value,
            region=_REGION_FATE.get(core.region.state, "absent"),
            quarantined=dict(self.counts["quarantined"]), leaked=dict(self.counts["leaked"]),
            errors=tuple(self.errors), elapsed=elapsed, interrupted=self.interrupt is not None,
        )


_REGION_FATE: Final[dict[RegionState | None, RegionFate]] = {
    RegionState.RELEASED: "released", RegionState.QUARANTINED: "quarantined"}


def finalize(core: WorkerCore) -> None:
    """R15: shut down a worker that was dropped (or alive at exit) without shutdown().

    Run through ``process.finalize_safely`` (from the collector: in a thread of its own, joined with a bound, so it
    cannot deadlock on a library lock this thread holds). The worker's own lock cannot be held here: a thread
    holding it is inside one of the worker's methods, so the worker is alive (R19).
    """
    if core.owner.inherited() or core.state is not WorkerState.OPEN:
        return  # R21: a forked child's copy touches nothing of the parent's, and takes no lock the fork copied
    finalize_safely(core.shutdown, core.policy.timeout, "CPUOffloadingWorker")
