"""ruff (configured in pyproject.toml: line length 120, pyflakes, pycodestyle, import order) finds
nothing and the formatter would change nothing, so CI's lint step and a local pytest agree."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    found = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(found).exists():
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    return [found]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_is_clean(args):
    proc = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
