"""Llama-3-8B and Mixtral-8x7B, built from their configs on meta (no weights), dry-run for 64 H100s
(8 nodes of 8), beside the formula planner's choice for the same model, cluster and batch.

    python -m benchmarks.dry_run_real_sizes [--models llama3_8b,mixtral_8x7b] [--write-results]

Each model is transformers' own class (LlamaForCausalLM, MixtralForCausalLM) at the published
config, in an ordinary LightningModule that builds it in ``configure_model``; sequences of
``SEQ`` tokens, micro batch 1, MICROBATCHES x GPUS a step (each replica's dry-run step accumulated to its share). Layouts: t in 1, 2, 4, 8
(sequence parallel when t > 1), p in 1, 2, 4, ZeRO 0 and 3 (3 alone at t = 1) (and e = 8 for Mixtral). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SECTION = "dry_run_real_sizes"
GPUS, PER_NODE, H100_GIB, SEQ, MICROBATCHES = 64, 8, 80, 4096, 8
PRECISION = "bf16-mixed"  # what an H100 run trains in (the formula planner models bf16 activations too)
CONFIGS = {
    # meta-llama/Meta-Llama-3-8B and mistralai/Mixtral-8x7B-v0.1 config.json values
    "llama3_8b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128_256,
            hidden_size=4096,
            intermediate_size=14_336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500_000.0,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral_8x7b": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            vocab_size=32_000,
            hidden_size=4096,
            intermediate_size=14_336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=32_768,
            tie_word_embeddings=False,
            router_jitter_noise=0.0,
        ),
    ),
}


def factory(name: str, batch: int):
    """A (LightningModule, DataLoader) pair: the model built in configure_model, token batches of SEQ."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    import transformers

    config_cls, model_cls, values = CONFIGS[name]

    class Deferred(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = None

        def configure_model(self) -> None:
            if self.net is None:
                config = getattr(transformers, config_cls)(**values)
                config._attn_implementation = "sdpa"
                self.net = getattr(transformers, model_cls)(config)

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            logits = self.net(input_ids=inputs, use_cache=False).logits
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    ids = torch.randint(0, values["vocab_size"], (batch, SEQ + 1))
    loader = torch.utils.data.DataLoader(list(zip(ids[:, :-1], ids[:, 1:])), batch_size=batch)
    return Deferred(), loader


def layouts(name: str) -> list[dict]:
    found = []
    for t in (1, 2, 4, 8):
        for p in (1, 2, 4):
            d = GPUS // (t * p)
            for zero in ((0, 3) if t > 1 else (3,)) if d > 1 else (0,):  # t=1 without ZeRO-3: far over 80 GiB
                layout = {"tensor_parallel_size": t, "pipeline_parallel_size": p}
                if t > 1:
                    layout["sequence_parallel"] = True
                if p > 1:
                    layout.update(micro_batch_size=1, pipeline_schedule="1f1b")
                if zero:
                    layout["zero_stage"] = zero
                if name == "mixtral_8x7b" and d >= 8:
                    layout["expert_parallel_size"] = 8
                found.append(layout)
    return found


def formula_choice(name: str) -> dict:
    """The formula planner's fastest layout for the same model, 64 H100s and global batch, with the
    dry run's options (micro batch 1, sequence parallel, no recompute)."""
    from lightning_ptdp.planner import Cluster, plan
    from lightning_ptdp.planner.models import MIXTRAL_8X7B, ModelSize

    model = MIXTRAL_8X7B if name == "mixtral_8x7b" else ModelSize.from_hf_config(CONFIGS[name][2], seq_length=SEQ)
    ranked = plan(
        model,
        Cluster.h100(GPUS),
        MICROBATCHES * GPUS,
        sequence_parallel=True,
        max_micro_batch_size=1,
        recompute_modes=(None,),
    )
    best = ranked[0]
    keys = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "expert_parallel_size")
    return {
        **{key: getattr(best, key) for key in keys},
        "zero_stage": best.zero_stage,
        "memory_gib": best.memory_bytes_per_gpu / 2**30,
        "step_time_s": best.step_time_s,
    }


