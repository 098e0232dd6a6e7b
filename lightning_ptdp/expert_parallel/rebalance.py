"""Balanced expert placement at run time (``expert_balance=``): every ``interval`` optimizer steps
each MoE layer gets a new placement from the rows routed to each expert since the last one, summed
over every rank (placement.py ``balance``), and the experts' weights and optimizer state move to it.
Between steps a replicated expert's gradient is summed over the ranks holding it, so every replica
takes the same update: the model computes what one process computes, only where changes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.expert_parallel.apply import EPReport
from lightning_ptdp.expert_parallel.exchange import ExpertShard
from lightning_ptdp.expert_parallel.expert_list import place_expert_list
from lightning_ptdp.expert_parallel.placement import Placement, balance

log = logging.getLogger(__name__)


@dataclass
class _Slots:
    """One group of a layer's slot tensors: a stacked parameter (its rows are the slots) or the
    same parameter of each slot's module (a ModuleList layer)."""

    params: list[nn.Parameter]
    stacked: bool

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Slot i of ``tensors`` (the params, their grads or an optimizer state of the same shapes)."""
        return list(tensors[0].unbind(0)) if self.stacked else tensors


@dataclass
class _Layer:
    name: str
    shard: ExpertShard
    groups: list[_Slots]
    module: Optional[nn.Module] = None
    """A ModuleList layer: the module holding the list (its stubs are rebuilt when experts move)."""


class ExpertBalancer:
    """Placement, gradients and moves of every split MoE layer of one model (see the module doc)."""

    def __init__(self, model: nn.Module, report: EPReport, interval: int, pipeline: bool = False) -> None:
        self.interval, self.steps = interval, 0
        layers = [_layer(model, name, shard) for name, shard in sorted(report.sites.items())]
        self.layers = [layer for layer in layers if layer.groups]  # under PP: this stage's layers
        listed = [layer.name for layer in self.layers if layer.module is not None]
        if pipeline and listed:
            raise ValueError(
                f"expert_balance with pipeline_parallel_size > 1: the experts of '{listed[0]}' are a ModuleList, "
                "whose parameter names change when experts move, and the pipeline schedule finds each chunk's "
                "parameters by name; not supported yet. Use expert_balance without a pipeline for this model, "
                "or leave expert_balance unset"
            )
        self.stats = report.stats
        self.load = {layer.name: torch.zeros(layer.shard.num_experts, dtype=torch.long) for layer in self.layers}

    def owned_together(self) -> dict[int, int]:
        """id(param) -> group, for ZeRO-1: a ModuleList layer's slots of one parameter are owned by
        one edp index, so their optimizer state is present or absent together when they move."""
        return {
            id(p): k for k, group in enumerate(g for layer in self.layers for g in layer.groups) for p in group.params
        }

    # ------------------------------------------------------------------ every step
    def sum_replica_grads(self) -> None:
        """A replicated expert's gradient summed over the ep ranks holding it (each computed some of
        its rows), before the mean over the ranks holding the same slots."""
        for layer in self.layers:
            hot = layer.shard.placement.replicated
            if not hot:
                continue
            where = {j: k for k, j in enumerate(hot)}
            for group in layer.groups:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group.params]
                slots = group.views(grads)
                summed = slots[0].new_zeros((len(hot), *slots[0].shape))
                for j, grad in zip(layer.shard.mine, slots):
                    if j in where:
                        summed[where[j]] += grad
                dist.all_reduce(summed, group=layer.shard.ep.group)
                for j, grad in zip(layer.shard.mine, slots):
                    if j in where:
                        grad.copy_(summed[where[j]])
                for p, grad in zip(group.params, grads):
                    p.grad = grad

    def norm_shares(self) -> dict[int, Any]:
        """id(param) -> the share of its squares in the model's gradient norm: 1 / replicas of each
        slot's expert (a tensor over a stacked parameter's rows, a number for a slot's module)."""
        shares: dict[int, Any] = {}
        for layer in self.layers:
            placement = layer.shard.placement
            per_slot = [1.0 / len(placement.holders[j]) for j in layer.shard.mine]
            for group in layer.groups:
                if group.stacked:
                    shares[id(group.params[0])] = torch.tensor(per_slot, dtype=torch.float64)
                else:
                    shares.update((id(p), share) for p, share in zip(group.params, per_slot))
        return shares

    def stepped(self, optimizers: Iterable[Any]) -> bool:
        """After an optimizer step: count its routing; every ``interval`` steps place the experts
        anew and move them (weights and ``optimizers``' state). Returns whether they moved."""
        for name, rows in self.stats.tokens_per_expert.items():
            if name in self.load:
                self.load[name] += rows.long()
        self.steps += 1
        if self.steps % self.interval:
            return False
        totals = _summed_everywhere(self.load)
        moved = False
        for layer in self.layers:
            load = totals.get(layer.name)
            if load is None or not load.any():
                continue
            old = layer.shard.placement
            new = balance(load, old.size, old.per_rank)
            if new != old:
                _move(layer, old, new, optimizers)
                moved = True
            self.load[layer.name].zero_()
        return moved


