"""The ``kvoffload-ref`` command line: --version, each subcommand's --help, and the exit statuses of ``spec``,
``failure-modes`` and ``bench --check``."""

from __future__ import annotations

import pathlib

import pytest

import kvoffload_ref
from kvoffload_ref import cli

SUBCOMMANDS = {
    "demo": "Five acts on the simulated device",
    "diagram": "state machines",
    "spec": "every rule in docs/spec.md is cited by a test",
    "failure-modes": "Run every failure scenario",
    "bench": "baseline from the same run",
    "fuzz": "conformance state machine",
}


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvoffload-ref {kvoffload_ref.__version__}"


@pytest.mark.parametrize(("command", "says"), SUBCOMMANDS.items())
def test_cli_each_subcommand_help_says_what_it_does(command: str, says: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert says in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv", [["spec"], ["spec", "--write"], ["failure-modes", "--check"],
                                  ["failure-modes", "--write"]])
def test_cli_outside_a_source_checkout_exits_2_with_one_line(argv: list[str], tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*argv, "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a source checkout" in err


def _doc(met: bool | None) -> dict[str, object]:
    return {"results": [{"key": "planner_small", "met": None}, {"key": "planner_medium", "met": met}]}


@pytest.mark.parametrize(("met", "check", "status"), [(True, True, 0), (False, True, 1), (False, False, 0)])
def test_cli_bench_check_exits_1_when_a_goal_is_missed(met: bool, check: bool, status: int,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "run_bench", lambda *args, **kwargs: _doc(met))
    assert cli.main(["bench", "--quick", *(["--check"] if check else [])]) == status
    err = capsys.readouterr().err
    assert ("goals missed: planner_medium" in err) == (not met)


def test_cli_demo_explains_its_acts_and_lists_its_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    acts = [out.index(f"Act {n} -- ") for n in (1, 2, 3)]
    first_log = out.index("\n  [log ")
    assert acts == sorted(acts) and acts[1] < first_log
    assert "expected" in out[acts[1]:first_log]
    assert out.count("check ok: ") == 22 and "22 checks passed, 0 failed" in out
    assert "Act 5 -- the canonical layout (R24)" in out
    assert "modelled bandwidth" in out and "not a measurement" in out
