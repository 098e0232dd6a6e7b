"""Sharded checkpoints: every rank writes its own pieces with torch.distributed.checkpoint (DCP).

Tensors are stored as the original (single-process) tensors cut into rectangles (pieces.py), under
the original names, so DCP's resharding reads any other layout's pieces out of them; a weight held
by several ranks is written once. Custom planners hand DCP those pieces: a fused q/k/v shard is
several rectangles, which neither a DTensor placement nor DCP's default planner describes. Saving
is atomic: DCP writes a fresh hidden version folder and the checkpoint's name is a symlink swapped
onto it with one ``os.replace``. Key layout and cleanup rules: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_ptdp.checkpoint.io import fsync_dir
from lightning_ptdp.checkpoint.pieces import Piece, Pieces, pieces, tp_cuts

MODEL = "state_dict."
OPTIMIZER = "optimizer_states."
VERSIONS = ".ptdp"  # hidden folder beside the checkpoints holding their versions
FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------- planners
def _split(state: dict[str, Any]) -> tuple[dict[str, Pieces], dict[str, Any]]:
    ours = {k: v for k, v in state.items() if isinstance(v, Pieces)}
    return ours, {k: v for k, v in state.items() if k not in ours}


def _piece_at(entry: Pieces, offsets: torch.Size) -> Piece:
    return next(p for p in entry.items if torch.Size(p.offsets) == offsets)


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's planner, plus one write item per piece: its offsets and sizes in the original tensor."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self._pieces, rest = _split(state_dict)
        super().set_up_planner(rest, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
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
            for fqn, entry in self._pieces.items()
            for piece in entry.items
        ]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        entry = self._pieces.get(write_item.index.fqn)
        if entry is None:
            return super().resolve_data(write_item)
        return _piece_at(entry, write_item.index.offset).local.detach().cpu().clone()  # a view would save its base


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, plus read items for this rank's pieces: DCP's resharding finds the saved
    pieces that overlap each, and the reads land in the piece's view of the live tensor."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        self._pieces, rest = _split(state_dict)
        super().set_up_planner(rest, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for fqn, entry in self._pieces.items():
            chunks = [ChunkStorageMetadata(torch.Size(p.offsets), p.local.shape) for p in entry.items]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
        return dataclasses.replace(plan, items=plan.items + items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        entry = self._pieces.get(read_item.dest_index.fqn)
        if entry is None:
            return super().resolve_tensor(read_item)
        local = _piece_at(entry, read_item.dest_index.offset).local
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            local = local.narrow(dim, start, length)
        return local


# ----------------------------------------------------------------------------- what ranks hold
def canonical(name: str, aliases: Optional[dict[str, list[str]]]) -> str:
    """The single-process name of a parameter (a weight tied across stages: its first name)."""
    return (aliases or {}).get(name, [name])[0]


def model_pieces(module: nn.Module, aliases: Optional[dict[str, list[str]]] = None) -> dict[str, Any]:
    """This rank's part of the model's state, under every name the single-process model gives it."""
    cuts = tp_cuts(module)
    out: dict[str, Any] = {}
    for name, value in module.state_dict().items():
        entry = pieces(value, cuts.get(name)) if torch.is_tensor(value) and value.dim() > 0 else value
        for alias in (aliases or {}).get(name, [name]):
            out[alias] = entry
    return out


def optimizer_state_pieces(module: nn.Module, state: dict[str, Any], name: str, cuts: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state with its parameter-shaped tensors as pieces (``cuts``: tp_cuts(module))."""
    param = module.get_parameter(name)
    cut = cuts.get(name)
    out = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"optimizer state {name}.{key} has shape {tuple(value.shape)}, not its parameter's "
                    f"{tuple(param.shape)}: a sharded checkpoint cannot say which part of the model it belongs to "
                    "(a factored optimizer?). Use PTDPStrategy(checkpoint_format='full') with this optimizer"
                )
            value = pieces(value, cut)
        out[key] = value
    return out


def optimizer_pieces(
    module: nn.Module, optimizer: Any, aliases: Optional[dict[str, list[str]]] = None
) -> dict[str, Any]:
    """This rank's part of an optimizer's state keyed by the single-process parameter names, and
    its groups (hyperparameters and the names of this rank's parameters in each)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))
    cuts = tp_cuts(module)
    return {
        "state": {
            canonical(name, aliases): optimizer_state_pieces(module, values, name, cuts)
            for name, values in state["state"].items()
        },
        "param_groups": [
            {**group, "params": [canonical(n, aliases) for n in group["params"]]} for group in state["param_groups"]
        ],
    }


def flat_state(checkpoint: dict[str, Any], rank: int, layout: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict (with ``model_pieces``/``optimizer_pieces`` in it) as DCP entries.
    Entries every rank holds alike are written once, by whichever rank DCP picks; Lightning's dict
    and the layout are rank 0's alone (callback state may differ on other ranks)."""
    from lightning_ptdp.checkpoint.rng import collect_rng_states

    rest = dict(checkpoint)
    flat: dict[str, Any] = {f"{MODEL}{k}": v for k, v in rest.pop("state_dict", {}).items()}
    for index, optimizer in enumerate(rest.pop("optimizer_states", [])):
        for name, values in optimizer["state"].items():
            flat.update({f"{OPTIMIZER}{index}.state.{name}.{k}": v for k, v in values.items()})
        flat[f"{OPTIMIZER}{index}.param_groups.{rank}"] = optimizer["param_groups"]
    flat[f"rng.{rank}"] = collect_rng_states()
    if rank == 0:
        flat["ptdp"] = {"format": FORMAT_VERSION, **layout}
        flat["lightning"] = rest
    return flat


