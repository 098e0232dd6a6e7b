"""Expert parallelism: each MoE layer's experts split over the ep group, n_experts / e whole experts
per rank, tokens exchanged all-to-all (exchange.py). Found from the model (discovery.py); the rest
of the model keeps its layout. Also the full (unsplit) tensors of the experts, for checkpoints."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.core.comm import detached_cpu, divisors
from lightning_ptdp.core.plans import resolve_plan
from lightning_ptdp.expert_parallel.discovery import (
    PLAN_HINT,
    ExpertCalls,
    ExpertDiscoveryError,
    ExpertsSite,
    ep_plan_cross_check,
    find_experts,
)
from lightning_ptdp.expert_parallel.exchange import EPGroup, ExchangeStats, ExpertShard, exchange
from lightning_ptdp.expert_parallel.expert_list import install_expert_list
from lightning_ptdp.expert_parallel.grouped import GroupedSite, install_grouped
from lightning_ptdp.expert_parallel.placement import initial_placement

log = logging.getLogger(__name__)


@dataclass
class EPReport:
    """What ``apply_expert_parallel`` did: the split experts modules by name, and the exchange stats."""

    sites: dict[str, ExpertShard] = field(default_factory=dict)
    expert_params: list[str] = field(default_factory=list)
    """Qualified names of the split parameters: their gradients average over the expert-dp group."""
    expert_modules: list[nn.Module] = field(default_factory=list)
    """The modules holding them (stacked experts; each kept expert of a ModuleList): ZeRO's units."""
    stats: ExchangeStats = field(default_factory=ExchangeStats)
    plan_check: Optional[str] = None
    """transformers' ``base_model_ep_plan`` against what discovery found (logged), when the model has one."""

    def summary(self) -> str:
        shards = list(self.sites.values())
        if not shards:
            return "expert parallel: no MoE layer"
        first = shards[0]
        return (
            f"expert parallel: {len(shards)} MoE layers, {first.local} of {first.num_experts} experts per rank "
            f"over {first.ep.size} ranks"
        )


