"""Non-finite losses and gradients, detected on all ranks together.

One rank's NaN must not let the others step: after backward every rank shares a flag (one small
all-gather), so all of them take the same decision. "raise" stops the run on every rank with a
FloatingPointError naming the step and the ranks whose loss or gradients were not finite;
"skip" drops the step everywhere (gradients cleared, so the optimizer leaves every parameter and
its moments untouched) with a warning; "ignore" does nothing, as plain Lightning.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _nonfinite_flag(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 1-element tensor on ``device``, > 0 when any element of ``tensors`` is NaN or Inf. One fused
    pass per (device, dtype): GradScaler's own check with a unit scale (x * 1.0 is x, bit for bit,
    NaN and Inf included), a few dispatches instead of a sum per tensor; no host sync here."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    flag = torch.zeros(1, device=device)
    with torch.no_grad():
        for (where, dtype), group in groups.items():
            if dtype in _FUSED_DTYPES:
                found = torch.zeros(1, device=where)
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.ones(1, device=where))
            else:  # a NaN or Inf anywhere survives the sum
                found = (~torch.isfinite(torch.stack([t.float().sum() for t in group]))).any().float().view(1)
            flag += found.to(device)
    return flag


def nonfinite_ranks(loss: Any, params: Iterable[torch.nn.Parameter]) -> dict[str, list[int]]:
    """Global ranks whose loss, and whose gradients, are not finite (a collective over the world).

    Both are reported: under data parallelism one rank's NaN loss reaches every rank's gradients
    through the all-reduce, and the loss names where it started. One host sync on a single rank."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    on_loss_device = isinstance(loss, torch.Tensor) and (not distributed or dist.get_backend() == "nccl")
    device = loss.device if on_loss_device else torch.device("cpu")
    losses = [loss.detach().reshape(1)] if isinstance(loss, torch.Tensor) else []
    flags = torch.cat([_nonfinite_flag(losses, device), _nonfinite_flag(grads, device)])
    if not distributed:
        gathered = [flags.tolist()]  # a world of one: nothing to share
    else:
        shared = [torch.zeros(2, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(shared, flags)
        gathered = [f.tolist() for f in shared]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    ranks = range(len(gathered)) if distributed else [rank]
    return {
        "loss": [r for r, f in zip(ranks, gathered) if f[0]],
        "gradients": [r for r, f in zip(ranks, gathered) if f[1]],
    }


def apply_policy(policy: str, bad: dict[str, list[int]], step: int, params: Iterable[torch.nn.Parameter]) -> bool:
    """Act on the shared decision; returns True when the step must be skipped."""
    if not (bad["loss"] or bad["gradients"]) or policy == "ignore":
        return False
    what = (
        f"non-finite values at global step {step}: loss on rank(s) {bad['loss']}, "
        f"gradients on rank(s) {bad['gradients']}"
    )
    if policy == "raise":
        raise FloatingPointError(
            f"{what}; every rank stops here. Lower the learning rate, clip gradients, or pass "
            "PTDPStrategy(on_nonfinite='skip') to drop such steps"
        )
    rank_zero_warn(f"{what}: skipping this optimizer step on every rank (on_nonfinite='skip')")
    for param in params:
        param.grad = None
    return True


def check_grad_scaler(precision_plugin: Any, on_nonfinite: str, *, pipeline: bool = False) -> None:
    """A GradScaler (precision='16-mixed') skips a step whose scaled gradients overflow and lowers
    the scale: normal in its first steps. The policy here runs before it unscales, so "raise" would
    stop on those overflows and "skip" would leave it no gradients to check: refused together. The
    pipeline schedule's backward cannot apply a scaler at all."""
    if getattr(precision_plugin, "scaler", None) is None:
        return
    if pipeline:
        raise ValueError(
            "precision='16-mixed' scales the loss with a GradScaler, which the pipeline schedule's backward "
            "cannot apply; with pipeline_parallel_size > 1 use precision='bf16-mixed', 'bf16-true' or '32-true'"
        )
    if on_nonfinite != "ignore":
        raise ValueError(
            "precision='16-mixed' scales the loss with a GradScaler, which skips a step whose gradients overflow "
            "and lowers the scale: that is how it works, not a failure, but "
            f"on_nonfinite={on_nonfinite!r} would act on it (the check sees the still-scaled gradients). "
            "With PTDPStrategy use precision='bf16-mixed', or on_nonfinite='ignore' to let the GradScaler "
            "decide alone"
        )
