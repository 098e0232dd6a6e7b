"""A rank that raises or is killed inside a pipeline step: every rank exits, quickly, naming the
failed rank (or, when it could not report, the broken connection and the peers to look at)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each launch is ~10 s of startup and 2 steps; the collective timeout (10 min) is what a hang
# would take, so finishing within 120 s shows the failure was propagated, not timed out.
BOUND_S = 120


@pytest.mark.parametrize("fail_rank", [0, 1], ids=["first-stage-fails", "last-stage-fails"])
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_a_failing_rank_stops_the_whole_pipeline(fail_rank, launcher):
    output = _run_job(fail_rank, launcher, "raise")
    assert f"ValueError: injected failure on rank {fail_rank} at batch 2" in output
    if launcher == "lightning":  # torchrun may stop the survivor itself before it reports
        survivor = 1 - fail_rank
        named = (
            f"[rank{survivor}]: lightning_ptdp.pipeline.failure.PipelinePeerFailure: pipeline step stopped: "
            f"rank {fail_rank} failed with ValueError: injected failure on rank {fail_rank} at batch 2"
        )
        # rank 0 hosts the job's store under Lightning's launcher; if it is already gone, the
        # survivor names it from that instead of reading its error
        store_gone = f"[rank{survivor}]: lightning_ptdp.pipeline.failure.PipelinePeerFailure: pipeline step stopped: the job's store on global rank 0 is unreachable, so rank 0 failed"
        assert named in output or (fail_rank == 0 and store_gone in output), output[-3000:]


@pytest.mark.parametrize("fail_rank", [0, 1], ids=["first-stage-killed", "last-stage-killed"])
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_a_killed_rank_stops_the_whole_pipeline(fail_rank, launcher):
    """SIGKILL: the rank cannot report; its peer sees the broken connection and says so."""
    output = _run_job(fail_rank, launcher, "kill")
    if launcher == "torchrun":
        assert "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output[-3000:]
    elif fail_rank == 1:
        assert ("[rank0]: lightning_ptdp.pipeline.failure.PipelinePeerFailure: pipeline step stopped on rank 0: a peer "
                "closed its connection without reporting an error (killed? out of memory?); this rank's pipeline "
                "peers are global ranks [1]") in output, output[-3000:]
    else:  # the launcher's own process was killed, and with it the job's store
        assert ("[rank1]: lightning_ptdp.pipeline.failure.PipelinePeerFailure: pipeline step stopped: the job's store "
                "on global rank 0 is unreachable, so rank 0 failed or exited") in output, output[-3000:]


def _run_job(fail_rank: int, launcher: str, mode: str) -> str:
    job = ["-m", "tests.integration.pipeline_failure_job", str(fail_rank), mode]
    cmd = [sys.executable, *job]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *job]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BOUND_S + 60)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < BOUND_S, f"took {elapsed:.0f}s"
    time.sleep(2)  # a survivor may still be printing its error
    leftover = subprocess.run(["pgrep", "-f", "pipeline_failure_job"], capture_output=True, text=True).stdout.split()
    assert leftover == [], "processes left behind"
    return output
