"""Lightning features that decide across ranks behave as on one process under every layout:
ModelCheckpoint's best-k set and file names, EarlyStopping's epoch."""

from __future__ import annotations

import os

import lightning as L
import pytest

from recipes.gpt import GPTLightningModule

# A monitored score (mode "min") that goes up and down: with save_top_k=2 one process keeps
# epochs 3 and 5 (best 1.0); EarlyStopping(patience=3) stops after epoch 6 (no improvement in 4-6).
SCORES = [3.0, 2.0, 4.0, 1.0, 5.0, 1.5, 6.0, 0.5]
TOP_K, PATIENCE = 2, 3


class ScoredGPT(GPTLightningModule):
    """The recipe GPT, logging the epoch's score from validation_step (through the pipeline's
    log replay under PP)."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("score", SCORES[self.current_epoch], batch_size=batch[0].shape[0])


def fit_with_monitors(strategy_kwargs: dict | None, devices: int, root: str) -> dict:
    """Fit for up to len(SCORES) epochs with a top-k ModelCheckpoint whose names collide (a fixed
    filename: the version counter decides them) and EarlyStopping on the same score."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from recipes.gpt import GPTConfig, OptimConfig
    from tests.fit_utils import quiet_trainer, strategy_from, zoo_data

    L.seed_everything(0, verbose=False)
    model = ScoredGPT(GPTConfig(vocab_size=64, seq_length=32, num_layers=4, num_heads=4, hidden_size=32), OptimConfig())
    dirpath = os.path.join(root, "ckpts")
    top_k = ModelCheckpoint(dirpath=dirpath, filename="best", monitor="score", mode="min", save_top_k=TOP_K)
    stop = EarlyStopping(monitor="score", mode="min", patience=PATIENCE)
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy_from(strategy_kwargs),
        max_epochs=len(SCORES),
        callbacks=[top_k, stop],
        enable_checkpointing=True,
        limit_train_batches=1,
        limit_val_batches=1,
    )
    trainer.fit(model, zoo_data(8, 40 * 33, 8 * 33))
    scores = {os.path.basename(path): float(score) for path, score in top_k.best_k_models.items()}
    return {
        "best_k": scores,
        "best_score": float(top_k.best_model_score),
        "best_path": os.path.basename(top_k.best_model_path),
        "on_disk": sorted(name for name in os.listdir(dirpath) if name.endswith(".ckpt")),
        "stopped_epoch": stop.stopped_epoch,
        "current_epoch": trainer.current_epoch,
    }


LAYOUTS = [
    (2, {"tensor_parallel_size": 2}),
    (2, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2}),
    (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2}),
]


@pytest.mark.parametrize(("devices", "strategy_kwargs"), LAYOUTS, ids=["t2", "p2v2", "t2p2"])
def test_top_k_checkpoints_and_early_stopping_as_one_process(dist_pool, tmp_path, devices, strategy_kwargs):
    ref = fit_with_monitors(None, 1, str(tmp_path / "ref"))
    assert sorted(ref["best_k"].values()) == [1.0, 1.5] and ref["best_score"] == 1.0
    assert ref["stopped_epoch"] == 6
    results = dist_pool(devices).run(fit_with_monitors, strategy_kwargs, devices, str(tmp_path / "run"))
    for rank, result in enumerate(results):
        assert result == ref, f"rank {rank}: {result} where one process has {ref}"


class LoggingGPT(GPTLightningModule):
    """Logs with every reduce_fx, per step and per epoch: under PP each microbatch logs its part."""

    def training_step(self, batch, batch_idx):
        import torch.nn.functional as F

        inputs, targets = batch
        per_token = F.cross_entropy(self(inputs).flatten(0, 1).float(), targets.flatten(), reduction="none")
        loss = per_token.mean()
        both = {"on_step": True, "on_epoch": True}
        self.log("samples", float(len(inputs)), reduce_fx="sum", **both)
        self.log("max_token_loss", per_token.max(), reduce_fx="max", **both)
        self.log("min_token_loss", per_token.min(), reduce_fx="min", **both)
        self.log("mean_loss", loss, batch_size=len(inputs), **both)
        return loss


class StepMetrics(L.Callback):
    """The step values of callback_metrics after every batch."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("_step")})


def fit_and_log(strategy_kwargs: dict | None, devices: int) -> dict:
    """Two epochs of a 12-sample set in batches of 8 and 4 (no drop_last: the epoch mean weights them)."""
    from torch.utils.data import DataLoader, DistributedSampler, Subset

    from recipes.gpt import GPTConfig, OptimConfig
    from tests.fit_utils import quiet_trainer, strategy_from, zoo_data

    L.seed_everything(0, verbose=False)
    model = LoggingGPT(
        GPTConfig(vocab_size=64, seq_length=32, num_layers=2, num_heads=4, hidden_size=32), OptimConfig()
    )
    data = zoo_data(8, 20 * 33, 8 * 33)
    data.setup("fit")
    samples = Subset(data.train_set, range(12))  # the shuffled order Lightning gives d=1, also for one process
    loader = DataLoader(samples, batch_size=8, sampler=DistributedSampler(samples, num_replicas=1, rank=0, seed=0))
    recorder = StepMetrics()
    trainer = quiet_trainer(
        devices=devices, strategy=strategy_from(strategy_kwargs), max_epochs=2, callbacks=[recorder]
    )
    trainer.fit(model, train_dataloaders=loader)
    epoch = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("_epoch")}
    return {"steps": recorder.steps, "epoch": epoch}


LOG_RTOL = 1e-5  # fp32: microbatch losses equal the batch's rows' up to summation order (test_pipeline.py)


@pytest.mark.world_size(2)
def test_logged_values_under_pipeline_follow_reduce_fx(dist_pool):
    ref = fit_and_log(None, 1)
    assert [s["samples_step"] for s in ref["steps"]] == [8.0, 4.0, 8.0, 4.0] and ref["epoch"]["samples_epoch"] == 12.0
    kwargs = {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}  # m = 4, then 2
    for rank, result in enumerate(dist_pool(2).run(fit_and_log, kwargs, 2)):
        assert len(result["steps"]) == len(ref["steps"])
        for step, (got, expected) in enumerate(zip(result["steps"], ref["steps"])):
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert got[name] == pytest.approx(value, rel=LOG_RTOL), f"rank {rank} step {step}: {name}"
        assert result["epoch"].keys() == ref["epoch"].keys()
        for name, value in ref["epoch"].items():
            assert result["epoch"][name] == pytest.approx(value, rel=LOG_RTOL), f"rank {rank} epoch: {name}"
