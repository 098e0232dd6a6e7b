"""Tensor parallelism: ptdp's automatic rewrite beside Lightning's ModelParallelStrategy with a
hand-written DTensor plan, same model, same CPU, one run; plus collectives per layer.

    python -m benchmarks.bench_tp [--steps 40] [--rounds 3]

Prints JSON: tokens/s of each (alternating rounds, medians, ratio ptdp / ModelParallelStrategy),
and ptdp's measured collectives and bytes per layer and microbatch beside Megatron's analytic
figures (2 all-reduces of b*s*h each way; with SP 2 all-gathers + 2 reduce-scatters of b*s*h).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import lightning as L
import torch

from benchmarks.bench_dp import WARMUP_STEPS, StepTimer

MODEL = dict(vocab_size=256, seq_length=128, num_layers=4, num_heads=8, hidden_size=256)
TP = 2


def _dtensor_module():
    """The GPT recipe with the plan a ModelParallelStrategy user writes by hand."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from recipes.gpt import GPTConfig, GPTLightningModule

    class HandPlannedGPT(GPTLightningModule):
        def configure_model(self) -> None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            plan = {
                "attn.query": ColwiseParallel(), "attn.key": ColwiseParallel(), "attn.value": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel(),
            }
            for block in self.gpt.blocks:
                parallelize_module(block, tp_mesh, plan)

    return HandPlannedGPT(GPTConfig(**MODEL))


def timed_fit(name: str, steps: int, batch: int) -> float:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    if name == "ptdp":
        model, strategy = GPTLightningModule(GPTConfig(**MODEL)), PTDPStrategy(tensor_parallel_size=TP)
    else:
        model, strategy = _dtensor_module(), ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=TP)
    seq = MODEL["seq_length"]
    data = MarkovDataModule(vocab_size=256, seq_length=seq, batch_size=batch,
                            train_tokens=(steps + 2) * batch * (seq + 1), val_tokens=2 * (seq + 1))
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=TP, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[timer])
    trainer.fit(model, data)
    return timer.timed_steps * batch * seq / (timer.end - timer.start)


def collectives_per_layer(sequence_parallel: bool, batch: int) -> dict:
    """One forward+backward of the blocks only, counted; divided by the number of layers."""
    import torch.distributed as dist

    from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
    from lightning_ptdp.testing import CollectiveCounter
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    net = GPT(GPTConfig(**MODEL))
    ids = torch.randint(0, 256, (batch, MODEL["seq_length"]))
    tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    apply_tensor_parallel(net, tp, sequence_parallel=sequence_parallel, probe=lambda: net(ids))
    x = torch.randn(batch, MODEL["seq_length"], MODEL["hidden_size"], requires_grad=True)
    blocks = torch.nn.Sequential(*net.blocks)
    with CollectiveCounter() as counter:
        blocks(x).sum().backward()
    layers = MODEL["num_layers"]
    per_layer = {k: v / layers for k, v in counter.counts.items()}
    bytes_per_layer = {k: v / layers for k, v in counter.bytes.items()}
    bsh_bytes = batch * MODEL["seq_length"] * MODEL["hidden_size"] * 4
    if sequence_parallel:  # SP: the enter/exit of the block list adds 1 gather each way over all layers
        analytic = {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}
    else:
        analytic = {"all_reduce": 4}
    return {"measured_calls": per_layer, "measured_bytes": bytes_per_layer, "megatron_calls": analytic,
            "megatron_bytes_per_call": bsh_bytes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    from lightning_ptdp.testing import DistributedPool

    rounds: dict[str, list[float]] = {"ptdp": [], "model_parallel_strategy": []}
    with DistributedPool(TP) as pool:
        for _ in range(args.rounds):
            for name in rounds:
                rounds[name].append(pool.run(timed_fit, name, args.steps, args.batch)[0])
        comms = {sp: pool.run(collectives_per_layer, sp == "tp+sp", args.batch)[0] for sp in ("tp", "tp+sp")}
    medians = {k: statistics.median(v) for k, v in rounds.items()}
    print(json.dumps({
        "benchmark": "tensor_parallel_tokens_per_s", "tensor_parallel_size": TP, "model": MODEL,
        "batch": args.batch, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "tokens_per_s": rounds, "median_tokens_per_s": medians,
        "ratio_ptdp_over_model_parallel_strategy": medians["ptdp"] / medians["model_parallel_strategy"],
        "collectives_per_layer_and_microbatch": comms,
        "cpu": platform.machine(), "torch": torch.__version__, "lightning": L.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
