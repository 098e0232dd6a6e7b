"""``ptdp plan``: rank the layouts of a model on a cluster, or estimate one (``--layout``). The model
is a known name, ``layers,hidden,heads[,vocab,seq]`` or a transformers ``config.json``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from lightning_ptdp.planner.cost import GB, Cluster
from lightning_ptdp.planner.estimate import Layout, estimate
from lightning_ptdp.planner.models import MODELS, ModelSize, model_size
from lightning_ptdp.planner.render import format_layout, format_plan
from lightning_ptdp.planner.search import plan

LAYOUT_KEYS = {
    "t": "tensor_parallel_size",
    "p": "pipeline_parallel_size",
    "e": "expert_parallel_size",
    "c": "context_parallel_size",
    "v": "virtual_pipeline_size",
    "b": "micro_batch_size",
    "recompute": "activation_checkpointing",
}


def parse_layout(text: str) -> dict:
    """ "t=8,p=64,v=1,b=1" (and optionally recompute=full|selective|none) -> estimate's keyword arguments."""
    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in LAYOUT_KEYS or not value.strip():
            raise ValueError(
                f"--layout item {item!r} is not KEY=VALUE with KEY one of {', '.join(LAYOUT_KEYS)}; "
                f"write e.g. --layout t=8,p=64,v=1,b=1"
            )
        if key == "recompute":
            out[LAYOUT_KEYS[key]] = None if value.strip().lower() == "none" else value.strip()
            continue
        try:
            out[LAYOUT_KEYS[key]] = int(value)
        except ValueError:
            raise ValueError(f"--layout {key}={value!r} must be a whole number, e.g. {key}=8") from None
    missing = [k for k in ("t", "p") if LAYOUT_KEYS[k] not in out]
    if missing:
        raise ValueError(
            f"--layout needs {' and '.join(missing)} (t and p; e, c, v, b and recompute are optional), "
            f"e.g. --layout t=8,p=64,v=1,b=1"
        )
    return out


def _model(text: str, seq_length: int | None) -> ModelSize | str:
    if text.endswith(".json") or Path(text).is_file():
        if not Path(text).is_file():
            raise ValueError(f"no such config.json: {text!r}; pass the path of a transformers model's config.json")
        return ModelSize.from_hf_config(text, seq_length=seq_length)
    if "," in text:
        names = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length")
        sizes = dict(zip(names, map(int, text.split(","))))
        if seq_length:
            sizes["seq_length"] = seq_length
        return ModelSize(**sizes)
    if seq_length:
        return replace(model_size(text), seq_length=seq_length)
    return text


