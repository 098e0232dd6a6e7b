"""Sequence parallelism's column-parallel Linear: keep 1/t of the input for backward, not all of it.

Under SP a region's input X = [X_1; ...; X_t] is all-gathered once at the region's entry for the
column Linears Y = X A_i, whose weight gradient needs all of X. As Korthikanti et al. 2022 (4.2.2)
and Megatron do, each column Linear gets ``SavedInputShard`` (X_r and one ``Regather`` shared by the
region, so q, k, v gather once in backward), saves X_r, and returns dX at full length; the entry's
reduce-scatter makes it 1/t again. A Function, not saved-tensor hooks on the region: those would
shadow active hooks (recompute, offload) and could not recognise autocast's casts of X.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.overrides import handle_torch_function, has_torch_function_variadic

from lightning_ptdp.tensor_parallel.collectives import TPGroup, all_gather_sequence


class Regather:
    """In backward: the whole X from a saved shard, gathered once for all the region's Linears.

    Each Linear registers in forward; the gathered X is cached until the last registered one has
    used it (then released). A second backward through a retained graph gathers again per use.
    Every TP rank runs the same Linears' backward in the same order, so the all-gathers match.
    """

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._users = 0
        self._whole: torch.Tensor | None = None

    def register(self) -> None:
        self._users += 1

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        whole = self._whole if self._whole is not None else all_gather_sequence(shard, self.tp)
        self._users -= 1
        self._whole = whole if self._users > 0 else None
        return whole


class SavedInputShard:
    """This rank's X_r of one region input in one forward (it lives only while that forward runs:
    the Linears' autograd nodes keep the saved tensor and the ``Regather``, not this object)."""

    def __init__(self, shard: torch.Tensor, tp: TPGroup) -> None:
        self.regather = Regather(tp)
        self._by_dtype = {shard.dtype: shard.detach()}

    def saved(self, dtype: torch.dtype) -> torch.Tensor:
        """X_r in the dtype the Linears compute in (autocast's): one tensor for all of them."""
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = next(iter(self._by_dtype.values())).to(dtype)
        return self._by_dtype[dtype]


class _SequenceParallelLinear(Function):
    """Y = X A_i (+ b_i) on the all-gathered X; saves X_r and A_i; dA_i = dY^T Regather(X_r)."""

    @staticmethod
    def forward(ctx, x, weight, bias, shard: SavedInputShard):
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(shard.saved(y.dtype), weight)
        ctx.regather, ctx.x_dtype = shard.regather, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        if ctx.needs_input_grad[1]:
            shard.regather.register()
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])  # the ops (and round-off) of F.linear's own backward
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_2d.mm(weight.to(grad.dtype)).view(*grad.shape[:-1], -1).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            whole = ctx.regather(shard)
            grad_w = whole.reshape(-1, whole.shape[-1]).t().mm(grad_2d).t().to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def sequence_parallel_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    shard: SavedInputShard,  # noqa: A002
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for an all-gathered ``input``, saving ``shard`` instead of it.

    Overridable like ``F.linear`` (torch function modes see it: the kernel router fuses its bias
    with a following GeLU the same way)."""
    if has_torch_function_variadic(input, weight, bias):
        return handle_torch_function(sequence_parallel_linear, (input, weight, bias), input, weight, bias, shard=shard)
    if not torch.is_grad_enabled():
        return F.linear(input, weight, bias)
    return _SequenceParallelLinear.apply(input, weight, bias, shard)
