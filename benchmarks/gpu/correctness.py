"""Part 1: the Triton kernels against torch, values and gradients, in fp16, bf16 and fp32.

Reference: the same math in fp64 from the same rounded inputs. A case passes when the kernel's
largest error is within 2x torch's own error in that dtype (SDPA, or eager bias + GeLU, against
the same fp64 reference) plus a floor of a few ulps of the dtype: the kernel must be no less
accurate than torch. Attention: causal and not, head dims 64 and 128 (16 in a smoke run), ragged
lengths, unequal query/key lengths, grouped-query heads. Tiles are the fixed ones
(TRITON_KERNELS_AUTOTUNE=0: one compile per variant); the attention part checks the tuned tiles.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from benchmarks.gpu.context import Context, short_error

BUDGET_S = 190.0  # 160 s measured on a cold H100 (Triton compiling every variant)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
RATIO = 2.0


def _attention_cases(smoke: bool) -> list[dict]:
    """(batch, heads, kv_heads, q_len, kv_len): ragged, unequal lengths, grouped-query."""
    if smoke:
        shapes = [(1, 2, 2, 19, 19), (1, 2, 2, 13, 29), (1, 4, 2, 23, 23)]
    else:
        shapes = [(2, 4, 4, 1000, 1000), (1, 4, 4, 257, 777), (2, 8, 2, 517, 517)]
    return [dict(zip(("b", "h", "kv", "q", "k"), shape)) for shape in shapes]


def _max_errors(outputs, reference) -> list[float]:
    return [(o.double() - r).abs().max().item() for o, r in zip(outputs, reference)]


def _attention_row(ctx: Context, dtype_name: str, head_dim: int, causal: bool, case: dict) -> dict:
    from lightning_ptdp.triton_kernels import flash_attention

    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(head_dim * 1009 + case["q"] * 7 + case["k"])

    def make(heads: int, length: int) -> torch.Tensor:
        return torch.randn(case["b"], heads, length, head_dim, generator=gen).to(ctx.device, dtype)

    q, k, v, grad = (
        make(case["h"], case["q"]),
        make(case["kv"], case["k"]),
        make(case["kv"], case["k"]),
        make(case["h"], case["q"]),
    )
    gqa = case["kv"] != case["h"]

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad.to(cast))]

    reference = run(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=gqa), torch.float64
    )
    kernel = run(lambda a, b, c: flash_attention(a, b, c, causal=causal), dtype)
    torch_errors = _max_errors(
        run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=gqa), dtype), reference
    )
    return _verdict(
        {"kernel": "flash_attention", "dtype": dtype_name, "head_dim": head_dim, "causal": causal, **case},
        ("out", "dq", "dk", "dv"),
        _max_errors(kernel, reference),
        torch_errors,
        dtype,
    )


def _bias_gelu_row(ctx: Context, dtype_name: str, approximate: str, rows: int, cols: int) -> dict:
    from lightning_ptdp.triton_kernels import bias_gelu

    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(rows + cols)
    x, bias, grad = (
        torch.randn(*shape, generator=gen).to(ctx.device, dtype) for shape in ((rows, cols), (cols,), (rows, cols))
    )

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (x, bias)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad.to(cast))]

    def eager(a, b):
        return F.gelu(a + b, approximate=approximate)

    reference = run(eager, torch.float64)
    return _verdict(
        {"kernel": "bias_gelu", "dtype": dtype_name, "approximate": approximate, "rows": rows, "cols": cols},
        ("out", "dx", "dbias"),
        _max_errors(run(lambda a, b: bias_gelu(a, b, approximate), dtype), reference),
        _max_errors(run(eager, dtype), reference),
        dtype,
    )


def _verdict(row: dict, names: tuple[str, ...], kernel: list[float], torch_: list[float], dtype: torch.dtype) -> dict:
    bounds = [RATIO * t + FLOOR[dtype] for t in torch_]
    row["max_error"] = dict(zip(names, kernel))
    row["torch_max_error"] = dict(zip(names, torch_))
    row["passed"] = all(e <= b for e, b in zip(kernel, bounds))
    return row


def _forget_untuned_choices() -> None:
    """The configs this part cached untimed must not stand in for autotune's in the parts after it."""
    try:
        from lightning_ptdp.triton_kernels import tuning
    except ImportError:  # no triton: nothing was cached
        return
    tuning.clear()


def run(ctx: Context, rows: list[dict]) -> dict:
    previous = os.environ.get("TRITON_KERNELS_AUTOTUNE")
    os.environ["TRITON_KERNELS_AUTOTUNE"] = "0"
    try:
        for dtype_name in DTYPES:
            for head_dim in (16,) if ctx.smoke else (64, 128):
                for causal in (False, True):
                    for case in _attention_cases(ctx.smoke):
                        labels = {"kernel": "flash_attention", "dtype": dtype_name, "head_dim": head_dim}
                        args = (ctx, dtype_name, head_dim, causal, case)
                        rows.append(_guarded(_attention_row, args, {**labels, "causal": causal, **case}))
            for approximate in ("none", "tanh"):
                shape = (37, 75) if ctx.smoke else (3001, 4099)
                labels = {"kernel": "bias_gelu", "dtype": dtype_name, "approximate": approximate}
                rows.append(_guarded(_bias_gelu_row, (ctx, dtype_name, approximate, *shape), labels))
    finally:
        if previous is None:
            os.environ.pop("TRITON_KERNELS_AUTOTUNE", None)
        else:
            os.environ["TRITON_KERNELS_AUTOTUNE"] = previous
        _forget_untuned_choices()
    failed = [r for r in rows if not r.get("passed")]
    return {
        "passed": not failed and bool(rows),
        "cases": len(rows),
        "failed": len(failed),
        "rule": f"kernel error <= {RATIO} x torch's error in the same dtype + floor { ({k: FLOOR[v] for k, v in DTYPES.items()}) }",
    }


def _guarded(fn, args: tuple, labels: dict) -> dict:
    start = time.monotonic()
    try:
        row = fn(*args)
    except Exception as err:  # noqa: BLE001 - one failing case is a row, not the end of the part
        row = {**labels, "passed": False, "error": short_error(err)}
    return {**row, "seconds": time.monotonic() - start}


def markdown(record: dict) -> str:
    rows = record.get("rows", [])
    failed = [r for r in rows if not r.get("passed")]
    lines = [f"Correctness: {len(rows) - len(failed)}/{len(rows)} cases passed ({record.get('rule', '')})."]
    for row in failed[:10]:
        lines.append(f"- FAILED {row}")
    return "\n".join(lines)
