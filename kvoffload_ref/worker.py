"""CPUOffloadingWorker: owns the host region and both direction handlers, and shuts them down safely.

Theory of operation
-------------------
The worker is a thin facade over ``_WorkerCore``, which holds everything (region, handlers, backend, policy,
report). A ``weakref.finalize`` over the core -- never over the worker -- shuts it down if the worker is dropped
or still alive at interpreter exit (R15).

Construction (R1, R2) acquires with guards whose unwinding *is* the cleanup order: pin the region, build the
store handler, build the load handler, then adopt the region. Any failure unwinds exactly what was acquired, in
reverse, leaves the caller's region the caller's, and re-raises the original exception.

Shutdown (R9-R14) runs under one deadline on the backend clock:

1. drain the store handler, then the load handler, whatever either raises (R9); each stops at its first
   failure and abandons the rest (R10);
2. if some transfer was never proven by its own event, attempt the device-level proof (R13) -- unless a
   BaseException arrived, which skips it (R14);
3. ``lifecycle.decide_fate`` turns the proof's outcome and the policy into release or quarantine (R12): the
   handlers release their streams and events and free or quarantine the descriptor buffers of unproven
   transfers, then the region is released (R3) or quarantined;
4. the report is stored; a second ``shutdown()`` returns it (R8); an interrupting BaseException propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import signal
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from kvoffload_ref import lifecycle
from kvoffload_ref.backends.base import POLL_FIRST_SLEEP, POLL_MAX_SLEEP, Backend, ResourceKind, Stream
from kvoffload_ref.backends.sim import SimHang
from kvoffload_ref.errors import DeadlineExceeded, DeviceError, InvalidTransferError, WorkerClosedError
from kvoffload_ref.handler import DirectionHandler, HandlerReport, HandlerStats, TransferResult, finish_all
from kvoffload_ref.layout import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, check_geometry
from kvoffload_ref.lifecycle import (
    Action,
    Fate,
    Policy,
    ProofDecision,
    ProofOutcome,
    RegionState,
    WorkerInput,
    WorkerState,
)
from kvoffload_ref.region import DEFAULT_PIN_CHUNK_BYTES, HostRegion, QuarantinedItem, quarantine

__all__ = [
    "CPUOffloadingWorker",
    "HandlerReport",
    "ShutdownPolicy",
    "ShutdownReport",
    "WorkerStats",
    "create_worker",
]

logger = logging.getLogger("kvoffload_ref.worker")

DEFAULT_TIMEOUT: Final = 5.0
DIRECTIONS: Final[tuple[Direction, Direction]] = ("store", "load")


@dataclasses.dataclass(frozen=True)
class ShutdownPolicy:
    """How shutdown treats time and unproven memory.

    Attributes:
        timeout: seconds (backend clock) for the whole shutdown: drains and the device-level proof (R11).
        on_unproven: "quarantine" (default: keep memory that may still be under DMA alive until process exit,
            R12) or "release" (vLLM #51622: release it after a best-effort proof).

    Raises:
        InvalidTransferError: a negative or non-finite timeout, or an unknown on_unproven.
    """

    timeout: float = DEFAULT_TIMEOUT
    on_unproven: str = "quarantine"

    def __post_init__(self) -> None:
        if not isinstance(self.timeout, (int, float)) or not 0 <= self.timeout < float("inf"):
            raise InvalidTransferError(f"timeout must be a finite number >= 0, got {self.timeout!r}")
        if self.on_unproven not in {p.value for p in Policy}:
            raise InvalidTransferError(
                f"on_unproven must be 'quarantine' or 'release', got {self.on_unproven!r}")

    @property
    def policy(self) -> Policy:
        return Policy(self.on_unproven)


def check_job_id(job_id: object) -> int:
    """A job id: an int or numpy integer, not a bool (R7).

    Raises:
        InvalidTransferError: anything else.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
        raise InvalidTransferError(f"job_id must be an int, got {type(job_id).__name__}")
    return int(job_id)


def check_job_ids(job_ids: object) -> set[int]:
    """The ids a ``wait`` lists: an iterable of job ids (R7).

    Raises:
        InvalidTransferError: not an iterable (e.g. ``wait(8)``: pass ``wait({8})``), or an element that is not
            a job id.
    """
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise InvalidTransferError(f"job_ids must be an iterable of job ids (e.g. {{{job_ids!r}}}), "
                                   f"got {type(job_ids).__name__}")
    return {check_job_id(job) for job in job_ids}


def check_timeout(timeout: object) -> float | None:
    """A wait's timeout: None (no bound) or a real number >= 0 (R7); infinity means no bound.

    Raises:
        InvalidTransferError: a bool, a non-number (e.g. the string "1"), NaN, or a negative number.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise InvalidTransferError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    value = float(timeout)
    if math.isnan(value) or value < 0:
        raise InvalidTransferError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return None if math.isinf(value) else value


DeviceSync = Literal["not_needed", "ok", "timeout", "failed", "skipped"]
RegionFate = Literal["released", "quarantined", "absent"]


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """What shutdown did.

    Attributes:
        store, load: each handler's drain: transfers drained, abandoned, and the first failure (R10).
        device_sync: whether the device-level proof (R13) ran and what it established: "not_needed" (the clean
            path held), "ok", "timeout", "failed", or "skipped" (an interrupt stopped all waiting, R14).
        region: "released" or "quarantined" (R12); "absent" only if the region could not be finished at all.
        quarantined: ledger kind -> count kept alive on purpose until process exit (R12).
        leaked: ledger kind -> count the library could not release (a failed release step, R16).
        errors: every failure of the teardown, as text (R9).
        elapsed: seconds on the backend clock (R11).
        interrupted: a BaseException cut the shutdown short (R14).
    """

    store: HandlerReport
    load: HandlerReport
    device_sync: DeviceSync
    region: RegionFate
    quarantined: Mapping[str, int]
    leaked: Mapping[str, int]
    errors: tuple[str, ...]
    elapsed: float
    interrupted: bool


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A frozen snapshot of a worker (for tests, invariants and dashboards)."""

    state: str
    store: HandlerStats
    load: HandlerStats
    region: str
    pinned: bool
    ledger_live: Mapping[ResourceKind, int]


class _WorkerCore:
    """Everything a worker holds. The finalizer references this, never the worker (R15).

    Concurrency (R19): ``lock`` guards the worker's state and everything inside both handlers while the worker is
    open; it is held for each non-blocking step (a submission, one reap, one poll of a wait) and never across a
    sleep or a blocking wait. Once the state is SHUTTING_DOWN (set under the lock) no other thread touches the
    handlers, so the shutdown thread drains and releases them without the lock; ``done`` wakes a second
    ``shutdown()`` when the report is stored.
    """

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
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)

    def transition(self, event: WorkerInput) -> Action:
        """One step of the worker's machine; the caller holds ``lock``."""
        self.state, action = lifecycle.step(lifecycle.WORKER_TABLE, "worker", self.state, event)
        return action

    # -- the shutdown sequence ------------------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        with self.lock:
            action = self.transition(WorkerInput.SHUTDOWN)
            if action is Action.AWAIT_REPORT:
                return self._await_report()
            if action is Action.RETURN_REPORT:
                assert self.report is not None  # Invariant: CLOSED implies a report
                return self.report
            self.shutdown_thread = threading.get_ident()
        return self._run_shutdown()

    def _await_report(self) -> ShutdownReport:
        """R8/R19: a second shutdown waits for the running one (bounded by its timeout, R11)."""
        if self.shutdown_thread == threading.get_ident():
            raise WorkerClosedError("shutdown() re-entered from the thread that is running it (e.g. a signal "
                                    "handler); it returns the report once the running shutdown ends")
        while self.report is None:
            self.done.wait()
        return self.report

    def _run_shutdown(self) -> ShutdownReport:
        backend = self.backend
        started = backend.monotonic()
        deadline = started + self.policy.timeout
        run = _ShutdownRun()
        try:
            self._drain_both(deadline, run)
            self._prove(deadline, run)
        except BaseException as exc:  # R14: an interrupt outside a drain (e.g. reading the clock)
            run.interrupt = run.interrupt or exc
        with _sigint_deferred() as deferred:  # R14: a real Ctrl-C waits until everything is finished
            self._finish(run, backend.monotonic() - started)
        interrupt = run.interrupt or deferred.interrupt
        if interrupt is not None:
            raise interrupt
        assert self.report is not None  # Invariant: _finish stored it
        return self.report

    def _finish(self, run: _ShutdownRun, elapsed: float) -> None:
        """Release or quarantine everything, store the report and close, whatever is raised meanwhile (R14)."""
        failed, interrupt = finish_all([("release the worker's resources", lambda: self._release(run))])
        run.errors.extend(failed)
        run.interrupt = run.interrupt or interrupt
        with self.lock:
            self.report = run.report(self, elapsed)
            self.transition(WorkerInput.INTERRUPTED if run.interrupt else WorkerInput.SHUTDOWN_COMPLETE)
            self.done.notify_all()

    def _drain_both(self, deadline: float, run: _ShutdownRun) -> None:
        """R9: store first, then load, whatever either raises; a BaseException stops all waiting (R14)."""
        for name, handler in (("store", self.store), ("load", self.load)):
            try:
                handler.drain(deadline, interrupted=run.interrupt is not None)
            except BaseException as exc:  # the handler abandoned what it could not prove; teardown goes on (R9)
                if not isinstance(exc, Exception):
                    run.interrupt = run.interrupt or exc
            run.clean &= handler.clean
            error = handler.report().error
            if error is not None and error is not run.interrupt:
                logger.error("Failed to shut down %s offloading handler", name, exc_info=error)
                run.errors.append(f"{name}: {error!r}")

    def _prove(self, deadline: float, run: _ShutdownRun) -> None:
        """R13: the device-level proof, only off the clean path; skipped after an interrupt (R14)."""
        decision = lifecycle.decide_proof(run.clean, run.interrupt is not None)
        if decision is not ProofDecision.ATTEMPT:
            run.proof = ProofOutcome(decision.value)
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

    def _release(self, run: _ShutdownRun) -> None:
        """R10/R12/R3: release or quarantine, both handlers then the region, every step whatever an earlier one
        raised (R9, R14). Never waits."""
        fate = lifecycle.decide_fate(run.proof, self.policy.policy)
        reason = f"device not proven idle (device_sync={run.proof.value})"
        for name, handler in (("store", self.store), ("load", self.load)):
            kept, failed, interrupt = handler.release(fate)
            run.errors.extend(f"{name} release: {f}" for f in failed)
            run.interrupt = run.interrupt or interrupt
            for buf in kept:
                quarantine(QuarantinedItem("descriptor", repr(buf), reason, buf))
            run.add("quarantined", "descriptor", len(kept))
        self._finish_region(fate, reason, run)

    def _finish_region(self, fate: Fate, reason: str, run: _ShutdownRun) -> None:
        region = self.region
        if fate is Fate.RELEASE:
            run.errors.extend(f"region: {f}" for f in region.release_by_owner())
            kept = region.leaked
        else:
            run.errors.extend(f"region: {f}" for f in region.quarantine_by_owner(reason))
            kept = region.quarantined_resources
        for kind, count in kept.items():
            run.add("leaked" if fate is Fate.RELEASE else "quarantined", kind, count)


