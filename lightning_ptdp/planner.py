"""Layout planner (``ptdp plan``): a pure cost model ranking (t, p, d, v, b, recompute) layouts.

No process group, no torch: arithmetic on :mod:`lightning_ptdp.tools.flops`.  Layouts obey ``t*p*d =
num_gpus``, ``t | heads``, ``t | hidden``, ``p*v | layers``, ``b*d | B`` (and ``p | m`` to interleave).

* Memory per GPU: model state (``model_state_bytes_per_rank``) + the first stage's activations
  (``min(p, m)`` microbatches of its ``l/p`` layers under 1F1B, times ``1 + (p-1)/(p*v)`` when
  interleaved, Korthikanti et al. 2022) + one layer's full activations while it is recomputed
  + the fp32 logits. Layouts over ``memory_fraction`` of the GPU are dropped (the rest is for
  the CUDA context, NCCL buffers and fragmentation).
* Step time: ``compute * (1 + (p-1)/(v*m)) + TP + PP + DP``. Compute: the slowest stage's FLOPs
  (``l/p`` layers + the logit layer on the last stage) at ``peak * achievable_fraction``. TP: 4
  ring all-reduces of ``2bsh`` bytes per layer and microbatch (6 with full recompute; SP adds
  backward's 2 all-gathers of its saved 1/t region inputs, one all-reduce's bytes). PP: a
  ``2bsh/t`` send each way per microbatch and chunk (scatter/gather over the t links) + the tied
  embedding's gradient. DP: a ring all-reduce of the bf16 gradients. A ring over n ranks sends
  ``2(n-1)/n`` of the buffer per rank; groups tiling a node use NVLink, others the network.
  Nothing overlaps (as in Megatron 2021). Coarse on purpose: the paper's Section 3 trade-offs
  (TP within a node, bubble against memory, DP traffic falling with t*p), not kernel speeds.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple, Optional, Union

from lightning_ptdp.tools.flops import (
    activation_bytes_per_layer,
    gpt_flops_per_iteration,
    gpt_parameter_count,
    model_state_bytes_per_rank,
)

__all__ = ["TABLE_1", "Cluster", "Layout", "LayoutArguments", "ModelSize", "PaperConfiguration",
           "format_plan", "layout_arguments", "main", "model_size", "plan"]

GB = 1e9
BF16 = 2  # bytes per activation, gradient and communicated element
RECOMPUTE_CHOICES = (None, "selective", "full")


def _check_positive(name: str, value: object, *, integer: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """A GPT's shape; defaults are the paper's vocabulary (51,200, padded) and context (2,048)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int = 51_200
    seq_length: int = 2_048

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            _check_positive(f"ModelSize.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"ModelSize.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}; use a multiple of the head count")

    @property
    def parameters(self) -> int:
        return gpt_parameter_count(self.num_layers, self.hidden_size, self.vocab_size, self.seq_length)


@dataclass(frozen=True)
class PaperConfiguration:
    """One row of Table 1 of Narayanan et al. 2021 (weak scaling on 80 GB A100s, 8 per node)."""

    model: ModelSize
    parameters_billions: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_gpus: int
    global_batch_size: int
    achieved_tflops_per_gpu: float


