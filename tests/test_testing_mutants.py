"""The conformance machine bites: deliberately wrong workers, each caught within the CI budget.

Each mutant is kvoffload_ref's own worker with one method replaced (on the instance, through the machine's
worker factory) by a copy carrying one known bug -- most of them bugs the upstream vLLM worker had or has. The
package is never changed. Every run is derandomized (fixed seeds), generate-only, with the CI example budget,
so each test is deterministic and cheap; the steps the machine needed are printed.
"""

from __future__ import annotations

import collections.abc
import gc
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from _support import CATCH_BUDGET, catch_budget
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend, Event
from kvoffload_ref.errors import DeviceError
from kvoffload_ref.lifecycle import HandlerState, ProofOutcome, WorkerState
from kvoffload_ref.results import ShutdownPolicy
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.testing import ConformanceError, Setup, make_machine, reference_factory
from kvoffload_ref.testing.adapter import SimDevice, WorkerLike
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.worker import CPUOffloadingWorker

#: The CI budget a mutant must be caught in (examples of up to 50 steps).
BUDGET = CATCH_BUDGET

Patch = Callable[[CPUOffloadingWorker, Setup], None]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def _factory(patch: Patch) -> Callable[[Backend, Sequence[object], Setup], WorkerLike]:
    def mutant_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
        worker = reference_factory(backend, gpu, setup)
        assert isinstance(worker, CPUOffloadingWorker)
        patch(worker, setup)
        return worker
    return mutant_factory


def _handlers(worker: CPUOffloadingWorker) -> list[Any]:
    return [worker._core.store, worker._core.load]


def _catch(patch: Patch, name: str) -> tuple[str, int]:
    """Run the machine on the mutant; return the violation's message and the steps it took."""
    machine = make_machine(_factory(patch), name=f"Mutant_{name}")
    budget = catch_budget(BUDGET)
    with pytest.raises(ConformanceError) as info:
        run_state_machine_as_test(machine, settings=budget)
    steps = machine.counters.steps
    print(f"{name}: caught after {steps} steps ({machine.counters.runs} runs): {info.value}")
    return str(info.value), steps


