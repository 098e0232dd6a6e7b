"""Explicit tensor-parallel plans: ``tp_plan={"module path or glob": style}``.

Keys are module paths or fnmatch globs; each must match a module, and a module matched twice must
get one style. Each colwise layer brings its own f and each rowwise its own g (Megatron's way); the
forward must take head counts from tensor shapes (``view(B, T, -1, head_dim)``). Linear-likes are
nn.Linear and transformers' ``Conv1D`` (weight (in, out); shards keep that layout, so checkpoints
keep the model's shapes). A tied weight is sharded only as the vocabulary pair (vocab_embedding +
vocab_head, both in the plan); any other tie is refused, never broken.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn

from lightning_ptdp.core.blocks import is_conv1d
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    VocabParallelHead,
)

EXPLICIT_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head")
_VOCAB_PAIR = {"vocab_embedding", "vocab_head"}


def _linear_view(conv: nn.Module) -> SimpleNamespace:
    """A Conv1D seen as nn.Linear: weight (out, in) as a transposed view of the (in, out) one."""
    return SimpleNamespace(
        in_features=conv.weight.shape[0], out_features=conv.nf, weight=conv.weight.t(), bias=conv.bias
    )


def _transpose_weight(layer: nn.Module) -> None:
    layer.weight = nn.Parameter(layer.weight.detach().t().contiguous(), requires_grad=layer.weight.requires_grad)


class ColumnParallelConv1D(ColumnParallelLinear):
    """A column shard of transformers' Conv1D; weight (in, out/t) like the original's (in, out)."""

    transposed = True  # the shared forward uses weight.t()

    def __init__(self, conv: nn.Module, layout: ShardLayout, tp: TPGroup, *, comm: bool = True) -> None:
        super().__init__(_linear_view(conv), layout, tp, comm=comm)
        _transpose_weight(self)


class RowParallelConv1D(RowParallelLinear):
    """A row shard of transformers' Conv1D; weight (in/t, out) like the original's (in, out)."""

    transposed = True  # the shared forward uses weight.t()

    def __init__(self, conv: nn.Module, layout: ShardLayout, tp: TPGroup, *, comm: bool = True) -> None:
        super().__init__(_linear_view(conv), layout, tp, comm=comm)
        _transpose_weight(self)


def shard_dim(layer: nn.Module, attr: str) -> int:
    """The dimension of ``layer.<attr>`` a column/row layer splits (a column bias: 0; a row layer's
    bias is not split); a Conv1D shard's weight is transposed, so its dimensions swap."""
    if attr != "weight":
        return 0
    return int(isinstance(layer, RowParallelLinear)) ^ int(getattr(layer, "transposed", False))


