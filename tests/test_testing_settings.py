"""The kit's own settings: no explain phase, bounded shrinking, TestCase classes that pytest and HypoFuzz find, and
the documented pytest route catching a wrong worker quickly."""

from __future__ import annotations

import time
import unittest
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, InMemoryExampleDatabase

from kvoffload_ref.faults import Fault
from kvoffload_ref.testing import kit_settings, make_machine, settings_for_ci, setups
from kvoffload_ref.testing.campaign import quiet_logs
from kvoffload_ref.testing.mutants import failures_reported_as_success
from kvoffload_ref.testing.settings import (
    EXAMPLE_DATABASE_ENV,
    PROFILES,
    bounded_shrinking,
    register_profiles,
    settings_for_fuzz,
    settings_for_hypofuzz,
)


def test_testing_settings_have_no_explain_phase_and_no_database() -> None:
    for chosen in (kit_settings(), settings_for_ci(), kit_settings(shrink=False)):
        assert Phase.explain not in chosen.phases and chosen.database is None and chosen.deadline is None
    assert Phase.shrink not in kit_settings(shrink=False).phases
    assert settings_for_ci().derandomize


def test_testing_settings_hypofuzz_profile_is_the_fuzz_profile_with_an_example_database(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HypoFuzz needs the loaded profile's database (its workers died on ``database=None``): the hypofuzz
    profile has one -- the directory $KVOFFLOAD_REF_EXAMPLE_DATABASE names, else .hypothesis/examples, or the
    path or database given -- replays that database first, and otherwise has the fuzz profile's settings. Making
    it writes nothing."""
    fuzz = settings_for_fuzz()
    monkeypatch.delenv(EXAMPLE_DATABASE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    chosen = settings_for_hypofuzz()
    assert chosen.database == DirectoryBasedExampleDatabase(str(tmp_path / ".hypothesis" / "examples"))
    for name in ("max_examples", "deadline", "derandomize", "stateful_step_count", "suppress_health_check",
                 "report_multiple_bugs"):
        assert getattr(chosen, name) == getattr(fuzz, name), name
    # The same phases, plus replaying the database's examples first (HypoFuzz's failures included).
    assert [p for p in chosen.phases if p is not Phase.reuse] == list(fuzz.phases)
    assert Phase.reuse in chosen.phases and Phase.reuse not in fuzz.phases
    monkeypatch.setenv(EXAMPLE_DATABASE_ENV, "shared-examples")
    assert settings_for_hypofuzz().database == DirectoryBasedExampleDatabase(str(tmp_path / "shared-examples"))
    assert settings_for_hypofuzz(tmp_path / "named").database == DirectoryBasedExampleDatabase(
        str(tmp_path / "named"))
    shared = InMemoryExampleDatabase()
    assert settings_for_hypofuzz(shared).database is shared
    assert not list(tmp_path.iterdir())
    register_profiles()
    assert PROFILES[-1] == "kvoffload_ref-hypofuzz"
    assert settings.get_profile("kvoffload_ref-hypofuzz").database is not None
    assert settings.get_profile("kvoffload_ref-fuzz").database is None


def test_testing_settings_machines_test_case_uses_them_and_is_a_hypothesis_test() -> None:
    machine = make_machine(name="SettingsProbe")
    case = machine.TestCase
    assert issubclass(case, unittest.TestCase)
    assert Phase.explain not in case.settings.phases and case.settings.max_examples == kit_settings().max_examples
    assert getattr(case.runTest, "is_hypothesis_test", False)  # what pytest plugins and HypoFuzz look for
    chosen = settings_for_ci()
    assert make_machine(name="Chosen", settings=chosen).TestCase.settings is chosen


def test_testing_settings_bounded_shrinking_sets_and_restores_hypothesis_bound() -> None:
    from hypothesis.internal.conjecture import engine

    before = engine.MAX_SHRINKING_SECONDS
    with bounded_shrinking(7.0):
        assert engine.MAX_SHRINKING_SECONDS == 7.0
    assert before == engine.MAX_SHRINKING_SECONDS
    with pytest.raises(ValueError, match="positive"), bounded_shrinking(0):
        pass


@pytest.mark.rule("R5")
def test_testing_settings_pytest_route_catches_a_worker_reporting_failures_as_success() -> None:
    """docs/conformance.md's pytest route, on the importable wrong worker: found, shrunk and reported. Every
    setup arms an error on job 1's end event, so the run does not depend on which examples are drawn."""
    failing_job_1 = setups(plans=st.just((Fault("event_query", "error", job_id=1),)))
    machine = make_machine(failures_reported_as_success, name="WrongWorker", setup_strategy=failing_job_1,
                           settings=kit_settings(200, derandomize=True))
    machine.shrink_seconds = 2.0
    start = time.perf_counter()
    with quiet_logs():
        result = unittest.TestResult()
        machine.TestCase().run(result)
    elapsed = time.perf_counter() - start
    print(f"pytest route: wrong worker found, shrunk and reported in {elapsed:.1f} s")
    assert len(result.failures) == 1
    assert "R5: job" in result.failures[0][1] and "reported success" in result.failures[0][1]
    assert "from kvoffload_ref.testing.mutants import failures_reported_as_success" in machine.last_reproduction
