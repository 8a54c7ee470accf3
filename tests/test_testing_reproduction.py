"""A failing run's reproduction is a test (``def test_reproduction()`` ending in the violated rule's assertion), and
a machine run under pytest keeps the library's log lines off the report (the last KEEP are noted with a failure)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import seed
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.backends.base import Backend
from kvoffload_ref.testing import ConformanceError, Setup, WorkerLike, make_machine, mutants, reference_factory
from kvoffload_ref.testing.campaign import REPRO_BEGIN, REPRO_END, run_campaign
from kvoffload_ref.testing.logtail import KEEP, LogTail
from kvoffload_ref.testing.reproduction import NO_SCRIPT_FORM, as_test
from kvoffload_ref.testing.settings import bounded_shrinking, kit_settings

HEADER = "import gc\nfrom kvoffload_ref import *"


def _run(tmp_path: pathlib.Path, *runs: tuple[str, ...]) -> list[int]:
    """The exit status of each run, side by side: ``(text,)`` under python, ``(text, *pytest_args)`` under pytest."""

    def one(index: int, text: str, *pytest_args: str) -> int:
        path = tmp_path / f"repro_{index}.py"
        path.write_text(text)
        under = ("-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args) if pytest_args else ()
        return subprocess.run([sys.executable, *under, str(path)], capture_output=True, text=True, timeout=60,
                              check=False, cwd=tmp_path).returncode

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda indexed: one(indexed[0], *indexed[1]), enumerate(runs)))


def test_testing_reproduction_asserts_the_rule_under_python_and_pytest(tmp_path: pathlib.Path) -> None:
    steps = [HEADER, "results = [1, 2]", "print(results)"]
    broken = as_test(steps, "R5", "job 3 reported", "3 in results")
    assert broken.count("def test_reproduction() -> None:") == 1 and broken.startswith('"""')
    holds = as_test(steps, "R5", "job 3 reported", "2 in results")
    assert _run(tmp_path, (broken,), (broken, "-x"), (holds,), (holds, "-x")) == [1, 1, 0, 0]


def test_testing_reproduction_without_a_python_form_fails_where_the_kit_did(tmp_path: pathlib.Path) -> None:
    text = as_test([HEADER, "x = 1"], "R16", "the ledger does not balance", None)
    assert NO_SCRIPT_FORM in text and "raise AssertionError('R16: the ledger does not balance')" in text
    assert _run(tmp_path, (text,)) == [1]


def test_testing_reproduction_of_a_call_that_raised_passes_once_it_returns(tmp_path: pathlib.Path) -> None:
    raised, returned = _run(tmp_path, *((as_test([HEADER, last], "the last call raised", "x", "True"),)
                                        for last in ("raise KeyboardInterrupt", "pass")))
    assert raised != 0 and returned == 0


@pytest.mark.rule("R5")
def test_testing_machine_under_pytest_notes_one_reproduction_and_keeps_the_logs_off(
        caplog: pytest.LogCaptureFixture) -> None:
    """The pytest route (no campaign, no quiet_logs): the library's lines never reach pytest's log capture; the
    failure's notes carry the reproduction once, as a test, and at most KEEP log lines."""
    caplog.set_level(logging.DEBUG)
    machine = make_machine(mutants.failures_reported_as_success, name="LoggedMachine")
    with pytest.raises(ConformanceError) as info, bounded_shrinking(1.0):
        run_state_machine_as_test(seed(2)(machine), settings=kit_settings(200))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert notes.count("def test_reproduction() -> None:") == 1
    assert "assert all(not r.success for r in results if r.job_id ==" in notes
    library = [r for r in caplog.records if not r.name.startswith("kvoffload_ref.testing")]
    assert library == []
    kept = [line for line in machine.last_logs.splitlines() if line.startswith("#   ")]
    assert 0 < len(kept) <= KEEP and kept == [line for line in notes.splitlines() if line.startswith("#   ")]
    logger = logging.getLogger("kvoffload_ref")  # given back (another test may have left its own handler there)
    assert logger.propagate and not any(isinstance(h, LogTail) for h in logger.handlers)


class _KeepsUnderRelease(mutants._Wrapper):
    """kvoffload_ref's worker, except that its report says "quarantined" under the release policy (R12)."""

    def shutdown(self) -> object:
        report = self._inner.shutdown()
        return dataclasses.replace(report, region="quarantined") if report.region == "released" else report


def keeps_under_release(backend: Backend, gpu: Sequence[object], setup: Setup) -> WorkerLike:
    """A worker that keeps the region under the release policy (R12 violated)."""
    return _KeepsUnderRelease(reference_factory(backend, gpu, setup))  # type: ignore[return-value]


@pytest.mark.rule("R12")
def test_testing_release_policy_reproduction_asserts_the_region(tmp_path: pathlib.Path) -> None:
    """The release policy's fate (R12) closes the reproduction as ``assert report.region == 'released'``: the script
    fails with the wrong worker and passes with kvoffload_ref's own."""
    out = io.StringIO()
    assert run_campaign(400, 1, "release", out, factory=keeps_under_release, shrink_seconds=1.0) == 1
    script = out.getvalue().split(REPRO_BEGIN + "\n", 1)[1].split(REPRO_END, 1)[0]
    assert "assert report.region == 'released', \"R12: policy 'release' left the region" in script
    module = "from test_testing_reproduction import keeps_under_release"
    assert module in script
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parent)}
    path = tmp_path / "repro.py"
    for text, status in ((script, 1), (script.replace("w = keeps_under_release(", "w = reference_factory("), 0)):
        path.write_text(text)
        done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60, check=False,
                              cwd=tmp_path, env=env)
        assert done.returncode == status, done.stdout[-2000:] + done.stderr[-2000:]


_ROUTE = '''
import hypothesis
from hypothesis import strategies as st
from kvoffload_ref.faults import Fault
from kvoffload_ref.testing import kit_settings, make_machine, mutants, setups

Wrong = make_machine(mutants.failures_reported_as_success, name="WrongWorker",
                     setup_strategy=setups(plans=st.just((Fault("event_query", "error", job_id=1),))),
                     settings=hypothesis.settings(kit_settings(200, derandomize=True), print_blob=True))
Wrong.shrink_seconds = 2.0
TestWrongWorker = Wrong.TestCase
'''


@pytest.mark.rule("R5")
@pytest.mark.parametrize("ci", [False, True])
def test_testing_pytest_route_prints_the_reproduction_once(tmp_path: pathlib.Path, ci: bool) -> None:
    """docs/conformance.md's pytest route, failing: the output holds the kit's reproduction once and not
    Hypothesis's own listing of the steps (its ``Failing test case``, each ``state.rule()`` call, its shrink
    warning); Hypothesis's ``@reproduce_failure`` line is kept (``print_blob``: it replays the kit's run). Also on
    CI, where pytest's summary line holds the whole exception (a note there would be printed twice)."""
    (tmp_path / "test_route.py").write_text(_ROUTE)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    if ci:
        env["CI"] = "true"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_route.py"],
                          capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert out.count("def test_reproduction() -> None:") == 1, out[-3000:]
    assert out.count("w = failures_reported_as_success(dev.backend, dev.gpu, setup)") == 1
    assert "assert all(not r.success for r in results if r.job_id == 1)" in out
    for hypothesis_own in ("Failing test case", "state.get_finished()", "Draw 1", "five minutes"):
        assert hypothesis_own not in out, hypothesis_own
    assert out.count("@reproduce_failure(") == 1
