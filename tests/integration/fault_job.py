"""A 2-process job in which one rank raises or is killed in a chosen phase (for test_faults).

Usage: python -m tests.integration.fault_job LAYOUT FAIL_RANK PHASE MODE [TAG] (Lightning's
launcher), or the same under torchrun. LAYOUT: dp (d=2), tp (t=2) or pp (p=2); PHASE: backward
(a gradient hook of a parameter raises, mid-backward) or optimizer (on_before_optimizer_step);
MODE: raise (an exception) or kill (SIGKILL, no chance to report). TAG is ignored: it marks the
job's processes so a test can find any left behind. Before injecting, the rank prints
``fault-injected at <unix time>`` so the test can time every rank's exit from the fault.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import lightning as L
import torch.distributed as dist

from lightning_ptdp import PTDPStrategy
from tests.fit_utils import quiet_trainer, zoo_data
from tests.models import CausalLM, NanoGPT, ZooConfig

FAIL_AT_BATCH = 2  # a later batch than the first, so every rank is inside steady-state training
LAYOUTS = {
    "dp": dict(),
    "tp": dict(tensor_parallel_size=2),
    "pp": dict(pipeline_parallel_size=2, micro_batch_size=2),
}


def inject(phase: str, mode: str) -> None:
    rank = dist.get_rank()
    print(f"fault-injected at {time.time():.3f}", file=sys.stderr, flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"injected {phase} failure on rank {rank}")


class InjectFault(L.Callback):
    """On ``fail_rank`` at batch FAIL_AT_BATCH: fail in ``phase`` by ``mode``."""

    def __init__(self, fail_rank: int, phase: str, mode: str) -> None:
        self.fail_rank, self.phase, self.mode = fail_rank, phase, mode

    def _armed(self, trainer: L.Trainer) -> bool:
        return trainer.global_rank == self.fail_rank and trainer.fit_loop.epoch_loop.batch_idx == FAIL_AT_BATCH

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.phase == "backward" and trainer.global_rank == self.fail_rank and batch_idx == FAIL_AT_BATCH:
            # a parameter in the middle of this rank's part of the model: autograd reaches it
            # mid-backward (under PP, inside the schedule's backward)
            params = [p for p in pl_module.parameters() if p.requires_grad]
            params[len(params) // 2].register_hook(lambda grad: inject(self.phase, self.mode))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.phase == "optimizer" and self._armed(trainer):
            inject(self.phase, self.mode)


def main() -> None:
    layout, fail_rank, phase, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        devices=2, max_steps=5, strategy=PTDPStrategy(**LAYOUTS[layout]), callbacks=[InjectFault(fail_rank, phase, mode)]
    )
    trainer.fit(CausalLM(NanoGPT(ZooConfig())), zoo_data(8, 6 * 8 * 33, 4 * 33))


if __name__ == "__main__":
    main()
