"""Replicated data parallelism on the dp axis of the mesh (ZeRO stage 0)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(module: torch.nn.Module, dp_mesh: DeviceMesh, **ddp_kwargs: Any) -> torch.nn.Module:
    """Average gradients over the dp group only (never over tp or pp ranks).

    torch's DDP does this well (bucketed all-reduce overlapped with backward), so it is used as is,
    restricted to the dp sub-group. With d == 1 there is nothing to average and the module is
    returned unwrapped.
    """
    if dp_mesh.size() == 1:
        return module
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=dp_mesh.get_group(), **ddp_kwargs)
