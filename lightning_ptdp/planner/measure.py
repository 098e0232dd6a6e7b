"""What ``ptdp plan --calibrate`` times on this CPU: micro-benchmarks of a block, AdamW and gloo,
speed probes, and ``Trainer.fit`` steps of the small GPT at a layout, on every rank of a pool.

Torch and Lightning are imported inside the functions: ``import lightning_ptdp.planner`` stays light.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

MODEL = {"vocab_size": 256, "seq_length": 128, "num_layers": 8, "num_heads": 4, "hidden_size": 256}
GLOBAL_BATCH = 16
WORLD = 4
WARMUP, TIMED = 2, 4
SHALLOW_TIMED = 12  # steps of 1-2 layer probes last a fraction of a second: time three times as many


def small_size():
    from lightning_ptdp.planner.models import ModelSize

    return ModelSize(
        num_layers=MODEL["num_layers"],
        hidden_size=MODEL["hidden_size"],
        num_heads=MODEL["num_heads"],
        vocab_size=MODEL["vocab_size"],
        seq_length=MODEL["seq_length"],
    )


def _cpu_seconds(fn, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(median CPU seconds of this process per call, CPU seconds / wall seconds over the timed calls).

    CPU time (``time.process_time``: every thread of the process, gloo's included) is the work a call
    costs; a rank waiting on a descheduled peer sleeps and costs nothing, its core runs another rank."""
    for _ in range(warmup):
        fn()
    cpu, wall_start, cpu_start = [], time.perf_counter(), time.process_time()
    for _ in range(repeats):
        c = time.process_time()
        fn()
        cpu.append(time.process_time() - c)
    share = (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
    return statistics.median(cpu), share


def measure_machine(repeats: int = 12) -> dict:
    """On every rank at once, as in training: CPU seconds of one block's forward + backward at b=1
    and b=2, of an AdamW step over the whole model, and of gloo all-reduces at the sizes and group
    sizes the layouts use; and the CPU share a rank gets while all ranks compute."""
    import torch
    import torch.distributed as dist

    from lightning_ptdp.tools.interconnect import benchmark_collectives
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    model = GPT(GPTConfig(**MODEL))
    block = model.blocks[0]
    for b in (1, 2):
        x = torch.randn(b, MODEL["seq_length"], MODEL["hidden_size"], requires_grad=True)
        dist.barrier()
        out[f"block_b{b}_cpu_s"], out[f"share_b{b}"] = _cpu_seconds(lambda x=x: block(x).sum().backward(), repeats)
    params = list(model.parameters())
    for q in params:
        q.grad = torch.randn_like(q)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    dist.barrier()
    out["adam_cpu_s"], _ = _cpu_seconds(optimizer.step, repeats)
    out["adam_parameters"] = sum(q.numel() for q in params)
    # gloo all-reduces: the TP activation (fp32 s*h) in pairs of consecutive ranks, both pairs at
    # once; the DP gradients (fp32, all parameters) over all ranks.
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    pair = pairs[rank // 2]
    tp = torch.randn(MODEL["seq_length"] * MODEL["hidden_size"])
    dp = torch.randn(out["adam_parameters"])
    dist.barrier()
    out["tp_all_reduce_cpu_s"], _ = _cpu_seconds(lambda: dist.all_reduce(tp, group=pair), 5 * repeats)
    dist.barrier()
    out["dp_all_reduce_cpu_s"], _ = _cpu_seconds(lambda: dist.all_reduce(dp), repeats)
    dist.barrier()
    rows = benchmark_collectives([4096, tp.numel() * 4], torch.device("cpu"), iters=20)  # ptdp doctor --bench
    ar = {row.size_bytes: row for row in rows if row.op == "all_reduce"}
    out["wall_busbw"], out["wall_4kb_s"] = ar[max(ar)].busbw_gbps * 1e9, ar[min(ar)].time_us * 1e-6
    out["tp_bytes"], out["dp_bytes"] = tp.numel() * 4, dp.numel() * 4
    return out


def probe_speed(seconds: float = 1.5) -> tuple[float, float]:
    """(CPU / wall of this rank, its CPU seconds per block forward + backward at b=1) while every
    rank runs blocks for ``seconds``: how fast this shared VM is now (other users' load, cache and
    frequency included), measured beside each timed run and compared with ``measure_machine``'s."""
    import torch
    import torch.distributed as dist

    from recipes.gpt import GPT, GPTConfig

    block = GPT(GPTConfig(**{**MODEL, "num_layers": 1})).blocks[0]
    x = torch.randn(1, MODEL["seq_length"], MODEL["hidden_size"], requires_grad=True)
    block(x).sum().backward()
    dist.barrier()
    calls, wall, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        block(x).sum().backward()
        calls += 1
    used = time.process_time() - cpu
    return used / (time.perf_counter() - wall), used / calls


def step_clock():
    """A Lightning callback that stamps wall and CPU time (``.stamps``, ``.cpu``) once per optimizer
    step: at p = 1 Lightning's batch is one microbatch of a gradient-accumulated step."""
    import lightning as L

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_end(self, trainer, *_: object) -> None:
            if trainer.global_step > len(self.stamps):
                self.stamps.append(time.perf_counter())
                self.cpu.append(time.process_time())

    return StepClock()


def measure_layout(
    t: int, p: int, d: int, v: int, num_layers: int = MODEL["num_layers"], timed: int = TIMED
) -> tuple[float, float, float]:
    """(median seconds per optimizer step of ``Trainer.fit`` of the small GPT at this layout, this
    rank's CPU seconds / wall seconds over the timed steps, its CPU seconds per timed step)."""
    import lightning as L
    import torch

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.planner import Cluster, layout_arguments
    from lightning_ptdp.testing import quiet_trainer
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    cluster = Cluster(num_gpus=WORLD, gpus_per_node=WORLD, gpu_memory_bytes=1e12)
    model = {**MODEL, "num_layers": num_layers}
    layout = small_estimate(cluster, t, p, v, num_layers)
    args = layout_arguments(layout, cluster)
    clock = step_clock()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    seq, steps = MODEL["seq_length"], WARMUP + timed
    batches = steps * max(1, layout.num_microbatches if p == 1 else 1)
    data = MarkovDataModule(
        vocab_size=MODEL["vocab_size"],
        seq_length=seq,
        batch_size=args.per_rank_batch_size,
        train_tokens=(batches + 2) * args.per_rank_batch_size * d * (seq + 1),
        val_tokens=2 * (seq + 1),
    )
    trainer = quiet_trainer(
        strategy=PTDPStrategy(**args.strategy),
        max_steps=steps,
        callbacks=[clock],
        **{k: v for k, v in args.trainer.items() if k != "num_nodes"},
    )
    trainer.fit(GPTLightningModule(GPTConfig(**model)), data)
    stamps, cpu = clock.stamps, clock.cpu
    assert len(stamps) == steps, f"{len(stamps)} optimizer steps stamped, expected {steps}"
    step = statistics.median(b - a for a, b in zip(stamps[WARMUP - 1 :], stamps[WARMUP:]))
    used = cpu[-1] - cpu[WARMUP - 1]
    return step, used / (stamps[-1] - stamps[WARMUP - 1]), used / timed


def small_estimate(cluster, t: int, p: int, v: int, num_layers: int = MODEL["num_layers"]):
    """The planner's ``Layout`` of the small GPT, ``num_layers`` deep, at this layout on ``cluster``."""
    from lightning_ptdp.planner import estimate

    return estimate(
        replace(small_size(), num_layers=num_layers),
        cluster,
        GLOBAL_BATCH,
        tensor_parallel_size=t,
        pipeline_parallel_size=p,
        virtual_pipeline_size=v,
        activation_checkpointing=None,
    )


def between_probes(pool, fn, *args) -> tuple[list, float, float]:
    """``fn`` on every rank between two ``probe_speed`` runs: (its per-rank results, the median
    share, the median CPU seconds per block) around it."""
    before = pool.run(probe_speed)
    out = pool.run(fn, *args)
    around = before + pool.run(probe_speed)
    return out, statistics.median(x for x, _ in around), statistics.median(x for _, x in around)
