"""Start a 2-process job under Lightning's launcher or torchrun and see how it ends (for the
fault tests): its exit code, its output, how long after the injected fault its last process
exited, and whether any process was left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INJECTED = re.compile(r"fault-injected at ([0-9.]+)")


@dataclass
class JobEnd:
    returncode: int
    output: str
    fault_to_exit_s: float
    """From the injected fault to the last process closing its output (so: exiting)."""
    left_behind: list[str]


def run_job(module: str, args: list[str], launcher: str, *, limit_s: float) -> JobEnd:
    tag = f"ptdp-fault-{uuid.uuid4().hex[:12]}"  # in every rank's command line: finds this job's processes only
    job = ["-m", module, *args, tag]
    cmd = [sys.executable, *job]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *job]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        # the ranks inherit the output pipes: run() returns once the last of them has exited,
        # orphans included (a rank whose launcher, rank 0, was killed)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        _kill(tag)
        raise
    end = time.time()
    output = proc.stdout + proc.stderr
    injected = INJECTED.search(output)
    assert injected is not None, f"the job never injected its fault:\n{output[-3000:]}"
    left = _find(tag)
    if left:
        time.sleep(2)  # one may be between closing its output and exiting
        left = _find(tag)
    _kill(tag)
    return JobEnd(proc.returncode, output, end - float(injected.group(1)), left)


def _find(tag: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()


def _kill(tag: str) -> None:
    for pid in _find(tag):  # only this job's processes, each by its id
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
