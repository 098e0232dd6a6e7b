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

Three more fail while a checkpoint is written (phase save: ModelCheckpoint saves every 2 steps with
save_last=True; the failing rank fails half way through writing its part of the second last.ckpt).
Sharded format: a raise on rank 1 and a kill of rank 0 (which takes the store along), both under
Lightning's launcher (torchrun's teardown of the same faults is what the step cases above test;
the suite's time budget keeps this to 3 launches): DCP's
coordinator (rank 0) gathers every rank's outcome of writing, so a raise reaches every rank as
DCP's own error, while a kill breaks that gather under the survivor, who names the rank as above.
Full format: rank 0 is the only writer, so one case, killed (a raise deletes its partial file; a
kill leaves it behind, the case to check) under torchrun. Layouts: tp (each rank writes different
weights) and dp (DCP writes each replicated weight once).

Asserted: the job ends non-zero; its last process exits within FAULT_TO_EXIT_S of the fault; no
process is left behind; the failed rank's own error is printed (raise); and the survivor's error
names the failed rank: with its error (read from the store), or, when it could not record one
(SIGKILL), as the rank that did not report; or, when rank 0 took the store with it under
Lightning's launcher, as rank 0. Under torchrun, whose agent stops the survivor (SIGTERM) as soon
as the failed rank exits, the survivor's own message must be there too (the strategy turns SIGTERM
into an exception that on_exception explains; torchrun's "Root Cause" summary does not count), and
every rank's exit code is asserted: -9 for a killed rank, else 1 (it raised its own error or the
explained one) or -15 (the agent's SIGTERM came after the strategy's teardown, once the rank had
printed its message: the default action is back, the termination is not swallowed). They are read
from the agent's summary: it reaps each worker, so it has the operating system's status, signals
included, which a rank cannot write itself (SIGKILL runs nothing of it, a default SIGTERM no
atexit). When a rank raises inside a sharded save, DCP raises the failure on every rank, naming
the failed one: every rank's error must say so. After a save fault, every checkpoint name in the
folder must be a complete checkpoint of its step, last.ckpt still the first save's (read in this
process: consolidated for sharded, torch.load for full), ckpt_path="last" must resolve to it, and
the interrupted write must be there under no name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tests.integration.fault_job import SAVE_EVERY
from tests.integration.launch import JobEnd, run_job

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


