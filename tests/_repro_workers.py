"""Deliberately wrong workers for the reproduction tests, importable on their own (no pytest): each breaks one
check whose reproduction closes in a Python assertion (``tests/test_testing_reproduction_checks.py`` runs the
printed reproductions in a subprocess with this directory on ``PYTHONPATH``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.errors import InvalidTransferError, TransferExpired
from kvoffload_ref.results import HeldBlocks
from kvoffload_ref.testing.adapter import Bytes, Setup, WorkerLike, reference_factory
from kvoffload_ref.testing.mutants import _Wrapper


class _CorruptsBytes(_Wrapper):
    """Once a result was handed out, ``cpu_snapshot()`` reads byte [0, 0] of tensor 0 flipped."""

    reported = False

    def get_finished(self) -> list[Any]:
        results = super().get_finished()
        self.reported = self.reported or bool(results)
        return results

    def cpu_snapshot(self) -> Sequence[Bytes]:
        arrays = [np.array(a, copy=True) for a in self._inner.cpu_snapshot()]
        if self.reported and arrays and arrays[0].size:
            arrays[0][0, 0] ^= 0xFF
        return arrays


class _ForgetsHolds(_Wrapper):
    """``held()`` lists nothing, whatever late copies hold."""

    def held(self) -> Any:
        return HeldBlocks()


class _Overstays(_Wrapper):
    """``shutdown()`` first lets a second more than the timeout pass on the device."""

    def __init__(self, inner: WorkerLike, backend: Any, timeout: float) -> None:
        super().__init__(inner)
        self._backend, self._timeout = backend, timeout

    def shutdown(self) -> Any:
        self._backend.clock_advance(self._timeout + 1.0)
        return self._inner.shutdown()


class _ProvesNeedlessly(_Wrapper):
    """The report says the device-level proof ran (``device_sync="ok"``) where none was needed."""

    def shutdown(self) -> Any:
        report = self._inner.shutdown()
        return dataclasses.replace(report, device_sync="ok") if report.device_sync == "not_needed" else report


class _AcceptsInvalid(_Wrapper):
    """An invalid submission returns instead of raising InvalidTransferError."""

    def submit_store(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        try:
            return super().submit_store(job_id, src, dst, deadline=deadline)
        except InvalidTransferError:
            return None

    def submit_load(self, job_id: int, src: object, dst: object, *, deadline: float | None = None) -> object:
        try:
            return super().submit_load(job_id, src, dst, deadline=deadline)
        except InvalidTransferError:
            return None


class _OverstaysWait(_Wrapper):
    """``wait()`` with a timeout lets a second more than it pass on the device first."""

    def __init__(self, inner: WorkerLike, backend: Any) -> None:
        super().__init__(inner)
        self._backend = backend

    def wait(self, job_ids: Any, timeout: float | None = None) -> None:
        if timeout is not None:
            self._backend.clock_advance(timeout + 1.0)
        super().wait(job_ids, timeout)


class _Misuses(_Wrapper):
    """``get_finished()`` first releases host memory the device never tracked (the sim records the misuse)."""

    def __init__(self, inner: WorkerLike, backend: Any) -> None:
        super().__init__(inner)
        self._backend = backend

    def get_finished(self) -> list[Any]:
        self._backend.untrack_host(1 << 40)
        return super().get_finished()


class _MisnamesExpiries(_Wrapper):
    """A result that expired says the job expired for reason "later" (R26 knows "deadline", "cancel", "behind")."""

    def get_finished(self) -> list[Any]:
        results = super().get_finished()
        return [dataclasses.replace(r, error=TransferExpired(str(r.error), "later", r.job_id))
                if isinstance(r.error, TransferExpired) else r for r in results]


class _OvercountsDrains(_Wrapper):
    """The report's store handler claims one more drained transfer than it drained."""

    def shutdown(self) -> Any:
        report = self._inner.shutdown()
        return dataclasses.replace(report, store=dataclasses.replace(report.store, drained=report.store.drained + 1))


def corrupts_cpu_bytes(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R4/R5 (the byte compare): the CPU region reads back other bytes than the steps wrote."""
    return _CorruptsBytes(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


def forgets_holds(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R27 (``held()``): a late copy's blocks are not listed as held."""
    return _ForgetsHolds(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


def overstays_shutdown(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R11 (the bound): ``shutdown()`` runs a second past its timeout."""
    return _Overstays(reference_factory(backend, gpu, setup), backend,  # type: ignore[return-value]
                      setup.policy.timeout)


def proves_needlessly(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R13 (the proof only off the clean path): a clean shutdown's report claims the device-level proof."""
    return _ProvesNeedlessly(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


def accepts_invalid(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R7: an invalid submission is accepted (no InvalidTransferError)."""
    return _AcceptsInvalid(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


def overstays_wait(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R6/R11 (a bounded wait): ``wait(timeout=...)`` runs a second past its timeout."""
    return _OverstaysWait(reference_factory(backend, gpu, setup), backend)  # type: ignore[return-value]


def misuses_the_device(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R3 (the device's misuse log): a release of memory the device never tracked."""
    return _Misuses(reference_factory(backend, gpu, setup), backend)  # type: ignore[return-value]


def misnames_expiries(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R26 (why a job expired): an expiry's reason is none of the three."""
    return _MisnamesExpiries(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


def overcounts_drains(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """R10 (the drain's counts): the report says the store handler drained one transfer more."""
    return _OvercountsDrains(reference_factory(backend, gpu, setup))  # type: ignore[return-value]
