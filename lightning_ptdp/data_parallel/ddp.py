"""Replicated data parallelism on the dp axis of the mesh (ZeRO stage 0); DDP's search for
parameters without a gradient only where a setup probe step finds some."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def apply_data_parallel(
    module: torch.nn.Module,
    dp_mesh: DeviceMesh,
    *,
    ignore: Sequence[str] = (),
    probe: Optional[Callable[[], Any]] = None,
    **ddp_kwargs: Any,
) -> torch.nn.Module:
    """Average gradients over the dp group only (never over tp or pp ranks).

    torch's DDP does this well (bucketed all-reduce overlapped with backward), so it is used as is,
    restricted to the dp sub-group. With d == 1 there is nothing to average and the module is
    returned unwrapped. ``ignore``: parameter names DDP leaves alone, neither broadcast at the
    start nor averaged (split experts, which differ per rank and average over their own group).
    ``probe``: one training step returning what the step returns (its loss); the parameters its
    graph does not reach on some rank turn on DDP's ``find_unused_parameters``.
    """
    if dp_mesh.size() == 1:
        return module
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if probe is not None and "find_unused_parameters" not in ddp_kwargs:
        unused = params_without_grad(module, probe, set(ignore))
        flag = torch.tensor([float(bool(unused))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dp_mesh.get_group())
        if flag.item():
            # A parameter no step's loss reaches (a sparse-attention indexer feeding only top-k indices, a
            # head the inputs never use) never fires DDP's hook, so its bucket never reduces and the next
            # step raises. find_unused_parameters makes DDP walk the autograd graph from the outputs after
            # each forward (CPU time linear in the graph's nodes) and all-reduce one used-flag per
            # parameter; a parameter unused on every rank keeps no gradient, as in one process.
            shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
            log.info(
                "data parallel: the probe step gives no gradient to %s: DDP searches each step's graph for unused "
                "parameters (find_unused_parameters)",
                shown or "parameters of another rank",
            )
            ddp_kwargs["find_unused_parameters"] = True
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=dp_mesh.get_group(), **ddp_kwargs)


def params_without_grad(module: torch.nn.Module, probe: Callable[[], Any], ignore: set[str] = frozenset()) -> list[str]:
    """Names of ``module``'s trainable parameters (less ``ignore``) that the autograd graph of the
    probe step's output tensors does not reach: the search DDP's ``find_unused_parameters`` makes
    each step, made once. Empty when the output holds no tensor with a graph (nothing to tell)."""
    with torch.enable_grad(), torch.compiler.set_stance("force_eager"):
        output = probe()
    roots: list[torch.Tensor] = []  # the tensors of the step's output (mappings, sequences, dataclasses of them)
    apply_to_collection(output, torch.Tensor, lambda t: roots.append(t) if t.requires_grad else None)
    if not roots:
        return []
    reached = _graph_params(roots)
    return [
        name for name, p in module.named_parameters() if p.requires_grad and name not in ignore and id(p) not in reached
    ]


def _graph_params(roots: list[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors (parameters) the autograd graphs of ``roots`` accumulate into."""
    reached = {id(t) for t in roots if t.grad_fn is None}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes .grad of
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return reached