class _Deferred:
    """What ``_sigint_deferred`` held back."""

    def __init__(self) -> None:
        # Invariant: the KeyboardInterrupt that SIGINT would have raised meanwhile, or None.
        self.interrupt: BaseException | None = None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[_Deferred]:
    """R14: hold back SIGINT (Ctrl-C) while the release runs, then deliver it to the previous handler.

    Only the main thread receives signals in Python, and only it may change their handlers; elsewhere (and when
    the application installed no Python-level SIGINT handler) this does nothing.
    """
    deferred = _Deferred()
    received: list[int] = []
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, TypeError):
            previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield deferred
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if received and callable(previous):
        try:
            previous(signal.SIGINT, None)
        except BaseException as exc:  # the default handler raises KeyboardInterrupt: the caller re-raises it
            deferred.interrupt = exc


class _ShutdownRun:
    """Scratch state of one shutdown sequence, turned into the report at the end."""

    def __init__(self) -> None:
        self.clean = True
        self.proof = ProofOutcome.NOT_NEEDED
        self.interrupt: BaseException | None = None
        self.errors: list[str] = []
        self.counts: dict[str, dict[str, int]] = {"quarantined": {}, "leaked": {}}

    def add(self, table: str, kind: ResourceKind, count: int) -> None:
        if count:
            self.counts[table][kind] = self.counts[table].get(kind, 0) + count

    def report(self, core: _WorkerCore, elapsed: float) -> ShutdownReport:
        return ShutdownReport(
            store=core.store.report(), load=core.load.report(),
            device_sync=self.proof.value,
            region=_REGION_FATE.get(core.region.state, "absent"),
            quarantined=dict(self.counts["quarantined"]), leaked=dict(self.counts["leaked"]),
            errors=tuple(self.errors), elapsed=elapsed, interrupted=self.interrupt is not None,
        )


