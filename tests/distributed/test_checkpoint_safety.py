"""Checkpoints that cannot be trusted are refused with the reason; a crash while saving leaves
the previous checkpoint whole, and ``ckpt_path="last"`` resumes from it as if never interrupted."""

from __future__ import annotations

from pathlib import Path

import pytest

STEPS_PER_EPOCH = 2
LOSS_RTOL = 1e-5  # fp32, same layout: the resumed run repeats the same arithmetic


def train(
    root: str,
    epochs: int,
    *,
    resume: str | None = None,
    model_overrides: dict | None = None,
    fail_save_at_epoch: int | None = None,
    family: str = "gpt",
    fmt: str = "full",
) -> dict:
    """Train with a ModelCheckpoint saving every epoch (and last.ckpt); optionally make the disk
    fail half-way through writing the checkpoint of one epoch (full: rank 0's file after 100 kB;
    sharded: rank 1's shard file, while rank 0 writes its own)."""
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint import FileSystemWriter

    import lightning_ptdp.checkpoint.io as checkpoint_module
    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from tests.fit_utils import LossRecorder, quiet_trainer
    from tests.models import build_model

    class FullDisk:
        """A file that takes 100 kB, then fails as a full disk does."""

        def __init__(self, path, mode):
            self.file, self.written = open(path, mode), 0

        def write(self, data):
            if self.written + len(data) > 100_000:
                raise OSError(28, "No space left on device")
            self.written += len(data)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    def full_shard_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    class FailingDisk(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if fail_save_at_epoch is None or trainer.current_epoch != fail_save_at_epoch:
                return
            if fmt == "full":
                checkpoint_module.open = FullDisk  # the module's own open(), seen by CheckedCheckpointIO
            elif dist.get_rank() == 1:
                FileSystemWriter.write_data = full_shard_disk

    L.seed_everything(0, verbose=False)
    data = MarkovDataModule(
        vocab_size=64, seq_length=32, batch_size=4, train_tokens=STEPS_PER_EPOCH * 8 * 33 + 1, val_tokens=100
    )
    recorder = LossRecorder()
    # the failing callback runs before ModelCheckpoint's save in the same hook
    callbacks = [
        FailingDisk(),
        ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1, every_n_epochs=1),
        recorder,
    ]
    write_data = FileSystemWriter.write_data
    trainer = quiet_trainer(
        devices=2,
        strategy=PTDPStrategy(checkpoint_format=fmt),
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=True,
    )
    try:
        trainer.fit(build_model(family, **(model_overrides or {})), data, ckpt_path=resume)
        error = None
    except Exception as caught:  # noqa: BLE001 - the message is what the test checks
        error = f"{type(caught).__name__}: {caught}"
    finally:
        checkpoint_module.__dict__.pop("open", None)
        FileSystemWriter.write_data = write_data
    return {
        "losses": recorder.losses,
        "error": error,
        "files": sorted(p.name for p in Path(root).iterdir()) if Path(root).is_dir() else [],
    }


@pytest.mark.world_size(2)
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_crash_while_saving_keeps_the_last_good_checkpoint(dist_pool, tmp_path, fmt):
    # dropout: the resumed losses equal the uninterrupted ones only if each rank's random stream
    # continues where the checkpoint left it (the checkpoints hold every rank's generator states)
    noisy = {"dropout": 0.1}
    uninterrupted = dist_pool(2).run(train, str(tmp_path / "a"), 4, fmt=fmt, model_overrides=noisy)[0]
    crashed = dist_pool(2).run(train, str(tmp_path / "b"), 4, fail_save_at_epoch=2, fmt=fmt, model_overrides=noisy)
    for r in crashed:  # every rank stops with the reason, none waits in the barrier after the save
        assert r["error"].startswith(
            f"CheckpointSaveError: saving checkpoint '{tmp_path / 'b'}/epoch=2-step=6.ckpt' failed"
        )
        assert "the previous checkpoint is untouched" in r["error"]
        failed = "rank 0 (OSError" if fmt == "full" else "(on rank 1: OSError"  # sharded: rank 1's own shard
        assert f"{failed}: [Errno 28] No space left on device)" in r["error"], r["error"]
    # epochs 0 and 1 saved whole; the partly written epoch-2 file or folder never took the name
    names = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    assert crashed[0]["files"] == (names if fmt == "full" else [".ptdp", *names])
    resumed = dist_pool(2).run(train, str(tmp_path / "b"), 4, resume="last", fmt=fmt, model_overrides=noisy)
    for r in resumed:
        assert r["error"] is None
        assert r["losses"] == pytest.approx(uninterrupted["losses"][2 * STEPS_PER_EPOCH :], rel=LOSS_RTOL)


@pytest.mark.world_size(2)
def test_a_truncated_or_foreign_checkpoint_is_refused_with_the_reason(dist_pool, tmp_path):
    root = tmp_path / "run"
    dist_pool(2).run(train, str(root), 1)
    good = root / "last.ckpt"
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    truncated = dist_pool(2).run(train, str(tmp_path / "x"), 2, resume=str(cut))
    for r in truncated:
        assert f"ValueError: checkpoint '{cut}'" in r["error"]
        assert (
            "is truncated or not a torch checkpoint" in r["error"] and "Resume from an earlier checkpoint" in r["error"]
        )
    wider = dist_pool(2).run(train, str(tmp_path / "y"), 2, resume=str(good), model_overrides={"hidden_size": 64})
    for r in wider:
        assert "the checkpoint's weights do not fit this model: " in r["error"]
        assert (
            "shapes differ, checkpoint vs model (first: gpt.token_embedding.weight (64, 32) vs (64, 64)" in r["error"]
        )
    other = dist_pool(2).run(train, str(tmp_path / "z"), 2, resume=str(good), family="nanogpt")
    for r in other:
        assert (
            "entries are missing (first: net.wte.weight" in r["error"]
            and "entries are not in this model (first: gpt." in r["error"]
        )
