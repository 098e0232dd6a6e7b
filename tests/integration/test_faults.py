"""A rank that raises or is killed mid-step stops every rank, quickly, and the survivor says which.

One launch per case (2 processes, gloo, CPU; about 10 s each), so the cases are a chosen subset
of layout {dp, tp} x phase {backward, optimizer} x mode {raise, kill} x launcher {lightning,
torchrun} x failing rank {0, 1} (32): the 8 below cover every layout/phase/mode combination once,
and every pair of the other factors (launcher x failing rank x mode, layout x launcher, phase x
launcher, layout x failing rank) at least once. What differs between those factors is where the
store lives (rank 0's process under Lightning's launcher, torchrun's agent otherwise), who tears
the job down (Lightning's child observer in rank 0, torchrun's agent) and whether the failed rank
could record its error (raise) or not (kill). Two pipeline cases add the phases the forward-only
pipeline tests (test_pipeline_failure.py) do not: backward inside the schedule, and a failure
outside the schedule (optimizer step) that the next step's transfer runs into. 10 faults in all.

Asserted: the job ends non-zero; its last process exits within FAULT_TO_EXIT_S of the fault; no
process is left behind; the failed rank's own error is printed (raise); and the survivor's error
names the failed rank: with its error (read from the store), or, when it could not record one
(SIGKILL), as the rank that did not report; or, when rank 0 took the store with it under
Lightning's launcher, as rank 0. Under torchrun the agent may stop the survivor (SIGTERM) before
it reports, so there the agent's own summary must name the failed rank as the root cause.
"""

from __future__ import annotations

import re

import pytest

from tests.integration.launch import run_job

# The survivor sees the fault at once (gloo: the peer's sockets close when its process exits);
# then at most failure_timeout (10 s) on the store when rank 0 took it along, at most 5 s until
# Lightning's child observer stops rank 0 after a failed child, interpreter exit, and slack for
# 2 shared CPU cores. A fault that was not propagated would take the collective timeout (10 min).
FAULT_TO_EXIT_S = 45
LAUNCH_LIMIT_S = 240  # startup (~10 s, several times that on a loaded machine) plus the above

CASES = [  # layout, phase, mode, launcher, failing rank
    ("dp", "backward", "raise", "lightning", 1),
    ("dp", "backward", "kill", "torchrun", 0),
    ("dp", "optimizer", "raise", "torchrun", 0),
    ("dp", "optimizer", "kill", "lightning", 1),
    ("tp", "backward", "raise", "torchrun", 1),
    ("tp", "backward", "kill", "lightning", 0),
    ("tp", "optimizer", "raise", "lightning", 0),
    ("tp", "optimizer", "kill", "torchrun", 1),
    ("pp", "backward", "raise", "torchrun", 1),
    ("pp", "optimizer", "raise", "lightning", 1),
]


@pytest.mark.parametrize(("layout", "phase", "mode", "launcher", "fail_rank"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_failed_rank_stops_every_rank_and_is_named(layout, phase, mode, launcher, fail_rank):
    end = run_job("tests.integration.fault_job", [layout, str(fail_rank), phase, mode], launcher, limit_s=LAUNCH_LIMIT_S)
    output, survivor = end.output, 1 - fail_rank
    print(f"fault {layout}/{phase}/{mode}/{launcher}/rank{fail_rank}: exit {end.returncode}, "
          f"{end.fault_to_exit_s:.1f}s after the fault; survivor said: {survivor_reports(output, survivor)[-1:]}")
    assert end.returncode != 0, output[-3000:]
    assert end.fault_to_exit_s < FAULT_TO_EXIT_S, f"took {end.fault_to_exit_s:.0f}s after the fault"
    assert end.left_behind == [], "processes left behind"
    own_error = f"ValueError: injected {phase} failure on rank {fail_rank}"
    if mode == "raise":
        assert own_error in output, output[-3000:]
    reports = survivor_reports(output, survivor)
    if launcher == "torchrun":
        root_cause = re.search(r"Root Cause \(first observed failure\):\s*\[0\]:.*?rank\s*:\s*(\d+)", output, re.DOTALL)
        assert root_cause is not None and int(root_cause.group(1)) == fail_rank, output[-3000:]
    else:
        assert reports, output[-3000:]
    named = [
        f"rank {fail_rank} failed with {own_error}" if mode == "raise" else
        f"no rank recorded an error, so a rank was killed or ran out of memory (SIGKILL, the OOM killer); global ranks "
        f"that had not reported when rank {survivor} stopped: [{fail_rank}]",
    ]
    if launcher == "lightning" and fail_rank == 0:
        named.append("the job's store is unreachable: it lives in global rank 0's process (Lightning's launcher), "
                     "so rank 0 failed or was killed; its own output has the error")
    for report in reports:  # whatever the survivor said, it named the failed rank
        assert any(report.startswith(n) for n in named), report


def survivor_reports(output: str, survivor: int) -> list[str]:
    """The survivor's explanations: its logged line and the message of the error it raised."""
    marker = f" (rank {survivor} stopped because its collective broke: "
    return [re.sub(r"^\[rank\d\]: \w[\w.]*: ", "", line) for line in output.splitlines() if marker in line]
