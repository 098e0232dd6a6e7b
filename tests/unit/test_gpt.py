"""The reference GPT recipe: shapes, variants, config errors, LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.gpt import GPT, GPTConfig, GPTLightningModule, OptimConfig, cosine_with_warmup


@pytest.mark.parametrize("position", ["learned", "rotary"])
@pytest.mark.parametrize("tie", [True, False])
def test_variants_forward_and_tying(position, tie):
    cfg = GPTConfig(
        vocab_size=50,
        seq_length=16,
        num_layers=2,
        num_heads=2,
        hidden_size=16,
        position_embedding=position,
        tie_embeddings=tie,
    )
    model = GPT(cfg)
    logits = model(torch.randint(0, 50, (3, 16)))
    assert logits.shape == (3, 16, 50)
    assert (model.lm_head.weight is model.token_embedding.weight) == tie
    names = dict(model.named_parameters())
    assert ("position_embedding.weight" in names) == (position == "learned")


def test_attention_is_causal():
    model = GPT(GPTConfig(vocab_size=50, seq_length=16, num_layers=2, num_heads=2, hidden_size=16)).eval()
    x = torch.randint(0, 50, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 50
    torch.testing.assert_close(model(x)[0, :10], model(y)[0, :10])


def test_initial_loss_is_near_uniform():
    module = GPTLightningModule(GPTConfig(vocab_size=256, tie_embeddings=False))
    x = torch.randint(0, 256, (4, 64))
    loss = module.loss((x, torch.randint(0, 256, (4, 64))))
    assert abs(loss.item() - math.log(256)) < 0.1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 30, "num_heads": 4}, r"hidden_size=30 is not divisible by num_heads=4"),
        ({"num_layers": 0}, r"num_layers=0 must be a positive integer"),
        ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
        ({"position_embedding": "alibi"}, r"position_embedding='alibi'"),
        (
            {"hidden_size": 12, "num_heads": 4, "position_embedding": "rotary"},
            r"rotary position embedding needs an even head size",
        ),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_sequence_longer_than_context_is_refused():
    model = GPT(GPTConfig(seq_length=8))
    with pytest.raises(ValueError, match=r"sequence of length 9 is longer than GPTConfig.seq_length=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_warmup_then_cosine():
    kw = dict(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert cosine_with_warmup(0, **kw) == pytest.approx(0.1)
    assert cosine_with_warmup(9, **kw) == pytest.approx(1.0)
    assert cosine_with_warmup(60, **kw) == pytest.approx(0.55)
    assert cosine_with_warmup(110, **kw) == pytest.approx(0.1)
    assert cosine_with_warmup(500, **kw) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    module = GPTLightningModule(GPTConfig(), OptimConfig(weight_decay=0.3))
    groups = module.configure_optimizers()["optimizer"].param_groups
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[0]["weight_decay"] == 0.3
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0
