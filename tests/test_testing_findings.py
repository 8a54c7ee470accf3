"""The explorers' findings grouped (kvoffload_ref.testing.findings): by (method, interruption, problem), each with
its count of distinct cases and its case with the fewest backend calls before the point."""

from __future__ import annotations

import pytest

from kvoffload_ref.testing.findings import group, problem_of, render
from kvoffload_ref.testing.pairs import PairCase
from kvoffload_ref.testing.scenario import Case, Failure

_LOST = "job {} appears 0 times across get_finished() and the report (results {}, report [])"


def _lost(point: int, job: int = 3, results: str = "[1, 2]", injection: str = "SIGINT",
          method: str = "wait") -> Failure[Case]:
    return Failure(Case("clean", method, point, injection), "R5/R8/R14", _LOST.format(job, results))


@pytest.mark.rule("R14")
def test_findings_group_by_method_interruption_and_problem_keeping_the_shortest_case() -> None:
    failures = [_lost(5), _lost(2, job=4, results="[1]"), _lost(2), _lost(7), _lost(2, injection="double"),
                _lost(0, method="get_finished"),
                Failure(Case("hung", "wait", 1, "SIGINT"), "R12", "the region was released with device_sync='x'")]
    groups = group(failures)
    assert [(g.method, g.how, g.problem.split("]")[0] + "]") for g in groups] == [
        ("wait", "SIGINT", "[R5/R8/R14]"), ("wait", "double", "[R5/R8/R14]"),
        ("get_finished", "SIGINT", "[R5/R8/R14]"), ("wait", "SIGINT", "[R12]")]
    lost = groups[0]
    assert lost.problem == problem_of(failures[0]) == problem_of(failures[1])  # job ids and lists left out
    assert (len(lost.cases), lost.findings) == (3, 4)  # point 2 broke it twice: one case, two findings
    assert lost.shortest is failures[1]  # the fewest calls before the point; the first such one
    assert "  wait / SIGINT: 3 cases\n" in str(lost)  # the distinct cases, not the findings
    assert "--point 2 " in str(lost) and str(lost).count("reproduce: ") == 1


@pytest.mark.rule("R19")
def test_findings_group_pairs_by_the_second_thread() -> None:
    def pair(second: str, point: int) -> Failure[PairCase]:
        return Failure(PairCase("clean", "wait", second, point), "R19", f"B {second} blocked at {point}")
    groups = group([pair("cancel", 3), pair("shutdown", 2), pair("cancel", 1)])
    assert [(g.how, len(g.cases), g.shortest.case.point) for g in groups] == [("while cancel", 2, 1),
                                                                              ("while shutdown", 1, 2)]
    assert "--pairs" in str(groups[0]) and "--second cancel --point 1" in str(groups[0])


@pytest.mark.rule("R14")
def test_findings_render_summarises_per_method_then_each_group_once() -> None:
    failures = [_lost(p) for p in (3, 1, 2)] + [_lost(0, method="get_finished")]
    text = render({"get_finished": 10, "wait": 20, "shutdown": 5}, failures, ("get_finished", "wait", "shutdown"),
                  show=1)
    rows = [line.split() for line in text.splitlines()[1:5]]
    assert rows == [["get_finished", "10", "1", "1", "1"], ["wait", "20", "3", "3", "1"],
                    ["shutdown", "5", "0", "0", "0"], ["total", "35", "4", "4", "2"]]
    assert "1 distinct problem:" in text and ": 4 cases in 2 groups" in text
    assert text.count("reproduce: ") == 1 and "... and 1 more group (--show N" in text
    assert render({"wait": 3}, [], ("wait",), show=5).splitlines()[-1].split() == ["total", "3", "0", "0", "0"]
