"""Finding a model's mixture-of-experts layers from the model itself, with no plan, in either
layout: a module holding every expert's weights stacked ``[n_experts, ...]`` whose forward takes
top-k routing per token (hidden [..., H], chosen experts [..., k], weights [..., k]: transformers'
Mixtral, Qwen2/3-MoE, OLMoE experts; torchtitan's RoutedExperts around its GroupedExperts), or a
layer with a router Linear and a ModuleList of expert MLPs, each called on its rows (litgpt's
LLaMAMoE). One probe forward records how each is called; of nested candidates the innermost one
called with top-k routing is the experts module, else one called on rows grouped by expert (grouped.py)."""

from __future__ import annotations

import fnmatch
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from lightning_ptdp.core.census import record_alone
from lightning_ptdp.expert_parallel.calls import ArgSlot, ExpertDiscoveryError, describe, slots
from lightning_ptdp.expert_parallel.grouped import GroupedSite, check_grouped, classify_grouped

EP_STYLES = ("experts", "expert_list", "dense")
PLAN_HINT = (
    "; or name the MoE modules yourself: ep_plan={'<path or glob>': 'experts'} (a module whose parameters "
    "are the experts stacked [n_experts, ...], called with top-k routing), 'expert_list' (a layer holding a "
    "ModuleList of experts) or 'dense' (never split)"
)
log = logging.getLogger(__name__)
_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "lightning_ptdp" + os.sep)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _call_site() -> str:
    """The user's source line making the current call (the first frame outside torch and ptdp)."""
    frame = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename for part in _LIBRARIES):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "an unknown line"


def check_ep_plan(plan: object, expert_parallel_size: int) -> Optional[dict[str, str]]:
    """``ep_plan`` as given, checked: module paths or globs to one of ``EP_STYLES``."""
    if plan is None:
        return None
    if not isinstance(plan, dict) or not all(isinstance(k, str) and v in EP_STYLES for k, v in plan.items()):
        raise ValueError(
            f"ep_plan={plan!r} must be a dict of module path (or glob) -> one of {', '.join(map(repr, EP_STYLES))}, "
            "e.g. {'model.layers.*.mlp.experts': 'experts'}"
        )
    if expert_parallel_size == 1:
        raise ValueError("ep_plan names modules for expert parallelism: set expert_parallel_size > 1, or drop ep_plan")
    return dict(plan)


@dataclass(frozen=True)
class ExpertsSite:
    """One experts module and how its forward takes the routing."""

    name: str
    module: nn.Module
    num_experts: int
    top_k: int
    hidden: ArgSlot
    indices: ArgSlot
    weights: ArgSlot
    hidden_dims: int = 2
    """The hidden argument's dims ([N, H], or [B, L, H] with [B, L, k] routing)."""
    counts: Optional[ArgSlot] = None
    """Tokens per expert, [n_experts] integers, when the forward takes them too (torchtitan)."""


def stacked_experts(module: nn.Module, *, need_3d: bool = True) -> Optional[int]:
    """``n_experts`` when ``module`` holds experts stacked: its parameters (its children's too; at
    least one 3D unless named by ep_plan) all lead with the same size >= 2; else None."""
    if any(_torch_layer(m) for m in module.modules()):  # torch defines what its layers' dims mean (a depthwise
        return None  # conv's [C, 1, k] leads with channels): experts are stacked by the model's own modules
    params = list(module.parameters())
    leading = {p.shape[0] for p in params if p.dim() >= 1}
    if not params or len(leading) != 1 or (need_3d and not any(p.dim() == 3 for p in params)) or min(leading) < 2:
        return None
    return leading.pop()


def _torch_layer(module: nn.Module) -> bool:
    """A layer of torch.nn with a forward of its own and parameters of its own (Conv1d, Linear, Embedding,
    norms...): not nn.Module itself nor a container such as ParameterList."""
    cls = type(module)
    return (
        cls.__module__.startswith("torch.nn.modules.")
        and cls.forward is not nn.Module.forward
        and any(True for _ in module.parameters(False))
    )


