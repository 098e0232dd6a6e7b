"""Part 4: single-GPU training throughput and MFU, ptdp (Triton or torch kernels) vs plain Lightning.

The recipes GPT at ~1.3B parameters (h=2048, l=24, a=16, V=50304, s=2048; tied embedding), AdamW,
bf16-mixed, the same weights (drawn from one seed) and the same batch for every variant:
  ptdp-triton  Trainer(strategy=PTDPStrategy(kernels="triton"))
  ptdp-torch   Trainer(strategy=PTDPStrategy(kernels="torch"))
  ptdp-auto    Trainer(strategy="ptdp"): the default, kernels="auto" (on sm80+: Triton bias-GeLU only)
  lightning    Trainer() with no ptdp
then compiled, every transformer block on its own (regional compilation), while the budget lasts:
  ptdp+compile       Trainer(strategy=PTDPStrategy(compile=...)): blocks compiled after ptdp's rewrites
  lightning+compile  Trainer() with block.compile() on every block before fit
(ptdp's Triton kernels are not compiled: under compile inductor writes its own fused kernels.) TFLOP/s from flops.gpt_flops_per_iteration without recompute (the paper's formula
with 3 passes: 72Bslh^2(1 + s/6h + V/12lh), model FLOPs); MFU against the dense bf16 peak.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from benchmarks.gpu.context import Context, short_error

BUDGET_S = 130.0
GPU_MODEL = {"vocab_size": 50304, "seq_length": 2048, "num_layers": 24, "num_heads": 16, "hidden_size": 2048}
SMOKE_MODEL = {"vocab_size": 128, "seq_length": 32, "num_layers": 2, "num_heads": 2, "hidden_size": 32}
GPU_BATCHES = (8, 4, 2)  # the first that fits in the first variant, then kept for all
COMPILE_MIN_S = 40.0  # a compiled variant starts only with this much budget left


@dataclass(frozen=True)
class Variant:
    name: str
    kernels: str | None  # None: plain Lightning
    compiled: bool = False


VARIANTS = (
    Variant("ptdp-triton", "triton"),
    Variant("ptdp-torch", "torch"),
    Variant("ptdp-auto", "auto"),
    Variant("lightning", None),
    Variant("ptdp+compile", "auto", True),
    Variant("lightning+compile", None, True),
)


def _timer(warmup: int, cuda: bool):
    import lightning as L

    class StepClock(L.Callback):
        """Wall time of the steps after ``warmup``; the GPU is synchronised at both ends only."""

        def __init__(self) -> None:
            self.start = self.end = None
            self.timed = 0
            self.loss = self.first_loss = None

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
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
            pl_module.zero_grad(set_to_none=True)

    return StepClock()


def build(cfg, device: torch.device):
    """The recipes GPT, its recipe's init rules drawn on ``device`` from seed 0: every variant gets
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
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in module.gpt.named_parameters():
            rule = module.gpt.init_rule(name)
            if isinstance(rule, Constant):
                param.fill_(rule.value)
            else:
                param.normal_(rule.mean, rule.std)
    return module


