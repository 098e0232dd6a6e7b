"""The planner against the paper (Table 1, GPT-3 175B), a mixture of experts (Mixtral-8x7B
against Megatron-Core's figure) and long context (Llama-3-8B at 128k tokens with context
parallelism): arithmetic only, instant.

    python -m benchmarks.bench_planner

Prints JSON and writes its sections of benchmarks/RESULTS.md (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from benchmarks.results import cpu_description, today, write_section
from lightning_ptdp.core.flops import training_time_seconds
from lightning_ptdp.planner import FIT_ROWS, GEMM_EFFICIENCY, TABLE_1, Cluster, estimate, paper_layout, plan

GPT3 = {"model": "gpt3_175b", "gpus": 1024, "batch": 1536, "paper_tflops": 140, "tokens": 300e9, "paper_days": 34}
# Table 1's row of GPT-3's width and heads (gpt_145.6b) ran t=8, p=8; with p=16, the layouts like it on 1,024 GPUs
GPT3_TABLE_1_LAYOUTS = ((8, 8), (8, 16))


def table_1() -> dict:
    rows = []
    for name, row in TABLE_1.items():
        x = paper_layout(name)
        best = plan(
            name,
            Cluster.paper(row.num_gpus),
            row.global_batch_size,
            recompute_modes=("full",),
            max_micro_batch_size=1,
            zero_stage=0,
        )[0]
        rows.append(
            {
                "model": name,
                "t": row.tensor_parallel_size,
                "p": row.pipeline_parallel_size,
                "gpus": row.num_gpus,
                "batch": row.global_batch_size,
                "paper_tflops": row.achieved_tflops_per_gpu,
                "estimate_tflops": round(x.tflops_per_gpu, 1),
                "error": round(x.tflops_per_gpu / row.achieved_tflops_per_gpu - 1, 3),
                "fitted_on": name in FIT_ROWS,
                "top_choice_full_b1": [
                    best.tensor_parallel_size,
                    best.pipeline_parallel_size,
                    best.virtual_pipeline_size,
                ],
                "paper_layout_step_over_best": round(x.step_time_s / best.step_time_s, 3),
            }
        )
    cluster = Cluster.paper(GPT3["gpus"])  # the paper's toolset: Megatron 2021's attention, no ZeRO
    best = plan(GPT3["model"], cluster, GPT3["batch"], recompute_modes=(None, "full"), zero_stage=0)[0]
    steps = GPT3["tokens"] / (GPT3["batch"] * 2048)
    gpt3 = {
        "best_layout": {
            "t": best.tensor_parallel_size,
            "p": best.pipeline_parallel_size,
            "d": best.data_parallel_size,
            "v": best.virtual_pipeline_size,
            "b": best.micro_batch_size,
            "recompute": best.activation_checkpointing,
        },
        "estimate_tflops": round(best.tflops_per_gpu, 1),
        "paper_tflops": GPT3["paper_tflops"],
        "step_time_s": round(best.step_time_s, 2),
        "days_from_step_time": round(steps * best.step_time_s / 86400, 1),
        "eq4_days_at_paper_140": round(training_time_seconds(GPT3["tokens"], 175e9, GPT3["gpus"], 140e12) / 86400, 1),
        "paper_days": GPT3["paper_days"],
    }
    # like with like: the paper's 140 counts recomputation's FLOPs (Eq. 4's 8TP), so full recompute
    full = plan(GPT3["model"], cluster, GPT3["batch"], recompute_modes=("full",), zero_stage=0)[0]
    at_table_1 = [
        estimate(GPT3["model"], cluster, GPT3["batch"], tensor_parallel_size=t, pipeline_parallel_size=p)
        for t, p in GPT3_TABLE_1_LAYOUTS
    ]
    gpt3["at_table_1_layouts"] = [
        {
            "t": x.tensor_parallel_size,
            "p": x.pipeline_parallel_size,
            "estimate_tflops": round(x.tflops_per_gpu, 1),
            "error_vs_paper": round(x.tflops_per_gpu / GPT3["paper_tflops"] - 1, 3),
            "step_over_search_best": round(x.step_time_s / full.step_time_s, 3),
        }
        for x in at_table_1
    ]
    gpt3["full_recompute"] = {
        "layout": [full.tensor_parallel_size, full.pipeline_parallel_size, full.virtual_pipeline_size],
        "b": full.micro_batch_size,
        "estimate_tflops": round(full.tflops_per_gpu, 1),
        "error_vs_paper": round(full.tflops_per_gpu / GPT3["paper_tflops"] - 1, 3),
        "days_from_step_time": round(steps * full.step_time_s / 86400, 1),
    }
    return {"gemm_efficiency": GEMM_EFFICIENCY, "fit_rows": list(FIT_ROWS), "table_1": rows, "gpt3_175b": gpt3}


def _head(title: str, command: str) -> list[str]:
    """A planner section's heading, hardware (none: arithmetic) and command lines."""
    return [
        f"## {today()} — {title}",
        "",
        f"- Hardware: none (arithmetic); run on {cpu_description()}, Python {platform.python_version()}.",
        f"- Command: `{command}`",
    ]


