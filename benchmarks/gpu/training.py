"""Part 4: single-GPU training throughput and MFU, ptdp with each kernel choice vs plain Lightning.

The recipes GPT at ~1.3B parameters (h=2048, l=24, a=16, V=50304, s=2048; tied embedding), AdamW,
bf16-mixed; every run starts from the same weights (drawn from one seed) and reads the same batches in
the same order (no sampler is injected; fingerprints checked, rounds.same_start):
  lightning       Trainer() with no ptdp
  ptdp-torch      Trainer(strategy=PTDPStrategy(kernels="torch"))
  ptdp-attention  kernels="auto" as if the suite had measured only the Triton attention faster here
  ptdp-bias-gelu  kernels="auto" as if it had measured only the Triton bias-GeLU faster here
  ptdp-triton     Trainer(strategy=PTDPStrategy(kernels="triton")): both kernels
  ptdp-auto       the default, kernels="auto": the run above that routes what it routes on this device
then compiled, every transformer block on its own (regional compilation), while the budget lasts:
  ptdp+compile+float8  and float8="tensorwise": the blocks' Linears in torchao's float8 (first losses
                       compared with ptdp+compile's, not held to the same-start rule); -rowwise: "rowwise"
  ptdp+compile         Trainer(strategy=PTDPStrategy(compile=...)): blocks compiled after ptdp's rewrites
  lightning+compile    Trainer() with block.compile() on every block before fit
Each group is timed in alternated rounds (rounds.py). TFLOP/s from flops.gpt_flops_per_iteration without
recompute (model FLOPs: 72Bslh^2(1 + s/6h + V/12lh)); MFU against the dense bf16 peak.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch

from benchmarks.gpu import rounds
from benchmarks.gpu.context import Context, short_error

BUDGET_S = 130.0
GPU_MODEL = {"vocab_size": 50304, "seq_length": 2048, "num_layers": 24, "num_heads": 16, "hidden_size": 2048}
SMOKE_MODEL = {"vocab_size": 128, "seq_length": 32, "num_layers": 2, "num_heads": 2, "hidden_size": 32}
GPU_BATCHES = (8, 4, 2)  # the first that fits in the first variant, then kept for all
GPU_STEPS, GPU_WARMUP = 8, 3  # per run: the spread between alternated runs, not within one, is what decides
COMPILE_MIN_S = 40.0  # a compiled round starts only with this much budget left
AUTO = "ptdp-auto"


@dataclass(frozen=True)
class Variant:
    name: str
    kernels: str | None  # None: plain Lightning
    compiled: bool = False
    routes: tuple[str, ...] = ()
    """The kernels the run routes ("auto" runs: as if the suite had measured exactly these faster here)."""
    float8: str | None = None
    """float8= recipe (torchao; emulated in --smoke)."""


VARIANTS = (
    Variant("lightning", None),
    Variant("ptdp-torch", "torch"),
    Variant("ptdp-attention", "auto", routes=("attention",)),
    Variant("ptdp-bias-gelu", "auto", routes=("bias_gelu",)),
    Variant("ptdp-triton", "triton", routes=("attention", "bias_gelu")),
    Variant("ptdp+compile+float8", "auto", True, float8="tensorwise"),
    Variant("ptdp+compile+float8-rowwise", "auto", True, float8="rowwise"),
    Variant("ptdp+compile", "auto", True),
    Variant("lightning+compile", None, True),
)
FLOAT8_BASE = "ptdp+compile"
"""What the float8 row's speed and first loss are compared with."""
SINGLE_KERNEL = {"attention": "ptdp-attention", "bias_gelu": "ptdp-bias-gelu"}
"""The variant that routes each kernel alone: its paired rounds against ptdp-torch decide "auto"."""


