"""A rank that raises or is killed inside a pipeline step (forward): every rank exits, quickly,
naming the failed rank (or, when it could not report, the broken connection and the rank that
did not report). Other layouts and phases: test_faults.py, whose checks these share.

Two launches of the 8 combinations (the suite's time budget): a raise on the first stage and a
kill of the last, under Lightning's launcher, where rank 0 hosts the job's store (the harder
case for the survivor); test_faults runs the pipeline's backward and optimizer phases, one of
them under torchrun, with the same checks."""

from __future__ import annotations

import pytest

from tests.integration.launch import run_job
from tests.integration.test_faults import FAULT_TO_EXIT_S, LAUNCH_LIMIT_S, survivor_reports

STORE_GONE = (
    "the job's store is unreachable: it lives in global rank 0's process (Lightning's launcher), so rank 0 "
    "failed or was killed; its own output has the error"
)


@pytest.mark.parametrize(("launcher", "fail_rank"), [("lightning", 0)], ids=["lightning-first-stage-fails"])
def test_a_failing_rank_stops_the_whole_pipeline(fail_rank, launcher):
    output = _run_job(fail_rank, launcher, "raise")
    assert f"ValueError: injected failure on rank {fail_rank} at batch 2" in output
    reports = survivor_reports(output, 1 - fail_rank)
    named = f"rank {fail_rank} failed with ValueError: injected failure on rank {fail_rank} at batch 2"
    if launcher == "lightning":  # torchrun may stop the survivor itself before it reports
        assert reports, output[-3000:]
    # rank 0 hosts the job's store under Lightning's launcher; if it is already gone, the
    # survivor names it from that instead of reading its error
    for report in reports:
        assert report.startswith(named) or (
            fail_rank == 0 and launcher == "lightning" and report.startswith(STORE_GONE)
        ), report


@pytest.mark.parametrize(("launcher", "fail_rank"), [("lightning", 1)], ids=["lightning-last-stage-killed"])
def test_a_killed_rank_stops_the_whole_pipeline(fail_rank, launcher):
    """SIGKILL: the rank cannot report; its peer sees the broken connection and says so."""
    output = _run_job(fail_rank, launcher, "kill")
    reports = survivor_reports(output, 1 - fail_rank)
    if launcher == "torchrun":
        assert "Signal 9 (SIGKILL)" in output or "exitcode  : -9" in output, output[-3000:]
    elif fail_rank == 1:
        assert reports and reports[-1].startswith(
            "no rank recorded an error, so a rank was killed or ran out of memory (SIGKILL, the OOM killer); global "
            "ranks that had not reported when rank 0 stopped: [1]"
        ), output[-3000:]
    else:  # the launcher's own process was killed, and with it the job's store
        assert reports and reports[-1].startswith(STORE_GONE), output[-3000:]


def _run_job(fail_rank: int, launcher: str, mode: str) -> str:
    end = run_job("tests.integration.pipeline_failure_job", [str(fail_rank), mode], launcher, limit_s=LAUNCH_LIMIT_S)
    assert end.returncode != 0
    assert end.fault_to_exit_s < FAULT_TO_EXIT_S, f"took {end.fault_to_exit_s:.0f}s after the fault"
    assert end.left_behind == [], "processes left behind"
    return end.output