def classify_call(name: str, num_experts: int, args: tuple, kwargs: dict, site: str = "") -> ExpertsSite:
    """The routing convention of one recorded call (made at source line ``site``), or a clear refusal."""
    where = f" at {site}" if site else ""
    tensors = [(slot, v) for slot, v in slots(args, kwargs) if torch.is_tensor(v)]
    hidden = next(((s, v) for s, v in tensors if v.is_floating_point() and v.dim() >= 2), None)
    lead = tuple(hidden[1].shape[:-1]) if hidden else None
    indices = next(
        ((s, v) for s, v in tensors if not v.is_floating_point() and v.dim() >= 2 and tuple(v.shape[:-1]) == lead),
        None,
    )
    if hidden is None or indices is None:
        raise ExpertDiscoveryError(
            f"experts module '{name}' ({num_experts} experts stacked) was called{where} with "
            f"({describe(args, kwargs)}); expert parallelism needs top-k routing per token: hidden rows [N, H], "
            "chosen experts [N, k] and their weights [N, k] (as transformers' Mixtral experts take them), or rows "
            "grouped by expert [M, H] with one count per expert (JetMoE's) or n_experts equal blocks (Llama 4's). "
            "Routing by capacity is not supported yet; pass expert_parallel_size=1 for this "
            f"model, or ep_plan={{'{name}': 'dense'}} if these are not experts" + PLAN_HINT
        )
    k = indices[1].shape[-1]
    shape = tuple(indices[1].shape)
    weights = next(((s, v) for s, v in tensors if v.is_floating_point() and tuple(v.shape) == shape), None)
    if weights is None or not 1 <= k <= num_experts:
        raise ExpertDiscoveryError(
            f"experts module '{name}' was called{where} with ({describe(args, kwargs)}): chosen experts "
            f"{list(shape)} need weights of the same shape and 1 <= k={k} <= {num_experts} (top-k routing per token)"
        )
    counts = next(
        (s for s, v in tensors if not v.is_floating_point() and tuple(v.shape) == (num_experts,)), None
    )  # tokens per expert beside the routing (torchtitan): recomputed for the rows each rank receives
    return ExpertsSite(name, None, num_experts, k, hidden[0], indices[0], weights[0], hidden[1].dim(), counts)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ExpertListSite:
    """An MoE layer (``name``) holding its experts as ``module.<experts_attr>``, a ModuleList."""

    name: str
    module: nn.Module
    experts_attr: str
    num_experts: int


def router_linears(layer: nn.Module, num_experts: int) -> list[nn.Linear]:
    """A mixture-of-experts layer's routers: its Linear children with one output per expert."""
    return [c for c in layer.children() if isinstance(c, nn.Linear) and c.out_features == num_experts]


def expert_list_candidates(model: nn.Module) -> list[ExpertListSite]:
    """Modules holding a ModuleList of >= 2 experts of one class, each with parameters, and a
    router: a Linear child with one output per expert."""
    found = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) < 2:
                continue
            kinds = {type(expert) for expert in child}
            if len(kinds) != 1 or not all(any(True for _ in expert.parameters()) for expert in child):
                continue
            if router_linears(module, len(child)):
                found.append(ExpertListSite(name, module, attr, len(child)))
    return found


def check_calls(site: ExpertListSite, calls: list[tuple[int, tuple, dict, Any]]) -> None:
    """Each expert call must take one tensor of rows and return rows of the same shape."""
    for index, args, kwargs, out in calls:
        rows = args[0] if len(args) == 1 and not kwargs else None
        if not (torch.is_tensor(rows) and torch.is_tensor(out) and out.shape == rows.shape and rows.dim() == 2):
            raise ExpertDiscoveryError(
                f"expert {index} of '{site.name}' was called with {len(args)} positional and {sorted(kwargs)} keyword "
                "arguments; expert parallelism over a ModuleList of experts needs each expert called on the rows "
                "routed to it, [N, H] -> [N, H] (as litgpt's LLaMAMoE calls them)"
            )


