"""Loading a sharded checkpoint (dcp_save.py) into the model and optimizers this rank holds now.

Every rank checks what it will read first (files whole, keys and shapes, optimizer state); the
problems of all ranks are shared, so each rank raises the same error before any rank enters the
collective read. Then one ``dcp.load`` reads each rank's pieces straight into its live tensors.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from lightning_ptdp.checkpoint.dcp_save import (
    FORMAT_VERSION,
    MODEL,
    OPTIMIZER,
    PiecesLoadPlanner,
    canonical,
    model_pieces,
    optimizer_state_pieces,
)
from lightning_ptdp.checkpoint.full import describe_mismatch, load_named_optimizer_state
from lightning_ptdp.checkpoint.pieces import Pieces, tp_cuts
from lightning_ptdp.checkpoint.rng import set_rng_state
from lightning_ptdp.core.comm import raise_on_every_rank
from lightning_ptdp.expert_parallel import cut_experts

LOADED_IN_PLACE = "ptdp_loaded_in_place"


def open_checkpoint(path: str) -> tuple[Any, Any]:
    """DCP's reader and metadata for ``path``, after checking every data file is there whole."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(
            f"{path!r} is a link to {os.readlink(path)!r}, which is not there: a sharded checkpoint's name points into "
            "the hidden .ptdp folder beside it. Copy the checkpoint with `cp -rL`, or copy .ptdp along with it"
        )
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(
            f"{path!r} is not a complete sharded checkpoint: it has no .metadata file (written last, after every "
            "rank's data). The save that made it did not finish; resume from an earlier checkpoint"
        )
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(f for f in ends if not os.path.exists(os.path.join(path, f)))
    short = sorted(f for f in ends if f not in missing and os.path.getsize(os.path.join(path, f)) < ends[f])
    if missing or short:
        what = [f"missing shard file(s) {', '.join(missing)}"] if missing else []
        what += [f"truncated shard file(s) {', '.join(short)}"] if short else []
        raise ValueError(
            f"checkpoint {path!r} is incomplete: {'; '.join(what)} (each rank writes its own __<rank>_*.distcp). "
            "It was damaged or copied partially after it was saved; copy it again whole or resume from another one"
        )
    return reader, metadata


def _shape(value: Any) -> Optional[tuple[int, ...]]:
    if isinstance(value, Pieces):
        return value.full_shape
    return tuple(value.shape) if torch.is_tensor(value) else None


def _model_targets(
    module: nn.Module, metadata: Any, strict: bool, pipeline: bool
) -> tuple[dict[str, Any], Optional[str]]:
    """DCP entries for the model's tensors here, and what does not fit (shapes always; missing or
    unexpected keys when strict; a stage knows only its own keys)."""
    model = {f"{MODEL}{k}": v for k, v in model_pieces(module).items()}
    saved = {
        k[len(MODEL) :]: tuple(md.size) if hasattr(md, "size") else None
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(MODEL)
    }
    saved = cut_experts(module, saved)  # another rank's experts of a ModuleList are not expected here
    expected = {k[len(MODEL) :]: _shape(v) for k, v in model.items()}
    if not strict:
        expected = {k: v for k, v in expected.items() if k in saved}
    problem = describe_mismatch(expected, saved, check_unexpected=strict and not pipeline)
    return {k: v for k, v in model.items() if k in metadata.state_dict_metadata}, problem


