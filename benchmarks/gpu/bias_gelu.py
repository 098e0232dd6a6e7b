"""Part 3: fused bias + GeLU, effective GB/s beside eager torch and torch.compile, and % of HBM peak.

Bytes counted are the fused minimum for every contender (forward reads x, writes y; backward
reads x and dy, writes dx), so an unfused implementation shows as a lower effective bandwidth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu.context import Context, short_error

BUDGET_S = 60.0


def _eager(x, bias):
    return F.gelu(x + bias)


def _row(ctx: Context, rows: int, cols: int) -> dict:
    from triton_kernels import bias_gelu

    x = torch.randn(rows, cols, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(cols, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    # smoke: torch.compile's eager backend walks the same dynamo path without a C++ compile
    compiled = torch.compile(_eager, dynamic=False, backend="inductor" if ctx.cuda else "eager")
    fwd_bytes, bwd_bytes = 2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size()
    row = {"rows": rows, "cols": cols, "dtype": "bf16", "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes}
    for name, fn in {"triton": bias_gelu, "eager": _eager, "compile": compiled}.items():
        try:
            with torch.no_grad():
                fwd_ms = ctx.time_ms(lambda fn=fn: fn(x, bias))
            out = fn(x, bias)
            bwd_ms = ctx.time_ms(lambda out=out: out.backward(grad, retain_graph=True), grad_to_none=[x, bias])
            stats = {
                "fwd_ms": fwd_ms,
                "fwd_gbps": fwd_bytes / fwd_ms * 1e-6,
                "bwd_ms": bwd_ms,
                "bwd_gbps": bwd_bytes / bwd_ms * 1e-6,
            }
            if ctx.hbm_bytes_per_s:
                stats["fwd_hbm_fraction"] = stats["fwd_gbps"] * 1e9 / ctx.hbm_bytes_per_s
                stats["bwd_hbm_fraction"] = stats["bwd_gbps"] * 1e9 / ctx.hbm_bytes_per_s
            row[name] = stats
        except Exception as err:  # noqa: BLE001 - torch.compile may be unavailable: keep the others
            row[name] = {"error": short_error(err)}
    return row


def run(ctx: Context, rows: list[dict]) -> dict:
    shapes = ((40, 72),) if ctx.smoke else ((8192, 8192), (16384, 8192), (8192, 11008))
    for shape in shapes:
        try:
            rows.append(_row(ctx, *shape))
        except Exception as err:  # noqa: BLE001
            rows.append({"rows": shape[0], "cols": shape[1], "error": short_error(err)})
        ctx.free()
    fractions = [r["triton"].get(k) for r in rows if "triton" in r for k in ("fwd_hbm_fraction", "bwd_hbm_fraction")]
    return {
        "target": "triton >= 85% of HBM peak",
        "hbm_bytes_per_s": ctx.hbm_bytes_per_s,
        "target_met": bool(fractions) and all(f is not None and f >= 0.85 for f in fractions),
    }


def _pair(row: dict, name: str) -> str:
    stats = row.get(name, {})
    return f"{stats['fwd_gbps']:.0f} / {stats['bwd_gbps']:.0f}" if "fwd_gbps" in stats else stats.get("error", "-")


def markdown(record: dict) -> str:
    lines = [
        "| shape | triton fwd / bwd GB/s | % HBM | eager fwd / bwd | torch.compile fwd / bwd |",
        "|---|---|---|---|---|",
    ]
    for r in record.get("rows", []):
        if "error" in r:
            lines.append(f"| {r['rows']}x{r['cols']} | {r['error']} | | | |")
            continue

        t = r.get("triton", {})
        hbm = f"{t['fwd_hbm_fraction']:.0%} / {t['bwd_hbm_fraction']:.0%}" if "fwd_hbm_fraction" in t else "-"
        lines.append(
            f"| {r['rows']}x{r['cols']} | {_pair(r, 'triton')} | {hbm} | {_pair(r, 'eager')} | {_pair(r, 'compile')} |"
        )
    return "Bias-GeLU, bf16:\n\n" + "\n".join(lines)