# name: (parameters in billions, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU)
_TABLE_1_ROWS = {
    "gpt_1.7b": (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    "gpt_3.6b": (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    "gpt_7.5b": (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    "gpt_18.4b": (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    "gpt_39.1b": (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    "gpt_76.1b": (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    "gpt_145.6b": (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    "gpt_310.1b": (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    "gpt_529.6b": (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    "gpt_1t": (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
}
TABLE_1: dict[str, PaperConfiguration] = {
    name: PaperConfiguration(ModelSize(num_layers=row[3], hidden_size=row[2], num_heads=row[1]), row[0], *row[4:])
    for name, row in _TABLE_1_ROWS.items()}


def model_size(model: Union[str, ModelSize]) -> ModelSize:
    """A ``ModelSize`` as is, or the sizes of a Table 1 name ("gpt_1.7b" ... "gpt_1t")."""
    if isinstance(model, ModelSize):
        return model
    key = str(model).strip().lower().replace("-", "_")
    if key not in TABLE_1:
        raise ValueError(f"unknown model {model!r}: pass a ModelSize(...) or one of the Table 1 "
                         f"names {', '.join(TABLE_1)}")
    return TABLE_1[key].model


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs and links; bandwidths in bytes/s per GPU and direction. The defaults are the paper's
    DGX A100 nodes: 8 x 80 GB, 312 TFLOP/s bf16, NVLink 3, 8 x 200 Gb/s InfiniBand per node."""

    num_gpus: int
    gpu_memory_bytes: float = 80 * GB
    peak_flops: float = 312e12
    """Dense peak FLOP/s of one GPU at the training precision."""
    intra_node_bandwidth: float = 300 * GB
    inter_node_bandwidth: float = 25 * GB
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node", "gpu_memory_bytes", "peak_flops",
                     "intra_node_bandwidth", "inter_node_bandwidth"):
            _check_positive(f"Cluster.{name}", getattr(self, name), integer=name in ("num_gpus", "gpus_per_node"))
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"Cluster.num_gpus={self.num_gpus} is not a whole number of nodes of "
                             f"{self.gpus_per_node} GPUs; use a multiple of gpus_per_node")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One ranked candidate; times in seconds per training step, memory in bytes per GPU."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_size: int
    micro_batch_size: int
    activation_checkpointing: Optional[str]
    num_microbatches: int
    global_batch_size: int
    sequence_parallel: bool
    zero_stage: int
    step_time_s: float
    compute_s: float
    bubble_fraction: float
    tensor_parallel_comm_s: float
    pipeline_comm_s: float
    data_parallel_comm_s: float
    memory_bytes_per_gpu: float
    tflops_per_gpu: float
    """Executed TFLOP/s per GPU at the estimated step time (the paper's measure)."""
    reason: str = ""


_Options = NamedTuple("_Options", [("zero_stage", int), ("sequence_parallel", bool),
                                   ("achievable_fraction", float), ("memory_limit", float)])


def _shapes(model: ModelSize, num_gpus: int, batch: int, max_b: int) -> Iterator[tuple[int, ...]]:
    """Every (t, p, d, v, b, m) obeying the divisibility rules (m: microbatches per step)."""
    for t in _divisors(num_gpus):
        if model.num_heads % t or model.hidden_size % t:
            continue
        for p in _divisors(num_gpus // t):
            d = num_gpus // (t * p)
            if model.num_layers % p or batch % d:
                continue
            for b in (b for b in _divisors(batch // d) if b <= max_b):
                m = batch // (b * d)
                for v in _divisors(model.num_layers // p) if p > 1 else [1]:
                    if v == 1 or m % p == 0:  # interleaving needs m to be a multiple of p
                        yield t, p, d, v, b, m


def _memory(model: ModelSize, shape: tuple[int, ...], recompute: Optional[str], opts: _Options) -> float:
    t, p, d, v, b, m = shape
    shape_args = (model.seq_length, b, model.hidden_size, model.num_heads, t, opts.sequence_parallel and t > 1)
    state = model_state_bytes_per_rank(model.parameters, t, p, d, opts.zero_stage)
    in_flight = min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    activations = activation_bytes_per_layer(*shape_args, recompute) * model.num_layers / p * in_flight
    if recompute == "full":  # the layer being recomputed holds all its activations at once
        activations += activation_bytes_per_layer(*shape_args, None)
    logits = b * model.seq_length * model.vocab_size / t * 4  # fp32 logits for the loss
    return state + activations + logits


def _executed_flops(model: ModelSize, batch: int, recompute: Optional[str]) -> tuple[float, float]:
    """(transformer-layer FLOPs, logit-layer FLOPs) of one iteration, recompute included."""
    dims = (batch, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size)
    total = gpt_flops_per_iteration(*dims, activation_recompute=recompute == "full")
    if recompute == "selective":  # the attention core (QK^T and scores x V) runs forward again
        total += 4 * batch * model.seq_length ** 2 * model.hidden_size * model.num_layers
    logits = 6 * batch * model.seq_length * model.hidden_size * model.vocab_size
    return total - logits, logits


def _ring_seconds(size_bytes: float, ranks: int, bandwidth: float) -> float:
    return 2 * (ranks - 1) / ranks * size_bytes / bandwidth  # what each rank sends in a ring


def _link(span: int, cluster: Cluster) -> float:
    """Bandwidth of a group whose ranks lie within ``span`` consecutive GPUs: NVLink only when
    such blocks tile the nodes (a block of 6 on 8-GPU nodes straddles two of them)."""
    within = cluster.gpus_per_node % span == 0
    return cluster.intra_node_bandwidth if within else cluster.inter_node_bandwidth


def _estimate(model: ModelSize, cluster: Cluster, batch: int, shape: tuple[int, ...],
              recompute: Optional[str], opts: _Options) -> Layout:
    t, p, d, v, b, m = shape
    layer_flops, logit_flops = _executed_flops(model, batch, recompute)
    # the last stage also runs the logit layer and sets the pace of the whole pipeline
    slowest_stage = layer_flops / p + logit_flops
    compute = slowest_stage / (t * d * cluster.peak_flops * opts.achievable_fraction)
    bubble = (p - 1) / (v * m)
    activation = b * model.seq_length * model.hidden_size * BF16
    tp = pp = dp = 0.0
    if t > 1:
        all_reduces = 6 if recompute == "full" else 4
        if opts.sequence_parallel:  # + backward's 2 all-gathers of the saved 1/t inputs: one all-reduce's bytes
            all_reduces += 1
        tp = m * model.num_layers / p * all_reduces * _ring_seconds(activation, t, _link(t, cluster))
    if p > 1:  # activations forward, gradients backward, then the tied embedding's gradient
        pipeline_link = _link(t * d * p, cluster)
        pp = 2 * v * m * activation / t / pipeline_link
        pp += _ring_seconds(model.vocab_size * model.hidden_size / t * BF16, 2, pipeline_link)
    if d > 1:
        zero3 = 1.5 if opts.zero_stage == 3 else 1.0  # all-gather twice + reduce-scatter
        grads = model.parameters / (t * p) * BF16
        dp = zero3 * _ring_seconds(grads, d, _link(t * d, cluster))
    step = compute * (1 + bubble) + tp + pp + dp
    layout = Layout(
        tensor_parallel_size=t, pipeline_parallel_size=p, data_parallel_size=d,
        virtual_pipeline_size=v, micro_batch_size=b, activation_checkpointing=recompute,
        num_microbatches=m, global_batch_size=batch, sequence_parallel=opts.sequence_parallel and t > 1,
        zero_stage=opts.zero_stage, step_time_s=step, compute_s=compute, bubble_fraction=bubble,
        tensor_parallel_comm_s=tp, pipeline_comm_s=pp, data_parallel_comm_s=dp,
        memory_bytes_per_gpu=_memory(model, shape, recompute, opts),
        tflops_per_gpu=(layer_flops + logit_flops) / step / cluster.num_gpus / 1e12)
    return replace(layout, reason=_reason(layout, cluster.gpus_per_node, opts.memory_limit))


def _reason(x: Layout, per_node: int, limit: float) -> str:
    t = x.tensor_parallel_size
    where = "within a node" if per_node % t == 0 else "across nodes"
    tp = "no TP" if t == 1 else f"TP {where} (t={t}, {per_node} GPUs/node)"
    return (f"{tp}; bubble (p-1)/(v*m)={x.bubble_fraction:.3f} (m={x.num_microbatches}); "
            f"comm/step TP {x.tensor_parallel_comm_s:.2f}s, PP {x.pipeline_comm_s:.2f}s, "
            f"DP {x.data_parallel_comm_s:.2f}s; recompute={x.activation_checkpointing}; "
            f"{x.memory_bytes_per_gpu / GB:.1f} of {limit / GB:.1f} GB usable")


def plan(model: Union[str, ModelSize], cluster: Cluster, global_batch_size: int, *,
         zero_stage: int = 0, sequence_parallel: bool = False, achievable_fraction: float = 0.5,
         memory_fraction: float = 0.9, max_micro_batch_size: int = 8,
         recompute_modes: tuple = RECOMPUTE_CHOICES) -> list[Layout]:
    """Every layout that fits in memory, fastest estimated step first; ValueError saying why if none.

    ``model``: a ``ModelSize`` or a Table 1 name. ``achievable_fraction``: of the peak, what the
    matmuls reach (the paper reports 44-52% end to end). ``memory_fraction``: of the GPU, what is
    usable. ``recompute_modes``: the choices tried; ``(None, "full")`` is the paper's toolset
    (selective recompute came with Korthikanti et al. 2022)."""
    size = model_size(model)
    if not recompute_modes or any(mode not in RECOMPUTE_CHOICES for mode in recompute_modes):
        raise ValueError(f"recompute_modes must be a non-empty selection of {RECOMPUTE_CHOICES}, "
                         f"got {recompute_modes!r}")
    _check_positive("global_batch_size", global_batch_size)
    _check_positive("max_micro_batch_size", max_micro_batch_size)
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3) or not isinstance(sequence_parallel, bool):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 and sequence_parallel True or False, "
                         f"got zero_stage={zero_stage!r}, sequence_parallel={sequence_parallel!r}")
    for name, value in (("achievable_fraction", achievable_fraction), ("memory_fraction", memory_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    opts = _Options(zero_stage, sequence_parallel, achievable_fraction, cluster.gpu_memory_bytes * memory_fraction)
    shapes = list(_shapes(size, cluster.num_gpus, global_batch_size, max_micro_batch_size))
    if not shapes:
        raise ValueError(
            f"no layout of {cluster.num_gpus} GPUs fits the model and batch: every (t, p, d) with "
            f"t*p*d = {cluster.num_gpus} breaks a rule among t | num_heads ({size.num_heads}), t | "
            f"hidden_size ({size.hidden_size}), p | num_layers ({size.num_layers}) and d | "
            f"global_batch_size ({global_batch_size}); change the GPU count or the batch size")
    candidates = [_estimate(size, cluster, global_batch_size, shape, recompute, opts)
                  for shape in shapes for recompute in recompute_modes]
    fitting = [c for c in candidates if c.memory_bytes_per_gpu <= opts.memory_limit]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes_per_gpu)
        raise ValueError(
            f"the model ({size.parameters / 1e9:.1f}B parameters) does not fit in GPU memory with any layout "
            f"of {cluster.num_gpus} GPUs: the smallest need is {least.memory_bytes_per_gpu / GB:.1f} GB per GPU "
            f"(t={least.tensor_parallel_size}, p={least.pipeline_parallel_size}, recompute="
            f"{least.activation_checkpointing!r}, b={least.micro_batch_size}), over the "
            f"{opts.memory_limit / GB:.1f} GB usable ({memory_fraction:.0%} of {cluster.gpu_memory_bytes / GB:.1f} "
            f"GB); use more GPUs, zero_stage=1..3, sequence_parallel=True or GPUs with more memory")
    # ties (b without pipelining changes only memory): fewer, larger microbatches run faster
    return sorted(fitting, key=lambda c: (round(c.step_time_s, 6), -c.micro_batch_size,
                                          c.memory_bytes_per_gpu, c.virtual_pipeline_size))


@dataclass(frozen=True, kw_only=True)
class LayoutArguments:
    """A layout as arguments: strategy, Trainer, and the per-rank dataloader batch size."""

    strategy: dict
    trainer: dict
    per_rank_batch_size: int

    def python(self) -> str:
        strategy = ", ".join(f"{k}={v!r}" for k, v in self.strategy.items())
        trainer = "".join(f", {k}={v!r}" for k, v in self.trainer.items())
        return (f"Trainer(strategy=PTDPStrategy({strategy}){trainer})  "
                f"# dataloader batch size per rank: {self.per_rank_batch_size}")

    def cli_flags(self) -> list[str]:
        return self._assignments("--trainer.strategy.", "--trainer.", "--data.")

    def hydra_overrides(self) -> list[str]:  # "++": conf/trainer has no accumulate_grad_batches
        return [f"++{item}" if item.startswith("trainer.accumulate") else item
                for item in self._assignments("parallel.", "trainer.", "data.")]

    def _assignments(self, strategy: str, trainer: str, data: str) -> list[str]:
        pairs = [(strategy + k, v) for k, v in self.strategy.items()]
        pairs += [(trainer + k, v) for k, v in self.trainer.items()]
        spelled = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in pairs]
        return spelled + [f"{data}batch_size={self.per_rank_batch_size}"]


def layout_arguments(layout: Layout, cluster: Cluster) -> LayoutArguments:
    """The strategy and Trainer arguments that run ``layout`` on ``cluster``.

    With pipelining the strategy splits each rank's batch of ``B/d`` into microbatches of
    ``b``; without it, microbatches are Lightning's gradient accumulation of ``m`` batches of ``b``.
    """
    pipelined = layout.pipeline_parallel_size > 1
    strategy: dict = {"tensor_parallel_size": layout.tensor_parallel_size,
                      "pipeline_parallel_size": layout.pipeline_parallel_size,
                      "data_parallel_size": layout.data_parallel_size}
    optional = {"virtual_pipeline_size": layout.virtual_pipeline_size > 1,
                "micro_batch_size": pipelined, "sequence_parallel": layout.sequence_parallel,
                "zero_stage": layout.zero_stage > 0,
                "activation_checkpointing": layout.activation_checkpointing is not None}
    strategy.update({name: getattr(layout, name) for name, used in optional.items() if used})
    trainer: dict = {"devices": min(cluster.num_gpus, cluster.gpus_per_node),
                     "num_nodes": max(1, cluster.num_gpus // cluster.gpus_per_node)}
    if not pipelined and layout.num_microbatches > 1:
        trainer["accumulate_grad_batches"] = layout.num_microbatches
    per_rank = layout.global_batch_size // layout.data_parallel_size if pipelined else layout.micro_batch_size
    return LayoutArguments(strategy=strategy, trainer=trainer, per_rank_batch_size=per_rank)


def format_plan(layouts: list[Layout], cluster: Cluster, limit: int = 5) -> str:
    """A text table of the best ``limit`` layouts and the arguments that run the best one."""
    if not layouts:
        raise ValueError("format_plan needs at least one layout (plan() raises rather than return none)")
    rows = ["rank    t    p    d    v    b  recompute     m    step s  TFLOP/s/GPU  GB/GPU"]
    for rank, x in enumerate(layouts[:limit], start=1):
        degrees = (rank, x.tensor_parallel_size, x.pipeline_parallel_size, x.data_parallel_size,
                   x.virtual_pipeline_size, x.micro_batch_size)
        rows.append("".join(f"{n:>4} " for n in degrees) + f" {str(x.activation_checkpointing):<9} "
                    f"{x.num_microbatches:>5} {x.step_time_s:>9.3g} {x.tflops_per_gpu:>12.1f} "
                    f"{x.memory_bytes_per_gpu / GB:>7.1f}")
    args = layout_arguments(layouts[0], cluster)
    return "\n".join(rows + ["", f"best: {layouts[0].reason}", "", args.python(), "",
                             " ".join(args.cli_flags()), "", " ".join(args.hydra_overrides())])


def main(argv: Optional[list[str]] = None) -> int:
    """``ptdp plan MODEL --gpus N --global-batch-size B``: the ranked layouts, then the arguments
    that run the best. MODEL is a Table 1 name or ``layers,hidden,heads[,vocab,seq]``."""
    parser = argparse.ArgumentParser(prog="ptdp plan", description="Rank PTD-P layouts by estimated step time.")
    parser.add_argument("model", help="gpt_1.7b ... gpt_1t, or layers,hidden,heads[,vocab,seq]")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, required=True, help="sequences per step")
    for flag, default in (("gpus-per-node", 8), ("gpu-memory-gb", 80.0), ("peak-tflops", 312.0),
                          ("intra-node-gb-per-s", 300.0), ("inter-node-gb-per-s", 25.0), ("zero-stage", 0)):
        parser.add_argument(f"--{flag}", type=type(default), default=default, help=f"default {default} (per GPU)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--top", type=int, default=5, help="layouts to list")
    args = parser.parse_args(argv)
    names = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length")
    try:
        model = ModelSize(**dict(zip(names, map(int, args.model.split(","))))) if "," in args.model else args.model
        cluster = Cluster(num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                          gpu_memory_bytes=args.gpu_memory_gb * GB, peak_flops=args.peak_tflops * 1e12,
                          intra_node_bandwidth=args.intra_node_gb_per_s * GB,
                          inter_node_bandwidth=args.inter_node_gb_per_s * GB)
        layouts = plan(model, cluster, args.global_batch_size, zero_stage=args.zero_stage,
                       sequence_parallel=args.sequence_parallel)
    except (ValueError, TypeError) as err:
        parser.exit(2, f"ptdp plan: {err}\n")
    sys.stdout.write(format_plan(layouts, cluster, limit=args.top) + "\n")
    return 0
