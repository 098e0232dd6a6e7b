"""Will my model fit: ``dry_run(factory, devices=...)`` over candidate layouts, ranked and rendered,
and ``ptdp plan --model pkg.module:factory`` on the command line (planner/meta_run.py runs each one).

Layouts are ranked by whether the largest rank fits the device, then by the cost model's time for
the step's FLOPs and collectives (``step_seconds``).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence

GIB = 1024**3


def candidate_layouts(world_size: int, *, devices_per_node: int, zero_stages: Sequence[int] = (0, 1, 3)) -> list[dict]:
    """Every (t, p) that tiles the world, t within a node, d what is left; ZeRO stages as given;
    sequence parallelism whenever t > 1 (it only takes activation memory away)."""
    layouts = []
    for t in (n for n in range(1, devices_per_node + 1) if devices_per_node % n == 0 and world_size % n == 0):
        for p in (n for n in range(1, world_size // t + 1) if (world_size // t) % n == 0):
            d = world_size // (t * p)
            for zero in zero_stages if d > 1 else (0,):
                layout: dict[str, Any] = {"tensor_parallel_size": t, "pipeline_parallel_size": p}
                if t > 1:
                    layout["sequence_parallel"] = True
                if zero:
                    layout["zero_stage"] = zero
                layouts.append(layout)
    return layouts


def check_layout(layout: dict, world_size: int) -> None:
    """Setup-time refusals the dry run adds to the strategy's own (which it runs next)."""
    t, p = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    c, d = layout.get("context_parallel_size", 1), layout.get("data_parallel_size", "auto")
    tiles = world_size % (t * p * c) == 0 and (d == "auto" or d * t * p * c == world_size)
    if not tiles:
        raise ValueError(
            f"dry_run: the layout t={t} x p={p} x c={c} x d={d} does not tile the world of {world_size} ranks "
            f"(devices x num_nodes); the rule: t * p * c * d == {world_size}; pick degrees that divide it"
        )


def dry_run(
    factory: Any,
    *,
    devices: int,
    num_nodes: int = 1,
    layouts: Optional[Sequence[dict]] = None,
    device_memory_gb: Optional[float] = None,
    cluster: Any = None,
    precision: str = "32-true",
) -> list:
    """Dry-run ``factory`` (a callable returning a LightningModule, or a (module, datamodule) pair; or
    "pkg.module:factory") on ``devices x num_nodes`` ranks, for ``layouts`` (strategy keyword
    dicts; default: ``candidate_layouts``). Returns the ``LayoutReport``s, best first: those that
    fit, fastest by ``step_seconds`` on ``cluster`` (a ``planner.Cluster``; default H100 nodes).
    ``precision``: the Trainer's (``"bf16-mixed"``: activations as autocast makes them)."""

    factory = load_factory(factory) if isinstance(factory, str) else factory
    if not callable(factory):
        raise TypeError(f"dry_run: factory={factory!r} is not callable; pass a function returning the LightningModule")
    world_size = devices * num_nodes
    layouts = list(layouts) if layouts is not None else candidate_layouts(world_size, devices_per_node=devices)
    for layout in layouts:
        check_layout(layout, world_size)
    reports = [_attempt(factory, layout, world_size, precision) for layout in layouts]
    limit = device_memory_gb * GIB if device_memory_gb else None
    cluster = cluster or _cluster(world_size, devices)
    return sorted(
        reports,
        key=lambda r: (
            r.refused is not None,
            limit is not None and not r.fits(limit),
            step_seconds(r, cluster) if r.refused is None else 0.0,
        ),
    )


def _attempt(factory: Any, layout: dict, world_size: int, precision: str = "32-true") -> Any:
    """One layout's dry run; a layout ptdp's setup refuses for this model is reported with the reason."""
    from lightning_ptdp.planner.meta_run import LayoutReport, dry_run_layout

    try:
        return dry_run_layout(factory, layout, world_size=world_size, precision=precision)
    except (ValueError, TypeError, NotImplementedError) as error:
        if "dry_run" in str(error):  # the factory's or the module's own fault: no layout would do
            raise
        return LayoutReport(dict(layout), world_size, (), refused=f"{type(error).__name__}: {error}")


def _cluster(world_size: int, devices_per_node: int) -> Any:
    from lightning_ptdp.planner.cost import Cluster

    return Cluster.h100(world_size, gpus_per_node=min(devices_per_node, world_size))


