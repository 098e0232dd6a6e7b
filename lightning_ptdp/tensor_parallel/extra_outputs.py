"""A value a tensor-parallel block returns besides its hidden states that is still sharded by heads
(eager attention's weights a block returns, a state it hands the next block): ``HeadShardedOutput`` holds
this rank's heads and is gathered whole over the tp group the first time anything reads it, so an
unread one (the usual case: the model keeps it only when asked for attentions) costs nothing and a
read one is the single process's value."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from lightning_ptdp.core.subclasses import run_converted
from lightning_ptdp.tensor_parallel.collectives import TPGroup


class _GatherHeads(Function):
    """Megatron's gather from the tensor-parallel region, along ``dim``: backward keeps this rank's part."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
        ctx.dim, ctx.tp = dim, tp
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        if not local.is_meta:  # a trial run on meta (trial.py): shapes only
            dist.all_gather(parts, local.contiguous(), group=tp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad.chunk(ctx.tp.size, dim=ctx.dim)[ctx.tp.rank].contiguous(), None, None


class HeadShardedOutput(torch.Tensor):
    """This rank's heads of an extra block output; any torch call on it sees the whole value."""

    _dim: int
    _tp: TPGroup
    _whole: Any = None

    @staticmethod
    def wrap(local: torch.Tensor, dim: int, tp: TPGroup) -> HeadShardedOutput:
        out = local.as_subclass(HeadShardedOutput)
        out._dim, out._tp = dim, tp
        return out

    def local(self) -> torch.Tensor:
        """This rank's heads, a plain tensor still attached to autograd."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def whole(self) -> torch.Tensor:
        """The gathered value (once per output, still attached to autograd)."""
        if self._whole is None:
            self._whole = _GatherHeads.apply(self.local(), self._dim, self._tp)
        return self._whole

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return run_converted(func, args, kwargs or {}, HeadShardedOutput, HeadShardedOutput.whole)


def wrap_extra_outputs(out: Any, sharded: dict[int, int], tp: TPGroup) -> Any:
    """The block's output tuple with each of ``sharded`` (index -> head dim) made a HeadShardedOutput."""
    if not sharded or not isinstance(out, tuple):
        return out
    return tuple(
        HeadShardedOutput.wrap(v, sharded[i], tp) if i in sharded and isinstance(v, torch.Tensor) else v
        for i, v in enumerate(out)
    )
