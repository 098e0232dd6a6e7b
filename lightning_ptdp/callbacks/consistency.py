"""ReplicaConsistency: every N steps, check that copies of a parameter are bitwise equal.

Copies that must stay identical: a parameter across its data-parallel replicas (same pp and tp
coordinates; none under ZeRO, where each rank holds a different shard) and a weight tied across
pipeline stages. A silent divergence (a missed all-reduce, a non-deterministic kernel, a bad host)
otherwise surfaces days later as an unexplained loss curve. Each rank reduces every parameter to a
64-bit fingerprint of its raw bits (plain and position-weighted sums), the fingerprints are
all-gathered over the group, and the first parameter whose copies differ is named.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ptdp.core.comm import local_tensor

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergence(RuntimeError):
    """Copies of a parameter that must be identical differ."""


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """(sum of raw bits, position-weighted sum) as int64: equal for bitwise-equal tensors."""
    local = local_tensor(tensor)
    bits = local.detach().contiguous().view(-1).view(_BITS[local.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device) % 1021 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def first_divergence(names: list[str], prints: torch.Tensor, group_ranks: list[int]) -> Optional[str]:
    """``prints``: (ranks, params, 2) fingerprints gathered over a group; the first difference."""
    for index, name in enumerate(names):
        column = prints[:, index]
        differs = [r for r, p in zip(group_ranks, column) if not torch.equal(p, column[0])]
        if differs:
            return f"parameter '{name}' differs between global ranks {group_ranks[0]} and {differs}"
    return None


class ReplicaConsistency(pl.Callback):
    """Every ``every_n_steps`` optimizer steps, check replicated parameters; ``on_divergence``
    "raise" stops training on every rank (ReplicaDivergence, with every rank's findings), "warn" warns."""

    def __init__(self, *, every_n_steps: int = 100, on_divergence: Literal["raise", "warn"] = "raise") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ReplicaConsistency(every_n_steps={every_n_steps!r}) must be a positive integer")
        if on_divergence not in ("raise", "warn"):
            raise ValueError(f"ReplicaConsistency(on_divergence={on_divergence!r}) must be 'raise' or 'warn'")
        self.every_n_steps, self.on_divergence = every_n_steps, on_divergence
        self.checks = 0
        self._last_step = -1

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or step == self._last_step or not dist.is_initialized():
            return  # (accumulated batches share a step: check it once)
        self._last_step = step
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, self.check(trainer, pl_module))  # every rank acts on every finding
        problems = list(dict.fromkeys(p for rank_problems in found for p in rank_problems))
        self.checks += 1
        if problems:
            message = f"step {trainer.global_step}: " + "; ".join(problems)
            if self.on_divergence == "raise":
                raise ReplicaDivergence(message)
            rank_zero_warn(message)

    def check(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> list[str]:
        """Compare now; returns the divergences found (empty when all copies agree)."""
        strategy = trainer.strategy
        mesh = getattr(strategy, "device_mesh", None)
        problems = []
        if not getattr(getattr(strategy, "parallel_config", None), "fsdp", False):  # ZeRO 2-3 shard the replicas
            group = mesh["dp"].get_group() if mesh is not None else None
            named = sorted(pl_module.named_parameters())
            found = self._compare([n for n, _ in named], [p for _, p in named], group, strategy.root_device)
            if found:
                problems.append(f"data-parallel replicas: {found}")
        engine = getattr(strategy, "pipeline", None)
        if engine is not None and engine.split.tied:
            names, tensors, held = [], [], []
            for original, shape, dtype, local_name in engine.split.tied:
                param = engine.split.tied_param(local_name)
                names.append(original)
                tensors.append(param if param is not None else torch.zeros(()))
                held.append(param is not None)
            found = self._compare(names, tensors, engine.pp_group, strategy.root_device, held)
            if found:
                problems.append(f"weights tied across pipeline stages: {found}")
        return problems

    @staticmethod
    def _compare(
        names: list[str],
        tensors: list[torch.Tensor],
        group: Any,
        device: torch.device,
        held: Optional[list[bool]] = None,
    ) -> Optional[str]:
        size = dist.get_world_size(group)
        if size == 1 or not names:
            return None
        mine = torch.stack([fingerprint(t).to(device) for t in tensors])  # (params, 2), on the group's device
        mask = torch.tensor(held if held is not None else [True] * len(names), dtype=torch.int64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(size)]
        masks = [torch.zeros_like(mask) for _ in range(size)]
        dist.all_gather(gathered, mine, group=group)
        dist.all_gather(masks, mask, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        for index, name in enumerate(names):  # only the ranks that hold a copy take part
            holders = [r for r in range(size) if int(masks[r][index])]
            prints = torch.stack([gathered[r][index].cpu() for r in holders]).unsqueeze(1)
            found = first_divergence([name], prints, [ranks[r] for r in holders])
            if found:
                return found
        return None