def table_1_markdown(result: dict, command: str) -> str:
    lines = [
        *_head("planner estimate at Table 1's own layouts, and GPT-3 175B (issue 18)", command),
        (
            f"- One fitted constant: GEMM_EFFICIENCY = {result['gemm_efficiency']} (least squares on "
            f"{' and '.join(result['fit_rows'])}); the other rows are predictions. Layout: the paper's t and p, "
            "b=1, v=1, full recompute."
        ),
        "",
        (
            "| model | t | p | GPUs | batch | paper TFLOP/s | estimate | error | planner top (t, p, v), full, b=1 "
            "| paper layout step / top |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["table_1"]:
        fit = " (fit)" if r["fitted_on"] else ""
        lines.append(
            f"| {r['model']}{fit} | {r['t']} | {r['p']} | {r['gpus']} | {r['batch']} | {r['paper_tflops']} "
            f"| {r['estimate_tflops']} | {r['error']:+.1%} | {tuple(r['top_choice_full_b1'])} "
            f"| {r['paper_layout_step_over_best']} |"
        )
    g = result["gpt3_175b"]
    lines += [
        "",
        (
            f"- **GPT-3 175B on 1,024 A100s, batch 1,536** (paper's toolset: no selective recompute, no SP): "
            f"best layout {g['best_layout']}, **{g['estimate_tflops']} TFLOP/s per GPU** (paper's estimate "
            f"{g['paper_tflops']}), step {g['step_time_s']} s, {g['days_from_step_time']} days for 300B tokens "
            f"from that step time; Eq. 4 at the paper's 140 TFLOP/s: {g['eq4_days_at_paper_140']} days "
            f"(paper: {g['paper_days']}). That best layout recomputes nothing, so its TFLOP/s count fewer "
            "FLOPs than the paper's 140, which include recomputation (Eq. 4's 8TP)."
        ),
        (
            f"- **Like with like, full recompute** (FLOPs counted as the paper counts them): best layout "
            f"(t, p, v) = {tuple(g['full_recompute']['layout'])}, b={g['full_recompute']['b']}, "
            f"**{g['full_recompute']['estimate_tflops']} TFLOP/s per GPU, {g['full_recompute']['error_vs_paper']:+.1%} "
            f"against the paper's {g['paper_tflops']}**; {g['full_recompute']['days_from_step_time']} days from its "
            f"step time against the paper's {g['paper_days']}."
        ),
        (
            "- **Where that gap comes from.** The paper does not state the layout its 140 was measured at. At "
            "the layouts of Table 1's row with GPT-3's width and heads (gpt_145.6b: t=8, p=8; b=1, v=1, full "
            "recompute) the estimate is "
            + ", ".join(
                f"{r['estimate_tflops']} TFLOP/s at (t, p) = ({r['t']}, {r['p']}) ({r['error_vs_paper']:+.1%})"
                for r in g["at_table_1_layouts"]
            )
            + ", inside Table 1's 10% like every row (tested). The rest is the search: the planner rates its best "
            "layout (interleaved, b=2) "
            + " and ".join(f"{r['step_over_search_best']}x" for r in g["at_table_1_layouts"])
            + " faster than those, a ranking of layouts nobody measured (Table 1's last column is the same kind "
            "of figure), so the search's full-recompute figure is reported here, not asserted."
        ),
    ]
    return "\n".join(lines)


# Megatron-Core's MoE README (megatron/core/transformer/moe): Mixtral 8x7B, bf16, H100, MCore v0.9;
# its example layout for 8x7B: TP 1, PP 4, EP 8 (and "EP8TP1 is better than EP4TP2 for 8x7B")
MEGATRON_MIXTRAL = {"tflops": 468, "t": 1, "p": 4, "e": 8}
MIXTRAL_RUNS = {"64 H100s": (Cluster.h100(64), 256), "1,040 A100s": (Cluster(num_gpus=1040), 1040)}


def _row(x) -> dict:
    return {
        "t": x.tensor_parallel_size,
        "p": x.pipeline_parallel_size,
        "d": x.data_parallel_size,
        "e": x.expert_parallel_size,
        "v": x.virtual_pipeline_size,
        "b": x.micro_batch_size,
        "recompute": x.activation_checkpointing,
        "tflops": round(x.tflops_per_gpu, 1),
        "step_s": round(x.step_time_s, 3),
        "all_to_all_s": round(x.expert_parallel_comm_s, 3),
        "c": x.context_parallel_size,
        "kv_exchange_s": round(x.context_parallel_comm_s, 3),
        "gb_per_gpu": round(x.memory_bytes_per_gpu / 1e9, 1),
    }


def _ranked(top: list[dict], best: list[dict], degree: str):
    """(label, row): the top rows by rank, then the best row at each value of ``degree``."""
    yield from ((f"{i}", r) for i, r in enumerate(top, start=1))
    yield from ((f"best, {degree}={r[degree]}", r) for r in best)


def _best_per(ranked: list, degree: str) -> list[dict]:
    """The fastest layout at each value of ``degree``, by that value."""
    best: dict = {}
    for x in ranked:
        best.setdefault(getattr(x, degree), _row(x))
    return [best[k] for k in sorted(best)]


def mixtral() -> dict:
    """Mixtral-8x7B at 4,096 tokens with ZeRO-1 (Megatron's distributed optimizer): the planner's
    top layouts, and its estimate at Megatron-Core's layout (v and recompute its best there)."""
    out: dict = {"megatron_core": MEGATRON_MIXTRAL}
    ranked = {}
    for name, (cluster, batch) in MIXTRAL_RUNS.items():
        layouts = ranked[name] = plan("mixtral_8x7b", cluster, batch, zero_stage=1)
        out[name] = {"batch": batch, "top": [_row(x) for x in layouts[:3]]}
        out[name]["best_per_e"] = _best_per(layouts, "expert_parallel_size")
    m = MEGATRON_MIXTRAL
    at_megatron = [
        x
        for x in ranked["64 H100s"]
        if (x.tensor_parallel_size, x.pipeline_parallel_size, x.expert_parallel_size) == (m["t"], m["p"], m["e"])
    ]
    out["at_megatron_layout"] = _row(at_megatron[0])
    out["at_megatron_layout"]["error_vs_megatron"] = round(at_megatron[0].tflops_per_gpu / m["tflops"] - 1, 3)
    return out


def mixtral_markdown(result: dict, command: str) -> str:
    m, at = result["megatron_core"], result["at_megatron_layout"]
    lines = [
        *_head("planner: Mixtral-8x7B with expert parallelism, next to Megatron-Core (issue 27)", command),
        (
            "- Model: Mixtral-8x7B (46.70B parameters, 12.88B active), 4,096 tokens, ZeRO-1; H100 nodes by "
            "`Cluster.h100` (data sheet and NCCL figures; the GEMM efficiency is still the A100 fit), A100 "
            "nodes the paper's Selene. TFLOP/s count executed FLOPs (selective recompute runs the attention core again)."
        ),
        "",
        "| cluster | batch | rank | t | p | d | e | v | b | recompute | TFLOP/s/GPU | step s | all-to-all s | GB/GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in MIXTRAL_RUNS:
        run = result[name]
        for label, r in _ranked(run["top"], run["best_per_e"], "e"):
            lines.append(
                f"| {name} | {run['batch']} | {label} | {r['t']} | {r['p']} | {r['d']} | {r['e']} | {r['v']} "
                f"| {r['b']} | {r['recompute']} | {r['tflops']} | {r['step_s']} | {r['all_to_all_s']} "
                f"| {r['gb_per_gpu']} |"
            )
    lines += [
        "",
        (
            f"- **Megatron-Core reports {m['tflops']} TFLOP/s per GPU** for Mixtral 8x7B in bf16 on H100 "
            f"(MCore v0.9; its example layout t={m['t']}, p={m['p']}, e={m['e']}). The planner at that layout "
            f"(its best v and recompute there: v={at['v']}, {at['recompute']}): **{at['tflops']} TFLOP/s, "
            f"{at['error_vs_megatron']:+.1%}**. The planner overlaps nothing (Megatron-Core overlaps the "
            "gradient reduce, parameter gather and the all-to-alls with compute, and runs grouped GEMMs with "
            "permutation fused), which points low; it runs attention as one flash kernel at the GEMM efficiency "
            "and carries the 2021 A100 GEMM efficiency to H100, neither measured there, which may point either way."
        ),
    ]
    return "\n".join(lines)


LONG_CONTEXT = {"model": "llama3_8b_128k", "batch": 8, "gpus": (8, 64), "c": (1, 2, 4, 8, 16, 32)}


def _long_context_plan(cluster: Cluster) -> list:
    return plan(
        LONG_CONTEXT["model"],
        cluster,
        LONG_CONTEXT["batch"],
        zero_stage=1,
        sequence_parallel=True,
        context_parallel_sizes=LONG_CONTEXT["c"],
    )


def long_context() -> dict:
    """Llama-3-8B at 131,072 tokens, 8 sequences (1M tokens) per step on H100 nodes, ZeRO-1 and SP:
    the best layout at each c with flash attention, and with attention that keeps its scores the c
    that fit (or why none does)."""
    out: dict = {}
    for gpus in LONG_CONTEXT["gpus"]:
        layouts = _long_context_plan(Cluster.h100(gpus))
        best = _best_per(layouts, "context_parallel_size")
        out[f"{gpus} H100s"] = {"top": [_row(x) for x in layouts[:3]], "best_per_c": best}
        try:
            eager = _long_context_plan(Cluster.h100(gpus, flash_attention=False))
            out[f"{gpus} H100s"]["eager_fitting_c"] = sorted({x.context_parallel_size for x in eager})
        except ValueError as error:
            out[f"{gpus} H100s"]["eager_error"] = str(error)
    return out


def long_context_markdown(result: dict, command: str) -> str:
    lines = [
        *_head("planner: Llama-3-8B at 128k tokens with context parallelism (issue 28)", command),
        (
            f"- Model: Llama-3-8B (8.03B parameters, GQA 8 KV heads, V=128,256) at 131,072 tokens, "
            f"{LONG_CONTEXT['batch']} sequences per step, ZeRO-1, sequence parallelism; c searched over "
            f"{LONG_CONTEXT['c']}; H100 nodes by `Cluster.h100`. The fp32 logits are b s V / c per rank without "
            "TP (the head and loss on each rank's tokens) and b s V / t with it (vocabulary-parallel head). "
            "Attention is flash/cuDNN SDPA (`Cluster.flash_attention`, what ptdp runs on sm80+): no s x s scores "
            "in memory or through HBM, the kernel at the fitted GEMM efficiency (an A100 fit: no H100 attention "
            "kernel has been measured for it)."
        ),
        "",
    ]
    for name, run in result.items():
        lines += [
            f"- {name}:",
            "",
            "  | rank | t | p | c | d | v | b | recompute | TFLOP/s/GPU | step s | K/V exchange s | GB/GPU |",
            "  |---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, r in _ranked(run["top"], run["best_per_c"], "c"):
            lines.append(
                f"  | {label} | {r['t']} | {r['p']} | {r['c']} | {r['d']} | {r['v']} | {r['b']} | {r['recompute']} "
                f"| {r['tflops']} | {r['step_s']} | {r['kv_exchange_s']} | {r['gb_per_gpu']} |"
            )
        lines.append("")
        c1 = [r for r in run["best_per_c"] if r["c"] == 1]
        if c1:
            faster = c1[0]["step_s"] / run["top"][0]["step_s"]
            lines.append(
                f"  Without context parallelism the best layout is t={c1[0]['t']}, recompute={c1[0]['recompute']} "
                f"({c1[0]['gb_per_gpu']} GB per GPU): it fits, and the best layout steps {faster:.2f}x faster."
            )
        if "eager_error" in run:
            lines.append(f"  With attention that keeps its scores (`--eager-attention`): {run['eager_error']}.")
        else:
            lines.append(
                f"  With attention that keeps its scores (`--eager-attention`) only c in {run['eager_fitting_c']} fit."
            )
        lines.append("")
    lines.append(
        "- At 128k tokens the s x s scores are what decide whether a layout without cp fits: 5 a s^2 b / t "
        "bytes for the layer being recomputed, 344 GB at t=8, 20.6 GB per GPU without them. torchtitan "
        "reports training Llama 3 8B at 262k tokens on 8 GPUs with context parallelism and flash attention."
    )
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    command = "python -m benchmarks.bench_planner"
    result = table_1()
    write_section("planner_table_1", table_1_markdown(result, command))
    result["mixtral_8x7b"] = mixtral()
    write_section("planner_moe", mixtral_markdown(result["mixtral_8x7b"], command))
    result["long_context"] = long_context()
    write_section("planner_long_context", long_context_markdown(result["long_context"], command))
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
