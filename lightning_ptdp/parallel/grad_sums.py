"""The collectives that finish a step's gradients, each named by the group it runs over: sums of
weights tied across pipeline stages (pp), of what TP leaves partial (tp), and the whole model's
norm for clipping. Their caller and order: ``StepGradients`` (parallel/gradients.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.core.comm import all_reduce_grads, flat_all_reduce, local_tensor
from lightning_ptdp.pipeline.split import PipelineSplit
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.consolidate import split_parameters
from lightning_ptdp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    VocabParallelHead,
)

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def _dp_shard_shape(shape: tuple[int, ...], dp_rank: int, dp_size: int) -> tuple[int, ...]:
    """The rows of ``shape`` FSDP2 gives dp rank ``dp_rank`` (torch.chunk over dim 0)."""
    rows = -(-shape[0] // dp_size)
    return (max(0, min(rows, shape[0] - dp_rank * rows)), *shape[1:])


def sum_tied_over_pp(
    split: PipelineSplit, pp_group: Any, device: torch.device, fsdp_dp: Optional[tuple[int, int]] = None
) -> None:
    """Parameters used on several pipeline ranks (embedding tied to the LM head) get the sum of
    their gradients on every holder, as Megatron does, so the copies stay equal. Every rank of
    the pipeline group joins; ranks not holding a parameter add zeros (of the dp shard's shape
    under ZeRO, ``fsdp_dp`` = (dp rank, dp size): the holders share this rank's dp coordinate)."""
    if not split.tied:
        return
    grads = []
    for _, shape, dtype, local_name in split.tied:
        param = split.tied_param(local_name)
        if param is not None and param.grad is None:  # this copy saw no gradient: it still takes the sum
            param.grad = torch.zeros_like(param)
        if param is not None:
            grads.append(local_tensor(param.grad))
        else:
            local = _dp_shard_shape(shape, *fsdp_dp) if fsdp_dp is not None else shape
            grads.append(torch.zeros(local, dtype=dtype, device=device))
    flat_all_reduce(grads, pp_group)


def _replicated_kv(model: nn.Module) -> list[tuple[nn.Parameter, int, ShardLayout]]:
    """(parameter, dim, layout) of split parameters with heads copied over several TP ranks (t >
    n_kv_heads; multi-query attention's one KV head in a fused column; a conv over heads beside one shared group
    held as its share), in model order."""
    return [(param, dim, layout) for _, param, dim, layout in split_parameters(model) if layout.replication > 1]


def sum_partial_over_tp(model: nn.Module, partial: list[tuple[nn.Module, str]], tp: TPGroup) -> None:
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
    if any(hasattr(param, "to_local") for param, _, _ in replicated):
        raise NotImplementedError(
            "zero_stage 2 or 3 with key/value heads replicated over tensor-parallel ranks "
            "(tensor_parallel_size > n_kv_heads) is not supported yet; use zero_stage=0 or 1, or a smaller t"
        )
    own = [layout.indices(tp.rank).to(param.device) for param, _, layout in replicated]
    fulls = []
    for (param, dim, layout), rows in zip(replicated, own):
        shape = list(param.shape)
        shape[dim] = layout.size
        full = param.new_zeros(shape)
        if param.grad is not None:
            full.index_copy_(dim, rows, param.grad)
        fulls.append(full)
    had = torch.tensor(
        [param.grad is not None for param, _, _ in replicated], dtype=torch.float32, device=fulls[0].device
    )
    flat_all_reduce([*fulls, had], tp.group)
    for (param, dim, _), rows, full, anywhere in zip(replicated, own, fulls, had.tolist()):
        if anywhere and param.grad is None:
            param.grad = full.index_select(dim, rows)
        elif anywhere:
            param.grad.copy_(full.index_select(dim, rows))


def global_grad_norm(
    parameters: list[nn.Parameter],
    model: nn.Module,
    tp: TPGroup | None,
    dp_group: Any = None,
    pp_group: Any = None,
    exclude: frozenset[int] = frozenset(),
    split: Optional[tuple] = None,
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, as a single process would compute it.

    Sharded parameters contribute their squares summed over the tp group; replicated ones (norms,
    row biases, position embeddings) once; KV heads replicated over r ranks 1/r from each copy.
    Under ZeRO each dp rank holds a slice of every gradient (summed over ``dp_group``); under
    pipeline parallelism each stage its own layers (summed over ``pp_group``), a weight tied
    across stages counted on one of them (the others pass its id in ``exclude``). ``split``: (group,
    ids) of parameters whose ranks in ``group`` each hold different parts (split experts, summed there),
    and optionally {id: share}: a replicated expert's slots count 1 / replicas (per row of dim 0).
    """
    weight: dict[int, Any] = {}  # None: replicated; a float: 1 / copies; (dim, tensor): 1 / copies of each index
    for layer in model.modules():
        if isinstance(layer, _TP_LAYERS):  # the vocabulary's shards; a row layer's bias is replicated
            weight |= {
                id(p): None if isinstance(layer, RowParallelLinear) and a == "bias" else 1.0
                for a, p in layer.named_parameters(recurse=False)
            }
    for _, param, dim, layout in split_parameters(model):
        copies = layout.local_replication()
        uniform = bool((copies == copies[0]).all())
        weight[id(param)] = 1.0 / float(copies[0]) if uniform else (dim, 1.0 / copies.double())
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    parts = torch.zeros((), dtype=torch.float64)
    split_group, split_ids, *more = split or (None, frozenset())
    shares = more[0] if more else {}
    for param in parameters:
        if param.grad is None or id(param) in exclude:
            continue
        grad = local_tensor(param.grad.detach()).double()
        share = shares.get(id(param))
        if torch.is_tensor(share):  # per row: the squares of each slot
            square = (grad.pow(2).reshape(grad.shape[0], -1).sum(1).cpu() * share).sum()
        else:
            square = grad.pow(2).sum().cpu() * (1.0 if share is None else share)
        share = weight.get(id(param))
        if isinstance(share, tuple):  # a layout whose parts are copied over different numbers of ranks
            dim, per_index = share
            square = (grad.pow(2).movedim(dim, 0).reshape(grad.shape[dim], -1).sum(1).cpu() * per_index).sum()
            share = 1.0
        if id(param) in split_ids:
            parts += square
        elif share is None:
            replicated += square
        else:
            sharded += square * share
    device = parameters[0].device if parameters else torch.device("cpu")
    if tp is not None:
        sharded = sharded.to(device)
        dist.all_reduce(sharded, group=tp.group)
    if split_group is not None:
        parts = parts.to(device)
        dist.all_reduce(parts, group=split_group)
    total = (sharded.cpu() + replicated + parts.cpu()).to(device)
    for group in (dp_group, pp_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt().cpu()


def clip_grad_norm(
    parameters: list[nn.Parameter],
    model: nn.Module,
    tp: TPGroup | None,
    max_norm: float,
    dp_group: Any = None,
    pp_group: Any = None,
    exclude: frozenset[int] = frozenset(),
    split: Optional[tuple] = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over the whole parallel model."""
    total = global_grad_norm(parameters, model, tp, dp_group, pp_group, exclude, split)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for param in parameters:
            if param.grad is not None:
                local_tensor(param.grad).mul_(scale)
    return total
