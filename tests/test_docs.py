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
    from kvoffload_ref.docgen import diagram

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- diagram:handler -->\n```mermaid\n(.*?)```\n<!-- /diagram -->", text, flags=re.S)
    assert block is not None and block.group(1) == diagram.render_machine("handler")


def _table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def test_docs_readme_guarantee_table_is_generated_from_the_failure_modes() -> None:
    from kvoffload_ref.docgen import failure_modes

    text = (ROOT / "README.md").read_text()
    assert failure_modes.guarantee_table() in text, "regenerate with: kvoffload-ref failure-modes --write"


def test_docs_readme_vllm_cells_match_docs_failure_modes() -> None:
    """One source of truth: every vLLM cell of README's table is the one docs/failure-modes.md states."""
    from kvoffload_ref.docgen import failure_modes

    readme = {row[0]: row for row in _table_rows((ROOT / "README.md").read_text())}
    modes = {row[0]: row for row in _table_rows((ROOT / "docs" / "failure-modes.md").read_text())}
    linked = [g for g in failure_modes.GUARANTEES if g.fault is not None]
    assert len(linked) >= 5
    for g in linked:
        _, before, after, _ = readme[g.topic]
        _, want_before, want_after, *_ = modes[g.fault]
        assert before == want_before, g.topic
        assert after == (want_before if want_after == "same as before" else want_after), g.topic
    failed = readme["Failed transfer"]
    assert "success=True" in failed[1] and "escapes `get_finished`" in failed[1]


def test_docs_install_the_kit_only_by_a_direct_reference_and_ci_checks_that_route() -> None:
    """kvoffload_ref is not on PyPI: no doc may tell a user to ``pip install "kvoffload_ref[conformance]"`` from the
    index; each gives the direct-reference forms a user runs as written (a checkout, a clone through
    ``git+file``), and .ci/run installs a wheel of the checkout through that form with the conformance extra alone,
    then runs the kit's CLI on a factory module in the current directory, and installs the clone's HEAD through
    ``git+file``."""
    docs = {path: path.read_text() for path in (ROOT / "README.md", ROOT / "docs" / "conformance.md")}
    for path, text in docs.items():
        assert not re.search(r"""pip install ["']kvoffload_ref\[conformance\]["']""", text), path
        assert 'pip install "kvoffload_ref[conformance] @ ' in text, path
        assert "<host>" not in text and "<owner>" not in text, path  # every line runs as written
        for form in ("@ file:///abs/path/to/checkout", "@ git+file:///abs/path/to/checkout",
                     "git+file://localhost/abs/path/to/checkout"):
            assert form in text, (path, form)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip wheel -q --no-deps -w " in ci and "python3 -m venv .venv-wheel" in ci
    assert 'pip install -q "kvoffload_ref[conformance] @ file://$wheel"' in ci
    assert "kvoffload-ref explore --factory mymod:make_worker" in ci
    assert 'pip install -q "kvoffload_ref[conformance] @ git+file://$checkout"' in ci