def _holders(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> the module paths holding it directly (several: a tied weight)."""
    holders: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for _, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append(path)
    return holders


def check_ties(model: nn.Module, resolved: dict[str, str]) -> None:
    """A weight tied between modules stays one Parameter only as the vocabulary pair, both planned."""
    holders = _holders(model)
    for path in resolved:
        for name, param in model.get_submodule(path).named_parameters(recurse=False):
            tied = sorted(set(holders[id(param)]))
            if len(tied) < 2:
                continue
            styles = {p: resolved.get(p) for p in tied}
            pair = sorted(s for s in styles.values() if s) == ["vocab_embedding", *["vocab_head"] * (len(tied) - 1)]
            if not pair:
                given = ", ".join(f"'{p}': {s!r}" if s else f"'{p}' (not in tp_plan)" for p, s in styles.items())
                raise ValueError(
                    f"tp_plan shards '{path}.{name}', a weight tied between {given}; sharding one would silently "
                    "untie it. A tied embedding and LM head are split together: give the embedding 'vocab_embedding' "
                    "and every module sharing its weight 'vocab_head'; other ties: leave all of them out of tp_plan"
                )


def _check_linear_like(path: str, style: str, module: nn.Module) -> None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise ValueError(
            f"tp_plan['{path}']={style!r} needs a Linear-like module (nn.Linear or transformers' Conv1D), found "
            f"{type(module).__name__}; match only the projections (e.g. 'model.layers.*.mlp.up_proj')"
        )


def fused_parts(parts: str) -> tuple[int, ...] | None:
    """'3' (equal parts) -> (1, 1, 1); '4|2|2' (q | k | v heads with fewer KV heads) -> (4, 2, 2)."""
    pieces = parts.split("|") if parts else ["1"]
    if not all(p.isdigit() and int(p) >= 1 for p in pieces):
        return None
    return (1,) * int(pieces[0]) if len(pieces) == 1 else tuple(map(int, pieces))


def check_plan(plan: object, *, tensor_parallel_size: int, sequence_parallel: bool) -> dict[str, str] | None:
    """An explicit ``tp_plan`` ({module path or glob: style}) checked against the layout, at
    strategy construction (before any process starts); None when there is none."""
    if plan is None:
        return None
    check_styles(plan)
    if tensor_parallel_size == 1:
        raise ValueError("tp_plan is given but tensor_parallel_size=1; set tensor_parallel_size > 1 or drop tp_plan")
    if sequence_parallel:
        raise ValueError("sequence_parallel=True needs the discovered plan; drop tp_plan or sequence_parallel")
    return plan


def check_styles(plan: object) -> None:
    """Every entry of ``plan`` names a module (path or glob) and a style this module knows."""
    if not isinstance(plan, dict):
        raise ValueError(
            f"tp_plan={plan!r} must be a dict of module path -> style, e.g. {{'blocks.0.attn.q': 'colwise'}}"
        )
    for path, style in plan.items():
        kind, _, parts = str(style).partition(":")
        fused = kind == "colwise_fused" and fused_parts(parts) is not None
        if not isinstance(path, str) or not (fused or style in EXPLICIT_STYLES):
            raise ValueError(
                f"tp_plan[{path!r}]={style!r} is not a style: use one of "
                f"{', '.join(repr(s) for s in EXPLICIT_STYLES)}, 'colwise_fused:K' (K equal parts) or "
                "'colwise_fused:a|b|c' (parts of a, b, c heads, e.g. q | k | v = 4|2|2)"
            )


def _column(module: nn.Module, parts: str, tp: TPGroup) -> nn.Module:
    units = fused_parts(parts)
    out_features = module.nf if is_conv1d(module) else module.out_features
    if len(set(units)) == 1:
        layout = ShardLayout(len(units), out_features // len(units), 1, tp.size)
    else:  # each part (in units of out_features / sum(parts)) split over t
        layout = ShardLayout(len(units), max(units), out_features // sum(units), tp.size, units)
    if is_conv1d(module):
        return ColumnParallelConv1D(module, layout, tp)
    return ColumnParallelLinear(module, layout, tp, comm=True)


def _row(module: nn.Module, tp: TPGroup) -> nn.Module:
    if is_conv1d(module):
        return RowParallelConv1D(module, ShardLayout(1, module.weight.shape[0], 1, tp.size), tp)
    return RowParallelLinear(module, ShardLayout(1, module.in_features, 1, tp.size), tp, comm=True)


def rewrite(model: nn.Module, resolved: dict[str, str], tp: TPGroup) -> list[tuple[str, str, str]]:
    """Swap every planned module for its shard; (path, style, detail) per module, embeddings first
    (a tied head then takes the embedding's sharded weight)."""
    entries = []
    embedding_weights: dict[int, nn.Parameter] = {}
    for path, style in sorted(resolved.items(), key=lambda item: item[1] != "vocab_embedding"):
        module = model.get_submodule(path)
        kind, _, parts = style.partition(":")
        if kind in ("colwise", "colwise_fused", "rowwise"):
            _check_linear_like(path, style, module)
            new = _column(module, parts, tp) if kind != "rowwise" else _row(module, tp)
            what = "Conv1D (weight (in, out))" if is_conv1d(module) else "Linear"
        elif kind == "vocab_embedding":
            new = VocabParallelEmbedding(module, tp)
            embedding_weights[id(module.weight)] = new.weight
            what = "embedding"
        else:
            new = VocabParallelHead(module, tp, weight=embedding_weights.get(id(module.weight)))
            what = "tied to the embedding" if id(module.weight) in embedding_weights else "untied"
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        entries.append((path, style, f"explicit plan, {what}"))
    return entries
