"""The full checkpoint format: unsharded tensors in the original model's keys and shapes, loading
with plain ``load_state_dict`` and on any layout. TP: shards gathered, cut again for the new t on
load (``consolidate``). ZeRO (FSDP2): torch's state-dict helpers gather to rank 0 and scatter back,
optimizer state included. EP: experts gathered over the ep group, cut on load. PP: each stage's
entries gathered over the pipeline group (a tied weight under each of its names); on load each
stage takes what it holds. Every function is a collective over the ranks holding shards."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.core.comm import detached_cpu, tensor_shape
from lightning_ptdp.expert_parallel import cut_experts, gather_expert_optimizer_state, gather_experts, has_split_experts
from lightning_ptdp.tensor_parallel.consolidate import full_state_dict, map_optimizer_state_by_name, shard_state_dict
from lightning_ptdp.tensor_parallel.state_dict_hooks import run_load_pre_hooks, run_save_hooks


def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _gather_stages(state: dict[str, Any], pp_group: Any) -> dict[str, Any]:
    parts: list[Optional[dict]] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, detached_cpu(state), group=pp_group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part or {})
    return merged


def model_state(module: nn.Module, *, tensor_parallel: bool, fsdp: bool, pp_group: Any = None) -> dict[str, Any]:
    """Unsharded weights (under ZeRO alone only rank 0 receives them)."""
    every_rank = pp_group is not None or has_split_experts(module)  # gathered further: every rank needs its part
    state = _stage_model_state(module, tensor_parallel=tensor_parallel, fsdp=fsdp, every_rank=every_rank)
    state = gather_experts(module, state)
    state = _gather_stages(state, pp_group) if pp_group is not None else state
    return run_save_hooks(module, state)  # hooks taken off sharded modules, now on whole tensors


def _stage_model_state(module: nn.Module, *, tensor_parallel: bool, fsdp: bool, every_rank: bool) -> dict[str, Any]:
    if fsdp and (tensor_parallel or every_rank):  # gather over dp on every rank, then over tp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return full_state_dict(module, get_model_state_dict(module, options=_options()))
    if fsdp:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module, options=_options(cpu_offload=True))
    return full_state_dict(module) if tensor_parallel else module.state_dict()


def describe_mismatch(
    expected: dict[str, Optional[tuple[int, ...]]],
    saved: dict[str, Optional[tuple[int, ...]]],
    *,
    check_unexpected: bool = True,
    check_shapes: bool = True,
) -> Optional[str]:
    """How a checkpoint's weights (name -> shape) differ from a model's, or None: missing or
    unexpected keys (another model), other shapes (another size of the model)."""
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected] if check_unexpected else []
    problems = []
    if missing:
        problems.append(f"{len(missing)} of this model's entries are missing (first: {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} entries are not in this model (first: {', '.join(unexpected[:3])})")
    if check_shapes:
        shapes = [
            f"{k} {saved[k]} vs {shape}"
            for k, shape in expected.items()
            if k in saved and saved[k] is not None and shape is not None and tuple(saved[k]) != tuple(shape)
        ]
        if shapes:
            problems.append(f"{len(shapes)} shapes differ, checkpoint vs model (first: {'; '.join(shapes[:3])})")
    if not problems:
        return None
    return (
        "; ".join(problems)
        + ". It was saved from another model or configuration; build the same model (sizes, tying) to resume"
    )


def check_fits(module: nn.Module, state: dict[str, Any], *, pipeline: bool, tensor_parallel: bool) -> None:
    """Raise a ValueError saying how a checkpoint's weights differ from ``module``'s, if they do.
    A pipeline stage knows only its own keys; under TP the model holds shards (checkpoints never)."""
    problem = describe_mismatch(
        {k: tensor_shape(v) for k, v in module.state_dict().items()},
        {k: tensor_shape(v) for k, v in state.items()},
        check_unexpected=not pipeline,
        check_shapes=not tensor_parallel,
    )
    if problem:
        raise ValueError(f"the checkpoint's weights do not fit this model: {problem}")


def load_model_state(
    module: nn.Module, state: dict[str, Any], *, tensor_parallel: bool, fsdp: bool, strict: bool, pipeline: bool = False
) -> None:
    state = run_load_pre_hooks(module, state, strict)  # e.g. wq/wk/wv merged back into a fused wqkv
    state = cut_experts(module, state)
    if strict:
        check_fits(module, state, pipeline=pipeline, tensor_parallel=tensor_parallel)
    if pipeline:  # this stage's entries only
        local = module.state_dict().keys()
        state = {k: v for k, v in state.items() if k in local}
    if fsdp:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        local = shard_state_dict(module, state) if tensor_parallel else state
        set_model_state_dict(module, local, options=_options(strict=strict))
    elif tensor_parallel:
        module.load_state_dict(shard_state_dict(module, state), strict=strict)
    else:
        module.load_state_dict(state, strict=strict)


def optimizer_state(
    module: nn.Module,
    optimizer: Any,
    *,
    tensor_parallel: bool,
    fsdp: bool,
    pp_group: Any = None,
    dp_group: Any = None,
) -> dict[str, Any]:
    """Unsharded optimizer state keyed by parameter name, the same on every layout (under ZeRO
    alone only rank 0 receives it). ``dp_group``: ZeRO-1, whose dp ranks each hold the state of
    the parameters they own (gathered first, so TP and PP see whole states as at stage 0)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    rank0_only = fsdp and not tensor_parallel and pp_group is None and not has_split_experts(module)
    state = get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=rank0_only))
    if tensor_parallel:  # on the device, before any CPU copy (TP peers own the same parameters)
        state = map_optimizer_state_by_name(module, state, to_full=True)
    state = gather_expert_optimizer_state(module, state)
    if dp_group is not None:  # to dp rank 0 alone: the ranks that write (rank 0) are there
        state = _gather_optimizer_parts(state, dp_group, to_first=True)
    return _gather_optimizer_parts(state, pp_group) if pp_group is not None else state


