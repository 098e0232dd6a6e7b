"""float8= (parallel/float8.py): the config's refusals, which Linears are converted, and ptdp's
tensor-parallel seam into torchao's float8 matmul. Numerics per layout: tests/distributed/test_float8.py."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_ptdp import ParallelConfig
from lightning_ptdp.config import Float8Config

pytest.importorskip("torchao.float8")


def test_float8_values_parse_to_one_config():
    assert ParallelConfig(float8=True).float8 == Float8Config()
    assert ParallelConfig(float8="rowwise").float8.recipe == "rowwise"
    assert ParallelConfig(float8={"skip": ["*.attn.*"], "emulate": True}).float8.skip == ("*.attn.*",)
    assert ParallelConfig(float8=False).float8 is None and ParallelConfig().float8 is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("mxfp8", r"float8='mxfp8' is not one of 'tensorwise', 'rowwise'"),
        ({"recipe": "tensorwise", "scaling": "delayed"}, r"unknown keys \['scaling'\]"),
        ({"skip": "*.attn.*"}, r"skip='\*\.attn\.\*' must be a list of module-name patterns"),
        ({"emulate": "yes"}, r"emulate='yes' must be True or False"),
        (8, r"float8=8 must be True, False, 'tensorwise', 'rowwise'"),
    ],
)
def test_bad_float8_values_are_refused_at_construction(value, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(float8=value)


def test_float8_without_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"needs torchao .*pip install torchao.*or leave float8 off"):
        Float8Config()


def test_float8_off_a_float8_gpu_is_refused_unless_emulated():
    from lightning_ptdp.parallel.float8 import check_float8_device

    with pytest.raises(ValueError, match=r"compute capability 8.9 or later .* runs on cpu; pass .*'emulate': True"):
        check_float8_device(Float8Config(), torch.device("cpu"))
    check_float8_device(Float8Config(emulate=True), torch.device("cpu"))  # emulation runs anywhere


class _Block(nn.Module):
    """Attention-like Linears, a Linear of 24 outputs, and a router over 16 expert Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)
        self.odd = nn.Linear(32, 24)
        self.router = nn.Linear(32, 16, bias=False)
        self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(16))

    def forward(self, x):
        x = x + self.proj(self.qkv(x)[..., :32]) + F.pad(self.odd(x), (0, 8))
        weights = self.router(x).softmax(-1)
        return x + sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_blocks_linears_are_converted_and_the_rest_kept():
    from torchao.float8.float8_linear import Float8Linear

    from lightning_ptdp.parallel.float8 import apply_float8

    model = _Model()
    config = Float8Config(emulate=True, skip=("blocks.1.proj",))
    report = apply_float8(model, config, zero_stage=0, device=torch.device("cpu"))
    experts = {f"blocks.{b}.experts.{i}": "expert (no grouped float8 GEMM)" for b in range(2) for i in range(16)}
    assert report.kept == {
        "blocks.0.odd": "weight [24, 32] not in multiples of 16",
        "blocks.0.router": "router",
        "blocks.1.proj": "float8 skip",
        "blocks.1.odd": "weight [24, 32] not in multiples of 16",
        "blocks.1.router": "router",
        **experts,
    }
    assert report.converted == ["blocks.0.qkv", "blocks.0.proj", "blocks.1.qkv"]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert isinstance(module, Float8Linear) == (name in report.converted), name
    assert not isinstance(model.head, Float8Linear)  # outside the blocks: the head stays precise
    model(torch.randn(2, 4, 32)).sum().backward()


def test_float8_matmul_of_a_shard_layer_is_torchaos_float8_linear():
    """ptdp's TP layers call torchao's matmul Function directly: the same output and gradients as
    torchao's own Float8Linear on the same weight, bitwise; and not the full-precision result."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from lightning_ptdp.parallel.float8 import Float8Matmul

    torch.manual_seed(0)
    config = Float8LinearConfig(emulate=True)
    reference = Float8Linear.from_float(nn.Linear(32, 48), config=config)
    weight = nn.Parameter(reference.weight.detach().clone())
    bias = nn.Parameter(reference.bias.detach().clone())
    x = torch.randn(3, 5, 32)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference(x_ref)
    got = Float8Matmul(config)(x_ours, weight, bias)
    (expected * torch.arange(48)).sum().backward()
    (got * torch.arange(48)).sum().backward()
    assert torch.equal(got, expected) and torch.equal(x_ours.grad, x_ref.grad)
    assert torch.equal(weight.grad, reference.weight.grad) and torch.equal(bias.grad, reference.bias.grad)
    assert not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-3, atol=1e-3)  # float8 rounding is there


def test_kernel_routing_leaves_a_float8_linear_to_torchao():
    import torch.fx as fx

    from lightning_ptdp.kernels import _linear_gelu_pairs
    from lightning_ptdp.parallel.float8 import FLOAT8_MARK

    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU())
    assert _linear_gelu_pairs(mlp, fx.symbolic_trace(mlp).graph) == [("0", "1")]
    setattr(mlp[0], FLOAT8_MARK, True)
    assert _linear_gelu_pairs(mlp, fx.symbolic_trace(mlp).graph) == []
