"""Every CPU benchmark in one command; rewrites their sections of benchmarks/RESULTS.md.

    OMP_NUM_THREADS=1 python -m benchmarks.run_all --cpu            # the CPU figures of RESULTS.md
    OMP_NUM_THREADS=1 python -m benchmarks.run_all --cpu --quick --results R.md   # tiny sizes, a smoke run

Each benchmark runs repeated rounds with its contenders alternated (A B, B A, ...) in the same
processes and reports median and spread (min-max) and per-round ratios; the sizes are in the JSON
and in each section. Prints one JSON object with every section's results, the hardware and the
command, and writes each benchmark's section of the results file (``--results``; by default
benchmarks/RESULTS.md for a full run, nothing for ``--quick``), leaving every other section (the
GPU suite's) as it is. ``--only dp,tp`` runs a subset; ``--render RUN.json`` rewrites the sections from a run's JSON
(``--json``) without running anything. The full run takes under 15 minutes on the
2-core CPU machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: set, not inherited from the machine
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # the pool's workers inherit it

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.results import RESULTS, code_version, cpu_description, today, write_section

# name -> (module, sizes for --cpu, sizes for --cpu --quick, world size of the pool it runs on)
SECTIONS: dict[str, tuple[str, dict, dict, int]] = {
    "overhead": (
        "benchmarks.bench_overhead",
        {"rounds": 7, "steps": 30, "warmup": 10, "batch": 8},
        {"rounds": 2, "steps": 4, "warmup": 2, "batch": 2},
        1,
    ),
    "dp": (
        "benchmarks.bench_dp",
        {"rounds": 5, "steps": 25, "warmup": 8},
        {"rounds": 2, "steps": 4, "warmup": 2, "batch_per_rank": 2, "seq_length": 32},
        2,
    ),
    "tp": (
        "benchmarks.bench_tp",
        {"rounds": 5, "steps": 20, "warmup": 5},
        {"rounds": 2, "steps": 4, "warmup": 2, "batch": 2},
        2,
    ),
    "pipeline": (
        "benchmarks.bench_pipeline",
        {"rounds": 3, "steps": 2, "warmup": 1, "microbatches": (4, 8)},
        {
            "rounds": 2,
            "steps": 1,
            "warmup": 1,
            "microbatches": (2,),
            "model": {"vocab_size": 64, "seq_length": 32, "num_layers": 4, "num_heads": 2, "hidden_size": 32},
        },
        2,
    ),
    "memory": ("benchmarks.bench_memory", {"rounds": 2}, {"rounds": 1, "layouts": [(1, 1), (2, 2)]}, 4),
    "activation": (
        "benchmarks.bench_activation",
        {},
        {
            "layouts": [(2, True)],
            "model": {
                "vocab_size": 64,
                "seq_length": 32,
                "num_layers": 3,
                "num_heads": 2,
                "hidden_size": 32,
                "dropout": 0.1,
            },
        },
        4,
    ),
    "overlap": (
        "benchmarks.bench_overlap",
        {"rounds": 4, "steps": 6, "warmup": 2},
        {
            "rounds": 2,
            "steps": 1,
            "warmup": 1,
            "model": {"vocab_size": 64, "seq_length": 32, "num_layers": 4, "num_heads": 2, "hidden_size": 32},
        },
        4,
    ),
    "experts": (
        "benchmarks.bench_experts",
        {"rounds": 3},
        {
            "rounds": 1,
            "steps": 4,
            "warmup": 2,
            "model": {"hidden_size": 32, "intermediate_size": 64, "num_local_experts": 4},
            "shape": {"vocab_size": 64, "seq_length": 16, "batch": 2},
        },
        4,
    ),
    "expert_balance": (
        "benchmarks.bench_expert_balance",
        {"rounds": 3},
        {
            "rounds": 1,
            "steps": 4,
            "warmup": 2,
            "interval": 2,
            "model": {"hidden_size": 32, "intermediate_size": 64},
            "shape": {"vocab_size": 64, "seq_length": 16, "batch": 2},
        },
        4,
    ),
    "context": (
        "benchmarks.bench_context",
        {"rounds": 3},
        {"rounds": 1, "steps": 3, "warmup": 1, "model": {"seq_length": 128, "hidden_size": 32}},
        4,
    ),
    "compile": (
        "benchmarks.bench_compile",
        {"rounds": 3, "steps": 20, "warmup": 5},
        {
            "rounds": 2,
            "steps": 3,
            "warmup": 2,
            "batch": 4,
            "models": {
                "tiny": {"vocab_size": 64, "seq_length": 32, "num_layers": 2, "num_heads": 2, "hidden_size": 32}
            },
            "layouts": ("one process", "t2"),
        },
        4,
    ),
    "fused_loss": (
        "benchmarks.bench_fused_loss",
        {"rounds": 3},
        {"rounds": 1, "vocab": 4096, "hidden": 64, "tokens": 256},
        1,
    ),
}


def hardware() -> dict:
    import lightning
    import torch

    memory = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    return {
        "cpu": cpu_description(),
        "memory": memory,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": sys.version.split()[0],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "backend": "gloo, one thread per rank",
    }


def run_section(name: str, quick: bool, pools: dict[int, Any]) -> dict:
    import importlib

    module_name, full, small, world_size = SECTIONS[name]
    module = importlib.import_module(module_name)
    sizes = small if quick else full
    start = time.perf_counter()
    if name == "overhead":
        result = module.measure(**sizes)
    else:
        result = module.run(**sizes, pool=pools.get(world_size))
    result["elapsed_s"] = time.perf_counter() - start
    result["load_average_after"] = os.getloadavg()
    return result


def section_markdown(name: str, result: dict, info: dict, command: str) -> str:
    import importlib

    module = importlib.import_module(SECTIONS[name][0])
    body = module.body(result) if name == "overhead" else module.markdown(result)
    load = ", ".join(f"{x:.1f}" for x in result["load_average_after"])
    return f"""## {info["date"]} — {module.TITLE}

