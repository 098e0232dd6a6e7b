"""ExpertLoad: what expert parallelism's routing did each training step, logged through Lightning."""

from __future__ import annotations

from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch


class ExpertLoad(pl.Callback):
    """Log, every training step of a run with ``expert_parallel_size > 1``:

    * ``moe/imbalance``: tokens of the hottest expert over the mean, in the most imbalanced MoE
      layer (1.0: balanced; n_experts: one expert took every token), over the whole global batch;
    * ``moe/hot_expert``: that expert's index, and ``moe/hot_layer`` its layer's position;
    * ``moe/all_to_all_bytes``: bytes this rank sent to other ranks in the step's token exchanges,
      forward (dispatch and combine) and backward (as much again);
    * ``moe/busiest_link_bytes``: the bytes of the step's busiest rank-to-rank link, all MoE layers
      summed, and ``moe/link_imbalance`` that over the mean link between two ranks;
    * ``moe/busiest_rank_rows``: the (token, expert) rows of the global batch the experts of the
      busiest ep rank computed (its replicas together), and ``moe/rank_imbalance`` that over the mean
      (1.0: every ep rank computes as many); ``moe/rank_imbalance_fixed`` the same had each rank held
      its fixed n/e experts (with ``expert_balance``: before balancing, against after).

    ``history`` keeps the last ``keep`` steps' tokens per expert, by layer (CPU tensors of n_experts
    counts); ``traffic`` the last step's all-to-all bytes from each ep rank (row) to each (column), by
    layer, summed over the replicas; ``metrics`` the last step's logged values.
    """

    def __init__(self, keep: int = 100) -> None:
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=keep)
        self.traffic: dict[str, torch.Tensor] = {}
        self.metrics: dict[str, float] = {}

    @staticmethod
    def _stats(trainer: pl.Trainer) -> Any:
        report = getattr(trainer.strategy, "expert_report", None)
        return report.stats if report is not None else None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        stats = self._stats(trainer)
        if stats is None or not stats.tokens_per_expert:
            return
        layers = sorted(stats.tokens_per_expert)
        local = torch.stack([stats.tokens_per_expert[name] for name in layers]).double()
        counts = trainer.strategy.reduce(local.to(pl_module.device), reduce_op="sum").cpu()  # over the dp ranks
        self.history.append({name: row.clone() for name, row in zip(layers, counts)})
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)
        hot_layer = int(ratio.argmax())
        self.traffic = traffic_matrices(trainer, stats, pl_module.device)
        links = sum(self.traffic.values())
        fixed = counts.view(len(layers), stats.ep_size, -1).sum(dim=(0, 2))  # the rows each of n/e experts takes
        rows = rows_per_rank(trainer, stats, pl_module.device)
        off = ~torch.eye(stats.ep_size, dtype=torch.bool)
        self.metrics = {
            "moe/imbalance": float(ratio[hot_layer]),
            "moe/hot_expert": float(counts[hot_layer].argmax()),
            "moe/hot_layer": float(hot_layer),
            "moe/all_to_all_bytes": float(2 * stats.bytes_sent),
            "moe/busiest_link_bytes": float(links.max()),
            "moe/link_imbalance": float(links.max() / links[off].mean().clamp_min(1e-12)) if off.any() else 1.0,
            "moe/busiest_rank_rows": float(rows.max()),
            "moe/rank_imbalance": float(rows.max() / rows.mean().clamp_min(1e-12)),
            "moe/rank_imbalance_fixed": float(fixed.max() / fixed.mean().clamp_min(1e-12)),
        }
        pl_module.log_dict(self.metrics, on_step=True, on_epoch=False)


def rows_per_rank(trainer: pl.Trainer, stats: Any, device: torch.device) -> torch.Tensor:
    """The (token, expert) rows each ep rank's experts computed this step, all layers, summed over
    the replicas (every rank calls this: it all-reduces)."""
    local = torch.zeros(stats.ep_size, dtype=torch.float64)
    local[stats.ep_rank] = float(sum(stats.rows_computed.values()))
    return _over_replicas(trainer, local.to(device)).cpu()


def _over_replicas(trainer: pl.Trainer, tensor: torch.Tensor) -> torch.Tensor:
    replicas = trainer.strategy.parallel_dims.replica_mesh(trainer.strategy.device_mesh)  # ep groups are cut from these
    if replicas.size() > 1:
        torch.distributed.all_reduce(tensor, group=replicas.get_group())
    return tensor


def traffic_matrices(trainer: pl.Trainer, stats: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The step's all-to-all bytes from each ep rank (row) to each (column), forward and backward (as
    much again), by MoE layer, summed over the replicas (every rank calls this: it all-reduces)."""
    layers = sorted(stats.bytes_to)
    local = torch.zeros(len(layers), stats.ep_size, stats.ep_size, dtype=torch.float64)
    for i, name in enumerate(layers):
        local[i, stats.ep_rank] = stats.bytes_to[name].double()
    summed = _over_replicas(trainer, local.to(device))
    return {name: 2 * matrix for name, matrix in zip(layers, summed.cpu())}
