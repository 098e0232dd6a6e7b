"""Mixture-of-experts layers whose experts are a ModuleList of ordinary MLPs (litgpt's LLaMAMoE,
plain PyTorch MoE code): the layer calls each expert on the rows routed to it, one at a time.

Under expert parallelism a rank keeps its experts (one module per slot); the others become stubs without
parameters. The layer's forward then runs twice: first to collect every expert call's rows
(each call answers zeros), then, after one all-to-all exchange has computed every call on the rank
holding its expert, again with each call answering its computed rows, in the same order. The
router and the combination run twice (cheap); the experts once, on every rank's rows together."""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_ptdp.expert_parallel.discovery import ExpertListSite
from lightning_ptdp.expert_parallel.exchange import EPGroup, ExchangeStats, ExpertShard, exchange
from lightning_ptdp.expert_parallel.placement import initial_placement


class _Stub(nn.Module):
    """An expert another rank holds: no parameters; answers through the layer's exchange."""

    def __init__(self, index: int, answer: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.index = index
        self.__dict__["answer"] = answer

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.answer(self.index, rows)


class _Calls:
    """One forward of the layer: collect the expert calls, then answer them from the exchange."""

    def __init__(self) -> None:
        self.collecting = True
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.answers: list[torch.Tensor] = []
        self.position = 0

    def answer(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        if self.collecting:
            self.calls.append((index, rows))
            return torch.zeros_like(rows)
        expected, sent = self.calls[self.position]
        if expected != index or sent.shape != rows.shape:
            raise RuntimeError(
                f"the MoE layer called expert {index} on {tuple(rows.shape)} rows where its first pass called expert "
                f"{expected} on {tuple(sent.shape)}: expert parallelism runs the layer twice and needs the same calls "
                "(no randomness in the routing beyond torch's generator)"
            )
        self.position += 1
        return self.answers[self.position - 1]


def install_expert_list(
    site: ExpertListSite, ep: EPGroup, stats: ExchangeStats, slots: Optional[int | str] = None
) -> tuple[ExpertShard, list[str]]:
    """Keep this rank's experts (one module per slot), stub the others, make the layer's forward
    exchange its calls. Returns what this rank kept and the kept experts' parameter names, relative
    to the layer."""
    module, n = site.module, site.num_experts
    experts: nn.ModuleList = getattr(module, site.experts_attr)
    shard = ExpertShard(num_experts=n, ep=ep, placement=initial_placement(n, ep.size, slots))
    current: dict[str, Optional[_Calls]] = {"calls": None}

    def answer(index: int, rows: torch.Tensor) -> torch.Tensor:
        return current["calls"].answer(index, rows)

    def own_forward(self: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        if current["calls"] is None:  # called by the exchange, through __call__ (hooks: FSDP's, recompute's)
            return type(self).forward(self, rows)
        return answer(self.__dict__["_ptdp_expert_index"], rows)

    own = [experts[j] for j in shard.mine]  # slot i's module: it takes another expert's weights when moved
    for expert in own:
        expert.forward = types.MethodType(own_forward, expert)
    place_expert_list(experts, own, shard.mine, answer)
    original = type(module).forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls = current["calls"] = _Calls()
        state = torch.random.get_rng_state()
        try:
            original(self, *args, **kwargs)  # first pass: collect the rows of every expert call
            current["calls"] = None  # the exchange calls this rank's experts for real
            calls.answers = _exchange(calls.calls, own, shard, stats if self.training else None, site.name)
            current["calls"], calls.collecting = calls, False
            torch.random.set_rng_state(state)
            return original(self, *args, **kwargs)
        finally:
            current["calls"] = None

    module.forward = types.MethodType(torch.compiler.disable(forward), module)  # as stacked experts' (apply.py)
    module.__dict__["_ptdp_expert_list"] = (site.experts_attr, shard)
    module.__dict__["_ptdp_expert_slots"] = (own, answer)
    return shard, [f"{site.experts_attr}.{j}.{p}" for j in shard.mine for p, _ in experts[j].named_parameters()]


def place_expert_list(experts: nn.ModuleList, own: list[nn.Module], mine: tuple[int, ...], answer: Callable) -> None:
    """``experts[j]`` is slot i's module for ``j = mine[i]``, a stub elsewhere."""
    for j in range(len(experts)):
        experts[j] = _Stub(j, answer)
    for j, expert in zip(mine, own):
        expert.__dict__["_ptdp_expert_index"] = j
        experts[j] = expert


def _exchange(
    calls: list[tuple[int, torch.Tensor]],
    own: list[nn.Module],
    shard: ExpertShard,
    stats: Optional[ExchangeStats],
    name: str,
) -> list[torch.Tensor]:
    """Every call's rows computed by a rank holding its expert, returned in call order: the calls'
    rows as one batch routed to one expert each (exchange.py), each slot's module run once on
    every rank's rows for it."""
    rows = torch.cat([sent for _, sent in calls])
    index = torch.tensor([j for j, sent in calls for _ in range(sent.shape[0])], dtype=torch.long, device=rows.device)

    def compute(received: torch.Tensor, slots: torch.Tensor, _ones: torch.Tensor) -> torch.Tensor:
        slots = slots.view(-1)
        out: Optional[torch.Tensor] = None
        for i, expert in enumerate(own):  # each slot's expert once, on every source's rows
            where = (slots == i).nonzero().view(-1)
            computed = expert(received[where])
            if out is None:
                out = computed.new_zeros((received.shape[0], *computed.shape[1:]))
            out = out.index_copy(0, where, computed)
        return out

    ones = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
    back = exchange(rows, index.unsqueeze(1), ones, shard=shard, compute=compute, stats=stats, name=name)
    return list(back.split([sent.shape[0] for _, sent in calls]))