def apply_expert_parallel(
    model: nn.Module,
    ep: EPGroup,
    probe: Callable[[], Any] | ExpertCalls,
    plan: Optional[dict[str, str]] = None,
    capacity_factor: Optional[float] = None,
    slots: Optional[int | str] = None,
) -> EPReport:
    """Split every MoE layer's experts over ``ep``: found from the setup census's ``ExpertCalls``
    (or one probe forward; every rank still holds all experts), then each rank keeps its n/e and its
    experts' forward exchanges tokens. ``plan``: ep_plan, {module path or glob: style}, deciding
    where it names a module (the census's recorder was built with it). ``capacity_factor``: the
    exchange drops the rows past each expert's capacity (exchange.py ``capacity``). ``slots``: the
    experts a rank holds when balancing (>= n/e, or ``SPARE_SLOT``: n/e + 1; the spare slots take
    replicas: rebalance.py)."""
    if isinstance(probe, ExpertCalls):
        sites, lists = probe.sites()
    else:
        sites, lists = find_experts(model, probe, resolve_plan(model, plan, "ep_plan") if plan else None)
    every = [*sites, *lists]
    if not every:
        raise ExpertDiscoveryError(
            f"expert_parallel_size={ep.size}, but the model has no mixture-of-experts layer that can be split: no "
            "module holds its experts' weights stacked as [n_experts, ...] tensors, and none holds a ModuleList of "
            "experts beside a router Linear with one output per expert. Use expert_parallel_size=1" + PLAN_HINT
        )
    uneven = [s for s in every if s.num_experts % ep.size]
    if uneven:
        fits = sorted(set.intersection(*(set(divisors(s.num_experts)) for s in every)))
        raise ExpertDiscoveryError(
            f"expert_parallel_size={ep.size} does not divide the {uneven[0].num_experts} experts of "
            f"'{uneven[0].name}'; each rank holds whole experts: choose expert_parallel_size in {fits} (dividing the "
            "data-parallel size too)"
        )
    few = [s for s in every if isinstance(slots, int) and not s.num_experts // ep.size <= slots <= s.num_experts]
    if few:
        n = few[0].num_experts
        raise ExpertDiscoveryError(
            f"expert_balance experts_per_rank={slots}: the {n} experts of '{few[0].name}' over "
            f"expert_parallel_size={ep.size} need at least n/e = {n // ep.size} per rank (each expert held "
            f"somewhere) and at most n = {n}; choose experts_per_rank in [{n // ep.size}, {n}] (n/e + 1 leaves one "
            "slot a rank for a hot expert's replica)"
        )
    not_per_token = [s for s in every if isinstance(s, GroupedSite) or s in lists]
    if capacity_factor is not None and not_per_token:
        raise ExpertDiscoveryError(
            f"expert_capacity_factor={capacity_factor}: the experts of '{not_per_token[0].name}' are called on rows "
            "already grouped by expert (a block or a call per expert), not with each token's top-k experts and "
            "weights, so which rows to drop (the lowest weights) is not known; leave expert_capacity_factor unset"
        )
    report = EPReport()
    for site in sites:
        shard = _split(site, ep, slots)
        if isinstance(site, GroupedSite):
            install_grouped(site, shard, report.stats)
        else:
            _install(site, shard, report.stats, capacity_factor)
        report.sites[site.name] = shard
        report.expert_params += [f"{site.name}.{n}" if site.name else n for n, _ in site.module.named_parameters()]
        report.expert_modules += [m for m in site.module.modules() if "_ptdp_experts" in m.__dict__]
    for site in lists:
        shard, kept = install_expert_list(site, ep, report.stats, slots)
        report.sites[site.name] = shard
        report.expert_params += [f"{site.name}.{n}" if site.name else n for n in kept]
        report.expert_modules += site.module.__dict__["_ptdp_expert_slots"][0]
    log.info(report.summary())
    checked = ep_plan_cross_check(model, [*(s.name for s in sites), *(s.name for s in lists)])
    if checked:
        log.info(checked)
    report.plan_check = checked
    return report


def _split(site: ExpertsSite, ep: EPGroup, slots: Optional[int | str]) -> ExpertShard:
    """Each module holding the experts' parameters (the site, or its children: torchtitan's
    GroupedExperts) keeps the rows of its rank's experts under the fixed split (n/e contiguous; with
    ``slots`` > n/e, the next experts fill the spare slots until balancing places replicas there)
    and records the shard (checkpoints read it)."""
    n = site.num_experts
    shard = ExpertShard(num_experts=n, ep=ep, placement=initial_placement(n, ep.size, slots))
    mine = list(shard.mine)
    for owner in site.module.modules():
        own = list(owner.named_parameters(recurse=False))
        for name, param in own:
            kept = param.detach()[mine].clone()
            setattr(owner, name, nn.Parameter(kept, requires_grad=param.requires_grad))
        for attr, value in list(vars(owner).items()):  # n_experts the forward reads (one_hot, histc): now its own
            if isinstance(value, int) and not isinstance(value, bool) and value == n and "expert" in attr:
                setattr(owner, attr, shard.local)
        if own:
            owner.__dict__["_ptdp_experts"] = shard
    return shard


def _install(site: ExpertsSite, shard: ExpertShard, stats: ExchangeStats, capacity_factor: Optional[float]) -> None:
    """The module's own forward, run on the rows this rank's experts received."""
    module = site.module
    original = type(module).forward

    lead = (1,) * (site.hidden_dims - 2)  # [B, L, H] routing (torchtitan): the rows as one sequence
    k_attributes = _k_attributes(module, site.top_k)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        def compute(rows: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
            call_args, call_kwargs = list(args), dict(kwargs)
            for slot, value in ((site.hidden, rows), (site.indices, ids), (site.weights, ones)):
                slot.put(call_args, call_kwargs, value.view(*lead, *value.shape))
            if site.counts is not None:  # tokens per local expert, of the rows received
                site.counts.put(call_args, call_kwargs, torch.bincount(ids.view(-1), minlength=shard.local))
            for owner, attr in k_attributes:  # each received row is one (token, expert) pair: k = 1
                setattr(owner, attr, 1)
            try:
                return original(self, *call_args, **call_kwargs).reshape(rows.shape)
            finally:
                for owner, attr in k_attributes:
                    setattr(owner, attr, site.top_k)

        hidden = site.hidden.get(args, kwargs)
        k = site.indices.get(args, kwargs).shape[-1]
        return exchange(
            hidden.reshape(-1, hidden.shape[-1]),
            site.indices.get(args, kwargs).reshape(-1, k),
            site.weights.get(args, kwargs).reshape(-1, k),
            shard=shard,
            compute=compute,
            stats=stats if self.training else None,
            name=site.name,
            capacity_factor=capacity_factor if self.training else None,
        ).view(hidden.shape)

    # the exchange's split sizes are values (counts read back): under compile= it runs eagerly,
    # one break in the compiled block, its rows feeding the graph again after it
    module.forward = types.MethodType(torch.compiler.disable(forward), module)


K_NAMES = ("top_k", "topk", "num_experts_per_tok", "experts_per_token")


def _k_attributes(module: nn.Module, k: int) -> list[tuple[Any, str]]:
    """Where the experts' forward reads k from an attribute rather than the routing's shape (torchtitan's
    token dispatcher: ``top_k``): the module, its submodules and the plain objects they hold."""
    holders: list[Any] = []
    for sub in module.modules():
        holders.append(sub)
        holders += [
            v for v in vars(sub).values() if hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor))
        ]
    return [
        (h, name) for h in holders for name in K_NAMES if getattr(h, name, None) == k and not callable(getattr(h, name))
    ]


