"""Each check whose reproduction once ended in an unconditional ``raise AssertionError`` now closes it in the
script's own terms: a wrong worker's printed reproduction fails under ``python`` and ``pytest``, and the same
steps on kvoffload_ref's worker pass under ``python`` (exit 0; a passing reproduction passes under pytest too:
``test_testing_reproduction.py``). The wrong workers live in ``tests/_repro_workers.py`` and
``tests/_wrong_workers.py``. Each script is found once (``_script``, cached); the subprocess runs are the file's
cost, so the twelve pytest runs are one (a file per script, each file's outcome read from its junit report) and the
python runs go side by side."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvoffload_ref.faults import Fault
from kvoffload_ref.testing import WorkerFactory, make_machine, mutants, setups
from kvoffload_ref.testing.reproduction import NO_SCRIPT_FORM
from kvoffload_ref.testing.settings import bounded_shrinking, kit_settings

TESTS = pathlib.Path(__file__).parent
sys.path.insert(0, str(TESTS))
import _repro_workers as wrong  # noqa: E402
import _wrong_workers  # noqa: E402

FAILING_JOB_1 = (Fault("event_query", "error", job_id=1),)


def _found(factory: WorkerFactory, plans: tuple[Fault, ...] | None, examples: int = 300) -> str:
    """The reproduction the kit prints for ``factory`` (the run must fail)."""
    chosen = setups(plans=st.just(plans)) if plans is not None else setups()
    machine = make_machine(factory, name="Wrong", setup_strategy=chosen)
    machine.shrink_seconds = 2.0
    with pytest.raises(AssertionError), bounded_shrinking(2.0):
        run_state_machine_as_test(machine, settings=kit_settings(examples, derandomize=True))
    return machine.last_reproduction


CASES: dict[str, tuple[Callable[..., object], tuple[Fault, ...] | None, tuple[str, ...]]] = {
    # check: (wrong worker, the setups' faults (None: drawn), what the closing assertion reads: one of these, as
    # shrinking, cut short by time, may end at another check the same bug breaks)
    "R4/R5 bytes": (wrong.corrupts_cpu_bytes, (), ("int(w.cpu_snapshot()[",)),
    "R4/R20 races": (mutants.order_after_ignored, (), ("dev.races() ==",)),
    "R27 held": (wrong.forgets_holds, FAILING_JOB_1, ("w.held()",)),
    "R11 bound": (wrong.overstays_shutdown, (), ("dev.clock() - start <=",)),
    "R13 proof": (wrong.proves_needlessly, (), ("report.device_sync == 'not_needed'",)),
    "R7 refused": (wrong.accepts_invalid, (), ("raised is not None",)),
    "R22 poisoned": (mutants.poisons_source_blocks, FAILING_JOB_1, ("r.invalid_blocks",)),
    "R6/R11 wait": (wrong.overstays_wait, (), ("dev.clock() - start <=",)),
    "R3 misuse": (wrong.misuses_the_device, (), ("dev.violations() == []",)),
    "R26 expiry": (wrong.misnames_expiries, None, ("<= {'deadline', 'cancel', 'behind'}",)),
    "R10 drained": (wrong.overcounts_drains, (), ("report.store.drained",)),
    # job 3 never handed out: the accounting (R10/R14/R22), or a wait() that returned for it first (R6)
    "R10/R14/R22 accounted": (_wrong_workers.drops_a_result, (), ("handed + ", "{r.job_id for r in results}")),
}


CHECKS = sorted(CASES)


@functools.cache
def _script(check: str) -> str:
    factory, plans, _ = CASES[check]
    return _found(factory, plans)  # type: ignore[arg-type]


def _fixed(check: str) -> str:
    name = CASES[check][0].__name__
    return _script(check).replace(f"w = {name}(", "w = reference_factory(")  # (pytest: see the module)


def _run(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, check=False,
                          cwd=cwd, env=env)


@pytest.mark.rule("R3", "R4", "R5", "R6", "R7", "R10", "R11", "R13", "R14", "R20", "R22", "R26", "R27")
@pytest.mark.parametrize("check", CHECKS)
def test_testing_reproduction_closes_in_the_check_on_the_wrong_worker(check: str) -> None:
    """The script reads the check and runs the wrong worker (its runs: the test below)."""
    script = _script(check)
    _, _, reads = CASES[check]
    name = CASES[check][0].__name__
    closing = script.split("the rule the run violated", 1)[1]
    assert NO_SCRIPT_FORM not in script and any(expression in closing for expression in reads), script[-1500:]
    assert f"w = {name}(" in script


@pytest.mark.rule("R3", "R4", "R5", "R6", "R7", "R10", "R11", "R13", "R14", "R20", "R22", "R26", "R27")
def test_testing_reproductions_fail_under_python_and_pytest_and_pass_once_fixed(tmp_path: pathlib.Path) -> None:
    wrong_files = {check: tmp_path / f"test_repro_{i}.py" for i, check in enumerate(CHECKS)}
    fixed_files = {check: tmp_path / f"fixed_{i}.py" for i, check in enumerate(CHECKS)}
    for check in CHECKS:
        wrong_files[check].write_text(_script(check))
        fixed_files[check].write_text(_fixed(check))
    junit = tmp_path / "junit.xml"
    pytest_run = ("-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                  *(str(wrong_files[check]) for check in CHECKS))
    runs = [pytest_run, *((str(path),) for path in (*wrong_files.values(), *fixed_files.values()))]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done_pytest, *done_python = pool.map(lambda args: _run(tmp_path, *args), runs)
    done_wrong = dict(zip(CHECKS, done_python[:len(CHECKS)], strict=True))
    done_fixed = dict(zip(CHECKS, done_python[len(CHECKS):], strict=True))
    failures = {case.get("classname"): "".join(failure.itertext()) + (failure.get("message") or "")
                for case in ET.parse(junit).iter("testcase") for failure in case.iter("failure")}
    assert done_pytest.returncode != 0, (done_pytest.stdout[-2000:], done_pytest.stderr[-2000:])
    for check in CHECKS:
        done = done_wrong[check]
        assert done.returncode != 0 and "AssertionError" in done.stdout + done.stderr, (check, done.stdout[-2000:],
                                                                                     done.stderr[-2000:])
        assert "AssertionError" in failures.get(wrong_files[check].stem, ""), (check, done_pytest.stdout[-2000:])
        done = done_fixed[check]
        assert done.returncode == 0, (check, _fixed(check), done.stdout[-2000:], done.stderr[-2000:])
