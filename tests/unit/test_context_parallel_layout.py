"""The load-balanced layout of context parallelism, without a process group: which tokens each rank
holds, that the gathered order is the sequence's, and the refusals of the degrees."""

from __future__ import annotations

import pytest
import torch

from lightning_ptdp import ParallelConfig
from lightning_ptdp.context_parallel.layout import CPGroup, check_sequence_length, global_order, own_chunks
from lightning_ptdp.core.dims import ParallelDims


@pytest.mark.parametrize("c", [1, 2, 4])
def test_rank_i_holds_chunks_i_and_2c_minus_1_minus_i(c):
    positions = torch.arange(8 * c)
    held = [own_chunks(positions, 0, CPGroup(None, c, r)) for r in range(c)]
    for r, mine in enumerate(held):
        first, second = r, 2 * c - 1 - r
        assert mine.tolist() == [*range(first * 4, first * 4 + 4), *range(second * 4, second * 4 + 4)]
    # the causal work is balanced: every rank's queries see the same number of keys in total
    assert len({int((mine + 1).sum()) for mine in held}) == 1
    # gathered in rank order, then put in sequence order: the sequence again
    assert torch.equal(global_order(torch.cat(held), 0, CPGroup(None, c, 0)), positions)


def test_own_chunks_cuts_any_dim_and_its_gradient_lands_in_place():
    x = torch.randn(2, 3, 8, 5, requires_grad=True)
    mine = own_chunks(x, 2, CPGroup(None, 2, 1))  # chunks 1 and 2 of 4, two tokens each
    assert torch.equal(mine, x[:, :, 2:6])
    mine.sum().backward()
    assert torch.equal(x.grad[:, :, 2:6], torch.ones(2, 3, 4, 5)) and x.grad.sum() == mine.numel()


def test_a_sequence_not_divisible_by_2c_is_refused_with_the_fix():
    with pytest.raises(
        ValueError,
        match=r"sequence length 30 is not divisible by 2 \* context_parallel_size = 8.*"
        r"multiple of 8 \(e\.g\. 32\), or choose context_parallel_size in \[1, 3, 5, 15\]",
    ):
        check_sequence_length(30, CPGroup(None, 4, 0))


def test_the_mesh_puts_cp_between_tp_and_dp():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, context_parallel_size=2), world_size=8)
    assert (dims.pp, dims.dp, dims.cp, dims.tp) == (1, 2, 2, 2) and dims.mesh_shape == (1, 2, 2, 2)
    coords = [dims.coordinates(rank) for rank in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["cp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["dp"] for c in coords] == [0] * 4 + [1] * 4
    assert dims.checkpoint_layout(ParallelConfig(context_parallel_size=2))["c"] == 2


def test_degrees_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"context_parallel_size\(3\) = 6 does not divide the world size 8"):
        ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, context_parallel_size=3), world_size=8)
    with pytest.raises(ValueError, match=r"data_parallel_size\(2\) \* context_parallel_size\(2\) = 4, but the world"):
        ParallelDims(pp=1, dp=2, tp=1, cp=2, world_size=8)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide data x context parallel size 2"):
        ParallelDims(pp=1, dp=1, tp=1, cp=2, ep=4, world_size=2)
    ParallelDims(pp=1, dp=2, tp=1, cp=2, ep=4, world_size=4)  # e=4 fits: experts over the d x c = 4 ranks
    with pytest.raises(ValueError, match=r"context_parallel_size=0 must be >= 1"):
        ParallelConfig(context_parallel_size=0)
