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
      forward (dispatch and combine) and backward (as much again).

    ``history`` keeps the last ``keep`` steps' tokens per expert, by layer (CPU tensors of n_experts
    counts); ``metrics`` the last step's logged values.
    """

    def __init__(self, keep: int = 100) -> None:
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=keep)
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
        self.metrics = {
            "moe/imbalance": float(ratio[hot_layer]),
            "moe/hot_expert": float(counts[hot_layer].argmax()),
            "moe/hot_layer": float(hot_layer),
            "moe/all_to_all_bytes": float(2 * stats.bytes_sent),
        }
        pl_module.log_dict(self.metrics, on_step=True, on_epoch=False)
