"""The kernels compile for Hopper (sm_90) with the tiles a real launch uses, on any machine:
the CPU interpreter cannot catch layout lowering, ptxas or shared-memory errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    script = Path(__file__).with_name("compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    proc = subprocess.run(
        [sys.executable, str(script), "--arch", "90"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.stdout, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["failures"] == [] and proc.returncode == 0, report["failures"]
    from lightning_ptdp.triton_kernels._config import ATTENTION_CANDIDATES

    # bf16 d=128 causal: every attention candidate, the delta pass, bias-GeLU forward and backward
    assert len(report["compiled"]) == sum(len(tiles) for tiles in ATTENTION_CANDIDATES.values()) + 3
