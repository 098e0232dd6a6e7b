"""State-dict hooks of sharded modules (tensor parallel, ZeRO 2-3), run on whole tensors only.

A model may rename or reshape its parameters on save and back on load (torchtitan's fused
``wqkv`` writes stock ``wq``/``wk``/``wv`` keys). On a rank's TP shard such a hook would cut the
shard as if it were the whole tensor. So when a module is sharded, its hooks are taken off it:
sharded checkpoints (DCP pieces) key by parameter name, and the full checkpoint runs the save hooks
on the gathered whole tensors and the load pre-hooks on the whole state before it is cut, so a
full checkpoint has the keys and values of the one a single process writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

_TABLES = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")
_ATTR = "_ptdp_state_dict_hooks"


@dataclass
class _Taken:
    prefix: str
    """The module's path in the model, with a trailing dot ("" for the model itself)."""
    module: nn.Module
    keys: list[str]
    """The module's state_dict keys when taken (before the pipeline split empties some)."""
    hooks: dict[str, list[Any]] = field(default_factory=dict)
    """Table name -> the hooks taken from it, in registration order."""


def take_state_dict_hooks(model: nn.Module, sharded: list[str]) -> None:
    """Move the state_dict hooks off every module on the path to each sharded module (recorded on
    ``model`` for ``run_save_hooks`` / ``run_load_pre_hooks``)."""
    taken: dict[int, _Taken] = {id(t.module): t for t in model.__dict__.get(_ATTR, [])}
    for path in sharded:
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            where = ".".join(parts[:depth])
            module = model.get_submodule(where)
            if type(module).__name__ == "CheckpointWrapper":  # torch's recompute wrapper only strips its prefix
                continue
            if id(module) in taken or not any(getattr(module, table, None) for table in _TABLES):
                continue
            hooks = {table: getattr(module, table) for table in _TABLES if getattr(module, table, None)}
            record = _Taken(f"{where}." if where else "", module, [])
            for table, found in hooks.items():
                record.hooks[table] = list(found.values())
                found.clear()
            record.keys = list(module.state_dict(keep_vars=True))  # its own keys, with its hooks off
            taken[id(module)] = record
    if taken:
        model.__dict__[_ATTR] = list(taken.values())


def hooked_modules(model: nn.Module) -> list[str]:
    """Paths of the modules that have state_dict hooks (FSDP2 shards every module under ZeRO 2-3)."""
    return [path for path, module in model.named_modules() if any(getattr(module, t, None) for t in _TABLES)]


def _whole(record: _Taken, state: dict[str, Any]) -> bool:
    """This state holds every parameter and buffer of the module (a rank may hold none of them)."""
    return bool(record.keys) and all(f"{record.prefix}{n}" in state for n in record.keys)


def run_save_hooks(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The taken save hooks run on ``state`` (whole tensors keyed by parameter name), as
    ``model.state_dict()`` would have run them on an unsharded model."""
    for record in model.__dict__.get(_ATTR, []):
        if not _whole(record, state):
            continue
        for hook in record.hooks.get("_state_dict_pre_hooks", []):
            hook(record.module, record.prefix, False)
        for hook in record.hooks.get("_state_dict_hooks", []):
            before = list(state)
            result = hook(record.module, state, record.prefix, {})
            if result is not None and not getattr(hook, "_from_public_api", False):
                state = result
            state = _in_place_of_removed(before, state)
    return state


def _in_place_of_removed(before: list[str], state: dict[str, Any]) -> dict[str, Any]:
    """The hook's new keys where its removed ones were, as the module's own state_dict orders them."""
    removed = [k for k in before if k not in state]
    if not removed:
        return state
    added = [k for k in state if k not in set(before)]
    order = []
    for key in before:
        if key == removed[0]:
            order.extend(added)
        if key in state:
            order.append(key)
    return {key: state[key] for key in order}


def run_load_pre_hooks(model: nn.Module, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """A copy of ``state`` (a whole checkpoint) with the taken load pre-hooks run on it, back in
    parameter-name keys (torchtitan's merge of wq/wk/wv into wqkv)."""
    records = model.__dict__.get(_ATTR, [])
    if not records:
        return state
    state = dict(state)
    for record in records:
        for hook in record.hooks.get("_load_state_dict_pre_hooks", []):
            # nn.Module stores them wrapped: (state_dict, prefix, metadata, strict, missing, unexpected, errors)
            hook(state, record.prefix, {}, strict, [], [], [])
    return state
