"""Part 2: attention TFLOP/s, the Triton kernel beside F.scaled_dot_product_attention, one run.

Causal, bf16, s = 1k..16k, head dims 64 and 128, batch * seq = 16384 tokens and heads * head_dim
= 2048 at every point (constant work per token). Contenders: triton (autotuned), SDPA restricted
to its flash backend, and to cuDNN where this build has it. FLOPs, as in the flash-attention
papers: forward 4 * b * h * s^2 * d, halved when causal; backward 2.5x forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu.context import Context, short_error

BUDGET_S = 90.0


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return call


def contenders(ctx: Context) -> dict:
    from lightning_ptdp.triton_kernels import flash_attention

    impls = {"triton": lambda q, k, v: flash_attention(q, k, v, causal=True)}
    if not ctx.cuda:  # smoke: the CPU's default SDPA
        impls["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return impls
    impls["sdpa_flash"] = _sdpa("FLASH_ATTENTION")
    if hasattr(torch.nn.attention.SDPBackend, "CUDNN_ATTENTION"):
        impls["sdpa_cudnn"] = _sdpa("CUDNN_ATTENTION")
    return impls


def _row(ctx: Context, seq: int, head_dim: int, tokens: int, hidden: int) -> dict:
    batch, heads = max(1, tokens // seq), max(1, hidden // head_dim)
    row = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": True, "dtype": "bf16"}
    q, k, v, grad = (
        torch.randn(batch, heads, seq, head_dim, device=ctx.device, dtype=torch.bfloat16) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fwd_flops = 2 * batch * heads * seq * seq * head_dim  # 4bhs^2d halved by the causal mask
    impls = contenders(ctx)
    with torch.no_grad():
        expected = next(fn for name, fn in impls.items() if name != "triton")(q, k, v)
        row["max_abs_diff_vs_sdpa"] = (impls["triton"](q, k, v) - expected).abs().max().item()
    for name, fn in impls.items():
        try:
            with torch.no_grad():
                fwd_ms = ctx.time_ms(lambda fn=fn: fn(q, k, v))
            both_ms = ctx.time_ms(lambda fn=fn: fn(q, k, v).backward(grad), grad_to_none=[q, k, v])
            row[name] = {
                "fwd_ms": fwd_ms,
                "fwd_tflops": fwd_flops / fwd_ms * 1e-9,
                "fwd_bwd_ms": both_ms,
                "fwd_bwd_tflops": 3.5 * fwd_flops / both_ms * 1e-9,
            }
        except Exception as err:  # noqa: BLE001 - a backend this GPU or shape lacks: keep the others
            row[name] = {"error": short_error(err)}
    for name in impls:
        if name != "triton" and "fwd_tflops" in row[name] and "fwd_tflops" in row["triton"]:
            for kind in ("fwd", "fwd_bwd"):
                row[f"{kind}_ratio_vs_{name}"] = row["triton"][f"{kind}_tflops"] / row[name][f"{kind}_tflops"]
    return row


def run(ctx: Context, rows: list[dict]) -> dict:
    seqs, dims = ((32,), (16,)) if ctx.smoke else ((1024, 2048, 4096, 8192, 16384), (64, 128))
    tokens, hidden = (64, 32) if ctx.smoke else (16384, 2048)
    for head_dim in dims:
        for seq in seqs:
            try:
                rows.append(_row(ctx, seq, head_dim, tokens, hidden))
            except Exception as err:  # noqa: BLE001 - OOM at one size: record it, go on
                rows.append({"seq": seq, "head_dim": head_dim, "error": short_error(err)})
            ctx.free()
    target = [
        r.get("fwd_bwd_ratio_vs_sdpa_flash") for r in rows if r.get("head_dim") == 128 and r.get("seq", 0) >= 4096
    ]
    return {
        "target": "fwd+bwd >= 1.1x SDPA flash at d=128, s >= 4k",
        "target_met": bool(target) and all(t is not None and t >= 1.1 for t in target),
    }


def markdown(record: dict) -> str:
    names = [n for n in ("triton", "sdpa_flash", "sdpa_cudnn", "sdpa") if any(n in r for r in record.get("rows", []))]
    head = "| d | s | " + " | ".join(f"{n} fwd | {n} fwd+bwd" for n in names) + " | triton / flash fwd | fwd+bwd |"
    lines = [head, "|" + "---|" * (4 + 2 * len(names))]
    for r in record.get("rows", []):
        if "error" in r:
            lines.append(f"| {r.get('head_dim')} | {r.get('seq')} | {r['error']} |")
            continue
        cells = []
        for n in names:
            stats = r.get(n, {})
            cells += [
                f"{stats['fwd_tflops']:.0f}" if "fwd_tflops" in stats else stats.get("error", "-"),
                f"{stats['fwd_bwd_tflops']:.0f}" if "fwd_bwd_tflops" in stats else "-",
            ]
        ratios = [f"{r[k]:.2f}" if k in r else "-" for k in ("fwd_ratio_vs_sdpa_flash", "fwd_bwd_ratio_vs_sdpa_flash")]
        lines.append(f"| {r['head_dim']} | {r['seq']} | " + " | ".join(cells + ratios) + " |")
    return "Attention, causal bf16, TFLOP/s:\n\n" + "\n".join(lines)
