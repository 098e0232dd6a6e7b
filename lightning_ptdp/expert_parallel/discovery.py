"""Finding a model's mixture-of-experts layers from the model itself, with no plan.

An experts module holds every expert's weights stacked, ``[n_experts, ...]`` (transformers'
Mixtral, Qwen2/Qwen3-MoE and OLMoE ``*Experts``, torchtitan's ``GroupedExperts``), and its forward
takes the routing. One probe forward records how each is called: the hidden rows ``[N, H]``, the
chosen experts ``[N, k]`` (integers) and their weights ``[N, k]``, i.e. top-k routing per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn


class ExpertDiscoveryError(ValueError):
    """The model's experts cannot be split as found (the message names the module and the fix)."""


@dataclass(frozen=True)
class ArgSlot:
    """Where an argument of the experts' forward sits: a position, or a keyword name."""

    position: Optional[int] = None
    name: Optional[str] = None

    def get(self, args: tuple, kwargs: dict) -> Any:
        return args[self.position] if self.name is None else kwargs[self.name]

    def put(self, args: list, kwargs: dict, value: Any) -> None:
        if self.name is None:
            args[self.position] = value
        else:
            kwargs[self.name] = value


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


def stacked_experts(module: nn.Module) -> Optional[int]:
    """``n_experts`` when ``module`` holds experts stacked: its own parameters (at least one 3D)
    all lead with the same size >= 2, and no child holds parameters; else None."""
    own = list(module.parameters(recurse=False))
    if not own or any(True for child in module.children() for _ in child.parameters()):
        return None
    leading = {p.shape[0] for p in own if p.dim() >= 1}
    if len(leading) != 1 or not any(p.dim() == 3 for p in own) or min(leading) < 2:
        return None
    return leading.pop()


def _slots(args: tuple, kwargs: dict) -> list[tuple[ArgSlot, Any]]:
    return [(ArgSlot(position=i), a) for i, a in enumerate(args)] + [(ArgSlot(name=k), v) for k, v in kwargs.items()]


def _describe(args: tuple, kwargs: dict) -> str:
    def one(value: Any) -> str:
        return (
            f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            if torch.is_tensor(value)
            else type(value).__name__
        )

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def classify_call(name: str, num_experts: int, args: tuple, kwargs: dict) -> ExpertsSite:
    """The routing convention of one recorded call, or a clear refusal."""
    tensors = [(slot, v) for slot, v in _slots(args, kwargs) if torch.is_tensor(v)]
    hidden = next(((s, v) for s, v in tensors if v.is_floating_point() and v.dim() == 2), None)
    rows = hidden[1].shape[0] if hidden else -1
    indices = next(
        ((s, v) for s, v in tensors if not v.is_floating_point() and v.dim() == 2 and v.shape[0] == rows), None
    )
    if hidden is None or indices is None:
        raise ExpertDiscoveryError(
            f"experts module '{name}' ({num_experts} experts stacked) was called with ({_describe(args, kwargs)}); "
            "expert parallelism needs top-k routing per token: hidden rows [N, H], chosen experts [N, k] and "
            "their weights [N, k] (as transformers' Mixtral experts take them). Routing by expert (tokens per "
            "expert) or by capacity is not supported yet; pass expert_parallel_size=1 for this model"
        )
    k = indices[1].shape[1]
    weights = next(
        ((s, v) for s, v in tensors if v.is_floating_point() and v.dim() == 2 and tuple(v.shape) == (rows, k)), None
    )
    if weights is None or not 1 <= k <= num_experts:
        raise ExpertDiscoveryError(
            f"experts module '{name}' was called with ({_describe(args, kwargs)}): chosen experts [N={rows}, k={k}] "
            f"need weights of the same shape and 1 <= k <= {num_experts} (top-k routing per token)"
        )
    return ExpertsSite(name, None, num_experts, k, hidden[0], indices[0], weights[0])  # type: ignore[arg-type]


def find_experts(model: nn.Module, probe: Callable[[], Any]) -> list[ExpertsSite]:
    """Every stacked-experts module of ``model``, with the routing convention one probe forward
    shows. Refused: a candidate the probe never called, or one called without per-token top-k."""
    candidates = {name: (module, n) for name, module in model.named_modules() if (n := stacked_experts(module))}
    if not candidates:
        return []
    calls: dict[str, tuple[tuple, dict]] = {}
    hooks = []
    for name, (module, _) in candidates.items():

        def record(_module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            calls.setdefault(name, (args, kwargs))

        hooks.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            probe()
    finally:
        for hook in hooks:
            hook.remove()
    sites = []
    for name, (module, n) in candidates.items():
        if name not in calls:
            raise ExpertDiscoveryError(
                f"experts module '{name}' ({n} experts stacked) was not called by the probe forward, so its routing "
                "is unknown; expert parallelism needs every experts module to run in an ordinary step"
            )
        found = classify_call(name, n, *calls[name])
        sites.append(ExpertsSite(name, module, n, found.top_k, found.hidden, found.indices, found.weights))
    return sites
