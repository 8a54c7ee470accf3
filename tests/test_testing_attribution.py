"""The kit knows R22 and R23: the model predicts every failed result's ``invalid_blocks`` and the shutdown report's
job list, the machine holds both workers to it (every accepted job exactly once across ``get_finished()`` and the
report), the R20 race model counts ``order_after`` as an ordering edge, and the machine catches a worker that
names the wrong blocks, one whose ``order_after`` orders nothing, and one whose report loses a job.

Every machine run is derandomized, generate-only, within the mutant tests' CI budget (200 examples of up to 50
steps); the steps each took are printed (``pytest -s``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from _support import catch_budget
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.specs import CPULoadStoreSpec, GPULoadStoreSpec, KVCacheLayout, LayerRef
from kvoffload_ref.testing import Capabilities, ConformanceError, Setup, make_machine
from kvoffload_ref.testing.adapter import WorkerFactory, WorkerLike, reference_factory, reference_worker_factory
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.model import Model, plan_moves
from kvoffload_ref.testing.mutants import order_after_ignored, poisons_source_blocks
from kvoffload_ref.testing.outcomes import accounting_problems, outcome_problems
from kvoffload_ref.testing.races import RaceModel

FACTORIES = {"engine": reference_factory, "reference": reference_worker_factory}
LAYOUT = KVCacheLayout(tensor_page_bytes=(16,), groups=((LayerRef(0, 16),),))


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def _catch(factory: WorkerFactory, name: str) -> tuple[str, int]:
    machine = make_machine(factory, name=f"Attribution_{name}")
    with pytest.raises(ConformanceError) as info:
        run_state_machine_as_test(machine, settings=catch_budget())
    counters = machine.counters
    print(f"{name}: caught at step {counters.first_failure_step} ({counters.runs} runs): {str(info.value)[:200]}")
    return str(info.value), counters.first_failure_step


def _cited(message: str) -> list[str]:
    return message.split(":", 1)[0].replace("/", " ").split()


def _moves(gpu: list[int], cpu: list[int]) -> list[Any]:
    return plan_moves(LAYOUT, 1, GPULoadStoreSpec(gpu, group_sizes=(len(gpu),), block_indices=(0,)),
                      CPULoadStoreSpec(cpu))


# -- the models alone ---------------------------------------------------------------------------------------------
@pytest.mark.rule("R20")
@pytest.mark.rule("R23")
def test_testing_attribution_race_model_counts_order_after_as_an_edge() -> None:
    race = RaceModel()
    race.transfer("load", 1, _moves([2], [0]))
    race.transfer("load", 2, _moves([3], [1]))
    race.order_after([("load", 2)])                    # covers load 2 and, by FIFO, load 1
    race.compute(0, [2, 3], 16)                        # ordered after both loads: no race
    race.order_after([("load", 1)], "side")            # a named stream waits for load 1 only
    race.compute(0, [2], 16, "side")                   # WAW with compute 0 (another stream): a race
    race.compute(0, [3], 16, "other")                  # nothing ordered on this stream: races load 2, compute 0
    race.transfer("store", 3, _moves([3], [2]))        # after the worker's compute stream: ordered after its waits
    assert race.races == {(("compute", 0), ("compute", 1)), (("load", 2), ("compute", 2)),
                          (("compute", 0), ("compute", 2)), (("compute", 2), ("store", 3))}
    race.observe(("compute", -1))                      # to_host: the worker's stream, and what it waited for
    assert race.is_observed(("load", 2)) and not race.is_observed(("compute", 1))
    assert race.waits == [(None, (("load", 2),)), ("side", (("load", 1),))]


@pytest.mark.rule("R22")
@pytest.mark.rule("R23")
def test_testing_attribution_model_names_destinations_and_orders_compute_after_a_load() -> None:
    gpu0 = [np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)]
    model = Model(LAYOUT, 1, 4, 4, gpu0, [np.zeros((4, 16), np.uint8)])
    gpu, cpu = GPULoadStoreSpec([3, 1], group_sizes=(2,), block_indices=(0,)), CPULoadStoreSpec([2, 0])
    load = model.submit("load", 1, gpu, cpu, hung=False)
    store = model.submit("store", 2, GPULoadStoreSpec([0], group_sizes=(1,), block_indices=(0,)),
                         CPULoadStoreSpec([3]), hung=False)
    assert load.dst_ids == (1, 3) and load.transfer_type == ("CPU", "GPU")
    assert store.dst_ids == (3,) and store.transfer_type == ("GPU", "CPU")
    model.compute_write(0, [3], 7, 0.0, 0.0)           # unordered with the pending load: unknown
    assert not model.sides["gpu"].known[0][3].any()
    model.order_after([load], 0.0)
    model.compute_write(0, [1], 9, 0.0, 0.0)           # ordered after it: the compute's bytes, once it resolves
    model.resolve(load, True)
    assert model.sides["gpu"].settled(0)[1].all() and (model.sides["gpu"].value[0][1] == 9).all()
    model.compute_write(0, [0], 5, 0.0, 0.0, "side")   # a named stream: ordered with nothing, poisoned
    assert model.sides["gpu"].poison[0][0].all()


@dataclasses.dataclass(frozen=True)
class _Result:
    job_id: int
    success: bool
    transfer_size: int | None = None
    invalid_blocks: tuple[int, ...] = ()
    transfer_type: tuple[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class _Outcome:
    result: _Result
    ended: str


@dataclasses.dataclass(frozen=True)
class _Part:
    drained: int
    abandoned: int


@dataclasses.dataclass(frozen=True)
class _Report:
    unreported: tuple[_Outcome, ...]
    store: _Part = _Part(0, 0)
    load: _Part = _Part(0, 2)


@pytest.mark.rule("R22")
def test_testing_attribution_outcome_checks_name_each_contradiction() -> None:
    model = Model(LAYOUT, 1, 4, 4, [np.zeros((4, 16), np.uint8)], [np.zeros((4, 16), np.uint8)])
    for job, (g, c) in enumerate((([0], [1]), ([2], [3])), start=1):
        model.submit("load", job, GPULoadStoreSpec(g, group_sizes=(1,), block_indices=(0,)), CPULoadStoreSpec(c),
                     hung=False)
    kind = ("CPU", "GPU")
    right = _Report((_Outcome(_Result(1, False, None, (0,), kind), "abandoned"),
                     _Outcome(_Result(2, False, None, (2,), kind), "abandoned")))
    assert list(outcome_problems(right, model, frozenset(), unreliable=False, proven_in_time=False)) == []
    assert list(accounting_problems(right, model, {})) == []
    wrong = _Report((_Outcome(_Result(2, False, None, (3,), kind), "abandoned"),   # a source id, out of order
                     _Outcome(_Result(1, True, 16, (), kind), "failed")))           # a failed "success"
    found = list(outcome_problems(wrong, model, frozenset(), unreliable=False, proven_in_time=True))
    cited = {rules for rules, *_ in found}
    assert {"R22", "R10/R22", "R5/R22"} <= cited, found
    lost = _Report((_Outcome(_Result(1, False, None, (0,), kind), "abandoned"),))
    assert [r for r, *_ in accounting_problems(lost, model, {})] == ["R10/R22"]   # job 2 neither handed nor listed
    assert [r for r, *_ in accounting_problems(right, model, {1: 1})] == ["R14/R22"]  # job 1 twice


# -- the machine on both workers ----------------------------------------------------------------------------------
@pytest.mark.rule("R20")
@pytest.mark.rule("R22")
@pytest.mark.rule("R23")
@pytest.mark.parametrize("worker", sorted(FACTORIES))
def test_testing_attribution_machine_checks_hold_on_both_workers(worker: str) -> None:
    """Failed results name their blocks, every report's job list is predicted, order_after orders what the race
    model says, and every accepted job appears exactly once: on the engine and on the reference."""
    machine = make_machine(FACTORIES[worker], name=f"Attribution_{worker}")
    run_state_machine_as_test(machine, settings=catch_budget(60))
    counters = machine.counters
    print(f"{worker}: {counters.line()}")
    assert counters.violations == 0
    assert counters.failed and counters.outcomes_checked and counters.shutdowns
    assert counters.orderings and counters.ordered_edges and counters.races


# -- the mutants --------------------------------------------------------------------------------------------------
@pytest.mark.rule("R22")
def test_testing_attribution_wrong_poisoned_blocks_are_caught() -> None:
    message, _ = _catch(poisons_source_blocks, "poisons_source_blocks")
    assert "R22" in _cited(message) and "invalid_blocks" in message, message


@pytest.mark.rule("R20")
@pytest.mark.rule("R23")
def test_testing_attribution_order_after_doing_nothing_is_caught() -> None:
    message, _ = _catch(order_after_ignored, "order_after_ignored")
    assert "R20" in _cited(message) and "flagged but ordered by the rules" in message, message
    assert "order_after (R23) waits in this run" in message, message


class _LosesAJob:
    """The engine, except that its shutdown report leaves out the last job it lists."""

    def __init__(self, inner: WorkerLike) -> None:
        self._inner = inner
        self._report: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def shutdown(self) -> Any:
        report = self._inner.shutdown()
        if self._report is None:
            jobs = report.load.jobs or report.store.jobs
            part = "load" if report.load.jobs else "store"
            short = dataclasses.replace(getattr(report, part), jobs=jobs[:-1])
            self._report = dataclasses.replace(report, **{part: short})
        return self._report


def _loses_a_job(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    return _LosesAJob(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


@pytest.mark.rule("R22")
def test_testing_attribution_report_losing_a_job_is_caught() -> None:
    message, _ = _catch(_loses_a_job, "loses_a_job")
    assert "R22" in _cited(message), message


class _Legacy:
    """A worker without R22/R23: results and a report without attribution, and no order_after."""

    def __init__(self, inner: WorkerLike) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "order_after":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def get_finished(self) -> list[Any]:
        return [type("Result", (), {"job_id": r.job_id, "success": r.success, "transfer_size": r.transfer_size})()
                for r in self._inner.get_finished()]


def _legacy(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    return _Legacy(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


def test_testing_attribution_capabilities_off_keep_the_kit_usable_without_r22_r23() -> None:
    machine = make_machine(_legacy, name="Attribution_legacy",
                           capabilities=Capabilities(attribution=False, ordering=False))
    run_state_machine_as_test(machine, settings=catch_budget(30))
    counters = machine.counters
    assert counters.violations == 0 and counters.orderings == 0 and counters.outcomes_checked == 0
