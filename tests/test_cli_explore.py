"""``kvoffload-ref explore`` output a person can act on, through the console script in a temporary directory:
failures grouped by (method, interruption, problem), each once with its count and one shortest reproduction
that reruns as printed; a worker that reports failed transfers as successes fails it (R5, R22)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

_TESTS = pathlib.Path(__file__).parent
_HEADER = re.compile(r"^(\[\S+\] .*)  (\S+) / (.+): (\d+) cases?$")


def _explore(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """The installed console script, with ``tests/`` on ``PYTHONPATH`` (for ``_wrong_workers``)."""
    env = {**os.environ, "PYTHONPATH": str(_TESTS)}
    script = str(pathlib.Path(sys.executable).parent / "kvoffload-ref")
    return subprocess.run([script, *argv], capture_output=True, text=True, timeout=120, check=False, cwd=cwd,
                          env=env)


def _groups(out: str) -> list[tuple[str, str, str, int, str, str]]:
    """(problem, method, how, count, shortest, reproduce) of each group printed."""
    lines = out.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m:
            shortest = lines[i + 1].split("shortest:", 1)[1].strip()
            again = lines[i + 2].split("reproduce:", 1)[1].strip()
            found.append((m[1], m[2], m[3], int(m[4]), shortest, again))
    return found


@pytest.mark.rule("R5")
@pytest.mark.rule("R14")
@pytest.mark.parametrize("pairs", [False, True], ids=["single", "pairs"])
def test_cli_explore_groups_a_dropped_result_once_each_with_a_reproduction_that_reruns(
        pairs: bool, tmp_path: pathlib.Path) -> None:
    """One dropped result (job 3) breaks R5 at every call point under every injection (or second thread): each
    (method, interruption, problem) is printed once, with its count, its case with the fewest backend calls
    before the point (#0) and one reproduction; the summary counts them; the reproduction, run as printed,
    finds a failure of that group again (exit 1)."""
    argv = ["explore", *(["--pairs"] if pairs else []), "--factory", "_wrong_workers:drops_a_result",
            "--config", "clean", "--method", "get_finished"]
    done = _explore(argv, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    groups = _groups(done.stdout)
    keys = [(p, m, h) for p, m, h, *_ in groups]
    assert len(keys) == len(set(keys)) == 7, keys  # 7 injections (or seconds), each once
    dropped = [g for g in groups if g[0].startswith("[R5/R8/R14] job # appears # times")]
    # Every interruption but handler_shutdown_exit (its handler's shutdown() lists job 3 in the report).
    assert len(dropped) == (7 if pairs else 6), groups
    assert all(g[3] == 4 and "backend call #0 " in g[4] and "job 3 appears 0 times" in g[4] for g in dropped)
    assert done.stdout.count("reproduce: ") == len(groups)
    summary = re.search(r"^get_finished\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", done.stdout, re.M)
    assert summary is not None and int(summary[4]) == len(groups), done.stdout
    assert int(summary[1]) == 28 and int(summary[2]) == (28 if pairs else 24), summary[0]
    problem, _, _, _, _, line = dropped[-1]
    assert shlex.split(line)[0] == "kvoffload-ref" and "--point 0" in line
    again = _explore(shlex.split(line)[1:], tmp_path)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-2000:]
    assert [g[0] for g in _groups(again.stdout)].count(problem) == 1, again.stdout
    assert "reproduce: " + line in again.stdout


@pytest.mark.rule("R5")
@pytest.mark.rule("R22")
@pytest.mark.parametrize(("factory", "problem"), [
    ("kvoffload_ref.testing.mutants:failures_reported_as_success",
     "[R5] job #'s completion failed on the device, yet it was reported success=True"),
    ("_wrong_workers:forgets_what_failures_poisoned",
     "[R22] failed store job # lists invalid_blocks [...], not its destination [...]"),
])
def test_cli_explore_fails_a_worker_that_hides_a_failed_transfer(factory: str, problem: str,
                                                                   tmp_path: pathlib.Path) -> None:
    """In a failed configuration the failing job is reported success=False (R5) listing its destination blocks
    (R22): a worker that reports it as a success, or forgets what it poisoned, fails ``explore`` with that
    grouped finding; kvoffload_ref's worker passes the same cases."""
    argv = ["explore", "--config", "failed", "--method", "get_finished"]
    done = _explore([*argv, "--factory", factory], tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"  {problem}: " in done.stdout, done.stdout
    assert {g[0] for g in _groups(done.stdout)} == {problem}
    assert _explore(argv, tmp_path).returncode == 0