_REGION_FATE: Final[dict[RegionState | None, RegionFate]] = {
    RegionState.RELEASED: "released", RegionState.QUARANTINED: "quarantined"}


# Invariant: True while the cyclic garbage collector runs (set by _track_gc), in whichever thread runs it.
_GC_RUNNING = False


def _track_gc(phase: str, info: dict[str, int]) -> None:
    global _GC_RUNNING  # noqa: PLW0603  # one flag for the process: the collector is process-wide
    _GC_RUNNING = phase == "start"


gc.callbacks.append(_track_gc)


def _finalize(core: _WorkerCore) -> None:
    """R15: shut down a worker that was dropped (or alive at exit) without shutdown().

    The garbage collector may run this at any allocation, also while this thread holds a library lock (the ledger's,
    say). So when called from the collector, the shutdown runs in a thread of its own and this thread waits for it
    at most the policy's timeout plus a second: normally it has finished by then (the outcome is as deterministic as
    an inline shutdown); if this thread held a lock the shutdown needs, the wait ends and the shutdown completes as
    soon as the lock is released, instead of deadlocking. The worker's own lock cannot be held here: a thread
    holding it is inside one of the worker's methods, so the worker is alive (R19).
    """
    if core.state is not WorkerState.OPEN:
        return
    if not _GC_RUNNING:
        _finalize_now(core)
        return
    thread = threading.Thread(target=_finalize_now, args=(core,), name="kvoffload_ref-finalizer")
    thread.start()
    thread.join(core.policy.timeout + 1.0)