def _gather_optimizer_parts(state: dict[str, Any], group: Any, to_first: bool = False) -> dict[str, Any]:
    """Every rank's per-parameter state in one dict (pipeline stages, ZeRO-1 owners); param
    groups joined group by group. ``to_first``: only the group's first rank gets it (the others
    keep their own part)."""
    first = dist.get_rank(group) == 0
    parts: Optional[list[Any]] = [None] * dist.get_world_size(group) if first or not to_first else None
    if to_first:
        dist.gather_object(detached_cpu(state), parts, dst=dist.get_global_rank(group, 0), group=group)
    else:
        dist.all_gather_object(parts, detached_cpu(state), group=group)
    if parts is None:
        return state
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for part in parts:
        merged["state"].update(part["state"])
        for index, group in enumerate(part["param_groups"]):
            if index == len(merged["param_groups"]):
                merged["param_groups"].append({**group, "params": []})
            merged["param_groups"][index]["params"] += [
                p for p in group["params"] if p not in merged["param_groups"][index]["params"]
            ]
    return merged


def stage_optimizer_state(
    module: nn.Module, optimizer: Any, state: dict[str, Any], aliases: dict[str, list[str]]
) -> dict[str, Any]:
    """The entries of a whole-model optimizer state this stage's optimizer holds, found under any
    name of the parameter (a single process names a tied weight once, a stage by its own module)."""
    names = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    by_name, picked, groups = state["state"], {}, []
    for index, group in enumerate(optimizer.param_groups):
        local = [names[id(p)] for p in group["params"]]
        for name in local:
            found = [alias for alias in aliases.get(name, [name]) if alias in by_name]
            if found:
                picked[name] = by_name[found[0]]
        groups.append({**state["param_groups"][index], "params": local})
    return {"state": picked, "param_groups": groups}


def load_named_optimizer_state(module: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """A state keyed by parameter name into ``optimizer`` with torch's own ``load_state_dict``.
    For ZeRO-1's local optimizers: torch's state-dict helpers refuse more than one parameter group
    without parameters, which a dp rank owning nothing of two groups has."""
    names = {id(p): n for n, p in module.named_parameters()}
    by_index, groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        indices = []
        for param in group["params"]:
            if names[id(param)] in state["state"]:
                by_index[index] = state["state"][names[id(param)]]
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
    optimizer.load_state_dict({"state": by_index, "param_groups": groups})


def load_optimizer_state(
    module: nn.Module,
    optimizer: Any,
    state: dict[str, Any],
    *,
    tensor_parallel: bool,
    fsdp: bool,
    aliases: Optional[dict[str, list[str]]] = None,
    owned_only: bool = False,
) -> None:
    """A whole-model optimizer state into this rank's optimizer: its stage's entries (PP), cut to
    its TP shards. ``owned_only``: ZeRO-1's local optimizer, which holds only the parameters this
    dp rank owns (loaded by name, see ``load_named_optimizer_state``)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if aliases is not None or owned_only:
        state = stage_optimizer_state(module, optimizer, state, aliases or {})
    if tensor_parallel:
        state = map_optimizer_state_by_name(module, state, to_full=False)
    state = {**state, "state": cut_experts(module, state["state"])}
    if owned_only:
        load_named_optimizer_state(module, optimizer, state)
    else:
        set_optimizer_state_dict(module, optimizer, state, options=_options())
