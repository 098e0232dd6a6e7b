"""torch.compile: the speedup compile gives one process, and how much of it ptdp keeps at t=2, p=2
and t=2 p=2 (PTDPStrategy(compile=...), every block compiled after ptdp's rewrites).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_compile [--steps 20] [--rounds 3]

Prints JSON: per layout, tokens/s eager and compiled (alternated rounds in the same processes,
medians and spreads), the per-round speedup compiled / eager, and the retention: a layout's median
speedup over one process's (the issue's goal: >= 0.9). One process is plain Lightning with each
block compiled by ``block.compile()``, what a user without ptdp writes.
"""

from __future__ import annotations

import argparse
import json

import lightning as L

from benchmarks.bench_dp import WARMUP_STEPS, StepTimer, timing_data
from benchmarks.results import paired_ratio, pool_of, spread, stats
from lightning_ptdp.testing import quiet_trainer

TITLE = "torch.compile: the speedup one process gets, and the share ptdp keeps (issue 24)"
# Two sizes: at h=256 one thread's time is mostly GEMMs, which compile leaves to the same BLAS; at h=64
# the norms, GeLU, residuals and per-op dispatch that compile fuses are a larger share of a step.
MODELS = {
    "h256": {"vocab_size": 256, "seq_length": 128, "num_layers": 4, "num_heads": 8, "hidden_size": 256},
    "h64": {"vocab_size": 256, "seq_length": 128, "num_layers": 4, "num_heads": 4, "hidden_size": 64},
}
BACKEND = "inductor"
# name -> (devices, strategy arguments; None: plain Lightning, one process)
LAYOUTS: dict[str, tuple[int, dict | None]] = {
    "one process": (1, None),
    "t2": (2, {"tensor_parallel_size": 2}),
    "p2": (2, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}),
    "t2 p2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2}),
}
VARIANTS = ("eager", "compiled")


def timed_fit(layout: str, compiled: bool, steps: int, batch: int, warmup: int, model: dict) -> float:
    """Train the recipes GPT at ``layout``; tokens/s of the timed steps (compilation falls in the warm-up)."""
    import torch._dynamo

    from lightning_ptdp import PTDPStrategy
    from recipes.gpt import GPTConfig, GPTLightningModule

    devices, strategy_kwargs = LAYOUTS[layout]
    torch._dynamo.reset()  # each fit compiles for itself: no graph kept from the other variant's fit
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(GPTConfig(**model))
    strategy = "auto"
    if strategy_kwargs is not None:
        strategy = PTDPStrategy(**strategy_kwargs, compile={"backend": BACKEND} if compiled else False)
    elif compiled:
        for block in module.gpt.blocks:
            block.compile(backend=BACKEND)
    seq = model["seq_length"]
    data = timing_data(model["vocab_size"], seq, batch, steps)
    timer = StepTimer(warmup)
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=steps, callbacks=[timer])
    trainer.fit(module, data)
    return timer.timed_steps * batch * seq / (timer.end - timer.start)


def run(
    *,
    rounds: int = 3,
    steps: int = 20,
    warmup: int = WARMUP_STEPS,
    batch: int = 8,
    models: dict | None = None,
    layouts: tuple[str, ...] = tuple(LAYOUTS),
    pool=None,
) -> dict:
    return {
        "benchmark": "compile_speedup_retention",
        "sizes": {"rounds": rounds, "steps": steps, "warmup_steps": warmup, "batch": batch},
        "backend": BACKEND,
        "goal": 0.9,
        "models": {
            name: measure(model, rounds=rounds, steps=steps, warmup=warmup, batch=batch, layouts=layouts, pool=pool)
            for name, model in (models or MODELS).items()
        },
    }


def measure(model: dict, *, rounds: int, steps: int, warmup: int, batch: int, layouts: tuple, pool) -> dict:
    """Eager and compiled, alternated round by round, at each layout for one model size."""
    tokens: dict[str, dict[str, list[float]]] = {name: {v: [] for v in VARIANTS} for name in layouts}
    for name in layouts:
        with pool_of(LAYOUTS[name][0], pool) as workers:
            for index in range(rounds):
                for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                    args = (name, variant == "compiled", steps, batch, warmup, model)
                    tokens[name][variant].append(workers.run(timed_fit, *args)[0])
    speedup = {name: paired_ratio(t["compiled"], t["eager"]) for name, t in tokens.items()}
    base = speedup.get("one process")
    retention = {
        name: s["median"] / base["median"] for name, s in speedup.items() if base is not None and name != "one process"
    }
    return {
        "model": model,
        "tokens_per_s": {name: {v: stats(values) for v, values in t.items()} for name, t in tokens.items()},
        "speedup_compiled_over_eager": speedup,
        "retention_over_one_process": retention,
        "goal_met": bool(retention) and min(retention.values()) >= 0.9,
    }


def markdown(result: dict) -> str:
    s = result["sizes"]
    parts = [
        f"""- Sizes: batch {s["batch"]} per replica; {s["rounds"]} rounds of {s["steps"]} steps, eager and compiled
  alternated in the same processes, the first {s["warmup_steps"]} steps (compilation) untimed; backend
  {result["backend"]}. One process: plain Lightning, `block.compile()` on each block; ptdp:
  `PTDPStrategy(compile=...)`, one thread per rank (the t=2 p=2 layout runs 4 ranks on 2 cores)."""
    ]
    for name, r in result["models"].items():
        m = r["model"]
        rows = []
        for layout, variants in r["tokens_per_s"].items():
            speed = r["speedup_compiled_over_eager"][layout]
            keep = r["retention_over_one_process"].get(layout)
            rows.append(
                f"  | {layout} | {spread(variants['eager'], '{:.0f}')} | {spread(variants['compiled'], '{:.0f}')} "
                f"| {spread(speed)} | {'; '.join(f'{v:.2f}' for v in speed['values'])} "
                f"| {'-' if keep is None else f'{keep:.3f}'} |"
            )
        kept = r["retention_over_one_process"]
        lowest = f"lowest {min(kept.values()):.3f}" if kept else "no layout measured"
        table = "\n".join(rows)
        parts.append(
            f"""- **{name}**: recipes GPT l={m["num_layers"]} h={m["hidden_size"]} a={m["num_heads"]} V={m["vocab_size"]}, s={m["seq_length"]}.

  | layout | eager tokens/s, median (min-max) | compiled tokens/s | speedup compiled / eager, per round: median (min-max) | per round | kept of one process's speedup |
  |---|---|---|---|---|---|
{table}

  Kept of one process's speedup (a layout's median speedup / one process's): **{lowest}**; the goal
  >= {result["goal"]} is {"met" if r["goal_met"] else "not met"}."""
        )
    parts.append(
        "- Where compile speeds one process up by only a few percent, the kept share is a ratio of two\n"
        "  numbers near 1 and says little; the rounds' spread is how far a single figure can be trusted."
    )
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(run(rounds=args.rounds, steps=args.steps, batch=args.batch), indent=1))


if __name__ == "__main__":
    main()
