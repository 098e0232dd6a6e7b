"""Tensor parallelism: ptdp's automatic rewrite beside Lightning's ModelParallelStrategy with a
hand-written DTensor plan, same model, same CPU, one run; plus collectives per layer.

    python -m benchmarks.bench_tp [--steps 40] [--rounds 5]

Prints JSON: tokens/s of each (alternated rounds, medians, spreads, per-round ratio ptdp /
ModelParallelStrategy), and ptdp's collectives per layer and microbatch, counted, beside the
analytic count of Megatron-LM (``megatron_calls``).

Counting per layer: the blocks of the recipes GPT are built at two depths (``COUNT_DEPTHS``), one
forward and one backward of the block list alone are counted at each, and per layer = difference
/ difference of depths; what is left at either depth is per model (under SP: entering and leaving
the block list), reported apart.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch

from benchmarks.bench_dp import WARMUP_STEPS, StepTimer, timing_data
from benchmarks.results import paired_ratio, pool_of, spread, stats
from lightning_ptdp.testing import quiet_trainer

TITLE = "tensor parallelism: ptdp vs ModelParallelStrategy + hand-written DTensor plan (issue 3)"
MODEL = {"vocab_size": 256, "seq_length": 128, "num_layers": 4, "num_heads": 8, "hidden_size": 256}
TP = 2
COUNT_DEPTHS = (4, 2)
CONTENDERS = ("ptdp", "model_parallel_strategy")

# Megatron-LM, per layer and microbatch (two regions per layer: attention, MLP). Without SP, f/g:
# one all-reduce per region forward (g) and one backward (f). With SP (Korthikanti et al. 2022,
# Sec. 4.2.2): forward an all-gather entering each region and a reduce-scatter leaving it; backward
# their conjugates (a reduce-scatter and an all-gather per region) plus, because a column Linear
# saves only its 1/t input shard, the all-gather of that shard again for the weight gradient
# (Megatron's LinearWithGradAccumulationAndAsyncCommunication, sequence_parallel=True): one more per region.
MEGATRON = {
    "tp": {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    "tp+sp": {
        "forward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        "backward": {"all_gather_into_tensor": 2 + 2, "reduce_scatter_tensor": 2},
    },
}


def _dtensor_module():
    """The GPT recipe with the plan a ModelParallelStrategy user writes by hand."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from recipes.gpt import GPTConfig, GPTLightningModule

    class HandPlannedGPT(GPTLightningModule):
        def configure_model(self) -> None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            plan = {
                "attn.query": ColwiseParallel(),
                "attn.key": ColwiseParallel(),
                "attn.value": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc_in": ColwiseParallel(),
                "mlp.fc_out": RowwiseParallel(),
            }
            for block in self.gpt.blocks:
                parallelize_module(block, tp_mesh, plan)

    return HandPlannedGPT(GPTConfig(**MODEL))


def timed_fit(name: str, steps: int, batch: int, warmup: int = WARMUP_STEPS) -> float:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_ptdp import PTDPStrategy
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    if name == "ptdp":
        model, strategy = GPTLightningModule(GPTConfig(**MODEL)), PTDPStrategy(tensor_parallel_size=TP)
    else:
        model, strategy = _dtensor_module(), ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=TP)
    seq = MODEL["seq_length"]
    data = timing_data(256, seq, batch, steps)
    timer = StepTimer(warmup)
    trainer = quiet_trainer(
        devices=TP,
        strategy=strategy,
        max_steps=steps,
        callbacks=[timer],
    )
    trainer.fit(model, data)
    return timer.timed_steps * batch * seq / (timer.end - timer.start)


def count_collectives(sequence_parallel: bool, batch: int, layers: int) -> dict:
    """One forward and one backward of the block list only, counted apart: {phase: {name: (calls, bytes)}}."""
    import torch.distributed as dist

    from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
    from lightning_ptdp.testing import CollectiveCounter
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    net = GPT(GPTConfig(**{**MODEL, "num_layers": layers}))
    ids = torch.randint(0, 256, (batch, MODEL["seq_length"]))
    tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    apply_tensor_parallel(net, tp, sequence_parallel=sequence_parallel, probe=lambda: net(ids))
    x = torch.randn(batch, MODEL["seq_length"], MODEL["hidden_size"], requires_grad=True)
    blocks = torch.nn.Sequential(*net.blocks)
    with CollectiveCounter() as forward:
        out = blocks(x)
    with CollectiveCounter() as backward:
        out.sum().backward()
    return {
        phase: {k: (c.counts[k], c.bytes[k]) for k in c.counts}
        for phase, c in (("forward", forward), ("backward", backward))
    }


