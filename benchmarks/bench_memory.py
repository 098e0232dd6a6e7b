"""Model-state memory per rank: parameters, gradients and Adam state for each ZeRO stage on
several (t, p, d) layouts, measured after a training step, beside the ZeRO paper's accounting.

    python -m benchmarks.bench_memory

4 gloo ranks, fp32 ("32-true"), AdamW. Theory: 16 bytes per parameter this rank would hold
without ZeRO (4 weight + 4 gradient + 8 Adam moments; with bf16 mixed precision the paper's
2 + 2 + 12 is also 16), divided as each stage divides it over d:
  stage 0: 4 + 4 + 8,  stage 1: 4 + 4 + 8/d,  stage 2: 4 + (4 + 8)/d,  stage 3: 16/d.
ptdp's stages 1-3 are FSDP2, which keeps weights and gradients sharded at rest in all three:
stages 1 and 2 keep the gathered weights from forward until backward (measured on entering
backward, p = 1), stage 3 gathers them again there. So at rest ptdp holds 16/d bytes per
parameter for stages 1-3 ("theory_fsdp"); the ZeRO paper's per-stage figure is printed beside it.
Prints JSON.
"""

from __future__ import annotations

import json
import platform

import lightning as L
import torch

MODEL = dict(vocab_size=512, seq_length=64, num_layers=4, num_heads=8, hidden_size=256)
LAYOUTS = [  # (t, p) on 4 ranks; d = 4 / (t * p)
    (1, 1), (2, 1), (1, 2), (2, 2),
]


def _bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class Measure(L.Callback):
    """Bytes this rank holds right before the optimizer's second step (state exists by then), and
    the weight bytes registered on entering backward (gathered or not)."""

    def __init__(self) -> None:
        self.result: dict = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == 1:
            self.result["weights_in_backward_bytes"] = sum(_bytes(p) for p in pl_module.parameters())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 1:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        state = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
        self.result |= {
            "param_bytes": sum(_bytes(p) for p in params),
            "grad_bytes": sum(_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": sum(_bytes(v) for v in state),
        }


def measure(t: int, p: int, zero: int) -> dict:
    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    callback = Measure()
    kwargs = {"tensor_parallel_size": t, "pipeline_parallel_size": p, "zero_stage": zero}
    if p > 1:
        kwargs["micro_batch_size"] = 2
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback],
        strategy=PTDPStrategy(**kwargs),
    )
    seq = MODEL["seq_length"]
    data = MarkovDataModule(vocab_size=MODEL["vocab_size"], seq_length=seq, batch_size=4,
                            train_tokens=16 * 4 * (seq + 1), val_tokens=2 * (seq + 1))
    trainer.fit(GPTLightningModule(GPTConfig(**MODEL)), data)
    return callback.result


def theory(unsharded_params: int, zero: int, d: int, fsdp: bool = False) -> float:
    """Bytes at rest: the ZeRO paper's division per stage, or FSDP2's (all of it over d)."""
    weight, grad, adam = 4.0, 4.0, 8.0
    if zero >= 1:
        adam /= d
    if zero >= 2 or (zero >= 1 and fsdp):
        grad /= d
    if zero >= 3 or (zero >= 1 and fsdp):
        weight /= d
    return unsharded_params * (weight + grad + adam)


def main() -> None:
    from lightning_ptdp.testing import DistributedPool

    rows = []
    pool = DistributedPool(4)
    try:
        for t, p in LAYOUTS:
            d = 4 // (t * p)
            per_rank_params = [r["param_bytes"] // 4 for r in pool.run(measure, t, p, 0)]  # zero 0: unsharded count
            for zero in (0, 1, 2, 3):
                results = pool.run(measure, t, p, zero)
                for rank, result in enumerate(results):
                    total = result["param_bytes"] + result["grad_bytes"] + result["optimizer_bytes"]
                    paper = theory(per_rank_params[rank], zero, d)
                    ours = theory(per_rank_params[rank], zero, d, fsdp=True)
                    rows.append({
                        "t": t, "p": p, "d": d, "zero": zero, "rank": rank, **result, "total_bytes": total,
                        "theory_zero_paper": paper, "theory_fsdp": ours, "ratio_to_fsdp_theory": round(total / ours, 4),
                    })
    finally:
        pool.close()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "model": MODEL, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
