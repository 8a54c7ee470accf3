"""The explorers' findings, grouped so a person can act on them (R5, R14, R19).

One wrong behaviour usually breaks a rule at many call points: a dropped result fails every case that reaches
it, in every configuration and under every injection. :func:`group` folds the failures by (method, how it was
interrupted, problem) -- the problem is the rules' tags and the message with its numbers (job ids, blocks, call
points) left out -- and keeps, for each group, its shortest reproducing case: the one with the fewest backend calls
before the interruption point (the first such one found). :func:`render` prints a summary per method, a line per
distinct problem, and each group once, with its count and that case's rerun command. Both explorers
(``explorer.py``, ``pairs.py``) print through it; ``kvoffload-ref explore`` is the command.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from kvoffload_ref.testing.scenario import Failure

__all__ = ["Group", "group", "problem_of", "render", "summary"]

_LIST: Final = re.compile(r"\[[^\[\]]*\]")
_NUMBER: Final = re.compile(r"\d+")


def _many(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def problem_of(failure: Failure[Any]) -> str:
    """The failure's rules and message, its numbers and lists left out: what two cases share when they broke a
    rule the same way at different call points, jobs or blocks."""
    return f"[{failure.rules}] " + _NUMBER.sub("#", _LIST.sub("[...]", failure.message))


@dataclasses.dataclass
class Group:
    """The failures of one (method, interruption, problem)."""

    method: str
    how: str
    problem: str
    # Invariant: the failing case with the fewest backend calls before its point (the first such one seen).
    shortest: Failure[Any]
    # Invariant: the distinct cases in this group (a case that broke the rule twice counts once).
    cases: set[object] = dataclasses.field(default_factory=set)
    findings: int = 0

    def __str__(self) -> str:
        return (f"{self.problem}  {self.method} / {self.how}: {_many(len(self.cases), 'case')}\n"
                f"    shortest:  {self.shortest.case.describe()}: {self.shortest.message}\n"
                f"    reproduce: {self.shortest.case.reproduction(self.shortest.factory)}")


def group(failures: Iterable[Failure[Any]]) -> list[Group]:
    """Fold failures by (method, interruption, problem), in the order each group was first seen.

    Args:
        failures: an explorer's failures (of either explorer).

    Returns:
        One group per (method, interruption, problem), each with its count and shortest reproducing case.
    """
    groups: dict[tuple[str, str, str], Group] = {}
    for failure in failures:
        method, how = failure.case.kind()
        key = (method, how, problem_of(failure))
        found = groups.get(key)
        if found is None:
            found = groups[key] = Group(method, how, key[2], failure)
        elif failure.case.point < found.shortest.case.point:
            found.shortest = failure
        found.cases.add(failure.case)
        found.findings += 1
    return list(groups.values())


def summary(cases: Mapping[str, int], failures: Sequence[Failure[Any]], order: Sequence[str]) -> str:
    """Per method: the cases run, how many failed, the findings and the groups they fold into.

    Args:
        cases: method -> cases run. failures: every failure found. order: the methods' reporting order.

    Returns:
        The table, one row per method that ran, then the totals.
    """
    methods = [m for m in order if m in cases]
    width = max((len(m) for m in methods), default=6)
    head = f"{'method':<{width}}  {'cases':>7}  {'failing':>7}  {'findings':>8}  {'groups':>6}"
    lines = [head]
    for m in [*methods, "total"]:
        mine = [f for f in failures if m in ("total", f.case.method)]
        ran = sum(cases.values()) if m == "total" else cases[m]
        lines.append(f"{m:<{width}}  {ran:>7}  {len({f.case for f in mine}):>7}  {len(mine):>8}  "
                     f"{len(group(mine)):>6}")
    return "\n".join(lines)


def render(cases: Mapping[str, int], failures: Sequence[Failure[Any]], order: Sequence[str], show: int) -> str:
    """The summary, then the first ``show`` groups, each once with its count and one rerun command.

    Args:
        cases: method -> cases run. failures: every failure found. order: the methods' reporting order.
        show: how many groups to print in full.

    Returns:
        The text to print.
    """
    groups = group(failures)
    lines = [summary(cases, failures, order)]
    problems: dict[str, list[Group]] = {}
    for g in groups:
        problems.setdefault(g.problem, []).append(g)
    if problems:
        lines.append(f"{_many(len(problems), 'distinct problem')}:")
        lines.extend(f"  {p}: {sum(len(g.cases) for g in gs)} cases in {_many(len(gs), 'group')}"
                     for p, gs in problems.items())
    if groups:
        lines.append(f"{_many(len(groups), 'group')} (by method, interruption and problem; the reproduction is the "
                     "case with the fewest backend calls before its point):")
        lines.extend(str(g) for g in groups[:show])
    if len(groups) > show:
        lines.append(f"... and {_many(len(groups) - show, 'more group')} (--show N prints more)")
    return "\n".join(lines)
