"""CPUOffloadingWorker: owns the host region and both direction handlers, and shuts them down safely.

Theory of operation
-------------------
The worker is a thin facade over :class:`~kvoffload_ref.core.WorkerCore`, which holds everything (region,
handlers, backend, policy, report), serialises the calls of several threads (R19) and runs the shutdown sequence
(R8-R14). A ``weakref.finalize`` over the core -- never over the worker -- shuts it down if the worker is dropped
or still alive at interpreter exit (R15).

Construction (R1, R2) acquires with guards whose unwinding *is* the cleanup order: pin the region, build the
store handler, build the load handler, then adopt the region. Any failure unwinds exactly what was acquired, in
reverse, leaves the caller's region the caller's, and re-raises the original exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload_ref import lifecycle
from kvoffload_ref.backends.base import POLL_FIRST_SLEEP, POLL_MAX_SLEEP, Backend, ResourceKind
from kvoffload_ref.core import WorkerCore, finalize
from kvoffload_ref.errors import DeadlineExceeded, DeviceError, InvalidTransferError
from kvoffload_ref.handler import DirectionHandler
from kvoffload_ref.lifecycle import Action, RegionState, WorkerInput, WorkerState
from kvoffload_ref.region import DEFAULT_PIN_CHUNK_BYTES, HostRegion
from kvoffload_ref.results import (
    DEFAULT_TIMEOUT,
    HandlerReport,
    HandlerStats,
    ShutdownPolicy,
    ShutdownReport,
    TransferResult,
)
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout, check_geometry
from kvoffload_ref.validate import check_int, check_job_ids, check_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "CPUOffloadingWorker",
    "HandlerReport",
    "ShutdownPolicy",
    "ShutdownReport",
    "WorkerStats",
    "create_worker",
]

logger = logging.getLogger("kvoffload_ref.worker")

DIRECTIONS: Final[tuple[Direction, Direction]] = ("store", "load")


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """A frozen snapshot of a worker (for tests, invariants and dashboards)."""

    state: str
    store: HandlerStats
    load: HandlerStats
    region: str
    pinned: bool
    ledger_live: Mapping[ResourceKind, int]



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
        blocks_per_chunk, pin_chunk_bytes, prewarm = _check_options(blocks_per_chunk, policy, pin_chunk_bytes,
                                                                    require_pinned, prewarm)
        region.check_backend(backend)
        gpu = [backend.array_info(t) for t in gpu_tensors]
        check_geometry(layout, gpu, region.geometries(), blocks_per_chunk)
        if region.state is not RegionState.CALLER_OWNED:
            lifecycle.step(lifecycle.REGION_TABLE, "region", region.state, lifecycle.RegionInput.ADOPT)
        compute = backend.compute_stream(compute_stream)
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
        self._core = WorkerCore(backend, region, handlers[0], handlers[1], policy, compute)
        self._finalizer = weakref.finalize(self, finalize, self._core)

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
        with core.call:
            core.transition(WorkerInput.SUBMIT)
            job = check_int("job_id", job_id)
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
        with core.call:
            if core.transition(WorkerInput.GET_FINISHED) is Action.RETURN_EMPTY:
                return []
            core.store.reap()  # backend calls: an interrupt here leaves every result where it waits (R14)
            core.load.reap()
            return [*core.store.take_results(), *core.load.take_results()]  # no backend call: one step

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
        core.owner.check("this worker")
        ids = check_job_ids(job_ids)
        limit = check_timeout(timeout)
        started = core.backend.monotonic()
        deadline = None if limit is None else started + limit
        with core.call:
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
        with core.call:
            core.transition(WorkerInput.SNAPSHOT)
            return core.region.snapshot()

    def stats(self) -> WorkerStats:
        """A frozen snapshot of the worker; works before and after shutdown."""
        core = self._core
        with core.call:
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
            ShutdownDeferred: called on a thread that is inside a call of this worker -- a signal handler that
                interrupted it, or the running shutdown itself: the request is recorded and the worker shuts down
                as the interrupted call returns; a later call returns the report (R19).
            WorkerClosedError: called in a forked child (R21).
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


def _poll(core: WorkerCore, settle: Callable[[], bool], started: float, deadline: float | None,
          what: str) -> None:
    """Poll ``settle()`` under the worker's lock until it returns True, sleeping without the lock (R19).

    Returns at once (reporting nothing) when shutdown began meanwhile. Polls at least once.

    Raises:
        DeadlineExceeded: the deadline passed first (R6).
        SimHang: no deadline, and the backend models hung work that outlived its ``hang_horizon``: raised by the
            backend's ``check_unbounded_wait`` (a real device never raises it).
    """
    backend = core.backend
    horizon = backend.hang_horizon if deadline is None else None
    # A simulated clock (one with a hang horizon) sleeps for free: back off without a cap, so that an unbounded
    # wait reaches the horizon in a few dozen polls; a real clock keeps polling at least every POLL_MAX_SLEEP.
    longest = POLL_MAX_SLEEP if horizon is None else max(POLL_MAX_SLEEP, horizon / 64)
    pause = POLL_FIRST_SLEEP
    while True:
        with core.call:
            if core.transition(WorkerInput.WAIT) is Action.RETURN_EMPTY or settle():
                return
        now = backend.monotonic()
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(f"{what} not proven complete by the deadline")
        if horizon is not None:
            backend.check_unbounded_wait(started, now, what)
        backend.sleep(pause if deadline is None else max(min(pause, deadline - now), 0.0))
        pause = min(pause * 2, longest)


def _check_options(blocks_per_chunk: object, policy: object, pin_chunk_bytes: object, require_pinned: object,
                   prewarm: object) -> tuple[int, int, int]:
    """R7: the worker's numeric and flag options, checked before anything is built.

    Returns:
        ``(blocks_per_chunk, pin_chunk_bytes, prewarm)`` as Python ints.

    Raises:
        InvalidTransferError: an option of the wrong type or out of range (a bool where an int is meant included).
    """
    checked = (check_int("blocks_per_chunk", blocks_per_chunk, minimum=1),
               check_int("pin_chunk_bytes", pin_chunk_bytes, minimum=1),
               check_int("prewarm", prewarm, minimum=0))
    if not isinstance(require_pinned, bool):
        raise InvalidTransferError(f"require_pinned must be a bool, got {type(require_pinned).__name__} "
                                   f"{require_pinned!r}")
    if policy is not None and not isinstance(policy, ShutdownPolicy):
        raise InvalidTransferError(f"policy must be a ShutdownPolicy or None, got {type(policy).__name__}")
    return checked


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
    _check_options(blocks_per_chunk, policy, pin_chunk_bytes, require_pinned, prewarm)  # before a region is mapped
    check_int("num_cpu_chunks", num_cpu_chunks, minimum=1)  # also when a region is given (then it is unused)
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
