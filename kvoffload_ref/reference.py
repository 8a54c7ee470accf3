"""The reference worker: the normative statement of what an offloading worker does (with ``reference_handler.py``).

**This file is the rule; ``worker.py`` is the fast implementation.** The conformance kit, the call-point explorer
and the differential test run both, and where they disagree the reference is right. Read it top to bottom
together with ``lifecycle.py`` (the state machines as data): every transition below goes through
``lifecycle.step`` on ``WORKER_TABLE``/``HANDLER_TABLE`` (the region's through its own methods), every shutdown
decision through ``decide_proof``/``decide_fate``, and each rule is carried out where its R-number stands.

What it is built from: the specs and the plain placement rule (one copy descriptor per ``placement.Move``), the
Backend protocol's per-call methods (no batched release, no prefix query), ``HostRegion``, the shield, the result
types, ``ProcessOwner``. One stream per direction, one ``threading.RLock``, no pools, no batching: each transfer
creates its three events (compute marker, start, end) and its descriptor buffer, and frees them once proven.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType

import numpy as np
import numpy.typing as npt

from kvoffload_ref import errors, lifecycle, results
from kvoffload_ref.backends import base
from kvoffload_ref.backends.base import POLL_FIRST_SLEEP, POLL_MAX_SLEEP, Backend, Stream
from kvoffload_ref.lifecycle import Action, Fate, ProofOutcome, RegionState, WorkerInput, WorkerState
from kvoffload_ref.process import ProcessOwner, finalize_safely, sigint_deferred
from kvoffload_ref.reference_handler import ReferenceHandler
from kvoffload_ref.region import DEFAULT_PIN_CHUNK_BYTES, HostRegion
from kvoffload_ref.results import ShutdownPolicy, ShutdownReport, TransferResult
from kvoffload_ref.shield import Shield, finish_all
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, check_geometry
from kvoffload_ref.validate import check_int, check_job_ids, check_timeout

__all__ = ["ReferenceStats", "ReferenceWorker", "create_reference_worker"]

logger = logging.getLogger("kvoffload_ref.reference")


@dataclasses.dataclass(frozen=True)
class ReferenceStats:
    """A frozen snapshot of a reference worker (the fields of ``worker.WorkerStats``)."""

    state: str
    store: results.HandlerStats
    load: results.HandlerStats
    region: str
    pinned: bool
    ledger_live: Mapping[base.ResourceKind, int]


class _Run:
    """Scratch state of one shutdown sequence, turned into the report at its end."""

    def __init__(self) -> None:
        self.started = 0.0  # Invariant: the backend clock when the sequence began (0.0 until read).
        self.clean = True
        self.proof = ProofOutcome.NOT_NEEDED
        self.interrupt: BaseException | None = None  # Invariant: the first BaseException that cut it short.
        self.errors: list[str] = []
        self.counts: dict[str, dict[str, int]] = {"quarantined": {}, "leaked": {}}

    def add(self, table: str, kind: str, count: int) -> None:
        if count:
            self.counts[table][kind] = self.counts[table].get(kind, 0) + count


class _Core:
    """Everything a reference worker holds; the finalizer references this, never the worker (R15)."""

    def __init__(self, backend: Backend, region: HostRegion, store: ReferenceHandler, load: ReferenceHandler,
                 policy: ShutdownPolicy, compute: Stream) -> None:
        self.backend, self.policy, self.compute = backend, policy, compute
        # Invariant: owned by this worker (WORKER_OWNED) until shutdown releases or quarantines it (R1).
        self.region = region
        self.store, self.load = store, load
        # Invariant: changed only through lifecycle.step(WORKER_TABLE, ...), under lock.
        self.state = WorkerState.OPEN
        # Invariant: set once, under lock, when the shutdown sequence ends.
        self.report: ShutdownReport | None = None
        # Invariant: the thread running the shutdown sequence (None before it begins).
        self.shutdown_thread: int | None = None
        # Invariant: reentrant, so a signal handler's shutdown() on a thread inside a call finds it owned (R19).
        self.lock = threading.RLock()
        self.done = threading.Condition(self.lock)
        # Invariant: a shutdown() a signal handler asked for inside a call; carried out as the call leaves (R19).
        self.shutdown_requested = False
        # Invariant: the process that built the worker; in a forked child everything is inert (R21).
        self.owner = ProcessOwner()

    def transition(self, event: WorkerInput) -> Action:
        self.state, action = lifecycle.step(lifecycle.WORKER_TABLE, "worker", self.state, event)
        return action

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One public call under the lock (R19), refused in a forked child (R21)."""
        self.owner.check("this worker")  # R21
        if self.lock._is_owned():  # type: ignore[attr-defined]  # R19: re-entered from a signal handler
            raise errors.LifecycleError("a worker method was called from a signal handler on a thread inside another "
                                        "call of the same worker; only shutdown() may be called there (R19)")
        self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()
            if self.shutdown_requested and self.state is WorkerState.OPEN:
                self.shutdown()  # R19: the shutdown a signal handler asked for while this call held the lock

    # -- shutdown (R8-R14, R19) -------------------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        self.owner.check("this worker")  # R21
        me = threading.get_ident()
        if self.lock._is_owned() or (self.shutdown_thread == me and self.report is None):  # type: ignore[attr-defined]
            self.shutdown_requested = self.shutdown_thread is None  # R19: deferred to the end of the call
            raise errors.ShutdownDeferred("shutdown() was called on a thread inside a call of this worker (a signal "
                                          "handler interrupted it); the worker shuts down as that call returns, "
                                          "and a later shutdown() returns the report")
        run = _Run()
        try:
            with self.lock:
                state, action = lifecycle.step(lifecycle.WORKER_TABLE, "worker", self.state, WorkerInput.SHUTDOWN)
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
            for name, handler in (("store", self.store), ("load", self.load)):  # R9: store first, then load
                try:
                    handler.drain(deadline, interrupted=run.interrupt is not None)
                except BaseException as exc:  # R9: teardown goes on; R14: an interrupt stops all waiting
                    if not isinstance(exc, Exception):
                        run.interrupt = run.interrupt or exc
                run.clean &= handler.clean
                if handler.error is not None and handler.error is not run.interrupt:
                    logger.error("Failed to shut down %s offloading handler", name, exc_info=handler.error)
                    run.errors.append(f"{name}: {handler.error!r}")
            self._prove(deadline, run)
        except BaseException as exc:  # R14: an interrupt anywhere before the release (the clock read included)
            if self.shutdown_thread != me or self.report is not None:
                raise  # not this thread's sequence
            run.interrupt = run.interrupt or exc
        return self._finish(run)

    def _prove(self, deadline: float, run: _Run) -> None:
        """R13: the device-level proof, only off the clean path; R14: skipped after an interrupt."""
        decided = lifecycle.decide_proof(run.clean, run.interrupt is not None)
        if decided is not None:  # NOT_NEEDED on the clean path, SKIPPED after an interrupt
            run.proof = decided
            return
        streams = [self.compute, *(h.stream for h in (self.store, self.load) if h.stream is not None)]
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

    def _finish(self, run: _Run) -> ShutdownReport:
        """R14: release or quarantine everything, store the report and close, whatever is raised meanwhile; a
        Ctrl-C is held back until the release is done."""
        shield = Shield()
        try:
            if run.interrupt is not None:  # R14: the interrupt may have come before a drain began
                finish_all([(f"abandon the {h.direction} handler", h.abandon_undrained)
                            for h in (self.store, self.load)], shield)
                run.clean = run.clean and self.store.clean and self.load.clean
                if run.proof is ProofOutcome.NOT_NEEDED:
                    run.proof = lifecycle.decide_proof(run.clean, True) or ProofOutcome.SKIPPED  # never None here
            with sigint_deferred() as deferred:
                failed, _ = finish_all([("release the worker's resources", lambda: self._release(run, shield))],
                                       shield)
                run.errors.extend(failed)
            run.interrupt = run.interrupt or shield.interrupt or deferred.interrupt
        except BaseException as exc:  # a second interrupt after the release
            run.interrupt = run.interrupt or exc
        finally:
            self._close(run, shield)
        if run.interrupt is not None:
            raise run.interrupt  # R14: propagates once everything is finished
        assert self.report is not None  # Invariant: _close stored it
        return self.report

    def _release(self, run: _Run, shield: Shield) -> None:
        """R10/R12/R3: both handlers, then the region, released or quarantined as decide_fate says. Never waits."""
        fate = lifecycle.decide_fate(run.proof, self.policy.policy)
        reason = f"device not proven idle (device_sync={run.proof.value})"
        for name, handler in (("store", self.store), ("load", self.load)):
            kept, failed = handler.release(fate, shield, reason)
            run.errors.extend(f"{name} release: {f}" for f in failed)
            run.add("quarantined", "descriptor", kept)
        if fate is Fate.RELEASE:  # R3 (R12: everything was proven idle, or the release policy)
            run.errors.extend(f"region: {f}" for f in self.region.release_by_owner(shield))
            table, kinds = "leaked", self.region.leaked  # R16: a release step that failed
        else:  # R12: quarantined: mapped and pinned until process exit
            run.errors.extend(f"region: {f}" for f in self.region.quarantine_by_owner(reason))
            table, kinds = "quarantined", self.region.quarantined_resources
        for kind, count in kinds.items():
            run.add(table, kind, count)

    def _close(self, run: _Run, shield: Shield) -> None:
        """Store the report and close (no backend call but the clock, retried through interrupts)."""
        try:
            elapsed = shield.run(self.backend.monotonic) - run.started
        except BaseException as exc:
            run.interrupt, elapsed = run.interrupt or exc, self.policy.timeout
        run.interrupt = run.interrupt or shield.interrupt
        fate = {RegionState.RELEASED: "released", RegionState.QUARANTINED: "quarantined"}
        with self.lock:
            self.report = ShutdownReport(
                store=self.store.report(), load=self.load.report(), device_sync=run.proof.value,
                region=fate.get(self.region.state, "absent"),  # type: ignore[arg-type]
                quarantined=dict(run.counts["quarantined"]), leaked=dict(run.counts["leaked"]),
                errors=tuple(run.errors), elapsed=elapsed, interrupted=run.interrupt is not None)
            self.transition(WorkerInput.INTERRUPTED if run.interrupt else WorkerInput.SHUTDOWN_COMPLETE)
            self.done.notify_all()


