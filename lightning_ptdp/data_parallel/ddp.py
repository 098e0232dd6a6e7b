"""Replicated data parallelism on the dp axis of the mesh (ZeRO stage 0); DDP's search for
parameters without a gradient only where a setup probe step finds some."""

from __future__ import annotations

import logging
from typing import AbstractSet as Set
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_ptdp.core.census import ParamsReached, record_alone

log = logging.getLogger(__name__)


def apply_data_parallel(
    module: torch.nn.Module,
    dp_mesh: DeviceMesh,
    *,
    ignore: Sequence[str] = (),
    probe: Optional[Callable[[], Any] | ParamsReached] = None,
    **ddp_kwargs: Any,
) -> torch.nn.Module:
    """Average gradients over the dp group only (never over tp or pp ranks).

    torch's DDP does this well (bucketed all-reduce overlapped with backward), so it is used as is,
    restricted to the dp sub-group. With d == 1 there is nothing to average and the module is
    returned unwrapped. ``ignore``: parameter names DDP leaves alone, neither broadcast at the
    start nor averaged (split experts, which differ per rank and average over their own group).
    ``probe``: the census's ``ParamsReached`` (or one training step returning what the step
    returns); the parameters its graph does not reach on some rank turn on DDP's
    ``find_unused_parameters``.
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
            # head the inputs never use, an expert no token of this rank's batch is routed to) never fires
            # DDP's hook, so its bucket never reduces and the next step raises. find_unused_parameters makes
            # DDP walk the autograd graph from the outputs after each forward (CPU time linear in the graph's
            # nodes) and all-reduce one used-flag per parameter; a parameter unused on every rank keeps no
            # gradient, as in one process.
            shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
            log.info(
                "data parallel: a step may give no gradient to %s: DDP searches each step's graph for unused "
                "parameters (find_unused_parameters)",
                shown or "parameters of another rank",
            )
            ddp_kwargs["find_unused_parameters"] = True
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=dp_mesh.get_group(), **ddp_kwargs)


def params_without_grad(
    module: torch.nn.Module, probe: Callable[[], Any] | ParamsReached, ignore: Set[str] = frozenset()
) -> list[str]:
    """Names of ``module``'s trainable parameters (less ``ignore``) that the probe step's graph does
    not reach, or that a later step may not (``ParamsReached.routed``): read from the setup's census,
    or from a census of its own when given a probe."""
    reached = probe
    if not isinstance(reached, ParamsReached):
        reached = ParamsReached(module)
        with torch.compiler.set_stance("force_eager"):
            record_alone(probe, reached)
    maybe_unused = dict.fromkeys([*reached.unused, *reached.routed])  # routed: reached by value, step by step
    return [name for name in maybe_unused if name not in ignore]
