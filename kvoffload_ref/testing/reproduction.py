"""A failing run's reproduction as a test: a Python file that runs the steps and asserts the violated rule.

The machine notes each step as a line of Python (:meth:`~kvoffload_ref.testing.machine_base.MachineBase._say`);
when a check fails, :func:`as_test` wraps the lines in ``def test_reproduction()`` (so ``pytest FILE`` collects it)
ending in the check as an ``assert`` of what the rule requires, and a ``__main__`` guard that calls it (so ``python
FILE`` exits non-zero while the rule is violated, 0 once it holds). Each check says itself over the script's names
(``w``, ``dev``, ``results``, ``report``, ``handed``, ``raised``, ``start``...: the lines the check needs are in the
steps); only those a thread interleaving alone can break (:mod:`~kvoffload_ref.testing.concurrent_rules`: the script
runs the threads' calls one after the other) have no Python form: the test ends in a ``raise AssertionError``
stating what the kit found there (it fails until the kit's own run passes).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Final, TextIO

__all__ = ["NO_SCRIPT_FORM", "REPRODUCTION_HEADING", "as_test", "report_once"]

#: The comment on the closing line of a check with no Python form.
NO_SCRIPT_FORM: Final = "# the kit's check (no Python form) failed here: rerun the kit to confirm a fix"
_HEADER_START: Final = "import "
#: The line above a reproduction in a failure's report.
REPRODUCTION_HEADING: Final = "# Reproduction (runnable Python, a test):"
#: The start of Hypothesis's own replay line (``print_blob``): kept beside the reproduction.
_BLOB_START: Final = "You can reproduce this test case by temporarily adding @reproduce_failure"


def set_literal(values: Iterable[object]) -> str:
    """A set as a Python literal for a reproduction's assertion (sorted; ``set()`` when empty)."""
    items = sorted(values)  # type: ignore[type-var]  # ids, labels, pairs: sortable
    return "{" + ", ".join(map(repr, items)) + "}" if items else "set()"


def as_test(lines: Sequence[str], rules: str, message: str, asserts: str | None) -> str:
    """The reproduction file: imports, ``def test_reproduction()`` with the steps and the check, a main guard.

    Args:
        lines: the run's steps as Python (the first may be the imports, each entry one or more lines).
        rules: the violated rules' ids (e.g. "R5").
        message: what the check found.
        asserts: the check as a Python expression over the steps' names (true when the rule holds), or None.

    Returns:
        The file's text.
    """
    header = [lines[0]] if lines and lines[0].startswith(_HEADER_START) else []
    steps = list(lines[len(header):])
    verdict = repr(f"{rules}: {message}")
    final = f"assert {asserts}, {verdict}" if asserts else f"raise AssertionError({verdict})  {NO_SCRIPT_FORM}"
    body = textwrap.indent("\n".join([*steps, f"# {rules}: the rule the run violated", final]), "    ")
    doc = f'"""Reproduction of a conformance failure ({rules}): run it with python or pytest."""'
    return "\n".join([doc, *header, "", "", "def test_reproduction() -> None:", body, "", "",
                      'if __name__ == "__main__":', "    test_reproduction()", ""])


def report_once(exc: BaseException, reproduction: str, logs: str, out: TextIO | None = None) -> None:
    """Print a failure's report once -- the reproduction, the library's last log lines, Hypothesis's replay line --
    and take the notes off the failure.

    Hypothesis notes its own copy of the steps (its ``Failing test case`` and each rule call) beside the kit's;
    the reproduction already holds every step, runnable. A note would be printed twice by pytest where it does
    not shorten its summary (on CI, or with ``-vv``: the summary line holds the whole exception, notes included),
    so the report is printed instead (pytest shows it once, under "Captured stdout call") and the failure keeps
    only its one-line message. Hypothesis's replay line (``@reproduce_failure``, with ``print_blob``) is kept: it
    replays the kit's run itself, model included, which the reproduction does not.

    Args:
        exc: the failure Hypothesis raised (its ``__notes__`` are removed).
        reproduction: the failing run's reproduction (:func:`as_test`; "" when no run failed a check).
        logs: the library's last log lines of that run ("" for none).
        out: where to print (default: ``sys.stdout`` at call time).
    """
    kept = [note.strip() for note in getattr(exc, "__notes__", ()) if note.strip().startswith(_BLOB_START)]
    report = ([f"{REPRODUCTION_HEADING}\n{reproduction}"] if reproduction else []) + ([logs] if logs else []) + kept
    if hasattr(exc, "__notes__"):
        del exc.__notes__
    stream = out if out is not None else sys.stdout
    stream.write("\n".join(report) + "\n")
    stream.flush()
