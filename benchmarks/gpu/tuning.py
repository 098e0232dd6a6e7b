"""Part 5: the tiles triton.autotune chose for each attention key the earlier parts launched."""

from __future__ import annotations

from benchmarks.gpu.context import Context

BUDGET_S = 5.0


def run(ctx: Context, rows: list[dict]) -> dict:
    from lightning_ptdp.triton_kernels import _config
    from lightning_ptdp.triton_kernels.tuning import chosen

    rows.extend(chosen())
    return {
        "autotune": not ctx.smoke and _config.autotune_enabled(),
        "key": "(seq bucket, head dim, causal) + tensor dtypes",
        "candidates": {stage: [t.__dict__ for t in tiles] for stage, tiles in _config.ATTENTION_CANDIDATES.items()},
        "note": "the interpreter (smoke) has one tile size: nothing is timed",
    }


def markdown(record: dict) -> str:
    rows = record.get("rows", [])
    if not rows:
        return "Tuning: no autotuned launch recorded (" + record.get("note", "") + ")."
    lines = ["| kernel | key | BLOCK_M x BLOCK_N | warps | stages |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['kernel']} | {', '.join(r['key'])} | {r['block_m']}x{r['block_n']} | {r['num_warps']} | "
        f"{r['num_stages']} |"
        for r in rows
    ]
    return "Autotuned attention tiles:\n\n" + "\n".join(lines)
