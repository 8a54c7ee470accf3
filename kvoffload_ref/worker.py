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
import gc
import logging
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref import lifecycle
from kvoffload_ref.backends.base import Backend, ResourceKind, Stream
from kvoffload_ref.errors import DeviceError, InvalidTransferError
from kvoffload_ref.handler import DirectionHandler, DrainOutcome, HandlerStats, TransferResult
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


@dataclasses.dataclass(frozen=True)
class HandlerReport:
    """One handler's part of the shutdown report.

    Attributes:
        drained: transfers proven complete during shutdown.
        abandoned: transfers whose completion is unknown (the drain stopped early).
        error: the first failure of its drain, or None.
    """

    drained: int
    abandoned: int
    error: BaseException | None


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """What shutdown did. See ARCHITECTURE.md for the meaning of each field."""

    store: HandlerReport
    load: HandlerReport
    device_sync: str  # "not_needed" | "ok" | "timeout" | "failed" | "skipped"
    region: str  # "released" | "quarantined" | "absent"
    quarantined: Mapping[str, int]
    leaked: Mapping[str, int]
    errors: tuple[str, ...]
    elapsed: float
    interrupted: bool


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A frozen snapshot of a worker (R-free: for tests, invariants and dashboards)."""

    state: str
    store: HandlerStats
    load: HandlerStats
    region: str
    pinned: bool
    ledger_live: Mapping[ResourceKind, int]


def _to_handler_report(outcome: DrainOutcome | None) -> HandlerReport:
    if outcome is None:
        return HandlerReport(0, 0, None)
    return HandlerReport(outcome.drained, outcome.abandoned, outcome.error)


class _WorkerCore:
    """Everything a worker holds. The finalizer references this, never the worker (R15)."""

    def __init__(self, backend: Backend, region: HostRegion, store: DirectionHandler,
                 load: DirectionHandler, policy: ShutdownPolicy) -> None:
        self.backend = backend
        # Invariant: owned by this worker (WORKER_OWNED) from construction until shutdown releases/quarantines it.
        self.region = region
        self.store = store
        self.load = load
        self.policy = policy
        # Invariant: changed only through lifecycle.step(WORKER_TABLE, ...), under _lock.
        self.state = WorkerState.OPEN
        # Invariant: set exactly once, when the shutdown sequence ends (normally or interrupted).
        self.report: ShutdownReport | None = None
        self._lock = threading.RLock()

    def transition(self, event: WorkerInput) -> Action:
        with self._lock:
            self.state, action = lifecycle.step(lifecycle.WORKER_TABLE, "worker", self.state, event)
            return action

    # -- the shutdown sequence ------------------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        action = self.transition(WorkerInput.SHUTDOWN)
        if action is Action.RETURN_REPORT:
            assert self.report is not None  # Invariant: CLOSED implies a report
            return self.report
        return self._run_shutdown()

    def _run_shutdown(self) -> ShutdownReport:
        backend = self.backend
        started = backend.monotonic()
        deadline = started + self.policy.timeout
        run = _ShutdownRun()
        try:
            self._drain_both(deadline, run)
            self._prove(deadline, run)
        finally:
            try:
                self._release(run)
            finally:
                self.report = run.report(backend.monotonic() - started)
                self.transition(WorkerInput.INTERRUPTED if run.interrupt else WorkerInput.SHUTDOWN_COMPLETE)
        if run.interrupt is not None:
            raise run.interrupt
        return self.report

    def _drain_both(self, deadline: float, run: _ShutdownRun) -> None:
        """R9: store first, then load, whatever either raises; a BaseException stops all waiting (R14)."""
        for name, handler in (("store", self.store), ("load", self.load)):
            try:
                outcome = handler.drain(deadline, interrupted=run.interrupt is not None)
            except BaseException as exc:  # the handler abandoned what it could not prove; teardown goes on (R9)
                if not isinstance(exc, Exception):
                    run.interrupt = run.interrupt or exc
                outcome = DrainOutcome(0, handler.stats().abandoned, exc, False)
            run.outcomes[name] = outcome
            run.clean &= outcome.clean
            if outcome.error is not None and outcome.error is not run.interrupt:
                logger.error("Failed to shut down %s offloading handler", name, exc_info=outcome.error)
                run.errors.append(f"{name}: {outcome.error!r}")

    def _prove(self, deadline: float, run: _ShutdownRun) -> None:
        """R13: the device-level proof, only off the clean path; skipped after an interrupt (R14)."""
        decision = lifecycle.decide_proof(run.clean, run.interrupt is not None)
        if decision is not ProofDecision.ATTEMPT:
            run.proof = ProofOutcome(decision.value)
            return
        streams: list[Stream] = [self.backend.current_stream(), *self.store.streams_in_use(),
                                 *self.load.streams_in_use()]
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
        """R10/R12/R3: release or quarantine. Runs even when interrupted; never waits."""
        fate = lifecycle.decide_fate(run.proof, self.policy.policy)
        reason = f"device not proven idle (device_sync={run.proof.value})"
        for name, handler in (("store", self.store), ("load", self.load)):
            try:
                kept = handler.release(fate).quarantined
            except Exception as exc:  # pragma: no cover - a bug; teardown still goes on (R9)
                logger.error("Failed to release %s offloading handler", name, exc_info=True)
                run.errors.append(f"{name} release: {exc!r}")
                continue
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
        run.region = region.state


class _ShutdownRun:
    """Scratch state of one shutdown sequence, turned into the report at the end."""

    def __init__(self) -> None:
        self.outcomes: dict[str, DrainOutcome] = {}
        self.clean = True
        self.proof = ProofOutcome.NOT_NEEDED
        self.interrupt: BaseException | None = None
        self.errors: list[str] = []
        self.counts: dict[str, dict[str, int]] = {"quarantined": {}, "leaked": {}}
        self.region: RegionState | None = None

    def add(self, table: str, kind: ResourceKind, count: int) -> None:
        if count:
            self.counts[table][kind] = self.counts[table].get(kind, 0) + count

    def report(self, elapsed: float) -> ShutdownReport:
        region = {RegionState.RELEASED: "released", RegionState.QUARANTINED: "quarantined"}.get(
            self.region, "absent") if self.region is not None else "absent"
        return ShutdownReport(
            store=_to_handler_report(self.outcomes.get("store")),
            load=_to_handler_report(self.outcomes.get("load")),
            device_sync=self.proof.value, region=region,
            quarantined=dict(self.counts["quarantined"]), leaked=dict(self.counts["leaked"]),
            errors=tuple(self.errors), elapsed=elapsed, interrupted=self.interrupt is not None,
        )


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
    soon as the lock is released, instead of deadlocking.
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

    Use :func:`create_worker` unless you built the region yourself.
    """

    def __init__(self, backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                 blocks_per_chunk: int, region: HostRegion, policy: ShutdownPolicy | None = None,
                 pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES, require_pinned: bool = False,
                 prewarm: int = 1) -> None:
        """Build a worker over a caller-owned region; on success the worker owns it (R1).

        Args:
            backend: the device.
            gpu_tensors: one 2-D uint8 device array per layout tensor, shape (num_gpu_blocks, tensor_page_bytes).
            layout: the KV-cache layout.
            blocks_per_chunk: GPU blocks per CPU chunk.
            region: a caller-owned HostRegion built for this layout and blocks_per_chunk.
            policy: shutdown timeout and what to do with unproven memory.
            pin_chunk_bytes: the most bytes registered per host-register call.
            require_pinned: if True a failed registration fails construction; else it runs unpinned (warning).
            prewarm: streams (with three events each) each handler creates up front.

        Raises:
            InvalidTransferError: tensors, region or parameters do not fit the layout.
            OwnershipError: the region is not caller-owned.
            DeviceError: a device call failed (everything acquired is released in reverse order, R2).
        """
        gpu = [backend.array_info(t) for t in gpu_tensors]
        check_geometry(layout, gpu, region.geometries(), blocks_per_chunk)
        if region.state is not RegionState.CALLER_OWNED:
            lifecycle.step(lifecycle.REGION_TABLE, "region", region.state, lifecycle.RegionInput.ADOPT)
        logger.info("Allocating %d CPU tensors...", layout.num_tensors)
        with contextlib.ExitStack() as guards:
            self._pin(region, pin_chunk_bytes, require_pinned, guards)
            handlers = []
            for direction in DIRECTIONS:
                handler = DirectionHandler(backend, direction, layout, gpu, region.geometries(),
                                           blocks_per_chunk, prewarm=prewarm)
                guards.callback(handler.discard)
                handlers.append(handler)
            region.adopt()
            guards.pop_all()
        self._core = _WorkerCore(backend, region, handlers[0], handlers[1], policy or ShutdownPolicy())
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
        queued so far (R4); it is not ordered against stores.

        Returns:
            True (the transfer is queued).

        Raises:
            InvalidTransferError: bad input (R7; nothing changed). WorkerClosedError: shutdown began (R8).
            DeviceError: a device call failed; nothing was queued.
        """
        return self._submit(self._core.load, job_id, src_spec, dst_spec)

    def _submit(self, handler: DirectionHandler, job_id: int, src: object, dst: object) -> bool:
        core = self._core
        core.transition(WorkerInput.SUBMIT)
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
            raise InvalidTransferError(f"job_id must be an int, got {type(job_id).__name__}")
        if core.store.knows(int(job_id)) or core.load.knows(int(job_id)):
            raise InvalidTransferError(f"job_id {int(job_id)} is already in flight")
        handler.submit(int(job_id), src, dst)  # type: ignore[arg-type]  # the planner checks the types (R7)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Results of transfers whose completion became known, each exactly once; store results first (R5).

        Never blocks. Returns [] once shutdown began.
        """
        if self._core.transition(WorkerInput.GET_FINISHED) is Action.RETURN_EMPTY:
            return []
        return [*self._core.store.get_finished(), *self._core.load.get_finished()]

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until each listed job is proven complete or has failed (R6). Reports nothing.

        Args:
            job_ids: ids to wait for; unknown or already reported ids are ignored.
            timeout: seconds on the backend clock; None waits without bound.

        Raises:
            DeadlineExceeded: the timeout passed first.
        """
        core = self._core
        if core.transition(WorkerInput.WAIT) is Action.RETURN_EMPTY:
            return
        ids = set(job_ids)
        deadline = None if timeout is None else core.backend.monotonic() + timeout
        core.store.wait(ids, deadline)
        core.load.wait(ids, deadline)

    def cpu_snapshot(self) -> list[npt.NDArray[np.uint8]]:
        """Copies of the CPU region, one 2-D uint8 array per tensor, shape (num_cpu_chunks, cpu row bytes).

        Raises:
            WorkerClosedError: shutdown began.
        """
        self._core.transition(WorkerInput.SNAPSHOT)
        return self._core.region.snapshot()

    def stats(self) -> WorkerStats:
        """A frozen snapshot of the worker; works before and after shutdown."""
        core = self._core
        return WorkerStats(
            state=core.state.value, store=core.store.stats(), load=core.load.stats(),
            region=core.region.state.value, pinned=core.region.pinned,
            ledger_live=core.backend.ledger.live(),
        )

    # -- shutdown ---------------------------------------------------------------------------------------------------
    def shutdown(self) -> ShutdownReport:
        """Shut down within the policy's timeout (R9-R14); idempotent (R8).

        Returns:
            The report. A second call returns the first call's report.

        Raises:
            BaseException: one that interrupted the shutdown is re-raised after everything that could be released
                was released and the rest quarantined (R14); a later call returns that report, marked interrupted.
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


def create_worker(backend: Backend, gpu_tensors: Sequence[object], layout: KVCacheLayout, *,
                  blocks_per_chunk: int, num_cpu_chunks: int, policy: ShutdownPolicy | None = None,
                  region: HostRegion | None = None, pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
                  require_pinned: bool = False, prewarm: int = 1) -> CPUOffloadingWorker:
    """Build the region (unless given) and the worker (R1, R2).

    If construction fails, a region built here is released and the original exception propagates; a region
    passed in stays the caller's.

    Args:
        backend, gpu_tensors, layout, blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, prewarm: as for
            :class:`CPUOffloadingWorker`.
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
                                   prewarm=prewarm)
    built = HostRegion.allocate(backend, layout, blocks_per_chunk, num_cpu_chunks)
    try:
        return CPUOffloadingWorker(backend, gpu_tensors, layout, blocks_per_chunk=blocks_per_chunk, region=built,
                                   policy=policy, pin_chunk_bytes=pin_chunk_bytes, require_pinned=require_pinned,
                                   prewarm=prewarm)
    except BaseException:
        built.release()
        raise
