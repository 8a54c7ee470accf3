"""The README is executable and its test command is the one CI runs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_docs_readme_test_command_is_what_ci_runs() -> None:
    commands = [b.strip() for b in _blocks("bash")]
    assert len(commands) == 2, "README has exactly two set-up commands"
    test_command = commands[1].split("&&")[-1].strip()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_command
    assert "kvoffload-ref demo" in commands[0]


def test_docs_readme_usage_example_runs(capsys: object) -> None:
    (example,) = _blocks("python")
    namespace: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), namespace)
    report = namespace["report"]
    assert report.region == "released"  # type: ignore[attr-defined]
    assert not namespace["be"].ledger.live()  # type: ignore[attr-defined]


def test_docs_readme_diagram_is_generated_from_the_lifecycle_table() -> None:
    from kvoffload_ref import diagram

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- diagram:handler -->\n```mermaid\n(.*?)```\n<!-- /diagram -->", text, flags=re.S)
    assert block is not None and block.group(1) == diagram.render_machine("handler")
