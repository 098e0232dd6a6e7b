"""Model-state memory per rank for each ZeRO stage on several (t, p, d) layouts: measured from the
C allocator (at rest after an optimizer step, and the peak during that step), beside the formulas.

    python -m benchmarks.bench_memory [--rounds 1]

4 gloo ranks, fp32 ("32-true"), AdamW, 2 training steps; step 2 (optimizer state exists) is measured.

Measured: the bytes glibc's malloc has handed out and not taken back (``mallinfo2()``: in-use
bytes of every arena plus mmapped chunks; torch's CPU allocator allocates through it), in this
rank's process, minus the same figure just before the model is built. "At rest" is that after
step 2's optimizer step: weights, gradients, Adam moments and everything else the run keeps
(DDP's gradient buckets, FSDP's buffers, Lightning's and the strategy's objects). "Peak" is the
largest of the figure sampled every millisecond by a thread during step 2 and at its hooks (a
spike shorter than that can be missed). Not torch.profiler's memory events: it only sees
allocations and frees made on the thread that started it, and gloo and autograd free tensors on
others (its live totals differed between ranks of one configuration by megabytes). Not RSS: glibc
keeps freed pages.

Formulas: 16 bytes per parameter this rank would hold without ZeRO (4 weight + 4 gradient + 8 Adam
moments; with bf16 mixed precision the ZeRO paper's 2 + 2 + 12 is also 16), divided as each stage
divides it over d: stage 0: 4 + 4 + 8, stage 1: 4 + 4 + 8/d, stage 2: 4 + (4 + 8)/d, stage 3: 16/d.
ptdp's stage 1 is that (torch's ZeroRedundancyOptimizer: whole weights and gradients, Adam
moments of the parameters the rank owns); its stages 2 and 3 are FSDP2, which keeps weights and
gradients sharded at rest in both (stage 2 keeps the gathered weights from forward until backward,
stage 3 gathers them again), so ptdp's formula at rest is 16/d for stages 2-3. A third formula column sums numel * element_size of
the tensors the rank's parameters, gradients and optimizer state hold: that too is a formula (what
those tensors should occupy), not a measurement. Prints JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import threading

import lightning as L
import torch

from benchmarks.results import pool_of, stats
from lightning_ptdp.data_parallel.zero1 import local_optimizer
from lightning_ptdp.testing import quiet_trainer

TITLE = "model-state memory per rank for each ZeRO stage, from the allocator (issue 5)"
MODEL = {"vocab_size": 512, "seq_length": 64, "num_layers": 4, "num_heads": 8, "hidden_size": 256}
WORLD_SIZE = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (t, p) on 4 ranks; d = 4 / (t * p)
MEASURED_STEP = 1  # global_step of the measured step (the second): Adam's state exists by then


def _bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_in_use() -> int:
    """Bytes glibc's malloc has allocated and not freed, all threads: arenas' in-use + mmapped chunks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class Sampler:
    """The largest ``malloc_in_use()`` seen by a thread polling every ``period`` s, and at ``sample()`` calls."""

    def __init__(self, period: float = 1e-3) -> None:
        self.period, self.peak = period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> int:
        value = malloc_in_use()
        self.peak = max(self.peak, value)
        return value

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.sample()


