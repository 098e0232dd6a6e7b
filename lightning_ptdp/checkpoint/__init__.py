"""Checkpoints that load on any layout. ``Checkpointer`` is the one entry the strategy calls.

Sharded (default): every rank writes its pieces of the original tensors with DCP (``dcp_save``,
``dcp_load``, geometry in ``pieces``). Full: rank 0 writes one file of unsharded tensors (``full``,
written atomically by ``io``). Both carry every rank's RNG states (``rng``); ``resume`` restarts the
dataloader mid-epoch, ``pretrained`` reads weight files into shards, ``command`` is ``ptdp checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.checkpoint import dcp_load, dcp_save, full, rng
from lightning_ptdp.core.comm import raise_on_every_rank
from lightning_ptdp.data_parallel.zero1 import dp_group_of, local_optimizer, sync_groups_after_load

LOADED_IN_PLACE = dcp_load.LOADED_IN_PLACE


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed on some rank; the checkpoint it would have replaced is untouched."""


@dataclass(frozen=True, kw_only=True)
class ShardingView:
    """What checkpoints need to know about how the model was cut (``Parallelized.sharding``)."""

    module: nn.Module
    """The LightningModule (unwrapped): its state_dict names are the checkpoint's."""
    tensor_parallel: bool = False
    fsdp: bool = False
    pp_group: Any = None
    """The pipeline group when p > 1: each stage holds its own chunks' entries."""
    aliases: Optional[dict[str, list[str]]] = None
    """Under PP: every name of a weight tied across stages."""