# -- the mutants ------------------------------------------------------------------------------------------------
def store_handler_owns_region(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """Pre-#51622: the store handler owns the shared region and releases it when it shuts down, while the load
    handler may still have copies reading it."""
    core = worker._core
    drain = core.store.drain

    def store_drain(deadline: float, *, interrupted: bool = False) -> Any:
        outcome = drain(deadline, interrupted=interrupted)
        core.region.release_by_owner()
        return outcome
    core.store.drain = store_drain


def pop_before_sync(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """Upstream's shutdown loop: ``transfer = queue.popleft(); transfer.end_event.synchronize()`` -- a transfer
    whose completion is not proven (timeout or error) is gone: neither abandoned nor kept for the proof."""
    for handler in _handlers(worker):
        def observe_head(self: Any, observe: Callable[[Event], bool]) -> bool:
            if self.state is HandlerState.ACCEPTING:
                return type(self)._observe_head(self, observe)
            head = self._queue.popleft()
            try:
                done = observe(head.end)
            except DeviceError as exc:
                self._queue.appendleft(head)
                self._head_failed(exc)
                return True
            if done:
                self._queue.appendleft(head)
                self._head_proven()
            return done
        handler._observe_head = types.MethodType(observe_head, handler)


def no_try_between_handler_shutdowns(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """``store.shutdown(); load.shutdown()`` with no try/except: a failed store drain raises past the load's."""
    core = worker._core

    def drain_both(deadline: float, run: Any) -> None:
        for handler in (core.store, core.load):
            outcome = handler.drain(deadline, interrupted=run.interrupt is not None)
            run.clean &= handler.clean
            if outcome.error is not None:
                raise outcome.error
    core._drain_both = drain_both


def unbounded_sync_on_shutdown(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """The drain waits with a blocking ``synchronize()`` instead of polling against the deadline."""
    for handler in _handlers(worker):
        def observe_head(self: Any, observe: Callable[[Event], bool]) -> bool:
            if self.state is HandlerState.DRAINING:
                def observe(event: Event, self: Any = self) -> bool:
                    self._backend.synchronize(event)
                    return True
            return type(self)._observe_head(self, observe)
        handler._observe_head = types.MethodType(observe_head, handler)


def release_after_failed_sync(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """vLLM #51622's best effort under the quarantine policy: a failed (or timed-out) device sync is taken as
    a proof, so the region is released."""
    core = worker._core
    release = core._release

    def release_anyway(run: Any, shield: Any) -> None:
        if run.proof in (ProofOutcome.FAILED, ProofOutcome.TIMEOUT):
            run.proof = ProofOutcome.OK
        release(run, shield)
    core._release = release_anyway


def success_for_failed_event(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """An error from the end event's query is taken as completion: the transfer is reported success=True."""
    for handler in _handlers(worker):
        def observe_head(self: Any, observe: Callable[[Event], bool]) -> bool:
            try:
                done = observe(self._queue[0].end)
            except DeviceError:
                done = True
            if done:
                self._head_proven()
            return done
        handler._observe_head = types.MethodType(observe_head, handler)


def submit_after_shutdown(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """Submissions after shutdown began are accepted (and silently dropped) instead of refused."""
    core, me = worker._core, weakref.ref(worker)
    # The patch holds the worker weakly: a worker -> patch -> worker cycle would leave a dropped mutant to the
    # machine's gc.collect() (see drop_worker), a collection of the whole test session's heap on every drop -- the
    # minutes this test took in a full run. Held weakly, the mutant is finalized when dropped, as the real worker.
    for name in ("submit_store", "submit_load"):
        submit = getattr(type(worker), name)

        def accept(job_id: int, src: Any, dst: Any, submit: Any = submit, **options: Any) -> bool:
            if core.state is not WorkerState.OPEN:
                return True
            return bool(submit(me(), job_id, src, dst, **options))
        setattr(worker, name, accept)


class _ShiftedPlan:
    """A prepared plan whose CPU address of the last block of each partial last chunk is one sub-block late."""

    def __init__(self, inner: Any, cpu_side: str, shifts: list[tuple[int, int]]) -> None:
        self._inner, self._cpu_side, self._shifts = inner, cpu_side, shifts
        self.num_ops: int = inner.num_ops
        self.nbytes: int = inner.nbytes
        self.gpu_ids, self.cpu_ids = inner.gpu_ids, inner.cpu_ids

    def write(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> int:  # type: ignore[type-arg]
        count = int(self._inner.write(src, dst, sizes))
        cpu = dst if self._cpu_side == "dst" else src
        for position, page in self._shifts:
            cpu[position] += page
        return count


def planner_off_by_one_in_last_chunk(worker: CPUOffloadingWorker, setup: Setup) -> None:
    """The planner places the last block of a group whose last chunk is partial one sub-block too far."""
    for handler in _handlers(worker):
        planner, layout, bpc = handler._planner, setup.layout, setup.blocks_per_chunk

        def prepare(direction: str, src: Any, dst: Any, planner: Any = planner, layout: Any = layout,
                    bpc: int = bpc) -> Any:
            plan = planner.prepare(direction, src, dst)
            gpu = src if direction == "store" else dst
            assert isinstance(gpu, GPULoadStoreSpec) and isinstance(src if direction == "load" else dst,
                                                                    CPULoadStoreSpec)
            shifts, offset = [], 0
            for g, refs in enumerate(layout.groups):
                n, skip = gpu.group_sizes[g], gpu.block_indices[g]
                if n and (n + skip) % bpc:
                    shifts += [(offset + r * n + n - 1, layout.tensor_page_bytes[ref.tensor_idx])
                               for r, ref in enumerate(refs)]
                offset += n * len(refs)
            return _ShiftedPlan(plan, "dst" if direction == "store" else "src", shifts)
        handler._planner = types.SimpleNamespace(prepare=prepare)


MUTANTS: dict[str, tuple[Patch, tuple[str, ...]]] = {
    "store handler owns and releases the region": (store_handler_owns_region, ("R3", "R12", "R16")),
    # R14 too: popped at an interrupted shutdown, it is not seen as unproven, and the shutdown claims the clean path.
    "transfer popped before its sync succeeded": (pop_before_sync, ("R10", "R12", "R14", "R16")),
    "no try/except between the handler shutdowns": (no_try_between_handler_shutdowns, ("R9", "R14")),
    "unbounded synchronize() on the shutdown path": (unbounded_sync_on_shutdown, ("R11", "R15")),
    "region released after a failed device sync": (release_after_failed_sync, ("R12",)),
    # Either the false success is seen, or the failed transfer's resources, recycled as if proven, are freed
    # under a copy that may still run.
    "success=True for a transfer whose event failed": (success_for_failed_event, ("R5", "R10")),
    "submit accepted after shutdown began": (submit_after_shutdown, ("R8",)),
    "planner off by one in the last chunk's skip": (planner_off_by_one_in_last_chunk, ("R4",)),
}


def _cites(message: str, rules: tuple[str, ...]) -> bool:
    cited = message.split(":", 1)[0]
    return any(rule in cited.replace("/", " ").split() for rule in rules)


@pytest.mark.rule("R1")
@pytest.mark.rule("R3")
@pytest.mark.rule("R12")
def test_testing_mutant_store_handler_owning_the_region_is_caught() -> None:
    message, _ = _catch(store_handler_owns_region, "store_owns_region")
    assert _cites(message, MUTANTS["store handler owns and releases the region"][1]), message


@pytest.mark.rule("R10")
def test_testing_mutant_pop_before_sync_is_caught() -> None:
    message, _ = _catch(pop_before_sync, "pop_before_sync")
    assert _cites(message, MUTANTS["transfer popped before its sync succeeded"][1]), message


@pytest.mark.rule("R9")
def test_testing_mutant_no_try_between_handler_shutdowns_is_caught() -> None:
    message, _ = _catch(no_try_between_handler_shutdowns, "no_try")
    assert _cites(message, MUTANTS["no try/except between the handler shutdowns"][1]), message


@pytest.mark.rule("R11")
# When the machine catches it through a dropped worker (R15), the mutant's finalizer ends in SimHang, which Python
# can only report as "exception ignored": that is the mutant's bug, not the test's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_testing_mutant_unbounded_sync_on_shutdown_is_caught() -> None:
    message, _ = _catch(unbounded_sync_on_shutdown, "unbounded_sync")
    assert _cites(message, MUTANTS["unbounded synchronize() on the shutdown path"][1]), message


@pytest.mark.rule("R12")
def test_testing_mutant_release_after_failed_device_sync_is_caught() -> None:
    message, _ = _catch(release_after_failed_sync, "release_after_failed_sync")
    assert _cites(message, MUTANTS["region released after a failed device sync"][1]), message


@pytest.mark.rule("R5")
def test_testing_mutant_success_for_failed_event_is_caught() -> None:
    message, _ = _catch(success_for_failed_event, "success_for_failed_event")
    assert _cites(message, MUTANTS["success=True for a transfer whose event failed"][1]), message


@pytest.mark.rule("R8")
def test_testing_mutant_submit_after_shutdown_is_caught() -> None:
    message, _ = _catch(submit_after_shutdown, "submit_after_shutdown")
    assert _cites(message, MUTANTS["submit accepted after shutdown began"][1]), message


def test_testing_mutant_submit_after_shutdown_is_freed_without_a_collection() -> None:
    """The mutant hunt above drops hundreds of mutants: each must go when its last reference does, as the real
    worker does; one held by a cycle costs a collection of the whole session's heap per drop (minutes in CI)."""
    layout = KVCacheLayout(tensor_page_bytes=(64,), groups=((LayerRef(0, 64),),))
    setup = Setup(layout, 2, 8, 4, (0,), ShutdownPolicy())
    device = SimDevice(setup)
    worker = _factory(submit_after_shutdown)(device.backend, device.gpu, setup)
    alive = weakref.ref(worker)
    gc.disable()
    try:
        del worker
        assert alive() is None, "a reference cycle holds the patched worker"
    finally:
        gc.enable()


@pytest.mark.rule("R4")
def test_testing_mutant_planner_off_by_one_is_caught() -> None:
    message, _ = _catch(planner_off_by_one_in_last_chunk, "planner_off_by_one")
    assert _cites(message, MUTANTS["planner off by one in the last chunk's skip"][1]), message


def test_testing_mutants_table_is_complete() -> None:
    assert len(MUTANTS) == 8 and all(isinstance(v[0], collections.abc.Callable) for v in MUTANTS.values())
