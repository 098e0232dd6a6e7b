"""Context parallelism on CPU: activation memory per rank from the allocator at c = 1, 2 and 4, the
key/value bytes each layer exchanges against the formula, and the step time, in alternated rounds.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_context [--rounds 3]

4 gloo ranks; the repository's GPT (learned positions) at a long sequence, fp32, AdamW, one sequence
per replica: c = 1 is d = 4 (each rank a whole sequence), c = 2 is d = 2, c = 4 is d = 1, so each
rank holds S / c tokens of one sequence.
Activations: glibc malloc in use just before backward (the forward's saved tensors, the logits and
the loss alive) minus at the step's start (bench_memory.py's measure), in the measured step; and
the bytes autograd saves inside the blocks (saved-tensor hooks, each storage once), which context
parallelism splits but for the gathered keys and values each layer keeps for its backward; the
final norm, the head and the loss also run on each rank's tokens (the logits are 1/c too).
Bytes: what each rank receives from the other ranks in the blocks' all-gathers of one forward
(keys and values; the backward's reduce-scatters send as much), counted from the tensors, against
2 (c-1)/c B S n_kv d_head 4 bytes per layer (K and V, fp32); nothing else is gathered (the
sequence leaves the blocks cut). Time: seconds per step after warm-up, tokens per second over
the 4 ranks; c = 1, 2, 4 in every round, the order reversed every other round. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import lightning as L
import torch

from benchmarks.bench_memory import malloc_in_use
from benchmarks.results import paired_ratio, pool_of, spread, stats
from lightning_ptdp.testing import quiet_trainer

TITLE = "context parallelism: activation memory per rank, key/value bytes per layer, step time (issue 28)"
WORLD_SIZE = 4
MODEL = {"vocab_size": 256, "seq_length": 4096, "num_layers": 2, "num_heads": 4, "hidden_size": 128}
MEASURED_STEP = 1  # global_step of the measured step


class Measure(L.Callback):
    """The allocator before backward minus at the step's start, the blocks' saved bytes, the
    all-gather bytes received, in the measured step; and step times after warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.result = warmup, [], {"gathers": []}
        self._start, self._saved, self._counting = 0.0, None, False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import torch.distributed as dist

        original = dist.all_gather_into_tensor

        def counted(output, tensor, group=None, **kwargs):
            if self._counting:  # the measured step's forward
                self.result["gathers"].append((output.numel() - tensor.numel()) * output.element_size())
            return original(output, tensor, group=group, **kwargs)

        dist.all_gather_into_tensor = counted
        self._restore = lambda: setattr(dist, "all_gather_into_tensor", original)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_ptdp.core.blocks import find_block_lists

        params = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
        measure = self

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()  # views of one storage (a narrowed key) count once
            key = storage.data_ptr()
            if measure._saved is not None and key not in params and key not in measure._seen:
                measure._seen.add(key)
                if tensor.dim() == 2 and bool(torch.isinf(tensor).any()):  # the causal masks (CPU), shared
                    measure._masks += storage.nbytes()
                else:
                    measure._saved += storage.nbytes()
            return tensor

        def enter(*args: Any) -> None:
            measure._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)
            measure._hooks.__enter__()

        def leave(*args: Any) -> None:
            measure._hooks.__exit__(None, None, None)

        for _, blocks in find_block_lists(pl_module):
            for block in blocks:
                block.register_forward_pre_hook(enter)
                block.register_forward_hook(leave)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == MEASURED_STEP:
            self._saved, self._seen, self._counting, self._masks = 0, set(), True, 0
            self.result["at_start"] = malloc_in_use()
        self._start = time.perf_counter()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == MEASURED_STEP:
            self.result["activations"] = malloc_in_use() - self.result["at_start"]
            self.result["block_saved"], self._saved, self._counting = self._saved, None, False
            self.result["masks"] = self._masks

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def fit(c: int, steps: int, warmup: int, model: dict) -> dict:
    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule, OptimConfig

    L.seed_everything(0, verbose=False)
    measure = Measure(warmup)
    net = GPTLightningModule(GPTConfig(**model), OptimConfig(lr=1e-3, warmup_steps=1, max_steps=steps))
    seq = model["seq_length"]
    data = MarkovDataModule(
        vocab_size=model["vocab_size"],
        seq_length=seq,
        batch_size=1,
        train_tokens=(steps + 2) * WORLD_SIZE * (seq + 1),
        val_tokens=2 * (seq + 1),
    )
    trainer = quiet_trainer(
        devices=WORLD_SIZE, strategy=PTDPStrategy(context_parallel_size=c), max_steps=steps, callbacks=[measure]
    )
    trainer.fit(net, data)
    return {**measure.result, "step_seconds": statistics.median(measure.times)}


