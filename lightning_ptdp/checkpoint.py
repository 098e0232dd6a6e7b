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

from lightning_ptdp.tensor_parallel.consolidate import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    shard_state_dict,
)


def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def model_state(module: nn.Module, *, tensor_parallel: bool, zero: bool) -> dict[str, Any]:
    """Unsharded weights (under ZeRO only rank 0 receives them)."""
    if zero:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module, options=_options(cpu_offload=True))
    return full_state_dict(module) if tensor_parallel else module.state_dict()


def load_model_state(module: nn.Module, state: dict[str, Any], *, tensor_parallel: bool, zero: bool, strict: bool) -> None:
    if zero:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module, state, options=_options(strict=strict))
    elif tensor_parallel:
        module.load_state_dict(shard_state_dict(module, state), strict=strict)
    else:
        module.load_state_dict(state, strict=strict)


def optimizer_state(module: nn.Module, optimizer: Any, *, tensor_parallel: bool, zero: bool) -> dict[str, Any]:
    """Unsharded optimizer state (under ZeRO rank 0 receives it)."""
    if zero:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))
    return full_optimizer_state(module, optimizer) if tensor_parallel else optimizer.state_dict()


def load_optimizer_state(module: nn.Module, optimizer: Any, state: dict[str, Any], *, tensor_parallel: bool, zero: bool) -> None:
    if zero:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(module, optimizer, state, options=_options())
    elif tensor_parallel:
        load_full_optimizer_state(module, optimizer, state)
    else:
        optimizer.load_state_dict(state)
