"""Heads folded into the batch, (B, nh, T, hs) -> (B*nh, T, hs), in plain torch: BLOOM's and XGLM's
idiom. The split keeps each rank's B blocks of its heads, a per-head bias of the folded size made
outside the block (ALiBi's (B*nh, 1, T)) is cut block by block, and a batch size computed as the
folded size over the global head count gets the local view. A Python check of the whole folded
shape against the global head count (XGLM's) passes on the shard; a check of one size read as an
int cannot see the split: a trial run on meta finds it at setup and keeps that attention whole,
with its error as the warning's reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, HIDDEN, HEADS = 8, 16, 4
LOSS_RTOL, GRAD_REL = 1e-5, 1e-5  # fp32: t=2 splits each row's sum in two, round-off only


class FoldedBlock(nn.Module):
    def __init__(self, checks: str = "") -> None:
        super().__init__()
        self.checks, self.heads = checks, HEADS
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k, v = (t.reshape(B * self.heads, T, -1) for t in (q, k, v))  # (B*nh, T, hs)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=q.shape[-1] ** -0.5)  # (B*nh, T, T)
        if self.checks == "shape" and scores.size() != (B * self.heads, T, T):
            raise ValueError(f"scores should be of size {(B * self.heads, T, T)}, not {tuple(scores.size())}")
        if self.checks == "size" and scores.size(0) != B * self.heads:
            raise ValueError(f"scores should hold {B * self.heads} rows, not {scores.size(0)}")
        y = torch.bmm(scores.softmax(dim=-1), v)
        batch = y.shape[0] // self.heads  # the folded size over the head count, as BLOOM computes it
        y = y.view(batch, self.heads, T, -1).transpose(1, 2).reshape(batch, T, self.heads * (C // self.heads))
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(x)))


class FoldedNet(nn.Module):
    def __init__(self, checks: str = "") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([FoldedBlock(checks), FoldedBlock(checks)])
        self.slopes = nn.Parameter(torch.linspace(0.1, 0.8, HEADS))  # one slope per head, outside the blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        distance = torch.arange(T, dtype=x.dtype).view(1, 1, T)
        bias = (self.slopes.view(1, HEADS, 1) * distance).expand(B, HEADS, T).reshape(B * HEADS, 1, T)
        for block in self.blocks:
            x = block(x, bias)
        return x


def _step(distributed: bool, checks: str = "") -> dict:
    from tests.distributed.test_tp_block_structures import _inputs, _tp_step

    inputs = _inputs(HIDDEN, SEQ)
    net = FoldedNet(checks)
    result = _tp_step(net, inputs, distributed, split_all=True)
    result.pop("out")
    return {**result, "rows": net.blocks[0].q.weight.shape[0]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("checks", ["", "shape"], ids=["plain", "whole-shape-check"])
def test_heads_folded_into_the_batch_split_equal_to_one_process(dist_pool, checks):
    from tests.distributed.test_tp_block_structures import _assert_as_one_process

    ref = _step(False, checks)
    for result in dist_pool(2).run(_step, True, checks):
        assert result["rows"] == HIDDEN // 2  # q (and k, v) split by heads, not kept whole
        _assert_as_one_process(result, ref)


def test_a_python_check_of_one_folded_size_keeps_that_attention_whole_at_setup():
    from lightning_ptdp.tensor_parallel import PartialSplitWarning, tensor_parallel_plan

    net = FoldedNet(checks="size")
    with pytest.warns(PartialSplitWarning, match=r"keeps q, k, v, o whole .* raised ValueError: scores should hold"):
        report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.randn(2, SEQ, HIDDEN)))
    styles = {path: style for path, style, _ in report.entries}
    assert styles["blocks.*.q"] == "replicated" and styles["blocks.*.up"] == "colwise"
