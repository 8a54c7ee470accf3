"""Deliberately wrong workers: to see a conformance set-up bite, in CI or from the command line.

Each is a worker factory (the signature of :data:`~kvoffload_ref.testing.adapter.WorkerFactory`) building
kvoffload_ref's own worker behind a wrapper that breaks one rule through the public API only, e.g.::

    kvoffload-ref fuzz --factory kvoffload_ref.testing.mutants:failures_reported_as_success --seconds 120

exits 1 with the violation (R5), its seed and a runnable reproduction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing.adapter import Bytes, ReportLike, ResultLike, Setup, WorkerLike, reference_factory

__all__ = ["failures_reported_as_success", "interrupts_swallowed"]


@dataclasses.dataclass(frozen=True)
class _Reported:
    """A result as the wrong worker reports it."""

    job_id: int
    success: bool
    transfer_size: int | None


class _Wrapper:
    """kvoffload_ref's worker behind a wrapper that passes every call through (subclasses break one rule)."""

    def __init__(self, inner: WorkerLike) -> None:
        # Invariant: the only reference to the real worker (dropping this wrapper drops it: R15 still applies).
        self._inner = inner

    def submit_store(self, job_id: int, src: object, dst: object) -> object:
        return self._inner.submit_store(job_id, src, dst)  # type: ignore[arg-type]

    def submit_load(self, job_id: int, src: object, dst: object) -> object:
        return self._inner.submit_load(job_id, src, dst)  # type: ignore[arg-type]

    def get_finished(self) -> list[ResultLike]:
        return list(self._inner.get_finished())

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        self._inner.wait(job_ids, timeout)

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
        return [_Reported(r.job_id, True, r.transfer_size) for r in self._inner.get_finished()]


class _Swallower(_Wrapper):
    """kvoffload_ref's worker, except that a submission swallows a Ctrl-C and reports it was not queued."""

    def submit_store(self, job_id: int, src: object, dst: object) -> object:
        try:
            return self._inner.submit_store(job_id, src, dst)  # type: ignore[arg-type]
        except KeyboardInterrupt:
            return False


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