def run(*, rounds: int = 3, steps: int = 6, warmup: int = 2, model: dict | None = None, pool=None) -> dict:
    model = {**MODEL, **(model or {})}
    batch, seq, hidden, layers = 1, model["seq_length"], model["hidden_size"], model["num_layers"]
    results: dict[int, list[list[dict]]] = {1: [], 2: [], 4: []}
    with pool_of(WORLD_SIZE, pool) as workers:
        workers.run(fit, 2, 3, 1, model)  # warm-up, not recorded
        for index in range(rounds):
            for c in (1, 2, 4) if index % 2 == 0 else (4, 2, 1):
                results[c].append(workers.run(fit, c, steps, warmup, model))
    rows = []
    for c, per_round in results.items():
        first = per_round[0][0]
        layer_gathers = first["gathers"]  # keys and values only: the sequence leaves the blocks cut
        rows.append(
            {
                "c": c,
                "activation_bytes": stats([r["activations"] for rr in per_round for r in rr]),
                "block_saved_bytes": stats([r["block_saved"] for rr in per_round for r in rr]),
                "mask_bytes": first["masks"],
                "formula_gathered_kv_bytes": 2 * batch * seq * hidden * 4 * layers if c > 1 else 0,
                "kv_bytes_per_layer": sum(layer_gathers) / layers,
                "formula_kv_bytes_per_layer": 2 * (c - 1) / c * batch * seq * hidden * 4,  # n_kv d_head = h (MHA)
                "step_seconds": stats([rr[0]["step_seconds"] for rr in per_round]),
                "tokens_per_second": stats([WORLD_SIZE // c * seq / rr[0]["step_seconds"] for rr in per_round]),
            }
        )
    seconds = {c: [rr[0]["step_seconds"] for rr in per_round] for c, per_round in results.items()}
    return {
        "benchmark": "context_parallel",
        "sizes": {"world_size": WORLD_SIZE, "rounds": rounds, "steps": steps, "warmup": warmup, **model},
        "rows": rows,
        "step_time_c2_over_c1": paired_ratio(seconds[2], seconds[1]),
        "step_time_c4_over_c1": paired_ratio(seconds[4], seconds[1]),
    }


def markdown(result: dict) -> str:
    s, mib = result["sizes"], 2**20
    base = result["rows"][0]
    lines = []
    for r in result["rows"]:
        act, saved = r["activation_bytes"]["median"], r["block_saved_bytes"]["median"]
        kv = r["formula_gathered_kv_bytes"]
        lines.append(
            f"| {r['c']} | {act / mib:.1f} | {act / base['activation_bytes']['median']:.3f} | {saved / mib:.1f} "
            f"| {saved / base['block_saved_bytes']['median']:.3f} | {kv / mib:.1f} "
            f"| {(saved - kv) / base['block_saved_bytes']['median']:.3f} | {r['mask_bytes'] / mib:.1f} "
            f"| {r['kv_bytes_per_layer'] / mib:.3f} "
            f"| {r['formula_kv_bytes_per_layer'] / mib:.3f} | {spread(r['step_seconds'])} "
            f"| {r['tokens_per_second']['median']:.0f} |"
        )
    table = "\n".join("  " + line for line in lines)
    return f"""- Sizes: {s["world_size"]} gloo ranks, 1 thread each; the repository's GPT, {s["num_layers"]} layers,
  h={s["hidden_size"]}, {s["num_heads"]} heads, V={s["vocab_size"]}, s={s["seq_length"]}, one sequence per replica
  (c = 1: d = 4; c = 2: d = 2; c = 4: d = 1); fp32, AdamW; {s["steps"]} steps per run, memory and bytes in
  step {MEASURED_STEP + 1}, times after {s["warmup"]} warm-up steps; one unrecorded run, then {s["rounds"]} rounds of
  c = 1, 2, 4, the order reversed every other round.
- Activations: glibc malloc in use before backward minus at the step's start (all ranks, all
  rounds); "saved in the blocks": bytes autograd saved inside the blocks (but the masks), of which each
  layer's gathered keys and values, whole (2 B S h 4 bytes per layer, by formula), and "the rest" is
  what is cut by c; "masks": the shared lower-right causal masks CPU attention takes (2-D, once per
  rank, the 2-D tensors holding -inf; on CUDA the kernels take lower-right causal natively). Bytes: received from the other
  ranks by one forward's all-gathers (the backward's reduce-scatters send as much), per layer
  against 2 (c-1)/c B S h 4 (keys and values, fp32; MHA: n_kv d_head = h); nothing else is
  gathered (the sequence leaves the blocks cut, the loss's shares are summed).

  | c | activations MiB | of c = 1 | saved in the blocks MiB | of c = 1 | of which gathered K/V (formula) MiB | the rest, of c = 1 | masks MiB | K/V MiB per layer | formula | s per step | tokens/s (4 ranks) |
  |---|---|---|---|---|---|---|---|---|---|---|---|
{table}

  Step time per round, c = 2 / c = 1: {spread(result["step_time_c2_over_c1"])}; c = 4 / c = 1:
  {spread(result["step_time_c4_over_c1"])} (c = 1 trains c times the tokens per step: compare tokens/s).

  Not divided by c: each layer's gathered keys and values (whole, for its backward) and, on CPU,
  the shared causal masks (made once per rank and sequence length, before the measured step).
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(rounds=args.rounds), indent=1))


if __name__ == "__main__":
    main()
