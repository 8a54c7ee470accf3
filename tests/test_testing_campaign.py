"""run_campaign: the fuzz campaign outside pytest (``kvoffload-ref fuzz``)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pytest

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing import Setup, WorkerLike, mutants, reference_factory
from kvoffload_ref.testing.adapter import reference_worker_factory
from kvoffload_ref.testing.campaign import run_campaign


class _Phantom:
    """A worker that reports a job nobody submitted."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_finished(self) -> list[Any]:
        return [*self._inner.get_finished(), type("R", (), {"job_id": -5, "success": True, "transfer_size": 0})()]


def _phantom_factory(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    return _Phantom(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


@pytest.mark.rule("R5")
@pytest.mark.rule("R12")
@pytest.mark.rule("R16")
def test_testing_campaign_runs_the_steps_and_reports_progress() -> None:
    out = io.StringIO()
    assert run_campaign(400, 3, "quarantine", out=out) == 0
    text = out.getvalue()
    assert text.startswith("fuzz: 400 steps, seed 3, policy quarantine\n")
    assert "steps/s" in text and "violations 0" in text and "fuzz: OK:" in text
    steps = int(text.rsplit("fuzz: steps ", 1)[1].split("/", 1)[0])
    assert steps >= 400


def test_testing_campaign_same_seed_same_campaign() -> None:
    runs = []
    for _ in range(2):
        out = io.StringIO()
        assert run_campaign(200, 11, None, out=out) == 0
        runs.append(out.getvalue().rsplit("fuzz: OK: ", 1)[1])
    assert runs[0] == runs[1]


@pytest.mark.rule("R5")
def test_testing_campaign_fails_with_a_reproduction() -> None:
    out = io.StringIO()
    assert run_campaign(2000, 1, None, out=out, factory=_phantom_factory) == 1
    text = out.getvalue()
    assert "fuzz: FAILED (seed 1) at step " in text and ": R5: reported job -5" in text
    assert "w = _phantom_factory(dev.backend, dev.gpu, setup)" in text
    assert text.count("def test_reproduction() -> None:") == 1  # once: Hypothesis's copy of the steps is dropped
    assert "assert -5 not in [r.job_id for r in results], 'R5: reported job -5" in text
    assert "Failing test case" not in text


def _success_only_reference(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A deliberately wrong reference worker: the kit's ``failures_reported_as_success`` mutant applied to it."""
    return mutants._SuccessOnly(reference_worker_factory(backend, gpu, setup))


#: The kit's ``failures_reported_as_success`` mutant on each worker.
SUCCESS_ONLY = {"engine": mutants.failures_reported_as_success, "reference": _success_only_reference}


@pytest.mark.rule("R5")
@pytest.mark.parametrize("worker", list(SUCCESS_ONLY))
def test_testing_campaign_catches_failures_reported_as_success(worker: str) -> None:
    """The machine, run as a campaign, catches either worker reporting failed transfers as successful (found is
    what is checked: the shrink is cut short)."""
    out = io.StringIO()
    assert run_campaign(2_000, 1, None, out, factory=SUCCESS_ONLY[worker], shrink_seconds=1.0) == 1
    assert "R5" in out.getvalue()


def test_testing_campaign_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        run_campaign(10, 1, "sometimes")


def test_testing_campaign_jobs_total_sums_every_counter() -> None:
    """``--jobs``' closing ``fuzz: totals:`` line sums each job's counters (the long campaign's record)."""
    from kvoffload_ref.testing.jobs import _Tally
    from kvoffload_ref.testing.machine import Counters

    tally = _Tally(2)
    tally.latest = [Counters(runs=2, steps=90, faults_fired=3, interrupts=1, races=4, concurrent_shutdowns=1),
                    Counters(runs=3, steps=110, faults_fired=5, races=2, first_failure_step=0)]
    total = tally.total()
    assert (total.runs, total.steps, total.faults_fired, total.interrupts, total.races) == (5, 200, 8, 1, 6)
    assert total.concurrent_shutdowns == 1 and total.first_failure_step == 0
    assert "steps=200" in total.line()
