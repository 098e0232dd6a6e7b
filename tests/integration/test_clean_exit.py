"""A fit that finished exits with code 0, every time. A gloo worker may still hold a finished
collective's work when the interpreter tears down; releasing its tensors needs the GIL, and a thread
asking for the GIL during finalisation is ended inside a C++ destructor: "terminate called without
an active exception", SIGABRT, exit code 134, in a few percent of runs. So at exit the strategy takes
every group down while the interpreter is whole (core/shutdown.py): each rank must be left with no
gloo worker thread, which fails deterministically where a group survives, unlike the abort itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 240
CASES = [
    ("d2", "gpt", 1),
    ("t2", "gpt", 1),
    ("p2", "gpt", 2),  # a second fit in the same process: the groups work until exit
    ("c2", "gpt", 1),
    ("d2-e2", "moe_llama", 1),
    ("p2", "hf_phi3", 1),  # the case first seen aborting
]


@pytest.mark.parametrize(("layout", "family", "fits"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_finished_fit_exits_with_code_0_and_no_gloo_thread(layout, family, fits):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.short_fit_job", layout, family, str(fits)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    tail = output[-3000:]
    # both ranks print to one stream: their lines can run together, so find the phrase, not lines
    finished = sorted(re.findall(r"rank \d finished at step 3", output))
    assert finished == sorted(["rank 0 finished at step 3", "rank 1 finished at step 3"] * fits), tail
    assert "terminate called" not in output, tail
    assert proc.returncode == 0, f"exit code {proc.returncode} after a finished fit:\n{tail}"
    assert sorted(re.findall(r"rank \d left \d+ gloo threads", output)) == [
        "rank 0 left 0 gloo threads",
        "rank 1 left 0 gloo threads",
    ], tail
