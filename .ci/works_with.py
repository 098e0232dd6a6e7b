"""Rewrite the "Works with" tables from the conformance matrices (tests/works_with.py renders each
block and says which document holds it; tests/unit/test_works_with.py checks they do). Run from anywhere:

    python .ci/works_with.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `tests`

from tests.works_with import BLOCKS  # noqa: E402

for block in BLOCKS:
    block.path.write_text(block.rewrite(block.path.read_text()))
