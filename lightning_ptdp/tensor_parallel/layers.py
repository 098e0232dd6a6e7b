"""Tensor-parallel replacements for nn.Linear and nn.Embedding holding this rank's shard.

Parameters are plain local tensors, not DTensors: no placement says "each of q, k, v split by heads"
(fused QKV) or "KV heads replicated across rank pairs" (GQA with t > n_kv_heads), and plain tensors
keep per-op dispatch cost off the step. A ``ShardLayout`` maps each shard back to the original
tensor. In a discovered block each layer holds its region's ``RegionEntry`` (replay.py): columns
take the input entered once (f: copy, or all-gather under SP keeping 1/t for backward), the row
reduces (g). From an explicit plan (``comm=True``) each layer brings its own f or g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_ptdp.tensor_parallel.collectives import (
    TPGroup,
    copy_to_tp_region,
    gather_features_from_tp_region,
    gather_features_split_grad,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
)
from lightning_ptdp.tensor_parallel.logits import VocabParallelLogits
from lightning_ptdp.tensor_parallel.sequence_linear import SavedInputShard, sequence_parallel_linear


@dataclass(frozen=True)
class ShardLayout:
    """How one dimension of size ``blocks * units * unit_size`` is split over t ranks.

    ``blocks`` side-by-side parts (3 for fused q/k/v) each hold ``units`` (heads, or single
    features) of ``unit_size``. Rank r owns the same units of every block: units/t of them, or,
    when units < t (grouped-query KV heads), unit r // (t / units), replicated across ranks.
    ``part_units`` gives unequal parts instead (fused q | k | v with fewer KV heads: (a, g, g)),
    each split or replicated by the same rule (multi-query attention's one KV head: whole on every rank),
    each of its own unit size where ``part_unit_sizes`` says (gate | x heads | B, C groups | dt per head).
    """

    blocks: int
    units: int
    unit_size: int
    tp_size: int
    part_units: tuple[int, ...] = ()
    part_unit_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for units in self.parts:
            if units >= self.tp_size and units % self.tp_size:
                raise ValueError(f"{units} units cannot be split evenly over tensor_parallel_size={self.tp_size}")
            if units < self.tp_size and self.tp_size % units:
                raise ValueError(f"{units} units cannot be replicated evenly over tensor_parallel_size={self.tp_size}")

    @property
    def parts(self) -> tuple[int, ...]:
        """Units of each side-by-side part."""
        return self.part_units or (self.units,) * self.blocks

    @property
    def unit_sizes(self) -> tuple[int, ...]:
        """Unit size of each part."""
        return self.part_unit_sizes or (self.unit_size,) * len(self.parts)

    @property
    def size(self) -> int:
        return sum(u * size for u, size in zip(self.parts, self.unit_sizes))

    @property
    def local_units(self) -> int:
        return max(1, self.units // self.tp_size)

    @property
    def replication(self) -> int:
        """How many ranks hold the same units, at most over the parts (1 unless some part has units < t)."""
        return max(1, self.tp_size // min(self.parts))

    def local_replication(self) -> torch.Tensor:
        """How many ranks hold each of this rank's indices (the same on every rank), part by part."""
        return torch.cat(
            [
                torch.full((len(self.unit_indices(0, u)) * size,), max(1, self.tp_size // u))
                for u, size in zip(self.parts, self.unit_sizes)
            ]
        )

    def unit_indices(self, rank: int, units: int | None = None) -> range:
        units = self.units if units is None else units
        if units >= self.tp_size:
            per = units // self.tp_size
            return range(rank * per, (rank + 1) * per)
        unit = rank // max(1, self.tp_size // units)
        return range(unit, unit + 1)

    def segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(offset in the shard, length, offset in the full dimension) of each part's piece."""
        out, local, start = [], 0, 0
        for units, size in zip(self.parts, self.unit_sizes):
            owned = self.unit_indices(rank, units)
            length = len(owned) * size
            out.append((local, length, start + owned.start * size))
            local, start = local + length, start + units * size
        return out

    def indices(self, rank: int) -> torch.Tensor:
        """Indices into the full dimension owned by ``rank``, part by part."""
        return torch.cat([torch.arange(length) + start for _, length, start in self.segments(rank)])


@dataclass(frozen=True)
class ParameterShard:
    """A plain parameter of the user's module held as this rank's share along ``dim`` (a depthwise
    conv's weight over the heads' channels): recorded on its module (``parameter_shard``)."""

    dim: int
    layout: ShardLayout
    tp: TPGroup


def parameter_shard(module: nn.Module, attr: str) -> ParameterShard | None:
    """How tensor parallelism cut ``module.<attr>`` when it is a plain parameter held as a share."""
    return module.__dict__.get("_ptdp_parameter_shards", {}).get(attr)


@torch.no_grad()
def hold_share(
    module: nn.Module, attr: str, dim: int, bounds: tuple[int, ...], tp: TPGroup, part_ratios: tuple[int, ...] = ()
) -> None:
    """Replace ``module.<attr>`` by this rank's share along ``dim`` (1/t of each fused part between
    ``bounds``, or 1/ratio where ``part_ratios`` gives each part's), the same share the replay would
    cut where a call reads it."""
    whole = module._parameters[attr]
    edges = bounds or (0, whole.shape[dim])
    parts = tuple(b - a for a, b in zip(edges, edges[1:]))
    if part_ratios:  # a part of ratio r: r units (each rank one of them, or one whole on t / r ranks)
        sizes = tuple(n // r for n, r in zip(parts, part_ratios))
        layout = ShardLayout(len(parts), max(part_ratios), 1, tp.size, part_ratios, sizes)
    else:
        layout = ShardLayout(len(parts), parts[0], 1, tp.size, parts if len(parts) > 1 else ())
    local = whole.index_select(dim, layout.indices(tp.rank).to(whole.device))
    module._parameters[attr] = _param(local, whole)
    module.__dict__.setdefault("_ptdp_parameter_shards", {})[attr] = ParameterShard(dim, layout, tp)


def _param(tensor: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone().contiguous(), requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank's output features (the layout's units) of an nn.Linear."""

    _ptdp_linear = True
    transposed = False  # weight stored (in, out), as transformers' Conv1D keeps it

    def __init__(self, linear: nn.Linear, layout: ShardLayout, tp: TPGroup, *, comm: bool = False) -> None:
        super().__init__()
        self.in_features, self.layout, self.tp, self.comm = linear.in_features, layout, tp, comm
        self.register_buffer("_rows", layout.indices(tp.rank), persistent=False)
        self.weight = _param(linear.weight[self._rows], linear.weight)
        self.bias = None if linear.bias is None else _param(linear.bias[self._rows], linear.bias)
        self.out_features = self.weight.shape[0]
        self.region = None  # RegionEntry of a discovered block
        self.float8 = None  # parallel/float8.py's Float8Matmul when the shard trains in float8

    def forward(self, x: torch.Tensor, shard: SavedInputShard | None = None) -> torch.Tensor:
        """``x`` whole; under sequence parallelism ``shard`` is this rank's 1/t of it (saved instead,
        except in float8, where torchao's matmul saves the whole ``x``)."""
        if self.region is not None:
            x, shard = self.region.enter(x)
        elif self.comm:
            x = copy_to_tp_region(x, self.tp)
        weight = self.weight.t() if self.transposed else self.weight
        if self.float8 is not None:
            return self.float8(x, weight, self.bias)
        if shard is not None:
            return sequence_parallel_linear(x, weight, self.bias, shard=shard)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_local={self.out_features}/{self.layout.size}, tp={self.tp.size}"


class GatheredColumnLinear(ColumnParallelLinear):
    """A Linear inside a region before its columns (a low-rank down-projection): this rank's
    output features, gathered (Megatron's gather_output=True). The gradient of the gathered output is
    reduce-scattered, as what reads it inside the region works on this rank's heads only."""

    def forward(self, x: torch.Tensor, shard: SavedInputShard | None = None) -> torch.Tensor:
        return gather_features_from_tp_region(super().forward(x, shard), self.tp)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", gathered"


class StreamGateLinear(ColumnParallelLinear):
    """A Linear outside every region whose output is as wide as the residual stream (RWKV's receptance,
    gating the feed-forward's output): this rank's output features, gathered. What reads the output runs
    alike on every rank, so the gathered gradient is the same on each and the backward keeps this rank's
    slice (Megatron's gather_from_tensor_model_parallel_region); the input enters by f. On sequence shards
    the input's sequence is gathered first and each rank keeps its tokens of the output."""

    def __init__(self, linear: nn.Linear, layout: ShardLayout, tp: TPGroup, *, on_shards: bool) -> None:
        super().__init__(linear, layout, tp, comm=not on_shards)
        self.on_shards = on_shards

    def forward(self, x: torch.Tensor, shard: SavedInputShard | None = None) -> torch.Tensor:
        if not self.on_shards:
            return gather_features_split_grad(super().forward(x), self.tp)
        y = gather_features_split_grad(super().forward(gather_from_sp_region(x, self.tp)), self.tp)
        return scatter_to_sp_region(y, self.tp)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", gathered gate"


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i B_i: this rank's input features; the bias is added once, after the sum.

    In a discovered block the region's entry says whether to all-reduce or reduce-scatter (SP).
    """

    _ptdp_linear = True
    transposed = False

    def __init__(self, linear: nn.Linear, layout: ShardLayout, tp: TPGroup, *, comm: bool = False) -> None:
        super().__init__()
        self.out_features, self.layout, self.tp, self.comm = linear.out_features, layout, tp, comm
        self.register_buffer("_cols", layout.indices(tp.rank), persistent=False)
        self.weight = _param(linear.weight[:, self._cols], linear.weight)
        self.bias = None if linear.bias is None else _param(linear.bias, linear.bias)
        self.in_features = self.weight.shape[1]
        self.region = None  # RegionEntry of a discovered block
        self.float8 = None  # parallel/float8.py's Float8Matmul when the shard trains in float8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        # torchao returns a view of its product, which the in-place all-reduce may not modify: a copy
        y = F.linear(x, weight) if self.float8 is None else self.float8(x, weight).clone()
        if self.region is not None and self.region.sequence_parallel:
            y = reduce_scatter_to_sp_region(y, self.tp)
        else:
            y = reduce_from_tp_region(y, self.tp)
        if self.region is not None:
            self.region.finish()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}/{self.layout.size}, out={self.out_features}, tp={self.tp.size}"


class InnerRowParallelLinear(RowParallelLinear):
    """A row shard whose sum the region reads again (a scan's x_proj, whose dt, B and C meet the channels):
    all-reduced (g), its bias added once, then entered like the region's input (f: the gradient, each
    rank's part from its heads, summed). The region goes on; the row after it ends it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        y = reduce_from_tp_region(F.linear(x, weight), self.tp)
        return copy_to_tp_region(y if self.bias is None else y + self.bias, self.tp)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", inner"


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + local) of a vocabulary padded to a multiple of t; rows >= vocab are padding."""

    vocab_size: int
    padded_size: int
    start: int
    local: int

    @classmethod
    def of(cls, vocab_size: int, tp: TPGroup) -> "VocabShard":
        padded = -(-vocab_size // tp.size) * tp.size
        local = padded // tp.size
        return cls(vocab_size, padded, tp.rank * local, local)

    @property
    def valid(self) -> int:
        """Rows of this shard inside the real vocabulary."""
        return max(0, min(self.local, self.vocab_size - self.start))

    def slice_rows(self, weight: torch.Tensor) -> torch.Tensor:
        out = weight.new_zeros((self.local, *weight.shape[1:]))
        out[: self.valid] = weight[self.start : self.start + self.valid]
        return out


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary rows (zeros elsewhere); the sum over ranks
    (one all-reduce) is the full embedding. ``padding_idx`` as in nn.Embedding: the rank owning
    that row never accumulates a gradient into it."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        _check_vocab_parallel(embedding)
        self.tp = tp
        self.shard = VocabShard.of(embedding.num_embeddings, tp)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx  # nn.Embedding keeps it in [0, num_embeddings)
        local_pad = None if self.padding_idx is None else self.padding_idx - self.shard.start
        self._local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.shard.valid else None
        self.weight = (
            weight if weight is not None else _param(self.shard.slice_rows(embedding.weight), embedding.weight)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.valid)
        # ids of other ranks look up row 0 and are zeroed below, so they add no gradient either
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp)

    def extra_repr(self) -> str:
        return f"vocab rows {self.shard.start}..{self.shard.start + self.shard.local} of {self.shard.padded_size}"


def _check_vocab_parallel(embedding: nn.Embedding) -> None:
    """Options whose result depends on the whole vocabulary's rows or ids are refused, not approximated."""
    refused = {
        "max_norm": embedding.max_norm,
        "scale_grad_by_freq": embedding.scale_grad_by_freq or None,
        "sparse": embedding.sparse or None,
    }
    bad = {k: v for k, v in refused.items() if v is not None}
    if bad:
        given = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        raise ValueError(
            f"vocab-parallel embedding of {embedding.num_embeddings} rows: {given} is not supported (max_norm "
            "renormalises rows in place on lookup, scale_grad_by_freq counts ids over the whole vocabulary, sparse "
            "gradients are not reduced); build the nn.Embedding without it, or leave this embedding out of tp_plan"
        )


class VocabParallelHead(nn.Module):
    """LM head split by vocabulary rows; returns ``VocabParallelLogits`` (never full-vocab logits)."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.shard = VocabShard.of(linear.out_features, tp)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = weight if weight is not None else _param(self.shard.slice_rows(linear.weight), linear.weight)
        self.bias = None
        if linear.bias is not None:
            self.bias = _param(self.shard.slice_rows(linear.bias.unsqueeze(-1)).squeeze(-1), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(copy_to_tp_region(x, self.tp), self.weight, self.bias)
        return VocabParallelLogits.wrap(local, self.shard, self.tp)

    def extra_repr(self) -> str:
        return f"vocab rows {self.shard.start}..{self.shard.start + self.shard.local} of {self.shard.padded_size}"
