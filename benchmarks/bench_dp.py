"""Tokens/s of ptdp data parallelism beside Lightning's DDPStrategy, same model, same CPU, one run.

    python benchmarks/bench_dp.py [--devices 2] [--steps 60] [--rounds 3]

Both strategies run inside the same gloo worker processes, alternating round by round, so
machine noise hits both alike; the JSON reports each round, the medians and ptdp / ddp.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import lightning as L
import torch

WARMUP_STEPS = 10


class StepTimer(L.Callback):
    """Wall time (and this process's CPU time, all threads) from the end of the warm-up steps to
    the end of the last step."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.cpu_start: float | None = None
        self.cpu_end: float | None = None
        self.step_cpu: list[float] = []  # CPU seconds of each timed step
        self.timed_steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == WARMUP_STEPS:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        elif trainer.global_step > WARMUP_STEPS:
            now = time.process_time()
            self.step_cpu.append(now - (self.cpu_end or self.cpu_start))
            self.end, self.cpu_end = time.perf_counter(), now
            self.timed_steps = trainer.global_step - WARMUP_STEPS


def timed_fit(strategy_name: str, devices: int, steps: int, batch_per_rank: int, seq_length: int) -> float:
    """Train the recipes' small GPT for ``steps`` steps; return tokens/s over all ranks."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    model = GPTLightningModule(GPTConfig(vocab_size=256, seq_length=seq_length, num_layers=4, num_heads=4, hidden_size=128))
    data = MarkovDataModule(
        vocab_size=256, seq_length=seq_length, batch_size=batch_per_rank,
        train_tokens=(steps + 2) * batch_per_rank * devices * (seq_length + 1), val_tokens=2 * (seq_length + 1),
    )
    strategy = PTDPStrategy() if strategy_name == "ptdp" else DDPStrategy()
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[timer],
    )
    trainer.fit(model, data)
    return timer.timed_steps * batch_per_rank * devices * seq_length / (timer.end - timer.start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    args = parser.parse_args()

    from lightning_ptdp.testing import DistributedPool

    rounds: dict[str, list[float]] = {"ptdp": [], "ddp": []}
    with DistributedPool(args.devices) as pool:
        for _ in range(args.rounds):
            for name in ("ptdp", "ddp"):
                per_rank = pool.run(timed_fit, name, args.devices, args.steps, args.batch_per_rank, args.seq_length)
                rounds[name].append(per_rank[0])
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    print(json.dumps({
        "benchmark": "data_parallel_tokens_per_s",
        "devices": args.devices, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "batch_per_rank": args.batch_per_rank, "seq_length": args.seq_length,
        "model": "recipes GPT l=4 h=128 a=4 V=256",
        "tokens_per_s": rounds, "median_tokens_per_s": medians,
        "ratio_ptdp_over_ddp": medians["ptdp"] / medians["ddp"],
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "lightning": L.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