def as_strategy(choice: dict) -> dict:
    """The formula planner's layout as strategy arguments, with the dry run's options."""
    t, p, e = choice["tensor_parallel_size"], choice["pipeline_parallel_size"], choice["expert_parallel_size"]
    layout: dict = {"tensor_parallel_size": t, "pipeline_parallel_size": p}
    if t > 1:
        layout["sequence_parallel"] = True
    if p > 1:
        layout.update(micro_batch_size=1, pipeline_schedule="1f1b")
    if choice["zero_stage"]:
        layout["zero_stage"] = choice["zero_stage"]
    if e > 1:
        layout["expert_parallel_size"] = e
    return layout


def formula_view(name: str, layout: dict) -> dict:
    """The formula planner's estimate of one strategy layout (memory and step time), or why it refuses it."""
    from lightning_ptdp.planner import Cluster, estimate
    from lightning_ptdp.planner.models import MIXTRAL_8X7B, ModelSize

    model = MIXTRAL_8X7B if name == "mixtral_8x7b" else ModelSize.from_hf_config(CONFIGS[name][2], seq_length=SEQ)
    keys = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "zero_stage", "sequence_parallel")
    try:
        found = estimate(
            model,
            Cluster.h100(GPUS),
            MICROBATCHES * GPUS,
            activation_checkpointing=None,
            micro_batch_size=1,
            pipeline_schedule="1f1b",
            **{k: layout[k] for k in keys if k in layout},
        )
    except ValueError as error:
        return {"refused": str(error)[:200]}
    return {"memory_gib": found.memory_bytes_per_gpu / 2**30, "step_time_s": found.step_time_s}


