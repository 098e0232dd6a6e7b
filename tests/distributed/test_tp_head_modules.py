"""Modules called on head-sharded tensors beside whole ones, in plain torch, trained by the Trainer at t=2
(with and without SP) against one process:

- a per-head norm module with a ``(heads, head_dim)`` scale that also reads the positions (an L2 clip of
  each head, then a scale growing with the position): each rank applies its heads' slice of the scale;
- a bank all heads share (``proj [d_rel, extent]``) mixed into a bias per head, query and key, gathered
  by the distance ``q - k`` expanded over the heads by the sharded tensor's own size: the expanded index
  is cut with the heads it is broadcast over, and the bank's gradient (each rank's heads' part) is
  summed over tp. The bank stays whole on every rank (each head reads all of it), which the warning says;
- heads split by a size read of the shard over the global head count, ``x.size(-1) // n_head`` (the local
  features, where the recording read all of them), in a block that returns a list ``[h, weights]``. The bank is called as a module of its own in one block and read inline, in the module
  holding the states' projection, in the other.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS, D_REL, EXTENT = 8, 16, 16, 4, 3, 5
HEAD = HIDDEN // HEADS
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class ClipByPosition(nn.Module):
    """Each head's vector scaled by its own learned scale, clipped to norm 1, then grown with the position."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, HEADS * HEAD).view(HEADS, HEAD))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x: (B, T, nh, hs)
        x = x * self.scale
        x = x * (1.0 / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)
        return x * (1.0 + 0.1 * torch.log1p(positions.float()))[..., None, None]


def relative_bias(states: torch.Tensor, proj: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Per-head states mix a shared bank of bias-by-distance profiles: (B, T, nh, d_rel) -> (B, nh, T, T)."""
    logits = (states @ proj).transpose(1, 2)  # (B, nh, T, extent)
    distance = (q_pos[:, None] - k_pos[None, :])[None, None]  # (1, 1, T, T)
    index = distance.clamp(0, EXTENT - 1).expand(*logits.shape[:2], -1, -1)
    bias = logits.gather(-1, index)
    return bias.masked_fill((distance < 0) | (distance >= EXTENT), 0.0)


class SharedBank(nn.Module):
    """The bank alone: a module called on the head-sharded states beside whole positions."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(D_REL, EXTENT) * 0.5)

    def forward(self, states: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return relative_bias(states, self.proj, q_pos, k_pos)


class RelativeBias(nn.Module):
    """The states' projection and the bank in one module: the bank is read inline, beside the column."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HEADS * D_REL)
        self.proj = nn.Parameter(torch.randn(D_REL, EXTENT) * 0.5)

    def forward(self, h: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        return relative_bias(self.linear(h).view(B, T, -1, D_REL), self.proj, q_pos, k_pos)


class Block(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.inline = inline
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.q_norm = ClipByPosition()
        if inline:
            self.rel = RelativeBias()
        else:
            self.r, self.bank = nn.Linear(HIDDEN, HEADS * D_REL), SharedBank()
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        B, T, _ = h.shape
        positions = torch.arange(T, device=x.device)
        q = self.q_norm(self.q(h).view(B, T, -1, HEAD), positions[None]).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (p(h).view(B, T, -1, HEAD).transpose(1, 2) for p in (self.k, self.v))
        if self.inline:
            bias = self.rel(h, positions, positions)
        else:
            bias = self.bank(self.r(h).view(B, T, -1, D_REL), positions, positions)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf")))
        return x + self.o(y.transpose(1, 2).reshape(B, T, HIDDEN))


class SizeReadBlock(nn.Module):
    """GPT-1's attention: heads split by ``x.size(-1) // n_head``, written out, the block returning a list."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("causal", torch.ones(SEQ, SEQ).tril().view(1, 1, SEQ, SEQ), persistent=False)

    @staticmethod
    def split_heads(x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, nh, T, hs)
        return x.view(*x.size()[:-1], HEADS, x.size(-1) // HEADS).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> list:
        q, k, v = (self.split_heads(t) for t in self.qkv(self.norm(x)).split(HIDDEN, dim=2))
        w = (q @ k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        w = (w * self.causal + -1e4 * (1 - self.causal)).softmax(-1)
        y = (w @ v).permute(0, 2, 1, 3).contiguous()
        y = y.view(*y.size()[:-2], y.size(-2) * y.size(-1))
        return [x + self.o(y), w]


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    blocks = lambda: [Block(inline=False), Block(inline=True), SizeReadBlock()]  # noqa: E731
    make = functools.partial(TokenLM, blocks, VOCAB, HIDDEN)
    model, result = fit_token_lm(make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel)
    module, inline, size_read = model.blocks
    shapes = [module.q.weight, module.r.weight, inline.q.weight, inline.rel.linear.weight, size_read.qkv.weight]
    return {**result, "split": [tuple(w.shape) for w in shapes] + [type(b.o).__name__ for b in model.blocks]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_head_modules_beside_whole_positions_split_by_heads_equal_to_one_process(dist_pool, sequence_parallel):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        # the banks stay whole on every rank, said once per block structure: nothing else does
        assert [w.split(" whole on every rank")[0] for w in split["warnings"]] == [
            "tensor parallelism (t=2) keeps bank",
            "tensor parallelism (t=2) keeps rel.proj",
        ]
        halves = [(HIDDEN // 2, HIDDEN), (HEADS // 2 * D_REL, HIDDEN)] * 2 + [(3 * HIDDEN // 2, HIDDEN)]
        assert split["split"] == halves + ["RowParallelLinear"] * 3