def _sizes(flag: str, text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{flag}={text!r} must list whole numbers >= 1, e.g. {flag} 1,2,4,8")
    return sizes


def main(argv: list[str] | None = None) -> int:
    """``ptdp plan MODEL --gpus N --global-batch-size B [--layout t=8,p=64,v=1,b=1]``. MODEL is a
    known name, ``layers,hidden,heads[,vocab,seq]`` or the path of a transformers config.json."""
    parser = argparse.ArgumentParser(prog="ptdp plan", description="Rank PTD-P layouts by estimated step time.")
    parser.add_argument(
        "model", nargs="?", help=f"{', '.join(MODELS)}; layers,hidden,heads[,vocab,seq]; or a transformers config.json"
    )
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--global-batch-size", type=int, help="sequences per step")
    parser.add_argument("--layout", help="estimate this one layout, e.g. t=8,p=64,v=1,b=1 (recompute=full default)")
    parser.add_argument("--seq-length", type=int, help="tokens per sequence (config.json: its context, at most 4096)")
    for flag, default in (
        ("gpus-per-node", 8),
        ("gpu-memory-gb", 80.0),
        ("peak-tflops", 312.0),
        ("intra-node-gb-per-s", 240.0),
        ("inter-node-gb-per-s", 25.0),
    ):
        parser.add_argument(f"--{flag}", type=type(default), default=default, help=f"default {default} (per GPU)")
    parser.add_argument("--zero-stage", type=int, help="fix the ZeRO stage (default: 0-3 searched; --layout: 0)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--eager-attention",
        action="store_true",
        help="attention keeps its s x s scores (eager or math attention, pre-sm80 GPUs); default: flash/cuDNN SDPA",
    )
    parser.add_argument(
        "--context-parallel", default="1", help="context-parallel sizes c to search, e.g. 1,2,4,8 (long sequences)"
    )
    parser.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="the busiest expert-parallel rank's routed rows over the mean (ExpertLoad's moe/rank_imbalance); "
        "default 1.0, balanced",
    )
    parser.add_argument("--top", type=int, default=5, help="layouts to list")
    parser.add_argument(
        "--model",
        dest="factory",
        metavar="MODULE:FACTORY",
        help="dry-run your own model: a function returning the LightningModule (or it and its datamodule)",
    )
    parser.add_argument(
        "--precision",
        default="32-true",
        help="with --model: the Trainer's precision, e.g. bf16-mixed (default 32-true)",
    )
    args = parser.parse_args(argv)
    if args.factory is not None:
        return _dry_run(parser, args)
    if args.model is None or args.gpus is None or args.global_batch_size is None:
        parser.exit(2, "ptdp plan: MODEL, --gpus and --global-batch-size are required\n")
    try:
        model = _model(args.model, args.seq_length)
        cluster = Cluster(
            num_gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_bytes=args.gpu_memory_gb * GB,
            peak_flops=args.peak_tflops * 1e12,
            intra_node_bandwidth=args.intra_node_gb_per_s * GB,
            inter_node_bandwidth=args.inter_node_gb_per_s * GB,
            flash_attention=not args.eager_attention,
        )
        if args.layout:
            layout = estimate(
                model,
                cluster,
                args.global_batch_size,
                zero_stage=args.zero_stage or 0,
                sequence_parallel=args.sequence_parallel,
                expert_imbalance=args.expert_imbalance,
                **parse_layout(args.layout),
            )
            sys.stdout.write(format_layout(layout, cluster) + "\n")
            return 0
        searched = dict(
            zero_stage=args.zero_stage,
            sequence_parallel=args.sequence_parallel,
            context_parallel_sizes=_sizes("--context-parallel", args.context_parallel),
        )
        layouts = plan(model, cluster, args.global_batch_size, expert_imbalance=args.expert_imbalance, **searched)
        balanced = None
        if args.expert_imbalance > 1.0 and model_size(model).num_experts:
            balanced = plan(model, cluster, args.global_batch_size, **searched)[0]
    except (ValueError, TypeError) as err:
        parser.exit(2, f"ptdp plan: {err}\n")
    sys.stdout.write(f"model: {model_size(model).describe()}\n")
    sys.stdout.write(format_plan(layouts, cluster, limit=args.top) + "\n")
    if balanced is not None:
        sys.stdout.write(balancing_line(layouts[0], balanced, args.expert_imbalance) + "\n")
    return 0


def _dry_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--model``: ptdp's own setup of the user's model on a fake process group (planner/fit.py)."""
    from lightning_ptdp.planner.fit import dry_run, format_dry_run

    if args.gpus is None:
        parser.exit(2, "ptdp plan --model: --gpus is required (the world size to dry-run)\n")
    devices = min(args.gpus, args.gpus_per_node)
    try:
        if args.gpus % devices:
            raise ValueError(f"--gpus={args.gpus} is not a whole number of nodes of --gpus-per-node={devices}")
        reports = dry_run(
            args.factory,
            devices=devices,
            num_nodes=args.gpus // devices,
            device_memory_gb=args.gpu_memory_gb,
            precision=args.precision,
        )
    except (ValueError, TypeError) as err:
        parser.exit(2, f"ptdp plan: {err}\n")
    from lightning_ptdp.planner.cost import Cluster

    cluster = Cluster.h100(args.gpus, gpus_per_node=devices)
    sys.stdout.write(format_dry_run(reports[: args.top], args.gpu_memory_gb, cluster) + "\n")
    return 0


def balancing_line(imbalanced: Layout, balanced: Layout, imbalance: float) -> str:
    """What balanced routing would buy: the best step at ``imbalance`` against the best at 1.0."""

    def shape(x: Layout) -> str:
        return f"t={x.tensor_parallel_size} p={x.pipeline_parallel_size} e={x.expert_parallel_size}"

    saved = 1 - balanced.step_time_s / imbalanced.step_time_s
    return (
        f"routing imbalance {imbalance:g}: best step {imbalanced.step_time_s:.3f} s ({shape(imbalanced)}); "
        f"balanced: {balanced.step_time_s:.3f} s ({shape(balanced)}), {saved:.1%} less"
    )