def _accumulate(layout: dict, batch: int) -> int:
    """Dry-run steps (of ``batch`` sequences a replica) per optimizer step at the global batch of
    MICROBATCHES x GPUS sequences, the formula planner's."""
    split = layout["tensor_parallel_size"] * layout["pipeline_parallel_size"]
    return max(MICROBATCHES * GPUS // (GPUS // split) // batch, 1)


def run(names: list[str]) -> dict:
    from lightning_ptdp.planner import Cluster
    from lightning_ptdp.planner.fit import GIB, layout_name, step_seconds
    from lightning_ptdp.planner.meta_run import dry_run_layout

    cluster = Cluster.h100(GPUS)

    record = {"gpus": GPUS, "device_gib": H100_GIB, "seq": SEQ, "models": {}}
    for name in names:
        rows = []
        formula = formula_choice(name)
        theirs = as_strategy(formula)
        candidates = layouts(name)
        if layout_name(theirs) not in {layout_name(c) for c in candidates}:
            candidates.append(theirs)  # the formula's choice is dry-run too
        for layout in candidates:
            batch = MICROBATCHES if layout.get("pipeline_parallel_size", 1) > 1 else 1
            started = time.perf_counter()
            try:
                report = dry_run_layout(lambda: factory(name, batch), layout, world_size=GPUS, precision=PRECISION)
            except Exception as error:  # a layout the dry run cannot do: listed with its reason
                rows.append({"layout": layout_name(layout), "error": f"{type(error).__name__}: {str(error)[:200]}"})
                continue
            row = {
                "layout": layout_name(layout),
                # every layout at the formula's global batch: a replica's dry-run step is accumulated to its share
                "step_seconds": step_seconds(report, cluster, accumulate=_accumulate(layout, batch))
                if report.refused is None
                else None,
                "peak_gib": report.largest.peak / GIB if report.refused is None else None,
                "fits": report.fits(H100_GIB * GIB),
                "communication_gib": {k: v / GIB for k, v in report.communication.items()},
                "refused": report.refused,
                "seconds": time.perf_counter() - started,
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        fitting = [r for r in rows if r.get("fits")]
        best = min(fitting, key=lambda r: r["step_seconds"], default=None)
        formula["dry_run_of_it"] = next((r for r in rows if r["layout"] == layout_name(theirs)), None)
        mine = next((c for c in candidates if best is not None and layout_name(c) == best["layout"]), None)
        formula_of_mine = formula_view(name, mine) if mine is not None else None
        record["models"][name] = {
            "dry_run": rows,
            "formula": formula,
            "dry_run_choice": best,
            "formula_of_choice": formula_of_mine,
        }
    return record


def _dry_run_words(row: dict | None) -> str:
    if not row:
        return "not run"
    if "error" in row or row.get("refused"):
        return f"could not run it ({row.get('error') or row['refused']})"
    fits = "fits" if row["fits"] else "does not fit"
    return f"{row['peak_gib']:.1f} GiB at its largest rank ({fits} 80 GiB), {row['step_seconds']:.2f} s per step."


def _formula_words(view: dict | None) -> str:
    if not view:
        return "none"
    if "refused" in view:
        return f"refused ({view['refused']})"
    return f"{view['memory_gib']:.1f} GiB, {view['step_time_s']:.2f} s"


def render(record: dict, command: str) -> str:
    from benchmarks.results import cpu_description, today

    lines = [
        "## Dry run at real sizes: Llama-3-8B and Mixtral-8x7B on 64 H100s, beside the formula planner",
        "",
        f"- {today()}, {cpu_description()} (the dry run needs no GPU).",
        f"- `{command}`: transformers' classes at the published configs, built on meta; {SEQ} tokens per "
        f"sequence, micro batch 1, {MICROBATCHES * GPUS} sequences a step for every layout (a replica's dry-run step, {MICROBATCHES} microbatches under 1F1B or 1 sequence when p = 1, accumulated to its share), AdamW, "
        f"precision {PRECISION} (Lightning's: fp32 weights, gradients and moments, 16 bytes of state per parameter; "
        f"the step under autocast, its casts as torch makes them); {H100_GIB} GiB per GPU, 8 per node.",
        "- The formula planner (`lightning_ptdp.planner.plan`, `Cluster.h100(64)`) with the same batch, micro batch 1, "
        "sequence parallelism and no recompute; it models bf16 activations.",
        "",
    ]
    for name, result in record["models"].items():
        f = result["formula"]
        lines += [
            f"**{name}**: the formula planner's fastest: t={f['tensor_parallel_size']} p={f['pipeline_parallel_size']} "
            f"d={f['data_parallel_size']} e={f['expert_parallel_size']} ZeRO-{f['zero_stage']}, "
            f"{f['memory_gib']:.1f} GiB per GPU and {f['step_time_s']:.2f} s per step (its estimates); dry-run: "
            + _dry_run_words(f.get("dry_run_of_it")),
            "",
        ]
        choice = result["dry_run_choice"]
        lines += [
            f"**{name}**: the dry run's fastest that fits: "
            + (
                f"{choice['layout']}, {choice['peak_gib']:.1f} GiB, {choice['step_seconds']:.2f} s per step (cost model); "
                f"the formula planner's estimate of it: {_formula_words(result.get('formula_of_choice'))}."
                if choice
                else "none fits."
            ),
            "",
            "| layout | largest rank's peak (GiB) | fits 80 GiB | step (s, cost model) | communication per step (GiB) | dry-run seconds |",
            "|---|---|---|---|---|---|",
        ]
        for row in result["dry_run"]:
            if "error" in row or row.get("refused"):
                lines.append(f"| {row['layout']} | {row.get('error') or 'refused: ' + row['refused'][:150]} | | | | |")
                continue
            comm = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["communication_gib"].items()))
            fits = "yes" if row["fits"] else "no"
            lines.append(
                f"| {row['layout']} | {row['peak_gib']:.1f} | {fits} | {row['step_seconds']:.2f} | {comm} | {row['seconds']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.results import code_version, write_section

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    commit = code_version()
    record = run(args.models.split(","))
    print(json.dumps(record, indent=1))
    if args.write_results:
        command = "python -m benchmarks.dry_run_real_sizes " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(SECTION, render(record, command.strip()), commit=commit)
    return record


if __name__ == "__main__":
    main()
