"""Sequence parallelism where a block keeps a region whole: that block gathers the sequence, runs as
without SP and cuts its output back to the rank's chunk, between blocks that run on 1/t of it. Plain
torch: attention whose keys are averaged over the heads (a head mix discovery cannot split), next to
ordinary attention blocks, trained by the Trainer at t=2 with SP against one process."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 16, 16, 16, 4
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class Block(nn.Module):
    """Pre-norm attention and MLP; ``mixed_heads``: the attention output's features are rolled by one
    across the heads before ``o``, which no split by heads can compute, so q, k, v and o stay whole."""

    def __init__(self, mixed_heads: bool) -> None:
        super().__init__()
        self.mixed_heads = mixed_heads
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        B, T, C = h.shape  # read from the region's input: under SP the whole sequence
        q, k, v = (p(h).view(B, T, HEADS, C // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # mixes the sequence
        y = y.transpose(1, 2).reshape(B, T, C)
        if self.mixed_heads:  # each head's last feature moves to the next head
            y = y.roll(1, dims=-1)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(x)))


def fit(t: int) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [Block(False), Block(True), Block(True), Block(False)], VOCAB, HIDDEN)
    model, result = fit_token_lm(make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=True)
    return {**result, "shapes": {k: tuple(v.shape) for k, v in model.named_parameters()}}


@pytest.mark.world_size(2)
def test_a_block_keeping_a_region_whole_runs_on_the_whole_sequence_between_sp_blocks(dist_pool):
    from tests.tp_utils import assert_same_state

    whole = fit(1)
    for split in dist_pool(2).run(fit, 2):
        (warning,) = split["warnings"]
        assert "keeps q, k, v, o whole" in warning and "gather the sequence and run on all of it" in warning
        assert split["shapes"]["blocks.0.q.weight"] == (HIDDEN // 2, HIDDEN)  # split blocks stay split
        assert split["shapes"]["blocks.1.q.weight"] == (HIDDEN, HIDDEN)
        assert split["shapes"]["blocks.1.up.weight"] == (HIDDEN, HIDDEN)  # its MLP is split all the same
        assert_same_state(whole, split, TOL)
