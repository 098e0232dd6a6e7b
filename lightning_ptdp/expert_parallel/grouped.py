"""Experts called on rows grouped by expert: ``forward(rows [M, H], sizes)``, the rows of block e
(``sizes[e]`` of them, in expert order) computed by expert e. ``sizes``: a list or an integer tensor
of one count per expert (JetMoE's, tokens per expert), or absent with M = n_experts x C, equal
blocks (Llama 4's dense dispatch). Found from the probe's call and checked on it: moving expert j's
weights or block j's rows moves block j's outputs only. Under expert parallelism each block goes to
the rank holding its expert (exchange.py) and comes back in place."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_ptdp.expert_parallel.calls import ArgSlot, slots
from lightning_ptdp.expert_parallel.exchange import ExchangeStats, ExpertShard, exchange


@dataclass(frozen=True)
class GroupedSite:
    """One experts module called on rows grouped by expert."""

    name: str
    module: nn.Module
    num_experts: int
    hidden: ArgSlot
    sizes: Optional[ArgSlot]
    """Rows per expert, as the call gives them; None: n_experts equal blocks."""


def classify_grouped(
    name: str, module: nn.Module, num_experts: int, args: tuple, kwargs: dict
) -> Optional[GroupedSite]:
    """The call as rows grouped by expert, or None: exactly one float [M, H] tensor, and either one
    argument of ``num_experts`` counts summing to M (and no other tensor) or no other tensor with
    M a multiple of ``num_experts``."""
    found = slots(args, kwargs)
    rows = [(s, v) for s, v in found if torch.is_tensor(v) and v.is_floating_point() and v.dim() == 2]
    if len(rows) != 1:
        return None
    hidden, value = rows[0]
    sizes = [s for s, v in found if _total(v, num_experts) == value.shape[0]]
    others = [s for s, v in found if torch.is_tensor(v) and s != hidden and s not in sizes]
    if others or len(sizes) > 1 or (not sizes and value.shape[0] % num_experts):
        return None
    return GroupedSite(name, module, num_experts, hidden, sizes[0] if sizes else None)


def _total(value: Any, n: int) -> Optional[int]:
    """The sum of ``value`` read as n block sizes (a list or tuple of n ints, an integer tensor [n])."""
    if isinstance(value, (list, tuple)) and len(value) == n and all(type(v) is int for v in value):
        return sum(value)
    integer = torch.is_tensor(value) and not value.is_floating_point() and value.dtype != torch.bool
    if integer and tuple(value.shape) == (n,) and not value.is_meta:
        return int(value.sum())
    return None


def block_sizes(site: GroupedSite, args: tuple, kwargs: dict, n: int) -> torch.Tensor:
    """The rows of each of the ``n`` experts in this call, int64 on the rows' device."""
    rows = site.hidden.get(args, kwargs)
    if site.sizes is None:
        return torch.full((n,), rows.shape[0] // n, dtype=torch.long, device=rows.device)
    return torch.as_tensor(site.sizes.get(args, kwargs), device=rows.device).long()


def check_grouped(site: GroupedSite, args: tuple, kwargs: dict) -> Optional[str]:
    """Why the recorded call is not experts applied block by block, or None. Expert j is moved (its
    weights, then its rows) for the first and last blocks holding a nonzero row; only that block's
    outputs may change, and some must. Not checked on the meta device (no values)."""
    module, n = site.module, site.num_experts
    if any(p.is_meta for p in module.parameters()):
        return None
    forward = functools.partial(type(module).forward, module)
    rows = site.hidden.get(args, kwargs)
    owner = torch.repeat_interleave(torch.arange(n, device=rows.device), block_sizes(site, args, kwargs, n))
    with torch.no_grad():
        base = forward(*args, **kwargs)
        if not torch.is_tensor(base) or base.dim() != 2 or base.shape[0] != rows.shape[0]:
            return f"it returns {type(base).__name__} {list(getattr(base, 'shape', []))}, not one row per input row"
        live = [e for e in range(n) if bool(rows[owner == e].ne(0).any())]
        for j in sorted({live[0], live[-1]}) if live else []:
            block = owner == j
            call_args, call_kwargs = _with_rows(site, args, kwargs, rows + block.unsqueeze(1).to(rows.dtype))
            shifted = forward(*call_args, **call_kwargs)
            for what, moved in (("weights", _weights_moved(module, j, forward, args, kwargs)), ("rows", shifted)):
                changed = (moved != base).any(dim=-1)
                if bool(changed[~block].any()) or not bool(changed[block].any()):
                    return f"moving expert {j}'s {what} moved rows outside its block (or none inside)"
    return None


def _with_rows(site: GroupedSite, args: tuple, kwargs: dict, rows: torch.Tensor) -> tuple[list, dict]:
    call_args, call_kwargs = list(args), dict(kwargs)
    site.hidden.put(call_args, call_kwargs, rows)
    return call_args, call_kwargs


def _weights_moved(module: nn.Module, j: int, forward: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The output with 1 added to expert ``j``'s slice of every parameter, then restored."""
    saved = [(p, p.data[j].clone()) for p in module.parameters()]
    try:
        for p, _ in saved:
            p.data[j] += 1
        return forward(*args, **kwargs)
    finally:
        for p, value in saved:
            p.data[j].copy_(value)


def install_grouped(site: GroupedSite, shard: ExpertShard, stats: ExchangeStats) -> None:
    """The module's own forward, run on the blocks of this rank's experts, every rank's rows of one
    expert together (the counts it is given are now per local expert)."""
    module, n = site.module, shard.num_experts
    original = type(module).forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = site.hidden.get(args, kwargs)
        owner = torch.repeat_interleave(torch.arange(n, device=rows.device), block_sizes(site, args, kwargs, n))

        def compute(received: torch.Tensor, local_ids: torch.Tensor, _ones: torch.Tensor) -> torch.Tensor:
            ids = local_ids.view(-1)
            order = torch.argsort(ids, stable=True)  # by local expert, each rank's rows in rank order
            call_args, call_kwargs = _with_rows(site, args, kwargs, received[order])
            if site.sizes is not None:
                counts = torch.bincount(ids, minlength=shard.local)
                site.sizes.put(call_args, call_kwargs, _as_given(site.sizes.get(args, kwargs), counts))
            return original(self, *call_args, **call_kwargs)[torch.argsort(order)]

        ones = rows.new_ones((rows.shape[0], 1))
        return exchange(
            rows,
            owner.unsqueeze(1),
            ones,
            shard=shard,
            compute=compute,
            stats=stats if self.training else None,
            name=site.name,
        )

    module.forward = types.MethodType(torch.compiler.disable(forward), module)


def _as_given(given: Any, counts: torch.Tensor) -> Any:
    if torch.is_tensor(given):
        return counts.to(given.dtype)
    return type(given)(counts.tolist())