- Hardware: {info["cpu"]}, {info["memory"]}, CPU only, shared with other jobs (load average after this
  section {load}); torch {info["torch"]}, lightning {info["lightning"]}, Python {info["python"]}, {info["backend"]},
  OMP_NUM_THREADS={info["omp_num_threads"]}.
- Command: `{command}` (this section took {result["elapsed_s"]:.0f} s; JSON on its stdout).
{body.rstrip()}
- Written by `benchmarks/run_all.py` from `{SECTIONS[name][0].replace(".", "/")}.py`; never edited by hand.
"""


def run_markdown(record: dict) -> str:
    """The summary section: what ran, for how long, and where each section's figures are."""
    info = record["info"]
    times = ", ".join(f"{name} {result['elapsed_s']:.0f} s" for name, result in record["sections"].items())
    return f"""## {info["date"]} — the CPU suite: `{info["command"]}`

- Hardware: {info["cpu"]}, {info["memory"]}, CPU only, shared with other jobs; torch {info["torch"]},
  lightning {info["lightning"]}, Python {info["python"]}.
- Ran {", ".join(record["sections"])} in {record["elapsed_s"] / 60:.1f} minutes ({times}); each section below
  states its sizes, rounds and the load average after it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", required=True, help="the CPU suite (the GPU one: benchmarks.gpu)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: checks the code, not the figures")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--results", type=Path, default=None, help="results file to write (default: see above)")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON there")
    parser.add_argument("--render", type=Path, default=None, help="write the sections from this JSON; run nothing")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    results_path = args.results or (None if args.quick else RESULTS)
    # the options that decide the figures (not where the output went)
    options = " --quick" if args.quick else ""
    options += f" --only {','.join(names)}" if names != list(SECTIONS) else ""
    command = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} python -m benchmarks.run_all --cpu{options}"
    if args.render is not None:  # the sections again from a run's JSON, e.g. after a change of wording
        record = json.loads(args.render.read_text())
        for name, result in record["sections"].items():
            write_section(
                name,
                section_markdown(name, result, record["info"], record["info"]["command"]),
                commit=record["info"].get("commit", "not recorded by that run"),
                path=results_path or RESULTS,
            )
        if list(record["sections"]) == list(SECTIONS):  # a subset's JSON leaves the whole run's summary alone
            write_section(
                "cpu-run",
                run_markdown(record),
                commit=record["info"].get("commit", "not recorded by that run"),
                path=results_path or RESULTS,
            )
        return 0
    warnings.filterwarnings("ignore", category=FutureWarning)

    from lightning_ptdp.testing import DistributedPool

    info = {"date": today(), **hardware(), "command": command, "quick": args.quick, "commit": code_version()}
    record: dict[str, Any] = {"info": info, "sections": {}}
    started = time.perf_counter()
    pools: dict[int, Any] = {}
    try:
        for name in names:
            world_size = SECTIONS[name][3]
            if world_size > 1 and world_size not in pools:
                for size in list(pools):  # one pool at a time: 2 cores
                    pools.pop(size).close()
                pools[world_size] = DistributedPool(world_size)
            print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
            result = run_section(name, args.quick, pools)
            print(f"[run_all] {name}: {result['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
            record["sections"][name] = result
            if results_path is not None:
                write_section(
                    name, section_markdown(name, result, info, command), commit=info["commit"], path=results_path
                )
    finally:
        for pool in pools.values():
            pool.close()
    record["elapsed_s"] = time.perf_counter() - started
    if results_path is not None and names == list(SECTIONS):  # a subset leaves the whole run's summary as it is
        write_section("cpu-run", run_markdown(record), commit=info["commit"], path=results_path)
    text = json.dumps(record, indent=1, default=str)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
