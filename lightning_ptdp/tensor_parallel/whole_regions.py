"""Say what tensor parallelism leaves whole: regions discovery could not split, and blocks that
stay mostly replicated. One warning per block structure, naming the op, its source line, and the
share of the block's parameters every rank keeps; ``strict_plan=True`` refuses instead."""

from __future__ import annotations

import warnings

import torch.nn as nn

from lightning_ptdp.tensor_parallel.discovery_types import BlockPlan

MOSTLY_WHOLE = 0.5
"""Warn when more than this share of a block's parameters stays whole on every rank."""


class PartialSplitWarning(UserWarning):
    """Part of a block runs whole on every tensor-parallel rank (turn into an error with
    ``warnings.simplefilter("error", PartialSplitWarning)`` or ``strict_plan=True``)."""


def _numel(block: nn.Module, names: list[str]) -> int:
    return sum(p.numel() for name in names for p in block.get_submodule(name).parameters())


def parameters_at(block: nn.Module, path: str) -> list[tuple[nn.Module, str]]:
    """(module, name) of the one parameter at ``path``, or of every parameter of the module there."""
    owner, _, leaf = path.rpartition(".")
    module = block.get_submodule(owner)
    if leaf in dict(module.named_parameters(recurse=False)):
        return [(module, leaf)]
    return [(m, n) for m in block.get_submodule(path).modules() for n, _ in m.named_parameters(recurse=False)]


def _split_linears(plan: BlockPlan) -> list[str]:
    """The Linears a plan splits: its regions' columns and rows, and its gates."""
    return [m for r in plan.regions for m in (*r.columns, r.row)] + plan.gates


def whole_share(block: nn.Module, plan: BlockPlan) -> float:
    """The share of ``block``'s parameters (before the split) that no region splits."""
    total = sum(p.numel() for p in block.parameters())
    split = _numel(block, _split_linears(plan))
    return 1.0 - split / total if total else 0.0


def uncalled(block: nn.Module, plan: BlockPlan) -> list[str]:
    """Modules holding matrices that the recorded forward never ran nor read (a decoder's cross-attention
    with no encoder): nothing splits them, so they stay whole on every rank."""
    used = [n.target for n in plan.graph.nodes if n.op in ("call_module", "get_attr")]
    idle = []
    for path, p in block.named_parameters():
        owner = path.rpartition(".")[0]
        if p.dim() >= 2 and not any(path == u or path.startswith(u + ".") for u in used) and owner not in idle:
            idle.append(owner or path)
    return idle


def warn_whole_regions(
    name: str, block: nn.Module, plan: BlockPlan, tp_size: int, sequence_parallel: bool = False
) -> None:
    """One warning for the blocks of ``name``'s structure, if any region stays whole or more than
    half of the block's parameters are replicated (under SP such blocks run on the whole sequence)."""
    share = whole_share(block, plan)
    side = [
        t for r in plan.regions for t in r.prefix if any(getattr(m, n).dim() >= 2 for m, n in parameters_at(block, t))
    ]
    idle = uncalled(block, plan)
    cut = [p for r in plan.regions for p in r.cut_parameters if p not in r.stored_cuts]
    shared = [  # matrices every head reads whole (a bank of profiles mixed per head): replicated by design
        t for r in plan.regions for t in r.partial if any(getattr(m, n).dim() >= 2 for m, n in parameters_at(block, t))
    ]
    if not plan.kept_whole and share <= MOSTLY_WHOLE and not side and not idle and not cut and not shared:
        return
    kept = [m for k in plan.kept_whole for m in k.linears]
    what = f"keeps {', '.join(kept)} whole on every rank" if kept else "splits little of it"
    if side and not kept:
        what = f"keeps {', '.join(side)} whole on every rank (computed from a region's input beside its heads)"
    elif idle and not kept:
        what = f"keeps {', '.join(idle)} whole on every rank (the recorded forward never ran them)"
    elif cut and not kept:
        what = f"keeps {', '.join(cut)} whole on every rank (each rank reads its heads' share where it is used)"
    elif shared and not kept:
        what = f"keeps {', '.join(shared)} whole on every rank (every head reads all of it; gradients summed over tp)"
    why = f": {plan.kept_whole[0].reason}" if plan.kept_whole else ""
    split = ", ".join(_split_linears(plan)) or "nothing"
    sp = (
        "; with sequence_parallel=True these blocks gather the sequence and run on all of it"
        if sequence_parallel and plan.kept_whole
        else ""
    )
    warnings.warn(
        f"tensor parallelism (t={tp_size}) {what} in block '{name}' and its like ({share:.0%} of each block's "
        f"parameters replicated){why}. Split over t: {split}{sp}. Training is exact; to refuse instead pass "
        "strict_plan=True, or split it by hand with tp_plan",
        PartialSplitWarning,
        stacklevel=3,
    )
