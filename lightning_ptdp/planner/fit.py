"""Will my model fit: ``dry_run(factory, devices=...)`` over candidate layouts, ranked and rendered,
and ``ptdp plan --model pkg.module:factory`` on the command line (planner/meta_run.py runs each one).

Layouts are ranked by whether the largest rank fits the device, then by the bytes one step's
collectives carry, then by that rank's peak.
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
) -> list:
    """Dry-run ``factory`` (a callable returning a LightningModule, or a (module, datamodule) pair; or
    "pkg.module:factory") on ``devices x num_nodes`` ranks, for ``layouts`` (strategy keyword
    dicts; default: ``candidate_layouts``). Returns the ``LayoutReport``s, best first."""

    factory = load_factory(factory) if isinstance(factory, str) else factory
    if not callable(factory):
        raise TypeError(f"dry_run: factory={factory!r} is not callable; pass a function returning the LightningModule")
    world_size = devices * num_nodes
    layouts = list(layouts) if layouts is not None else candidate_layouts(world_size, devices_per_node=devices)
    for layout in layouts:
        check_layout(layout, world_size)
    reports = [_attempt(factory, layout, world_size) for layout in layouts]
    limit = device_memory_gb * GIB if device_memory_gb else None
    return sorted(reports, key=lambda r: (r.refused is not None, limit is not None and not r.fits(limit), _order(r)))


def _attempt(factory: Any, layout: dict, world_size: int) -> Any:
    """One layout's dry run; a layout ptdp's setup refuses for this model is reported with the reason."""
    from lightning_ptdp.planner.meta_run import LayoutReport, dry_run_layout

    try:
        return dry_run_layout(factory, layout, world_size=world_size)
    except (ValueError, TypeError, NotImplementedError) as error:
        if "dry_run" in str(error):  # the factory's or the module's own fault: no layout would do
            raise
        return LayoutReport(dict(layout), world_size, (), refused=f"{type(error).__name__}: {error}")


def _order(report: Any) -> tuple[int, int]:
    if report.refused is not None:
        return (0, 0)
    return (sum(report.communication.values()), report.largest.peak)


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


def format_dry_run(reports: Sequence[Any], device_memory_gb: Optional[float] = None) -> str:
    """A table, one row per layout: its largest rank's bytes, and one step's communication by axis."""
    header = "| layout | params | grads | optimizer | activations | peak | fits | communication per step |"
    lines = [header, "|" + "---|" * 8]
    limit = device_memory_gb * GIB if device_memory_gb else None
    for report in reports:
        if report.refused is not None:
            lines.append(f"| {layout_name(report.layout)} | refused: {report.refused[:200]} |" + " |" * 6)
            continue
        rank = report.largest
        fits = "-" if limit is None else ("yes" if report.fits(limit) else "no")
        comm = ", ".join(f"{axis} {_gib(n)}" for axis, n in sorted(report.communication.items())) or "none"
        cells = (rank.parameters, rank.gradients, rank.optimizer, rank.activations, rank.peak)
        lines.append(f"| {layout_name(report.layout)} | " + " | ".join(map(_gib, cells)) + f" | {fits} | {comm} |")
    if reports and reports[0].refused is None:
        best = reports[0]
        args = ", ".join(f"{k}={v!r}" for k, v in best.layout.items())
        lines += ["", f"best: Trainer(strategy=PTDPStrategy({args}), devices=..., num_nodes=...)"]
        lines.append("CLI: " + " ".join(f"--trainer.strategy.{k}={v}" for k, v in best.layout.items()))
        lines.append("hydra: " + " ".join(f"parallel.{k}={v}" for k, v in best.layout.items()))
    return "\n".join(lines)
