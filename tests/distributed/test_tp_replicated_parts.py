"""Multi-query attention fused into one projection, in plain torch, trained by the Trainer at t=2 (with
and without SP) against one process: the query heads split over t while the one key/value head, a part
of the same projection, stays whole on every rank (its gradient summed over the ranks' query heads).

- q | k | v cut by ``split`` after an ``unsqueeze`` adds a heads dim of one (the key read as one head);
- the projection viewed into H + 2 heads and cut by slicing that dim: ``[..., :-2, :]``, ``[..., [-2], :]``.

Gradient clipping is on, at a norm every step exceeds: the norm must count each copied row once.
"""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 8, 16, 16, 4
HEAD = HIDDEN // HEADS
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)
CLIP = 0.05  # below every step's gradient norm: each update is scaled by the norm


class SplitMQABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, HIDDEN + 2 * HEAD)  # H heads | one key head | one value head
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm(x)
        B, T, _ = h.shape
        q, k, v = self.qkv(h).unsqueeze(1).split((HIDDEN, HEAD, HEAD), dim=3)  # (B, 1, T, *)
        q = q.view(B, T, -1, HEAD).transpose(1, 2)  # (B, nh, T, hs); k, v: (B, 1, T, hs), one head
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, -1))


class SlicedMQABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, HIDDEN + 2 * HEAD)
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm(x)
        B, T, _ = h.shape
        qkv = self.qkv(h).view(B, T, HEADS + 2, HEAD)  # (B, T, nh + 2, hs)
        q, k, v = qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # k, v: (B, 1, T, hs), broadcast over the heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, HIDDEN))


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(
        TokenLM, lambda: [SplitMQABlock(), SplitMQABlock(), SlicedMQABlock(), SlicedMQABlock()], VOCAB, HIDDEN
    )
    model, result = fit_token_lm(
        make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel, gradient_clip_val=CLIP
    )
    blocks = (model.blocks[0], model.blocks[2])
    return {**result, "qkv": [tuple(b.qkv.weight.shape) for b in blocks], "o": [type(b.o).__name__ for b in blocks]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_a_fused_projection_with_one_key_head_splits_its_queries_equal_to_one_process(dist_pool, sequence_parallel):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["warnings"] == []
        assert split["qkv"] == [(HIDDEN // 2 + 2 * HEAD, HIDDEN)] * 2  # half the query heads, the key and value whole
        assert split["o"] == ["RowParallelLinear"] * 2
