"""Rewrite README.md's "Works with" table from the conformance matrix (tests/works_with.py renders
it; tests/unit/test_works_with.py checks the README holds it). Run from anywhere:

    python .ci/works_with.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `tests`

from tests.works_with import README, readme_block, render  # noqa: E402

text = README.read_text()
README.write_text(text.replace(readme_block(text), render()))
