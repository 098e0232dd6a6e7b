"""Layout-independent initialisation: any piece of a tensor filled alone equals that part of the
whole tensor filled at once, and a model built on the meta device materialises to the eager one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.parallel.init import ROWS_PER_DRAW, Constant, Normal, fill, initialize, materialize


@pytest.mark.parametrize(
    ("offsets", "shape"), [((0, 0), (200, 12)), ((70, 4), (61, 5)), ((63, 0), (2, 12)), ((199, 11), (1, 1))]
)
def test_a_piece_equals_that_part_of_the_whole_tensor(offsets, shape):
    full_shape = (200, 12)
    assert full_shape[0] > 3 * ROWS_PER_DRAW  # pieces cross several draw blocks
    whole = torch.empty(full_shape)
    fill(whole, (0, 0), full_shape, Normal(0.02), 7, "w")
    piece = torch.empty(shape)
    fill(piece, offsets, full_shape, Normal(0.02), 7, "w")
    rows, cols = slice(offsets[0], offsets[0] + shape[0]), slice(offsets[1], offsets[1] + shape[1])
    assert torch.equal(piece, whole[rows, cols])
    assert abs(whole.std().item() - 0.02) < 0.002  # the distribution asked for (2400 samples)
    other = torch.empty(full_shape)
    fill(other, (0, 0), full_shape, Normal(0.02), 8, "w")
    assert not torch.equal(other, whole)  # the seed matters


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.init_seed = 3
        if not any(p.is_meta for p in self.parameters()):
            initialize(self)

    def init_rule(self, name: str):
        return Constant(0.0) if name.endswith("bias") else Normal(0.5)


def test_a_model_built_on_meta_materialises_to_the_eager_one():
    eager = Tiny()
    with torch.device("meta"):
        lazy = Tiny()
    lazy.proj.weight.tag = "no-decay"  # attributes set on parameters survive
    assert materialize(lazy, torch.device("cpu")) == sum(p.numel() for p in eager.parameters())
    assert lazy.head.weight is lazy.emb.weight and lazy.proj.weight.tag == "no-decay"
    for (name, a), (_, b) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert torch.equal(a, b), name


def test_a_buffer_left_on_meta_is_refused_by_name():
    with torch.device("meta"):
        lazy = Tiny()
        lazy.register_buffer("table", torch.ones(3))
    with pytest.raises(ValueError, match=r"buffer\(s\) table are on the meta device: their values cannot be recovered"):
        materialize(lazy, torch.device("cpu"))


def test_init_module_before_a_run_builds_real_tensors():
    """``trainer.init_module()`` (create, then load weights) keeps Lightning's meaning; only
    ``configure_model`` inside a run builds on the meta device."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy

    trainer = L.Trainer(strategy=PTDPStrategy(), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with trainer.init_module():
        layer = nn.Linear(2, 2)
    assert not layer.weight.is_meta
