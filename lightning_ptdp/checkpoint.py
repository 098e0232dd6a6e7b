"""What a checkpoint holds under tensor parallelism and ZeRO, and how it loads back.

Model weights are always saved unsharded (the original model's keys and shapes), so a
checkpoint loads on one device with plain ``load_state_dict`` and on any other layout:
  - TP: each rank's shards are gathered into the original tensors; on load, cut again for the
    new t (``consolidate.shard_state_dict``);
  - ZeRO (FSDP2): torch's distributed-checkpoint state-dict helpers gather to rank 0 and scatter
    back on load, optimizer state included.
Every function here is a collective over the ranks that hold shards: call it on all of them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from lightning_ptdp.tensor_parallel.consolidate import full_state_dict, map_optimizer_state_by_name, shard_state_dict


def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def model_state(module: nn.Module, *, tensor_parallel: bool, zero: bool) -> dict[str, Any]:
    """Unsharded weights (under ZeRO alone only rank 0 receives them)."""
    if zero and tensor_parallel:  # gather over dp on every rank, then over tp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return full_state_dict(module, get_model_state_dict(module, options=_options()))
    if zero:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module, options=_options(cpu_offload=True))
    return full_state_dict(module) if tensor_parallel else module.state_dict()


def load_model_state(module: nn.Module, state: dict[str, Any], *, tensor_parallel: bool, zero: bool, strict: bool) -> None:
    if zero:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        local = shard_state_dict(module, state) if tensor_parallel else state
        set_model_state_dict(module, local, options=_options(strict=strict))
    elif tensor_parallel:
        module.load_state_dict(shard_state_dict(module, state), strict=strict)
    else:
        module.load_state_dict(state, strict=strict)


def optimizer_state(module: nn.Module, optimizer: Any, *, tensor_parallel: bool, zero: bool) -> dict[str, Any]:
    """Unsharded optimizer state keyed by parameter name, the same on every layout (under ZeRO
    alone only rank 0 receives it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    gathered = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=zero and not tensor_parallel))
    return map_optimizer_state_by_name(module, gathered, to_full=True) if tensor_parallel else gathered


def load_optimizer_state(module: nn.Module, optimizer: Any, state: dict[str, Any], *, tensor_parallel: bool, zero: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if tensor_parallel:
        state = map_optimizer_state_by_name(module, state, to_full=False)
    set_optimizer_state_dict(module, optimizer, state, options=_options())
