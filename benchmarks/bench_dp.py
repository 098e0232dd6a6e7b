"""Tokens/s of ptdp data parallelism beside Lightning's DDPStrategy, same model, same CPU, one run.

    python -m benchmarks.bench_dp [--devices 2] [--steps 60] [--rounds 5]

Both strategies run inside the same gloo worker processes, alternating round by round (A B, B A,
...), so machine noise hits both alike; the JSON reports each round, the medians and spreads and
the per-round ratio ptdp / ddp.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import lightning as L

from benchmarks.results import paired_ratio, pool_of, spread, stats
from lightning_ptdp.testing import quiet_trainer

WARMUP_STEPS = 10
TITLE = "data parallelism: ptdp vs Lightning DDPStrategy (issue 2)"
MODEL = {"vocab_size": 256, "num_layers": 4, "num_heads": 4, "hidden_size": 128}


class StepTimer(L.Callback):
    """Wall time (and this process's CPU time, all threads) from the end of the warm-up steps to
    the end of the last step."""

    def __init__(self, warmup_steps: int = WARMUP_STEPS) -> None:
        self.warmup_steps = warmup_steps
        self.start: float | None = None
        self.end: float | None = None
        self.cpu_start: float | None = None
        self.cpu_end: float | None = None
        self.step_cpu: list[float] = []  # CPU seconds of each timed step
        self.timed_steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup_steps:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        elif trainer.global_step > self.warmup_steps:
            now = time.process_time()
            self.step_cpu.append(now - (self.cpu_end or self.cpu_start))
            self.end, self.cpu_end = time.perf_counter(), now
            self.timed_steps = trainer.global_step - self.warmup_steps


def timing_data(vocab_size: int, seq_length: int, batch: int, steps: int, replicas: int = 1) -> Any:
    """The embedded corpus with enough samples for ``steps`` steps (+2) of ``batch`` per replica."""
    from recipes.data import MarkovDataModule

    return MarkovDataModule(
        vocab_size=vocab_size,
        seq_length=seq_length,
        batch_size=batch,
        train_tokens=(steps + 2) * batch * replicas * (seq_length + 1),
        val_tokens=2 * (seq_length + 1),
    )


def timed_fit(strategy_name: str, devices: int, steps: int, batch_per_rank: int, seq_length: int, warmup: int) -> float:
    """Train the recipes' small GPT for ``steps`` steps; return tokens/s over all ranks."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ptdp import PTDPStrategy
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    model = GPTLightningModule(GPTConfig(seq_length=seq_length, **MODEL))
    data = timing_data(MODEL["vocab_size"], seq_length, batch_per_rank, steps, replicas=devices)
    strategy = PTDPStrategy() if strategy_name == "ptdp" else DDPStrategy()
    timer = StepTimer(warmup)
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[timer],
    )
    trainer.fit(model, data)
    return timer.timed_steps * batch_per_rank * devices * seq_length / (timer.end - timer.start)


def run(
    *,
    devices: int = 2,
    rounds: int = 5,
    steps: int = 60,
    warmup: int = WARMUP_STEPS,
    batch_per_rank: int = 8,
    seq_length: int = 128,
    pool=None,
) -> dict:
    contenders = ("ptdp", "ddp")
    tokens: dict[str, list[float]] = {name: [] for name in contenders}
    with pool_of(devices, pool) as workers:
        for index in range(rounds):
            for name in contenders if index % 2 == 0 else contenders[::-1]:  # neither always runs first
                per_rank = workers.run(timed_fit, name, devices, steps, batch_per_rank, seq_length, warmup)
                tokens[name].append(per_rank[0])
    return {
        "benchmark": "data_parallel_tokens_per_s",
        "sizes": {
            "devices": devices,
            "rounds": rounds,
            "steps": steps,
            "warmup_steps": warmup,
            "batch_per_rank": batch_per_rank,
            "seq_length": seq_length,
            "model": "recipes GPT l={num_layers} h={hidden_size} a={num_heads} V={vocab_size}".format(**MODEL),
        },
        "tokens_per_s": {name: stats(values) for name, values in tokens.items()},
        "ratio_ptdp_over_ddp": paired_ratio(tokens["ptdp"], tokens["ddp"]),
    }


def markdown(result: dict) -> str:
    s, tok, ratio = result["sizes"], result["tokens_per_s"], result["ratio_ptdp_over_ddp"]
    rounds = "; ".join(f"{a:.0f} / {b:.0f}" for a, b in zip(tok["ptdp"]["values"], tok["ddp"]["values"]))
    return f"""- Sizes: {s["devices"]} ranks, 1 thread each; {s["model"]}, s={s["seq_length"]}, {s["batch_per_rank"]} sequences
  per rank; {s["rounds"]} alternated rounds of {s["steps"]} steps, the first {s["warmup_steps"]} untimed.
- Tokens/s per round, ptdp / DDPStrategy: {rounds}.
- Median (min-max) tokens/s: ptdp {spread(tok["ptdp"], "{:.0f}")}, DDPStrategy {spread(tok["ddp"], "{:.0f}")}.
- **Ratio ptdp / DDPStrategy, per round: median {spread(ratio)}; ratio of the medians
  {ratio["of_medians"]:.3f}.** Target >= 0.95. Both run torch's DDP underneath (ptdp restricts it to the
  dp sub-group), so parity is expected.
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    args = parser.parse_args()
    print(
        json.dumps(
            run(
                devices=args.devices,
                rounds=args.rounds,
                steps=args.steps,
                batch_per_rank=args.batch_per_rank,
                seq_length=args.seq_length,
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
