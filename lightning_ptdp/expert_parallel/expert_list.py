"""Mixture-of-experts layers whose experts are a ModuleList of ordinary MLPs (litgpt's LLaMAMoE,
plain PyTorch MoE code): the layer calls each expert on the rows routed to it, one at a time.

Under expert parallelism a rank keeps its n/e experts; the others become stubs without
parameters. The layer's forward then runs twice: first to collect every expert call's rows
(each call answers zeros), then, after one all-to-all exchange has computed every call on the rank
holding its expert, again with each call answering its computed rows, in the same order. The
router and the combination run twice (cheap); the experts once, on every rank's rows together."""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.expert_parallel.discovery import ExpertListSite
from lightning_ptdp.expert_parallel.exchange import AllToAll, EPGroup, ExchangeStats, ExpertShard


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


def install_expert_list(site: ExpertListSite, ep: EPGroup, stats: ExchangeStats) -> tuple[ExpertShard, list[str]]:
    """Keep this rank's experts, stub the others, make the layer's forward exchange its calls.
    Returns what this rank kept and the kept experts' parameter names, relative to the layer."""
    module, n = site.module, site.num_experts
    local = n // ep.size
    first = ep.rank * local
    experts: nn.ModuleList = getattr(module, site.experts_attr)
    current: dict[str, Optional[_Calls]] = {"calls": None}

    def answer(index: int, rows: torch.Tensor) -> torch.Tensor:
        return current["calls"].answer(index, rows)

    def own_forward(self: nn.Module, rows: torch.Tensor, index: int = 0) -> torch.Tensor:
        if current["calls"] is None:  # called by the exchange, through __call__ (hooks: FSDP's, recompute's)
            return type(self).forward(self, rows)
        return answer(index, rows)

    own = [experts[i] for i in range(first, first + local)]
    for index in range(n):
        if first <= index < first + local:
            experts[index].forward = types.MethodType(
                lambda self, rows, i=index: own_forward(self, rows, i), experts[index]
            )
        else:
            experts[index] = _Stub(index, answer)
    original = type(module).forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls = current["calls"] = _Calls()
        state = torch.random.get_rng_state()
        try:
            original(self, *args, **kwargs)  # first pass: collect the rows of every expert call
            current["calls"] = None  # the exchange calls this rank's experts for real
            calls.answers = _exchange(calls.calls, own, first, n, ep, stats if self.training else None, site.name)
            current["calls"], calls.collecting = calls, False
            torch.random.set_rng_state(state)
            return original(self, *args, **kwargs)
        finally:
            current["calls"] = None

    module.forward = types.MethodType(torch.compiler.disable(forward), module)  # as stacked experts' (apply.py)
    shard = ExpertShard(num_experts=n, local=local, first=first, ep=ep)
    module.__dict__["_ptdp_expert_list"] = (site.experts_attr, shard)
    return shard, [
        f"{site.experts_attr}.{i}.{p}" for i in range(first, first + local) for p, _ in experts[i].named_parameters()
    ]


def _exchange(
    calls: list[tuple[int, torch.Tensor]],
    own: list[nn.Module],
    first: int,
    n: int,
    ep: EPGroup,
    stats: Optional[ExchangeStats],
    name: str,
) -> list[torch.Tensor]:
    """Every call's rows computed by its expert's rank, returned in call order."""
    local = n // ep.size
    order = sorted(range(len(calls)), key=lambda c: calls[c][0])  # by expert, so by the rank holding it
    rows = torch.cat([calls[c][1] for c in order])
    per_expert = torch.zeros(n, dtype=torch.int64)
    for index, sent in calls:
        per_expert[index] += sent.shape[0]
    device = rows.device
    counts = per_expert.to(device)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)
    received_per_expert = received.cpu().view(ep.size, local)
    send = per_expert.view(ep.size, local).sum(1).tolist()
    receive = received_per_expert.sum(1).tolist()
    all_to_all = stats.timed_all_to_all if stats is not None else AllToAll.apply
    arrived = all_to_all(rows, receive, send, ep.group)  # by source rank, then by expert
    by_source = arrived.split(receive)
    pieces = [part.split(received_per_expert[s].tolist()) for s, part in enumerate(by_source)]
    computed = []
    for j, expert in enumerate(own):  # each of this rank's experts once, on every source's rows
        mine = torch.cat([pieces[s][j] for s in range(ep.size)])
        computed.append(expert(mine).split([pieces[s][j].shape[0] for s in range(ep.size)]))
    back_rows = torch.cat([computed[j][s] for s in range(ep.size) for j in range(local)])
    back = all_to_all(back_rows, send, receive, ep.group)  # by expert, in ``order``
    if stats is not None:
        stats.record(name, per_expert, send, receive, (rows.shape[1], back.shape[1]), rows.element_size(), ep)
    answers: list[Optional[torch.Tensor]] = [None] * len(calls)
    for c, part in zip(order, back.split([calls[c][1].shape[0] for c in order])):
        answers[c] = part
    return answers  # type: ignore[return-value]
