"""A p=2 pipeline job in which one rank raises in its training_step (for test_pipeline_failure).

Usage: python -m tests.integration.pipeline_failure_job FAIL_RANK [raise|kill] [TAG] (Lightning's
launcher) or the same under torchrun. "kill" ends the rank with SIGKILL instead of an exception;
TAG is ignored (it marks the job's processes). The run must end non-zero on every rank, quickly,
naming the failed rank.
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

FAIL_AT_BATCH = 2


class FailingLM(CausalLM):
    def __init__(self, fail_rank: int, mode: str) -> None:
        super().__init__(NanoGPT(ZooConfig()))
        self.fail_rank, self.mode = fail_rank, mode

    def training_step(self, batch, batch_idx):
        if batch_idx == FAIL_AT_BATCH and dist.get_rank() == self.fail_rank:
            print(f"fault-injected at {time.time():.3f}", file=sys.stderr, flush=True)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"injected failure on rank {self.fail_rank} at batch {batch_idx}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    fail_rank, mode = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "raise"
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=2, max_steps=5, strategy=PTDPStrategy(pipeline_parallel_size=2, micro_batch_size=2))
    trainer.fit(FailingLM(fail_rank, mode), zoo_data(8, 6 * 8 * 33, 4 * 33))


if __name__ == "__main__":
    main()
