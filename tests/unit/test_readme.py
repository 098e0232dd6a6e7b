"""The README stays a user's document: short (what to read before starting), details in docs/.
That it types no figure by hand, like the other documents, is tests/unit/test_figures.py's."""

from __future__ import annotations

from tests.figures import ROOT

README = ROOT / "README.md"
MAX_README_LINES = 200  # the README of the two-axis version was 198 lines: what a user reads before starting


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (limit {MAX_README_LINES}): move details to docs/user_guide.md"
    )
