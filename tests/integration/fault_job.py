"""A 2-process job in which one rank raises or is killed in a chosen phase (for test_faults).

Usage: python -m tests.integration.fault_job LAYOUT FAIL_RANK PHASE MODE [DIR] [TAG] (Lightning's
launcher), or the same under torchrun. LAYOUT: dp (d=2), tp (t=2) or pp (p=2); PHASE: backward
(a gradient hook of a parameter raises, mid-backward), optimizer (on_before_optimizer_step),
save (while writing its part of the second ``last.ckpt``, sharded format) or save-full (the same
in the full format, where rank 0 is the only writer); MODE: raise (an exception) or kill (SIGKILL,
no chance to report). DIR (the save phases): where ModelCheckpoint writes, every SAVE_EVERY steps.
TAG is ignored: it marks the job's processes so a test can find any left behind. Before
injecting, the rank prints ``fault-injected at <unix time>`` so the test can time every rank's
exit from the fault.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ptdp import PTDPStrategy
from tests.fit_utils import quiet_trainer, zoo_data
from tests.models import CausalLM, NanoGPT, ZooConfig

FAIL_AT_BATCH = 2  # a later batch than the first, so every rank is inside steady-state training
SAVE_EVERY = 2  # steps 2 and 4 save (max_steps=5): the fault is in the second save, the first is complete
FAILING_SAVE = 2  # which write of last.ckpt fails
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


class FailWhileSaving(L.Callback):
    """On ``fail_rank``: fail by ``mode`` half way through writing its part of the FAILING_SAVE-th
    ``last.ckpt``, after flushing what it wrote (the periodic checkpoint of that step is complete).
    Sharded: inside DCP's ``FileSystemWriter.write_data``, after half of this rank's items. Full:
    inside ``CheckedCheckpointIO.save_checkpoint``, after half of the file's bytes."""

    def __init__(self, fail_rank: int, phase: str, mode: str) -> None:
        self.fail_rank, self.phase, self.mode, self.writes = fail_rank, phase, mode, 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == self.fail_rank:  # patched in this process only
            self._patch_full() if self.phase == "save-full" else self._patch_sharded()

    def _armed(self, name: str, prefix: str) -> bool:
        if name.startswith(prefix):
            self.writes += 1
        return name.startswith(prefix) and self.writes == FAILING_SAVE

    def _patch_sharded(self) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        write_data, callback = FileSystemWriter.write_data, self

        def failing_write_data(writer: Any, plan: Any, planner: Any) -> Any:
            if not callback._armed(Path(writer.path).name, "last.ckpt.v"):  # the version folder of last.ckpt
                return write_data(writer, plan, planner)
            streams, resolve, create_stream, left = (
                [],
                planner.resolve_data,
                writer.fs.create_stream,
                len(plan.items) // 2,
            )

            @contextmanager
            def recorded_stream(path: Any, mode: str) -> Any:
                with create_stream(path, mode) as stream:
                    streams.append(stream)
                    yield stream

            def resolve_data(item: Any) -> Any:
                nonlocal left
                left -= 1
                if left < 0:
                    for stream in streams:
                        stream.flush()
                    inject(callback.phase, callback.mode)
                return resolve(item)

            writer.fs.create_stream, planner.resolve_data = recorded_stream, resolve_data
            return write_data(writer, plan, planner)

        FileSystemWriter.write_data = failing_write_data

    def _patch_full(self) -> None:
        save, callback = torch.save, self

        def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not callback._armed(os.path.basename(str(getattr(f, "name", ""))), ".last.ckpt.partial"):
                return save(obj, f, *args, **kwargs)
            whole = io.BytesIO()
            save(obj, whole, *args, **kwargs)
            f.write(whole.getbuffer()[: whole.tell() // 2])
            f.flush()
            os.fsync(f.fileno())
            inject(callback.phase, callback.mode)

        torch.save = failing_save


def main() -> None:
    layout, fail_rank, phase, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    L.seed_everything(0, verbose=False)
    strategy, callbacks, saving = dict(LAYOUTS[layout]), [InjectFault(fail_rank, phase, mode)], {}
    if phase in ("save", "save-full"):
        strategy["checkpoint_format"] = "full" if phase == "save-full" else "sharded"
        callbacks = [
            ModelCheckpoint(dirpath=sys.argv[5], save_last=True, every_n_train_steps=SAVE_EVERY, save_top_k=-1),
            FailWhileSaving(fail_rank, phase, mode),
        ]
        saving = {"enable_checkpointing": True}
    trainer = quiet_trainer(devices=2, max_steps=5, strategy=PTDPStrategy(**strategy), callbacks=callbacks, **saving)
    trainer.fit(CausalLM(NanoGPT(ZooConfig())), zoo_data(8, 6 * 8 * 33, 4 * 33))


if __name__ == "__main__":
    main()
