"""The HypoFuzz route of docs/conformance.md, as a bounded smoke test (runs only where HypoFuzz is installed).

``HYPOTHESIS_PROFILE=hypofuzz hypothesis fuzz -n 2 --no-dashboard -- <machines>`` under ``timeout -s INT``, with
the example database in a temporary directory (``$KVOFFLOAD_REF_EXAMPLE_DATABASE``): on the project's machines
(``tests/test_testing_machine.py``) examples run and no failure is found; on a deliberately wrong worker
(``tests/_hypofuzz_wrong_worker.py``) the failure is found and is the kit's R5 violation. What HypoFuzz did is read
back from its database (its reports and failures), with HypoFuzz's own reader. The time bounds only stop a run
(HypoFuzz runs until stopped); nothing asserts how fast anything went. HypoFuzz is optional and never a
dependency of the package (its licence is its own); ``.ci/run`` runs this module in a separate venv.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hypofuzz", reason="HypoFuzz is not installed (optional: pip install hypofuzz; see .ci/run)")

from hypofuzz.database import FailureState, HypofuzzDatabase, test_keys_key
from hypothesis.database import DirectoryBasedExampleDatabase

from kvoffload_ref.testing.settings import EXAMPLE_DATABASE_ENV

ROOT = Path(__file__).resolve().parent.parent
#: How long the passing run fuzzes (HypoFuzz never stops by itself while no failure is found).
PASSING_SECONDS = 30
#: The most the wrong worker's run may take; it is stopped as soon as the failure is in the database.
FINDING_SECONDS = 60
#: After the bound, seconds between SIGINT and SIGKILL (``timeout -k``).
KILL_AFTER_SECONDS = 20

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")


@dataclasses.dataclass
class Target:
    """What HypoFuzz's database says about one fuzzed test."""

    nodeid: str
    valid: int
    failures: list[str]
    fatal: str | None


def _hypothesis_cli() -> list[str]:
    """The ``hypothesis`` command of this interpreter's environment (its console script, or the same entry point)."""
    script = Path(sys.executable).parent / "hypothesis"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from hypothesis.extra.cli import main; sys.exit(main())"]


def _read(database: Path) -> dict[str, Target]:
    """Per test nodeid: the most valid examples any of its reports counts, its failures' tracebacks, a fatal error."""
    db = HypofuzzDatabase(DirectoryBasedExampleDatabase(database))
    targets: dict[str, Target] = {}
    for key in set(db.fetch(test_keys_key)):
        reports = [r for r in db.reports.fetch(key) if r is not None]
        if not reports:
            continue
        failures = [str(observation.metadata.traceback)
                    for state in (FailureState.SHRUNK, FailureState.UNSHRUNK)
                    for choices in db.failures(state=state).fetch(key)
                    for observation in db.failure_observations(state=state).fetch_all(key, choices)]
        fatal = db.fatal_failures.fetch(key)
        valid = max(sum(count for status, count in r.status_counts.items() if status.name == "VALID")
                    for r in reports)
        targets[reports[0].nodeid] = Target(reports[0].nodeid, valid, failures,
                                            fatal.traceback if fatal is not None else None)
    return targets


def _fuzz(tmp_path: Path, test_file: str, seconds: int, *, stop_at_failure: bool = False) -> tuple[int, str]:
    """Run the documented command on ``test_file`` for at most ``seconds`` (or until a failure is saved)."""
    env = {**os.environ, "HYPOTHESIS_PROFILE": "hypofuzz", EXAMPLE_DATABASE_ENV: str(tmp_path / "examples")}
    command = ["timeout", "-s", "INT", "-k", str(KILL_AFTER_SECONDS), str(seconds), *_hypothesis_cli(), "fuzz",
               "-n", "2", "--no-dashboard", "--", test_file, "-p", "no:cacheprovider"]
    log = tmp_path / "hypofuzz.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                if stop_at_failure and any(t.failures for t in _read(tmp_path / "examples").values()):
                    os.killpg(proc.pid, signal.SIGINT)  # what timeout would send, earlier
                    break
            returncode = proc.wait(timeout=seconds + KILL_AFTER_SECONDS + 30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return returncode, log.read_text(errors="replace")


def test_testing_hypofuzz_fuzzes_the_project_machines_and_finds_nothing(tmp_path: Path) -> None:
    """docs/conformance.md's command on tests/test_testing_machine.py: both machines collected, examples fuzzed (in
    the database's reports), no failure and no fatal error; stopped by the time bound (exit 124, or killed after
    the grace period). A HypoFuzz process runs 100 inputs of one test before it picks again, so within the bound
    the two processes may both have picked the same machine, or one may have started just before the stop: at
    least one ran examples."""
    returncode, output = _fuzz(tmp_path, "tests/test_testing_machine.py", PASSING_SECONDS)
    assert "using 2 processes to fuzz 2 tests" in output, output[-3000:]
    # Stopped by the bound (SIGINT: 124), not by a crash or a finding. HypoFuzz itself sometimes does not exit
    # after the SIGINT (seen twice in 16 runs here, once with its file watcher's warning "Callback with id ...
    # already exists for watch"): ``timeout`` then kills the group after KILL_AFTER_SECONDS (-9: it killed itself
    # with it). That is the bound too; the database below still says whether anything failed.
    assert returncode in (124, -signal.SIGKILL), output[-3000:]
    targets = _read(tmp_path / "examples")
    print({nodeid: t.valid for nodeid, t in targets.items()})
    machines = {f"tests/test_testing_machine.py::TestReferenceWorker{policy}Policy::runTest"
                for policy in ("Quarantine", "Release")}
    assert targets and set(targets) <= machines, targets
    for target in targets.values():
        assert target.fatal is None or _stopped_by_the_bound(target.fatal), target.fatal
        assert not target.failures, target.failures[0]
    assert any(target.valid > 0 for target in targets.values()), targets


def _stopped_by_the_bound(fatal: str) -> bool:
    """Whether a fatal error HypoFuzz saved is its own reaction to the bound's SIGINT: the KeyboardInterrupt landed
    inside Hypothesis's drawing, and Hypothesis then failed to close its spans ("During handling of the above
    exception ... IndexError: pop from empty list", seen once in CI). Only the bound sends SIGINT, so a fatal error
    that arose while handling a KeyboardInterrupt is the stop, not a finding; any other fatal error still fails."""
    return "KeyboardInterrupt" in fatal and "During handling of the above exception" in fatal


@pytest.mark.rule("R5")
def test_testing_hypofuzz_finds_a_worker_reporting_failures_as_success(tmp_path: Path) -> None:
    """The same command on the kit's mutant (tests/_hypofuzz_wrong_worker.py): HypoFuzz saves the failure, the
    kit's R5 violation, to the database (the run is stopped once it is there)."""
    returncode, output = _fuzz(tmp_path, "tests/_hypofuzz_wrong_worker.py", FINDING_SECONDS, stop_at_failure=True)
    targets = _read(tmp_path / "examples")
    assert len(targets) == 1, (returncode, targets, output[-3000:])
    (target,) = targets.values()
    assert target.nodeid == "tests/_hypofuzz_wrong_worker.py::TestFailuresReportedAsSuccess::runTest", targets
    assert target.fatal is None, target.fatal
    assert target.failures, (returncode, output[-3000:])
    assert re.search(r"ConformanceError: (R\d+/)*R5\b", target.failures[0]), target.failures[0][-2000:]
