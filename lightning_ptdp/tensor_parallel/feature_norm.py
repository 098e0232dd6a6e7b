"""Modules whose weights span the heads tensor parallelism splits, each rank applying its slice.

A norm over all heads' features (a q/k norm over every head): each rank normalises its own
features with the statistics of all of them, the sums all-reduced over the tp group. Per-head
parameters (a (heads, head_dim) q/k norm, per-head scalars): each rank holds its heads' entries.
Any other module over all heads' features (a gated group norm, an L2 norm): run whole on the
gathered features, each rank keeping its share. Weights held whole have partial gradients on each
rank, summed over tp."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_ptdp.core.dtypes import at_least_fp32
from lightning_ptdp.tensor_parallel.collectives import TPGroup, gather_features_from_tp_region, sum_over_tp_region
from lightning_ptdp.tensor_parallel.layers import hold_share

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
    xf = at_least_fp32(x)
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
    sample_module = _cpu_copy(module)
    sample = 3 * torch.randn(4, features, generator=torch.Generator().manual_seed(1))
    out = sample_module(sample)
    weight, bias = sample_module.weight, getattr(sample_module, "bias", None)
    for eps in epsilons:
        for kind in ("rms", "layer"):
            expected = _formula(kind, sample, eps, lambda s: s, features) * weight
            expected = expected + bias if bias is not None else expected
            if torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
                return FeatureNorm(kind, eps, features)
    return None


@dataclass(frozen=True)
class GatheredModule:
    """A module over all heads' features that no rule splits: the argument leaves ``inputs`` (this
    rank's contiguous 1/t of the last dim) are all-gathered, the module runs whole on every rank, and
    each keeps its 1/t of the output's last dim (the gather's backward sums the ranks' gradients)."""

    inputs: tuple[int, ...]


def shard_feature_norm(module: nn.Module, norm: FeatureNorm | HeadSlices | GatheredModule, tp: TPGroup) -> None:
    """Make ``module`` normalise this rank's contiguous 1/t of the features (its heads), apply its
    heads' slice of per-head parameters, or run whole on the gathered features."""
    if isinstance(norm, GatheredModule):
        whole_forward = module.forward

        def gathered(*args, **kwargs):
            leaves, spec = tree_flatten((args, kwargs))
            leaves = [gather_features_from_tp_region(v, tp) if i in norm.inputs else v for i, v in enumerate(leaves)]
            whole_args, whole_kwargs = tree_unflatten(leaves, spec)
            out = whole_forward(*whole_args, **whole_kwargs)
            local = out.shape[-1] // tp.size
            return out.narrow(-1, tp.rank * local, local)

        module.forward = gathered
        return
    if isinstance(norm, HeadSlices):  # each rank holds its heads' entries, as a stored cut: its own gradient
        for name, dim in norm.dims:
            path, _, leaf = name.rpartition(".")
            hold_share(module.get_submodule(path), leaf, dim, (), tp)
        return
    local = norm.features // tp.size
    start = tp.rank * local

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = _formula(norm.kind, x, norm.eps, lambda s: sum_over_tp_region(s, tp), norm.features)
        y = y * module.weight[start : start + local]
        bias = getattr(module, "bias", None)
        return y + bias[start : start + local] if bias is not None else y

    module.forward = forward


@dataclass(frozen=True)
class HeadSlices:
    """Parameters of a module holding one entry per head along a dim: (name, dim) of each."""

    dims: tuple[tuple[str, int], ...]
    heads: int
    """Global size of those dims: the heads of the sharded tensor the module reads."""

    @contextlib.contextmanager
    def of_rank(self, module: nn.Module, rank: int, size: int) -> Iterator[None]:
        """Within: ``module``'s per-head parameters are views of rank ``rank``'s contiguous 1/size of
        the heads (swapped in as torch.func.functional_call swaps tensors: gradients reach the whole)."""
        local, swapped = self.heads // size, []
        for name, dim in self.dims:
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            whole = owner._parameters[leaf]
            swapped.append((owner, leaf, whole))
            owner._parameters[leaf] = whole.narrow(dim, rank * local, local)
        try:
            yield
        finally:
            for owner, leaf, whole in swapped:
                owner._parameters[leaf] = whole

    @torch.no_grad()
    def mismatch(
        self, module: nn.Module, shape: tuple[int, ...], dim: int, size: int, call: Optional[Callable] = None
    ) -> Optional[str]:
        """Why each rank's share of an input of ``shape`` (split along ``dim``) through the sliced
        module is not that share of the whole output, on a CPU copy with random weights; or None.
        ``call(x)``: the module's (args, kwargs) around that input (whole ones beside it: positions)."""
        sample_module = _cpu_copy(module)
        generator = torch.Generator().manual_seed(0)
        kept = [1 if d < dim else s for d, s in enumerate(shape)]  # leading (batch, position) dims: one each
        sample = torch.randn(kept, generator=generator)
        local = self.heads // size
        call = call or (lambda x: ((x,), {}))

        def run(x: torch.Tensor) -> torch.Tensor:
            args, kwargs = call(x)
            return sample_module(*args, **kwargs)

        try:
            whole = run(sample)
            for rank in range(size):
                with self.of_rank(sample_module, rank, size):
                    share = run(sample.narrow(dim, rank * local, local))
                if not torch.allclose(share, whole.narrow(dim, rank * local, local), rtol=1e-5, atol=1e-6):
                    return f"gives rank {rank} other values than its heads' share of the whole module's output"
        except Exception as err:  # the user's module may raise anything
            return f"fails on a sample: {type(err).__name__}: {err}"
        return None


def head_slices_of(module: nn.Module, shape: tuple[int, ...], dim: int) -> Optional[HeadSlices]:
    """The parameters of ``module`` with a dim of the input's global size along ``dim`` (``shape``),
    aligned with it from the right as broadcasting aligns them; None when there are none."""
    back = dim - len(shape)
    dims = tuple(
        (name, p.dim() + back)
        for name, p in module.named_parameters()
        if p.dim() >= -back and p.shape[back] == shape[dim]
    )
    return HeadSlices(dims, shape[dim]) if dims else None


@torch.no_grad()
def _cpu_copy(module: nn.Module) -> nn.Module:
    """A float32 CPU copy with random weights (so that one built on meta is checked too)."""
    on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    sample_module = copy.deepcopy(module)
    sample_module = sample_module.to_empty(device="cpu") if on_meta else sample_module.to("cpu")
    sample_module = sample_module.float()
    generator = torch.Generator().manual_seed(0)
    for param in sample_module.parameters():
        param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    if on_meta:
        for buffer in sample_module.buffers():
            buffer.copy_(torch.rand(buffer.shape, generator=generator) if buffer.is_floating_point() else 0)
    return sample_module
