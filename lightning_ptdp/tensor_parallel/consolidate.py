"""From per-rank shards back to the original tensors, and the gradient sums TP needs.

``full_state_dict`` gathers every sharded parameter over the tensor-parallel group and puts
each rank's rows/columns back where they came from (undoing the per-head interleave of fused
q/k/v), so the result has the original model's keys and values. A collective: call it on every
rank of the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.explicit_plan import shard_dim
from lightning_ptdp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def _gather(local: torch.Tensor, tp: TPGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return parts


def full_tensor(layer: nn.Module, attr: str, local: torch.Tensor) -> torch.Tensor:
    """The original-layout tensor of ``layer.<attr>`` (or of a gradient shaped like it)."""
    tp = layer.tp
    if isinstance(layer, (VocabParallelEmbedding, VocabParallelHead)):
        return torch.cat(_gather(local, tp), dim=0)[: layer.shard.vocab_size]
    if isinstance(layer, RowParallelLinear) and attr == "bias":
        return local
    dim = shard_dim(layer, attr)
    parts = _gather(local, tp)
    shape = list(local.shape)
    shape[dim] = layer.layout.size
    full = local.new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, layer.layout.indices(rank).to(local.device), part)
    return full


def _owners_by_name(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    owners = {}
    for path, module in model.named_modules():
        if isinstance(module, _TP_LAYERS):
            for attr, _ in module.named_parameters(recurse=False):
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
    owners = {id(p): (m, a) for m in model.modules() if isinstance(m, _TP_LAYERS) for a, p in m.named_parameters(recurse=False)}
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad  # ZeRO: DTensor
        owner = owners.get(id(param))
        grads[name] = full_tensor(owner[0], owner[1], grad) if owner else grad
    return grads


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's data of a tensor that ZeRO may have sharded into a DTensor (a view, writable)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def flat_all_reduce(tensors: list[torch.Tensor], group: Any, scale: float = 1.0) -> None:
    """All-reduce ``tensors`` in place through one flat buffer per dtype (one collective each)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def all_reduce_grads(params: list[nn.Parameter], group: Any, scale: float = 1.0) -> None:
    """Sum (times ``scale``) the gradients of ``params`` over ``group`` in one flat buffer per dtype,
    built from the parameter list so it is identical on every rank whatever each backward reached:
    a missing gradient contributes zeros, and stays None only where no rank has one (as one process)."""
    if not params:
        return
    had = [p.grad is not None for p in params]
    for param, present in zip(params, had):
        if not present:
            param.grad = torch.zeros_like(param)
    flags = torch.tensor(had, dtype=torch.float32, device=local_tensor(params[0]).device)
    flat_all_reduce([*(local_tensor(p.grad) for p in params), flags], group, scale)
    for param, anywhere in zip(params, flags.tolist()):
        if not anywhere:
            param.grad = None


def _replicated_kv(model: nn.Module) -> list[tuple[ColumnParallelLinear, nn.Parameter]]:
    """KV projection weights and biases replicated over several TP ranks (t > n_kv_heads), in model order."""
    return [
        (layer, param)
        for layer in model.modules()
        if isinstance(layer, ColumnParallelLinear) and layer.layout.replication > 1
        for param in (layer.weight, layer.bias)
        if param is not None
    ]


def sum_partial_gradients(model: nn.Module, partial: list[tuple[nn.Module, str]], tp: TPGroup) -> None:
    """Finish the gradients TP leaves partial, once per optimizer step (buffers from the parameter
    lists, identical on every rank; a rank that did not use a parameter adds zeros):

    - parameters replicated inside sequence-parallel blocks (norms, row biases) saw only this
      rank's part of the sequence: sum over the group (one flat all-reduce);
    - KV heads replicated over several ranks (t > n_kv_heads): each copy saw only its ranks'
      query heads: sum the copies (scatter into the full tensor, all-reduce, take own rows).
    """
    all_reduce_grads([getattr(module, name) for module, name in partial], tp.group)
    replicated = _replicated_kv(model)
    if not replicated:
        return
    if any(hasattr(param, "to_local") for _, param in replicated):
        raise NotImplementedError(
            "zero_stage > 0 with key/value heads replicated over tensor-parallel ranks "
            "(tensor_parallel_size > n_kv_heads) is not supported yet; use zero_stage=0 or a smaller t"
        )
    rows = [layer.layout.indices(tp.rank).to(param.device) for layer, param in replicated]
    fulls = []
    for (layer, param), own in zip(replicated, rows):
        full = param.new_zeros((layer.layout.size, *param.shape[1:]))
        if param.grad is not None:
            full.index_copy_(0, own, param.grad)
        fulls.append(full)
    had = torch.tensor([param.grad is not None for _, param in replicated], dtype=torch.float32, device=fulls[0].device)
    flat_all_reduce([*fulls, had], tp.group)
    for (_, param), own, full, anywhere in zip(replicated, rows, fulls, had.tolist()):
        if anywhere and param.grad is None:
            param.grad = full.index_select(0, own)
        elif anywhere:
            param.grad.copy_(full.index_select(0, own))


def global_grad_norm(
    parameters: list[nn.Parameter], model: nn.Module, tp: TPGroup | None, dp_group: Any = None,
    pp_group: Any = None, exclude: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, as a single process would compute it.

    Sharded parameters contribute their squares summed over the tp group; replicated ones (norms,
    row biases, position embeddings) once; KV heads replicated over r ranks 1/r from each copy.
    Under ZeRO each dp rank holds a slice of every gradient (summed over ``dp_group``); under
    pipeline parallelism each stage its own layers (summed over ``pp_group``), a weight tied
    across stages counted on one of them (the others pass its id in ``exclude``).
    """
    weight = {}
    for layer in model.modules():
        if isinstance(layer, _TP_LAYERS):
            replication = getattr(getattr(layer, "layout", None), "replication", 1)
            for attr, param in layer.named_parameters(recurse=False):
                replicated_bias = isinstance(layer, RowParallelLinear) and attr == "bias"
                weight[id(param)] = None if replicated_bias else 1.0 / replication
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for param in parameters:
        if param.grad is None or id(param) in exclude:
            continue
        square = local_tensor(param.grad.detach()).double().pow(2).sum().cpu()
        share = weight.get(id(param))
        if share is None:
            replicated += square
        else:
            sharded += square * share
    device = parameters[0].device if parameters else torch.device("cpu")
    if tp is not None:
        sharded = sharded.to(device)
        dist.all_reduce(sharded, group=tp.group)
    total = (sharded.cpu() + replicated).to(device)
    for group in (dp_group, pp_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt().cpu()


def clip_grad_norm(
    parameters: list[nn.Parameter], model: nn.Module, tp: TPGroup | None, max_norm: float, dp_group: Any = None,
    pp_group: Any = None, exclude: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over the whole parallel model."""
    total = global_grad_norm(parameters, model, tp, dp_group, pp_group, exclude)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for param in parameters:
            if param.grad is not None:
                local_tensor(param.grad).mul_(scale)
    return total


def local_shard(layer: nn.Module, attr: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of an original-layout tensor (the inverse of ``full_tensor``)."""
    if isinstance(layer, (VocabParallelEmbedding, VocabParallelHead)):
        rows = full if full.dim() > 1 else full.unsqueeze(-1)
        local = layer.shard.slice_rows(rows)
        return local if full.dim() > 1 else local.squeeze(-1)
    if isinstance(layer, RowParallelLinear) and attr == "bias":
        return full
    dim = shard_dim(layer, attr)
    return full.index_select(dim, layer.layout.indices(layer.tp.rank).to(full.device))


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
