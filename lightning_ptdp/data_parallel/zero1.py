"""ZeRO stage 1: gradients stay whole (all-reduced over d as at stage 0), the optimizer state is
sharded over d. torch's ZeroRedundancyOptimizer does the step: each dp rank updates the parameters
it owns (its local optimizer holds only their state), then broadcasts them to the other replicas."""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


def shard_optimizer_states(
    optimizers: list[Any], scheduler_configs: list[Any], dp_group: Any, names: dict[int, str]
) -> list[Any]:
    """Each optimizer ``configure_optimizers`` built, as a ZeroRedundancyOptimizer over ``dp_group``
    with the same class, groups and hyperparameters; its LR schedulers drive the new one
    (``names``: parameter names by id, to check every dp rank lists the same parameters)."""
    sharded = {id(optimizer): _shard(optimizer, dp_group, names) for optimizer in optimizers}
    for config in scheduler_configs:
        for scheduler in [config.scheduler, *getattr(config.scheduler, "_schedulers", [])]:
            replacement = sharded.get(id(getattr(scheduler, "optimizer", None)))
            if replacement is not None:
                scheduler.optimizer = replacement
                replacement._opt_called = True  # what the scheduler's step-order check looks for on its optimizer
    for optimizer in optimizers:  # anything still holding the old optimizer writes into the live groups
        if sharded[id(optimizer)] is not optimizer:
            optimizer.param_groups = sharded[id(optimizer)].param_groups
    return [sharded[id(optimizer)] for optimizer in optimizers]


def _shard(optimizer: Any, dp_group: Any, names: dict[int, str]) -> Any:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        if optimizer.process_group is not dp_group:
            raise ValueError(
                "zero_stage=1 builds the ZeroRedundancyOptimizer itself, over the data-parallel group only; "
                "return the plain optimizer from configure_optimizers"
            )
        return optimizer
    if not any(group["params"] for group in optimizer.param_groups):  # no optimizer (Lightning's stand-in)
        return optimizer
    _check_same_order(optimizer, dp_group, names)
    if optimizer.state:
        raise ValueError(
            f"zero_stage=1 shards the optimizer state at setup, but {type(optimizer).__name__} already holds state "
            "for some parameters; build it fresh in configure_optimizers (resume with ckpt_path= instead)"
        )
    groups = [dict(group) for group in optimizer.param_groups]  # hyperparameters as the schedulers left them
    try:
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=type(optimizer), process_group=dp_group, **_constructor_defaults(optimizer)
        )
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"zero_stage=1 shards the optimizer state with torch's ZeroRedundancyOptimizer, which cannot take this "
            f"{type(optimizer).__name__} ({error}). Use zero_stage=2 (FSDP2 shards state and gradients, any "
            "optimizer) or zero_stage=0"
        ) from error


def _check_same_order(optimizer: Any, dp_group: Any, names: dict[int, str]) -> None:
    """torch's partition follows the order of each group's parameters: every dp rank must list
    them alike, or ranks would broadcast different parameters to each other."""
    mine = [[names.get(id(p), str(tuple(p.shape))) for p in group["params"]] for group in optimizer.param_groups]
    every: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(every, mine, group=dp_group)
    if any(other != every[0] for other in every):
        raise ValueError(
            f"zero_stage=1: {type(optimizer).__name__}'s parameter groups list the parameters in a different order on "
            "different data-parallel ranks (built from a set?), so the ranks would disagree on who updates which "
            "parameter; build each group from a list in a fixed order (e.g. model.named_parameters())"
        )


def _constructor_defaults(optimizer: Any) -> dict[str, Any]:
    """The defaults its class's constructor accepts (AdamW keeps one, ``decoupled_weight_decay``,
    that it takes no argument for); every group carries all of them anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def local_optimizer(optimizer: Any) -> Any:
    """The optimizer holding this rank's state: a ZeroRedundancyOptimizer's local one, else itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def dp_group_of(optimizer: Any) -> Any:
    """The group a stage-1 optimizer shards its state over (None for any other optimizer)."""
    return optimizer.process_group if isinstance(optimizer, ZeroRedundancyOptimizer) else None


def sync_groups_after_load(optimizer: Any) -> None:
    """After a checkpoint was loaded into the local optimizer: every replica's exposed groups take
    the loaded hyperparameters (from a rank that owns parameters of the group), then its local
    optimizer's (a rank owning none of a group's parameters had no saved entry to match)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return
    mine = [
        {k: v for k, v in g.items() if k != "params"} if g["params"] else None for g in optimizer.optim.param_groups
    ]
    every: list[Any] = [None] * dist.get_world_size(optimizer.process_group)
    dist.all_gather_object(every, mine, group=optimizer.process_group)
    for index, group in enumerate(optimizer.param_groups):
        loaded = next((ranks[index] for ranks in every if ranks[index] is not None), None)
        if loaded is not None:
            group.update(loaded)
    for exposed, local in zip(optimizer.param_groups, optimizer.optim.param_groups):
        local.update({k: v for k, v in exposed.items() if k != "params"})
