"""Every GPU figure in one process, on one H100 or H200, within part budgets summing to under 8 minutes:

    PYTHONPATH=. python -m benchmarks.gpu                 # on the GPU: JSON + Markdown, RESULTS.md section
    PYTHONPATH=. python -m benchmarks.gpu --smoke --out /tmp/x   # CPU, tiny sizes, Triton interpreter

Needs only torch, triton, lightning and torchmetrics (no hydra, wandb or network). Parts:
correctness, attention, bias_gelu, tuning, training (see benchmarks/gpu/__init__.py); each has a
time budget and a failure in one is recorded in the JSON while the others still run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument(
        "--parts",
        default="correctness,attention,bias_gelu,tuning,training",
        help="comma-separated subset, run in this order",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated training variants to run (default: all), e.g. ptdp+compile+float8,ptdp+compile",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_suite"), help="folder for the JSON and Markdown")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="RESULTS.md to update (default: benchmarks/RESULTS.md on a GPU run, none with --smoke)",
    )
    parser.add_argument("--no-results", action="store_true", help="do not update any RESULTS.md")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (lightning does)
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.smoke else "8")
    import json

    import torch

    from benchmarks.gpu.suite import PARTS, run_suite

    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if not args.smoke and not torch.cuda.is_available():
        print(
            json.dumps({"status": "skipped", "reason": "no CUDA device; --smoke runs the suite on the CPU interpreter"})
        )
        return 0
    results = (
        None if args.no_results else args.results or (None if args.smoke else Path(__file__).parents[1] / "RESULTS.md")
    )
    command = "python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    record = run_suite(
        smoke=args.smoke,
        parts=parts,
        out_dir=args.out,
        results_md=results,
        budget_scale=args.budget_scale,
        command=command.strip(),
        variants=tuple(args.variants.split(",")) if args.variants else None,
    )
    print(
        json.dumps(
            {
                name: {k: part.get(k) for k in ("status", "seconds", "passed", "target_met", "error")}
                for name, part in record["parts"].items()
            }
            | {"files": record["files"]},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