def _finalize(core: _Core) -> None:
    """R15: shut down a worker dropped (or alive at exit) without shutdown(); R21: inert in a forked child. Run by
    the cyclic collector (maybe while this thread holds a library lock), the shutdown runs in a thread of its own,
    joined at most the policy's timeout plus a second, so that it cannot deadlock."""
    if core.owner.inherited() or core.state is not WorkerState.OPEN:
        return

    finalize_safely(core.shutdown, core.policy.timeout, "ReferenceWorker")


class ReferenceWorker:
    """The reference offloading worker, with the API of ``CPUOffloadingWorker``; every method is thread-safe (R19).

    Args:
        backend, gpu_tensors, layout, blocks_per_chunk, policy, pin_chunk_bytes, compute_stream: as for
            ``CPUOffloadingWorker``.
        region: a caller-owned HostRegion for this layout; on success the worker is its only owner (R1).

    Raises:
        InvalidTransferError: bad tensors, region or options (R7). OwnershipError: the region is not the caller's.
        DeviceError: a device call failed; what was acquired is released in reverse order (R2).
    """

    def __init__(self, backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                 blocks_per_chunk: int, region: HostRegion, policy: ShutdownPolicy | None = None,
                 pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES, compute_stream: object | None = None) -> None:
        bpc, pin_bytes = _check_options(blocks_per_chunk, policy, pin_chunk_bytes)
        region.check_backend(backend)
        gpu = [backend.array_info(t) for t in gpu_tensors]
        check_geometry(layout, gpu, region.geometries(), bpc)  # R7: before any device work
        if region.state is not RegionState.CALLER_OWNED:  # R1: only a caller-owned region is handed over
            lifecycle.step(lifecycle.REGION_TABLE, "region", region.state, lifecycle.RegionInput.ADOPT)
        compute = backend.compute_stream(compute_stream)
        undo: list[tuple[str, Callable[[], object]]] = []  # R2: what to release, in acquisition order
        try:
            if not region.pinned:
                try:
                    region.pin(pin_bytes)
                    undo.append(("unpin the region", region.unpin))
                except errors.DeviceError as exc:
                    logger.warning("Failed to pin the CPU region (status %d); transfers run from pageable memory",
                                   exc.status)
            handlers = []
            for direction in ("store", "load"):
                stream = backend.create_stream()  # R4: one stream per direction
                undo.append((f"destroy the {direction} stream", functools.partial(backend.destroy_stream, stream)))
                handlers.append(ReferenceHandler(backend, direction, stream, compute, layout, gpu,
                                                 region.geometries(), bpc))
            region.adopt()  # R1: from here on the worker is the region's only owner
        except BaseException:
            finish_all(reversed(undo))  # R2: reverse order, every step, then the original exception propagates
            raise
        self._core = _Core(backend, region, handlers[0], handlers[1], policy or ShutdownPolicy(), compute)
        self._finalizer = weakref.finalize(self, _finalize, self._core)  # R15: it references the core only

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> bool:
        """Queue a GPU -> CPU copy; see :meth:`submit_load`."""
        return self._submit(self._core.store, job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Queue a CPU -> GPU copy, after this direction's previous one and the compute work queued so far (R4).

        Returns:
            True: the transfer is queued.

        Raises:
            InvalidTransferError: bad input, nothing changed (R7). WorkerClosedError: shutdown began (R8), or a
                forked child (R21). DeviceError: a device call failed before the copy was queued; nothing was.
        """
        return self._submit(self._core.load, job_id, src_spec, dst_spec)

    def _submit(self, handler: ReferenceHandler, job_id: int, src: object, dst: object) -> bool:
        core = self._core
        with core.call():  # R19: queued completely before shutdown begins, or refused
            core.transition(WorkerInput.SUBMIT)  # R8: refused once shutdown began
            job = check_int("job_id", job_id)  # R7
            if job in core.store.jobs or job in core.load.jobs:  # R7: an id in flight in either direction
                raise errors.InvalidTransferError(f"job_id {job} is already in flight; reuse an id only after "
                                                  "get_finished() reported it")
            handler.submit(job, src, dst)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Results whose completion became known, each exactly once, store's first (R5, R19). Never blocks.

        Returns:
            The results; [] once shutdown began (R8).
        """
        core = self._core
        with core.call():
            if core.transition(WorkerInput.GET_FINISHED) is Action.RETURN_EMPTY:
                return []
            for h in (core.store, core.load):  # backend calls: an interrupt leaves every result where it waits
                h.reap()
                h.free_spent()
            return [*core.store.take_results(), *core.load.take_results()]  # R14: no backend call: one step

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until each listed job is proven complete or failed (R6); unknown ids are ignored. The lock is held
        only while polling, never while sleeping (R19); once shutdown began elsewhere it returns at its next poll.

        Args:
            job_ids: the ids. timeout: seconds on the backend clock, or None.

        Raises:
            InvalidTransferError: bad ids or timeout (R7). DeadlineExceeded: the timeout passed first (R6).
        """
        core, backend = self._core, self._core.backend
        core.owner.check("this worker")  # R21
        ids, limit = check_job_ids(job_ids), check_timeout(timeout)
        started = backend.monotonic()
        deadline = None if limit is None else started + limit
        with core.call():
            if core.transition(WorkerInput.WAIT) is Action.RETURN_EMPTY:
                return
            # R6: in FIFO order, once the last listed job of a direction is resolved, all of them are
            marks = [(h, next((t for t in reversed(h.queue) if t.job_id in ids), None)) for h in (core.store,
                                                                                                    core.load)]
        horizon = backend.hang_horizon if deadline is None else None  # the sim bounds hung work (R11's horizon)
        longest = POLL_MAX_SLEEP if horizon is None else max(POLL_MAX_SLEEP, horizon / 64)
        for handler, mark in marks:
            pause = POLL_FIRST_SLEEP
            while mark is not None:
                with core.call():
                    if core.transition(WorkerInput.WAIT) is Action.RETURN_EMPTY:
                        return  # R19: shutdown began in another thread
                    handler.reap(until=mark)
                    if mark.resolved:
                        break
                now, what = backend.monotonic(), f"{handler.direction} job {mark.job_id}"
                if deadline is not None and now >= deadline:
                    raise errors.DeadlineExceeded(f"{what} not proven complete by the deadline")
                if horizon is not None:
                    backend.check_unbounded_wait(started, now, what)  # SimHang past the horizon
                backend.sleep(pause if deadline is None else max(min(pause, deadline - now), 0.0))
                pause = min(pause * 2, longest)

    def cpu_snapshot(self) -> list[npt.NDArray[np.uint8]]:
        """Copies of the CPU region, one 2-D uint8 array per tensor.

        Raises:
            WorkerClosedError: shutdown began.
        """
        core = self._core
        with core.call():
            core.transition(WorkerInput.SNAPSHOT)
            return core.region.snapshot()

    def stats(self) -> ReferenceStats:
        """A frozen snapshot; works before and after shutdown."""
        core = self._core
        with core.call():
            return ReferenceStats(core.state.value, core.store.stats(), core.load.stats(), core.region.state.value,
                                  core.region.pinned, core.backend.ledger.live())

    def shutdown(self) -> ShutdownReport:
        """Shut down within the policy's timeout (R9-R14); idempotent (R8); safe from any thread (R19).

        Returns:
            The report; a later call returns the same one.

        Raises:
            BaseException: one that interrupted the shutdown, once everything is released or quarantined (R14).
            ShutdownDeferred: called on a thread inside a call of this worker (a signal handler): the shutdown
                runs as that call returns (R19). WorkerClosedError: called in a forked child (R21).
        """
        try:
            return self._core.shutdown()
        finally:
            if self._core.state is WorkerState.CLOSED:
                self._finalizer.detach()

    def __enter__(self) -> ReferenceWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()  # R15

    def __repr__(self) -> str:
        core = self._core
        return f"<ReferenceWorker {core.state.value} on {core.backend.name}, region {core.region.state.value}>"


def _check_options(blocks_per_chunk: object, policy: object, pin_chunk_bytes: object) -> tuple[int, int]:
    """R7: the numeric options and the policy, checked before anything is built."""
    if policy is not None and not isinstance(policy, ShutdownPolicy):
        raise errors.InvalidTransferError(f"policy must be a ShutdownPolicy or None, got {type(policy).__name__}")
    return (check_int("blocks_per_chunk", blocks_per_chunk, minimum=1),
            check_int("pin_chunk_bytes", pin_chunk_bytes, minimum=1))


def create_reference_worker(backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                            blocks_per_chunk: int, num_cpu_chunks: int, policy: ShutdownPolicy | None = None,
                            region: HostRegion | None = None, pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
                            compute_stream: object | None = None) -> ReferenceWorker:
    """Build the region (unless given) and the reference worker, as ``create_worker`` does (R1, R2).

    Args:
        num_cpu_chunks: CPU rows per tensor of the region built here. region: a caller-owned region instead.
        The others: as for :class:`ReferenceWorker`.

    Returns:
        The worker, owning its region.

    Raises:
        What :class:`ReferenceWorker` raises; a region built here is released first (R2).
    """
    _check_options(blocks_per_chunk, policy, pin_chunk_bytes)  # R7: before a region is mapped
    check_int("num_cpu_chunks", num_cpu_chunks, minimum=1)
    build = functools.partial(ReferenceWorker, backend, gpu_tensors, layout, blocks_per_chunk=blocks_per_chunk,
                              policy=policy, pin_chunk_bytes=pin_chunk_bytes, compute_stream=compute_stream)
    if region is not None:
        return build(region=region)
    built = HostRegion.allocate(backend, layout, blocks_per_chunk, num_cpu_chunks)
    try:
        return build(region=built)
    except BaseException:
        built.release()  # R2: the region built here goes too; the original exception propagates
        raise
