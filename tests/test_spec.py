"""docs/spec.md cites a test for every rule, no test cites an unknown rule, and generated docs are current."""

from __future__ import annotations

import pathlib

from kvoffload_ref import lifecycle
from kvoffload_ref.cli import main
from kvoffload_ref.docgen import diagram, spec

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_spec_every_rule_has_a_test_and_generated_docs_are_current() -> None:
    assert spec.check(ROOT) == []


def test_spec_covers_r1_to_r21_and_on_in_order() -> None:
    """R1-R21 all, then the later rules built so far, in increasing order (a rule is stated once it is built)."""
    rules = spec.rules_in_spec((ROOT / "docs" / "spec.md").read_text())
    numbers = [int(rule[1:]) for rule in rules]
    assert numbers[:21] == list(range(1, 22)) and numbers == sorted(set(numbers)), rules


def test_spec_check_reports_unknown_rules_and_missing_tests(tmp_path: pathlib.Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs" / "spec.md").write_text("## R1 — x\n\n<!-- tests:R1 -->\n<!-- /tests -->\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.rule('R99')\ndef test_x():\n    pass\n")
    problems = spec.check(tmp_path)
    assert "R1 has no test citing it" in problems
    assert "test_x.py::test_x cites R99, which docs/spec.md does not define" in problems
    assert any("lifecycle.md" in p for p in problems)


def test_spec_cli_check_exit_status() -> None:
    assert main(["spec", "--check", "--root", str(ROOT)]) == 0


def test_spec_diagram_lists_every_legal_transition() -> None:
    text = diagram.render_machine("worker")
    assert text.startswith("stateDiagram-v2\n")
    assert "OPEN --> SHUTTING_DOWN: SHUTDOWN / RUN_SHUTDOWN" in text
    assert "SHUTTING_DOWN --> CLOSED: SHUTDOWN_COMPLETE, INTERRUPTED" in text
    for name in lifecycle.MACHINES:
        assert f"### {name}" in diagram.render()
