"""Two idioms of recurrent mixers, in plain torch, trained by the Trainer at t=2 (with and without SP)
against one process:

- a token shift read mixed with the input (RWKV's time mixing): each column reads
  ``h * mix + shift(h) * (1 - mix)``, so the latest tensor all three are made from (the shifted input)
  is not one every path passes through; the region's input is the normed input itself;
- a module without Linears holding per-head parameters in its own shapes, (heads, hs, hs) and (heads,
  hs), reading its own head count (Griffin's RG-LRU): no rule splits its call as a whole, so the block
  is recorded again with its calls one by one, which split by heads."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 16, 16, 16, 4
WIDTH = 24  # the recurrence's width
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class TokenShiftBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.mix_k, self.mix_v, self.mix_r = (nn.Parameter(torch.linspace(0.1, 0.9, HIDDEN) + i / 10) for i in range(3))
        self.key, self.value, self.receptance = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.output = nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm1(x)
        shifted = F.pad(h, (0, 0, 1, -1))  # each token reads the one before it
        k, v, r = (h * m + shifted * (1 - m) for m in (self.mix_k, self.mix_v, self.mix_r))
        k, v, r = self.key(k), self.value(v), torch.sigmoid(self.receptance(r))
        state = torch.cumsum(k.exp() * v, dim=1) / torch.cumsum(k.exp(), dim=1)  # per feature, over tokens
        x = x + self.output(r * state)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class HeadGatedRecurrence(nn.Module):
    """A gate per head from a (heads, hs, hs) weight, and a decay per feature."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.head_size = HEADS, WIDTH // HEADS
        self.gate_weight = nn.Parameter(torch.randn(HEADS, self.head_size, self.head_size) / self.head_size)
        self.gate_bias = nn.Parameter(torch.zeros(HEADS, self.head_size))
        self.decay = nn.Parameter(torch.linspace(-1.0, 1.0, WIDTH))

    def forward(self, x):
        B, T, _ = x.shape
        per_head = x.reshape(B * T, self.heads, self.head_size).permute(1, 0, 2)  # (heads, B*T, hs)
        gate = torch.baddbmm(self.gate_bias[:, None, :], per_head, self.gate_weight)
        gate = torch.sigmoid(gate.transpose(0, 1).reshape(B, T, -1))
        a = torch.sigmoid(self.decay)
        out, state = [], torch.zeros_like(x[:, 0])
        for t in range(T):
            state = a * state + gate[:, t] * x[:, t]
            out.append(state)
        return torch.stack(out, dim=1)


class RecurrenceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.linear_x, self.linear_y = nn.Linear(HIDDEN, WIDTH), nn.Linear(HIDDEN, WIDTH)
        self.recurrence, self.linear_out = HeadGatedRecurrence(), nn.Linear(WIDTH, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.norm1(x)
        y = self.recurrence(self.linear_x(h)) * F.gelu(self.linear_y(h))
        x = x + self.linear_out(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _fit(block: type[nn.Module], t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import TokenLM, fit_token_lm

    make = functools.partial(TokenLM, lambda: [block(), block()], VOCAB, HIDDEN)
    model, result = fit_token_lm(make, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel)
    return {**result, "held": {name: tuple(p.shape) for name, p in model.blocks[0].named_parameters()}}


def fit_token_shift(t: int, sequence_parallel: bool) -> dict:
    return _fit(TokenShiftBlock, t, sequence_parallel)


def fit_recurrence(t: int, sequence_parallel: bool) -> dict:
    return _fit(RecurrenceBlock, t, sequence_parallel)


CASES = {
    "token-shift": (fit_token_shift, {"key.weight": (HIDDEN // 2, HIDDEN), "value.weight": (HIDDEN // 2, HIDDEN)}),
    "head-gated-recurrence": (
        fit_recurrence,
        {
            "linear_x.weight": (WIDTH // 2, HIDDEN),
            "recurrence.gate_weight": (HEADS // 2, WIDTH // HEADS, WIDTH // HEADS),
            "recurrence.decay": (WIDTH // 2,),
        },
    ),
}


LAYOUTS = [
    ("token-shift", False),
    ("token-shift", True),
    ("head-gated-recurrence", False),
    ("head-gated-recurrence", True),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("case", "sequence_parallel"),
    LAYOUTS,
    ids=["token-shift-t2", "token-shift-t2-sp", "recurrence-t2", "recurrence-t2-sp"],
)
def test_recurrent_mixers_split_by_features_and_heads(dist_pool, case, sequence_parallel):
    from tests.tp_utils import t2_runs

    fit, expected = CASES[case]
    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["warnings"] == []
        assert {name: split["held"][name] for name in expected} == expected