class Measure(L.Callback):
    """Allocator figures around the measured step, and the tensor bytes of the model state (a formula)."""

    def __init__(self) -> None:
        self.baseline = malloc_in_use()  # built just before the model
        self.sampler = Sampler()
        self.result: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == MEASURED_STEP:
            self.result["allocator_at_step_start"] = malloc_in_use() - self.baseline
            self.sampler.start()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == MEASURED_STEP:
            self.sampler.sample()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != MEASURED_STEP:
            return
        self.sampler.sample()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        holder = local_optimizer(optimizer)  # ZeRO-1: the local optimizer holds this rank's share
        state = [v for p in params for v in holder.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
        self.result["tensor_bytes"] = {
            "weights": sum(_bytes(p) for p in params),
            "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
            "adam": sum(_bytes(v) for v in state),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == MEASURED_STEP + 1:  # after the measured step's optimizer step
            self.result["allocator_at_rest"] = self.sampler.stop() - self.baseline
            self.result["allocator_peak_in_step"] = self.sampler.peak - self.baseline


def measure(t: int, p: int, zero: int) -> dict:
    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    kwargs = {"tensor_parallel_size": t, "pipeline_parallel_size": p, "zero_stage": zero}
    if p > 1:
        kwargs["micro_batch_size"] = 2
    seq = MODEL["seq_length"]
    data = MarkovDataModule(
        vocab_size=MODEL["vocab_size"],
        seq_length=seq,
        batch_size=4,
        train_tokens=16 * 4 * (seq + 1),
        val_tokens=2 * (seq + 1),
    )
    gc.collect()  # the pool's process ran other configurations: their leftovers must not be freed during this one
    callback = Measure()
    model = GPTLightningModule(GPTConfig(**MODEL))
    trainer = quiet_trainer(
        devices=WORLD_SIZE,
        max_steps=MEASURED_STEP + 1,
        callbacks=[callback],
        strategy=PTDPStrategy(**kwargs),
    )
    trainer.fit(model, data)
    return callback.result


def formula(unsharded_params: int, zero: int, d: int, ptdp: bool = False) -> float:
    """Bytes at rest: the ZeRO paper's division per stage, or ptdp's (stages 2-3 are FSDP2: all over d)."""
    weight, grad, adam = 4.0, 4.0, 8.0
    if zero >= 1:
        adam /= d
    if zero >= 2:
        grad /= d
    if zero >= 3 or (zero >= 2 and ptdp):
        weight /= d
    return unsharded_params * (weight + grad + adam)


def run(*, rounds: int = 1, layouts: list | None = None, pool=None) -> dict:
    configs = [(t, p, zero) for t, p in layouts or LAYOUTS for zero in (0, 1, 2, 3)]
    per_config: dict[tuple, list[list[dict]]] = {c: [] for c in configs}
    with pool_of(WORLD_SIZE, pool) as workers:
        for index in range(rounds):
            for config in configs if index % 2 == 0 else configs[::-1]:
                per_config[config].append(workers.run(measure, *config))
    rows = []
    for (t, p, zero), per_round in per_config.items():
        d = WORLD_SIZE // (t * p)
        unsharded = [r["tensor_bytes"]["weights"] // 4 for r in per_config[(t, p, 0)][0]]  # per rank, zero 0
        samples = [(rank, r) for results in per_round for rank, r in enumerate(results)]
        ptdp = [formula(unsharded[rank], zero, d, ptdp=True) for rank, _ in samples]
        rest = [r["allocator_at_rest"] for _, r in samples]
        rank0 = per_round[0][0]
        rows.append(
            {
                "t": t,
                "p": p,
                "d": d,
                "zero": zero,
                "formula_zero_paper_rank0": formula(unsharded[0], zero, d),
                "formula_ptdp_rank0": formula(unsharded[0], zero, d, ptdp=True),
                "formula_tensor_bytes_rank0": rank0["tensor_bytes"],
                # over every rank and round: median and spread
                "allocator_at_rest": stats(rest),
                "allocator_peak_in_step": stats([r["allocator_peak_in_step"] for _, r in samples]),
                "allocator_at_rest_over_ptdp_formula": stats([m / f for m, f in zip(rest, ptdp)]),
            }
        )
    return {
        "benchmark": "model_state_memory_per_rank",
        "sizes": {
            "world_size": WORLD_SIZE,
            "rounds": rounds,
            "model": MODEL,
            "batch": 4,
            "micro_batch_size_when_p>1": 2,
            "measured_step": MEASURED_STEP + 1,
        },
        "rows": rows,
    }


def markdown(result: dict) -> str:
    s, m = result["sizes"], result["sizes"]["model"]
    mib = 2**20
    lines = []
    for r in result["rows"]:
        rest, peak, ratio = (
            r["allocator_at_rest"],
            r["allocator_peak_in_step"],
            r["allocator_at_rest_over_ptdp_formula"],
        )
        tensors = sum(r["formula_tensor_bytes_rank0"].values())
        lines.append(
            f"| {r['t']} | {r['p']} | {r['d']} | {r['zero']} | {r['formula_zero_paper_rank0'] / mib:.2f} "
            f"| {r['formula_ptdp_rank0'] / mib:.2f} | {tensors / mib:.2f} "
            f"| {rest['median'] / mib:.2f} ({rest['min'] / mib:.2f}-{rest['max'] / mib:.2f}) "
            f"| {peak['median'] / mib:.2f} ({peak['min'] / mib:.2f}-{peak['max'] / mib:.2f}) "
            f"| {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}) |"
        )
    table = "\n".join("  " + line for line in lines)
    rows = result["rows"]
    ddp = [r["allocator_at_rest_over_ptdp_formula"]["median"] for r in rows if r["zero"] <= 1 and r["d"] > 1]
    rest = [r["allocator_at_rest_over_ptdp_formula"]["median"] for r in rows if r["zero"] >= 2 or r["d"] == 1]
    return f"""- Sizes: {s["world_size"]} gloo ranks, 1 thread each; recipes GPT l={m["num_layers"]} h={m["hidden_size"]}
  a={m["num_heads"]} V={m["vocab_size"]} s={m["seq_length"]}, tied embedding, batch {s["batch"]} per replica
  (microbatches of {s["micro_batch_size_when_p>1"]} when p > 1); fp32, AdamW; step {s["measured_step"]} of
  {s["measured_step"]} measured; {s["rounds"]} round(s), configurations in alternating order.
- Measured: bytes in use in glibc's malloc (`mallinfo2()`, all threads; torch's CPU tensors are
  allocated through it) in each rank's process, minus that figure just before the model is built:
  after step {s["measured_step"]}'s optimizer step ("at rest") and the largest value sampled every 1 ms and
  at the step's hooks during it ("peak"). Medians over every rank (and round), min-max in brackets.
  It counts everything the run allocates, not only tensors (Lightning's and the strategy's objects,
  gloo's buffers).
- Formulas (not measurements): "ZeRO paper" = 16 bytes per parameter the rank holds without ZeRO,
  divided per stage (stage 1: Adam over d; 2: + gradients; 3: + weights); "ptdp" = the same for
  stage 1 (torch's ZeroRedundancyOptimizer), while its stages 2-3 (FSDP2) keep the weights sharded
  at rest too (16/d); "tensor bytes" = the sum of numel x element_size of rank 0's parameters,
  gradients and optimizer state.

  | t | p | d | zero | formula: ZeRO paper | formula: ptdp | formula: tensor bytes | measured at rest | measured peak in step | at rest / ptdp formula |
  |---|---|---|---|---|---|---|---|---|---|
{table}

  (MiB per rank; formulas for rank 0, whose pipeline stage holds the embedding.) **At rest, measured
  / ptdp formula: median {statistics.median(ddp):.3f} (range {min(ddp):.3f}-{max(ddp):.3f}) at ZeRO 0-1 with d > 1,
  where DDP's gradient buckets (p = 1) or the pipeline's dp gradient buckets (p > 1) keep a second
  copy of the gradients (4 of the 16 bytes per parameter); {statistics.median(rest):.3f} (range {min(rest):.3f}-{max(rest):.3f}) in every other row.** The rest of
  the excess at rest is what the run allocates besides the model state (the Trainer's, the
  strategy's and gloo's objects and buffers); the peak adds the step's activations and, at ZeRO 2-3,
  the gathered weights (stage 2 keeps them from forward to backward, so its peak is above stage 3's).
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(run(rounds=args.rounds), indent=1))


if __name__ == "__main__":
    main()
