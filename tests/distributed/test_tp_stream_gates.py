"""A gate on the residual stream outside every region, in plain torch, trained by the Trainer at t=2
(with and without SP) against one process: a Linear reading the normed stream, as wide as it, scales
the MLP's output (RWKV's receptance). No Linear reads it, so no region holds it; it is split by output
features and gathered (each rank's gradient its slice of the same gathered one), not kept whole."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 8, 16, 16, 4
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class StreamGateBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.gate = nn.Linear(HIDDEN, HIDDEN)  # one value per stream feature, read by no Linear

    def forward(self, x):
        h = self.norm1(x)
        B, T, _ = h.shape
        q, k, v = (p(h).view(B, T, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, HIDDEN))
        h = self.norm2(x)
        return x + torch.sigmoid(self.gate(h)) * self.down(F.gelu(self.up(h)))


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [StreamGateBlock(), StreamGateBlock()], VOCAB, HIDDEN)
    model, result = fit_token_lm(make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel)
    gate = model.blocks[0].gate
    return {**result, "gate": (type(gate).__name__, tuple(gate.weight.shape))}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_a_gate_as_wide_as_the_stream_splits_by_output_features(dist_pool, sequence_parallel):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["warnings"] == []
        assert split["gate"] == ("StreamGateLinear", (HIDDEN // 2, HIDDEN))
