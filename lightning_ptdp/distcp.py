"""Sharded checkpoints: every rank writes its own pieces with torch.distributed.checkpoint (DCP).

Layout of a checkpoint directory (DCP's ``.metadata`` plus one data file per rank):
  state_dict.<name>                      model tensors, in the single-process model's names and shapes
  optimizer_states.<i>.state.<name>.<k>  optimizer state per parameter (Adam's exp_avg, ...), same
  optimizer_states.<i>.param_groups.<r>  hyperparameters per group (lr, betas, ...) and the names of
                                         rank r's parameters in it, bytes
  rng.<rank>                             each rank's random-number generator states, bytes
  ptdp                                   the layout it was saved at (for messages), bytes
  lightning                              everything else of Lightning's checkpoint (loops, callbacks,
                                         LR schedulers, hyperparameters, data position), bytes
Tensors are stored as the original tensors cut into rectangles (shards.py), so DCP's resharding
reads any other layout's pieces out of them; a weight held by several ranks (dp replicas, a tied
embedding on two stages) is written once (DCP deduplicates equal pieces).

Why custom planners: a fused q/k/v shard is several rectangles of the original tensor, which
neither a DTensor placement nor DCP's default planner can describe; ours hand DCP those pieces.

Saving is atomic: DCP writes into a fresh hidden version directory and the checkpoint's name is a
symlink swapped onto it with one ``os.replace`` once every rank's files are on disk. A crash at
any moment leaves the name pointing at the previous complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_ptdp.checkpoint import fsync_dir
from lightning_ptdp.shards import Piece, Pieces, pieces, tp_cuts

MODEL = "state_dict."
VERSIONS = ".ptdp"  # hidden folder beside the checkpoints holding their versions
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------- planners
def _planners() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorProperties, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    def split(state: dict[str, Any]) -> tuple[dict[str, Pieces], dict[str, Any]]:
        ours = {k: v for k, v in state.items() if isinstance(v, Pieces)}
        return ours, {k: v for k, v in state.items() if k not in ours}

    def find(entry: Pieces, offsets: torch.Size) -> Piece:
        return next(p for p in entry.items if torch.Size(p.offsets) == offsets)

    class PiecesSavePlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
            self._pieces, rest = split(state_dict)
            super().set_up_planner(rest, storage_meta, is_coordinator)

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = [
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(piece.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.local.shape),
                        properties=TensorProperties.create_from_tensor(piece.local),
                        size=torch.Size(entry.full_shape),
                    ),
                )
                for fqn, entry in self._pieces.items() for piece in entry.items
            ]
            self.plan = dataclasses.replace(plan, items=plan.items + items)
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            entry = self._pieces.get(write_item.index.fqn)
            if entry is None:
                return super().resolve_data(write_item)
            return find(entry, write_item.index.offset).local.detach().cpu().clone()  # a view would save its base

    class PiecesLoadPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
            self._pieces, rest = split(state_dict)
            super().set_up_planner(rest, metadata, is_coordinator)

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for fqn, entry in self._pieces.items():
                chunks = [ChunkStorageMetadata(torch.Size(p.offsets), p.local.shape) for p in entry.items]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return dataclasses.replace(plan, items=plan.items + items)

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            entry = self._pieces.get(read_item.dest_index.fqn)
            if entry is None:
                return super().resolve_tensor(read_item)
            local = find(entry, read_item.dest_index.offset).local
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                local = local.narrow(dim, start, length)
            return local

    return PiecesSavePlanner, PiecesLoadPlanner


# ----------------------------------------------------------------------------- what ranks hold
def model_pieces(module: nn.Module, aliases: Optional[dict[str, list[str]]] = None) -> dict[str, Any]:
    """This rank's part of the model's state, under every name the single-process model gives it."""
    cuts = tp_cuts(module)
    out: dict[str, Any] = {}
    for name, value in module.state_dict().items():
        entry = pieces(value, cuts.get(name)) if torch.is_tensor(value) and value.dim() > 0 else value
        for alias in (aliases or {}).get(name, [name]):
            out[alias] = entry
    return out


def optimizer_pieces(module: nn.Module, optimizer: Any, aliases: Optional[dict[str, list[str]]] = None) -> dict[str, Any]:
    """This rank's part of an optimizer's state keyed by the single-process parameter names (a
    weight tied across stages by its first name), and the groups' hyperparameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))
    cuts, shapes = tp_cuts(module), {n: tuple(p.shape) for n, p in module.named_parameters()}

    def convert(name: str, value: Any) -> Any:
        if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == shapes.get(name):
            return pieces(value, cuts.get(name))
        return value

    return {
        "state": {
            (aliases or {}).get(name, [name])[0]: {k: convert(name, v) for k, v in values.items()}
            for name, values in state["state"].items()
        },
        "param_groups": [  # a stage's own parameters per group; consolidation joins the stages'
            {**group, "params": [(aliases or {}).get(n, [n])[0] for n in group["params"]]} for group in state["param_groups"]
        ],
    }


