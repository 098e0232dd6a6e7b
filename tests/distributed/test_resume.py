"""Interrupted and resumed training equals uninterrupted training, also on another TP layout."""

from __future__ import annotations

import pytest
import torch

STEPS_PER_EPOCH = 5
# fp32; a resumed run repeats the same arithmetic from the same weights, Adam moments, LR schedule
# and sampler epoch: identical on the same layout up to round-off, and within the TP tolerance
# (summation order) on another one.
LOSS_RTOL = 1e-5


def run_epochs(
    devices: int, tensor_parallel_size: int | None, epochs: int, save: str | None, resume: str | None, zero_stage: int = 0,
    pipeline: dict | None = None, layers: int = 2,
) -> list:
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from tests.fit_utils import LossRecorder, quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("llama", num_layers=layers)
    pipeline = pipeline or {}
    batch = 8 // (devices // ((tensor_parallel_size or 1) * pipeline.get("pipeline_parallel_size", 1)))
    data = MarkovDataModule(vocab_size=64, seq_length=32, batch_size=batch, train_tokens=STEPS_PER_EPOCH * 8 * 33 + 1,
                            val_tokens=100)
    strategy = PTDPStrategy(tensor_parallel_size=tensor_parallel_size or 1, zero_stage=zero_stage, **pipeline)
    recorder = LossRecorder()
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_epochs=epochs, callbacks=[recorder])
    trainer.fit(model, data, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return recorder.losses


@pytest.mark.world_size(2)
def test_resume_on_the_same_and_other_tp_layouts(dist_pool, tmp_path):
    path = str(tmp_path / "epoch1.ckpt")
    uninterrupted = dist_pool(2).run(run_epochs, 2, 2, 2, None, None)[0]
    first = dist_pool(2).run(run_epochs, 2, 2, 1, path, None)[0]
    assert first == pytest.approx(uninterrupted[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    checkpoint = torch.load(path, weights_only=False)
    moments = checkpoint["optimizer_states"][0]["state"]["net.tok_embeddings.weight"]["exp_avg"]
    assert moments.shape == checkpoint["state_dict"]["net.tok_embeddings.weight"].shape  # unsharded
    resumed_same = dist_pool(2).run(run_epochs, 2, 2, 2, None, path)[0]
    assert resumed_same == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)
    resumed_t4 = dist_pool(4).run(run_epochs, 4, 4, 2, None, path)[0]
    assert resumed_t4 == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)
    # and with the weights and Adam moments sharded again over d=2 by ZeRO-3 (t=2 x d=2)
    resumed_zero = dist_pool(4).run(run_epochs, 4, 2, 2, None, path, 3)[0]
    assert resumed_zero == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)


@pytest.mark.world_size(4)
def test_resume_across_pipeline_layouts(dist_pool, tmp_path):
    """Saved at (t2, p2, d1), resumed at (t1, p1, d4) and at (t1, p2 with v=2, d1); and a
    single-layout checkpoint resumed under a pipeline: losses continue as uninterrupted."""
    path, flat = str(tmp_path / "t2p2.ckpt"), str(tmp_path / "d4.ckpt")
    t2p2 = {"pipeline_parallel_size": 2, "micro_batch_size": 2}
    p2v2 = {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 1}
    uninterrupted = dist_pool(4).run(run_epochs, 4, None, 2, None, None, layers=4)[0]
    first = dist_pool(4).run(run_epochs, 4, 2, 1, path, None, pipeline=t2p2, layers=4)
    for losses in first:
        assert losses == pytest.approx(uninterrupted[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    resumed_d4 = dist_pool(4).run(run_epochs, 4, None, 2, None, path, layers=4)[0]
    assert resumed_d4 == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)
    dist_pool(4).run(run_epochs, 4, None, 1, flat, None, layers=4)
    resumed_p2v2 = dist_pool(2).run(run_epochs, 2, None, 2, None, flat, pipeline=p2v2, layers=4)
    for losses in resumed_p2v2:
        assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)
    resumed_from_pipeline = dist_pool(2).run(run_epochs, 2, None, 2, None, path, pipeline=p2v2, layers=4)
    for losses in resumed_from_pipeline:
        assert losses == pytest.approx(uninterrupted[STEPS_PER_EPOCH:], rel=LOSS_RTOL)