def _finalize_now(core: _WorkerCore) -> None:
    logger.warning("CPUOffloadingWorker was not shut down; shutting it down from its finalizer")
    try:
        core.shutdown()
    except Exception:
        logger.error("Shutdown from the finalizer failed", exc_info=True)


class CPUOffloadingWorker:
    """Offloads KV-cache pages between GPU tensors and a pinned host region, and shuts down safely.

    Every method may be called from any thread, concurrently with every other (R19). Use :func:`create_worker`
    unless you built the region yourself.
    """

    def __init__(self, backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                 blocks_per_chunk: int, region: HostRegion, policy: ShutdownPolicy | None = None,
                 pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES, require_pinned: bool = False,
                 prewarm: int = 1, compute_stream: object | None = None) -> None:
        """Build a worker over a caller-owned region; on success the worker owns it (R1).

        Args:
            backend: the device.
            gpu_tensors: one device array per layout tensor, (num_gpu_blocks, tensor_page_bytes) bytes per block.
            layout: the KV-cache layout.
            blocks_per_chunk: GPU blocks per CPU chunk.
            region: a caller-owned HostRegion built for this layout and blocks_per_chunk on this backend.
            policy: shutdown timeout and what to do with unproven memory.
            pin_chunk_bytes: the most bytes registered per host-register call.
            require_pinned: if True a failed registration fails construction; else it runs unpinned (warning).
            prewarm: transfers' worth of events (three each) each handler creates up front.
            compute_stream: the stream the model computes on; every transfer waits for the work queued on it
                when the transfer is submitted (R4), and the device-level proof covers it (R13). None: the
                backend's current stream in the constructing thread, captured once (see ``Backend.compute_stream``
                for what each backend accepts).

        Raises:
            InvalidTransferError: tensors, region, compute stream or parameters do not fit (R7).
            OwnershipError: the region is not caller-owned.
            DeviceError: a device call failed (everything acquired is released in reverse order, R2).
        """
        gpu = [backend.array_info(t) for t in gpu_tensors]
        check_geometry(layout, gpu, region.geometries(), blocks_per_chunk)
        if region.state is not RegionState.CALLER_OWNED:
            lifecycle.step(lifecycle.REGION_TABLE, "region", region.state, lifecycle.RegionInput.ADOPT)
        compute = backend.current_stream() if compute_stream is None else backend.compute_stream(compute_stream)
        logger.info("Allocating %d CPU tensors...", layout.num_tensors)
        with contextlib.ExitStack() as guards:
            self._pin(region, pin_chunk_bytes, require_pinned, guards)
            handlers = []
            for direction in DIRECTIONS:
                handler = DirectionHandler(backend, direction, layout, gpu, region.geometries(),
                                           blocks_per_chunk, compute_stream=compute, prewarm=prewarm)
                guards.callback(handler.discard)
                handlers.append(handler)
            region.adopt()
            guards.pop_all()
        policy = policy or ShutdownPolicy()
        self._core = _WorkerCore(backend, region, handlers[0], handlers[1], policy, compute)
        self._finalizer = weakref.finalize(self, _finalize, self._core)

    @staticmethod
    def _pin(region: HostRegion, chunk_bytes: int, require_pinned: bool, guards: contextlib.ExitStack) -> None:
        if region.pinned:
            return
        try:
            region.pin(chunk_bytes)
        except DeviceError as exc:
            if require_pinned:
                raise
            logger.warning("Failed to pin the CPU region (status %d); transfers run from pageable memory",
                           exc.status)
            return
        guards.callback(region.unpin)

    # -- transfers --------------------------------------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> bool:
        """Queue a GPU -> CPU copy. See :meth:`submit_load` for the rules.

        Returns:
            True (the transfer is queued).

        Raises:
            InvalidTransferError: bad input (R7; nothing changed). WorkerClosedError: shutdown began (R8).
            DeviceError: a device call failed; nothing was queued.
        """
        return self._submit(self._core.store, job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Queue a CPU -> GPU copy. It waits for this direction's previous transfer and for the compute work
        queued so far (R4); it is not ordered against stores. A submission racing ``shutdown()`` in another
        thread is either queued completely before the shutdown begins (and drained) or refused (R19).

        Returns:
            True (the transfer is queued).

        Raises:
            InvalidTransferError: bad input (R7; nothing changed). WorkerClosedError: shutdown began (R8).
            DeviceError: a device call failed; nothing was queued.
        """
        return self._submit(self._core.load, job_id, src_spec, dst_spec)

    def _submit(self, handler: DirectionHandler, job_id: int, src: object, dst: object) -> bool:
        core = self._core
        with core.lock:
            core.transition(WorkerInput.SUBMIT)
            job = check_job_id(job_id)
            if core.store.knows(job) or core.load.knows(job):
                raise InvalidTransferError(f"job_id {job} is already in flight; reuse an id only after "
                                           "get_finished() reported it")
            handler.submit(job, src, dst)  # type: ignore[arg-type]  # the planner checks the types (R7)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Results of transfers whose completion became known, each exactly once, also across threads; store
        results first (R5, R19).

        Never blocks. Returns [] once shutdown began.
        """
        core = self._core
        with core.lock:
            if core.transition(WorkerInput.GET_FINISHED) is Action.RETURN_EMPTY:
                return []
            return [*core.store.get_finished(), *core.load.get_finished()]

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until each listed job is proven complete or has failed (R6). Reports nothing.

        The worker's lock is held only while polling, never while sleeping (R19); once another thread begins
        shutdown, the wait returns at its next poll.

        Args:
            job_ids: ids to wait for (an iterable of ints); unknown or already reported ids are ignored.
            timeout: seconds on the backend clock (a number >= 0); None waits without bound.

        Raises:
            InvalidTransferError: job_ids is not an iterable of ints, or timeout is not None or a number >= 0
                (R7).
            DeadlineExceeded: the timeout passed first.
        """
        core = self._core
        ids = check_job_ids(job_ids)
        limit = check_timeout(timeout)
        started = core.backend.monotonic()
        deadline = None if limit is None else started + limit
        with core.lock:
            if core.transition(WorkerInput.WAIT) is Action.RETURN_EMPTY:
                return
            marks = [(h, h.last_of(ids)) for h in (core.store, core.load)]
        for handler, mark in marks:
            if mark is not None:
                _poll(core, functools.partial(handler.settle, mark), started, deadline,
                      f"{handler.direction} job {mark.job_id}")

    def cpu_snapshot(self) -> list[npt.NDArray[np.uint8]]:
        """Copies of the CPU region, one 2-D uint8 array per tensor, shape (num_cpu_chunks, cpu row bytes).

        Raises:
            WorkerClosedError: shutdown began.
        """
        core = self._core
        with core.lock:
            core.transition(WorkerInput.SNAPSHOT)
            return core.region.snapshot()

    def stats(self) -> WorkerStats:
        """A frozen snapshot of the worker; works before and after shutdown."""
        core = self._core
        with core.lock:
            return WorkerStats(
                state=core.state.value, store=core.store.stats(), load=core.load.stats(),
                region=core.region.state.value, pinned=core.region.pinned,
                ledger_live=core.backend.ledger.live(),
            )

    # -- shutdown ---------------------------------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        """Shut down within the policy's timeout (R9-R14); idempotent (R8), and safe from any thread (R19).

        Returns:
            The report. A later call returns the first call's report; a call while another thread's shutdown
            runs waits for it and returns its report.

        Raises:
            BaseException: one that interrupted the shutdown is re-raised after everything that could be released
                was released and the rest quarantined (R14); a later call returns that report, marked interrupted.
            WorkerClosedError: called again from the thread already running the shutdown (a signal handler).
        """
        try:
            return self._core.shutdown()
        finally:
            if self._core.state is WorkerState.CLOSED:
                self._finalizer.detach()  # nothing left to finalize; the core may now die with the worker

    def __enter__(self) -> CPUOffloadingWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        core = self._core
        return f"<CPUOffloadingWorker {core.state.value} on {core.backend.name}, region {core.region.state.value}>"


def _poll(core: _WorkerCore, settle: Callable[[], bool], started: float, deadline: float | None,
          what: str) -> None:
    """Poll ``settle()`` under the worker's lock until it returns True, sleeping without the lock (R19).

    Returns at once (reporting nothing) when shutdown began meanwhile. Polls at least once.

    Raises:
        DeadlineExceeded: the deadline passed first (R6).
        SimHang: no deadline, and the backend models hung work (``hang_horizon``) that outlived its horizon.
    """
    backend = core.backend
    horizon = getattr(backend, "hang_horizon", None) if deadline is None else None
    pause = POLL_FIRST_SLEEP
    while True:
        with core.lock:
            if core.transition(WorkerInput.WAIT) is Action.RETURN_EMPTY or settle():
                return
        now = backend.monotonic()
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(f"{what} not proven complete by the deadline")
        if horizon is not None and now - started >= horizon:
            raise SimHang(f"wait() without a timeout: {what} did not complete within {horizon} s")
        backend.sleep(pause if deadline is None else max(min(pause, deadline - now), 0.0))
        pause = min(pause * 2, POLL_MAX_SLEEP)


def create_worker(backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                  blocks_per_chunk: int, num_cpu_chunks: int, policy: ShutdownPolicy | None = None,
                  region: HostRegion | None = None, pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
                  require_pinned: bool = False, prewarm: int = 1,
                  compute_stream: object | None = None) -> CPUOffloadingWorker:
    """Build the region (unless given) and the worker (R1, R2).

    If construction fails, a region built here is released and the original exception propagates; a region
    passed in stays the caller's.

    Args:
        backend, gpu_tensors, layout, blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, prewarm,
            compute_stream: as for :class:`CPUOffloadingWorker`.
        num_cpu_chunks: CPU rows per tensor when building the region.
        region: an existing caller-owned region to hand over instead of building one.

    Returns:
        The worker, owning its region.

    Raises:
        InvalidTransferError, OwnershipError, DeviceError: as for :class:`CPUOffloadingWorker`.
    """
    if region is not None:
        return CPUOffloadingWorker(backend, gpu_tensors, layout, blocks_per_chunk=blocks_per_chunk, region=region,
                                   policy=policy, pin_chunk_bytes=pin_chunk_bytes, require_pinned=require_pinned,
                                   prewarm=prewarm, compute_stream=compute_stream)
    built = HostRegion.allocate(backend, layout, blocks_per_chunk, num_cpu_chunks)
    try:
        return CPUOffloadingWorker(backend, gpu_tensors, layout, blocks_per_chunk=blocks_per_chunk, region=built,
                                   policy=policy, pin_chunk_bytes=pin_chunk_bytes, require_pinned=require_pinned,
                                   prewarm=prewarm, compute_stream=compute_stream)
    except BaseException:
        built.release()
        raise
