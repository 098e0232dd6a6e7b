"""From per-rank shards back to the original tensors, and from the original tensors to shards.

``full_state_dict`` gathers every sharded parameter over the tensor-parallel group and puts
each rank's rows/columns back where they came from (undoing the per-head interleave of fused
q/k/v), so the result has the original model's keys and values. A collective: call it on every
rank of the group.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.explicit_plan import shard_dim
from lightning_ptdp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    VocabParallelHead,
    parameter_shard,
)

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def _gather(local: torch.Tensor, tp: TPGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return parts


def full_tensor(layer: nn.Module, attr: str, local: torch.Tensor) -> torch.Tensor:
    """The original-layout tensor of ``layer.<attr>`` (or of a gradient shaped like it)."""
    if isinstance(layer, (VocabParallelEmbedding, VocabParallelHead)):
        return torch.cat(_gather(local, layer.tp), dim=0)[: layer.shard.vocab_size]
    if isinstance(layer, RowParallelLinear) and attr == "bias":
        return local
    tp, dim, layout = tp_layout(layer, attr)
    parts = _gather(local, tp)
    shape = list(local.shape)
    shape[dim] = layout.size
    full = local.new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, layout.indices(rank).to(local.device), part)
    return full


def tp_layout(layer: nn.Module, attr: str) -> tuple[TPGroup, int, ShardLayout] | None:
    """(group, dim, layout) of a column/row layer's parameter or of a plain parameter held as a share
    (a row layer's bias included: callers that keep it whole say so first); None for anything else."""
    shard = parameter_shard(layer, attr)
    if shard is not None:
        return shard.tp, shard.dim, shard.layout
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        return layer.tp, shard_dim(layer, attr), layer.layout
    return None


def split_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, int, ShardLayout]]:
    """(module path, parameter, dim, layout) of every parameter tensor parallelism split, in model
    order: a column/row layer's or a share held in place; a row layer's bias, whole on every rank, is none."""
    for path, layer in model.named_modules():
        for attr, param in layer.named_parameters(recurse=False):
            found = None if isinstance(layer, RowParallelLinear) and attr == "bias" else tp_layout(layer, attr)
            if found is not None:
                yield path, param, found[1], found[2]


def _owners_by_name(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    owners = {}
    for path, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            if isinstance(module, _TP_LAYERS) or parameter_shard(module, attr) is not None:
                owners[f"{path}.{attr}" if path else attr] = (module, attr)
    return owners


def full_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The unsharded state_dict of a tensor-parallel model (same keys as before the rewrite);
    ``state`` is this rank's TP-local state dict when it comes from elsewhere (ZeRO's gather)."""
    owners = _owners_by_name(model)
    state = model.state_dict(keep_vars=False) if state is None else state
    return {
        key: full_tensor(owners[key][0], owners[key][1], value) if key in owners else value
        for key, value in state.items()
    }


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients keyed by parameter name (after the strategy's TP gradient sums)."""
    owners = {id(getattr(m, a)): (m, a) for m, a in _owners_by_name(model).values()}
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad  # ZeRO: DTensor
        owner = owners.get(id(param))
        grads[name] = full_tensor(owner[0], owner[1], grad) if owner else grad
    return grads


def local_shard(layer: nn.Module, attr: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of an original-layout tensor (the inverse of ``full_tensor``)."""
    if isinstance(layer, (VocabParallelEmbedding, VocabParallelHead)):
        rows = full if full.dim() > 1 else full.unsqueeze(-1)
        local = layer.shard.slice_rows(rows)
        return local if full.dim() > 1 else local.squeeze(-1)
    if isinstance(layer, RowParallelLinear) and attr == "bias":
        return full
    tp, dim, layout = tp_layout(layer, attr)
    return full.index_select(dim, layout.indices(tp.rank).to(full.device))


def shard_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An unsharded state_dict (any tensor-parallel size, or none) cut to this rank's shards."""
    owners = _owners_by_name(model)
    return {key: local_shard(*owners[key], value) if key in owners else value for key, value in full_state.items()}


def map_optimizer_state_by_name(model: nn.Module, state: dict, to_full: bool) -> dict:
    """Unshard (``to_full``) or shard again the per-parameter tensors of an optimizer state dict
    keyed by parameter names, as torch's distributed-checkpoint helpers produce under ZeRO."""
    owners = _owners_by_name(model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def convert(name: str, value: Any) -> Any:
        owner = owners.get(name)
        if owner is None or not torch.is_tensor(value) or value.dim() == 0:
            return value
        if to_full:
            return full_tensor(*owner, value) if tuple(value.shape) == shapes[name] else value
        return local_shard(*owner, value) if tuple(value.shape) != shapes[name] else value

    converted = {name: {k: convert(name, v) for k, v in values.items()} for name, values in state["state"].items()}
    return {**state, "state": converted}
