"""Lightning semantics under ptdp data parallelism: sampler on the dp axis, logged reductions."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.fit_utils import quiet_trainer

NUM_SAMPLES = 48
BATCH = 3


class IndexDataset(Dataset):
    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class IndexRecorder(L.LightningModule):
    """Records the sample indices it trains on and logs its rank with several reductions."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        # the fit loop's batches (training_step also runs once at setup: the probe step, logging muted)
        self.seen.extend(batch.tolist())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        rank = torch.tensor(float(self.trainer.global_rank))
        self.log("rank_mean", rank, sync_dist=True, on_step=False, on_epoch=True, batch_size=BATCH)
        self.log("rank_sum", rank, sync_dist=True, reduce_fx="sum", on_step=True, on_epoch=False, batch_size=BATCH)
        self.log("rank_max", rank, sync_dist=True, reduce_fx="max", on_step=True, on_epoch=False, batch_size=BATCH)
        return (self.weight * batch.float()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(), batch_size=BATCH, shuffle=True)


def one_epoch(devices: int) -> dict:
    from lightning_ptdp import PTDPStrategy

    model = IndexRecorder()
    trainer = quiet_trainer(devices=devices, strategy=PTDPStrategy(), max_epochs=1)
    trainer.fit(model)
    sampler = trainer.train_dataloader.sampler
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"seen": model.seen, "metrics": metrics, "sampler": (sampler.num_replicas, sampler.rank)}


@pytest.mark.world_size(4)
def test_each_dp_rank_sees_disjoint_samples_and_every_sample_once(dist_pool):
    results = dist_pool(4).run(one_epoch, 4)
    seen = [set(r["seen"]) for r in results]
    for rank, r in enumerate(results):
        assert r["sampler"] == (4, rank)
        assert len(r["seen"]) == len(seen[rank]) == NUM_SAMPLES // 4, f"rank {rank} saw a sample twice"
    for a in range(4):
        for b in range(a + 1, 4):
            assert not seen[a] & seen[b], f"ranks {a} and {b} share samples {sorted(seen[a] & seen[b])}"
    counts = torch.bincount(torch.tensor([i for r in results for i in r["seen"]]), minlength=NUM_SAMPLES)
    assert counts.tolist() == [1] * NUM_SAMPLES


@pytest.mark.world_size(4)
def test_sync_dist_reduces_over_dp(dist_pool):
    results = dist_pool(4).run(one_epoch, 4)
    for r in results:
        assert r["metrics"]["rank_mean"] == 1.5  # mean of ranks 0..3
        assert r["metrics"]["rank_sum"] == 6.0
        assert r["metrics"]["rank_max"] == 3.0
