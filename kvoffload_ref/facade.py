"""The public face both workers share: each call's promise, and the helpers that build a worker with its region.

``ReferenceWorker`` (``reference.py``) and ``CPUOffloadingWorker`` (``worker.py``) are this facade over one
``reference.Core`` -- the worker level, whose rules ``reference.py`` states -- and differ only in the direction
handler behind it. The facade holds the core and the finalizer over it (never over the facade, R15); every method
forwards to the core and documents what it promises.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Final, Literal, Protocol, TypeVar, get_args

import numpy as np
import numpy.typing as npt

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.backends.pinned import refuses_registration
from kvoffload_ref.canonical_plan import CanonicalLayout, as_canonical
from kvoffload_ref.errors import (
    CUDA_ERROR_NOT_SUPPORTED,
    DeviceError,
    InvalidTransferError,
    RegistrationRefused,
    submission_refused,
)
from kvoffload_ref.lifecycle import WorkerState
from kvoffload_ref.region import HostRegion
from kvoffload_ref.results import HeldBlocks, ReleasedHold, ShutdownPolicy, ShutdownReport, TransferResult, WorkerStats
from kvoffload_ref.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, KVCacheLayout
from kvoffload_ref.validate import check_int, check_positive, short_repr

__all__ = ["CoreAPI", "Pinning", "WorkerFacade", "WorkerOptions", "build_with_region", "check_options"]

W = TypeVar("W")
F = TypeVar("F", bound="WorkerFacade")

logger = logging.getLogger("kvoffload_ref.worker")

#: How a worker's region is pinned (the workers' ``pinning``): ``"auto"`` registers, and where the platform refuses
#: registration (``RegistrationRefused``) a region ``create_*`` built is rebuilt as a pinned allocation;
#: ``"register"`` registers only (a refusal is then like any failed registration); ``"alloc"`` allocates pinned memory.
Pinning = Literal["auto", "register", "alloc"]
PINNINGS: Final[tuple[str, ...]] = get_args(Pinning)
#: The warning ``pinning="auto"`` logs, once per backend, when it falls back to a pinned allocation.
FALLBACK_WARNING: Final = ("Pinned memory registration (cudaHostRegister) is not supported on this platform "
                           "(status %d, e.g. under confidential computing); allocating pinned host memory "
                           "(cudaHostAlloc) for the CPU region instead")
# Invariant: the backends whose fallback was logged (a warning once per backend).
_WARNED: weakref.WeakSet[Backend] = weakref.WeakSet()


class CoreAPI(Protocol):
    """What the facade forwards to (``reference.Core``)."""

    backend: Backend
    region: HostRegion
    state: WorkerState

    def submit(self, direction: Direction, job_id: int, src: object, dst: object, deadline: object = None,
               tag: object = None) -> bool: ...
    def cancel(self, job_ids: Iterable[int]) -> None: ...
    def held(self) -> HeldBlocks: ...
    def take_released(self) -> list[ReleasedHold]: ...
    def get_finished(self) -> list[TransferResult]: ...
    def wait(self, job_ids: Iterable[int], timeout: float | None) -> None: ...
    def order_after(self, job_ids: Iterable[int], stream: object | None) -> None: ...
    def snapshot(self) -> list[npt.NDArray[np.uint8]]: ...
    def stats(self) -> WorkerStats: ...
    def shutdown(self) -> ShutdownReport: ...
    def finalize(self) -> None: ...


class WorkerFacade:
    """Offloads KV-cache pages between GPU tensors and a host region, and shuts down safely (R1-R21). Every method
    may be called from any thread, concurrently with every other (R19).

    The workers' constructors take (``create_worker``/``create_reference_worker`` also build the region):

    Args:
        backend: the device.
        gpu_tensors: one device array per layout tensor, (num_gpu_blocks, tensor_page_bytes) bytes per block.
        layout: the KV-cache layout.
        blocks_per_chunk: GPU blocks per CPU chunk.
        region: a caller-owned HostRegion built for this layout and blocks_per_chunk on this backend; on success
            the worker is its only owner (R1).
        policy: the shutdown timeout and what to do with unproven memory (R11, R12).
        pin_chunk_bytes: the most bytes registered per host-register call (with the region's
            ``max_register_bytes``: the smaller applies; seams fall on row boundaries either way, R25).
        require_pinned: if True a failed registration fails construction; else it runs unpinned (a warning) --
            except on a backend whose copies to pageable memory block the host (``pageable_copies_block``, the
            CuPy backend): there it is always required (R11).
        compute_stream: the stream the model computes on; every transfer waits for the work queued on it when the
            transfer is submitted (R4), and the device-level proof covers it (R13). None: the backend's current
            stream in the constructing thread, captured once (``Backend.compute_stream`` says what each accepts).
        canonical: canonical mode (R24, docs/canonical.md): a ``canonical_plan.CanonicalLayout`` (or a sequence
            of ``canonical.PageMapping``), this rank's mapping of each layout tensor; the region's CPU rows must
            then be ``canonical page * blocks_per_chunk`` (``create_*`` build it so). None: plain mode.
        stall_warning: None (off), or seconds: a transfer unproven that long after its start on the device is
            logged once as a warning naming the job, its direction and its age (R30).
        pinning: ``"auto"`` (default), ``"register"`` or ``"alloc"`` (:data:`Pinning`). ``"auto"``: the region is
            registered; if the platform refuses registration (``RegistrationRefused``, status 801, e.g. under
            confidential computing, vLLM #55428), a region ``create_*`` built is released and rebuilt as a pinned
            allocation (``HostRegion.allocate(..., pinning="alloc")``; a warning, once per backend; allocated at
            once where the backend says in advance that it refuses, ``refuses_registration``), while a region the
            caller built fails construction with that error (R2: it stays the caller's). Any other
            failed registration is as ``require_pinned`` says. ``"register"``: registration only; a refusal is
            as any failed registration. ``"alloc"``: ``create_*`` allocate the region pinned; a region given must
            be an allocated one.

    Raises:
        InvalidTransferError: tensors, region, compute stream or options do not fit (R7); in canonical mode also a
            mapping that does not verify or does not fit the layout or the region's rows (R24), before any device work.
        OwnershipError: the region is not caller-owned (R1).
        DeviceError: a device call failed; everything acquired is released in reverse order (R2).
        RegistrationRefused: (a DeviceError) under ``pinning="auto"``, the platform refused to register a region
            the caller built (the message says what to use instead), or a shared region (which cannot be
            allocated).
    """

    _core: CoreAPI
    _finalizer: weakref.finalize[[], WorkerFacade]

    def _attach(self, core: CoreAPI) -> None:
        self._core = core
        self._finalizer = weakref.finalize(self, core.finalize)  # R15: it references the core, never the facade

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec, *,
                     deadline: float | None = None, tag: object = None) -> bool:
        """Queue a GPU -> CPU copy; see :meth:`submit_load` for the rules."""
        try:  # as in submit_load (no frame between: every small job comes this way)
            return self._core.submit("store", job_id, src_spec, dst_spec, deadline, tag)
        except DeviceError as exc:  # R5/R14: raised only before the device took the copy: say the job was refused
            raise submission_refused(exc, "store", job_id) from exc

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec, *,
                    deadline: float | None = None, tag: object = None) -> bool:
        """Queue a CPU -> GPU copy. It runs after this direction's previous transfer and the compute work queued so
        far (R4); it is not ordered against stores. Racing ``shutdown()`` in another thread, it is either queued
        completely before the shutdown begins (and drained) or refused (R19).

        Args:
            deadline: None, or seconds of the backend clock (a finite number > 0) counted from the transfer's start
                on the device (R26): unproven past it, the job is reported failed (``TransferExpired``, reason
                "deadline"), the jobs behind it on its stream too ("behind"), and their blocks are held until their
                copies are observed done (R27, :meth:`held`, :meth:`take_released`).
            tag: any object, returned as given on the job's result and report entry (``TransferResult.tag``).

        Returns:
            True: the transfer is queued.

        Raises:
            InvalidTransferError: bad input; nothing changed (R7). BlocksHeldError: (an InvalidTransferError) it
                would touch blocks a late copy holds (R27); nothing changed. WorkerClosedError: shutdown began (R8),
                or this is a forked child (R21). DeviceError: a device call failed before the copy was queued;
                nothing was, and the message says the job was refused.
        """
        try:
            return self._core.submit("load", job_id, src_spec, dst_spec, deadline, tag)
        except DeviceError as exc:  # R5/R14: raised only before the device took the copy: say the job was refused
            raise submission_refused(exc, "load", job_id) from exc

    def cancel(self, job_ids: Iterable[int]) -> None:
        """End the listed jobs now (R26). Each is first looked at without waiting: a job already proven complete is
        reported as it is. Every other listed job still queued is reported once by ``get_finished()`` as failed
        (``TransferExpired``, reason "cancel", with its ``invalid_blocks``), the jobs queued behind it on its stream
        likewise (reason "behind"), and their blocks are held until their copies are observed done (R27). The
        direction goes on on a fresh stream (R28). Unknown or already reported ids are ignored; after shutdown began
        it does nothing. Never blocks on the device; any thread, a signal handler included (inside another call of
        this worker on the same thread it is carried out as that call returns).

        Raises:
            InvalidTransferError: job_ids is not an iterable of ints; nothing was cancelled (R7).
            WorkerClosedError: a forked child (R21).
        """
        self._core.cancel(job_ids)

    def held(self) -> HeldBlocks:
        """What late copies (expired, cancelled, behind or failed transfers whose copies may still run) hold (R27):
        a submission writing a held block, or reading a block held for any access, raises ``BlocksHeldError``."""
        return self._core.held()

    def take_released(self) -> list[ReleasedHold]:
        """The holds that ended since the last call, each handed out once (R27): their late copies were observed
        done, so their blocks may be used again (recompute a failed load's blocks before reading them)."""
        return self._core.take_released()

    def get_finished(self) -> list[TransferResult]:
        """Results of transfers whose completion became known, each exactly once, also across threads; store results
        first (R5, R19). Never blocks.

        Returns:
            The results; [] once shutdown began (the report lists what was never handed over, R8).
        """
        return self._core.get_finished()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until each listed job is proven complete or has failed (R6); reports nothing. The worker's lock is
        held only while polling, never while sleeping (R19); once another thread begins shutdown, the wait returns
        at its next poll.

        Args:
            job_ids: ids to wait for (an iterable of ints); unknown or already reported ids are ignored.
            timeout: seconds on the backend clock (a number >= 0); None waits without bound.

        Raises:
            InvalidTransferError: job_ids is not an iterable of ints, or timeout is not None or a number >= 0 (R7).
            DeadlineExceeded: the timeout passed first (R6).
        """
        self._core.wait(job_ids, timeout)

    def order_after(self, job_ids: Iterable[int], stream: object | None = None) -> None:
        """Make ``stream`` wait, on the device, for the end of each listed job still queued (R23). The host never
        blocks and no result changes. It orders; it does not prove: use a job's data only once ``get_finished()``
        reports it ``success=True`` (R5), and recompute its ``invalid_blocks`` if it failed (R22).

        Compute work enqueued on ``stream`` after this call runs after those transfers (the simulated device counts
        it as an ordering edge, R20). A job already reported, unknown, or never recordable orders nothing and is not
        an error; once shutdown began nothing is ordered.

        Args:
            job_ids: the ids (an iterable of ints).
            stream: the stream to order: None for the worker's compute stream, or any stream ``compute_stream=``
                accepts (a CuPy or torch stream, a raw handle, a sim stream or its name).

        Raises:
            InvalidTransferError: job_ids is not an iterable of ints, or the stream is not one (R7).
            DeviceError: the device failed while the wait was enqueued (e.g. it is lost); what was ordered before
                stays ordered, and the jobs' results say what became of them.
            WorkerClosedError: a forked child (R21).
        """
        self._core.order_after(job_ids, stream)

    def cpu_snapshot(self) -> list[npt.NDArray[np.uint8]]:
        """Copies of the CPU region, one 2-D uint8 array per tensor, shape (num_cpu_chunks, cpu row bytes).

        Raises:
            WorkerClosedError: shutdown began.
        """
        return self._core.snapshot()

    def stats(self) -> WorkerStats:
        """A frozen snapshot of the worker; works before and after shutdown."""
        return self._core.stats()

    def shutdown(self) -> ShutdownReport:
        """Shut down within the policy's timeout (R9-R14); idempotent (R8), and safe from any thread (R19).

        Returns:
            The report. A later call returns the first call's report; a call while another thread's shutdown runs
            waits for it and returns its report.

        Raises:
            BaseException: one that interrupted the shutdown, re-raised once everything that could be released was
                released and the rest quarantined (R14); a later call returns that report, marked interrupted.
            ShutdownDeferred: called on a thread that is inside a call of this worker (a signal handler that
                interrupted it, or the running shutdown itself): the worker shuts down as the interrupted call
                returns, and a later call returns the report (R19).
            WorkerClosedError: called in a forked child (R21).
        """
        try:
            return self._core.shutdown()
        finally:
            if self._core.state is WorkerState.CLOSED:
                self._finalizer.detach()  # nothing left to finalize; the core may now die with the worker

    def __enter__(self: F) -> F:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        core = self._core
        return (f"<{type(self).__name__} {core.state.value} on {core.backend.name}, "
                f"region {core.region.state.value}>")


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """A worker's common options, checked (:func:`check_options`); what ``reference.build_core`` is built from."""

    blocks_per_chunk: int  # Invariant: >= 1
    policy: ShutdownPolicy
    pin_chunk_bytes: int  # Invariant: >= 1
    require_pinned: bool
    compute_stream: object | None  # as the caller gave it; the backend resolves it (R7)
    canonical: CanonicalLayout | None = None  # Invariant: None (plain mode) or verified mappings (R24)
    stall_warning: float | None = None  # Invariant: None (off) or seconds > 0 (R30)
    pinning: Pinning = "auto"  # Invariant: one of PINNINGS


def check_options(blocks_per_chunk: object, policy: object, pin_chunk_bytes: object, require_pinned: object,
                  compute_stream: object | None = None, canonical: object = None, stall_warning: object = None,
                  pinning: object = "auto") -> WorkerOptions:
    """R7: a worker's common options, checked before anything is built (``canonical``: see
    :func:`~kvoffload_ref.canonical_plan.as_canonical`; how it fits the layout is checked by ``build_core``).

    Returns:
        The options, as Python ints and a policy (the default one for None).

    Raises:
        InvalidTransferError: an option of the wrong type or out of range (a bool where an int is meant included).
    """
    bpc = check_int("blocks_per_chunk", blocks_per_chunk, minimum=1)
    pin_bytes = check_int("pin_chunk_bytes", pin_chunk_bytes, minimum=1)
    if not isinstance(require_pinned, bool):
        raise InvalidTransferError(f"require_pinned must be a bool, got {type(require_pinned).__name__} "
                                   f"{require_pinned!r}")
    if policy is not None and not isinstance(policy, ShutdownPolicy):
        raise InvalidTransferError(f"policy must be a ShutdownPolicy or None (e.g. ShutdownPolicy(timeout=5.0)), got "
                                   f"{type(policy).__name__} {policy!r}")
    stall = None if stall_warning is None else check_positive("stall_warning", stall_warning, unit="seconds")
    if not isinstance(pinning, str) or pinning not in PINNINGS:
        raise InvalidTransferError(f"pinning must be one of {', '.join(map(repr, PINNINGS))}, got "
                                   f"{type(pinning).__name__} {short_repr(pinning)} (e.g. 'auto')")
    return WorkerOptions(bpc, policy or ShutdownPolicy(), pin_bytes, require_pinned, compute_stream,
                         as_canonical(canonical), stall, pinning)  # type: ignore[arg-type]  # checked: a Pinning


def build_with_region(build: Callable[[HostRegion], W], backend: Backend, layout: KVCacheLayout,
                      blocks_per_chunk: int, num_cpu_chunks: object, region: HostRegion | None,
                      canonical: CanonicalLayout | None = None, pinning: Pinning = "auto") -> W:
    """Hand ``region`` to ``build``, or build one (``num_cpu_chunks`` rows per tensor; in canonical mode rows of
    ``canonical page * blocks_per_chunk``, R24) and release it again if ``build`` fails (R1, R2); the original
    exception propagates. With ``pinning="alloc"`` the region is a pinned allocation; with ``"auto"``, too where
    the backend says in advance that it refuses registration (``backends.pinned.refuses_registration``), and when
    ``build`` fails because the platform refused to register a mapped region (``RegistrationRefused``), that region
    is released and ``build`` runs again over a pinned allocation (a warning, once per backend; what the release
    of the refused region could not release is reported with the new region's, R16).

    Raises:
        InvalidTransferError: ``num_cpu_chunks`` is not an int >= 1 (checked also when a region is given).
    """
    rows = check_int("num_cpu_chunks", num_cpu_chunks, minimum=1)
    if region is not None:
        return build(region)
    cpu_layout = layout if canonical is None else canonical.cpu_layout(layout)
    known = pinning == "auto" and refuses_registration(backend)  # the platform says so: no mapping tried first
    if known:
        _warn_fallback(backend, CUDA_ERROR_NOT_SUPPORTED)
    mode: Literal["register", "alloc"] = "alloc" if pinning == "alloc" or known else "register"
    first = HostRegion.allocate(backend, cpu_layout, blocks_per_chunk, rows, pinning=mode)
    try:
        return build(first)
    except RegistrationRefused as exc:
        first.release()
        if pinning != "auto" or first.allocated:
            raise
        _warn_fallback(backend, exc.status)
    except BaseException:
        first.release()
        raise
    region = HostRegion.allocate(backend, cpu_layout, blocks_per_chunk, rows, pinning="alloc")
    region.inherit_leaks(first.leaked)  # R16: what releasing the refused mapping left is this worker's to report
    try:
        return build(region)
    except BaseException:
        region.release()
        raise


def _warn_fallback(backend: Backend, status: int) -> None:
    """``pinning="auto"``'s warning, once per backend."""
    try:
        if backend in _WARNED:
            return
        _WARNED.add(backend)
    except TypeError:  # a backend that cannot be weakly referenced: warned each time
        pass
    logger.warning(FALLBACK_WARNING, status)
