"""What a pipeline step's last stage hands every other rank: its results, its ``self.log`` calls,
each combined over the microbatches as one process would log it for the whole batch, and its
torchmetrics states (``StepResults``; the functions below do each part)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_ptdp.core.comm import detached_cpu


def metric_states(metric_paths: dict[str, Any], counts_before: dict[str, int]) -> dict[str, tuple]:
    """State of every torchmetrics Metric the step updated (only the last stage computes them)."""
    states = {}
    for name, metric in metric_paths.items():
        if metric._update_count != counts_before.get(name):  # torchmetrics has no public state copy
            state = {key: detached_cpu(getattr(metric, key)) for key in metric._defaults}
            states[name] = (state, metric._update_count, detached_cpu(metric._forward_cache))
    return states


def apply_metric_states(module: nn.Module, states: dict[str, tuple], device: torch.device) -> None:
    """On the other stages: each Metric takes the last stage's state, as if it had updated it."""
    for name, (state, count, forward_cache) in states.items():
        metric = module.get_submodule(name)
        for key, value in state.items():
            setattr(metric, key, to_device(value, device))
        metric._update_count, metric._computed = count, None
        metric._forward_cache = to_device(forward_cache, device)


def reduce_logs(
    logs: list[tuple[int, str, Any, tuple, dict]], metric_paths: dict[str, Any]
) -> list[tuple[str, Any, tuple, dict]]:
    """One entry per logged name: the microbatches' values combined by the call's ``reduce_fx``,
    its ``batch_size`` (if given) the step's total (a Metric is passed by its path)."""
    from torchmetrics import Metric

    paths = {id(m): name for name, m in metric_paths.items()}
    values: dict[str, list] = {}
    sizes: dict[str, list] = {}
    options: dict[str, dict] = {}
    for _, name, value, args, kwargs in logs:
        options[name] = log_options(args, kwargs)
        values.setdefault(name, []).append(value)
        sizes.setdefault(name, []).append(options[name]["batch_size"])
    reduced = []
    for name, seen in values.items():
        kwargs = options[name]
        if isinstance(seen[-1], Metric):
            value = paths.get(id(seen[-1]))
            if value is None:
                raise ValueError(
                    f"self.log({name!r}, metric): under pipeline parallelism a logged Metric must be "
                    "an attribute of the LightningModule so every stage can log it"
                )
        else:
            floats = [float(v.detach() if isinstance(v, torch.Tensor) else v) for v in seen]
            value = combine_microbatches(floats, sizes[name], kwargs["reduce_fx"])
            if kwargs["batch_size"] is not None:
                kwargs = {**kwargs, "batch_size": sum(size or 0 for size in sizes[name])}
        reduced.append((name, value, (), kwargs))
    return reduced


_REDUCE_FX = {
    torch.mean: "mean",
    torch.sum: "sum",
    sum: "sum",
    torch.max: "max",
    max: "max",
    torch.min: "min",
    min: "min",
}


def log_options(args: tuple, kwargs: dict) -> dict:
    """The options of one ``self.log(name, value, *args, **kwargs)`` call by name, with defaults."""
    import inspect

    import lightning.pytorch as pl

    bound = inspect.signature(pl.LightningModule.log).bind(None, "name", None, *args, **kwargs)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}


def combine_microbatches(values: list[float], sizes: list[Optional[int]], reduce_fx: Any) -> float:
    """What one process logs for the whole batch, from each microbatch's value: the sum, max or
    min of them, or (mean) their mean weighted by ``batch_size`` where given."""
    fx = reduce_fx.lower() if isinstance(reduce_fx, str) else _REDUCE_FX.get(reduce_fx, reduce_fx)
    if fx == "sum":
        return sum(values)
    if fx == "max":
        return max(values)
    if fx == "min":
        return min(values)
    if fx not in ("mean", "avg"):  # Lightning refuses it when the value is replayed
        return values[-1]
    weights = [1 if size is None else size for size in sizes]
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def to_device(value: Any, device: torch.device) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten([v.to(device) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


class StepResults:
    """After each step, the last stage's results shared with every rank of its pipeline, and its
    logs and metric states replayed there."""

    def __init__(self, module: nn.Module, pp_group: Any, *, is_last: bool, device: torch.device) -> None:
        self.module, self.pp_group, self.is_last, self.device = module, pp_group, is_last, device
        self._last_global = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
        self._counts: dict[str, int] = {}
        self._metrics: Optional[dict[str, Any]] = None

    def metric_paths(self) -> dict[str, Any]:
        """The module's torchmetrics Metrics by path, found once (setup fixed the module tree)."""
        if self._metrics is None:
            from torchmetrics import Metric

            self._metrics = {name: m for name, m in self.module.named_modules() if isinstance(m, Metric)}
        return self._metrics

    def begin(self) -> None:
        """Before a step: the metrics' update counts, to tell which ones the step updated."""
        self._counts = {name: m._update_count for name, m in self.metric_paths().items()}

    def share_and_replay(self, last_stage: Callable[[], dict], logs: list, as_dict: bool) -> dict:
        """``last_stage()`` with the step's combined logs and metric states, on every pipeline rank;
        the logs replayed on each (``self.log``), the states taken by the other stages."""
        payload = None
        if self.is_last:
            paths = self.metric_paths()
            try:
                payload = {
                    **last_stage(),
                    "logs": reduce_logs(logs, paths),
                    "metrics": metric_states(paths, self._counts),
                }
                payload["as_dict"] = as_dict
            except Exception as error:  # shared below, so no other stage waits for a result that never comes
                payload = {"error": f"{type(error).__name__}: {error}"}
        payload = self.share(payload)
        if "error" in payload:
            raise RuntimeError(f"the last pipeline stage could not finish the step: {payload['error']}")
        if not self.is_last:
            apply_metric_states(self.module, payload["metrics"], self.device)
        for name, value, args, kwargs in payload["logs"]:
            if isinstance(value, str):  # a torchmetrics Metric, by its path in the module
                value = self.module.get_submodule(value)
            elif value is not None:
                value = torch.tensor(value, device=self.device)
            if value is not None:
                self.module.log(name, value, *args, **kwargs)
        return payload

    def share(self, payload: Any) -> Any:
        """``payload`` from the last pipeline stage, on every rank of this pipeline."""
        box = [payload if self.is_last else None]
        dist.broadcast_object_list(box, src=self._last_global, group=self.pp_group)
        return box[0]
