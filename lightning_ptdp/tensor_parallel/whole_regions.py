"""Say what tensor parallelism leaves whole: regions discovery could not split, and blocks that
stay mostly replicated. One warning per block structure, naming the op, its source line, and the
share of the block's parameters every rank keeps; ``strict_plan=True`` refuses instead."""

from __future__ import annotations

import warnings

import torch.nn as nn

from lightning_ptdp.tensor_parallel.discovery_types import BlockPlan, TPDiscoveryError

MOSTLY_WHOLE = 0.5
"""Warn when more than this share of a block's parameters stays whole on every rank."""


class PartialSplitWarning(UserWarning):
    """Part of a block runs whole on every tensor-parallel rank (turn into an error with
    ``warnings.simplefilter("error", PartialSplitWarning)`` or ``strict_plan=True``)."""


def _numel(block: nn.Module, names: list[str]) -> int:
    return sum(p.numel() for name in names for p in block.get_submodule(name).parameters())


def whole_share(block: nn.Module, plan: BlockPlan) -> float:
    """The share of ``block``'s parameters (before the split) that no region splits."""
    total = sum(p.numel() for p in block.parameters())
    split = _numel(block, [m for r in plan.regions for m in (*r.columns, r.row)])
    return 1.0 - split / total if total else 0.0


def warn_whole_regions(name: str, block: nn.Module, plan: BlockPlan, tp_size: int) -> None:
    """One warning for the blocks of ``name``'s structure, if any region stays whole or more than
    half of the block's parameters are replicated."""
    share = whole_share(block, plan)
    if not plan.kept_whole and share <= MOSTLY_WHOLE:
        return
    kept = [m for k in plan.kept_whole for m in k.linears]
    what = f"keeps {', '.join(kept)} whole on every rank" if kept else "splits little of it"
    why = f": {plan.kept_whole[0].reason}" if plan.kept_whole else ""
    split = ", ".join(m for r in plan.regions for m in (*r.columns, r.row)) or "nothing"
    warnings.warn(
        f"tensor parallelism (t={tp_size}) {what} in block '{name}' and its like ({share:.0%} of each block's "
        f"parameters replicated){why}. Split over t: {split}. Training is exact; to refuse instead pass "
        "strict_plan=True, or split it by hand with tp_plan",
        PartialSplitWarning,
        stacklevel=3,
    )


def refuse_whole_regions_under_sp(name: str, plan: BlockPlan) -> None:
    """Sequence parallelism runs the blocks on 1/t of the sequence: a region kept whole would see
    only its rank's tokens, so every region must be split."""
    if plan.kept_whole:
        kept = plan.kept_whole[0]
        raise TPDiscoveryError(
            f"sequence_parallel=True needs every region of block '{name}' split over the tensor-parallel ranks, "
            f"but {', '.join(kept.linears)} stay whole ({kept.reason}); use sequence_parallel=False, which runs that "
            "region whole and splits the rest, or pass tp_plan"
        )