@pytest.mark.parametrize(
    ("layout", "phase", "mode", "launcher", "fail_rank"), CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_a_failed_rank_stops_every_rank_and_is_named(layout, phase, mode, launcher, fail_rank):
    end = run_job(
        "tests.integration.fault_job", [layout, str(fail_rank), phase, mode], launcher, limit_s=LAUNCH_LIMIT_S
    )
    print(
        f"fault {layout}/{phase}/{mode}/{launcher}/rank{fail_rank}: exit {end.returncode} ({rank_exits(end.output)}), "
        f"{end.fault_to_exit_s:.1f}s after the fault; survivor said: {survivor_reports(end.output, 1 - fail_rank)[-1:]}"
    )
    assert_stopped(end, phase, mode, fail_rank)
    assert_survivor_names(end.output, phase, mode, launcher, fail_rank)
    assert_rank_exit_codes(end.output, mode, launcher, fail_rank)


SAVE_CASES = [  # layout, checkpoint format, mode, launcher, failing rank
    ("tp", "sharded", "raise", "lightning", 1),
    ("dp", "sharded", "kill", "lightning", 0),
    ("dp", "full", "kill", "torchrun", 0),
]


@pytest.mark.parametrize(
    ("layout", "fmt", "mode", "launcher", "fail_rank"), SAVE_CASES, ids=["-".join(map(str, c)) for c in SAVE_CASES]
)
def test_a_rank_failing_mid_save_stops_every_rank_and_keeps_the_last_good_checkpoint(
    layout, fmt, mode, launcher, fail_rank, tmp_path
):
    phase = "save" if fmt == "sharded" else "save-full"
    end = run_job(
        "tests.integration.fault_job",
        [layout, str(fail_rank), phase, mode, str(tmp_path)],
        launcher,
        limit_s=LAUNCH_LIMIT_S,
    )
    survivor, by_dcp = 1 - fail_rank, fmt == "sharded" and mode == "raise"
    errors = save_errors(end.output)
    said = [m for rank, m in errors if rank == survivor] if by_dcp else survivor_reports(end.output, survivor)
    print(
        f"fault {layout}/{phase}/{mode}/{launcher}/rank{fail_rank}: exit {end.returncode} ({rank_exits(end.output)}), "
        f"{end.fault_to_exit_s:.1f}s after the fault; survivor said: {said[-1:]}; "
        f"checkpoints: {sorted(os.listdir(tmp_path))} {sorted(os.listdir(tmp_path / '.ptdp')) if fmt == 'sharded' else ''}"
    )
    assert_stopped(end, phase, mode, fail_rank)
    if by_dcp:  # DCP's coordinator gathered the failure and raised it on every rank
        failed = f"failed (on rank {fail_rank}: {own_error(phase, fail_rank)}); the previous checkpoint is untouched"
        assert errors and all(failed in message for _, message in errors), errors
        assert said, errors
    else:
        assert_survivor_names(end.output, phase, mode, launcher, fail_rank)
    assert_rank_exit_codes(end.output, mode, launcher, fail_rank)
    assert_last_good_checkpoint_kept(tmp_path, fmt, mode, fail_rank)


def own_error(phase: str, fail_rank: int) -> str:
    return f"ValueError: injected {phase} failure on rank {fail_rank}"


def assert_stopped(end: JobEnd, phase: str, mode: str, fail_rank: int) -> None:
    """Non-zero, every process gone within FAULT_TO_EXIT_S, and a raised error printed."""
    assert end.returncode != 0, end.output[-3000:]
    assert end.fault_to_exit_s < FAULT_TO_EXIT_S, f"took {end.fault_to_exit_s:.0f}s after the fault"
    assert end.left_behind == [], "processes left behind"
    if mode == "raise":
        assert own_error(phase, fail_rank) in end.output, end.output[-3000:]


def assert_survivor_names(output: str, phase: str, mode: str, launcher: str, fail_rank: int) -> None:
    """The survivor's own error names the failed rank (under either launcher)."""
    survivor = 1 - fail_rank
    reports = survivor_reports(output, survivor)
    assert reports, output[-3000:]
    named = [
        f"rank {fail_rank} failed with {own_error(phase, fail_rank)}"
        if mode == "raise"
        else f"no rank recorded an error, so a rank was killed or ran out of memory (SIGKILL, the OOM killer); global ranks "
        f"that had not reported when rank {survivor} stopped: [{fail_rank}]",
    ]
    if launcher == "lightning" and fail_rank == 0:
        named.append(
            "the job's store is unreachable: it lives in global rank 0's process (Lightning's launcher), "
            "so rank 0 failed or was killed; its own output has the error"
        )
    for report in reports:  # whatever the survivor said, it named the failed rank
        assert any(report.startswith(n) for n in named), report


def survivor_reports(output: str, survivor: int) -> list[str]:
    """The survivor's explanations: its logged line and the message of the error it raised (its
    collective broke, or its launcher terminated it first)."""
    marker = f" (rank {survivor} stopped because "
    return [re.sub(r"^\[rank\d\]: \w[\w.]*: ", "", line) for line in output.splitlines() if marker in line]


def save_errors(output: str) -> list[tuple[int, str]]:
    """(rank, message) of every rank's CheckpointSaveError."""
    found = re.findall(r"^\[rank(\d)\]: lightning_ptdp\.checkpoint\.CheckpointSaveError: (.*)$", output, re.MULTILINE)
    return [(int(rank), message) for rank, message in found]


def assert_rank_exit_codes(output: str, mode: str, launcher: str, fail_rank: int) -> None:
    """Under torchrun, every rank's exit code from the agent's summary: -9 for a killed rank; 1 for
    one that raised (its own error, or its explained one), or -15 where the agent's SIGTERM reached
    it after the strategy's teardown had put the default handler back, its message already printed
    (asserted apart): a SIGTERM is never swallowed."""
    if launcher != "torchrun":  # Lightning's launcher reports rank 0's only (the job's own exit code)
        return
    exits = torchrun_exit_codes(output)
    assert [rank for rank, _ in exits] == [0, 1], output[-3000:]  # both listed: both exited non-zero
    for rank, code in exits:
        assert code == -9 if (rank == fail_rank and mode == "kill") else code in (1, -15), (exits, output[-3000:])


def torchrun_exit_codes(output: str) -> list[tuple[int, int]]:
    """(rank, exit code) of every worker torchrun's agent lists as failed, in rank order."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", output)
    return sorted((int(rank), int(code)) for rank, code in found)


def rank_exits(output: str) -> str:
    """Each rank's exit code where the launcher says it (torchrun's summary, Lightning's child observer)."""
    child = re.findall(r"Child process with PID \d+ terminated with code (-?\d+)", output)
    return ", ".join([f"rank {r}: {c}" for r, c in torchrun_exit_codes(output)] + [f"a child: {c}" for c in child])


def assert_last_good_checkpoint_kept(folder: Path, fmt: str, mode: str, fail_rank: int) -> None:
    """Every checkpoint name is a complete checkpoint of the step in its name, last.ckpt still the
    first save's; ckpt_path="last" resolves to it; the interrupted write is there under no name."""
    names = sorted(name for name in os.listdir(folder) if not name.startswith("."))
    assert {"last.ckpt", f"epoch=0-step={SAVE_EVERY}.ckpt"} <= set(names), names
    for name in names:
        step = SAVE_EVERY if name == "last.ckpt" else int(re.search(r"step=(\d+)", name).group(1))
        assert saved_step(folder / name, fmt) == step, name
    assert resume_last(folder) == str(folder / "last.ckpt")
    if fmt == "sharded":
        named = {os.path.realpath(folder / name) for name in names}
        unfinished = [v for v in (folder / ".ptdp").glob("last.ckpt.v*") if not (v / ".metadata").exists()]
        assert len(unfinished) == 1 and str(unfinished[0]) not in named, (unfinished, named)
        assert (unfinished[0] / f"__{fail_rank}_0.distcp").exists(), "the failing rank never started writing"
    else:
        assert (folder / ".last.ckpt.partial").exists() == (mode == "kill")  # a raise deletes its partial file


def saved_step(path: Path, fmt: str) -> int:
    """The global step of a complete checkpoint, read in this process."""
    if fmt == "full":
        return torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    from lightning_ptdp.checkpoint.command import consolidate

    assert (path / ".metadata").exists(), f"{path} has no .metadata"
    return consolidate(str(path))["global_step"]


def resume_last(folder: Path) -> str:
    """The checkpoint ``trainer.fit(ckpt_path="last")`` resumes from: Lightning's own lookup (its
    _CheckpointConnector: ModelCheckpoint's last-named files, the most recently modified)."""
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.callbacks import ModelCheckpoint

    candidates = ModelCheckpoint(dirpath=folder)._find_last_checkpoints(trainer=None)
    return max(candidates, key=lambda path: get_filesystem(path).modified(path))