class ExpertCalls:
    """The census recorder of every stacked-experts candidate and ModuleList MoE layer of ``model``
    (``plan``: {module path: ep_plan style}, resolved; it decides where it names): how the step
    calls each. On a model built on meta, a stacked candidate answers with rows like its input
    while the census runs (its own forward picks rows by value, which meta cannot); a ModuleList
    layer's rows per expert (``torch.where`` of its routing mask) take the balanced share
    (``meta_routing``, the probe's mode on meta)."""

    needs_grad = False
    done = False  # every call of the step: an uncalled candidate is kept whole

    def __init__(self, model: nn.Module, plan: Optional[dict[str, str]] = None) -> None:
        self.plan = plan or {}
        self.candidates, self.lists = _candidates(model, self.plan)
        self.calls: dict[str, tuple[tuple, dict, str]] = {}
        self.list_calls: dict[str, list[tuple[int, tuple, dict, Any]]] = {site.name: [] for site in self.lists}
        self._stand_ins: list[nn.Module] = []

    def arm(self, census: Any) -> list[Any]:
        armed: list[Any] = []
        for name, (module, n) in self.candidates.items():

            def record(_module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                if name not in self.calls:  # without the step's graph: the census may run with autograd
                    self.calls[name] = (*tree_map(_detached, (args, kwargs)), _call_site())

            armed.append(module.register_forward_pre_hook(record, with_kwargs=True))
            if any(p.is_meta for p in module.parameters()):
                # a module not called with top-k routing (an MoE block around the experts) runs its own
                def rows_out(
                    *args: Any, name: str = name, n: int = n, module: nn.Module = module, **kwargs: Any
                ) -> Any:
                    try:
                        site = classify_call(name, n, args, kwargs)
                    except ExpertDiscoveryError:
                        return type(module).forward(module, *args, **kwargs)
                    return torch.zeros_like(site.hidden.get(args, kwargs))

                module.forward = rows_out
                self._stand_ins.append(module)
        for site in self.lists:
            for index, expert in enumerate(getattr(site.module, site.experts_attr)):

                def note(
                    _m: nn.Module, args: tuple, kwargs: dict, out: Any, name: str = site.name, i: int = index
                ) -> None:
                    self.list_calls[name].append((i, *tree_map(_detached, (args, kwargs, out))))

                armed.append(expert.register_forward_hook(note, with_kwargs=True))
        return armed

    def finish(self, output: Any) -> None:
        for module in self._stand_ins:
            del module.forward
        self._stand_ins = []

    def sites(self) -> tuple[list[ExpertsSite], list[ExpertListSite]]:
        """The experts modules and ModuleList layers the step called, each checked against its layout's
        convention (top-k per token; an expert on its rows); the uncalled ones kept whole, or refused."""
        candidates, calls, plan = self.candidates, self.calls, self.plan
        sites = _innermost_routed(candidates, calls)
        uncalled = {
            n: m for n, (_, m) in candidates.items() if n not in calls and not any(_related(n, s.name) for s in sites)
        }
        uncalled.update({site.name: site.num_experts for site in self.lists if not self.list_calls[site.name]})
        uncalled = {n: m for n, m in uncalled.items() if not any(_inside(other, n) for other in uncalled)}  # innermost
        lists = [site for site in self.lists if self.list_calls[site.name]]
        _keep_uncalled_whole(uncalled, bool(sites or lists), plan)
        for site in lists:
            check_calls(site, self.list_calls[site.name])
        return sites, lists


def find_experts(
    model: nn.Module, probe: Callable[[], Any], plan: Optional[dict[str, str]] = None
) -> tuple[list[ExpertsSite], list[ExpertListSite]]:
    """Every stacked-experts module and every ModuleList MoE layer of ``model``, with how one probe
    forward calls them (a census of its own; ``parallelize`` records them in the setup's census)."""
    calls = ExpertCalls(model, plan)
    if not calls.candidates and not calls.lists:
        return [], []
    return record_alone(probe, calls).sites()


def _keep_uncalled_whole(uncalled: dict[str, int], others_found: bool, plan: dict[str, str]) -> None:
    """Stacked parameters or an expert ModuleList the probe step never ran (a per-loop query table, a
    branch this data does not take) are left whole on every rank: no step exchanges rows with them.
    Refused where ep_plan names one, or where no MoE layer ran at all (the probe missed the model)."""
    for name, n in uncalled.items():
        if name in plan or not others_found:
            raise ExpertDiscoveryError(
                f"experts module '{name}' ({n} experts stacked) was not called by the probe forward, so its routing "
                "is unknown; expert parallelism needs every experts module it splits to run in an ordinary step (the "
                "probe is one training step on the first batch)"
            )
        log.info("expert parallel: '%s' looks like stacked experts but the probe step never ran it: kept whole", name)


def routed_parameters(model: nn.Module) -> list[str]:
    """Names of the experts' parameters (stacked candidates, ModuleList layers): a router picks the rows
    each expert computes by value, so one rank's step may reach none of an expert's, or of a stacked
    tensor's, when no token of its batch is routed there (a layer with identity "zero" experts)."""
    candidates, lists = _candidates(model, {})
    owners = {**{name: module for name, (module, _) in candidates.items()}}
    owners.update({f"{s.name}.{s.experts_attr}".lstrip("."): getattr(s.module, s.experts_attr) for s in lists})
    return [f"{owner}.{name}".lstrip(".") for owner, module in owners.items() for name, _ in module.named_parameters()]


def _inside(inner: str, outer: str) -> bool:
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def _candidates(
    model: nn.Module, plan: dict[str, str]
) -> tuple[dict[str, tuple[nn.Module, int]], list[ExpertListSite]]:
    """Stacked candidates and ModuleList layers: discovered, then as ``plan`` says where it names
    a module (its chain of nested candidates replaced by it; 'dense' removes a module and its children)."""

    def under(name: str, paths: list[str]) -> bool:
        return any(name == p or _inside(name, p) for p in paths)

    dense = [p for p, style in plan.items() if style == "dense"]
    named = [p for p, style in plan.items() if style != "dense"]
    found = {name: (m, n) for name, m in model.named_modules() if (n := stacked_experts(m))}
    candidates = {k: v for k, v in found.items() if not under(k, dense) and not any(_related(k, p) for p in named)}
    lists = [s for s in expert_list_candidates(model) if not under(s.name, dense + named)]
    for path in named:
        module = model.get_submodule(path)
        if plan[path] == "experts":
            n = stacked_experts(module, need_3d=False)
            if n is None:
                shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
                raise ExpertDiscoveryError(
                    f"ep_plan['{path}']='experts', but its parameters {shapes} do not all lead with one n_experts >= 2; "
                    "name the module whose parameters are the stacked experts"
                )
            candidates[path] = (module, n)
        else:
            site = _expert_list_of(path, module)
            lists.append(site)
    return candidates, lists


def _related(a: str, b: str) -> bool:
    return a == b or _inside(a, b) or _inside(b, a)


def _expert_list_of(path: str, module: nn.Module) -> ExpertListSite:
    for attr, child in module.named_children():
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and len({type(e) for e in child}) == 1:
            return ExpertListSite(path, module, attr, len(child))
    raise ExpertDiscoveryError(
        f"ep_plan['{path}']='expert_list', but '{path}' ({type(module).__name__}) has no ModuleList child of two or "
        "more experts of one class; name the layer that holds the experts' ModuleList"
    )


def _innermost_routed(
    candidates: dict[str, tuple[nn.Module, int]], calls: dict[str, tuple[tuple, dict, str]]
) -> list[ExpertsSite]:
    """Of nested candidates (an MoE block, its experts, their inner GEMM module) the innermost one
    called with top-k routing; a candidate with none of its chain so called is refused with its reason."""
    sites: list[ExpertsSite] = []
    errors: dict[str, ExpertDiscoveryError] = {}
    for name in sorted(candidates, key=lambda n: n.count(".") + bool(n), reverse=True):  # innermost first
        if any(_inside(site.name, name) for site in sites):
            continue  # around experts already found
        module, n = candidates[name]
        if name not in calls:
            continue  # no step ran it: nothing to exchange (find_experts keeps it whole)
        try:
            found = classify_call(name, n, *calls[name])
        except ExpertDiscoveryError as error:
            errors[name] = error
            continue
        sites.append(
            ExpertsSite(
                name,
                module,
                n,
                found.top_k,
                found.hidden,
                found.indices,
                found.weights,
                found.hidden_dims,
                found.counts,
            )
        )
    sites += _grouped_sites(candidates, calls, errors, sites)
    for name in errors:  # the innermost unresolved one is named (an experts module, not its MoE block)
        if not any(_related(name, site.name) for site in sites):
            raise errors[name]
    return sorted(sites, key=lambda site: list(candidates).index(site.name))


def _grouped_sites(
    candidates: dict[str, tuple[nn.Module, int]],
    calls: dict[str, tuple[tuple, dict, str]],
    errors: dict[str, ExpertDiscoveryError],
    sites: list,
) -> list[GroupedSite]:
    """Of the candidates not called with top-k routing and in no chain that is, the innermost ones
    called on rows grouped by expert that pass ``check_grouped``; a failed check joins the error."""
    found: list[GroupedSite] = []
    for name in list(errors):  # innermost first
        if any(_related(name, site.name) for site in [*sites, *found]):
            continue
        module, n = candidates[name]
        args, kwargs, _ = calls[name]
        grouped = classify_grouped(name, module, n, args, kwargs)
        reason = check_grouped(grouped, args, kwargs) if grouped is not None else None
        if grouped is not None and reason is None:
            found.append(grouped)
        elif reason is not None:
            errors[name] = ExpertDiscoveryError(f"{errors[name]} (taken as rows grouped by expert: {reason})")
    return found


def ep_plan_cross_check(model: nn.Module, found: list[str]) -> Optional[str]:
    """What transformers' own ``base_model_ep_plan`` says next to what discovery found, as a log
    line, or None when no submodule carries such a plan. Only compared, never used."""
    for prefix, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
        base = getattr(module, "base_model", None)
        if not plan or base is None:
            continue
        base_name = next((n for n, m in model.named_modules() if m is base), prefix)
        head = f"{base_name}." if base_name else ""
        patterns = [key for key, style in plan.items() if "experts" in style or key.endswith("experts")]
        local = [name[len(head) :] for name in found if name.startswith(head)]
        planned = [n for n, _ in base.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if sorted(planned) == sorted(local):
            return f"expert parallel: transformers' base_model_ep_plan names the same {len(local)} experts modules"
        return (
            f"expert parallel: transformers' base_model_ep_plan names {sorted(planned)}, discovery found "
            f"{sorted(local)} (discovery's are split; the plan is only compared)"
        )
    return None
