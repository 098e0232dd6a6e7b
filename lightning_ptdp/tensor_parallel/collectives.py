"""Megatron's collectives over one tp group, forward / backward (T: dim 1, sequence; C: features):
copy_to_tp_region                 identity / all-reduce                 column-parallel region input
reduce_from_tp_region             all-reduce / identity                 row-parallel region output
gather_from_sp_region             all-gather(T) / reduce-scatter(T)     SP: region input
reduce_scatter_to_sp_region       reduce-scatter(T) / all-gather(T)     SP: region output
scatter_to_sp_region              own chunk / all-gather(T) (and back: gather_from_sp_region_split_grad)
sum_over_tp_region                all-reduce / all-reduce               a statistic of all ranks' features
gather_features_from_tp_region    all-gather(C) / reduce-scatter(C)     a gathered column in a region
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd import Function

SEQ_DIM = 1


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel process group of this rank, with its size and this rank's index in it."""

    group: dist.ProcessGroup
    size: int
    rank: int


def _all_reduce(x: torch.Tensor, tp: TPGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous()
    if x.is_meta:  # a setup probe of a model built on the meta device, shapes only
        return x
    if torch.compiler.is_compiling():  # dynamo traces functional collectives, not in-place ones (mark_dirty)
        return funcol.all_reduce(x, "max" if op == dist.ReduceOp.MAX else "sum", tp.group)
    dist.all_reduce(x, op=op, group=tp.group)
    return x


def _seq_dim(x: torch.Tensor) -> int:
    """(B, T, ...) splits T; a (B*T, C) view (OPT's MLP) splits rows: a position-wise region gets
    every rank's rows and gives each its own back."""
    return SEQ_DIM if x.dim() > 2 else 0


def _all_gather_along(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    if not x.is_meta:
        dist.all_gather_into_tensor(out, x, group=tp.group)
    # contiguous, not a movedim view: several Linears reading a view would each copy it
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_along(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    if not x.is_meta:
        dist.reduce_scatter_tensor(out, x, group=tp.group)
    return out.movedim(0, dim).contiguous()  # not a view: the model may add to it in place


def _all_gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _all_gather_along(x, tp, _seq_dim(x))


def _reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    check_sequence_divisible(x.shape[_seq_dim(x)], tp)
    return _reduce_scatter_along(x, tp, _seq_dim(x))


def _all_gather_features(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _all_gather_along(x, tp, x.dim() - 1)


def _reduce_scatter_features(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _reduce_scatter_along(x, tp, x.dim() - 1)


def _own_chunk(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    check_sequence_divisible(x.shape[SEQ_DIM], tp)
    return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()


def _own_features(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def check_sequence_divisible(length: int, tp: TPGroup) -> None:
    if length % tp.size:
        raise ValueError(
            f"sequence length {length} is not divisible by tensor_parallel_size={tp.size}, which "
            "sequence_parallel=True needs (each rank keeps 1/t of the sequence); pad the sequence to a "
            f"multiple of {tp.size} or set sequence_parallel=False"
        )


def _conjugate_pair(
    name: str, forward: Callable, backward: Callable
) -> Callable[[torch.Tensor, TPGroup], torch.Tensor]:
    """An autograd function applying ``forward(x, tp)`` and, to the gradient, ``backward(g, tp)``."""

    def fwd(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        out = forward(x, tp)
        if out is x and forward is _all_reduce:  # reduced in place: the output is x, not a view of it,
            ctx.mark_dirty(x)  # so the model may still add to it in place (Falcon's `+=`)
        return out

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.tp), None

    function = type(name, (Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
    return function.apply


def _identity(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x.view_as(x)


copy_to_tp_region = _conjugate_pair("CopyToTPRegion", _identity, _all_reduce)
reduce_from_tp_region = _conjugate_pair("ReduceFromTPRegion", _all_reduce, _identity)
gather_from_sp_region = _conjugate_pair("GatherFromSPRegion", _all_gather_seq, _reduce_scatter_seq)
reduce_scatter_to_sp_region = _conjugate_pair("ReduceScatterToSPRegion", _reduce_scatter_seq, _all_gather_seq)
scatter_to_sp_region = _conjugate_pair("ScatterToSPRegion", _own_chunk, _all_gather_seq)
gather_from_sp_region_split_grad = _conjugate_pair("GatherFromSPRegionSplitGrad", _all_gather_seq, _own_chunk)
sum_over_tp_region = _conjugate_pair("SumOverTPRegion", _all_reduce, _all_reduce)  # every rank uses the sum
# backward reduce-scatters, not splits: what reads the gathered features inside a region is per-rank (its heads)
gather_features_from_tp_region = _conjugate_pair(
    "GatherFeaturesFromTPRegion", _all_gather_features, _reduce_scatter_features
)
# backward keeps this rank's slice: what reads the gathered features runs alike on every rank (a gate on the stream)
gather_features_split_grad = _conjugate_pair("GatherFeaturesSplitGrad", _all_gather_features, _own_features)


def all_reduce_max(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Non-differentiable max over the group (for the numerically stable softmax)."""
    return _all_reduce(x.detach().clone(), tp, op=dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Non-differentiable sum over the group."""
    return _all_reduce(x.detach().clone(), tp)


def all_gather_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Non-differentiable all-gather along the sequence (SP: a saved shard made whole in backward)."""
    return _all_gather_seq(x.detach(), tp)