def has_split_experts(model: nn.Module) -> bool:
    """Whether expert parallelism split some of ``model``'s experts (checkpoints gather on every rank)."""
    return any("_ptdp_experts" in m.__dict__ or "_ptdp_expert_list" in m.__dict__ for m in model.modules())


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """The split experts modules of ``model`` by qualified name."""
    return {name: m.__dict__["_ptdp_experts"] for name, m in model.named_modules() if "_ptdp_experts" in m.__dict__}


def _split_names(model: nn.Module, names: Any) -> dict[str, ExpertShard]:
    """The names among ``names`` that are parameters of a split experts module, with its shard."""
    shards = expert_shards(model)
    out = {}
    for name in names:
        prefix, _, attr = name.rpartition(".")
        if prefix in shards and "." not in attr:
            out[name] = shards[prefix]
    return out


def _list_layers(model: nn.Module) -> dict[str, tuple[str, ExpertShard]]:
    """ModuleList MoE layers by qualified name: (their experts attribute, what this rank kept)."""
    return {n: m.__dict__["_ptdp_expert_list"] for n, m in model.named_modules() if "_ptdp_expert_list" in m.__dict__}


def _list_expert(model: nn.Module, names: Any) -> dict[str, tuple[int, tuple[str, ExpertShard]]]:
    """The names among ``names`` under a ModuleList MoE layer's experts: (expert index, its layer)."""
    out = {}
    for prefix, layer in _list_layers(model).items():
        head = f"{prefix}.{layer[0]}." if prefix else f"{layer[0]}."
        for name in names:
            if name.startswith(head) and name[len(head) :].split(".")[0].isdigit():
                out[name] = (int(name[len(head) :].split(".")[0]), layer)
    return out


def _gather_lists(model: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` with the other ranks' experts of every ModuleList MoE layer added (each rank
    holds only its own experts' keys): one object all-gather per layer, over its ep group."""
    out = dict(entries)
    found = _list_expert(model, entries)
    for prefix, layer in sorted(_list_layers(model).items()):
        mine = {name: entries[name] for name, (_, owner) in found.items() if owner is layer}
        ep = layer[1].ep
        parts: list[Any] = [None] * ep.size
        dist.all_gather_object(parts, detached_cpu(mine), group=ep.group)
        for part in parts:
            out.update({name: value for name, value in part.items() if name not in mine})
    return out


def _gather(piece: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """Every rank's slots [e S, ...] gathered over the ep group, then each expert once, in order (a
    replicated expert from its first holder)."""
    piece = piece.detach().contiguous()
    parts = [torch.empty_like(piece) for _ in range(shard.ep.size)]
    dist.all_gather(parts, piece, group=shard.ep.group)
    first = [holders[0] for holders in shard.placement.holders]
    return torch.cat(parts)[first]


def gather_experts(model: nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (parameter name -> this rank's tensor, or gradient) with every split expert
    tensor whole again, experts in order: a collective over each ep group, names in sorted order."""
    out = dict(tensors)
    for name, shard in sorted(_split_names(model, tensors).items()):
        out[name] = _gather(tensors[name], shard)
    return _gather_lists(model, out)


def gather_expert_optimizer_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name with the split experts' state tensors whole."""
    if "state" not in state:  # a rank torch's rank-0-only gather left empty (HSDP's other ranks)
        return state
    per_param = dict(state["state"])
    for name, shard in sorted(_split_names(model, per_param).items()):
        per_param[name] = {
            key: _gather(value, shard)
            if torch.is_tensor(value) and value.dim() and value.shape[0] == shard.local
            else value
            for key, value in per_param[name].items()
        }
    return {**state, "state": _gather_lists(model, per_param)}


def cut_experts(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A whole-model state (weights, or an optimizer's per-parameter entries) with every split
    expert tensor cut to this rank's experts."""

    def cut(value: Any, shard: ExpertShard) -> Any:
        if isinstance(value, dict):
            return {key: cut(v, shard) for key, v in value.items()}
        if torch.is_tensor(value) and value.dim() and value.shape[0] == shard.num_experts:
            return value[list(shard.mine)]
        return value

    out = dict(state)
    for name, shard in _split_names(model, state).items():
        out[name] = cut(state[name], shard)
    for name, (index, (_, shard)) in _list_expert(model, state).items():
        if index not in shard.mine:
            del out[name]  # another rank's expert
    return out