def _layer(model: nn.Module, name: str, shard: ExpertShard) -> _Layer:
    module = model.get_submodule(name) if name else model
    if "_ptdp_expert_list" in module.__dict__:
        own = module.__dict__["_ptdp_expert_slots"][0]
        names = [n for n, _ in own[0].named_parameters()]
        groups = [_Slots([expert.get_parameter(n) for expert in own], stacked=False) for n in names]
        return _Layer(name, shard, groups, module)
    groups = [
        _Slots([param], stacked=True)
        for owner in module.modules()
        if owner.__dict__.get("_ptdp_experts") is shard
        for param in owner.parameters(recurse=False)
    ]
    return _Layer(name, shard, groups)


def _summed_everywhere(load: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's counts summed over every rank (stages hold different layers: by name)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {name: rows.tolist() for name, rows in load.items()})
    out: dict[str, torch.Tensor] = {}
    for part in every:
        for name, rows in part.items():
            out[name] = out.get(name, 0) + torch.tensor(rows, dtype=torch.long)
    return out


def _move(layer: _Layer, old: Placement, new: Placement, optimizers: Iterable[Any]) -> None:
    """Every slot of this rank takes its new expert's weights and optimizer state from a rank that
    held it (all-gathered over the ep group); then the placement changes."""
    ep = layer.shard.ep
    source = [old.holders[j][0] for j in new.slots[ep.rank]]
    states = [opt.optim.state if hasattr(opt, "optim") else opt.state for opt in optimizers]  # ZeRO-1: the local one
    for group in layer.groups:
        _move_slots(group, [p.data for p in group.params], source, ep)
        for state in states:
            held = [state.get(p) for p in group.params]
            if not held[0]:  # not stepped yet, or another rank's share under ZeRO-1 (alike over the ep group)
                continue
            for key, value in held[0].items():
                if torch.is_tensor(value) and value.shape == group.params[0].shape:
                    _move_slots(group, [entry[key] for entry in held], source, ep)
    layer.shard.placement = new
    if layer.module is not None:
        own, answer = layer.module.__dict__["_ptdp_expert_slots"]
        place_expert_list(
            getattr(layer.module, layer.module.__dict__["_ptdp_expert_list"][0]), own, new.slots[ep.rank], answer
        )
    log.info("expert balance: %s now %s", layer.name or "<model>", new.slots)


def _move_slots(group: _Slots, tensors: list[torch.Tensor], source: list[int], ep: Any) -> None:
    slots = group.views(tensors)
    mine = torch.stack([s.detach() for s in slots]).contiguous()
    parts = [torch.empty_like(mine) for _ in range(ep.size)]
    dist.all_gather(parts, mine, group=ep.group)
    every = torch.cat(parts)
    with torch.no_grad():
        for slot, g in zip(slots, source):
            slot.copy_(every[g])
