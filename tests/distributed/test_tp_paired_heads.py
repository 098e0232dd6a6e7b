"""Heads paired across the halves of the heads dim, in plain torch, trained by the Trainer at t=2 (with
and without SP) against one process: differential attention (DIFF Transformer) cuts the value heads in
two halves, repeats each, attends twice and subtracts head h + H/2 from head h. A contiguous split of
the heads gives rank 0 only first halves, so each of q, k and v is split as two fused parts (each rank
its share of either half) and the output Linear, reading one result per pair, splits plainly."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 8, 16, 32, 8
HEAD = HIDDEN // HEADS
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class PairedHeadsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.lam = nn.Parameter(torch.full((HEAD,), 0.3))
        self.head_norm = nn.RMSNorm(2 * HEAD, elementwise_affine=False)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm1(x)
        B, T, _ = h.shape
        q, k, v = (p(h).view(B, T, -1, HEAD).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, hs)
        v1, v2 = (half.repeat(1, 2, 1, 1) for half in torch.chunk(v, 2, dim=1))  # each half onto all heads
        y1 = F.scaled_dot_product_attention(q, k, v1, is_causal=True)
        y2 = F.scaled_dot_product_attention(q, k, v2, is_causal=True)
        y = torch.cat([y1, y2], dim=-1)  # (B, H, T, 2 hs)
        first, second = torch.chunk(y, 2, dim=1)  # head h beside head h + H/2: (B, H/2, T, 2 hs)
        y = self.head_norm(first - self.lam.sum().sigmoid() * second)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [PairedHeadsBlock(), PairedHeadsBlock()], VOCAB, HIDDEN)
    model, result = fit_token_lm(make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel)
    block = model.blocks[0]
    return {**result, "split": [tuple(p.weight.shape) for p in (block.q, block.v, block.o)]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_heads_paired_across_halves_split_as_two_fused_parts(dist_pool, sequence_parallel):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["warnings"] == []
        assert split["split"] == [(HIDDEN // 2, HIDDEN), (HIDDEN // 2, HIDDEN), (HIDDEN, HIDDEN // 2)]