# ----------------------------------------------------------------------------------- saving
VERSION_MARK = ".ptdp-version"  # in every version folder the saver creates: only those are ever deleted


def _refuse_plain_folder(target: str) -> None:
    """A sharded checkpoint's name is a link into the versions folder; a plain folder there is not
    ours (user data, another tool's checkpoint): never replaced, moved or deleted."""
    if os.path.isdir(target) and not os.path.islink(target):
        raise FileExistsError(
            f"{target!r} is a plain folder, not a ptdp sharded checkpoint (whose name is a link into "
            f"{VERSIONS}/ beside it); ptdp does not replace, move or delete it. Move or delete it yourself, "
            "or save the checkpoint under another name"
        )


def _version_dir(target: str) -> str:
    """A new, empty version folder for ``target``, marked as ptdp's (rank 0 only)."""
    _refuse_plain_folder(target)
    versions = os.path.join(os.path.dirname(target), VERSIONS)
    os.makedirs(versions, exist_ok=True)
    base = os.path.basename(target)
    taken = [
        int(n.rsplit(".v", 1)[1])
        for n in os.listdir(versions)
        if n.startswith(f"{base}.v") and n.rsplit(".v", 1)[1].isdigit()
    ]
    path = os.path.join(versions, f"{base}.v{max(taken, default=0) + 1}")
    os.makedirs(path)
    with open(os.path.join(path, VERSION_MARK), "w") as mark:
        mark.write(base)
    return path


def _collect_garbage(folder: str) -> None:
    """Delete the version folders ptdp wrote (marked) that no name in ``folder`` points at (directly
    or through other links): replaced ones, removed ones, and those a crash left unpublished.
    Anything else in the versions folder is left alone."""
    versions = os.path.join(folder, VERSIONS)
    if not os.path.isdir(versions):
        return
    linked = {
        os.path.realpath(os.path.join(folder, n)) for n in os.listdir(folder) if os.path.islink(os.path.join(folder, n))
    }
    for name in os.listdir(versions):
        path = os.path.join(versions, name)
        ours = not os.path.islink(path) and os.path.isfile(os.path.join(path, VERSION_MARK))
        if ours and os.path.realpath(path) not in linked:
            shutil.rmtree(path, ignore_errors=True)


def _publish(version: str, target: str) -> None:
    """Point ``target`` at ``version`` with one atomic rename (after syncing the new folder's
    entries), then delete the versions no name points at any more."""
    folder = os.path.dirname(target)
    fsync_dir(version)
    fsync_dir(os.path.dirname(version))
    _refuse_plain_folder(target)  # again: one may have appeared while the ranks wrote
    link = f"{target}.ptdp-link"
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.relpath(version, folder), link)
    os.replace(link, target)
    fsync_dir(folder)
    _collect_garbage(folder)


def save(flat: dict[str, Any], target: str, *, no_dist: bool = False) -> None:
    """Write ``flat`` as a sharded checkpoint named ``target``; a collective over all ranks (unless
    ``no_dist`` or no process group: one process writing everything). Raises on every rank if any
    rank failed to write (DCP gathers the outcome)."""
    collective = not no_dist and dist.is_initialized()
    target = os.path.abspath(target)
    version = _on_rank_zero(lambda: _version_dir(target), collective)
    writer = dcp.FileSystemWriter(version, sync_files=True)
    dcp.save(flat, storage_writer=writer, planner=PiecesSavePlanner(), no_dist=not collective)
    if collective:
        dist.barrier()
        _check_shared(version)
    _on_rank_zero(lambda: _publish(version, target), collective)


def _check_shared(version: str) -> None:
    """Every rank must see the finished checkpoint: a folder on each node's own disk is not one."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.path.exists(os.path.join(version, ".metadata")))
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise OSError(
            f"ranks {blind} do not see {version}/.metadata that rank 0 wrote: the checkpoint folder is not on "
            "storage every node shares, so no rank could load it whole. Save to a shared filesystem"
        )


def _on_rank_zero(fn: Callable[[], Any], collective: bool) -> Any:
    """``fn()`` run by rank 0, its result on every rank; its failure raised on every rank."""
    outcome: tuple[Any, Optional[str]] = (None, None)
    if not collective or dist.get_rank() == 0:
        try:
            outcome = (fn(), None)
        except Exception as error:  # raised below on every rank
            outcome = (None, f"{type(error).__name__}: {error}")
    if collective:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    value, failure = outcome
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
    """Delete a checkpoint name; its data goes once no other name points at it. A plain folder at
    the name is not a checkpoint ptdp wrote: left in place, with a warning."""
    if os.path.islink(target):
        os.remove(target)
        _collect_garbage(os.path.dirname(os.path.abspath(target)))
    elif os.path.isdir(target):
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"not removing {target!r}: a plain folder, not a ptdp sharded checkpoint (a link); left as it is"
        )
