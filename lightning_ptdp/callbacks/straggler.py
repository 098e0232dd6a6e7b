"""StragglerDetector: every N steps, compare each rank's own work per step and name the slow ones."""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

_Mark = Union[float, "torch.cuda.Event"]


class StragglerWarning(UserWarning):
    """A rank's own work per step is slower than the other ranks' by more than the set factor."""


@dataclass(frozen=True)
class Straggler:
    rank: int
    seconds_per_step: float
    """The rank's local work per step (see StragglerDetector), averaged over the window."""
    others_median: float
    """Median of the same quantity over all other ranks."""

    @property
    def slowdown(self) -> float:
        return self.seconds_per_step / self.others_median if self.others_median > 0 else float("inf")


def find_stragglers(seconds_per_step: Sequence[float], factor: float) -> list[Straggler]:
    """Ranks (indices) whose time exceeds ``factor`` times the median of the *other* ranks.

    Leaving the rank out of its own median keeps a small world meaningful: with 2 ranks, the
    slow one is compared with the fast one instead of with the mean of both.
    """
    found = []
    for rank, seconds in enumerate(seconds_per_step):
        others = [other for i, other in enumerate(seconds_per_step) if i != rank]
        if others and seconds > factor * statistics.median(others):
            found.append(Straggler(rank=rank, seconds_per_step=seconds, others_median=statistics.median(others)))
    return found


class _Stopwatch:
    """Intervals on the device's own timeline: CUDA events on a GPU (no host synchronisation per
    step; read once per window), ``time.perf_counter`` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> _Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: _Mark, end: _Mark) -> float:
        if not self.cuda:
            return float(end) - float(start)
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class StragglerDetector(pl.Callback):
    """Warn (on rank 0, :class:`StragglerWarning`) naming every rank whose own work per step,
    averaged over the last ``every_n_steps`` steps, is more than ``slowdown_factor`` times the
    median of the other ranks'; every rank gets the gathered times in ``last_seconds_per_step``
    and the verdict in ``last_stragglers``. Each check is one all_gather over the world.

    Why not the wall-clock step time: collectives make every rank wait for the slowest (the
    gradient all-reduce, a ``self.log(..., sync_dist=True)`` in ``training_step``), so all ranks
    see the same step time. A rank's *own work* is measured where no collective runs:

    * fetching the batch: from the end of the previous step (or the epoch start, or the end of a
      validation) to ``on_train_batch_start``;
    * the model's forward: the time inside the forward calls of the LightningModule's direct
      submodules (forward hooks, added at ``on_train_start`` and removed at ``on_train_end``);
    * the optimizer step: from ``on_before_optimizer_step`` to the end of the step.

    The backward is left out (it waits in the gradient all-reduce). With tensor parallelism the
    forward holds TP collectives, so a slow rank also slows its TP peers (it stays the slowest).
    Intervals are read on the device's timeline: CUDA events on a GPU, no per-step host sync.
    """

    def __init__(self, *, every_n_steps: int = 50, slowdown_factor: float = 1.5) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"StragglerDetector(every_n_steps={every_n_steps!r}) must be a positive integer")
        if isinstance(slowdown_factor, bool) or not isinstance(slowdown_factor, (int, float)) or slowdown_factor <= 1:
            raise ValueError(
                f"StragglerDetector(slowdown_factor={slowdown_factor!r}) must be a number > 1, "
                "e.g. 1.5 to flag a rank 50% slower than the others"
            )
        self.every_n_steps, self.slowdown_factor = every_n_steps, float(slowdown_factor)
        self.last_seconds_per_step: list[float] = []
        self.last_stragglers: list[Straggler] = []
        self.hostnames: list[str] = []
        self._watch = _Stopwatch(torch.device("cpu"))
        self._open: Optional[_Mark] = None
        self._intervals: list[tuple[_Mark, _Mark]] = []
        self._steps = 0
        self._in_step = False
        self._forward_depth = 0
        self._hook_handles: list[Any] = []

    # ------------------------------------------------------------------ setup and teardown
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Called on every rank once the model is set up: clock, forward hooks, hostnames."""
        self._watch = _Stopwatch(pl_module.device)
        for child in pl_module.children():
            self._hook_handles.append(child.register_forward_pre_hook(self._forward_started))
            self._hook_handles.append(child.register_forward_hook(self._forward_ended))
        host = socket.gethostname()
        if dist.is_available() and dist.is_initialized():
            self.hostnames = [""] * dist.get_world_size()
            dist.all_gather_object(self.hostnames, host)
        else:
            self.hostnames = [host]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Also after a failed fit: leave the user's modules without our hooks."""
        self.on_train_end(trainer, pl_module)

    # ------------------------------------------------------------------ the measured intervals
    def _close(self) -> None:
        if self._open is not None:
            self._intervals.append((self._open, self._watch.mark()))
            self._open = None

    def _forward_started(self, module: Any, args: Any) -> None:
        self._forward_depth += 1
        if self._in_step and self._forward_depth == 1:
            self._open = self._watch.mark()

    def _forward_ended(self, module: Any, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._in_step and self._forward_depth == 0:
            self._close()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open = self._watch.mark()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open = self._watch.mark()  # validation itself is not a training step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close()  # the batch has arrived
        self._in_step = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._open = self._watch.mark()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close()
        self._in_step = False
        self._steps += 1
        if self._steps >= self.every_n_steps:
            self._check(pl_module.device)
            self._intervals, self._steps = [], 0
        self._open = self._watch.mark()  # fetching the next batch is the rank's own work

    def _check(self, device: torch.device) -> None:
        local = sum(self._watch.seconds(start, end) for start, end in self._intervals) / self._steps
        self.last_seconds_per_step = [local]
        if dist.is_available() and dist.is_initialized():  # over the whole world, every t, p, d rank
            mine = torch.tensor([local], dtype=torch.float64, device=device)
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
            self.last_seconds_per_step = [float(value) for value in gathered]
        self.last_stragglers = find_stragglers(self.last_seconds_per_step, self.slowdown_factor)
        for straggler in self.last_stragglers:
            rank_zero_warn(self._message(straggler), category=StragglerWarning)

    def _message(self, straggler: Straggler) -> str:
        host = self.hostnames[straggler.rank] if straggler.rank < len(self.hostnames) else "?"
        table = ", ".join(f"{rank}: {seconds:.4f}" for rank, seconds in enumerate(self.last_seconds_per_step))
        return (
            f"straggler: rank {straggler.rank} (host {host}) spent {straggler.seconds_per_step:.4f} s per step "
            f"on its own work (batch fetch, forward, optimizer) over the last {self._steps} steps, "
            f"{straggler.slowdown:.1f}x the median of the other ranks ({straggler.others_median:.4f} s); "
            f"seconds per step by rank: {table}"
        )
