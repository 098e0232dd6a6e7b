"""From per-rank shards back to the original tensors, and the gradient sums TP needs.

``full_state_dict`` gathers every sharded parameter over the tensor-parallel group and puts
each rank's rows/columns back where they came from (undoing the per-head interleave of fused
q/k/v), so the result has the original model's keys and values. A collective: call it on every
rank of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.tensor_parallel.collectives import TPGroup
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
    dim = 1 if isinstance(layer, RowParallelLinear) else 0
    parts = _gather(local, tp)
    shape = list(local.shape)
    shape[dim] = layer.layout.size
    full = local.new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, layer.layout.indices(rank).to(local.device), part)
    return full


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state_dict of a tensor-parallel model (same keys as before the rewrite)."""
    owners = {}
    for path, module in model.named_modules():
        if isinstance(module, _TP_LAYERS):
            for attr, _ in module.named_parameters(recurse=False):
                owners[f"{path}.{attr}" if path else attr] = (module, attr)
    state = model.state_dict(keep_vars=False)
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


def sum_partial_gradients(model: nn.Module, partial: list[nn.Parameter], tp: TPGroup) -> None:
    """Finish the gradients TP leaves partial, once per optimizer step:

    - parameters replicated inside sequence-parallel blocks (norms, row biases) saw only this
      rank's part of the sequence: sum over the group (one flat all-reduce);
    - KV heads replicated over several ranks (t > n_kv_heads): each copy saw only its ranks'
      query heads: sum the copies (scatter into the full tensor, all-reduce, take own rows).
    """
    grads = [p.grad for p in partial if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for layer in model.modules():
        if isinstance(layer, ColumnParallelLinear) and layer.layout.replication > 1:
            for param in (layer.weight, layer.bias):
                if param is None or param.grad is None:
                    continue
                rows = layer.layout.indices(tp.rank).to(param.grad.device)
                full = param.grad.new_zeros((layer.layout.size, *param.grad.shape[1:]))
                full.index_copy_(0, rows, param.grad)
                dist.all_reduce(full, group=tp.group)
                param.grad.copy_(full.index_select(0, rows))


def global_grad_norm(parameters: list[nn.Parameter], model: nn.Module, tp: TPGroup) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, as a single process would compute it.

    Sharded parameters contribute their squares summed over the group; replicated ones (norms,
    row biases, position embeddings) once; KV heads replicated over r ranks 1/r from each copy.
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
        if param.grad is None:
            continue
        square = param.grad.detach().double().pow(2).sum().cpu()
        share = weight.get(id(param))
        if share is None:
            replicated += square
        else:
            sharded += square * share
    dist.all_reduce(sharded, group=tp.group)
    return (sharded + replicated).sqrt()


def clip_grad_norm(parameters: list[nn.Parameter], model: nn.Module, tp: TPGroup, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over the whole tensor-parallel model."""
    total = global_grad_norm(parameters, model, tp)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(scale)
    return total


def local_shard(layer: nn.Module, attr: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of an original-layout tensor (the inverse of ``full_tensor``)."""
    if isinstance(layer, (VocabParallelEmbedding, VocabParallelHead)):
        rows = full if full.dim() > 1 else full.unsqueeze(-1)
        local = layer.shard.slice_rows(rows)
        return local if full.dim() > 1 else local.squeeze(-1)
    if isinstance(layer, RowParallelLinear) and attr == "bias":
        return full
    dim = 1 if isinstance(layer, RowParallelLinear) else 0
    return full.index_select(dim, layer.layout.indices(layer.tp.rank).to(full.device))


def shard_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An unsharded state_dict (any tensor-parallel size, or none) cut to this rank's shards."""
    owners = {}
    for path, module in model.named_modules():
        if isinstance(module, _TP_LAYERS):
            for attr, _ in module.named_parameters(recurse=False):
                owners[f"{path}.{attr}" if path else attr] = (module, attr)
    return {key: local_shard(*owners[key], value) if key in owners else value for key, value in full_state.items()}


def _param_owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    return {
        id(param): (layer, attr)
        for layer in model.modules()
        if isinstance(layer, _TP_LAYERS)
        for attr, param in layer.named_parameters(recurse=False)
    }


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every per-parameter tensor (Adam's moments...) unsharded.

    Parameter indices follow ``model.parameters()`` order, which the rewrite keeps, so the result
    is the state a single process would hold and loads back at any tensor-parallel size.
    """
    owners = _param_owners(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()
    full = {}
    for index, values in state["state"].items():
        owner = owners.get(id(params[index]))
        full[index] = {
            key: full_tensor(*owner, value) if owner and torch.is_tensor(value) and value.shape == params[index].shape else value
            for key, value in values.items()
        }
    return {"state": full, "param_groups": state["param_groups"]}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of ``full_optimizer_state`` for this rank's shards."""
    owners = _param_owners(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = {}
    for index, values in state["state"].items():
        param = params[int(index)]
        owner = owners.get(id(param))
        local[index] = {
            key: local_shard(*owner, value) if owner and torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape else value
            for key, value in values.items()
        }
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})