def _clock(warmup: int, cuda: bool):
    import lightning as L

    from lightning_ptdp.kernels import routed_kernels

    class StepClock(L.Callback):
        """Wall time of the steps after ``warmup`` (the GPU synchronised at both ends only), and what the
        run started from: the weights' float64 sum of squares, each batch's token sum, the first loss."""

        def __init__(self) -> None:
            self.start = self.end = self.loss = self.first_loss = self.weights = None
            self.timed, self.batches, self.routed = 0, [], ()

        def on_train_start(self, trainer, pl_module) -> None:
            self.routed = routed_kernels(pl_module)
            with torch.no_grad():
                self.weights = float(sum(p.detach().double().square().sum() for p in pl_module.parameters()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batches.append(batch[0].sum())  # stays on the device: read after the timed steps

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if step == 1 and isinstance(outputs, dict):
                self.first_loss = float(outputs["loss"])
            if step == warmup or step == trainer.max_steps:
                if cuda:
                    torch.cuda.synchronize()
                if step == warmup:
                    self.start = time.perf_counter()
                else:
                    self.end, self.timed = time.perf_counter(), step - warmup
                    self.loss = float(outputs["loss"]) if isinstance(outputs, dict) else None

        def on_train_end(self, trainer, pl_module) -> None:
            """Drop Adam's moments and the gradients before teardown copies the model to the CPU."""
            self.batches = [int(b) for b in self.batches]
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
            pl_module.zero_grad(set_to_none=True)

    return StepClock()


def build(cfg, device: torch.device, *, seed: int = 0):
    """The recipes GPT, its recipe's init rules drawn on ``device`` from ``seed``: every variant gets
    the same weights in well under a second (the recipe's layout-independent CPU init of 1.3B
    parameters takes most of a minute)."""
    from lightning_ptdp.parallel.init import Constant
    from recipes.gpt import GPTLightningModule

    with torch.device("meta"):
        module = GPTLightningModule(cfg)
    module.to_empty(device=device)  # gives every Parameter its own storage: the tie is broken here
    if cfg.tie_embeddings:
        module.gpt.lm_head.weight = module.gpt.token_embedding.weight
    tied = module.gpt.lm_head.weight is module.gpt.token_embedding.weight
    assert tied == cfg.tie_embeddings, "the head's tie to the embedding must survive to_empty"
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.gpt.named_parameters():
            rule = module.gpt.init_rule(name)
            if isinstance(rule, Constant):
                param.fill_(rule.value)
            else:
                param.normal_(rule.mean, rule.std)
    return module


@contextmanager
def _auto_measured(ctx: Context, variant: Variant):
    """For an "auto" run with ``routes``: this device class's entry of the measured table set to them."""
    from lightning_ptdp import kernels

    name = kernels.device_class(ctx.device)
    if variant.kernels != "auto" or not variant.routes or name is None:  # off CUDA "auto" routes nothing
        yield
        return
    with mock.patch.dict(kernels.MEASURED_FASTER, {name: frozenset(variant.routes)}):
        yield


def fit(
    ctx: Context,
    model: dict,
    variant: Variant,
    batch: int,
    steps: int,
    warmup: int,
    *,
    seed: int = 0,
    first_row: int = 0,
) -> dict:
    """One run of ``variant``; ``seed`` and ``first_row`` move the weights and the batches (every run of
    the suite uses 0 and 0: other values are the negative controls of rounds.same_start)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.testing import quiet_trainer
    from recipes.gpt import GPTConfig

    cfg = GPTConfig(**model)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (first_row + steps * batch, cfg.seq_length + 1), generator=gen)
    tokens = rows[first_row:]
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    module = build(cfg, ctx.device, seed=seed)
    built = sum(p.numel() for p in module.parameters())  # a tied weight once
    backend = "inductor" if ctx.cuda else "eager"  # smoke: dynamo's whole path without a C++ build
    if variant.compiled and variant.kernels is None:  # plain Lightning: the user compiles the blocks
        for block in module.gpt.blocks:
            block.compile(backend=backend)
    strategy = "auto"
    if variant.kernels is not None:
        float8 = {"recipe": variant.float8, "emulate": not ctx.cuda} if variant.float8 else None
        compiled = {"backend": backend} if variant.compiled else False
        strategy = PTDPStrategy(kernels=variant.kernels, compile=compiled, float8=float8)
    clock = _clock(warmup, ctx.cuda)
    trainer = quiet_trainer(
        accelerator="gpu" if ctx.cuda else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        strategy=strategy,
        callbacks=[clock],
        use_distributed_sampler=False,  # ptdp is a distributed strategy: Lightning would shuffle its rows
    )
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    try:
        with _auto_measured(ctx, variant):
            trainer.fit(module, train_dataloaders=loader)
    finally:
        del trainer, module
        gc.collect()
        if variant.compiled:
            torch._dynamo.reset()
        ctx.free()
    seconds = clock.end - clock.start
    return {
        "tokens_per_s": clock.timed * batch * cfg.seq_length / seconds,
        "step_s": seconds / clock.timed,
        "timed_steps": clock.timed,
        "parameters_built": built,
        "routed": list(clock.routed),
        "first_loss": clock.first_loss,
        "final_loss": clock.loss,
        "weights": clock.weights,
        "batches": clock.batches,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if ctx.cuda else None,
        "wall_s": time.monotonic() - started,
    }


def _first_fit(ctx: Context, model: dict, variant: Variant, batches: list[int], steps: int, warmup: int) -> dict:
    """The first run fixes the batch: the largest of ``batches`` that fits."""
    while True:
        try:
            return {"batch": batches[0], **fit(ctx, model, variant, batches[0], steps, warmup)}
        except torch.cuda.OutOfMemoryError:
            if len(batches) == 1:
                raise
            batches.pop(0)


def _run_rounds(ctx: Context, rows: dict[str, dict], variants: list[Variant], plan: dict) -> int:
    """Alternated rounds of ``variants`` while the budget lasts (a round starts only if the last one's
    time is left, a compiled one with COMPILE_MIN_S at least); returns the rounds completed."""
    done, last_s = 0, 0.0
    for index in range(rounds.ROUNDS):
        needed = max(last_s, COMPILE_MIN_S if variants[0].compiled and not ctx.smoke else 0.0)
        if (index or variants[0].compiled) and ctx.seconds_left() < needed:
            break
        started = time.monotonic()
        for slot, variant in enumerate(rounds.rotated(variants, index)):
            row = rows[variant.name]
            if "error" in row:
                continue
            try:
                if plan["batch"] is None:
                    run = _first_fit(ctx, plan["model"], variant, plan["batches"], plan["steps"], plan["warmup"])
                    plan["batch"] = run.pop("batch")
                else:
                    run = fit(ctx, plan["model"], variant, plan["batch"], plan["steps"], plan["warmup"])
            except Exception as err:  # noqa: BLE001 - e.g. torch.compile failing on one variant
                row["error"] = short_error(err)
                continue
            row["batch"], row["parameters_built"] = plan["batch"], run["parameters_built"]
            row["runs"].append({"round": index, "slot": slot, **run})
            rounds.summarise(row)
        done, last_s = index + 1, time.monotonic() - started
    return done


def _row(variant: Variant) -> dict:
    kernels = variant.kernels or "torch (no ptdp)"
    return {
        "variant": variant.name,
        "kernels": kernels,
        "routes": list(variant.routes),
        "compiled": variant.compiled,
        "float8": variant.float8,
        "runs": [],
    }


def _auto_row(ctx: Context, rows: dict[str, dict]) -> dict:
    """ptdp-auto is the eager run that routes what "auto" routes here: the same configuration, not timed twice."""
    from lightning_ptdp.kernels import auto_routes

    routes = tuple(sorted(auto_routes(ctx.device)[0]))
    twin = next(v.name for v in VARIANTS if not v.compiled and v.kernels is not None and v.routes == routes)
    return {**rows[twin], "variant": AUTO, "kernels": "auto", "routes": list(routes), "same_run_as": twin}


def _verdict(ctx: Context, by_name: dict[str, dict], eager_rounds: int) -> dict:
    """The kernels measured faster end to end here, against what lightning_ptdp.kernels.MEASURED_FASTER routes."""
    from lightning_ptdp.kernels import MEASURED_FASTER, device_class

    name = device_class(ctx.device)
    faster = rounds.measured_faster(by_name, SINGLE_KERNEL)
    table = MEASURED_FASTER.get(name) if name else None
    return {
        "device_class": name,
        "rounds": eager_rounds,
        "rule": f"a kernel is faster when ptdp routing it alone beat {rounds.BASELINE} in each of "
        f">= {rounds.ROUNDS} alternated rounds",
        "measured_faster": faster if eager_rounds >= rounds.ROUNDS else None,
        "table_routes": sorted(table) if table is not None else None,
        "table_agrees": table is not None and eager_rounds >= rounds.ROUNDS and sorted(table) == faster,
    }


def run(ctx: Context, rows: list[dict]) -> dict:
    from lightning_ptdp.core.flops import gpt_flops_per_iteration, gpt_parameter_count

    model = SMOKE_MODEL if ctx.smoke else GPU_MODEL
    steps, warmup = (3, 1) if ctx.smoke else (GPU_STEPS, GPU_WARMUP)
    params = gpt_parameter_count(model["num_layers"], model["hidden_size"], model["vocab_size"], model["seq_length"])
    info = {
        "model": model,
        "parameters": params,
        "steps": steps,
        "warmup_steps": warmup,
        "precision": "bf16-mixed",
        "optimizer": "AdamW",
        "flops_formula": "72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) per step (flops.gpt_flops_per_iteration, "
        "activation_recompute=False)",
        "peak_flops": ctx.peak_flops,
    }
    variants = [v for v in VARIANTS if ctx.variants is None or v.name in ctx.variants]
    by_name = {v.name: _row(v) for v in variants}
    rows.extend(by_name.values())  # filled in place round by round: a part stopped at its budget keeps them
    plan = {"model": model, "steps": steps, "warmup": warmup, "batch": None, "batches": list(GPU_BATCHES)}
    if ctx.smoke:
        plan["batches"] = [2]
    eager = [v for v in variants if not v.compiled]
    info["eager_rounds"] = _run_rounds(ctx, by_name, eager, plan) if eager else 0
    compiled = [v for v in variants if v.compiled]
    info["compiled_rounds"] = _run_rounds(ctx, by_name, compiled, plan) if compiled else 0
    for row in rows:
        if not row.get("runs") and "error" not in row:
            row.setdefault("skipped", f"under {COMPILE_MIN_S:.0f} s of the part's budget left")
    timed = {name: row for name, row in by_name.items() if row.get("runs")}
    flops = gpt_flops_per_iteration(
        batch_size=plan["batch"] or 0,
        seq_length=model["seq_length"],
        num_layers=model["num_layers"],
        hidden_size=model["hidden_size"],
        vocab_size=model["vocab_size"],
        activation_recompute=False,
    )
    for row in timed.values():
        row["tflops"] = flops / row["step_s"] / 1e12
        row["mfu"] = row["tflops"] * 1e12 / ctx.peak_flops if ctx.peak_flops else None
        base = timed.get("lightning+compile" if row["compiled"] else "lightning")
        if row["kernels"] != "torch (no ptdp)" and base is not None:
            rounds.add_ratio(row, base, "lightning")
        if row["variant"] in SINGLE_KERNEL.values() or row["variant"] == "ptdp-triton":
            rounds.add_ratio(row, timed.get(rounds.BASELINE, {"runs": []}), "ptdp_torch")
        if row["float8"] and FLOAT8_BASE in timed:
            rounds.add_ratio(row, timed[FLOAT8_BASE], "bf16")
    if rounds.BASELINE in timed and eager and all(v.name in timed for v in eager):
        rows.insert(len(eager), _auto_row(ctx, by_name))
    # float8 rounds the first forward differently: held to the same batches and weights, its loss compared apart
    same = [run for row in timed.values() if not row["float8"] for run in row["runs"]]
    info.update(rounds.same_start(same))
    info["float8_first_loss"] = _float8_first_loss(timed)
    info["auto"] = _verdict(ctx, timed, info["eager_rounds"])
    return info


def _float8_first_loss(timed: dict[str, dict]) -> dict[str, dict]:
    """Each float8 run's first loss against the bf16 run's (same weights and batch): how far float8 moved it."""
    if FLOAT8_BASE not in timed:
        return {}
    base = timed[FLOAT8_BASE]["runs"][0]
    found = {}
    for name in (n for n, row in timed.items() if row["float8"]):
        run = timed[name]["runs"][0]
        same_input = (tuple(run["batches"]), run["weights"]) == (tuple(base["batches"]), base["weights"])
        gap = abs(run["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
        found[name] = {
            "float8": run["first_loss"],
            "bf16": base["first_loss"],
            "relative_gap": gap,
            "same_input": same_input,
        }
    return found


def _range(row: dict, key: str, fmt: str) -> str:
    low, high = row.get(f"{key}_range") or (None, None)
    return "-" if key not in row else f"{row[key]:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def markdown(record: dict) -> str:
    params = record.get("parameters")
    steps = f"{record.get('steps', 0) - record.get('warmup_steps', 0)} timed steps after {record.get('warmup_steps')}"
    lines = [
        f"Training on one device: recipes GPT {record.get('model')} ({params / 1e9:.3g}B parameters), "
        f"bf16-mixed, AdamW, {steps} per run; {record.get('eager_rounds')} alternated rounds of the eager "
        f"variants and {record.get('compiled_rounds')} of the compiled ones (order rotated each round): medians "
        f"over rounds, min-max in brackets, ratios paired by round. TFLOP/s by {record.get('flops_formula')}."
        if params
        else "Training:",
        "",
        "| variant | routes | batch | tokens/s (min-max) | TFLOP/s | MFU | vs Lightning | vs ptdp-torch | peak GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record.get("rows", []):
        routes = ", ".join(r.get("routes", [])) or "-"
        if "tokens_per_s" not in r:
            lines.append(
                f"| {r['variant']} | {routes} | {r.get('batch', '')} | {r.get('error') or r.get('skipped')} | | | | | |"
            )
            continue
        tokens = f"{r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f})"
        if r.get("same_run_as"):
            tokens = f"= {r['same_run_as']}"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
        lines.append(
            f"| {r['variant']} | {routes} | {r['batch']} | {tokens} | {r['tflops']:.1f} | {mfu} | "
            f"{_range(r, 'ratio_vs_lightning', '.3f')} | {_range(r, 'ratio_vs_ptdp_torch', '.3f')} | {mem} |"
        )
    return "\n".join([*lines, "", *_notes(record)])


def _notes(record: dict) -> list[str]:
    auto = record.get("auto")
    if not auto:
        return []
    start = (
        f"Same start: first losses within {record['first_loss_gap']:.2g} of each other (rule: "
        f"{record['first_loss_rtol']:g} of the loss; {'agree' if record['first_losses_agree'] else 'DISAGREE'}), "
        f"batches {'identical' if record['batches_agree'] else 'DIFFERENT'}, weights "
        f"{'identical' if record['weights_agree'] else 'DIFFERENT'} over {record['runs_checked']} runs."
    )
    faster = auto["measured_faster"]
    measured = "too few rounds to choose" if faster is None else ", ".join(faster) or "none"
    if auto["device_class"] is None:
        table = "off CUDA it routes nothing"
    else:
        entry = auto["table_routes"]
        routes = "no entry (nothing)" if entry is None else ", ".join(entry) or "nothing"
        verdict = "agrees" if auto["table_agrees"] else "update it from this run" if faster is not None else "kept"
        table = f"lightning_ptdp.kernels.MEASURED_FASTER routes {routes} on {auto['device_class']} ({verdict})"
    lines = [start, "", f"kernels='auto': measured faster end to end ({auto['rule']}): {measured}; {table}."]
    rows = {r["variant"]: r for r in record.get("rows", [])}
    for name, float8 in (record.get("float8_first_loss") or {}).items():
        speed = _range(rows[name], "ratio_vs_bf16", ".3f") if "ratio_vs_bf16" in rows.get(name, {}) else "-"
        lines += [
            "",
            f"{name} against {FLOAT8_BASE}: tokens/s ratio {speed} (paired by round); first loss "
            f"{float8['float8']:.5f} against {float8['bf16']:.5f} (relative gap {float8['relative_gap']:.2g}; "
            f"{'same' if float8['same_input'] else 'DIFFERENT'} weights and batch).",
        ]
    return lines