def _fit(ctx: Context, model: dict, variant: Variant, batch: int, steps: int, warmup: int) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.core.flops import gpt_flops_per_iteration
    from lightning_ptdp.testing import quiet_trainer
    from recipes.gpt import GPTConfig

    cfg = GPTConfig(**model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (steps * batch, cfg.seq_length + 1), generator=gen)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    module = build(cfg, ctx.device)
    built = sum(p.numel() for p in module.parameters())  # a tied weight once
    backend = "inductor" if ctx.cuda else "eager"  # smoke: dynamo's whole path without a C++ build
    if variant.compiled and variant.kernels is None:  # plain Lightning: the user compiles the blocks
        for block in module.gpt.blocks:
            block.compile(backend=backend)
    strategy = "auto"
    if variant.kernels is not None:
        strategy = PTDPStrategy(kernels=variant.kernels, compile={"backend": backend} if variant.compiled else False)
    clock = _timer(warmup, ctx.cuda)
    trainer = quiet_trainer(
        accelerator="gpu" if ctx.cuda else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        strategy=strategy,
        callbacks=[clock],
    )
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.fit(module, train_dataloaders=loader)
    finally:
        del trainer, module
        gc.collect()
        if variant.compiled:
            torch._dynamo.reset()
        ctx.free()
    seconds = clock.end - clock.start
    flops = gpt_flops_per_iteration(
        batch_size=batch,
        seq_length=cfg.seq_length,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        activation_recompute=False,
    )
    tflops = clock.timed * flops / seconds / 1e12
    return {
        "tokens_per_s": clock.timed * batch * cfg.seq_length / seconds,
        "tflops": tflops,
        "mfu": tflops * 1e12 / ctx.peak_flops if ctx.peak_flops else None,
        "step_s": seconds / clock.timed,
        "timed_steps": clock.timed,
        "parameters_built": built,
        "first_loss": clock.first_loss,
        "final_loss": clock.loss,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if ctx.cuda else None,
    }


def run(ctx: Context, rows: list[dict]) -> dict:
    from lightning_ptdp.core.flops import gpt_parameter_count

    model = SMOKE_MODEL if ctx.smoke else GPU_MODEL
    steps, warmup = (3, 1) if ctx.smoke else (12, 4)
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
    batches = list((2,) if ctx.smoke else GPU_BATCHES)
    for variant in VARIANTS:
        row = {"variant": variant.name, "kernels": variant.kernels or "torch (no ptdp)", "compiled": variant.compiled}
        if variant.compiled and not ctx.smoke and ctx.seconds_left() < COMPILE_MIN_S:
            rows.append({**row, "skipped": f"under {COMPILE_MIN_S:.0f} s of the part's budget left"})
            continue
        while True:
            row["batch"] = batches[0]
            try:
                row.update(_fit(ctx, model, variant, batches[0], steps, warmup))
            except torch.cuda.OutOfMemoryError as err:
                if len(batches) > 1 and not any("tokens_per_s" in r for r in rows):  # batch not fixed yet
                    batches.pop(0)
                    continue
                row["error"] = short_error(err)
            except Exception as err:  # noqa: BLE001 - e.g. torch.compile failing on one variant
                row["error"] = short_error(err)
            break
        rows.append(row)
    by_name = {r["variant"]: r for r in rows if "tokens_per_s" in r}
    # the same weights and batch everywhere: the first losses agree to bf16 round-off (kernels differ)
    firsts = [r["first_loss"] for r in by_name.values() if r.get("first_loss") is not None]
    info["first_losses_agree"] = bool(firsts) and (max(firsts) - min(firsts)) <= 1e-2 * abs(min(firsts))
    for name in (v.name for v in VARIANTS if v.kernels is not None):
        base = by_name.get("lightning+compile" if name.endswith("+compile") else "lightning")
        if name in by_name and base is not None:
            by_name[name]["ratio_vs_lightning"] = by_name[name]["tokens_per_s"] / base["tokens_per_s"]
    return info


def markdown(record: dict) -> str:
    params = record.get("parameters")
    steps = f"{record.get('steps', 0) - record.get('warmup_steps', 0)} timed steps after {record.get('warmup_steps')}"
    lines = [
        f"Training on one device: recipes GPT {record.get('model')} ({params / 1e9:.3g}B parameters), "
        f"bf16-mixed, AdamW, {steps}; TFLOP/s by {record.get('flops_formula')}."
        if params
        else "Training:",
        "",
        "| variant | batch | tokens/s | TFLOP/s | MFU | vs Lightning | peak GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record.get("rows", []):
        if "tokens_per_s" not in r:
            lines.append(f"| {r['variant']} | {r.get('batch', '')} | {r.get('error') or r.get('skipped')} | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        ratio = f"{r['ratio_vs_lightning']:.3f}" if "ratio_vs_lightning" in r else "-"
        mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
        lines.append(
            f"| {r['variant']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['tflops']:.1f} | {mfu} | {ratio} | {mem} |"
        )
    return "\n".join(lines)
