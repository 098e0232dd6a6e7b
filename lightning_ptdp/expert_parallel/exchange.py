"""The all-to-all token exchange of expert parallelism: each (token, chosen expert) row goes to the
rank holding that expert, is computed there, and comes back (Megatron's dispatch and combine)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ptdp.expert_parallel.placement import Placement


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits, differentiable: its backward is the same
    exchange with the splits swapped. (Our own: torch.distributed.nn's is deprecated and the
    functional collectives' autograd form is private.)"""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass(frozen=True)
class EPGroup:
    """The ranks that split one MoE layer's experts between them (carved out of the dp ranks)."""

    group: Any
    size: int
    rank: int


@dataclass
class ExpertShard:
    """What one experts module holds after the split: the experts of ``placement.slots[ep.rank]``, one
    per slot, of ``num_experts``. The placement changes when balancing moves experts (rebalance.py)."""

    num_experts: int
    ep: EPGroup
    placement: Placement

    @property
    def local(self) -> int:
        """Slots this rank holds (n / e under the fixed split)."""
        return self.placement.per_rank

    @property
    def mine(self) -> tuple[int, ...]:
        """The experts this rank holds, slot by slot."""
        return self.placement.slots[self.ep.rank]


@dataclass
class ExchangeStats:
    """What this rank's exchanges moved since the last ``reset``: the rows it routed to each expert,
    by layer, and the bytes it sent to other ranks in the forward (dispatch and combine; the
    backward sends as much again)."""

    tokens_per_expert: dict[str, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_to: dict[str, torch.Tensor] = field(default_factory=dict)
    """By layer: the bytes this rank sent each ep rank in the forward (int64 [e]; its own entry 0)."""
    ep_rank: int = 0
    ep_size: int = 1
    spans: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each forward exchange (dispatch, combine), ``time.perf_counter`` seconds."""
    rows_computed: dict[str, int] = field(default_factory=dict)
    """By layer: the (token, expert) rows this rank's experts computed."""

    def reset(self) -> None:
        self.tokens_per_expert, self.bytes_sent, self.bytes_to, self.spans = {}, 0, {}, []
        self.rows_computed = {}

    def record(
        self, name: str, per_expert: torch.Tensor, send: list[int], receive: list[int], widths: tuple, size: int, ep
    ) -> None:
        """One exchange of layer ``name``: the rows routed to each expert, and the bytes sent to each ep
        rank: the rows routed to its experts (``widths[0]`` wide), then the rows its tokens sent here,
        computed (``widths[1]``), ``size`` bytes an element; rows staying on this rank cross no link."""
        self.tokens_per_expert[name] = self.tokens_per_expert.get(name, 0) + per_expert.detach().cpu()
        sent = (torch.tensor(send) * widths[0] + torch.tensor(receive) * widths[1]) * size
        sent[ep.rank] = 0
        self.bytes_to[name] = self.bytes_to.get(name, 0) + sent
        self.bytes_sent += int(sent.sum())
        self.rows_computed[name] = self.rows_computed.get(name, 0) + sum(receive)
        self.ep_rank, self.ep_size = ep.rank, ep.size

    def timed_all_to_all(
        self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        start = time.perf_counter()
        out = AllToAll.apply(rows, out_splits, in_splits, group)
        self.spans.append((start, time.perf_counter()))
        return out


def exchange(
    hidden: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    *,
    shard: ExpertShard,
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    stats: ExchangeStats | None = None,
    name: str = "",
    capacity_factor: float | None = None,
) -> torch.Tensor:
    """One MoE layer's experts over the ep group. ``hidden`` [N, H], ``indices`` [N, k] global
    expert ids, ``weights`` [N, k]. ``compute(rows, slots [R, 1], ones [R, 1])`` runs this rank's
    experts (by slot) on the rows it received. Returns [N, H'] (H' the experts' output width): each
    token's weighted sum over its k experts, as the experts' own forward computes it in one process.
    A replicated expert's rows are split among its replicas (``Placement.route``).
    ``capacity_factor``: each expert takes at most ``capacity(...)`` of this rank's (token, expert)
    rows, those of the largest routing weights; the rest are dropped (they add nothing)."""
    ep, placement = shard.ep, shard.placement
    n, local = placement.num_experts, placement.per_rank
    k = indices.shape[1]
    flat = indices.reshape(-1)
    kept = (
        None
        if capacity_factor is None
        else within_capacity(flat, weights.reshape(-1), n, capacity(flat.numel(), n, capacity_factor))
    )
    chosen = flat if kept is None else flat[kept]
    slot = placement.route(chosen, ep.rank)  # the global slot computing each row
    order = torch.argsort(slot, stable=True)  # rows grouped by slot, so by the rank holding it
    if kept is not None:
        order = kept[order]
    token = order // k
    per_expert = torch.bincount(chosen, minlength=n)
    per_slot = torch.bincount(slot, minlength=placement.size * local)
    received_per_slot = torch.empty_like(per_slot)
    dist.all_to_all_single(received_per_slot, per_slot, group=ep.group)  # my slots' counts from each rank
    if per_slot.is_meta:  # a dry run holds no counts: the router is taken as balanced (a hot expert's rank gets more)
        send = receive = [len(part) for part in torch.arange(chosen.numel()).tensor_split(ep.size)]
        # each row goes to one of this rank's experts: a top-1 choice among them, which a dry run reads as balanced
        local_ids = torch.empty(sum(receive), local, device="meta").topk(1).indices.view(-1)
    else:
        send = per_slot.view(ep.size, local).sum(1).tolist()
        received = received_per_slot.view(ep.size, local)
        receive = received.sum(1).tolist()
        local_ids = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(ep.size), received.view(-1))
    all_to_all = stats.timed_all_to_all if stats is not None else AllToAll.apply
    rows = all_to_all(hidden[token], receive, send, ep.group)  # [R, H]
    ones = torch.ones((rows.shape[0], 1), dtype=weights.dtype, device=weights.device)
    computed = compute(rows, local_ids.unsqueeze(1), ones)  # [R, H]
    if rows.requires_grad and not computed.requires_grad:  # no rows came (experts skip empty calls): both
        computed = computed + rows.sum().to(computed.dtype) * 0  # exchanges' backwards still run on this rank
    back = all_to_all(computed, send, receive, ep.group)  # [N * k, H], in ``order``
    if stats is not None:
        stats.record(name, per_expert, send, receive, (hidden.shape[1], back.shape[1]), hidden.element_size(), ep)
    weighted = back * weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
    out = hidden.new_zeros((hidden.shape[0], back.shape[1]))  # the experts' width (rows grouped by expert: any)
    return out.index_add_(0, token, weighted.to(hidden.dtype))


def capacity(rows: int, num_experts: int, factor: float) -> int:
    """(token, expert) rows one expert takes from one rank: ``factor`` times an even share (Switch
    Transformer's and Megatron's expert capacity, on this rank's tokens)."""
    return math.ceil(factor * rows / num_experts)


def within_capacity(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, limit: int) -> torch.Tensor:
    """Indices of the (token, expert) rows kept, grouped by expert: per expert the ``limit`` rows of the
    largest weights (Megatron's "probs" drop policy; ties by position)."""
    by_weight = torch.argsort(-weights, stable=True)
    by_expert = by_weight[torch.argsort(experts[by_weight], stable=True)]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(experts.numel(), device=experts.device) - starts[experts[by_expert]]
    return by_expert[position < limit]
