"""A trial run of a block's split forward on meta tensors, before the model is rewritten.

The recorded graph misses Python arithmetic on a size read (a batch computed as the folded size over the
global head count) and Python shape checks (``scores.size() != (bsz * num_heads, ...)``).
So the first block of each structure is copied to meta (no real storage), split at rank 0 of t (meta
tensors pass the collectives) and run once on meta copies of its inputs: a region whose split raises
stays whole, the error its warning's reason. A block that fails on meta even whole is not tried.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from lightning_ptdp.tensor_parallel.discovery_types import BlockPlan

_META = torch.device("meta")


def meta_copy(block: nn.Module) -> nn.Module:
    """``block`` deep-copied with every parameter and buffer on meta, none of them copied for real."""
    memo: dict[int, Any] = {}
    for p in block.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device=_META), requires_grad=p.requires_grad)
    for b in block.buffers():
        memo[id(b)] = torch.empty_like(b, device=_META)
    return copy.deepcopy(block, memo)


def _on_meta(value: Any) -> Any:
    return torch.empty_like(value, device=_META) if isinstance(value, torch.Tensor) else value


def runs_on_meta(block: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the whole block runs on meta copies of its inputs (else a trial says nothing)."""
    return trial_error(lambda b: None, block, args, kwargs) is None


def trial_error(
    split: Callable[[nn.Module], None], block: nn.Module, args: tuple, kwargs: dict
) -> BaseException | None:
    """The error the meta copy of ``block`` raises once ``split`` rewrote it, or None."""
    try:
        trial = meta_copy(block)
        split(trial)
        with torch.no_grad():
            trial(*tree_map(_on_meta, args), **tree_map(_on_meta, kwargs))
    except Exception as error:  # noqa: BLE001 - the user's forward on shards may raise anything
        return error
    return None


def describe(error: BaseException, name: str, row: str) -> str:
    return (
        f"block '{name}': its forward raised {type(error).__name__}: {str(error)[:200]} on a trial of the "
        f"region ending in '{row}' split (a size read or check outside the recorded graph)"
    )


def regions_that_fail(plan: BlockPlan, fails: Callable[[BlockPlan], BaseException | None], replan, name: str) -> dict:
    """Row -> reason for each region whose split alone fails the trial (``replan(keep)``: the plan with
    the regions of ``keep`` whole); every region's when each passes alone but not all together."""
    error = fails(plan)
    if error is None:
        return {}
    rows = [r.row for r in plan.regions]
    failing = {}
    for row in rows:
        alone = replan({other: "tried apart" for other in rows if other != row})
        alone_error = fails(alone) if any(r.row == row for r in alone.regions) else None
        if alone_error is not None:
            failing[row] = describe(alone_error, name, row)
    return failing or {row: describe(error, name, row) for row in rows}
