"""The documents the code cites are in the repository, with the sections cited."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sections(document: Path) -> set[str]:
    """The numbers of a document's headings: '## 3. Gemma 4' gives '3', '### 3.4 Rope' gives '3.4'."""
    return {m.group(1) for m in re.finditer(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", document.read_text(), re.M)}


def citations() -> list[tuple[str, str]]:
    """(file:line, section) for every §N on a line citing docs/families.md, in the code, the tests and the
    benchmarks."""
    found = []
    for folder in ("ember", "tests", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "docs/families.md" in line:
                    found += [(f"{path.relative_to(REPO)}:{number}", section)
                              for section in re.findall(r"§(\d+(?:\.\d+)?)", line)]
    return found


def test_every_families_md_citation_names_a_section_that_exists() -> None:
    cited = citations()
    assert len(cited) >= 16  # the family modules, ops, config, kv_cache, the references, the benchmarks
    known = sections(REPO / "docs" / "families.md")
    missing = [(where, section) for where, section in cited if section not in known]
    assert not missing, missing


def test_no_citation_points_outside_the_repository() -> None:
    bare = []
    for folder in ("ember", "tests", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(?<!docs/)\bfamilies\.md", line) and path.name != "test_docs.py":
                    bare.append(f"{path.relative_to(REPO)}:{number}")
    assert not bare, bare