def step_seconds(report: Any, cluster: Any, accumulate: int = 1) -> float:
    """The cost model's step time for the layout's busiest dry-run rank: its step's FLOPs (counted on
    meta) at the GPU's GEMM rate, stretched by the pipeline bubble, plus each collective it issued
    timed by ``planner/cost.py`` for its kind, bytes and group (summed: no overlap, an upper bound).
    ``accumulate``: the dry-run step is one of that many accumulated per optimizer step (its compute
    and model-parallel collectives repeat; the data-parallel gradient reduction runs once)."""
    from lightning_ptdp.planner import cost

    t, c = report.layout.get("tensor_parallel_size", 1), report.layout.get("context_parallel_size", 1)
    p, v = report.layout.get("pipeline_parallel_size", 1), report.layout.get("virtual_pipeline_size", 1)
    e = report.layout.get("expert_parallel_size", 1)
    inner = {"tp": 1, "cp": t, "ep": t, "dp": t * c, "edp": t * e}  # ranks between two members (tp innermost)
    timed = {"all_reduce": cost.all_reduce_seconds, "all_gather": cost.all_gather_seconds}
    timed["all_to_all"] = cost.all_to_all_seconds
    slowest = 0.0
    for rank in report.ranks:
        seconds = accumulate * rank.flops / (cluster.peak_flops * cluster.gemm_efficiency)
        seconds *= 1 + (p - 1) / (v * rank.microbatches)  # 1F1B's bubble (interleaved: over v)
        for axis, kind, size, nbytes, calls in rank.collectives:
            repeats = 1 if axis == "dp" or axis.endswith(" ranks") else accumulate
            if kind == "send":  # neighbouring stages: across nodes once a stage fills one
                across = report.world_size // p >= cluster.gpus_per_node
                seconds += repeats * calls * cost.send_seconds(nbytes / calls, across, cluster)
                continue
            per_node = max(1, min(size, cluster.gpus_per_node // inner.get(axis, t)))
            timing = timed[kind]
            once = timing(nbytes, size, per_node, cluster) + (calls - 1) * timing(0, size, per_node, cluster)
            seconds += repeats * once
        slowest = max(slowest, seconds)
    return slowest


def load_factory(text: str) -> Any:
    """ "pkg.module:factory" -> the callable; a clear error for a path that does not resolve."""
    module_name, _, attribute = text.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {text!r} is not MODULE:FACTORY; write e.g. --model my_project.train:build_model")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {text!r}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?") from err
    if not hasattr(module, attribute):
        raise ValueError(f"--model {text!r}: module {module_name!r} has no {attribute!r}")
    return getattr(module, attribute)


def _gib(value: int) -> str:
    return f"{value / GIB:.3g} GiB" if value >= GIB / 10 else f"{value / 1024**2:.3g} MiB"


def layout_name(layout: dict) -> str:
    keys = {"tensor_parallel_size": "t", "pipeline_parallel_size": "p", "context_parallel_size": "c"}
    keys.update(expert_parallel_size="e", zero_stage="zero", sequence_parallel="sp")
    parts = [f"{short}={layout[key]}" for key, short in keys.items() if key in layout and key != "sequence_parallel"]
    return " ".join(parts + (["sp"] if layout.get("sequence_parallel") else [])) or "d only"


def format_dry_run(reports: Sequence[Any], device_memory_gb: Optional[float] = None, cluster: Any = None) -> str:
    """A table, one row per layout: its largest rank's bytes, the cost model's step time on ``cluster``
    (``step_seconds``; default H100 nodes of 8), and one step's communication by axis."""
    header = "| layout | params | grads | optimizer | activations | peak | fits | step (s) | communication per step |"
    lines = [header, "|" + "---|" * 9]
    limit = device_memory_gb * GIB if device_memory_gb else None
    if reports and cluster is None:
        cluster = _cluster(reports[0].world_size, 8)
    for report in reports:
        if report.refused is not None:
            lines.append(f"| {layout_name(report.layout)} | refused: {report.refused[:200]} |" + " |" * 7)
            continue
        rank = report.largest
        fits = "-" if limit is None else ("yes" if report.fits(limit) else "no")
        comm = ", ".join(f"{axis} {_gib(n)}" for axis, n in sorted(report.communication.items())) or "none"
        cells = " | ".join(map(_gib, (rank.parameters, rank.gradients, rank.optimizer, rank.activations, rank.peak)))
        seconds = step_seconds(report, cluster)
        lines.append(f"| {layout_name(report.layout)} | {cells} | {fits} | {seconds:.3g} | {comm} |")
    if reports and reports[0].refused is None:
        best = reports[0]
        args = ", ".join(f"{k}={v!r}" for k, v in best.layout.items())
        lines += ["", f"best: Trainer(strategy=PTDPStrategy({args}), devices=..., num_nodes=...)"]
        lines.append("CLI: " + " ".join(f"--trainer.strategy.{k}={v}" for k, v in best.layout.items()))
        lines.append("hydra: " + " ".join(f"parallel.{k}={v}" for k, v in best.layout.items()))
    return "\n".join(lines)


def check_fits(
    factory: Any,
    layout: dict,
    *,
    devices: int,
    num_nodes: int = 1,
    device_memory_gb: float,
    precision: str = "32-true",
) -> Any:
    """Dry-run ``layout``; if its largest rank would not fit ``device_memory_gb``, raise with that rank,
    its largest holders and a layout of the same devices that fits (the best ``dry_run`` finds).
    Returns the layout's ``LayoutReport`` when it fits."""
    world_size = devices * num_nodes
    check_layout(layout, world_size)
    try:
        report = _attempt(factory, layout, world_size, precision)
    except Exception as error:
        raise RuntimeError(
            f"dry_run: this model could not be dry-run on the meta device ({type(error).__name__}: {error}); "
            "pass dry_run=False to launch without the check"
        ) from error
    limit = device_memory_gb * GIB
    if report.refused is not None or report.fits(limit):
        return report  # a layout setup refuses is refused again, with the same message, by the real setup
    rank = report.largest
    holders = ", ".join(f"{name} ({_gib(n)})" for name, n in rank.holders[:3])
    parts = zip(
        ("parameters", "gradients", "optimizer", "activations"),
        (rank.parameters, rank.gradients, rank.optimizer, rank.activations),
    )
    others = [
        r
        for r in dry_run(
            factory, devices=devices, num_nodes=num_nodes, device_memory_gb=device_memory_gb, precision=precision
        )
        if r.refused is None
    ]
    fitting = [r for r in others if r.fits(limit)]
    if fitting:
        best = fitting[0]
        args = ", ".join(f"{k}={v!r}" for k, v in best.layout.items())
        fix = f"a layout that fits: {layout_name(best.layout)} ({_gib(best.largest.peak)} at most per rank): PTDPStrategy({args})"
    else:
        least = min(others, key=lambda r: r.largest.peak, default=report)
        fix = (
            f"no layout of {world_size} devices fits; the least is {layout_name(least.layout)} at "
            f"{_gib(least.largest.peak)} per rank: more devices, a smaller model or micro batch"
        )
    raise ValueError(
        f"dry_run: rank {rank.rank} (and ranks {list(rank.like)}) would hold {_gib(rank.peak)} at its step's peak "
        f"under {layout_name(layout)}, more than the device's {device_memory_gb:.3g} GiB ("
        + ", ".join(f"{k} {_gib(v)}" for k, v in parts)
        + f"; largest holders: {holders}); {fix}; or dry_run=False to launch anyway"
    )


def check_fits_before_fit(trainer: Any, model: Any, data: Any, memory: Any) -> Any:
    """``ptdp fit --dry-run``: the configured layout dry-run before ``trainer.fit`` starts any process
    group, on a meta copy of ``model`` (no storage shared, no Trainer copied). Every launched rank
    reaches the same verdict, so a layout that does not fit stops them all here. ``memory``: True for
    the device's own, or GiB."""
    import dataclasses

    from lightning_ptdp.strategy import PTDPStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, PTDPStrategy):
        raise ValueError(
            f"--dry-run checks a PTDPStrategy layout; this Trainer's strategy is {type(strategy).__name__}"
        )
    layout = {**dataclasses.asdict(strategy.parallel_config), "compile": False}  # compiled or not: the same tensors
    layout.update(tp_plan=strategy.tp_plan, ep_plan=strategy.ep_plan)
    devices = len(strategy.parallel_devices)
    gib = device_memory_gib(strategy.root_device, devices) if memory is True else float(memory)

    def factory() -> Any:
        return meta_copy(model) if data is None else (meta_copy(model), data)

    return check_fits(
        factory,
        layout,
        devices=devices,
        num_nodes=strategy.num_nodes,
        device_memory_gb=gib,
        precision=str(trainer.precision),
    )


def device_memory_gib(device: Any, ranks_per_node: int) -> float:
    """A GPU's total memory; on the CPU, the machine's memory shared by the node's ranks."""
    import os

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_node / GIB


def meta_copy(module: Any) -> Any:
    """A copy of ``module`` whose parameters and buffers are meta tensors of the same shapes (deepcopy
    takes them from its memo, so no storage is copied), detached from its Trainer."""
    import copy

    import torch

    memo: dict[int, Any] = {id(module._trainer): None} if module._trainer is not None else {}
    for tensor in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        is_param = isinstance(tensor, torch.nn.Parameter)
        memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta
    return copy.deepcopy(module, memo)
