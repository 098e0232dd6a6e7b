"""The pipeline schedules users can pick, mapped onto torch.distributed.pipelining's, and the
microbatch counts each can run (checked before any send or receive)."""

from __future__ import annotations

from typing import Any, Callable, Optional


def schedule_runs(name: str, microbatches: int, pp: int) -> bool:
    """Whether torch's implementation of ``name`` accepts ``microbatches`` on ``pp`` ranks."""
    if name == "1f1b":
        return microbatches >= pp
    if name in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, microbatches // pp)
        return microbatches % rounds == 0
    return microbatches >= 1


def check_microbatches(name: str, microbatches: int, pp: int, batch_rows: int, micro_batch_size: int) -> None:
    """Raise a ValueError naming the counts that work when ``name`` cannot run ``microbatches``."""
    if schedule_runs(name, microbatches, pp):
        return
    upper = max(4 * pp, microbatches + 2 * pp)
    works = [m for m in range(1, upper + 1) if schedule_runs(name, m, pp)][:12]
    rule = (
        f"1F1B needs at least pipeline_parallel_size={pp} microbatches"
        if name == "1f1b"
        else f"the interleaved schedules need m divisible by max(1, m // {pp})"
    )
    raise ValueError(
        f"pipeline_schedule={name!r} cannot run m={microbatches} microbatches (per-replica batch {batch_rows} / "
        f"micro_batch_size {micro_batch_size}): {rule}; counts that work: {works}. Change the batch size or "
        "micro_batch_size so that m is one of them"
    )


def build_schedule(name: str, stages: list[Any], microbatches: int, loss_fn: Optional[Callable[..., Any]]) -> Any:
    """torch's schedule object for ``name`` over this rank's stages (one per local chunk).
    ``loss_fn=None`` builds a forward-only schedule (validation, test, predict)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
    )

    multi = len(stages) > 1
    if loss_fn is None or name == "gpipe":
        cls = ScheduleLoopedBFS if multi else ScheduleGPipe
    elif name == "1f1b":
        cls = Schedule1F1B
    elif name == "interleaved_1f1b":
        cls = ScheduleInterleaved1F1B
    else:
        cls = ScheduleInterleavedZeroBubble
    target = stages if cls in (ScheduleLoopedBFS, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) else stages[0]
    # scale_grads=False: the loss is already divided by the microbatch count (and accumulation)
    return cls(target, microbatches, loss_fn=loss_fn, scale_grads=False)
