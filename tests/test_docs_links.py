"""The docs are the project's own: every link in docs/ and README.md, and every Markdown file a docstring or doc
names, exists in this repository."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_MD_NAME = re.compile(r"(?<![\w/.$-])((?:\.\./|[\w-]+/)*[\w-]+\.md)\b")


def _texts() -> list[pathlib.Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "kvoffload_ref").rglob("*.py")])


def _exists(name: str, where: pathlib.Path) -> bool:
    if name.startswith(("http://", "https://", "mailto:")):
        return True
    candidates = [where.parent / name, ROOT / name, ROOT / "docs" / name]
    return any(c.resolve().is_relative_to(ROOT) and c.exists() for c in candidates)


def test_docs_links_point_inside_the_repository() -> None:
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in _texts() if path.suffix == ".md"
               for name in _LINK.findall(path.read_text())
               if not _exists(name, path)]
    assert missing == []


def test_docs_no_text_names_a_markdown_file_the_repository_lacks() -> None:
    missing = [f"{path.relative_to(ROOT)}: {name}"
               for path in _texts() if path.is_file()
               for name in _MD_NAME.findall(path.read_text(errors="replace"))
               if not _exists(name, path)]
    assert missing == []


def test_docs_link_checker_catches_an_outside_file(tmp_path: pathlib.Path) -> None:
    page = ROOT / "docs" / "architecture.md"
    assert _exists("spec.md", page) and _exists("../README.md", page)
    assert not _exists("../shared/design/ARCHITECTURE.md", page) and not _exists("ARCHITECTURE.md", page)
    assert _MD_NAME.findall("see ARCHITECTURE.md, and docs/spec.md") == ["ARCHITECTURE.md", "docs/spec.md"]
