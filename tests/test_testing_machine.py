"""The conformance machine on kvoffload_ref itself, under both shutdown policies (the CI budget: >= 20,000 steps).
(The same machines on the reference worker, built by :func:`policy_machine`, are in tests/test_reference.py: this
module is what HypoFuzz's route fuzzes, the engine's two machines.)

The machines are module-level ``TestCase`` classes (pytest runs them; HypoFuzz finds them); the step counts are
printed (``pytest -s``) and the last test checks what they did and the budget under the ``ci`` profile.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from kvoffload_ref.testing import OffloadingMachine, make_machine, policies, setups
from kvoffload_ref.testing.adapter import WorkerFactory, reference_factory
from kvoffload_ref.testing.campaign import quiet_logs

#: Stateful examples per test = the profile's max_examples times this (each example is up to 50 steps).
STATEFUL_MULTIPLIER = 4
#: Steps the ``ci`` profile must run over the stateful tests of this module (issue 3).
CI_STEP_BUDGET = 20_000


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


def reference_settings() -> settings:
    """The engine's machine settings at a quarter of its examples (100 per policy under the ``ci`` profile, up to
    5,000 steps each): the reference shares the kit with the engine, not its budget."""
    current = stateful_settings()
    return settings(current, max_examples=max(10, current.max_examples // 4))


def policy_machine(name: str, policy: str, factory: WorkerFactory = reference_factory,
                   machine_settings: settings | None = None) -> type[OffloadingMachine]:
    """The machine on the worker ``factory`` builds, every setup under one shutdown policy."""
    return make_machine(factory, name=name, setup_strategy=setups(policy=policies(on_unproven=(policy,))),
                        settings=machine_settings or stateful_settings())


#: The machines the project tests itself with: module-level TestCase classes, so that pytest runs them and
#: HypoFuzz (``hypothesis fuzz``) discovers them.
QuarantineMachine = policy_machine("ReferenceWorkerQuarantine", "quarantine")
ReleaseMachine = policy_machine("ReferenceWorkerRelease", "release")


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
class TestReferenceWorkerQuarantinePolicy(QuarantineMachine.TestCase):
    """The machine on kvoffload_ref's worker under the "quarantine" policy."""


@pytest.mark.rule("R2")
@pytest.mark.rule("R5")
@pytest.mark.rule("R8")
@pytest.mark.rule("R11")
@pytest.mark.rule("R12")
@pytest.mark.rule("R14")
@pytest.mark.rule("R16")
class TestReferenceWorkerReleasePolicy(ReleaseMachine.TestCase):
    """The machine on kvoffload_ref's worker under the "release" policy (vLLM #51622)."""


def test_testing_machine_ci_budget_of_stateful_steps() -> None:
    """After both machines ran: what they did, and the CI budget (>= 20,000 steps under the ``ci`` profile)."""
    quarantine, release = QuarantineMachine.counters, ReleaseMachine.counters
    if not (quarantine.runs and release.runs):
        pytest.skip("the stateful tests of this module did not run in this session")
    print(f"\nquarantine: {quarantine.line()}\nrelease: {release.line()}")
    assert quarantine.violations == 0 and quarantine.hazards == 0
    assert quarantine.submitted and quarantine.succeeded and quarantine.data_checks and quarantine.shutdowns
    assert release.violations == 0 and release.shutdowns
    total = quarantine.steps + release.steps
    print(f"stateful steps this session: {total} (quarantine={quarantine.steps}, release={release.steps})")
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        assert total >= CI_STEP_BUDGET
