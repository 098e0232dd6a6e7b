"""The ``ptdp`` tools start without torch or Lightning: ``ptdp plan --help`` took 6 s when the
package's import pulled them in."""

import subprocess
import sys

import lightning_ptdp
from lightning_ptdp.tools import cli

PROBE = """
import sys
sys.argv = ["ptdp", "plan", "--help"]
from lightning_ptdp.tools.cli import main
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "lightning", "jsonargparse") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_ptdp_plan_help_imports_neither_torch_nor_lightning():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert "usage: ptdp plan" in out and "HEAVY []" in out


def test_the_package_knows_every_tool_command():
    assert set(lightning_ptdp._TOOLS) == set(cli.TOOL_COMMANDS)


def test_a_plain_import_registers_the_strategy():
    code = "import lightning_ptdp; from lightning.pytorch.strategies import StrategyRegistry; print('ptdp' in StrategyRegistry)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
