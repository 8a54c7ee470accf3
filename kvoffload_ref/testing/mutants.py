"""Deliberately wrong workers: to see a conformance set-up bite, in CI or from the command line.

Each is a worker factory (the signature of :data:`~kvoffload_ref.testing.adapter.WorkerFactory`) building
kvoffload_ref's own worker behind a wrapper that breaks one rule through the public API only, e.g.::

    kvoffload-ref fuzz --factory kvoffload_ref.testing.mutants:failures_reported_as_success --seconds 120

exits 1 with the violation (R5), its seed and a runnable reproduction. Two more break what an engine needs from a
transfer: :func:`poisons_source_blocks` names the wrong blocks of a failed transfer (R22) and
:func:`order_after_ignored` orders nothing on the device (R23; the race check sees the compute work it should
have ordered, R20).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing.adapter import (
    Bytes,
    HeldLike,
    JobOutcomeLike,
    ReleasedLike,
    ReportLike,
    ResultLike,
    RunningLike,
    Setup,
    WorkerLike,
    reference_factory,
)
from kvoffload_ref.validate import check_job_ids

__all__ = ["failures_reported_as_success", "interrupts_swallowed", "order_after_ignored", "poisons_source_blocks"]


@dataclasses.dataclass(frozen=True)
class _Reported:
    """A result as the wrong worker reports it."""

    job_id: int
    success: bool
    transfer_size: int | None
    invalid_blocks: tuple[int, ...] = ()
    transfer_type: tuple[str, str] | None = None
    error: BaseException | None = None


def _reported(result: ResultLike, **changes: object) -> _Reported:
    """``result`` as a :class:`_Reported`, with ``changes``."""
    fields = {"job_id": result.job_id, "success": result.success, "transfer_size": result.transfer_size,
              "invalid_blocks": tuple(result.invalid_blocks), "transfer_type": result.transfer_type,
              "error": getattr(result, "error", None)}
    return _Reported(**{**fields, **changes})  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """A report's job as the wrong worker lists it."""

    result: ResultLike
    ended: str


@dataclasses.dataclass(frozen=True)
class _Report:
    """A report whose job list the wrong worker rewrote (every other field is the real report's)."""

    inner: ReportLike
    unreported: tuple[JobOutcomeLike, ...]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _options(deadline: float | None) -> dict[str, float]:
    """The keyword arguments a submission passes on: ``deadline=`` only when given (R26)."""
    return {} if deadline is None else {"deadline": deadline}


