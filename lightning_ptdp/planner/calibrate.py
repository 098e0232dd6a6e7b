"""``ptdp plan --calibrate``: the cost model on this machine's CPU, predicted beside measured.

On 4 local gloo processes (one thread each) it measures, with all 4 busy at once as in training:

* the compute rate: forward + backward of one transformer block of the small GPT below (t=1,
  b=1), so the CPU's per-op overheads and memory-bound ops are in the rate (``gemm_efficiency=1``,
  no tile quantization, memory-bound kernels folded in);
* the links: all-reduce bus bandwidth at the activation size and the latency of a 4 KB all-reduce
  (``ptdp doctor --bench``'s ``benchmark_collectives``).

Then it predicts, with ``estimate``, and measures (``Trainer.fit``, median step after warm-up) the
layouts (t, p, d) = (1,1,4), (2,1,2), (1,2,2), (2,2,1), (1,4,1) with v=2. Torch is imported here
only, never by ``import lightning_ptdp.planner``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

MODEL = {"vocab_size": 256, "seq_length": 128, "num_layers": 8, "num_heads": 4, "hidden_size": 256}
LAYOUTS = ((1, 1, 4, 1), (2, 1, 2, 1), (1, 2, 2, 1), (2, 2, 1, 1), (1, 4, 1, 2))  # (t, p, d, v)
GLOBAL_BATCH = 16
WORLD = 4
WARMUP, TIMED = 2, 4


def _size():
    from lightning_ptdp.planner.models import ModelSize

    return ModelSize(
        num_layers=MODEL["num_layers"],
        hidden_size=MODEL["hidden_size"],
        num_heads=MODEL["num_heads"],
        vocab_size=MODEL["vocab_size"],
        seq_length=MODEL["seq_length"],
    )


def measure_machine(repeats: int = 20) -> dict:
    """On every rank at once: seconds of one block's forward + backward, and gloo all-reduce figures."""
    import torch
    import torch.distributed as dist

    from lightning_ptdp.interconnect import benchmark_collectives
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    block = GPT(GPTConfig(**{**MODEL, "num_layers": 1})).blocks[0]
    x = torch.randn(1, MODEL["seq_length"], MODEL["hidden_size"], requires_grad=True)
    times = []
    for i in range(repeats + 3):
        dist.barrier()
        start = time.perf_counter()
        block(x).sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
    activation = MODEL["seq_length"] * MODEL["hidden_size"] * 4  # fp32
    rows = benchmark_collectives([4096, activation], torch.device("cpu"), iters=20)
    ar = {row.size_bytes: row for row in rows if row.op == "all_reduce"}
    small, large = ar[min(ar)], ar[max(ar)]
    return {"block_s": statistics.median(times), "busbw": large.busbw_gbps * 1e9, "small_s": small.time_us * 1e-6}


def measure_layout(t: int, p: int, d: int, v: int) -> float:
    """Median seconds per optimizer step of ``Trainer.fit`` of the small GPT at this layout."""
    import lightning as L
    import torch

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.planner import Cluster, estimate, layout_arguments
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    cluster = Cluster(num_gpus=WORLD, gpus_per_node=WORLD, gpu_memory_bytes=1e12)
    layout = estimate(
        _size(),
        cluster,
        GLOBAL_BATCH,
        tensor_parallel_size=t,
        pipeline_parallel_size=p,
        virtual_pipeline_size=v,
        activation_checkpointing=None,
    )
    args = layout_arguments(layout, cluster)
    stamps: list[float] = []

    class StepClock(L.Callback):
        def on_train_batch_end(self, trainer, *_: object) -> None:
            if len(stamps) < trainer.global_step + 1:
                stamps.append(time.perf_counter())

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    seq, steps = MODEL["seq_length"], WARMUP + TIMED
    batches = steps * max(1, layout.num_microbatches if p == 1 else 1)
    data = MarkovDataModule(
        vocab_size=MODEL["vocab_size"],
        seq_length=seq,
        batch_size=args.per_rank_batch_size,
        train_tokens=(batches + 2) * args.per_rank_batch_size * d * (seq + 1),
        val_tokens=2 * (seq + 1),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=PTDPStrategy(**args.strategy),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[StepClock()],
        **{k: v for k, v in args.trainer.items() if k != "num_nodes"},
    )
    trainer.fit(GPTLightningModule(GPTConfig(**MODEL)), data)
    return statistics.median(b - a for a, b in zip(stamps[WARMUP - 1 :], stamps[WARMUP:]))


def calibrate() -> dict:
    """Measure this machine, then predict and measure the five layouts; one dict of the figures."""
    from lightning_ptdp.planner import Cluster, estimate
    from lightning_ptdp.planner.estimate import executed_flops
    from lightning_ptdp.testing import DistributedPool

    pool = DistributedPool(WORLD)
    try:
        machine = pool.run(measure_machine)
        measured = {layout: statistics.median(pool.run(measure_layout, *layout)) for layout in LAYOUTS}
    finally:
        pool.close()
    block_s = statistics.median(m["block_s"] for m in machine)
    busbw = statistics.median(m["busbw"] for m in machine)
    small_s = statistics.median(m["small_s"] for m in machine)
    size = _size()
    layer_flops = executed_flops(replace(size, num_layers=1), 1, None)[0]  # one block, one sequence
    cluster = Cluster(
        num_gpus=WORLD,
        gpus_per_node=WORLD,
        gpu_memory_bytes=1e12,
        peak_flops=layer_flops / block_s,
        gemm_efficiency=1.0,
        hbm_bandwidth=1e15,
        num_sms=1,
        gemm_tile=(1, 1),
        intra_node_bandwidth=busbw / 2,  # the model counts 2-byte elements; the CPU runs fp32
        nvlink_hop_latency=small_s / (2 * (WORLD - 1)),
    )
    rows = []
    for (t, p, d, v), seconds in measured.items():
        x = estimate(
            size,
            cluster,
            GLOBAL_BATCH,
            tensor_parallel_size=t,
            pipeline_parallel_size=p,
            virtual_pipeline_size=v,
            activation_checkpointing=None,
        )
        rows.append(
            {
                "t": t,
                "p": p,
                "d": d,
                "v": v,
                "m": x.num_microbatches,
                "predicted_s": round(x.step_time_s, 4),
                "measured_s": round(seconds, 4),
                "error": round(x.step_time_s / seconds - 1, 3),
            }
        )
    order = lambda key: [(r["t"], r["p"], r["d"]) for r in sorted(rows, key=lambda r: r[key])]
    return {
        "model": MODEL,
        "global_batch_size": GLOBAL_BATCH,
        "world_size": WORLD,
        "block_forward_backward_s": round(block_s, 5),
        "compute_flops_per_rank": round(cluster.peak_flops),
        "all_reduce_busbw_bytes_per_s": round(busbw),
        "all_reduce_4kb_s": round(small_s, 6),
        "layouts": rows,
        "same_ranking": order("predicted_s") == order("measured_s"),
        "max_abs_error": max(abs(r["error"]) for r in rows),
    }


def main(argv: object = None) -> int:
    import json
    import sys

    result = calibrate()
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0 if result["max_abs_error"] <= 0.25 and result["same_ranking"] else 1
