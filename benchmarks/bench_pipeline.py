"""Pipeline bubble, measured: each stage's busy and idle time per step for GPipe, 1F1B and
interleaved 1F1B at several microbatch counts, beside the paper's (p-1)/m and (p-1)/(v*m).

    python -m benchmarks.bench_pipeline [--steps 6] [--microbatches 2 4 8]

p = 2 ranks (one thread each; this machine has 2 cores, so each stage owns one). For each
(schedule, m) it trains the recipes GPT through ``Trainer.fit`` and reads the engine's measured
timeline of the last steps: busy = time inside forward/backward of a microbatch, idle = the rest
of the schedule's wall time (waiting on the other stage and on transfers). The bubble is
idle / busy, the quantity the paper's (p-1)/m estimates (bubble time over ideal compute time).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import lightning as L
import torch

MODEL = dict(vocab_size=256, seq_length=256, num_layers=8, num_heads=8, hidden_size=512)
PP = 2
WARMUP_STEPS = 2
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))


class TimelineRecorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []  # (busy, wall) per step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        timeline = trainer.strategy.pipeline.timeline
        self.steps.append((timeline.busy, timeline.end - timeline.start))


def measure(schedule: str, vpp: int, microbatches: int, steps: int) -> dict:
    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    seq = MODEL["seq_length"]
    data = MarkovDataModule(
        vocab_size=MODEL["vocab_size"], seq_length=seq, batch_size=microbatches,
        train_tokens=(steps + 2) * microbatches * (seq + 1), val_tokens=2 * (seq + 1),
    )
    recorder = TimelineRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=PP, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[recorder],
        strategy=PTDPStrategy(pipeline_parallel_size=PP, virtual_pipeline_size=vpp, micro_batch_size=1,
                              pipeline_schedule=schedule),
    )
    trainer.fit(GPTLightningModule(GPTConfig(**MODEL)), data)
    timed = recorder.steps[WARMUP_STEPS:]
    busy = statistics.median(b for b, _ in timed)
    wall = statistics.median(w for _, w in timed)
    return {"busy_s": busy, "wall_s": wall, "bubble": (wall - busy) / busy}


def main() -> None:
    from lightning_ptdp.testing import DistributedPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    rows = []
    pool = DistributedPool(PP)
    try:
        for m in args.microbatches:
            for schedule, vpp in SCHEDULES:
                per_rank = pool.run(measure, schedule, vpp, m, args.steps + WARMUP_STEPS)
                bubble = statistics.mean(r["bubble"] for r in per_rank)
                rows.append({
                    "schedule": schedule, "v": vpp, "m": m, "measured_bubble": round(bubble, 3),
                    "paper_bubble": round((PP - 1) / (vpp * m), 3),
                    "per_rank": [{k: round(v, 4) for k, v in r.items()} for r in per_rank],
                })
    finally:
        pool.close()
    for m in args.microbatches:
        by = {r["schedule"]: r["measured_bubble"] for r in rows if r["m"] == m}
        cut = 1 - by["interleaved_1f1b"] / by["1f1b"] if by["1f1b"] > 0 else 0.0
        rows.append({"m": m, "interleaved_cut_of_1f1b_bubble": round(cut, 3), "target": 0.8 * (2 - 1) / 2})
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "p": PP,
        "model": MODEL, "micro_batch_size": 1, "results": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
