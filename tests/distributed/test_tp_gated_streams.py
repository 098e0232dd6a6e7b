"""A gate on the residual stream, in plain torch, trained by the Trainer at t=2 (with and without SP)
against one process: a small Linear reading the stream (no row closes it: a hyper-connection's injection
weight) scales the attention's output before it joins the stream, so the MLP's columns read the stream
mixed with that gate's output. The gate stays whole on every rank, as a router does, and the MLP is paired
as if the gate were part of the stream: split, not kept whole as "fed by a column and by the residual"."""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 8, 16, 16, 4
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class GatedStreamBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.inject = nn.Linear(HIDDEN, 2)  # one weight per half of the features
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm1(x)
        B, T, _ = h.shape
        q, k, v = (p(h).view(B, T, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, HIDDEN))
        gate = 2 * self.inject(h).sigmoid()  # (B, T, 2)
        x = x + (y.unflatten(-1, (2, -1)) * gate[..., None]).flatten(-2)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [GatedStreamBlock(), GatedStreamBlock()], VOCAB, HIDDEN)
    model, result = fit_token_lm(make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel)
    block = model.blocks[0]
    shapes = [block.q.weight, block.up.weight, block.inject.weight]
    return {**result, "split": [tuple(w.shape) for w in shapes] + [type(block.down).__name__]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_a_gate_mixed_into_the_stream_stays_whole_and_the_mlp_after_it_splits(dist_pool, sequence_parallel):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["warnings"] == []
        assert split["split"] == [(HIDDEN // 2, HIDDEN), (HIDDEN, HIDDEN), (2, HIDDEN), "RowParallelLinear"]