def collectives_per_layer(pool, batch: int) -> dict:
    deep, shallow = COUNT_DEPTHS
    bsh_bytes = batch * MODEL["seq_length"] * MODEL["hidden_size"] * 4
    result = {}
    for mode in ("tp", "tp+sp"):
        counts = {n: pool.run(count_collectives, mode == "tp+sp", batch, n)[0] for n in COUNT_DEPTHS}
        per_layer, per_model, bytes_per_call = {}, {}, {}
        for phase in ("forward", "backward"):
            names = set(counts[deep][phase]) | set(counts[shallow][phase])
            get = {n: {k: counts[n][phase].get(k, (0, 0)) for k in names} for n in COUNT_DEPTHS}
            per_layer[phase] = {k: (get[deep][k][0] - get[shallow][k][0]) / (deep - shallow) for k in sorted(names)}
            per_model[phase] = {k: get[deep][k][0] - deep * per_layer[phase][k] for k in sorted(names)}
            per_model[phase] = {k: v for k, v in per_model[phase].items() if v}
            for k in names:
                calls, nbytes = get[deep][k]
                bytes_per_call[k] = max(bytes_per_call.get(k, 0), nbytes // calls if calls else 0)
        result[mode] = {
            "measured_per_layer": per_layer,
            "measured_per_model": per_model,
            "measured_bytes_per_call": bytes_per_call,
            "megatron_per_layer": MEGATRON[mode],
            "megatron_bytes_per_call": bsh_bytes,
            "agrees": per_layer == {p: {k: float(v) for k, v in c.items()} for p, c in MEGATRON[mode].items()},
        }
    return result


def run(*, rounds: int = 5, steps: int = 40, warmup: int = WARMUP_STEPS, batch: int = 8, pool=None) -> dict:
    tokens: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with pool_of(TP, pool) as workers:
        comms = collectives_per_layer(workers, batch)
        for index in range(rounds):
            for name in CONTENDERS if index % 2 == 0 else CONTENDERS[::-1]:
                tokens[name].append(workers.run(timed_fit, name, steps, batch, warmup)[0])
    return {
        "benchmark": "tensor_parallel_tokens_per_s",
        "sizes": {
            "tensor_parallel_size": TP,
            "rounds": rounds,
            "steps": steps,
            "warmup_steps": warmup,
            "batch": batch,
            "model": MODEL,
            "count_depths": COUNT_DEPTHS,
        },
        "tokens_per_s": {name: stats(values) for name, values in tokens.items()},
        "ratio_ptdp_over_model_parallel_strategy": paired_ratio(tokens["ptdp"], tokens["model_parallel_strategy"]),
        "collectives_per_layer_and_microbatch": comms,
    }


_SHORT = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter"}


def _calls(counts: dict) -> str:
    return ", ".join(f"{v:g} {_SHORT.get(k, k)}" for k, v in sorted(counts.items()) if v) or "none"


def markdown(result: dict) -> str:
    s, tok = result["sizes"], result["tokens_per_s"]
    ratio = result["ratio_ptdp_over_model_parallel_strategy"]
    m = s["model"]
    rounds = "; ".join(
        f"{a:.0f} / {b:.0f}" for a, b in zip(tok["ptdp"]["values"], tok["model_parallel_strategy"]["values"])
    )
    rows = []
    for mode, c in result["collectives_per_layer_and_microbatch"].items():
        measured, megatron = c["measured_per_layer"], c["megatron_per_layer"]
        rows.append(
            f"| {mode.upper()} | {_calls(measured['forward'])} | {_calls(measured['backward'])} "
            f"| {_calls(megatron['forward'])} | {_calls(megatron['backward'])} | {'yes' if c['agrees'] else 'NO'} "
            f"| {_calls(c['measured_per_model'].get('forward', {}))} / "
            f"{_calls(c['measured_per_model'].get('backward', {}))} "
            f"| {max(c['measured_bytes_per_call'].values()):,} | {c['megatron_bytes_per_call']:,} |"
        )
    table = "\n".join("  " + row for row in rows)
    return f"""- Sizes: t={s["tensor_parallel_size"]} on 2 ranks, 1 thread each; recipes GPT l={m["num_layers"]}
  h={m["hidden_size"]} a={m["num_heads"]} V={m["vocab_size"]}, s={m["seq_length"]}, batch {s["batch"]};
  {s["rounds"]} alternated rounds of {s["steps"]} steps, the first {s["warmup_steps"]} untimed. The DTensor plan:
  q/k/v/fc_in ColwiseParallel, proj/fc_out RowwiseParallel per block, embedding and head replicated.
- Tokens/s per round, ptdp / ModelParallelStrategy: {rounds}.
- Median (min-max) tokens/s: ptdp {spread(tok["ptdp"], "{:.0f}")}, ModelParallelStrategy
  {spread(tok["model_parallel_strategy"], "{:.0f}")}.
- **Ratio ptdp / ModelParallelStrategy, per round: median {spread(ratio)}; ratio of the medians
  {ratio["of_medians"]:.3f}.** Target >= 1.0. ptdp's shards are plain tensors with one collective per
  region boundary; DTensor pays per-op dispatch on every call. ptdp also splits the vocabulary,
  which the hand-written plan leaves replicated.
- Collectives per layer and microbatch, counted by `lightning_ptdp.testing.CollectiveCounter` over
  one forward and one backward of the block list at {s["count_depths"][0]} and {s["count_depths"][1]} layers
  (per layer = the difference / 2; the rest is per model), beside Megatron-LM's analytic count:

  | mode | counted, forward | counted, backward | Megatron, forward | Megatron, backward | equal | per model (fwd / bwd), not per layer | counted bytes/call (largest) | b*s*h*4 (fp32) |
  |---|---|---|---|---|---|---|---|---|
{table}

  Megatron's count: two regions per layer (attention, MLP). Without SP one all-reduce per region
  each way. With SP, forward an all-gather entering each region and a reduce-scatter leaving it;
  backward their conjugates (a reduce-scatter and an all-gather per region) plus one all-gather per
  region of the 1/t input shard the column Linears saved, for their weight gradient (Megatron
  re-gathers it the same way): 6 all-gathers and 4 reduce-scatters per layer. The per-model
  gathers under SP are the block list's entry (its backward gathers the gradient) and exit
  (forward gathers the output); in a whole model Megatron does these at the embedding and LM
  head instead. An all-gather's bytes are those of its full-size side.
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(run(rounds=args.rounds, steps=args.steps, batch=args.batch), indent=1))


if __name__ == "__main__":
    main()
