"""The documents start with where tandem stands: README's tables come first and its
links land, and docs/BENCHMARKS.md stays a page of current figures (the sittings go
to docs/lab-notes/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readmes_first_table_is_on_its_first_screen():
    lines = README.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert first < 60, f"README's first table starts on line {first + 1}"


def test_benchmarks_is_the_current_standing():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 800
    assert (ROOT / "docs" / "lab-notes" / "README.md").is_file()


def test_readmes_links_land():
    for target in re.findall(r"\]\(([^)]+)\)", README.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, fragment = target.partition("#")
        assert (ROOT / path).exists(), target
        if fragment:
            headings = [
                anchor(line.lstrip("#"))
                for line in (ROOT / path).read_text().splitlines()
                if line.startswith("#")
            ]
            assert fragment in headings, f"{target}: no such heading"
