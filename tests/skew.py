"""A router made skewed for the tests: while a training batch runs, every ``topk`` over a last
dimension of ``n_experts`` scores sees a fixed bias toward the first two experts, whatever the
family's router (probabilities or logits, torch.topk or Tensor.topk): the same in one process
and in any layout, so the oracle still holds, and two experts run hot."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.overrides import TorchFunctionMode

HOT = (0, 1)
BIAS = 0.2


class _Skew(TorchFunctionMode):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.bias = torch.zeros(num_experts)
        self.bias[list(HOT)] = BIAS

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk) and args and torch.is_tensor(args[0]):
            scores = args[0]
            if scores.is_floating_point() and scores.dim() >= 1 and scores.shape[-1] == self.bias.numel():
                args = (scores + self.bias.to(scores.device, scores.dtype), *args[1:])
        return func(*args, **kwargs)


class SkewedRouting(L.Callback):
    """Enter the skew for each training batch (the schedule's forward and backward run inside it)."""

    def __init__(self, num_experts: int = 4) -> None:
        self.num_experts = num_experts
        self._mode: _Skew | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._mode = _Skew(self.num_experts)
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._leave()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._leave()  # a step that raised: the pool's next call must not run skewed

    def _leave(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
