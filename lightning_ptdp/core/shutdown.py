"""A finished run exits with code 0: at interpreter exit, while it is still whole, every process group is
destroyed, every reference to it cut and collected, so its C++ destructor joins gloo's worker threads
before finalisation (docs/architecture.md, "Clean exit"). Not after a failed run."""

from __future__ import annotations

import atexit
import gc
import os
import types
import warnings
from typing import Any

import torch.distributed as dist

GLOO_WORKER_THREAD = "pt_gloo_runloop"
"""The name gloo gives each process group's worker threads (two per group)."""

_STATE = {"registered": False, "failed": False}


def take_down_groups_at_exit() -> None:
    """Register the exit hook once. Called by whoever created the default process group (the strategy,
    in the launched processes), not for a caller's group (a test pool's)."""
    if not _STATE["registered"]:
        _STATE["registered"] = True
        atexit.register(_take_down)


def process_group_failed() -> None:
    """After a failed run a collective may still wait on a peer that is gone: leave the groups alone."""
    _STATE["failed"] = True


def _take_down() -> None:
    if _STATE["failed"] or not dist.is_initialized():
        return
    take_down_groups()


def take_down_groups() -> None:
    """Destroy every process group of this process and cut every Python reference to them (the user's
    model, torch's wrappers, ours), so that collecting them runs their destructors now. A group's
    destructor releases the GIL, lets its workers finish the work they hold (releasing a tensor may
    need the GIL) and joins them: no gloo thread is left to ask for the GIL during finalisation."""
    groups = list(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()
    with warnings.catch_warnings():  # reading every object touches deprecated ones (dist.reduce_op)
        warnings.simplefilter("ignore")
        _cut_references(groups, untracked=True)
    del groups
    gc.collect()


def _cut_references(targets: list, untracked: bool = False, depth: int = 2) -> None:
    """Replace by None every reference to the targets that gc can reach; a tuple holding one, which
    cannot change, is cut where it is held. With ``untracked``, also the containers gc does not track
    (a dict or tuple of untracked values, ``(group, size)``), found inside the objects that hold them."""
    ids = {id(target) for target in targets}
    holders = [h for h in gc.get_referrers(*targets) if h is not targets and not isinstance(h, types.FrameType)]
    for holder in holders:
        if not isinstance(holder, tuple):
            _cut_in(holder, ids)
        elif depth:
            _cut_references([holder], depth=depth - 1)
    if not untracked:
        return
    get = gc.get_referents
    for outer, inner in [
        (outer, inner)
        for outer in gc.get_objects()
        for inner in get(outer)
        if type(inner) in (tuple, dict, list) and not gc.is_tracked(inner) and not ids.isdisjoint(map(id, get(inner)))
    ]:
        _cut_in(outer, {id(inner)}) if isinstance(inner, tuple) else _cut_in(inner, ids)


def _cut_in(holder: Any, hits: set[int]) -> None:
    if isinstance(holder, list):
        holder[:] = [None if id(item) in hits else item for item in holder]
    elif isinstance(holder, types.CellType):
        holder.cell_contents = None
    elif isinstance(holder, dict) or isinstance(getattr(holder, "__dict__", None), dict):
        _cut_in_namespace(holder if isinstance(holder, dict) else vars(holder), hits)
    for name in getattr(type(holder), "__slots__", ()):
        if id(getattr(holder, name, None)) in hits:
            object.__setattr__(holder, name, None)


def _cut_in_namespace(namespace: dict, hits: set[int]) -> None:
    """The hits set to None; beside them, an object of torch's c10d extension (DDP's reducer and
    logger hold their group in C++) in an object's namespace, not a module's."""
    for key, value in list(namespace.items()):
        c10d_object = type(value).__module__ == "torch._C._distributed_c10d" and "__builtins__" not in namespace
        if id(value) in hits or c10d_object:
            namespace[key] = None


def gloo_worker_threads() -> int:
    """How many gloo worker threads this process has (Linux: read from /proc; 0 elsewhere)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return 0
    count = 0
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as comm:
                count += comm.read().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended meanwhile
            pass
    return count
