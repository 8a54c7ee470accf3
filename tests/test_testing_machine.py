"""The conformance machine on kvoffload_ref itself, under both shutdown policies (the CI budget: >= 20,000 steps).

The step counts are printed (``pytest -s``) and the last test checks the budget under the ``ci`` profile.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.testing import Counters, make_machine, policies, setups
from kvoffload_ref.testing.campaign import quiet_logs

#: Stateful examples per test = the profile's max_examples times this (each example is up to 50 steps).
STATEFUL_MULTIPLIER = 4
#: Steps the ``ci`` profile must run over the stateful tests of this module (issue 3).
CI_STEP_BUDGET = 20_000

# Invariant: test name -> the counters of its machine, filled as the stateful tests run.
COUNTS: dict[str, Counters] = {}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logs():
        yield


def stateful_settings() -> settings:
    """The loaded profile, with more examples for the stateful tests and 50 steps per example."""
    current = settings()
    return settings(current, max_examples=current.max_examples * STATEFUL_MULTIPLIER, stateful_step_count=50,
                    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.filter_too_much])


def _run(name: str, policy: str) -> Counters:
    machine = make_machine(name=name, setup_strategy=setups(policy=policies(on_unproven=(policy,))))
    run_state_machine_as_test(machine, settings=stateful_settings())
    COUNTS[name] = machine.counters
    print(f"\n{name}: {machine.counters.line()}")
    return machine.counters


@pytest.mark.rule("R4")
@pytest.mark.rule("R5")
@pytest.mark.rule("R6")
@pytest.mark.rule("R7")
@pytest.mark.rule("R8")
@pytest.mark.rule("R9")
@pytest.mark.rule("R10")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R13")
@pytest.mark.rule("R14")
@pytest.mark.rule("R15")
@pytest.mark.rule("R16")
def test_testing_machine_reference_worker_quarantine_policy() -> None:
    counters = _run("quarantine", "quarantine")
    assert counters.violations == 0 and counters.hazards == 0
    assert counters.submitted and counters.succeeded and counters.data_checks and counters.shutdowns


@pytest.mark.rule("R2")
@pytest.mark.rule("R5")
@pytest.mark.rule("R8")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
def test_testing_machine_reference_worker_release_policy() -> None:
    counters = _run("release", "release")
    assert counters.violations == 0 and counters.shutdowns


def test_testing_machine_ci_budget_of_stateful_steps() -> None:
    if len(COUNTS) < 2:
        pytest.skip("the stateful tests of this module did not run in this session")
    total = sum(c.steps for c in COUNTS.values())
    print(f"\nstateful steps this session: {total} ({', '.join(f'{k}={c.steps}' for k, c in COUNTS.items())})")
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        assert total >= CI_STEP_BUDGET
