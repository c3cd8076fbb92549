"""docs/architecture.md is where the code's references lead: every requirement a comment cites
(R1-R5) has its section, nothing points at a document outside the repository, and every file
the page names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
CITED = re.compile(r"\bR([1-9])\b")


def sources() -> dict[str, str]:
    """Repository path -> text of every .py / .md file under polyrl, docs and tests (a file
    that disappears while this reads, moved by a concurrent edit, is left out)."""
    out = {}
    for path in (p for d in ("polyrl", "docs", "tests") for p in (ROOT / d).rglob("*")):
        if path.suffix in (".py", ".md") and path != Path(__file__).resolve():
            try:
                out[path.relative_to(ROOT).as_posix()] = path.read_text()
            except (FileNotFoundError, IsADirectoryError):
                continue
    return out


def headings() -> list[str]:
    return [line.lstrip("#").strip() for line in DOC.read_text().splitlines() if line.startswith("#")]


def test_every_cited_requirement_has_a_section():
    sections = {m.group(1) for h in headings() if (m := re.match(r"R([1-9]) — ", h))}
    assert sections == {"1", "2", "3", "4", "5"}
    cited = {(path, n) for path, text in sources().items() for n in CITED.findall(text)}
    missing = sorted(c for c in cited if c[1] not in sections)
    assert not missing, f"cited requirements without a section in docs/architecture.md: {missing}"


def test_nothing_cites_a_design_document_outside_the_repository():
    outside = "DESIGN" + ".md"  # spelled in two parts so this file does not cite it either
    offenders = [path for path, text in sources().items() if outside in text]
    assert not offenders


def test_the_files_the_page_names_exist():
    named = set(re.findall(r"`((?:polyrl|tests|docs|benchmarks)/[\w/.]+\.(?:py|md))`", DOC.read_text()))
    assert named, "the page names no file: the pattern is wrong"
    assert not sorted(n for n in named if not (ROOT / n).exists())


def test_the_sections_the_conventions_test_cites_exist():
    assert {"Layers", "Contracts", "Conventions", "The environment-plan rules", "Topologies",
            "The batch", "Training engines"} <= set(headings())
