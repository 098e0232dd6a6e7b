"""Replicated data parallelism on the dp axis of the mesh (ZeRO stage 0)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(
    module: torch.nn.Module, dp_mesh: DeviceMesh, *, ignore: Sequence[str] = (), **ddp_kwargs: Any
) -> torch.nn.Module:
    """Average gradients over the dp group only (never over tp or pp ranks).

    torch's DDP does this well (bucketed all-reduce overlapped with backward), so it is used as is,
    restricted to the dp sub-group. With d == 1 there is nothing to average and the module is
    returned unwrapped. ``ignore``: parameter names DDP leaves alone, neither broadcast at the
    start nor averaged (split experts, which differ per rank and average over their own group).
    """
    if dp_mesh.size() == 1:
        return module
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=dp_mesh.get_group(), **ddp_kwargs)
