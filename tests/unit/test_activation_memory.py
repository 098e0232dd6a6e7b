"""Activation bytes one transformer block saves for backward, single process, beside the formula
of Korthikanti et al. 2022 (benchmarks/bench_activation.py holds the counter and the formula)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.bench_activation import block_saved_bytes, formula_bytes
from lightning_ptdp.core.flops import activation_bytes_per_layer
from lightning_ptdp.parallel.recompute import apply_activation_checkpointing
from recipes.gpt import GPT, GPTConfig

# a*s/h = 8: the attention-score term is larger than all the others together
MODEL = dict(vocab_size=64, seq_length=128, num_layers=3, num_heads=4, hidden_size=64, dropout=0.1)
BATCH = 2
FP32_EAGER_CPU = dict(act_bytes=4, mask_bytes=4, attention_dropout=False)  # see the benchmark's docstring
# The formula leaves out LayerNorm's saved mean and rstd: 2 norms x 2 x s*b fp32 = 16sb bytes, 0.35% of
# the smallest non-full row at h=64. Measured may exceed the formula by that, never fall below it.
LN_STATS_REL = 0.01


def test_formula_defaults_are_the_papers_table():
    for t, sp, recompute in itertools.product((1, 2, 4, 8), (False, True), (None, "selective", "full")):
        shape = dict(s=2048, b=1, h=12288, a=96, t=t)
        expected = activation_bytes_per_layer(2048, 1, 12288, 96, t, sp, recompute)
        assert formula_bytes(**shape, sp=sp, recompute=recompute) == pytest.approx(expected, rel=1e-12)


def _saved(recompute: str | None) -> int:
    torch.manual_seed(0)
    net = GPT(GPTConfig(**MODEL))
    if recompute is not None:
        apply_activation_checkpointing(net, recompute)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_length"]))
    with sdpa_kernel([SDPBackend.MATH]):  # unfused attention: the softmax the paper counts is saved
        return block_saved_bytes(net, net.blocks[1], lambda: net(ids))


def test_saved_bytes_match_the_fp32_formula_and_shrink_with_recompute():
    shape = dict(s=MODEL["seq_length"], b=BATCH, h=MODEL["hidden_size"], a=MODEL["num_heads"])
    saved = {mode: _saved(mode) for mode in (None, "selective", "full")}
    assert saved[None] > saved["selective"] > saved["full"]
    for mode, measured in saved.items():
        formula = formula_bytes(**shape, recompute=mode, **FP32_EAGER_CPU)
        assert formula <= measured <= formula * (1 + LN_STATS_REL), mode
    assert saved["full"] == 4 * BATCH * MODEL["seq_length"] * MODEL["hidden_size"]  # the block input, nothing else
