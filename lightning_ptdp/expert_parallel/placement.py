"""Where each MoE layer's experts live: ``Placement``, the experts each ep rank holds slot by slot
(the fixed n/e contiguous split, or a balanced one with hot experts replicated), how a rank's
(token, expert) rows are routed among an expert's replicas, and ``balance``, the rule that picks a
placement from the routing measured over recent steps."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Placement:
    """``slots[r]``: the experts ep rank r holds, one per slot, distinct, in increasing order; every
    expert is held somewhere, a hot one on several ranks (its replicas: the same weights, its rows
    split among them). A slot's global id is ``r * per_rank + i``."""

    num_experts: int
    slots: tuple[tuple[int, ...], ...]

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> Placement:
        """The fixed split: rank r holds experts [r n/e, (r + 1) n/e)."""
        local = num_experts // ep_size
        return cls(num_experts, tuple(tuple(range(r * local, (r + 1) * local)) for r in range(ep_size)))

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def per_rank(self) -> int:
        return len(self.slots[0])

    @functools.cached_property
    def holders(self) -> tuple[tuple[int, ...], ...]:
        """For each expert, the global ids of the slots holding it, by rank."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for r, experts in enumerate(self.slots):
            for i, j in enumerate(experts):
                out[j].append(r * self.per_rank + i)
        return tuple(tuple(h) for h in out)

    @property
    def replicated(self) -> list[int]:
        """The experts held by more than one rank, in order."""
        return [j for j, h in enumerate(self.holders) if len(h) > 1]

    @functools.cached_property
    def _table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, most replicas] global slot ids, padded with the first; [n] replica counts)."""
        most = max(len(h) for h in self.holders)
        table = torch.tensor([[*h, *(h[0],) * (most - len(h))] for h in self.holders], dtype=torch.long)
        return table, torch.tensor([len(h) for h in self.holders], dtype=torch.long)

    def _table_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``_table`` on ``device``, copied there once (every exchange of a step routes with it)."""
        tables = self.__dict__.setdefault("_tables", {})
        if device not in tables:
            tables[device] = tuple(t.to(device) for t in self._table)
        return tables[device]

    def route(self, experts: torch.Tensor, source: int) -> torch.Tensor:
        """The global slot computing each row of ``experts`` [R] (expert ids) sent from ep rank ``source``:
        an expert's rows go round-robin over its replicas, starting at ``source`` (so every source's
        remainders do not land on the same replica)."""
        table, count = self._table_on(experts.device)
        order = torch.argsort(experts, stable=True)
        per_expert = torch.bincount(experts, minlength=self.num_experts)
        starts = torch.cumsum(per_expert, 0) - per_expert
        position = torch.empty_like(experts)
        position[order] = torch.arange(experts.numel(), device=experts.device) - starts[experts[order]]
        return table[experts, (position + source) % count[experts]]

    def rank_rows(self, per_expert: torch.Tensor) -> torch.Tensor:
        """The rows each ep rank computes when expert j receives ``per_expert[j]`` rows, split evenly
        over its replicas [e] (float)."""
        count = self._table[1]
        share = per_expert.double().cpu() / count
        out = torch.zeros(self.size, dtype=torch.float64)
        for r, experts in enumerate(self.slots):
            out[r] = share[list(experts)].sum()
        return out


def balance(load: torch.Tensor, ep_size: int, per_rank: int) -> Placement:
    """A placement of ``len(load)`` experts over ``ep_size`` ranks of ``per_rank`` slots each that
    keeps the busiest rank's rows low, ``load`` being each expert's routed rows (recent steps).

    DeepSeek's EPLB in two greedy steps: the spare slots (e S - n) go one at a time to the expert of
    largest rows per replica (at most one replica per rank), then the replicas, largest first, each
    to the least loaded rank with a free slot not holding that expert (LPT). Chosen over an exact
    search: it is fast, deterministic (every rank computes the same from the same counts), and LPT
    is within 4/3 of the optimum. A replica no rank can take goes back, and a slot left free takes
    the expert of largest rows per replica not on that rank; then pairwise swaps off the busiest rank."""
    n = load.numel()
    if not n <= ep_size * per_rank <= n * ep_size:
        raise ValueError(f"{ep_size} ranks x {per_rank} slots cannot hold {n} experts once each and at most e times")
    rows = [float(v) for v in load.double().cpu()]
    replicas = [1] * n
    for _ in range(ep_size * per_rank - n):
        j = max((j for j in range(n) if replicas[j] < ep_size), key=lambda j: (rows[j] / replicas[j], -j))
        replicas[j] += 1
    items = sorted(
        ((rows[j] / replicas[j], j) for j in range(n) for _ in range(replicas[j])), key=lambda x: (-x[0], x[1])
    )
    held: list[list[int]] = [[] for _ in range(ep_size)]
    busy = [0.0] * ep_size
    for share, j in items:
        free = [r for r in range(ep_size) if len(held[r]) < per_rank and j not in held[r]]
        if not free:
            replicas[j] -= 1
            continue
        r = min(free, key=lambda r: (busy[r], r))
        held[r].append(j)
        busy[r] += share
    for r in range(ep_size):
        while len(held[r]) < per_rank:
            j = max((j for j in range(n) if j not in held[r]), key=lambda j: (rows[j] / replicas[j], -j))
            held[r].append(j)
            replicas[j] += 1
    _improve(held, rows)
    return Placement(n, tuple(tuple(sorted(h)) for h in held))


def _improve(held: list[list[int]], rows: list[float], passes: int = 32, candidates: int = 8) -> None:
    """Local search after the greedy steps, which can leave the busiest rank above the rest: take
    the move that most lowers the busiest rank's rows, until none does. A move swaps one of its
    replicas with another rank's, or turns one of its replicas of a replicated expert into a replica
    of one of the ``candidates`` experts of most rows per replica (changing both experts' shares)."""
    for _ in range(passes):
        count = [0] * len(rows)
        for h in held:
            for j in h:
                count[j] += 1
        busy = _busy(held, rows, count)
        top = max(range(len(held)), key=lambda r: (busy[r], -r))
        best: tuple[float, Any] = (busy[top], None)
        share = [rows[j] / count[j] for j in range(len(rows))]
        for other in range(len(held)):  # swaps: only the two ranks change
            for a in held[top] if other != top else ():
                for b in held[other]:
                    if b not in held[top] and a not in held[other]:
                        pair = max(busy[top] - share[a] + share[b], busy[other] - share[b] + share[a])
                        rest = max((busy[r] for r in range(len(held)) if r not in (top, other)), default=0.0)
                        if max(pair, rest) < best[0] - 1e-12:
                            best = (max(pair, rest), ("swap", other, a, b))
        hot = sorted(range(len(rows)), key=lambda j: (-share[j], j))[:candidates]
        for a in [a for a in held[top] if count[a] > 1]:  # re-replications: every holder of a and b changes
            for b in [b for b in hot if b not in held[top]]:
                count[a], count[b] = count[a] - 1, count[b] + 1
                trial = [list(h) for h in held]
                trial[top][trial[top].index(a)] = b
                worst = max(_busy(trial, rows, count))
                count[a], count[b] = count[a] + 1, count[b] - 1
                if worst < best[0] - 1e-12:
                    best = (worst, ("replicate", a, b))
        if best[1] is None:
            return
        if best[1][0] == "swap":
            _, other, a, b = best[1]
            held[other][held[other].index(b)] = a
        else:
            _, a, b = best[1]
        held[top][held[top].index(a)] = b


def _busy(held: list[list[int]], rows: list[float], count: list[int]) -> list[float]:
    return [sum(rows[j] / count[j] for j in h) for h in held]


SPARE_SLOT = "n/e+1"
"""``per_rank`` meaning one spare slot a rank, whatever the layer's n."""


def slots_per_rank(num_experts: int, ep_size: int, per_rank: int | str | None) -> int:
    """A layer's slots a rank: n/e (None: the fixed split), n/e + 1 (``SPARE_SLOT``, at most n), or as given."""
    if per_rank == SPARE_SLOT:
        return min(num_experts // ep_size + 1, num_experts)
    return num_experts // ep_size if per_rank is None else int(per_rank)


def initial_placement(num_experts: int, ep_size: int, per_rank: int | str | None = None) -> Placement:
    """The fixed split, n/e contiguous experts a rank; more slots (``per_rank``) hold the experts
    that follow the rank's own (wrapping), until balancing places replicas there."""
    fixed = Placement.contiguous(num_experts, ep_size)
    spare = slots_per_rank(num_experts, ep_size, per_rank) - fixed.per_rank
    if spare <= 0:
        return fixed
    slots = []
    for r, own in enumerate(fixed.slots):
        after = [(own[-1] + 1 + t) % num_experts for t in range(spare)]
        slots.append(tuple(sorted({*own, *after})))
    return Placement(num_experts, tuple(slots))
