"""litgpt's and torchtitan's model families at tiny sizes, at each layout, against one process (coverage table).

    OMP_NUM_THREADS=1 python -m benchmarks.sweep_libraries [--families 'litgpt:*,torchtitan:qwen3*']
        [--layouts d2,t2] [--sample N] [--quick] [--timeout S] [--out sweep.json] [--results RESULTS.md]

Families: tests/library_models.py (one litgpt named config per architecture signature; every decoder-only
torchtitan package). Cells run, are checked and classified as benchmarks/sweep_transformers.py does (its
arguments, pools, one-process reference with the fp64 round-off floor, classification), into section ``sweep_libraries``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import random
import sys
import time
from typing import Any

from benchmarks.results import code_version, cpu_description, today, write_section
from benchmarks.sweep_transformers import (
    EXPERT_LAYOUTS,
    OUTCOMES,
    SAMPLE_SEED,
    Pools,
    _cell_text,
    counts,
    parse,
    quiet,
    reference,
    run_layout,
)
from tests.distributed.test_real_models import GRAD_REL, LOSS_RTOL, STEPS, UPDATE_REL
from tests.fit_utils import ROUNDOFF_FACTOR

SECTION = "sweep_libraries"


class LibraryPools(Pools):
    """sweep_transformers' pools, whose ranks learn the library families (tests/library_models.py
    ``register``) as each pool starts."""

    def get(self, world_size: int) -> Any:
        from tests.library_models import register

        started = self.started
        pool = super().get(world_size)
        if self.started != started:
            pool.run(register)
        return pool


def select(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """(family -> description, excluded family -> reason), both filtered by ``--families`` globs; with
    ``--sample N``, N families drawn with sweep_transformers' seed and no exclusions."""
    from tests.library_models import library_exclusions, library_families

    def chosen(names: dict[str, str]) -> dict[str, str]:
        globs = args.families.split(",") if args.families else ["*"]
        return {n: v for n, v in names.items() if any(fnmatch.fnmatchcase(n, g) for g in globs)}

    families, excluded = chosen(library_families()), chosen(library_exclusions())
    if args.sample:
        drawn = random.Random(SAMPLE_SEED).sample(sorted(families), min(args.sample, len(families)))
        return {name: families[name] for name in sorted(drawn)}, {}
    return families, excluded


def sweep(args: argparse.Namespace) -> dict:
    from tests.library_models import register

    register()  # the one-process references build here
    described, excluded = select(args)
    steps = 1 if args.quick else STEPS
    pools, families = LibraryPools(), {}
    try:
        for name, what in described.items():
            moe, cells = family_cells(pools, name, args, steps)
            families[name] = {"description": what, "moe": moe, "cells": cells}
    finally:
        pools.close()
    return {"families": families, "excluded": excluded, "steps": steps, "pools_started": pools.started}


def family_cells(pools: Pools, name: str, args: argparse.Namespace, steps: int) -> tuple[bool, dict[str, dict]]:
    """(whether the family has experts, layout -> cell): every layout the family has (d2-e2 only with
    experts), each run against the one-process reference, or all the reason there is none."""
    from tests.shares import EXPERT

    ref, why = reference(name, steps, args.timeout)
    moe = ref is not None and any(EXPERT in key for key in ref["held"])
    layouts = [layout for layout in args.layouts if moe or layout not in EXPERT_LAYOUTS]
    if ref is None:
        outcome, _, reason = why.partition(": ")
        print(f"{name:32} {outcome}: {reason[:150]}", file=sys.stderr, flush=True)
        return moe, {layout: {"outcome": outcome, "reason": reason, "seconds": 0.0} for layout in layouts}
    cells = {}
    for layout in layouts:
        cells[layout] = cell = run_layout(pools, name, layout, ref, moe, steps, args.timeout)
        print(f"{name:32} {layout:6} {cell['outcome']:13} {cell['reason'][:150]}", file=sys.stderr, flush=True)
    return moe, cells


def render(record: dict) -> str:
    layouts, table = record["layouts"], counts(record)
    litgpt = sum(name.startswith("litgpt:") for name in record["families"])
    lines = [
        "## Sweep: litgpt's and torchtitan's model families at each layout against one process",
        "",
        f"- {record['date']}, litgpt {record['litgpt']}, torchtitan {record['torchtitan']}, torch {record['torch']}, "
        f"{record['cpu']}.",
        f"- `{record['command']}`: {litgpt} litgpt architectures (one named config per signature of "
        f"{record['litgpt_configs']} in litgpt.config.configs) and {len(record['families']) - litgpt} torchtitan "
        f"families, from tests/library_models.py; {record['steps']} steps, fp32, 2 gloo ranks; losses "
        f"{LOSS_RTOL:g} relative, first gradients {GRAD_REL:g}, weights {UPDATE_REL:g} of their update, each raised "
        f"to {ROUNDOFF_FACTOR:g}x the model's own fp32 round-off where larger (its one-process run in fp64), then "
        f"each rank's share (tests/shares.py); {record['minutes']:.1f} min, {record['pools_started']} pool(s) started.",
        "- Excluded: "
        + ("; ".join(f"{name} ({reason})" for name, reason in record["excluded"].items()) or "none")
        + ".",
        "",
        "| layout | " + " | ".join(OUTCOMES) + " | cells |",
        "|---" * (len(OUTCOMES) + 2) + "|",
    ]
    for layout in [*layouts, "all"]:
        row = {o: sum(table[k][o] for k in layouts if layout in ("all", k)) for o in OUTCOMES}
        lines.append(f"| {layout} | " + " | ".join(str(row[o]) for o in OUTCOMES) + f" | {sum(row.values())} |")
    lines += ["", "| family | what sets it apart | " + " | ".join(layouts) + " |", "|---" * (len(layouts) + 2) + "|"]
    for name, family in record["families"].items():
        cells = [family["cells"].get(layout, {}).get("outcome", "-") for layout in layouts]
        what = _cell_text(family["description"])
        lines.append(f"| {name}{' (MoE)' if family['moe'] else ''} | {what} | " + " | ".join(cells) + " |")
    lines += ["", "Every cell that is not ok, with its reason:", "", "| family | layout | outcome | reason |"]
    lines.append("|---|---|---|---|")
    for name, family in record["families"].items():
        for layout, cell in family["cells"].items():
            if cell["outcome"] != "ok":
                lines.append(f"| {name} | {layout} | {cell['outcome']} | {_cell_text(cell['reason'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from importlib.metadata import version

    from litgpt.config import configs

    quiet()
    args, commit, start = parse(argv), code_version(), time.monotonic()
    command = "python -m benchmarks.sweep_libraries " + " ".join(argv if argv is not None else sys.argv[1:])
    record: dict[str, Any] = {name: version(name) for name in ("litgpt", "torchtitan", "torch")}
    record |= dict(date=today(), cpu=cpu_description(), command=command, litgpt_configs=len(configs))
    record |= {"layouts": args.layouts, **sweep(args)}
    record |= {"minutes": (time.monotonic() - start) / 60, "counts": counts(record)}
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
    write_section(SECTION, render(record), commit=commit, **({"path": args.results} if args.results else {}))
    return record


if __name__ == "__main__":
    main()
