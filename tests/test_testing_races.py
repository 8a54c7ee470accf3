"""The conformance kit's R20 model (testing/races.py) and the machine's race check: the device flags exactly the
pairs the rules leave unordered; the check bites when the detector is off or when the worker drops R4's
compute-stream wait; ordered schedules see no race at all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _support import CATCH_BUDGET, catch_budget
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.testing import ConformanceError, Setup, make_machine, reference_factory, setups
from kvoffload_ref.testing.adapter import START, SimDevice, WorkerLike
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.model import plan_moves
from kvoffload_ref.testing.races import RaceModel
from kvoffload_ref.worker import CPUOffloadingWorker, ShutdownPolicy

#: Examples (of up to 50 steps) a broken race check must be caught in.
BUDGET = CATCH_BUDGET
LAYOUT = KVCacheLayout(tensor_page_bytes=(16, 8), groups=((LayerRef(0, 16),), (LayerRef(1, 8), LayerRef(0, 16))))


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def _moves(gpu: list[int], cpu: list[int], sizes: tuple[int, int] = (1, 0), indices: tuple[int, int] = (0, 0),
           bpc: int = 2) -> list[Any]:
    return plan_moves(LAYOUT, bpc, GPULoadStoreSpec(gpu, group_sizes=sizes, block_indices=indices),
                      CPULoadStoreSpec(cpu))


# -- the model alone ------------------------------------------------------------------------------------------
@pytest.mark.rule("R20")
@pytest.mark.rule("R4")
def test_testing_races_fifo_and_compute_wait_order() -> None:
    race = RaceModel()
    race.compute(0, [3], 16)
    race.transfer("store", 1, _moves([3], [0]))        # after the compute write (R4's wait): ordered
    race.transfer("store", 2, _moves([3], [0]))        # same direction: FIFO, ordered (WAW on the chunk)
    assert race.races == set()


@pytest.mark.rule("R20")
def test_testing_races_each_racing_pair() -> None:
    race = RaceModel()
    race.transfer("store", 1, _moves([3], [0]))        # reads GPU row 3 (tensor 0), writes chunk 0 sub-block 0
    race.transfer("load", 2, _moves([3], [1]))         # WAR on GPU row 3
    race.transfer("load", 3, _moves([5], [0]))         # RAW on chunk 0 (the store writes it)
    race.compute(0, [5], 16)                           # WAW with load 3 on GPU row 5 (compute after the load)
    race.transfer("store", 4, _moves([6], [1], indices=(1, 0)))  # sub-block 1 of chunk 1: no overlap with load 2
    race.transfer("load", 7, _moves([6], [3]))         # WAR with store 4 on GPU row 6
    assert race.races == {(("store", 1), ("load", 2)), (("store", 1), ("load", 3)),
                          (("load", 3), ("compute", 0)), (("store", 4), ("load", 7))}


@pytest.mark.rule("R20")
def test_testing_races_reads_of_the_same_bytes_and_other_sub_blocks_do_not_race() -> None:
    race = RaceModel()
    race.transfer("store", 1, _moves([3], [0]))
    race.transfer("store", 2, _moves([3], [1]))        # FIFO anyway
    race.transfer("load", 3, _moves([4], [0], indices=(1, 0)))  # chunk 0 sub-block 1: the store wrote sub-block 0
    race.transfer("load", 4, _moves([4], [2], sizes=(0, 1)))    # tensor 1 and 0 of GPU row 4: FIFO after load 3
    assert race.races == set()


@pytest.mark.rule("R20")
def test_testing_races_observation_orders_and_a_failure_does_not() -> None:
    race = RaceModel()
    race.transfer("store", 1, _moves([3], [0]))
    race.transfer("store", 2, _moves([4], [1]))
    race.observe(("store", 2))                          # observing job 2 observes job 1 too (FIFO)
    race.transfer("load", 3, _moves([3], [1]))          # ordered after both
    assert race.races == set() and race.is_observed(("store", 1))
    race.transfer("store", 5, _moves([7], [2]))         # suppose it failed: nothing is observed
    race.compute(0, [7], 16)                            # WAR with the failed store: still a race
    assert race.races == {(("store", 5), ("compute", 0))}
    race.transfer("store", 6, _moves([8], [3]))
    race.observe(("store", 6))                          # a later store of its direction observed: job 5 ordered
    race.compute(0, [7], 16)
    assert (("store", 5), ("compute", 1)) not in race.races


@pytest.mark.rule("R20")
def test_testing_races_compute_observed_by_to_host() -> None:
    race = RaceModel()
    race.transfer("load", 1, _moves([2], [0]))
    race.compute(0, [2], 16)                            # races with the pending load
    race.observe(("compute", -1))                       # to_host: the compute writes so far
    assert race.is_observed(("compute", 0)) and not race.is_observed(("load", 1))


@pytest.mark.rule("R26")
@pytest.mark.rule("R28")
def test_testing_races_fresh_stream_and_start_events() -> None:
    race = RaceModel()
    race.transfer("store", 1, _moves([3], [0]), "s1")
    race.transfer("store", 2, _moves([4], [0]), "s2")   # a fresh stream (R28): not ordered after job 1 (WAW)
    assert race.races == {(("store", 1), ("store", 2))}
    race.transfer("store", 3, _moves([5], [1]), "s2")
    race.observe(("store" + START, 3))                   # its start (a deadline's check): what precedes it only
    assert race.is_observed(("store", 2)) and not race.is_observed(("store", 3))
    assert not race.is_observed(("store", 1))


# -- the machine ----------------------------------------------------------------------------------------------
def _run(machine: Any) -> None:
    run_state_machine_as_test(machine, settings=catch_budget())


@pytest.mark.rule("R20")
def test_testing_races_detector_off_is_caught() -> None:
    """A device whose race detector is off misses races the model predicts: the machine says so."""
    machine = make_machine(name="DetectorOff")

    class DetectorOff(machine):  # type: ignore[misc,valid-type]
        def _make_device(self, setup: Setup) -> SimDevice:
            return SimDevice(setup, race_check=False)

    with pytest.raises(ConformanceError, match=r"R4/R20: dma_race pairs differ .* not flagged"):
        _run(DetectorOff)
    print(f"detector off: caught after {DetectorOff.counters.steps} steps")


class _NoComputeWait:
    """A backend proxy that drops ``wait_event``: the handler's R4 wait for the compute stream is lost."""

    def __init__(self, inner: Backend) -> None:
        self._inner = inner

    def wait_event(self, stream: object, event: object) -> None:
        """Dropped."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def no_compute_wait(backend: Backend, gpu: Any, setup: Setup) -> WorkerLike:
    """The reference worker whose handlers never make their stream wait for the compute stream (R4)."""
    worker = reference_factory(backend, gpu, setup)
    assert isinstance(worker, CPUOffloadingWorker)
    for handler in (worker._core.store, worker._core.load):
        handler._backend = _NoComputeWait(handler._backend)
    return worker


@pytest.mark.rule("R4")
@pytest.mark.rule("R20")
def test_testing_races_dropped_compute_wait_is_caught() -> None:
    machine = make_machine(no_compute_wait, name="NoComputeWait")
    with pytest.raises(ConformanceError, match=r"R4/R20: dma_race pairs differ .* flagged but ordered by the rules"):
        _run(machine)
    print(f"no compute wait: caught after {machine.counters.steps} steps")


@pytest.mark.rule("R20")
@pytest.mark.parametrize("schedule", ["ordered", "racy"])
def test_testing_races_schedules(schedule: str) -> None:
    """Ordered schedules never produce a race on the library's worker; racy ones do, and match the model."""
    machine = make_machine(name=f"Schedule_{schedule}", setup_strategy=setups(schedules=(schedule,)))
    run_state_machine_as_test(machine, settings=settings(catch_budget(), max_examples=40))
    counters = machine.counters
    print(f"{schedule}: {counters.line()}")
    assert counters.violations == 0
    if schedule == "ordered":
        assert counters.races == 0 and counters.ordered_waits > 0
    else:
        assert counters.races > 0


@pytest.mark.rule("R20")
def test_testing_races_reproduction_names_the_schedule() -> None:
    setup = Setup(LAYOUT, 2, 8, 4, (0, 0), ShutdownPolicy(), schedule="ordered")
    assert "schedule='ordered'" in repr(setup)
    dev = SimDevice(setup)
    assert dev.races() == set() and dev.take_observations() == []