class _OptimizerTarget:
    """One optimizer's state to load into: its tensors (live) and the DCP entries pointing at them."""

    def __init__(
        self, module: nn.Module, optimizer: Any, index: int, saved: set[str], aliases: Any, by_name: bool = False
    ) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        self.optimizer, self.index, self.by_name = optimizer, index, by_name
        self.state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))
        self.entries: dict[str, Any] = {}
        self.keys: dict[tuple[str, str], str] = {}  # (parameter, state field) -> DCP entry
        prefix = f"{OPTIMIZER}{index}.state."
        saved_names = {k[len(prefix) :].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)}
        self.fresh = []  # parameters without saved state (never had a gradient): they start fresh
        cuts = tp_cuts(module)
        for name in list(self.state["state"]):
            found = [a for a in (aliases or {}).get(name, [name]) if a in saved_names]
            if not found:
                self.fresh.append(name)
                del self.state["state"][name]
                continue
            for field, value in optimizer_state_pieces(module, self.state["state"][name], name, cuts).items():
                self.keys[name, field] = key = f"{prefix}{found[0]}.{field}"
                self.entries[key] = value
        groups = sorted(k for k in saved if k.startswith(f"{OPTIMIZER}{index}.param_groups."))
        self.group_keys = groups
        self.saved_any = bool(saved_names) or bool(groups)

    def restore(self, module: nn.Module, loaded: dict[str, Any], aliases: Any) -> None:
        """Hyperparameters from the saved group holding the same parameters (any layout), the
        non-tensor values, then torch's own setter."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        saved_groups = [g for key in self.group_keys for g in loaded[key]]
        for group in self.state["param_groups"]:
            names = {canonical(n, aliases) for n in group["params"]}
            match = next((g for g in saved_groups if names & set(g["params"])), None)
            if match is None and names:
                raise ValueError(
                    f"no parameter group of the checkpoint's optimizer {self.index} holds {sorted(names)[:3]}: "
                    "configure_optimizers must build the same groups to resume"
                )
            group.update({k: v for k, v in (match or {}).items() if k != "params"})
        for name, values in self.state["state"].items():
            for field, value in values.items():
                key = self.keys.get((name, field))
                if not torch.is_tensor(value) and key in loaded:
                    values[field] = loaded[key]
        if self.by_name:  # ZeRO-1's local optimizer (see full.load_named_optimizer_state)
            load_named_optimizer_state(module, self.optimizer, self.state)
            return
        options = StateDictOptions(full_state_dict=False, strict=not self.fresh)  # fresh ones keep their new state
        set_optimizer_state_dict(module, self.optimizer, self.state, options=options)


def load(
    path: str,
    *,
    module: nn.Module,
    optimizers: list[Any],
    aliases: Optional[dict[str, list[str]]],
    rank: int,
    world_size: int,
    strict: bool,
    pipeline: bool,
    by_name: Optional[list[bool]] = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``module`` and ``optimizers`` in place (any saved layout);
    return the rest of Lightning's checkpoint. A collective over all ranks."""
    problems: list[str] = []
    try:
        reader, metadata = open_checkpoint(path)
    except ValueError as error:  # every rank reads the same folder: this is everyone's problem
        reader, metadata = None, None
        problems.append(str(error))
    targets: dict[str, Any] = {}
    opt_targets: list[_OptimizerTarget] = []
    if metadata is not None:
        targets, problem = _model_targets(module, metadata, strict, pipeline)
        if problem:
            problems.append(f"the checkpoint's weights do not fit this model: {problem} (checkpoint {path!r})")
        saved = set(metadata.state_dict_metadata)
        for index, optimizer in enumerate(optimizers):
            target = _OptimizerTarget(module, optimizer, index, saved, aliases, bool(by_name and by_name[index]))
            if not target.saved_any:
                problems.append(
                    f"checkpoint {path!r} holds no state for optimizer {index}: it was saved with weights only "
                    "(ModelCheckpoint(save_weights_only=True)) or with fewer optimizers; it cannot resume training"
                )
            targets |= target.entries | {key: None for key in target.group_keys}
            opt_targets.append(target)
        rng_key = f"rng.{rank}"
        targets |= {"lightning": None, "ptdp": None} | ({rng_key: None} if rng_key in saved else {})
    raise_on_every_rank(problems)
    planner = PiecesLoadPlanner()
    dcp.load(targets, storage_reader=reader, planner=planner)
    loaded = planner.state_dict  # the non-tensor entries, filled in by the planner
    if loaded["ptdp"].get("format", 0) > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path!r} has format {loaded['ptdp']['format']}; this ptdp reads up to {FORMAT_VERSION}: upgrade"
        )
    for target in opt_targets:
        target.restore(module, loaded, aliases)
    extra = {k[len(MODEL) :]: v for k, v in loaded.items() if k.startswith(MODEL)}  # non-tensor entries (_extra_state)
    if extra:
        module.load_state_dict(extra, strict=False)
    if loaded["ptdp"].get("world_size") == world_size and f"rng.{rank}" in loaded:  # as many ranks: same streams
        set_rng_state(loaded[f"rng.{rank}"])
    return {
        **loaded["lightning"],
        "state_dict": {},
        "optimizer_states": [{} for _ in optimizers],
        LOADED_IN_PLACE: True,
    }