class _Wrapper:
    """kvoffload_ref's worker behind a wrapper that passes every call through (subclasses break one rule)."""

    def __init__(self, inner: WorkerLike) -> None:
        # Invariant: the only reference to the real worker (dropping this wrapper drops it: R15 still applies).
        self._inner = inner

    def submit_store(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        return self._inner.submit_store(job_id, src, dst, **_options(deadline))  # type: ignore[arg-type]

    def submit_load(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        return self._inner.submit_load(job_id, src, dst, **_options(deadline))  # type: ignore[arg-type]

    def cancel(self, job_ids: Iterable[int]) -> None:
        self._running.cancel(job_ids)

    def held(self) -> HeldLike:
        return self._running.held()

    def take_released(self) -> Sequence[ReleasedLike]:
        return self._running.take_released()

    @property
    def _running(self) -> RunningLike:
        return self._inner  # type: ignore[return-value]  # the real worker has a running engine's calls

    def get_finished(self) -> list[ResultLike]:
        return list(self._inner.get_finished())

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._inner.wait(job_ids, timeout)

    def order_after(self, job_ids: Iterable[int], stream: object | None = None) -> None:
        self._inner.order_after(job_ids, stream)

    def cpu_snapshot(self) -> Sequence[Bytes]:
        return self._inner.cpu_snapshot()

    def stats(self) -> object:
        return self._inner.stats()

    def shutdown(self) -> ReportLike:
        return self._inner.shutdown()


class _SuccessOnly(_Wrapper):
    """kvoffload_ref's worker, except that ``get_finished`` reports every transfer as successful -- the way
    vLLM's offloading worker has no failure result at all."""

    def get_finished(self) -> list[ResultLike]:
        return [_reported(r, success=True, invalid_blocks=()) for r in self._inner.get_finished()]


class _Swallower(_Wrapper):
    """kvoffload_ref's worker, except that a submission swallows a Ctrl-C and reports it was not queued."""

    def submit_store(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        try:
            return self._inner.submit_store(job_id, src, dst, **_options(deadline))  # type: ignore[arg-type]
        except KeyboardInterrupt:
            return False


class _SourcePoisoner(_Wrapper):
    """kvoffload_ref's worker, except that a failed transfer names its *source* ids as poisoned (the CPU chunks
    a failed load read, the GPU blocks a failed store read), in its result and in the shutdown report -- so an
    engine recomputes the wrong blocks and keeps the garbage (vLLM #52838's hook fed the wrong side)."""

    def __init__(self, inner: WorkerLike) -> None:
        super().__init__(inner)
        # Invariant: job id -> the sorted, distinct ids of its source spec (the latest submission of the id).
        self._sources: dict[int, tuple[int, ...]] = {}
        self._report: _Report | None = None

    def _remember(self, job_id: int, src: object) -> None:
        ids = getattr(src, "block_ids", None)
        if ids is not None:
            self._sources[job_id] = tuple(sorted({int(i) for i in ids}))

    def submit_store(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        queued = self._inner.submit_store(job_id, src, dst, **_options(deadline))  # type: ignore[arg-type]
        self._remember(job_id, src)
        return queued

    def submit_load(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        queued = self._inner.submit_load(job_id, src, dst, **_options(deadline))  # type: ignore[arg-type]
        self._remember(job_id, src)
        return queued

    def _wrong(self, result: ResultLike) -> ResultLike:
        if result.success:
            return result
        return _reported(result, invalid_blocks=self._sources.get(result.job_id, tuple(result.invalid_blocks)))

    def get_finished(self) -> list[ResultLike]:
        return [self._wrong(r) for r in self._inner.get_finished()]

    def shutdown(self) -> ReportLike:
        report = self._inner.shutdown()
        if self._report is None or self._report.inner is not report:  # R8: the same report every time
            self._report = _Report(report, tuple(_Outcome(self._wrong(o.result), o.ended) for o in report.unreported))
        return self._report  # type: ignore[return-value]


class _Unordered(_Wrapper):
    """kvoffload_ref's worker, except that ``order_after`` does nothing: compute work the engine queues after it
    races with the transfers it meant to wait for (SGLang #20611-style)."""

    def order_after(self, job_ids: Iterable[int], stream: object | None = None) -> None:
        check_job_ids(job_ids)  # R7 as the worker checks it (only R23 is broken): the ids, then the stream,
        self._inner.order_after((), stream)  # which the worker resolves (or refuses) and orders nothing after


def failures_reported_as_success(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A worker that reports failed transfers as successful (R5 violated).

    Args:
        backend: the kit's device backend.
        gpu: the GPU tensors.
        setup: the drawn setup.

    Returns:
        The wrong worker.
    """
    return _SuccessOnly(reference_factory(backend, gpu, setup))


def interrupts_swallowed(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A worker whose ``submit_store`` swallows a KeyboardInterrupt (R14 violated: the interrupt must propagate,
    and a job whose copy the device took must still be queued). The call-point explorer finds it::

        kvoffload-ref explore --factory kvoffload_ref.testing.mutants:interrupts_swallowed --method submit_store

    Args:
        backend: the kit's device backend.
        gpu: the GPU tensors.
        setup: the setup.

    Returns:
        The wrong worker.
    """
    return _Swallower(reference_factory(backend, gpu, setup))


def poisons_source_blocks(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A worker whose failed results (and the shutdown report's failed jobs) name the transfer's source ids as
    ``invalid_blocks`` instead of its destination ids (R22 violated)::

        kvoffload-ref fuzz --factory kvoffload_ref.testing.mutants:poisons_source_blocks --steps 20000

    Args:
        backend: the kit's device backend.
        gpu: the GPU tensors.
        setup: the drawn setup.

    Returns:
        The wrong worker.
    """
    return _SourcePoisoner(reference_factory(backend, gpu, setup))


def order_after_ignored(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A worker whose ``order_after`` returns without ordering anything (R23 violated: the sim flags the compute
    work queued after it as racing the loads, R20)::

        kvoffload-ref fuzz --factory kvoffload_ref.testing.mutants:order_after_ignored --steps 20000

    Args:
        backend: the kit's device backend.
        gpu: the GPU tensors.
        setup: the drawn setup.

    Returns:
        The wrong worker.
    """
    return _Unordered(reference_factory(backend, gpu, setup))
