"""Expert parallelism on CPU: the all-to-all bytes against the formula, the model-state memory per
rank from the allocator at e = 1, 2 and 4, and the step time with the experts split against
replicated, in alternated rounds.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_experts [--rounds 3]

4 gloo ranks (d = 4), transformers Mixtral (8 experts, top-2), fp32, AdamW, each rank its own batch.
Bytes: every float ``all_to_all_single`` of a step is counted from its split sizes, the rows this
rank sends to the other ranks times H x 4 bytes (its own rows stay), forward and backward. The
traffic chapter's formula: each token's hidden state goes out to its k experts and comes back,
(e-1)/e of it off-rank, forward and backward: 4 N k (e-1)/e H b per layer for N tokens on the rank,
uniform routing. "routed": the same with this step's routing (the rows each rank sends to experts
it does not hold, and receives for its own), the tokens per expert counted apart from the exchange:
each router's top-k taken again from its logits on the step's input. The measured bytes must equal it.
Memory: bytes in use in glibc's malloc at rest after step 2's optimizer step minus before the model
(as bench_memory.py), against 16 bytes per parameter held (weights, gradients, Adam moments).
Time: seconds per step after warm-up. One unrecorded run first (a fresh pool's first fit allocates
lazily imported state inside the measured window); then e = 1, 2, 4 in every round, the order
reversed every other round. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from benchmarks.bench_memory import Measure
from benchmarks.results import paired_ratio, pool_of, spread, stats
from lightning_ptdp.testing import quiet_trainer

TITLE = "expert parallelism: all-to-all bytes, expert memory per rank, step time (issue 27)"
WORLD_SIZE = 4
MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_local_experts": 8, "num_experts_per_tok": 2}
SHAPE = {"vocab_size": 256, "seq_length": 64, "num_layers": 2, "batch": 4}


class MixtralLM(L.LightningModule):
    """transformers' Mixtral as an ordinary LightningModule (ids -> logits, cross-entropy)."""

    def __init__(self, model: dict, shape: dict) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=shape["vocab_size"],
            num_hidden_layers=shape["num_layers"],
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=shape["seq_length"],
            router_jitter_noise=0.0,
            **model,
        )
        config._attn_implementation = "sdpa"
        self.net = MixtralForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.net(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CountBytes(L.Callback):
    """Rows sent to other ranks by float all_to_all_single calls during training step ``step``, and
    that step's tokens per expert by layer from the routers' own logits (``routed``)."""

    def __init__(self, step: int) -> None:
        self.step, self.sent, self.counting = step, 0, False
        self.routed: dict[str, torch.Tensor] = {}

    def _route(self, name: str, router: torch.nn.Module, args: Any, output: Any) -> None:
        """Mixtral's router returns (logits, weights, indices): the top-k is taken again from the logits."""
        if self.counting and router.training:
            top = torch.topk(output[0], router.top_k, dim=-1).indices
            counts = torch.bincount(top.flatten(), minlength=router.num_experts)
            self.routed[name] = self.routed.get(name, 0) + counts

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import functools

        import torch.distributed as dist

        for name, module in pl_module.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(functools.partial(self._route, name))

        original = dist.all_to_all_single

        def counted(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            if self.counting and tensor.is_floating_point():
                rank = dist.get_rank(group)
                rows = sum(input_split_sizes) - input_split_sizes[rank]
                self.sent += rows * tensor[0].numel() * tensor.element_size()
            return original(output, tensor, output_split_sizes, input_split_sizes, group=group, **kwargs)

        dist.all_to_all_single = counted
        self._restore = lambda: setattr(dist, "all_to_all_single", original)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counting = trainer.global_step == self.step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counting = False


class StepTimes(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._start = warmup, [], 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def _data(shape: dict, steps: int):
    from recipes.data import MarkovDataModule

    seq, batch = shape["seq_length"], shape["batch"]
    return MarkovDataModule(
        vocab_size=shape["vocab_size"],
        seq_length=seq,
        batch_size=batch,
        train_tokens=(steps + 2) * batch * WORLD_SIZE * (seq + 1),
        val_tokens=2 * (seq + 1),
    )


def fit(e: int, steps: int, warmup: int, model: dict, shape: dict) -> dict:
    """One run at expert_parallel_size=e: bytes of step ``warmup``, memory at rest after step 2, step times."""
    from lightning_ptdp import PTDPStrategy

    L.seed_everything(0, verbose=False)
    memory = Measure()  # its baseline: just before the model is built
    count, times = CountBytes(step=warmup), StepTimes(warmup)
    net = MixtralLM(model, shape)
    trainer = quiet_trainer(
        devices=WORLD_SIZE,
        strategy=PTDPStrategy(expert_parallel_size=e),
        max_steps=steps,
        callbacks=[memory, count, times],
    )
    trainer.fit(net, _data(shape, steps))
    experts = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    held = sum(p.numel() for p in net.parameters())
    return {
        "sent_bytes": count.sent,
        "routed": {k: v.tolist() for k, v in count.routed.items()},
        "memory_at_rest": memory.result.get("allocator_at_rest"),
        "params_held": held,
        "expert_params_held": experts,
        "step_seconds": statistics.median(times.times),
    }


def routed_bytes(per_rank_routed: list[dict], e: int, hidden: int, experts: int) -> list[int]:
    """Per rank, forward and backward: rows to experts another rank of its ep group holds, and rows
    it receives for its own experts from them, times hidden x 4 bytes; the backward mirrors both."""
    local = experts // e
    out = []
    for rank, routed in enumerate(per_rank_routed):
        group = [r for r in range(len(per_rank_routed)) if r // e == rank // e]
        own = range((rank % e) * local, (rank % e + 1) * local)
        rows = 0
        for layer, counts in routed.items():
            rows += sum(c for j, c in enumerate(counts) if j not in own)  # dispatched off-rank
            rows += sum(per_rank_routed[r][layer][j] for r in group if r != rank for j in own)  # combined back
        out.append(2 * rows * hidden * 4)
    return out


def run(
    *,
    rounds: int = 3,
    steps: int = 10,
    warmup: int = 3,
    model: dict | None = None,
    shape: dict | None = None,
    pool=None,
) -> dict:
    model, shape = {**MODEL, **(model or {})}, {**SHAPE, **(shape or {})}
    hidden, k, n_experts = model["hidden_size"], model["num_experts_per_tok"], model["num_local_experts"]
    tokens = shape["batch"] * shape["seq_length"]
    results: dict[int, list[list[dict]]] = {1: [], 2: [], 4: []}
    with pool_of(WORLD_SIZE, pool) as workers:
        workers.run(fit, 2, steps, warmup, model, shape)  # warm-up, not recorded
        for index in range(rounds):
            for e in (1, 2, 4) if index % 2 == 0 else (4, 2, 1):  # none always runs first
                results[e].append(workers.run(fit, e, steps, warmup, model, shape))
    rows = []
    for e, per_round in results.items():
        first = per_round[0]
        uniform = 4 * tokens * k * (e - 1) / e * hidden * 4 * shape["num_layers"]
        routed = routed_bytes([r["routed"] for r in first], e, hidden, n_experts) if e > 1 else [0] * WORLD_SIZE
        dense = first[0]["params_held"] - first[0]["expert_params_held"]
        rows.append(
            {
                "e": e,
                "sent_bytes_per_rank": [r["sent_bytes"] for r in first],
                "formula_routed_bytes_per_rank": routed,
                "formula_uniform_bytes_per_rank": uniform,
                "expert_params_per_rank": first[0]["expert_params_held"],
                "dense_params_per_rank": dense,
                "memory_at_rest": stats([r["memory_at_rest"] for results_ in per_round for r in results_]),
                "formula_model_state_bytes": 16 * first[0]["params_held"],
                "step_seconds": stats([results_[0]["step_seconds"] for results_ in per_round]),
            }
        )
    seconds = {e: [r[0]["step_seconds"] for r in per_round] for e, per_round in results.items()}
    return {
        "benchmark": "expert_parallel",
        "sizes": {"world_size": WORLD_SIZE, "rounds": rounds, "steps": steps, "warmup": warmup, **model, **shape},
        "rows": rows,
        "step_time_e2_over_e1": paired_ratio(seconds[2], seconds[1]),
        "step_time_e4_over_e1": paired_ratio(seconds[4], seconds[1]),
    }


def markdown(result: dict) -> str:
    s, mib = result["sizes"], 2**20
    lines = []
    base = result["rows"][0]  # e = 1
    for r in result["rows"]:
        measured_share = r["memory_at_rest"]["median"] / base["memory_at_rest"]["median"]
        formula_share = r["formula_model_state_bytes"] / base["formula_model_state_bytes"]
        exact = r["sent_bytes_per_rank"] == r["formula_routed_bytes_per_rank"]
        sent = statistics.mean(r["sent_bytes_per_rank"])
        lines.append(
            f"| {r['e']} | {sent / mib:.3f} | {statistics.mean(r['formula_routed_bytes_per_rank']) / mib:.3f} "
            f"({'equal on every rank' if exact else 'DIFFERS'}) | {r['formula_uniform_bytes_per_rank'] / mib:.3f} "
            f"| {r['expert_params_per_rank']} | {r['memory_at_rest']['median'] / mib:.2f} "
            f"| {r['formula_model_state_bytes'] / mib:.2f} | {measured_share:.3f} / {formula_share:.3f} "
            f"| {spread(r['step_seconds'])} |"
        )
    table = "\n".join("  " + line for line in lines)
    return f"""- Sizes: {s["world_size"]} gloo ranks (d = 4), 1 thread each; transformers Mixtral, {s["num_layers"]} layers,
  h={s["hidden_size"]}, {s["num_local_experts"]} experts of width {s["intermediate_size"]}, top-{s["num_experts_per_tok"]},
  V={s["vocab_size"]}, s={s["seq_length"]}, batch {s["batch"]} per rank; fp32, AdamW; {s["steps"]} steps per run,
  bytes counted in step {s["warmup"] + 1}, times after {s["warmup"]} warm-up steps; one unrecorded run, then
  {s["rounds"]} rounds of e = 1, 2, 4, the order reversed every other round.
- Bytes: what each rank's float `all_to_all_single` calls send to other ranks in one step (forward
  and backward), from their split sizes; the routed formula is the same traffic computed from the
  tokens per expert of each router's top-k on the step's input (counted by a hook on the router, not
  by the exchange), the uniform one the traffic chapter's 4 N k (e-1)/e H b per layer.
- Memory: glibc malloc in use at rest after step 2, minus before the model (bench_memory.py's
  measure); formula: 16 bytes per parameter the rank holds.

  | e | sent MiB per rank (mean) | formula, routed | formula, uniform | expert params per rank | measured at rest MiB | formula MiB | of e = 1: measured / formula | s per step |
  |---|---|---|---|---|---|---|---|---|
{table}

  Step time per round, e = 2 / e = 1: {spread(result["step_time_e2_over_e1"])}; e = 4 / e = 1:
  {spread(result["step_time_e4_over_e1"])}.

  Memory: at e = 1 DDP's gradient buckets hold a second copy of every gradient (4 of the 16 bytes
  per parameter, as in the memory section); at e > 1 DDP leaves the experts out (they average over
  their own group), so the measured share of e = 1 falls below the formula's. Time: on this shared
  2-core CPU the exchange (two all-to-alls per layer and their count exchanges, forward and
  backward) {_time_verdict(result)}: the experts' FLOPs per token do not change
  with e, only their memory does.
"""


def _time_verdict(result: dict) -> str:
    """What the rounds' step-time ratios (e = 2 and 4 over e = 1) show, in words."""
    ratios = (result["step_time_e2_over_e1"], result["step_time_e4_over_e1"])
    if all(r["min"] > 1 for r in ratios):
        return "costs more than holding fewer experts saves"
    if all(r["max"] < 1 for r in ratios):
        return "costs less than holding fewer experts saves"
    return "costs about what holding fewer experts saves (the rounds' ratios fall on both sides of 1)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(rounds=args.rounds), indent=1))


if __name__ == "__main__":
    main()