@dataclass(kw_only=True)
class Checkpointer:
    """Save and load Lightning's checkpoint dict in ``format``; every method is a collective."""

    format: str = "sharded"
    """One of config.CHECKPOINT_FORMATS (validated there, with the strategy's other options)."""

    # ------------------------------------------------------------------ state dicts
    def model_state(self, view: ShardingView) -> dict[str, Any]:
        """Sharded: this rank's pieces. Full: unsharded weights (a collective under TP, PP and ZeRO)."""
        if self.format == "sharded":
            return dcp_save.model_pieces(view.module, view.aliases)
        return full.model_state(
            view.module, tensor_parallel=view.tensor_parallel, fsdp=view.fsdp, pp_group=view.pp_group
        )

    def load_model_state(self, view: ShardingView, state: dict[str, Any], strict: bool) -> None:
        """Unsharded weights cut to this rank's shards (a sharded checkpoint was loaded in place)."""
        if state.get(LOADED_IN_PLACE):
            return
        full.load_model_state(
            view.module,
            state["state_dict"],
            strict=strict,
            tensor_parallel=view.tensor_parallel,
            fsdp=view.fsdp,
            pipeline=view.pp_group is not None,
        )

    def optimizer_state(self, view: ShardingView, optimizer: Any) -> dict[str, Any]:
        """Sharded: this rank's pieces (under ZeRO-1 of the parameters it owns). Full: unsharded."""
        local = local_optimizer(optimizer)
        if self.format == "sharded":
            return dcp_save.optimizer_pieces(view.module, local, view.aliases)
        return full.optimizer_state(
            view.module,
            local,
            tensor_parallel=view.tensor_parallel,
            fsdp=view.fsdp,
            pp_group=view.pp_group,
            dp_group=dp_group_of(optimizer),
        )

    def load_optimizer_states(self, view: ShardingView, optimizers: list[Any], state: dict[str, Any]) -> None:
        if state.get(LOADED_IN_PLACE):
            return
        for optimizer, optimizer_state in zip(optimizers, state["optimizer_states"]):
            owned_only = dp_group_of(optimizer) is not None  # ZeRO-1: the entries this rank owns
            with _failure_raised_on_every_rank("loading ZeRO-1's share of the optimizer state", owned_only):
                full.load_optimizer_state(
                    view.module,
                    local_optimizer(optimizer),
                    optimizer_state,
                    tensor_parallel=view.tensor_parallel,
                    fsdp=view.fsdp,
                    aliases=view.aliases,
                    owned_only=owned_only,
                )
            sync_groups_after_load(optimizer)

    # ------------------------------------------------------------------ files
    @staticmethod
    def is_sharded(path: str) -> bool:
        """A sharded checkpoint is a folder (its name a link to the current version); full is a file."""
        return os.path.isdir(path) or os.path.islink(path)

    def load_sharded(
        self, path: str, view: ShardingView, optimizers: list[Any], *, weights_only: Optional[bool], strict: bool
    ) -> dict[str, Any]:
        """Load a sharded checkpoint in place on every rank; return the rest of Lightning's dict."""
        if weights_only:
            raise ValueError(
                f"weights_only=True cannot be honoured for the sharded checkpoint {path!r}: torch.distributed.checkpoint "
                "unpickles its metadata and Lightning's state in full. Load only checkpoints you trust, with "
                "weights_only=None or False; or consolidate it (ptdp checkpoint consolidate) and load that file"
            )
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        owned_only = [dp_group_of(o) is not None for o in optimizers]  # ZeRO-1: the entries this rank owns
        with _failure_raised_on_every_rank("loading the sharded checkpoint", any(owned_only)):
            loaded = dcp_load.load(
                path,
                module=view.module,
                optimizers=[local_optimizer(o) for o in optimizers],
                aliases=view.aliases,
                rank=rank,
                world_size=world,
                strict=strict,
                pipeline=view.pp_group is not None,
                by_name=owned_only,
            )
        for optimizer in optimizers:
            sync_groups_after_load(optimizer)
        return loaded

    @staticmethod
    def restore_rng(loaded: dict[str, Any]) -> None:
        """After a full file was read: this rank continues its random streams where they were."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng.restore_rng_states(loaded.pop(rng.RNG_KEY, None), rank)

    def save(
        self,
        state: dict[str, Any],
        path: str,
        *,
        layout: dict[str, Any],
        write_file: Callable[[dict[str, Any]], None],
        storage_options: Any = None,
    ) -> None:
        """Write ``state`` at ``path`` (``write_file`` writes a full file on rank 0). A failure (disk
        full, quota) is raised on every rank, so none waits in the barrier after a save until the
        collective timeout; the previous checkpoint stays as it was."""
        if self.format == "sharded":
            return self._save_sharded(state, path, layout, storage_options)
        rank = dist.get_rank() if dist.is_initialized() else 0
        states: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(states, rng.collect_rng_states())
        else:
            states = [rng.collect_rng_states()]
        failure, cause = None, None
        if rank == 0:
            try:
                write_file({**state, rng.RNG_KEY: states})
            except Exception as error:  # reported to all ranks below, then raised here with its cause
                cause = root = error
                while root.__cause__ is not None or root.__context__ is not None:  # torch.save wraps OS errors
                    root = root.__cause__ or root.__context__
                failure = f"{type(root).__name__}: {root}"
        failure = _from_rank_zero(failure)
        if failure is not None:
            message = f"saving checkpoint {path!r} failed on rank 0 ({failure}); the previous checkpoint is untouched"
            raise CheckpointSaveError(message) from cause

    @staticmethod
    def _save_sharded(state: dict[str, Any], path: str, layout: dict[str, Any], storage_options: Any) -> None:
        if storage_options is not None or "://" in path:
            raise ValueError(
                f"checkpoint_format='sharded' writes to a local or mounted shared folder; {path!r} with "
                f"storage_options={storage_options!r} is not one. Use checkpoint_format='full' for remote storage"
            )
        flat = dcp_save.flat_state(state, dist.get_rank() if dist.is_initialized() else 0, layout)
        try:
            dcp_save.save(flat, _from_rank_zero(path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # DCP's CheckpointException (a BaseException) carries every rank's outcome
            raise CheckpointSaveError(
                f"saving checkpoint {path!r} failed ({dcp_save.describe_failure(error)}); the previous "
                "checkpoint is untouched"
            ) from error

    @staticmethod
    def remove(path: str, remove_file: Callable[[str], None]) -> None:
        """Delete a checkpoint name on rank 0 (a sharded one's data goes once no name points at it)."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if Checkpointer.is_sharded(path):
            dcp_save.remove(path)
        else:
            remove_file(path)


@contextmanager
def _failure_raised_on_every_rank(what: str, active: bool = True) -> Iterator[None]:
    """ZeRO-1 loads differ per rank (each its own share): a failure on some ranks is raised on all,
    before the collective that follows the load would wait for them."""
    if not active:
        yield
        return
    problems = []
    try:
        yield
    except Exception as error:  # shared below, then raised on every rank
        problems.append(f"{what} failed: {type(error).__name__}: {error}")
    raise_on_every_rank(problems)


def _from_rank_zero(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, 0)
    return box[0]
