"""Each check whose reproduction once ended in an unconditional ``raise AssertionError`` now closes it in the
script's own terms: a wrong worker's printed reproduction fails under ``python`` and ``pytest``, and the same
steps on kvoffload_ref's worker pass under ``python`` (exit 0; a passing reproduction passes under pytest too:
``test_testing_reproduction.py``). The wrong workers live in ``tests/_repro_workers.py`` and
``tests/_wrong_workers.py``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

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


def _exit(tmp_path: pathlib.Path, text: str, *runner: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "test_repro.py"
    path.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, *runner, str(path)], capture_output=True, text=True, timeout=120,
                          check=False, cwd=tmp_path, env=env)


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


@pytest.mark.rule("R3", "R4", "R5", "R6", "R7", "R10", "R11", "R13", "R14", "R20", "R22", "R26", "R27")
@pytest.mark.parametrize("check", sorted(CASES))
def test_testing_reproduction_asserts_the_check_and_passes_once_fixed(tmp_path: pathlib.Path, check: str) -> None:
    factory, plans, reads = CASES[check]
    script = _found(factory, plans)  # type: ignore[arg-type]
    name = factory.__name__
    closing = script.split("the rule the run violated", 1)[1]
    assert NO_SCRIPT_FORM not in script and any(expression in closing for expression in reads), script[-1500:]
    assert f"w = {name}(" in script
    for runner in ((), ("-m", "pytest", "-q", "-p", "no:cacheprovider")):
        done = _exit(tmp_path, script, *runner)
        assert done.returncode != 0 and "AssertionError" in done.stdout + done.stderr, (runner, done.stdout[-2000:],
                                                                                     done.stderr[-2000:])
    done = _exit(tmp_path, script.replace(f"w = {name}(", "w = reference_factory("))  # (pytest: see the module)
    assert done.returncode == 0, (script, done.stdout[-2000:], done.stderr[-2000:])
