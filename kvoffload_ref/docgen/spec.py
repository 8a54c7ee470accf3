"""Keep docs/spec.md and the generated docs honest: rule -> tests traceability and the lifecycle diagram.

``docs/spec.md`` states each rule under a ``## Rn`` heading. Below each rule, between
``<!-- tests:Rn -->`` and ``<!-- /tests -->``, sits the list of tests that cite it, found from the
``@pytest.mark.rule("Rn")`` markers on test functions and ``Test*`` classes in ``tests/`` (by reading the source,
not by importing it). ``check`` fails when
a rule has no test, a test cites a rule the spec does not have, or a list (or ``docs/lifecycle.md``, generated
from ``lifecycle.py``) is out of date; ``write`` regenerates them.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterator

from kvoffload_ref.docgen import diagram

__all__ = ["check", "rule_citations", "rules_in_spec", "write"]

_RULE_HEADING = re.compile(r"^## (R\d+)\b", re.M)
_BLOCK = re.compile(r"<!-- tests:(R\d+) -->\n.*?<!-- /tests -->", re.S)
_DIAGRAM_HEADER = "# Lifecycle diagrams\n\nGenerated from `kvoffload_ref/lifecycle.py` by `kvoffload-ref diagram`; " \
                  "do not edit by hand.\n\n"


def _rule_ids(decorators: list[ast.expr]) -> Iterator[str]:
    for node in decorators:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rule":
            # every id of the marker (``rule("R4", "R20")`` cites both)
            yield from (arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str))


def _is_test(node: ast.FunctionDef | ast.ClassDef) -> bool:
    """A test function, or a test class (e.g. a state machine's module-level TestCase subclass)."""
    return node.name.startswith("test" if isinstance(node, ast.FunctionDef) else "Test")


def rule_citations(tests_dir: pathlib.Path) -> dict[str, list[str]]:
    """Map each cited rule id to the tests citing it (``file::function`` or ``file::TestClass``), from the test
    sources.

    Args:
        tests_dir: the repository's ``tests/`` directory.

    Returns:
        rule id -> sorted list of test names.
    """
    cited: dict[str, list[str]] = {}
    for path in sorted(tests_dir.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _is_test(node):
                for rule in _rule_ids(node.decorator_list):
                    cited.setdefault(rule, []).append(f"{path.name}::{node.name}")
    return {rule: sorted(set(names)) for rule, names in cited.items()}


def rules_in_spec(spec_text: str) -> list[str]:
    """The rule ids with a ``## Rn`` heading in the spec, in document order."""
    return _RULE_HEADING.findall(spec_text)


def _render_block(rule: str, tests: list[str]) -> str:
    lines = [f"- `{name}`" for name in tests] or ["- (no test cites this rule)"]
    return f"<!-- tests:{rule} -->\n" + "\n".join(lines) + "\n<!-- /tests -->"


def _regenerate(spec_text: str, cited: dict[str, list[str]]) -> str:
    return _BLOCK.sub(lambda m: _render_block(m.group(1), cited.get(m.group(1), [])), spec_text)


def _lifecycle_doc() -> str:
    return _DIAGRAM_HEADER + diagram.render()


def check(root: pathlib.Path) -> list[str]:
    """Every problem with the generated docs under ``root`` (empty when all is in order).

    Args:
        root: the repository root (holding ``docs/`` and ``tests/``).

    Returns:
        Human-readable problems.
    """
    spec_text = (root / "docs" / "spec.md").read_text()
    rules = rules_in_spec(spec_text)
    cited = rule_citations(root / "tests")
    problems = [f"{rule} has no test citing it" for rule in rules if not cited.get(rule)]
    problems += [f"{name} cites {rule}, which docs/spec.md does not define"
                 for rule, names in sorted(cited.items()) if rule not in rules for name in names]
    blocks = {m.group(1) for m in _BLOCK.finditer(spec_text)}
    problems += [f"{rule} has no <!-- tests:{rule} --> block in docs/spec.md" for rule in rules if rule not in blocks]
    if _regenerate(spec_text, cited) != spec_text:
        problems.append("docs/spec.md test lists are out of date (run: kvoffload-ref spec --write)")
    lifecycle = root / "docs" / "lifecycle.md"
    if not lifecycle.exists() or lifecycle.read_text() != _lifecycle_doc():
        problems.append("docs/lifecycle.md is out of sync with lifecycle.py (run: kvoffload-ref spec --write)")
    return problems


def write(root: pathlib.Path) -> None:
    """Regenerate the test lists in ``docs/spec.md`` and the whole of ``docs/lifecycle.md``."""
    spec = root / "docs" / "spec.md"
    spec.write_text(_regenerate(spec.read_text(), rule_citations(root / "tests")))
    (root / "docs" / "lifecycle.md").write_text(_lifecycle_doc())
