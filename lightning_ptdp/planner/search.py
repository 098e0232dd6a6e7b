"""``plan``: every valid layout of a cluster, estimated and ranked; and the fit of the one constant."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from lightning_ptdp.planner.cost import GB, Cluster
from lightning_ptdp.planner.estimate import Layout, cost
from lightning_ptdp.planner.models import TABLE_1, ModelSize, check_positive, model_size
from lightning_ptdp.planner.rules import (
    RECOMPUTE_CHOICES,
    check_imbalance,
    check_options,
    context_parallel_reason,
    expert_parallel_reason,
)

FIT_ROWS = ("gpt_1.7b", "gpt_1t")
"""The Table 1 rows ``cost.GEMM_EFFICIENCY`` is fitted on (the smallest and the largest model)."""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _shapes(
    model: ModelSize, num_gpus: int, batch: int, max_b: int, contexts: Sequence[int] = (1,)
) -> Iterator[tuple[int, ...]]:
    """Every (t, p, v, b, e, c) obeying the divisibility rules (and m % p == 0 to interleave); e, for
    a mixture of experts, any divisor of d that divides the expert count; c among ``contexts``."""
    for t in _divisors(num_gpus):
        if model.tensor_parallel_reason(t):
            continue
        for p in _divisors(num_gpus // t):
            for c in contexts:
                if (num_gpus // (t * p)) % c or context_parallel_reason(model, c):
                    continue
                d = num_gpus // (t * p * c)
                if model.num_layers % p or batch % d:
                    continue
                for b in (b for b in _divisors(batch // d) if b <= max_b):
                    m = batch // (b * d)
                    for v in _divisors(model.num_layers // p) if p > 1 else [1]:
                        if v == 1 or m % p == 0:
                            for e in _divisors(d) if c == 1 else [1]:
                                if not expert_parallel_reason(model, d, e):
                                    yield t, p, v, b, e, c


def reason(x: Layout, cluster: Cluster, limit: float) -> str:
    """Why this layout costs what it does, in one line."""
    t, per_node = x.tensor_parallel_size, cluster.gpus_per_node
    where = "within a node" if per_node % t == 0 else "across nodes"
    tp = "no TP" if t == 1 else f"TP {where} (t={t}, {per_node} GPUs/node)"
    ep = f"EP {x.expert_parallel_comm_s:.2f}s, " if x.expert_parallel_size > 1 else ""
    ep += f"CP (c={x.context_parallel_size}) {x.context_parallel_comm_s:.2f}s, " if x.context_parallel_size > 1 else ""
    return (
        f"{tp}; bubble (p-1)/(v*m)={x.bubble_fraction:.3f} (m={x.num_microbatches}); "
        f"compute {x.compute_s:.2f}s, comm/step TP {x.tensor_parallel_comm_s:.2f}s, {ep}PP {x.pipeline_comm_s:.2f}s, "
        f"DP {x.data_parallel_comm_s:.2f}s; recompute={x.activation_checkpointing}, zero_stage={x.zero_stage}; "
        f"{x.memory_bytes_per_gpu / GB:.1f} of {limit / GB:.1f} GB usable"
    )


def _shard_sizes(cluster: Cluster, zero_stage: int, t: int, replicas: int, e: int) -> tuple[int | None, ...]:
    """FSDP over all replicas, and under ZeRO 2-3 on several nodes HSDP with the largest group of replicas
    that fits one node (torchtitan's and Megatron's usual choice: all-gathers over the node's links only)."""
    if zero_stage < 2 or e > 1 or t * replicas <= cluster.gpus_per_node:
        return (None,)
    fits = [s for s in range(1, replicas) if replicas % s == 0 and t * s <= cluster.gpus_per_node]
    return (None, max(fits)) if fits else (None,)


def plan(
    model: str | ModelSize,
    cluster: Cluster,
    global_batch_size: int,
    *,
    zero_stage: int | None = None,
    sequence_parallel: bool = False,
    memory_fraction: float = 0.9,
    max_micro_batch_size: int = 8,
    recompute_modes: Sequence[str | None] = RECOMPUTE_CHOICES,
    scatter_gather: bool = True,
    context_parallel_sizes: Sequence[int] = (1,),
    expert_imbalance: float = 1.0,
) -> list[Layout]:
    """Every layout that fits in memory, fastest estimated step first; ValueError saying why if none.

    ``model``: a ``ModelSize`` or a known name. ``memory_fraction``: of the GPU, what is usable.
    ``recompute_modes``: the choices tried; ``(None, "full")`` is the paper's toolset (selective
    recompute came with Korthikanti et al. 2022). ``sequence_parallel`` applies where t > 1.
    ``context_parallel_sizes``: the c tried (long sequences: e.g. (1, 2, 4, 8, 16)). ``zero_stage``:
    None searches the stages 0-3 as it searches t, p, v and b; a stage fixes it. ``expert_imbalance``:
    the busiest ep rank's routed rows over the mean, charged to the experts and the exchanges."""
    size = model_size(model)
    if not recompute_modes or any(mode not in RECOMPUTE_CHOICES for mode in recompute_modes):
        raise ValueError(
            f"recompute_modes must be a non-empty selection of {RECOMPUTE_CHOICES}, got {recompute_modes!r}"
        )
    check_positive("global_batch_size", global_batch_size)
    check_positive("max_micro_batch_size", max_micro_batch_size)
    check_options(None, sequence_parallel, 0 if zero_stage is None else zero_stage, memory_fraction)
    check_imbalance(expert_imbalance)
    stages = (0, 1, 2, 3) if zero_stage is None else (zero_stage,)
    limit = cluster.gpu_memory_bytes * memory_fraction
    shapes = list(_shapes(size, cluster.num_gpus, global_batch_size, max_micro_batch_size, context_parallel_sizes))
    if not shapes:
        raise ValueError(
            f"no layout of {cluster.num_gpus} GPUs fits the model and batch: every (t, p, d) with "
            f"t*p*d = {cluster.num_gpus} breaks a rule among t | num_heads ({size.num_heads}), num_kv_heads "
            f"({size.kv_heads}), hidden_size ({size.hidden_size}) and ffn_hidden_size ({size.ffn_size}), p | num_layers ({size.num_layers}) and d | "
            f"global_batch_size ({global_batch_size}); change the GPU count or the batch size"
        )
    candidates = [
        cost(
            size,
            cluster,
            global_batch_size,
            t,
            p,
            v,
            b,
            recompute=recompute,
            sp=sequence_parallel,
            zero_stage=stage,
            scatter_gather=scatter_gather,
            e=e,
            c=c,
            shard=shard,
            imbalance=expert_imbalance,
        )
        for t, p, v, b, e, c in shapes
        for recompute in recompute_modes
        for stage in stages
        for shard in _shard_sizes(cluster, stage, t, cluster.num_gpus // (t * p), e)
    ]
    fitting = [c for c in candidates if c.memory_bytes_per_gpu <= limit]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes_per_gpu)
        raise ValueError(
            f"the model ({size.parameters / 1e9:.1f}B parameters) does not fit in GPU memory with any layout "
            f"of {cluster.num_gpus} GPUs: the smallest need is {least.memory_bytes_per_gpu / GB:.1f} GB per GPU "
            f"(t={least.tensor_parallel_size}, p={least.pipeline_parallel_size}, "
            f"{f'c={least.context_parallel_size}, ' if least.context_parallel_size > 1 else ''}recompute="
            f"{least.activation_checkpointing!r}, b={least.micro_batch_size}), over the "
            f"{limit / GB:.1f} GB usable ({memory_fraction:.0%} of {cluster.gpu_memory_bytes / GB:.1f} "
            f"GB); use more GPUs{', zero_stage=1..3' if zero_stage == 0 else ''}, sequence_parallel=True or GPUs "
            "with more memory"
        )
    ranked = sorted(
        fitting,
        key=lambda c: (
            round(c.step_time_s, 6),
            -c.micro_batch_size,
            c.zero_stage,  # at equal time the lesser stage: fewer collectives than the cost model sees
            c.memory_bytes_per_gpu,
            c.virtual_pipeline_size,
            c.expert_parallel_size,
            c.context_parallel_size,
        ),
    )
    return [replace(x, reason=reason(x, cluster, limit)) for x in ranked]


def paper_layout(name: str, cluster: Cluster | None = None) -> Layout:
    """A Table 1 row's own layout (its t, p, GPUs and batch; b = 1, v = 1, full recompute) on ``Cluster.paper``."""
    row = TABLE_1[name]
    cluster = cluster or Cluster.paper(row.num_gpus)
    return cost(
        row.model,
        cluster,
        row.global_batch_size,
        row.tensor_parallel_size,
        row.pipeline_parallel_size,
        1,
        1,
        recompute="full",
    )


def table_1_fit_error(gemm_efficiency: float, rows: Sequence[str] = FIT_ROWS) -> float:
    """Sum over ``rows`` of the squared relative error of the estimate against the paper."""
    total = 0.0
    for name in rows:
        cluster = Cluster.paper(TABLE_1[name].num_gpus, gemm_efficiency=gemm_efficiency)
        total += (paper_layout(name, cluster).tflops_per_gpu / TABLE_1[name].achieved_tflops_per_gpu - 1) ** 2
    return total


def fit_gemm_efficiency(rows: Sequence[str] = FIT_ROWS, low: float = 0.3, high: float = 1.0) -> float:
    """The ``gemm_efficiency`` minimising ``table_1_fit_error`` (golden-section search, to 1e-4)."""
    ratio = (math.sqrt(5) - 1) / 2
    while high - low > 1e-4:
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if table_1_fit_error(a, rows) < table_1_fit_error(b, rows):
            high = b
        else:
            low = a
    return (low + high) / 2
