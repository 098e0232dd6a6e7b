"""ZeRO stage 1: gradients stay whole (all-reduced over d as at stage 0), the optimizer state is
sharded over d. torch's ZeroRedundancyOptimizer does the step: each dp rank updates the parameters
it owns (its local optimizer holds only their state), then broadcasts them to the other replicas.
With expert parallelism the split experts are owned and broadcast within the d/e ranks that hold
the same experts (``ExpertZero``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


@dataclass(frozen=True)
class ExpertGroups:
    """Expert parallelism under ZeRO-1: which parameters are split experts, and the d/e ranks
    (``edp``) that hold the same experts. dp rank = edp index * e + ep index (core.dims)."""

    params: frozenset[int]
    """ids of the split experts' parameters."""
    edp: Any
    ep_size: int
    together: dict[int, int] = field(default_factory=dict)
    """id -> group: parameters one edp index owns together (a balanced ModuleList layer's slots, whose
    state moves as one when experts move: expert_parallel/rebalance.py)."""


class ExpertZero(ZeroRedundancyOptimizer):
    """A ZeroRedundancyOptimizer whose split experts are owned per edp index: the e dp ranks of one
    index each own their own experts' copy of a parameter, and broadcast it over their edp group.
    (torch's partitions and broadcasts every parameter over the one dp group: the ep ranks'
    experts differ, so it would overwrite them; these two overrides are the whole change.)"""

    def __init__(self, params: Any, *, experts: ExpertGroups, **kwargs: Any) -> None:
        self._experts = experts  # read by the overrides, which the base constructor already calls
        super().__init__(params, **kwargs)

    def _partition_parameters(self, params_per_rank: Any = None) -> list[list[dict]]:
        if params_per_rank is not None or self._partition_parameters_cache:
            return super()._partition_parameters(params_per_rank)
        e = self._experts.ep_size
        cache: list[list[dict]] = [[] for _ in range(self.world_size)]
        dense_sizes, expert_sizes = [0] * self.world_size, [0] * (self.world_size // e)
        owner_of: dict[int, int] = {}  # a ``together`` group -> its edp index
        for group in self.param_groups:
            per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
            for param in sorted(group["params"], key=lambda t: t.numel(), reverse=True):  # torch's greedy order
                if id(param) in self._experts.params:  # one edp index: its e ranks, each holding its own experts
                    key = self._experts.together.get(id(param))
                    index = owner_of.get(key, expert_sizes.index(min(expert_sizes)))
                    if key is not None:
                        owner_of[key] = index
                    expert_sizes[index] += param.numel()
                    for rank in range(index * e, (index + 1) * e):
                        per_rank[rank].append(param)
                else:
                    rank = dense_sizes.index(min(dense_sizes))
                    dense_sizes[rank] += param.numel()
                    per_rank[rank].append(param)
            for rank, params in enumerate(per_rank):
                cache[rank].append({**group, "params": params})
        self._partition_parameters_cache = cache
        return cache

    def _broadcast_params_from_rank(self, rank: int) -> list[Any]:
        source = dist.get_global_rank(self.process_group, rank)
        mine = rank % self._experts.ep_size == self.rank % self._experts.ep_size  # an owner in my edp group
        handles = []
        for group in self._partition_parameters()[rank]:
            for param in group["params"]:
                if id(param) not in self._experts.params:
                    handles.append(dist.broadcast(param.data, src=source, group=self.process_group, async_op=True))
                elif mine:
                    handles.append(dist.broadcast(param.data, src=source, group=self._experts.edp, async_op=True))
        return handles


def shard_optimizer_states(
    optimizers: list[Any],
    scheduler_configs: list[Any],
    dp_group: Any,
    names: dict[int, str],
    experts: ExpertGroups | None = None,
) -> list[Any]:
    """Each optimizer ``configure_optimizers`` built, as a ZeroRedundancyOptimizer over ``dp_group``
    with the same class, groups and hyperparameters; its LR schedulers drive the new one
    (``names``: parameter names by id, to check every dp rank lists the same parameters)."""
    sharded = {id(optimizer): _shard(optimizer, dp_group, names, experts) for optimizer in optimizers}
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


def _shard(optimizer: Any, dp_group: Any, names: dict[int, str], experts: ExpertGroups | None) -> Any:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        if optimizer.process_group is not dp_group:
            raise ValueError(
                "zero_stage=1 builds the ZeroRedundancyOptimizer itself, over the data-parallel group only; "
                "return the plain optimizer from configure_optimizers"
            )
        return optimizer
    if not any(group["params"] for group in optimizer.param_groups):  # no optimizer (Lightning's stand-in)
        return optimizer
    _check_same_order(optimizer, dp_group, names, experts.params if experts else frozenset())
    if optimizer.state:
        raise ValueError(
            f"zero_stage=1 shards the optimizer state at setup, but {type(optimizer).__name__} already holds state "
            "for some parameters; build it fresh in configure_optimizers (resume with ckpt_path= instead)"
        )
    groups = [dict(group) for group in optimizer.param_groups]  # hyperparameters as the schedulers left them
    kwargs = dict(optimizer_class=type(optimizer), process_group=dp_group, **_constructor_defaults(optimizer))
    try:
        if experts is not None:
            return ExpertZero(groups, experts=experts, **kwargs)
        return ZeroRedundancyOptimizer(groups, **kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"zero_stage=1 shards the optimizer state with torch's ZeroRedundancyOptimizer, which cannot take this "
            f"{type(optimizer).__name__} ({error}). Use zero_stage=2 (FSDP2 shards state and gradients, any "
            "optimizer) or zero_stage=0"
        ) from error


def _check_same_order(optimizer: Any, dp_group: Any, names: dict[int, str], experts: frozenset[int]) -> None:
    """torch's partition follows the order of each group's parameters: every dp rank must list
    them alike, or ranks would broadcast different parameters to each other (split experts by
    shape: each ep rank names its own experts)."""

    def key(param: torch.Tensor) -> str:
        return f"expert {tuple(param.shape)}" if id(param) in experts else names.get(id(param), str(tuple(param.shape)))

    mine = [[key(p) for p in group["params"]] for group in optimizer.param_groups]
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
