"""Cross-check the discovered plan against a plan the model carries (transformers'
``config.base_model_tp_plan``): discovery decides, the model's plan is a second opinion, and each
plan entry says which source agreed. A disagreement is logged, not obeyed: the model's plan
describes DTensor styles for transformers' own TP, whose shape handling differs from ours."""

from __future__ import annotations

import fnmatch
import logging
from typing import Optional

import torch.nn as nn

log = logging.getLogger(__name__)

_SAME = {
    "colwise": ("colwise", "colwise_rep", "local_colwise", "packed_colwise"),
    "rowwise": ("rowwise", "rowwise_rep", "local_rowwise"),
    "replicated": ("replicate", "replicated"),  # transformers' name for a module every rank holds whole
}


def _model_plans(model: nn.Module) -> list[tuple[str, dict[str, str]]]:
    """(module path, plan) for every module whose config carries a base-model TP plan."""
    found = []
    for path, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if isinstance(plan, dict) and plan:
            found.append((path, plan))
    return found


def _their_style(path: str, plans: list[tuple[str, dict[str, str]]]) -> Optional[str]:
    for base, plan in plans:
        if base and not path.startswith(f"{base}."):
            continue
        relative = path[len(base) + 1 :] if base else path
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(relative, pattern):
                return style
    return None


def cross_check(model: nn.Module, entries: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The entries with the model plan's verdict added to each detail (unchanged without one)."""
    plans = _model_plans(model)
    if not plans:
        return entries
    checked, disagreements = [], []
    for path, style, detail in entries:
        theirs = _their_style(path, plans)
        if theirs is None:
            verdict = "model's tp plan: not listed"
        elif theirs in _SAME.get(style.split(":")[0].split("_")[0], ()):
            verdict = f"model's tp plan agrees ({theirs})"
        else:
            verdict = f"model's tp plan says {theirs}"
            disagreements.append(f"{path}: discovered {style}, the model's plan says {theirs}")
        checked.append((path, style, f"{detail}; {verdict}"))
    if disagreements:
        log.warning(
            "the discovered plan (used) differs from the model's base_model_tp_plan: %s", "; ".join(disagreements)
        )
    return checked