def flat_state(checkpoint: dict[str, Any], rank: int, layout: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict (with ``model_pieces``/``optimizer_pieces`` in it) as DCP entries."""
    from lightning_ptdp.checkpoint import collect_rng_states

    rest = dict(checkpoint)
    flat: dict[str, Any] = {f"{MODEL}{k}": v for k, v in rest.pop("state_dict", {}).items()}
    for index, optimizer in enumerate(rest.pop("optimizer_states", [])):
        for name, values in optimizer["state"].items():
            flat.update({f"optimizer_states.{index}.state.{name}.{k}": v for k, v in values.items()})
        flat[f"optimizer_states.{index}.param_groups.{rank}"] = optimizer["param_groups"]
    flat[f"rng.{rank}"] = collect_rng_states()
    flat["ptdp"] = {"format": FORMAT_VERSION, **layout}
    flat["lightning"] = rest
    return flat


# ----------------------------------------------------------------------------------- saving
def _version_dir(target: str) -> str:
    """A new, empty version folder for ``target`` (rank 0 only)."""
    versions = os.path.join(os.path.dirname(target), VERSIONS)
    os.makedirs(versions, exist_ok=True)
    base = os.path.basename(target)
    taken = [int(n.rsplit(".v", 1)[1]) for n in os.listdir(versions) if n.startswith(f"{base}.v") and n.rsplit(".v", 1)[1].isdigit()]
    path = os.path.join(versions, f"{base}.v{max(taken, default=0) + 1}")
    os.makedirs(path)
    return path


def _publish(version: str, target: str) -> None:
    """Point ``target`` at ``version`` with one atomic rename, then delete the versions of this
    name no checkpoint name points at any more (the one replaced, any left by a crash mid-save)."""
    folder, base = os.path.dirname(target), os.path.basename(target)
    if os.path.isdir(target) and not os.path.islink(target):  # a plain folder (another writer's): set aside
        os.replace(target, f"{version}-replaced")
    link = f"{target}.ptdp-link"
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.relpath(version, folder), link)
    os.replace(link, target)
    fsync_dir(folder)
    linked = {os.path.realpath(os.path.join(folder, n)) for n in os.listdir(folder) if os.path.islink(os.path.join(folder, n))}
    versions = os.path.dirname(version)
    for name in os.listdir(versions):
        path = os.path.join(versions, name)
        if name.startswith(f"{base}.v") and os.path.realpath(path) not in linked:
            shutil.rmtree(path, ignore_errors=True)


def save(
    flat: dict[str, Any], target: str, *, is_rank_zero: bool, broadcast: Callable[[Any], Any],
    barrier: Callable[[], None], no_dist: bool = False,
) -> None:
    """Write ``flat`` as a sharded checkpoint named ``target``; a collective over all ranks (unless
    ``no_dist``: one process writing everything). Raises on every rank if any rank failed to write
    (DCP gathers the outcome)."""
    import torch.distributed.checkpoint as dcp

    save_planner, _ = _planners()
    target = os.path.abspath(target)
    version = _on_rank_zero(lambda: _version_dir(target), is_rank_zero, broadcast)
    writer = dcp.FileSystemWriter(version, sync_files=True)
    dcp.save(flat, storage_writer=writer, planner=save_planner(), no_dist=no_dist)
    barrier()
    _on_rank_zero(lambda: _publish(version, target), is_rank_zero, broadcast)


def _on_rank_zero(fn: Callable[[], Any], is_rank_zero: bool, broadcast: Callable[[Any], Any]) -> Any:
    """``fn()`` run by rank 0, its result on every rank; its failure raised on every rank."""
    outcome: tuple[Any, Optional[str]] = (None, None)
    if is_rank_zero:
        try:
            outcome = (fn(), None)
        except Exception as error:  # raised below on every rank
            outcome = (None, f"{type(error).__name__}: {error}")
    value, failure = broadcast(outcome)
    if failure is not None:
        raise OSError(f"rank 0 failed: {failure}")
    return value


def describe_failure(error: BaseException) -> str:
    """One line per failed rank from DCP's CheckpointException (its str is every traceback)."""
    failures = getattr(error, "failures", None)
    if not failures:
        return f"{type(error).__name__}: {error}"
    return "; ".join(f"on rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(failures.items()))


def remove(target: str) -> None:
    """Delete a checkpoint: its name and the version it points at."""
    real = os.path.realpath(target)
    if os.path.islink(target):
        os.remove(target)
    shutil.rmtree(real, ignore_errors=True)


# ----------------------------------------------------------------------------------- loading
def open_checkpoint(path: str) -> tuple[Any, Any]:
    """DCP's reader and metadata for ``path``, after checking every data file is there whole."""
    import torch.distributed.checkpoint as dcp

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


def _full_shape(value: Any) -> Optional[tuple[int, ...]]:
    if isinstance(value, Pieces):
        return value.full_shape
    return tuple(value.shape) if torch.is_tensor(value) else None


def _saved_shapes(metadata: Any, prefix: str) -> dict[str, Optional[tuple[int, ...]]]:
    return {
        k[len(prefix):]: tuple(md.size) if hasattr(md, "size") else None
        for k, md in metadata.state_dict_metadata.items() if k.startswith(prefix)
    }


def _optimizer_targets(
    module: nn.Module, optimizer: Any, index: int, saved: set[str], aliases: Optional[dict[str, list[str]]]
) -> tuple[dict, dict, list, dict]:
    """The optimizer's state (its tensors are what is loaded into), the DCP entries pointing at them,
    the parameters the checkpoint has no state for, and (name, key) -> DCP entry."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))  # creates it
    cuts, shapes = tp_cuts(module), {n: tuple(p.shape) for n, p in module.named_parameters()}
    targets, missing, keys = {}, [], {}
    for name, values in state["state"].items():
        prefix = f"optimizer_states.{index}.state."
        found = [a for a in (aliases or {}).get(name, [name]) if any(k.startswith(f"{prefix}{a}.") for k in saved)]
        if not found:
            missing.append(name)
            continue
        for k, v in values.items():
            keys[name, k] = key = f"{prefix}{found[0]}.{k}"
            tensor = torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == shapes.get(name)
            targets[key] = pieces(v, cuts.get(name)) if tensor else v
    return state, targets, missing, keys


def load(
    path: str, *, module: nn.Module, optimizers: list[Any], aliases: Optional[dict[str, list[str]]], rank: int,
    world_size: int, strict: bool, pipeline: bool, describe_mismatch: Callable[..., Optional[str]],
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``module`` and ``optimizers`` in place (any saved layout);
    return the rest of Lightning's checkpoint. A collective over all ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from lightning_ptdp.checkpoint import restore_rng_states

    reader, metadata = open_checkpoint(path)
    model = {f"{MODEL}{k}": v for k, v in model_pieces(module).items()}
    expected = {k[len(MODEL):]: _full_shape(v) for k, v in model.items() if _full_shape(v) is not None}
    problem = describe_mismatch(expected, _saved_shapes(metadata, MODEL), check_unexpected=not pipeline)
    if problem and strict:
        raise ValueError(f"the checkpoint's weights do not fit this model: {problem} (checkpoint {path!r})")
    targets = {k: v for k, v in model.items() if k in metadata.state_dict_metadata}
    saved = set(metadata.state_dict_metadata)
    optimizer_states = []
    for index, optimizer in enumerate(optimizers):
        if not any(k.startswith(f"optimizer_states.{index}.") for k in saved):
            raise ValueError(
                f"checkpoint {path!r} holds no state for optimizer {index}: it was saved with weights only "
                "(ModelCheckpoint(save_weights_only=True)) or with fewer optimizers; it cannot resume training"
            )
        state, entries, missing, keys = _optimizer_targets(module, optimizer, index, saved, aliases)
        if missing:
            raise ValueError(
                f"checkpoint {path!r} has no optimizer state for {len(missing)} parameter(s) of this model "
                f"(first: {', '.join(missing[:3])}); it was saved from another model"
            )
        groups = f"optimizer_states.{index}.param_groups.{min(int(k.rsplit('.', 1)[1]) for k in saved if k.startswith(f'optimizer_states.{index}.param_groups.'))}"
        targets |= entries | {groups: None}
        optimizer_states.append((optimizer, state, keys, groups))
    rng_key = f"rng.{rank}"
    targets |= {"lightning": None, "ptdp": None} | ({rng_key: None} if rng_key in saved else {})
    _, load_planner = _planners()
    planner = load_planner()
    dcp.load(targets, storage_reader=reader, planner=planner)
    loaded = planner.state_dict  # the bytes entries, filled in by the planner
    for optimizer, state, keys, groups in optimizer_states:
        _restore_optimizer(optimizer, state, keys, loaded, loaded[groups])
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=False))
    if loaded["ptdp"].get("world_size") == world_size and rng_key in loaded:  # same number of ranks
        restore_rng_states([loaded[rng_key] if r == rank else None for r in range(world_size)], rank)
    return {**loaded["lightning"], "state_dict": {}, "optimizer_states": [{} for _ in optimizers], LOADED_IN_PLACE: True}


LOADED_IN_PLACE = "ptdp_loaded_in_place"


def _restore_optimizer(optimizer: Any, state: dict, keys: dict, loaded: dict, groups: list) -> None:
    """Put the saved hyperparameters and non-tensor values into ``state`` (tensors are loaded in place)."""
    if len(groups) != len(state["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one {len(state['param_groups'])}; "
            "configure_optimizers must build the same groups to resume"
        )
    for group, saved in zip(state["param_groups"], groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for name, values in state["state"].items():
        for k, v in values.items():
            if not torch.is_tensor(v) and keys.get((name, k)) in loaded:
                values[k] = loaded[keys[name, k]]
