"""A norm over the features tensor parallelism splits (OLMo-2's and OLMoE's q/k norms over all
heads). Each rank normalises its own features with the statistics of all of them: the sums are
all-reduced over the tp group. It applies its slice of the weight, which stays whole on every rank.
Its gradient is then partial on each rank and is summed over tp like a per-head norm's."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from lightning_ptdp.tensor_parallel.collectives import TPGroup, sum_over_tp_region

EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


@dataclass(frozen=True)
class FeatureNorm:
    """An RMSNorm or LayerNorm over the last dim of ``features``, as the module computes it."""

    kind: str
    """"rms" or "layer"."""
    eps: float
    features: int


def _formula(kind: str, x: torch.Tensor, eps: float, sums: Callable[[torch.Tensor], torch.Tensor], n: int):
    """The normalised features (before the weight), from sums over all ``n`` features."""
    xf = x.float()
    if kind == "rms":
        return (xf * torch.rsqrt(sums(xf.pow(2).sum(-1, keepdim=True)) / n + eps)).to(x.dtype)
    centered = xf - sums(xf.sum(-1, keepdim=True)) / n
    return (centered * torch.rsqrt(sums(centered.pow(2).sum(-1, keepdim=True)) / n + eps)).to(x.dtype)


@torch.no_grad()
def feature_norm_of(module: nn.Module, features: int) -> Optional[FeatureNorm]:
    """What ``module`` computes, if it is an RMSNorm or LayerNorm over a last dim of ``features``
    with a weight (and bias) of that size: checked against the formula on a sample input, on a CPU
    copy with random weights (so a module built on meta is checked too)."""
    params = dict(module.named_parameters())
    if set(params) - {"weight", "bias"} or "weight" not in params:
        return None
    if any(tuple(p.shape) != (features,) for p in params.values()):
        return None
    epsilons = [v for n in EPS_NAMES if isinstance(v := getattr(module, n, None), float)]
    sample_module = copy.deepcopy(module).to_empty(device="cpu").float()
    generator = torch.Generator().manual_seed(0)
    for param in sample_module.parameters():
        param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    sample = 3 * torch.randn(4, features, generator=generator)
    out = sample_module(sample)
    weight, bias = sample_module.weight, getattr(sample_module, "bias", None)
    for eps in epsilons:
        for kind in ("rms", "layer"):
            expected = _formula(kind, sample, eps, lambda s: s, features) * weight
            expected = expected + bias if bias is not None else expected
            if torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
                return FeatureNorm(kind, eps, features)
    return None


def shard_feature_norm(module: nn.Module, norm: FeatureNorm, tp: TPGroup) -> None:
    """Make ``module`` normalise this rank's contiguous 1/t of the features (its heads)."""
    local = norm.features // tp.size
    start = tp.rank * local

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = _formula(norm.kind, x, norm.eps, lambda s: sum_over_tp_region(s, tp), norm.features)
        y = y * module.weight[start : start + local]
        bias = getattr(module, "bias", None)
        return y + bias[start : start + local] if bias is not None else y

    module.forward = forward
