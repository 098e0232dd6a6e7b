"""Interrupted and resumed training equals uninterrupted training, also on other layouts: the losses
of the resumed steps, then the weights and optimizer state they end with, every tensor whole."""

from __future__ import annotations

import os

import pytest

STEPS_PER_EPOCH = 5
# fp32; a resumed run repeats the same arithmetic from the same weights, Adam moments, LR schedule
# and sampler epoch: identical on the same layout up to round-off, and within the TP tolerance
# (summation order) on another one.
LOSS_RTOL = 1e-5
# The state after the resumed steps, fp32: weights relative to how far those steps moved them (Adam
# turns round-off on small gradients into visible updates: 1e-3 of the update, as test_real_models.py;
# measured at most 3e-5), Adam's moments relative to their own norm: a first epoch on another layout
# sums in another order, and the resumed steps carry that on (measured at most 1.6e-5: a Mixtral expert's
# exp_avg_sq, saved at d2-e2). A moment not restored misses 0.9^k of exp_avg after k resumed steps, and
# most of exp_avg_sq.
UPDATE_REL = 1e-3
MOMENT_REL = 1e-4


def whole_checkpoint(path: str) -> dict:
    """A checkpoint as the full format holds it (whole weights, optimizer state keyed by parameter
    name), read with no process group: a sharded one consolidated, a full one loaded."""
    import torch

    from lightning_ptdp.checkpoint.command import consolidate

    return consolidate(path) if os.path.isdir(path) else torch.load(path, map_location="cpu", weights_only=False)


def assert_same_training_state(resumed: str, uninterrupted: str, resumed_from: str) -> None:
    """After the resumed steps, the checkpoint ``resumed`` holds the weights and optimizer state of
    ``uninterrupted`` (every tensor whole): each weight within UPDATE_REL of its move since
    ``resumed_from``, each Adam moment within MOMENT_REL of itself, the step counts equal."""
    from tests.fit_utils import relative_error

    got, want, start = (whole_checkpoint(path) for path in (resumed, uninterrupted, resumed_from))
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for name, expected in want["state_dict"].items():
        if expected.is_floating_point():
            err = relative_error(got["state_dict"][name], expected, expected - start["state_dict"][name])
            assert err <= UPDATE_REL, f"weight {name}: error {err:.2e} of its resumed update > {UPDATE_REL:.0e}"
    assert len(got["optimizer_states"]) == len(want["optimizer_states"]) > 0
    for mine, theirs in zip(got["optimizer_states"], want["optimizer_states"]):
        assert mine["state"].keys() == theirs["state"].keys() and theirs["state"]
        for name, fields in theirs["state"].items():
            assert mine["state"][name].keys() == fields.keys(), name
            for field, expected in fields.items():
                if expected.dim() == 0:  # Adam's step count
                    assert float(mine["state"][name][field]) == float(expected), (name, field)
                else:
                    err = relative_error(mine["state"][name][field], expected, expected)
                    assert err <= MOMENT_REL, f"{field} of {name}: relative error {err:.2e} > {MOMENT_REL:.0e}"


