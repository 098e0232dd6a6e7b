"""Which tokens of a sequence each context-parallel rank holds, and the sequence's collectives.

The sequence is cut into 2c equal chunks and rank i holds chunks i and 2c-1-i (Megatron's and
torchtitan's load balance: under causal attention every rank then attends over the same number
of keys). Gathered tensors come back in rank order and are put into global order here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function


@dataclass(frozen=True)
class CPGroup:
    """The context-parallel process group of this rank, with its size and this rank's index in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @property
    def chunks(self) -> tuple[int, int]:
        """The two of the 2c chunks this rank holds, in the order it holds them."""
        return self.rank, 2 * self.size - 1 - self.rank


def check_sequence_length(length: int, cp: CPGroup) -> None:
    parts = 2 * cp.size
    if length % parts:
        fits = [c for c in range(1, length // 2 + 1) if length % (2 * c) == 0 and c <= 16]
        raise ValueError(
            f"sequence length {length} is not divisible by 2 * context_parallel_size = {parts}: each of the "
            f"{cp.size} ranks holds two of {parts} equal chunks (the load balance of causal attention). Pad or cut "
            f"the sequences to a multiple of {parts} (e.g. {length + parts - length % parts}), or choose "
            f"context_parallel_size in {fits}"
        )


def own_chunks(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim``, side by side (differentiable: autograd puts
    the gradient back into a zero tensor of the whole length)."""
    chunks = x.chunk(2 * cp.size, dim=dim)
    first, second = cp.chunks
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def global_order(gathered: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """Rank order (r0's two chunks, r1's, ...) -> sequence order."""
    pieces = gathered.chunk(2 * cp.size, dim=dim)
    c = cp.size
    order = [pieces[2 * g] if g < c else pieces[2 * (2 * c - 1 - g) + 1] for g in range(2 * c)]
    return torch.cat(order, dim=dim)


def _rank_order(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """Sequence order -> rank order (``global_order`` undone): each rank's two chunks, rank by rank."""
    pieces, c = x.chunk(2 * cp.size, dim=dim), cp.size
    return torch.cat([p for r in range(c) for p in (pieces[r], pieces[2 * c - 1 - r])], dim=dim)


def _all_gather(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] * cp.size, *x.shape[1:]))
    if not x.is_meta:
        dist.all_gather_into_tensor(out, x, group=cp.group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // cp.size, *x.shape[1:]))
    if not x.is_meta:
        dist.reduce_scatter_tensor(out, x, group=cp.group)
    return out.movedim(0, dim)


class _GatherKeysValues(Function):
    """All-gather along ``dim`` / reduce-scatter: every rank's queries read every rank's keys, so a
    key's gradient is the sum of what all ranks' queries gave it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
        ctx.dim, ctx.cp = dim, cp
        return _all_gather(x, dim, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.cp), None, None


class _GatherSequence(Function):
    """Leaving the blocks: all-gather along ``dim`` / reduce-scatter (the sum over ranks) of the gradient.

    What follows the blocks (final norm, head, the user's loss) usually runs on the whole sequence on
    every cp rank alike, so the sum is c times this rank's chunks of it; that c is right because the
    gradients average over dp x cp (a block parameter's gradient on one rank holds only its tokens'
    share, and the c shares' mean times c is their sum). But a model that runs its blocks again
    (recurrent depth) cuts the gathered sequence anew, and each rank's gradient then reaches only its
    own chunks: only the sum is right in both cases."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
        ctx.dim, ctx.cp = dim, cp
        return global_order(_all_gather(x, dim, cp), dim, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(_rank_order(grad, ctx.dim, ctx.cp), ctx.dim, ctx.cp), None, None


def gather_keys_values(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """Every rank's keys (or values) along ``dim``, in sequence order."""
    return global_order(_GatherKeysValues.apply(x, dim, cp), dim, cp)


def gather_sequence(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    return _GatherSequence.apply(x, dim, cp)
