"""Megatron's collectives as small autograd functions over one tensor-parallel group.

Notation: t ranks, X the activation, A a weight split by columns A = [A_1 ... A_t] (rank i
computes X A_i), B a weight split by rows (rank i computes Y_i B_i, then sum_i).

  copy_to_tp          forward identity,        backward all-reduce   (input of a column-parallel region)
  reduce_from_tp      forward all-reduce,      backward identity     (output of a row-parallel region)
  gather_sequence     forward all-gather(s),   backward reduce-scatter(s)  (SP: region input)
  reduce_scatter_seq  forward reduce-scatter,  backward all-gather   (SP: region output)
  scatter_sequence    forward take own chunk,  backward all-gather   (SP: entering the blocks)
  gather_replicated   forward all-gather(s),   backward take own chunk (SP: leaving the blocks)

Sequence-parallel functions split dimension 1 (batch-first activations, (B, T, C)).
All calls go through ``torch.distributed`` module attributes, so a test can count them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
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
    dist.all_reduce(x, op=op, group=tp.group)
    return x


def _all_gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    x = x.movedim(SEQ_DIM, 0).contiguous()
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=tp.group)
    return out.movedim(0, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    check_sequence_divisible(x.shape[SEQ_DIM], tp)
    x = x.movedim(SEQ_DIM, 0).contiguous()
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=tp.group)
    return out.movedim(0, SEQ_DIM)


def _own_chunk(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    check_sequence_divisible(x.shape[SEQ_DIM], tp)
    return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()


def check_sequence_divisible(length: int, tp: TPGroup) -> None:
    if length % tp.size:
        raise ValueError(
            f"sequence length {length} is not divisible by tensor_parallel_size={tp.size}, which "
            "sequence_parallel=True needs (each rank keeps 1/t of the sequence); pad the sequence to a "
            f"multiple of {tp.size} or set sequence_parallel=False"
        )


class _CopyToTP(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSequence(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_seq(grad, ctx.tp), None


class _ScatterSequence(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _own_chunk(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_seq(grad, ctx.tp), None


class _GatherReplicated(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_chunk(grad, ctx.tp), None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp)


def gather_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _GatherSequence.apply(x, tp)


def reduce_scatter_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ReduceScatterSequence.apply(x, tp)


def scatter_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ScatterSequence.apply(x, tp)


def gather_replicated(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _GatherReplicated.apply(x, tp)


def all_reduce_max(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Non-differentiable max over the group (for the numerically stable softmax)."""
    return _all_reduce(x.detach().clone(), tp, op=dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Non-differentiable sum over the group."""
    return _all_reduce(x.detach().clone(), tp)