def run_epochs(
    devices: int,
    tensor_parallel_size: int | None,
    epochs: int,
    save: str | None,
    resume: str | None,
    zero_stage: int = 0,
    pipeline: dict | None = None,
    layers: int = 2,
    checkpoint_format: str = "sharded",
    three_groups: bool = False,
) -> list:
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from tests.fit_utils import LossRecorder, quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("llama", num_layers=layers)
    if three_groups:
        model.configure_optimizers = lambda: three_param_groups(model)
    pipeline = pipeline or {}
    split = pipeline.get("pipeline_parallel_size", 1) * pipeline.get("context_parallel_size", 1)
    batch = 8 // (devices // ((tensor_parallel_size or 1) * split))
    data = MarkovDataModule(
        vocab_size=64, seq_length=32, batch_size=batch, train_tokens=STEPS_PER_EPOCH * 8 * 33 + 1, val_tokens=100
    )
    strategy = PTDPStrategy(
        tensor_parallel_size=tensor_parallel_size or 1,
        zero_stage=zero_stage,
        checkpoint_format=checkpoint_format,
        **pipeline,
    )
    recorder = LossRecorder()
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_epochs=epochs, callbacks=[recorder])
    trainer.fit(model, data, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return recorder.losses


@pytest.mark.world_size(2)
def test_resume_on_the_same_and_other_tp_layouts(dist_pool, tmp_path):
    from lightning_ptdp.checkpoint.command import consolidate

    path, end = str(tmp_path / "epoch1.ckpt"), str(tmp_path / "end.ckpt")
    uninterrupted = dist_pool(2).run(run_epochs, 2, 2, 2, end, None)[0]
    first = dist_pool(2).run(run_epochs, 2, 2, 1, path, None)[0]
    assert first == pytest.approx(uninterrupted[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    checkpoint = consolidate(path)  # the sharded checkpoint put together, no process group
    moments = checkpoint["optimizer_states"][0]["state"]["net.tok_embeddings.weight"]["exp_avg"]
    assert moments.shape == checkpoint["state_dict"]["net.tok_embeddings.weight"].shape  # unsharded
    # resumed on the same layout, at t=4, and with the weights and Adam moments sharded again over
    # d=2 by ZeRO-3 (t=2 x d=2): the losses, then the weights and optimizer state at the end
    for devices, tp, zero_stage in ((2, 2, 0), (4, 4, 0), (4, 2, 3)):
        resumed = str(tmp_path / f"t{tp}-zero{zero_stage}.ckpt")
        losses = dist_pool(devices).run(run_epochs, devices, tp, 2, resumed, path, zero_stage)[0]
        assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL), (tp, zero_stage)
        assert_same_training_state(resumed, end, path)


@pytest.mark.world_size(4)
def test_resume_across_pipeline_layouts(dist_pool, tmp_path):
    """Sharded checkpoints saved at (t2, p2, d1), resumed at (t1, p1, d4) and (t4, p1, d1); one
    saved by ZeRO-3 at d4 resumed at (t1, p2 with v=2, d1): losses continue as uninterrupted."""
    path, flat, end = (str(tmp_path / name) for name in ("t2p2.ckpt", "d4.ckpt", "end.ckpt"))
    t2p2 = {"pipeline_parallel_size": 2, "micro_batch_size": 2}
    p2v2 = {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 1}
    uninterrupted = dist_pool(4).run(run_epochs, 4, None, 2, end, None, layers=4)[0]
    first = dist_pool(4).run(run_epochs, 4, 2, 1, path, None, pipeline=t2p2, layers=4)
    for losses in first:
        assert losses == pytest.approx(uninterrupted[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    for tp in (None, 4):  # resumed at d4 and at t4
        resumed = str(tmp_path / f"t{tp}.ckpt")
        losses = dist_pool(4).run(run_epochs, 4, tp, 2, resumed, path, layers=4)[0]
        assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL), tp
        assert_same_training_state(resumed, end, path)
    dist_pool(4).run(run_epochs, 4, None, 1, flat, None, 3, layers=4)  # saved sharded by ZeRO-3 over d=4
    resumed = str(tmp_path / "p2v2.ckpt")
    for losses in dist_pool(2).run(run_epochs, 2, None, 2, resumed, flat, pipeline=p2v2, layers=4):
        assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)
    assert_same_training_state(resumed, end, flat)


@pytest.mark.world_size(4)
def test_context_parallel_checkpoints_resume_on_other_layouts(dist_pool, tmp_path):
    """Parameters are replicated over cp: a checkpoint saved at c2-d2 with ZeRO-3 (weights and Adam
    moments sharded over d x c = 4) resumes at d4 and at c2-t2, and one saved at d4 resumes at c4."""
    path, flat, end = (str(tmp_path / name) for name in ("c2d2.ckpt", "d4.ckpt", "end.ckpt"))
    c2, c4 = {"context_parallel_size": 2}, {"context_parallel_size": 4}
    uninterrupted = dist_pool(4).run(run_epochs, 4, None, 2, end, None)[0]
    first = dist_pool(4).run(run_epochs, 4, None, 1, path, None, 3, pipeline=c2)
    for losses in first:
        assert losses == pytest.approx(uninterrupted[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    dist_pool(4).run(run_epochs, 4, None, 1, flat, None)
    # (from, tp, layout): d4 and c2-t2 from c2-d2-zero3's checkpoint, c4 from d4's
    for number, (start, tp, layout) in enumerate(((path, None, None), (path, 2, c2), (flat, None, c4))):
        resumed = str(tmp_path / f"resumed{number}.ckpt")
        for losses in dist_pool(4).run(run_epochs, 4, tp, 2, resumed, start, pipeline=layout):
            assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL), (tp, layout)
        assert_same_training_state(resumed, end, start)


def three_param_groups(model):
    """Weights with decay, then two one-parameter groups without: at d=4 ZeRO-1 puts each small
    group's parameter on one rank, so two ranks own nothing of two groups."""
    import torch

    alone = ("net.norm.weight", "net.layers.0.attention_norm.weight")
    rest = [p for n, p in model.named_parameters() if n not in alone]
    groups = [{"params": rest, "weight_decay": 0.01}]
    groups += [{"params": [p for n, p in model.named_parameters() if n == name], "weight_decay": 0.0} for name in alone]
    return torch.optim.AdamW(groups, lr=model.lr)


@pytest.mark.world_size(4)
def test_zero1_checkpoints_resume_on_other_layouts(dist_pool, tmp_path):
    """ZeRO-1 at d=4 keeps each Adam moment on one dp rank: saved sharded (each rank its own) and
    full (gathered), resumed at t=2 d=2 under ZeRO-1 and without ZeRO; and a t=2 checkpoint
    resumed into ZeRO-1 at d=4 (each rank loading only what it owns): losses continue as
    uninterrupted. Three parameter groups, two of them a single parameter: ranks owning nothing of
    a group load it too (torch's state-dict helpers refuse two such groups)."""
    sharded, full, t2, end = (str(tmp_path / n) for n in ("zero1.ckpt", "zero1-full.ckpt", "t2.ckpt", "end.ckpt"))
    groups = {"three_groups": True}
    uninterrupted = dist_pool(4).run(run_epochs, 4, None, 2, end, None, **groups)[0]
    for path, fmt in ((sharded, "sharded"), (full, "full")):
        first = dist_pool(4).run(run_epochs, 4, None, 1, path, None, 1, checkpoint_format=fmt, **groups)
        for losses in first:
            assert losses == pytest.approx(uninterrupted[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    dist_pool(4).run(run_epochs, 4, 2, 1, t2, None, **groups)
    for number, (path, tp, zero_stage) in enumerate(
        ((sharded, None, 1), (full, None, 1), (sharded, 2, 1), (full, 2, 0), (t2, None, 1))
    ):
        resumed = str(tmp_path / f"resumed{number}.ckpt")
        losses = dist_pool(4).run(run_epochs, 4, tp, 2, resumed, path, zero_stage, **groups)[0]
        assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL), (path, tp, zero_stage)
        assert_same_training_state(resumed, end, path)


def run_mid_epoch(root: str, *, crash_at_step: int | None = None, resume: str | None = None) -> dict:
    """One epoch of 6 steps on d=2; checkpoint every 2 steps; optionally every rank stops at
    ``crash_at_step`` (before it trains). Records each step's loss and the samples it trained on."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from tests.fit_utils import LossRecorder, quiet_trainer
    from tests.models import build_model

    class Crash(Exception):
        pass

    class Samples(L.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if crash_at_step is not None and trainer.global_step == crash_at_step:
                raise Crash
            self.seen.append(tuple(tuple(row[:6].tolist()) for row in batch[0]))

    L.seed_everything(0, verbose=False)
    data = MarkovDataModule(vocab_size=64, seq_length=32, batch_size=4, train_tokens=6 * 8 * 33 + 1, val_tokens=100)
    recorder, samples = LossRecorder(), Samples()
    checkpoints = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(
        devices=2,
        strategy=PTDPStrategy(),
        max_epochs=1,
        callbacks=[samples, recorder, checkpoints],
        enable_checkpointing=True,
    )
    try:
        trainer.fit(build_model("llama"), data, ckpt_path=resume)
    except Crash:
        pass
    return {"losses": recorder.losses, "samples": samples.seen, "dataset": len(data.train_set)}


STEP4 = "epoch=0-step=4.ckpt"  # ModelCheckpoint's name for the checkpoint at step 4


@pytest.mark.world_size(2)
def test_mid_epoch_resume_continues_at_the_checkpoints_sample(dist_pool, tmp_path):
    """Killed after step 5 with the last checkpoint at step 4: the resumed run trains steps 5-6 on
    exactly the samples the uninterrupted run did, with the same losses; over the interrupted and
    resumed runs every sample of the epoch is trained on once (counted), none skipped."""
    whole = dist_pool(2).run(run_mid_epoch, str(tmp_path / "whole"))
    crashed = dist_pool(2).run(run_mid_epoch, str(tmp_path / "run"), crash_at_step=5)
    resumed = dist_pool(2).run(run_mid_epoch, str(tmp_path / "run"), resume="last")
    for rank in range(2):
        assert len(whole[rank]["samples"]) == 6 and len(crashed[rank]["samples"]) == 5
        kept = crashed[rank]["samples"][:4]  # step 5 ran after the step-4 checkpoint: lost, redone
        assert kept + resumed[rank]["samples"] == whole[rank]["samples"]
        assert resumed[rank]["losses"] == pytest.approx(whole[rank]["losses"][4:], rel=LOSS_RTOL)
        sequences = [row for batch in kept + resumed[rank]["samples"] for row in batch]
        assert len(sequences) == len(set(sequences)) == 24  # 6 steps x 4 sequences, none repeated
    assert whole[0]["dataset"] == 49  # 2 ranks x 6 batches x 4 sequences trained per epoch (drop_last)
    # after step 6 (the last checkpoint of each run), resumed from the one at step 4
    run = tmp_path / "run"
    assert_same_training_state(str(run / "last.ckpt"), str(tmp_path / "whole" / "last.ckpt"), str(run / STEP4))
