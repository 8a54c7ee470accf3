"""What the conformance machine reads of the implementation under test: the worker it drives, the results and the
shutdown report it checks (R5, R8-R14, R22, R23), and a running engine's calls (R26-R28). Only the attributes
listed are read, so frozen dataclasses or plain objects do (docs/conformance.md); re-exported from
:mod:`~kvoffload_ref.testing.adapter`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec

__all__ = [
    "RUNNING_CALLS",
    "HandlerReportLike",
    "HeldLike",
    "JobOutcomeLike",
    "ReleasedLike",
    "ReportLike",
    "ResultLike",
    "RunningLike",
    "WorkerLike",
    "has_running_calls",
]

Bytes = npt.NDArray[np.uint8]


class ResultLike(Protocol):
    """One reported transfer result (the fields the machine reads; ``invalid_blocks`` and ``transfer_type`` only
    with ``Capabilities.attribution``, R22)."""

    @property
    def job_id(self) -> int: ...

    @property
    def success(self) -> bool: ...

    @property
    def transfer_size(self) -> int | None: ...

    @property
    def invalid_blocks(self) -> Sequence[int]:
        """R22: on failure the sorted, distinct destination ids (GPU blocks of a load, CPU chunks of a store)."""
        ...

    @property
    def transfer_type(self) -> tuple[str, str] | None:
        """R22: ("GPU", "CPU") for a store, ("CPU", "GPU") for a load."""
        ...


class JobOutcomeLike(Protocol):
    """One job of ``ReportLike.unreported``: its result and how it ended (R22, see
    ``kvoffload_ref.JobOutcome``)."""

    @property
    def result(self) -> ResultLike: ...

    @property
    def ended(self) -> str:
        """"unreaped", "drained", "failed" or "abandoned"."""
        ...


class HandlerReportLike(Protocol):
    """One direction's part of a shutdown report."""

    @property
    def drained(self) -> int: ...

    @property
    def abandoned(self) -> int: ...


class ReportLike(Protocol):
    """A shutdown report (the fields the machine reads; see ``kvoffload_ref.ShutdownReport`` for their meaning)."""

    @property
    def store(self) -> HandlerReportLike: ...

    @property
    def load(self) -> HandlerReportLike: ...

    @property
    def device_sync(self) -> str: ...

    @property
    def region(self) -> str: ...

    @property
    def quarantined(self) -> Mapping[str, int]: ...

    @property
    def leaked(self) -> Mapping[str, int]: ...

    @property
    def elapsed(self) -> float: ...

    @property
    def interrupted(self) -> bool: ...

    @property
    def unreported(self) -> Sequence[JobOutcomeLike]:
        """R22: every accepted job ``get_finished()`` never handed out, with how it ended (read only with
        ``Capabilities.attribution``)."""
        ...


class WorkerLike(Protocol):
    """The worker API the machine drives (the public API of ``kvoffload_ref.CPUOffloadingWorker``).

    A running engine's calls (R26-R28: ``cancel``, ``held``, ``take_released``, ``deadline=`` on the submissions)
    are optional: see :class:`RunningLike` and ``Capabilities.running``.
    """

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> object:
        """Queue a GPU -> CPU transfer; InvalidTransferError / WorkerClosedError / DeviceError as documented."""
        ...

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec) -> object:
        """Queue a CPU -> GPU transfer."""
        ...

    def get_finished(self) -> Sequence[ResultLike]:
        """Newly known results, each job once, per direction in submission order; never blocks."""
        ...

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until the jobs are proven or failed; DeadlineExceeded after ``timeout`` (backend clock)."""
        ...

    def order_after(self, job_ids: Iterable[int], stream: object | None = None) -> None:
        """R23: make ``stream`` (None: the worker's compute stream; on the kit's device also a stream name) wait
        on the device for the end of each listed job still queued; never blocks (only with
        ``Capabilities.ordering``)."""
        ...

    def cpu_snapshot(self) -> Sequence[Bytes]:
        """Copies of the CPU tensors, (num_cpu_chunks, tensor_page_bytes * blocks_per_chunk) each."""
        ...

    def stats(self) -> object:
        """A frozen snapshot compared with ``==`` (R7: a refused submission changes nothing)."""
        ...

    def shutdown(self) -> ReportLike:
        """Bounded, idempotent shutdown (R8-R14)."""
        ...


class HeldLike(Protocol):
    """What ``held()`` returns (R27; see ``kvoffload_ref.HeldBlocks``): sorted ids, and which are held for writes
    only (a late copy only reads them)."""

    @property
    def gpu_blocks(self) -> Sequence[int]: ...

    @property
    def cpu_chunks(self) -> Sequence[int]: ...

    @property
    def gpu_blocks_writes_only(self) -> Sequence[int]: ...

    @property
    def cpu_chunks_writes_only(self) -> Sequence[int]: ...


class ReleasedLike(Protocol):
    """One record of ``take_released()`` (R27; see ``kvoffload_ref.ReleasedHold``)."""

    @property
    def job_id(self) -> int: ...

    @property
    def direction(self) -> str: ...

    @property
    def gpu_blocks(self) -> Sequence[int]: ...

    @property
    def cpu_chunks(self) -> Sequence[int]: ...


class RunningLike(WorkerLike, Protocol):
    """A worker with a running engine's calls (R26-R28), checked when ``Capabilities.running`` is set and the
    worker has them (else the kit says once that it skips them)."""

    def cancel(self, job_ids: Iterable[int]) -> None:
        """R26: end the listed jobs now (queried first, never waits)."""
        ...

    def held(self) -> HeldLike:
        """R27: what late copies still hold."""
        ...

    def take_released(self) -> Sequence[ReleasedLike]:
        """R27: each ended hold, once."""
        ...


#: The calls a worker needs for ``Capabilities.running``.
RUNNING_CALLS: Final = ("cancel", "held", "take_released")


def has_running_calls(worker: object) -> bool:
    """Whether ``worker`` offers every call of :data:`RUNNING_CALLS`."""
    return all(callable(getattr(worker, name, None)) for name in RUNNING_CALLS)
