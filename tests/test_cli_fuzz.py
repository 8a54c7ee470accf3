"""``kvoffload-ref fuzz``: exit 0 (no violation), 1 (a violation, shrunk, with a runnable reproduction), 2 (bad
usage), and the one-line hint when Hypothesis is missing. Kept fast: tiny step counts, a mutant found quickly."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from kvoffload_ref import cli
from kvoffload_ref.cli import main
from kvoffload_ref.testing.adapter import Capabilities
from kvoffload_ref.testing.campaign import REPRO_BEGIN, REPRO_END
from kvoffload_ref.testing.logtail import KEEP

MUTANT = "kvoffload_ref.testing.mutants:failures_reported_as_success"
HINT = 'pip install "hypothesis>=6.100"'


@pytest.mark.parametrize("argv", [
    ["--steps", "0"], ["--steps", "-5"], ["--seconds", "0"], ["--jobs", "0"],
    ["--steps", "10", "--seconds", "1"], ["--without", "nonsense"],
])
def test_cli_fuzz_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fuzz", *argv])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("factory", ["no_such_module_here:factory", "kvoffload_ref.testing.mutants:nope",
                                     "kvoffload_ref.testing.mutants", "kvoffload_ref.testing.mutants:__doc__"])
def test_cli_fuzz_unimportable_factory_exits_2_with_one_line(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--factory", factory, "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload-ref fuzz: --factory")


@pytest.mark.parametrize("body", ["raise RuntimeError('boom')", "raise ValueError('bad\\nconfig')",
                                  "def __getattr__(name):\n    raise RuntimeError('boom')"])
def test_cli_fuzz_factory_whose_module_raises_exits_2_with_one_line(
        body: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A module that raises something other than ImportError while imported (or while its factory is looked up)
    is a bad factory (2), not a violation found (1), and is reported in one line, not with a traceback."""
    module = f"kvref_raising_factory_{abs(hash(body))}"
    (tmp_path / f"{module}.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["fuzz", "--factory", f"{module}:make_worker", "--steps", "10"]) == 2
    finally:
        sys.modules.pop(module, None)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvoffload-ref fuzz: --factory '{module}:make_worker'")
    assert "RuntimeError: boom" in err or "ValueError: bad config" in err
    assert "Traceback" not in err


@pytest.mark.rule("R5")
def test_cli_fuzz_reference_worker_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--steps", "100", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "fuzz: factory reference_factory" in out and "fuzz: OK:" in out


def _fuzz(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvoffload_ref fuzz ARGV`` in a fresh interpreter, as a user runs it (what a seed finds can
    depend on the process's history)."""
    return subprocess.run([sys.executable, "-m", "kvoffload_ref", "fuzz", *argv], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def wrong_run() -> subprocess.CompletedProcess[str]:
    """The wrong worker fuzzed until it fails (R5), its shrink cut short."""
    return _fuzz("--factory", MUTANT, "--steps", "1500", "--seed", "2", "--shrink-seconds", "1")


def _reproduction(out: str) -> str:
    return out.split(REPRO_BEGIN + "\n", 1)[1].split(REPRO_END, 1)[0]


def _library_lines(text: str) -> list[str]:
    """The lines of ``text`` the library logged (as the kit keeps them, or as Python's last-resort handler prints
    them: the finalizer's and the shutdown's warnings, which every failing run here logs)."""
    logged = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) kvoffload_ref\.")
    return [line for line in text.splitlines()
            if logged.search(line) or "from its finalizer" in line or "could not be proven idle" in line]


@pytest.mark.rule("R5")
def test_cli_fuzz_wrong_worker_exits_1_with_a_reproduction_that_is_a_test(
        wrong_run: subprocess.CompletedProcess[str], tmp_path: pathlib.Path) -> None:
    """The printed reproduction, saved as is: ``python`` exits 1 on the rule's assertion and ``pytest`` fails it;
    with the wrong worker swapped for kvoffload_ref's own (the bug fixed), both pass."""
    assert wrong_run.returncode == 1, wrong_run.stdout + wrong_run.stderr
    out = wrong_run.stdout
    assert "fuzz: FAILED (seed 2) at step " in out and "R5: job" in out
    script = _reproduction(out)
    assert "from kvoffload_ref.testing.mutants import failures_reported_as_success" in script
    path = tmp_path / "repro.py"
    path.write_text(script)
    fixed = tmp_path / "fixed.py"
    fixed.write_text(script.replace("w = failures_reported_as_success(", "w = reference_factory("))

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, check=False,
                              cwd=tmp_path)

    under_pytest = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
    done = run(str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "success=True" in done.stdout and "AssertionError: R5: job" in done.stderr
    tested = run(*under_pytest, str(path))
    assert tested.returncode == 1 and "1 failed" in tested.stdout, tested.stdout[-2000:]
    done = run(str(fixed))
    assert done.returncode == 0, done.stdout + done.stderr
    tested = run(*under_pytest, str(fixed))
    assert tested.returncode == 0 and "1 passed" in tested.stdout, tested.stdout[-2000:]


def test_cli_fuzz_prints_the_reproduction_once(wrong_run: subprocess.CompletedProcess[str]) -> None:
    """The kit's reproduction only: not Hypothesis's "Failing test case" copy of the steps, nor the kit's note."""
    text = wrong_run.stdout + wrong_run.stderr
    assert text.count("w = failures_reported_as_success(dev.backend, dev.gpu, setup)") >= 1
    assert text.count("def test_reproduction() -> None:") == 1
    assert "Failing test case" not in text and "state.get_finished()" not in text


@pytest.fixture(scope="module")
def unshrunk_run() -> subprocess.CompletedProcess[str]:
    """The wrong worker fuzzed until it fails (R5), the failure reported as found (``--shrink-seconds 0``: what a
    shrink keeps depends on how much real time it got, so the run is not shrunk here and is the same every time;
    seed 1's failing run ends in a hang, whose shutdown logs its quarantine)."""
    return _fuzz("--factory", MUTANT, "--steps", "1500", "--seed", "1", "--shrink-seconds", "0")


def test_cli_fuzz_failing_run_prints_at_most_the_kept_log_lines(
        unshrunk_run: subprocess.CompletedProcess[str]) -> None:
    """The library's lines are kept off the output while fuzzing; a failure prints the last KEEP, once, before
    the reproduction (under a header saying how many were logged)."""
    out = unshrunk_run.stdout
    assert unshrunk_run.returncode == 1 and "the library logged " in out
    kept = _library_lines(out)
    assert 0 < len(kept) <= KEEP and all(line.startswith("#   ") for line in kept)
    assert out.index("the library logged ") < out.index(REPRO_BEGIN)
    assert _library_lines(unshrunk_run.stderr) == []


def test_cli_fuzz_without_shrinking_says_so(unshrunk_run: subprocess.CompletedProcess[str]) -> None:
    """``--shrink-seconds 0`` reports the failure as found, and its lines say it is not shrinking."""
    lines = unshrunk_run.stdout.splitlines()
    assert any(line.startswith("fuzz: FAILED") and "(reported as found, not shrunk)" in line for line in lines)
    progress = [line for line in lines if line.startswith("fuzz: steps ") and "(first at step " in line]
    assert progress and all("; not shrinking)" in line for line in progress)


def test_cli_fuzz_passing_run_prints_no_log_lines() -> None:
    """A passing campaign prints none of the library's lines; ``--verbose`` shows them (so the fuzzed steps do
    log, and the first assertion can fail)."""
    quiet = _fuzz("--steps", "300", "--seed", "5")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert _library_lines(quiet.stdout + quiet.stderr) == []
    verbose = _fuzz("--steps", "300", "--seed", "5", "--verbose")
    assert verbose.returncode == 0 and _library_lines(verbose.stdout + verbose.stderr) != []


def test_cli_fuzz_progress_after_the_violation_says_shrinking(wrong_run: subprocess.CompletedProcess[str]) -> None:
    """A progress line is printed when the first violation is found (not after the shrink), naming its step."""
    lines = wrong_run.stdout.splitlines()
    failed = next(i for i, line in enumerate(lines) if line.startswith("fuzz: FAILED"))
    step = lines[failed].split(" at step ", 1)[1].split(" ", 1)[0]
    progress = [line for line in lines[:failed] if line.startswith("fuzz: steps ")]
    assert progress and f"(first at step {step}; shrinking)" in progress[0]
    assert all(" violations 0 " not in line for line in progress)
    assert int(progress[0].split("fuzz: steps ", 1)[1].split("/", 1)[0]) == int(step)


@pytest.mark.rule("R5")
def test_cli_fuzz_jobs_report_the_first_failure_with_its_seed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--factory", MUTANT, "--jobs", "2", "--steps", "3000", "--seed", "2",
                 "--shrink-seconds", "1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("fuzz: 2 jobs, campaign seed 2 (job seeds 2, ")
    assert "failed, seed " in out and "repeat it alone: kvoffload-ref fuzz --factory " + MUTANT in out
    assert REPRO_BEGIN in out


def test_cli_fuzz_without_hypothesis_says_how_to_install_it() -> None:
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "from kvoffload_ref.cli import main\n"
            "sys.exit(main(['fuzz', '--steps', '10']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and HINT in done.stderr and "Traceback" not in done.stderr


def test_cli_fuzz_without_offers_every_capability_of_the_kit() -> None:
    kit = tuple(f.name for f in dataclasses.fields(Capabilities))
    assert kit == cli.CAPABILITIES


def _console_script() -> str:
    """The installed ``kvoffload-ref`` console script (its ``sys.path[0]`` is its own directory, not the cwd)."""
    return str(pathlib.Path(sys.executable).parent / "kvoffload-ref")


_USER_MODULE = '''\
from kvoffload_ref.testing import adapter, mutants


def make_worker(backend, gpu, setup):
    return adapter.reference_worker_factory(backend, gpu, setup)


def make_wrong_worker(backend, gpu, setup):
    return mutants.interrupts_swallowed(backend, gpu, setup)
'''


@pytest.mark.rule("R5")
def test_cli_factory_is_imported_from_the_current_directory(tmp_path: pathlib.Path) -> None:
    """``--factory mymod:make_worker`` finds ``./mymod.py`` as ``python -m`` would, with no ``PYTHONPATH``, for
    ``fuzz`` (in-process and ``--jobs``) and ``explore``."""
    (tmp_path / "kvref_user_mod.py").write_text(_USER_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for argv in (["fuzz", "--factory", "kvref_user_mod:make_worker", "--steps", "30"],
                 ["fuzz", "--factory", "kvref_user_mod:make_worker", "--steps", "20", "--jobs", "2"],
                 ["explore", "--factory", "kvref_user_mod:make_worker", "--method", "get_finished"]):
        done = subprocess.run([_console_script(), *argv], capture_output=True, text=True, timeout=120,
                              check=False, cwd=tmp_path, env=env)
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])


@pytest.mark.rule("R14")
def test_cli_explore_reproduce_lines_run_as_printed_from_the_factory_directory(tmp_path: pathlib.Path) -> None:
    """The ``reproduce:`` line ``explore`` prints for a user's wrong worker reruns that case, as printed, from the
    directory it was printed in: it finds the violation again (exit 1), not a bad factory (exit 2)."""
    (tmp_path / "kvref_user_mod.py").write_text(_USER_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([_console_script(), "explore", "--factory", "kvref_user_mod:make_wrong_worker",
                           "--method", "submit_store", "--config", "clean"], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    line = next(ln for ln in done.stdout.splitlines() if "reproduce: " in ln).split("reproduce: ", 1)[1]
    assert line.startswith("kvoffload-ref explore --factory kvref_user_mod:make_wrong_worker ")
    again = subprocess.run([_console_script(), *shlex.split(line)[1:]], capture_output=True, text=True, timeout=120,
                           check=False, cwd=tmp_path, env=env)
    assert again.returncode == 1, again.stdout[-2000:] + again.stderr[-2000:]
    assert "reproduce: " + line in again.stdout


@pytest.mark.parametrize(("text", "seconds"), [("0", 0.0), ("0.00", 0.0), ("0e0", 0.0), ("-0", 0.0), ("2.5", 2.5)])
def test_cli_fuzz_shrink_seconds_takes_zero_in_any_spelling(text: str, seconds: float) -> None:
    assert cli._parser().parse_args(["fuzz", "--shrink-seconds", text]).shrink_seconds == seconds


@pytest.mark.parametrize("text", ["-1", "soon", "nan"])
def test_cli_fuzz_shrink_seconds_refuses_a_negative_or_non_number(text: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli._parser().parse_args(["fuzz", "--shrink-seconds", text])
    assert exit_.value.code == 2 and "--shrink-seconds" in capsys.readouterr().err
