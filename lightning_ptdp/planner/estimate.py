"""Step time and memory of one layout: ``estimate(model, cluster, B, tensor_parallel_size=..., ...)``.

    step = m * (stage compute + TP + EP all-to-alls + CP K/V + P2P) * (1 + (p-1)/(v*m)) + DP + optimizer

Ranks are ordered as in Megatron (t innermost, then c, d, p; e consecutive dp ranks share the
experts); nothing overlaps (Megatron 2021). Each term is in its function below;
docs/architecture.md ("The planner") lists them with their sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

from lightning_ptdp.core.flops import activation_bytes_per_layer, model_state_bytes_per_rank
from lightning_ptdp.planner.cost import (
    GB,
    Cluster,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    flash_attention_seconds,
    gemm_pass_seconds,
    memory_seconds,
    send_seconds,
)
from lightning_ptdp.planner.models import ModelSize, check_positive, model_size
from lightning_ptdp.planner.rules import (
    check_imbalance,
    check_options,
    context_parallel_reason,
    expert_parallel_reason,
    hsdp_reason,
)

BF16 = 2  # bytes per activation, gradient and communicated element
OPTIMIZER_BYTES_PER_PARAMETER = 32
"""Adam step: read the 16-bit gradient (2), read and write the fp32 master weight, m and v (24),
write the 16-bit weight (2); the gradient norm reads the gradients (2), zeroing writes them (2)."""
SCHEDULES = ("interleaved_1f1b", "1f1b", "gpipe")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One layout's estimate; times in seconds per training step, memory in bytes per GPU.
    ``step_time_s`` is the sum of the eight ``*_s`` terms."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    expert_parallel_size: int
    virtual_pipeline_size: int
    micro_batch_size: int
    activation_checkpointing: str | None
    num_microbatches: int
    global_batch_size: int
    sequence_parallel: bool
    zero_stage: int
    pipeline_schedule: str
    scatter_gather: bool
    step_time_s: float
    compute_s: float
    tensor_parallel_comm_s: float
    expert_parallel_comm_s: float
    """The all-to-all token exchanges of expert parallelism (0 at e = 1)."""
    pipeline_comm_s: float
    bubble_s: float
    data_parallel_comm_s: float
    optimizer_s: float
    bubble_fraction: float
    memory_bytes_per_gpu: float
    tflops_per_gpu: float
    """Executed TFLOP/s per GPU at the estimated step time (the paper's measure)."""
    reason: str = ""
    context_parallel_size: int = 1
    """c: ranks splitting each sequence (d = GPUs / (t*p*c))."""
    context_parallel_comm_s: float = 0.0
    """The key/value all-gathers (forward) and reduce-scatters (backward) of context parallelism."""
    data_parallel_shard_size: int | None = None
    """HSDP under ZeRO 2-3: the dense state is sharded within groups of this many replicas (None: all)."""
    expert_imbalance: float = 1.0
    """The busiest ep rank's routed rows over the mean, as charged (1.0: balanced routing, or e = 1)."""


def executed_flops(model: ModelSize, batch: int, recompute: str | None) -> tuple[float, float]:
    """(transformer-layer FLOPs, logit-layer FLOPs) of one iteration, recompute included, by the
    paper's terms for any layer: 2 FLOPs per weight and token in each matmul, 4bs^2h for QK^T and
    scores x V (``attention_flops_per_key``), three passes (four under full recompute); on its GPT,
    exactly its Eq. 3."""
    b, s, l, h, vocab = batch, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    logits = 6 * b * s * h * vocab
    core = b * s * s * model.attention_flops_per_key
    forward = 2 * b * s * model.active_matrix_parameters + l * core
    layers = forward * (4 if recompute == "full" else 3)
    if recompute == "selective":  # the attention core (QK^T and scores x V) runs forward again
        layers += core * l
    return layers, logits


def expert_rows(model: ModelSize, t: int, b: int, sp: bool) -> float:
    """(token, expert) rows one rank's MoE layer routes per microbatch: k per token it holds. The
    experts are not split by TP: under SP each TP rank routes its s/t tokens, without SP every TP
    rank routes (and computes) the whole sequence again. 0 for a dense model."""
    return (model.experts_per_token or 0) * b * model.seq_length / (t if sp else 1)


def layer_memory_bytes(model: ModelSize, t: int, b: int, sp: bool, scores: bool = True) -> float:
    """Bytes the memory-bound kernels of one layer's forward stream (backward: twice as many);
    ``scores``: attention writes its s x s scores (no fused attention), softmax and dropout stream them."""
    s, h, a = model.seq_length, model.hidden_size, model.num_heads
    sbh = s * b * h
    norms_residual = 22 * sbh / (t if sp else 1)  # 2 layer norms (4sbh), 2 bias-dropout-add (7sbh)
    # bias + GeLU read and write the f/t-wide activation; SwiGLU reads two of them and writes one
    per_width = 6 if model.gated_mlp else 4
    activation = per_width * s * b * model.dense_ffn_size / t
    rows = expert_rows(model, t, b, sp)  # each routed row: the activation, and a permute in and out (8h)
    experts = rows * (per_width * model.ffn_size + 8 * h)
    softmax = 9 * a * s * s * b / t if scores else 0.0  # scale-mask-softmax (4), attention dropout (5) per score
    return norms_residual + activation + experts + softmax


def _expert_gemms(
    model: ModelSize, t: int, b: int, sp: bool, e: int, cluster: Cluster, imbalance: float = 1.0
) -> tuple[float, float]:
    """(forward, backward) of the routed experts and the router on the busiest ep rank, whose n/e experts
    run ``imbalance`` times the mean e/n of the rows each (a grouped GEMM of n/e; larger e, fuller GEMMs):
    the exchange waits for it."""
    if not model.num_experts:
        return 0.0, 0.0
    h, f, n = model.hidden_size, model.ffn_size, model.num_experts
    rows = expert_rows(model, t, b, sp) * e / n * imbalance
    up = f * (2 if model.gated_mlp else 1)
    shapes = [(rows, up, h), (rows, h, f)]
    passes = [gemm_pass_seconds(*shape, cluster, batch=n // e) for shape in shapes]
    passes.append(gemm_pass_seconds(b * model.seq_length / (t if sp else 1), n, h, cluster))  # the router
    forward, backward = map(sum, zip(*passes))
    return forward, backward


@lru_cache(maxsize=4096)
def _layer_seconds(
    model: ModelSize,
    t: int,
    b: int,
    recompute: str | None,
    sp: bool,
    cluster: Cluster,
    e: int = 1,
    c: int = 1,
    imbalance: float = 1.0,
) -> tuple[float, float, float, float]:
    """(compute, TP communication, EP all-to-alls, CP key/value exchanges) of one layer for one
    microbatch, forward + backward. Under context parallelism a rank holds s/c tokens, whose queries
    attend to all s keys (causal work balanced by the 2c chunks: 1/c of the attention each). The
    experts and the exchanges are the busiest ep rank's: ``imbalance`` times the mean rows (it
    receives as much more, and the all-to-all ends when it has)."""
    s, h, a = model.seq_length, model.hidden_size, model.num_heads
    tokens, scores = b * s / c, not cluster.flash_attention
    f = model.dense_ffn_size  # the MLP, or a mixture of experts' shared expert (0: none)
    up = f * (2 if model.gated_mlp else 1)
    linear = [(tokens, cols, inner) for cols, inner in model.attention_linears(t)]
    linear += [(tokens, up / t, h), (tokens, h, f / t)] if f else []
    linear_f, linear_b = map(sum, zip(*(gemm_pass_seconds(*shape, cluster) for shape in linear)))
    if scores:  # QK^T and scores x V as two GEMMs, b*a/t of each, the scores through HBM
        attention = [(s / c, s, model.qk_head_dim), (s / c, model.v_head_dim, s)]
        core_f, core_b = map(sum, zip(*(gemm_pass_seconds(*shape, cluster, batch=b * a // t) for shape in attention)))
    else:
        core_f, core_b = flash_attention_seconds(b * s / c * s * model.attention_flops_per_key / t, cluster)
    experts_f, experts_b = _expert_gemms(model, t, b, sp, e, cluster, imbalance)
    linear_f, linear_b = linear_f + experts_f, linear_b + experts_b
    sbh = s * b * h / c
    streamed = layer_memory_bytes(model, t, b, sp, scores) / c  # every term per token, or per query row
    softmax = 9 * a * s * s * b / t / c if scores else 0.0
    forward = linear_f + core_f + memory_seconds(streamed, cluster)
    backward = linear_b + core_b + 2 * memory_seconds(streamed, cluster)
    again = {"full": forward, "selective": core_f + memory_seconds(softmax, cluster), None: 0.0}[recompute]
    # dispatch and combine, forward and backward (full recompute: the forward's again); e
    # consecutive dp ranks, t apart: gpus_per_node / t of them share a node
    exchanges = 6 if recompute == "full" else 4
    ep_members = max(1, min(e, cluster.gpus_per_node // t))
    routed = BF16 * h * expert_rows(model, t, b, sp) * imbalance
    ep = exchanges * all_to_all_seconds(routed, e, ep_members, cluster)
    # K and V all-gathered in forward (again under full recompute), reduce-scattered in backward:
    # this rank's KV heads over the whole sequence; cp ranks are t apart
    kv = BF16 * b * s * max(1, model.kv_heads // t) * (model.qk_head_dim + model.v_head_dim) / 2
    cp_members = max(1, min(c, cluster.gpus_per_node // t))
    cp = (6 if recompute == "full" else 4) * all_gather_seconds(kv, c, cp_members, cluster)
    if t == 1:
        return forward + backward + again, 0.0, ep, cp
    collectives = (6 if recompute == "full" else 4) + (1 if sp else 0)
    within = cluster.gpus_per_node % t == 0
    per_node = t if within else gcd(t, cluster.gpus_per_node)
    communication = collectives * all_reduce_seconds(BF16 * sbh, t, per_node, cluster)
    return forward + backward + again, communication, ep, cp


def _logit_seconds(model: ModelSize, t: int, b: int, cluster: Cluster, c: int = 1) -> float:
    """The last stage's logit GEMM (forward + backward) and vocab-parallel cross entropy over fp32
    logits (about six passes of 4 bytes per logit). Under context parallelism without TP each rank
    takes its s/c tokens; with TP the sequence is whole and the vocabulary split."""
    tokens, vocab = b * model.seq_length / (c if t == 1 else 1), model.vocab_size / t
    forward, backward = gemm_pass_seconds(tokens, vocab, model.hidden_size, cluster)
    return forward + backward + memory_seconds(24 * tokens * vocab, cluster)


def memory_bytes(
    model: ModelSize,
    t: int,
    p: int,
    d: int,
    v: int,
    b: int,
    m: int,
    recompute: str | None,
    sp: bool,
    zero_stage: int,
    schedule: str,
    e: int = 1,
    c: int = 1,
    *,
    flash: bool = True,
    shard: int | None = None,
) -> float:
    """Model state + the first stage's activations in flight + one layer recomputing + fp32 logits.
    ``flash``: attention keeps no s x s scores, only its fp32 log-sum-exp per head and query row
    (flash/cuDNN SDPA); otherwise the scores, their softmax and dropout mask (Korthikanti's 5as^2b).
    The routed experts' state is split over e and p (not t), ZeRO-sharded over the d/e ranks sharing them.
    Context parallelism: each layer keeps s/c tokens' activations, its queries' scores over all s keys
    and the gathered keys and values; the dense state is ZeRO-sharded over d*c; the logits are 1/c
    without TP (the head and loss on each rank's tokens), whole-sequence and 1/t by vocabulary with it."""
    s, a = model.seq_length, model.num_heads
    shape_args = (s // c, b, model.hidden_size, a, t, sp and t > 1)
    split = {"split_sbh": model.split_activation_sbh}
    dense, experts = model.parameters - model.expert_parameters, model.expert_parameters
    state = model_state_bytes_per_rank(dense, t, p, shard or d * c, zero_stage)  # HSDP: sharded over its group
    state += model_state_bytes_per_rank(experts, e, p, d // e, zero_stage) if experts else 0.0
    if schedule == "gpipe":
        in_flight = m  # every microbatch's forward before any backward
    else:  # 1F1B keeps min(p, m); interleaving adds (p-1)/(p*v) of it (Narayanan et al., Section 2.2)
        in_flight = min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    # the routed rows' activations: whole on each TP rank without SP (expert_rows)
    routed = model.expert_activation_sbh * model.seq_length * b * model.hidden_size / (t if sp else 1)
    routed /= c
    gathered = BF16 * b * s * (c - 1) / c * max(1, model.kv_heads // t) * (model.qk_head_dim + model.v_head_dim)
    routed += model.whole_activation_sbh * s * b * model.hidden_size / c  # MLA's latents, whole on each TP rank
    # rows s/c over s keys, beyond the formula's (s/c)^2; a fused kernel keeps 4 bytes per row and head instead
    scores = 4 * a * b * (s // c) / t if flash else 5 * a * b * (s // c) * (s - s // c) / t
    whole = "selective" if flash else None  # a layer's activations with nothing recomputed: the scores or not
    kept = activation_bytes_per_layer(*shape_args, recompute or whole, **split) + (routed if recompute != "full" else 0)
    kept += (gathered if recompute != "full" else 0) + (scores if recompute is None else 0)
    activations = kept * model.num_layers / p * in_flight
    if recompute == "full":  # the layer being recomputed holds all its activations at once
        activations += activation_bytes_per_layer(*shape_args, whole, **split) + routed + gathered + scores
    logits = b * model.seq_length * model.vocab_size / (t if t > 1 else c) * 4
    return state + activations + logits


def _group_all_reduce(nbytes: float, ranks: int, stride: int, cluster: Cluster) -> float:
    """An all-reduce over ``ranks`` members ``stride`` global ranks apart (a node holds the consecutive ones)."""
    spans = stride * ranks > cluster.gpus_per_node
    per_node = min(ranks, max(1, cluster.gpus_per_node // stride)) if spans else ranks
    return all_reduce_seconds(nbytes, ranks, per_node, cluster)


def cost(
    model: ModelSize,
    cluster: Cluster,
    batch: int,
    t: int,
    p: int,
    v: int,
    b: int,
    *,
    recompute: str | None = "full",
    sp: bool = False,
    zero_stage: int = 0,
    schedule: str = "interleaved_1f1b",
    scatter_gather: bool = True,
    e: int = 1,
    c: int = 1,
    shard: int | None = None,
    imbalance: float = 1.0,
) -> Layout:
    """The estimate of an already-validated layout (``estimate`` checks the arguments first). ``shard``:
    HSDP's group of replicas under ZeRO 2-3 (None: all d * c). ``imbalance``: the busiest ep rank's
    routed rows over the mean, at most e (every row on one rank); 1 where e = 1 (each rank routes to
    its own copy of every expert: a hot expert is a larger GEMM, not a busier rank)."""
    d = cluster.num_gpus // (t * p * c)
    imbalance = min(imbalance, e) if e > 1 and model.num_experts else 1.0
    shard = shard if shard and shard < d * c else None  # HSDP's group; a group of all d * c is plain FSDP
    m = batch // (b * d)
    layer, tp_layer, ep_layer, cp_layer = _layer_seconds(model, t, b, recompute, sp, cluster, e, c, imbalance)
    if model.dense_layers:  # the mean layer: a stage's share of dense and MoE layers taken as the model's
        dense = _layer_seconds(model.dense_layer, t, b, recompute, sp, cluster, 1, c)
        share = model.dense_layers / model.num_layers
        mean = [(1 - share) * moe + share * x for moe, x in zip((layer, tp_layer, ep_layer, cp_layer), dense)]
        layer, tp_layer, ep_layer, cp_layer = mean
    layers_per_stage = model.num_layers / p
    compute_mb = layers_per_stage * layer + _logit_seconds(model, t, b, cluster, c)
    tp_mb = layers_per_stage * tp_layer
    ep_mb = layers_per_stage * ep_layer
    cp_mb = layers_per_stage * cp_layer
    pp_mb = embedding = 0.0
    across = cluster.num_gpus > cluster.gpus_per_node  # the pipeline's slowest hop sets its pace
    if p > 1:
        activation = BF16 * b * model.seq_length * model.hidden_size / c
        if scatter_gather and t > 1 and across:
            hop = send_seconds(activation / t, True, cluster) + all_gather_seconds(activation, t, t, cluster)
        else:
            hop = send_seconds(activation, across, cluster)
        pp_mb = v * 2 * hop  # activations forward, gradients back, per chunk
        embedding = all_reduce_seconds(BF16 * model.vocab_size * model.hidden_size / t, 2, 1 if across else 2, cluster)
    bubble_fraction = (p - 1) / (v * m)
    bubble = (p - 1) / v * (compute_mb + tp_mb + ep_mb + cp_mb + pp_mb)
    # dense parameters split over t*p, reduced over d; the routed experts over e*p, reduced over d/e
    groups = [((model.parameters - model.expert_parameters) / (t * p), d * c, t)]  # cp folded into dp
    groups += [(model.expert_parameters / (e * p), d // e, t * e)] if model.expert_parameters else []
    dp = optimizer = 0.0
    for index, (params, ranks, stride) in enumerate(groups):
        sharded = shard if index == 0 and shard else ranks  # HSDP: the dense state's group
        if sharded > 1:  # ZeRO's reduce-scatter and all-gather (an all-reduce's traffic) within the group
            dp += (1.5 if zero_stage == 3 else 1.0) * _group_all_reduce(BF16 * params, sharded, stride, cluster)
        if sharded < ranks:  # HSDP: each rank's gradient shard all-reduced across the groups
            dp += _group_all_reduce(BF16 * params / sharded, ranks // sharded, stride * sharded, cluster)
        optimizer += memory_seconds(OPTIMIZER_BYTES_PER_PARAMETER * params / (sharded if zero_stage else 1), cluster)
    step = m * (compute_mb + tp_mb + ep_mb + cp_mb + pp_mb) + embedding + bubble + dp + optimizer
    layer_flops, logit_flops = executed_flops(model, batch, recompute)
    return Layout(
        tensor_parallel_size=t,
        pipeline_parallel_size=p,
        data_parallel_size=d,
        expert_parallel_size=e,
        virtual_pipeline_size=v,
        micro_batch_size=b,
        activation_checkpointing=recompute,
        num_microbatches=m,
        global_batch_size=batch,
        sequence_parallel=sp and t > 1,
        zero_stage=zero_stage,
        pipeline_schedule=schedule,
        scatter_gather=scatter_gather,
        step_time_s=step,
        compute_s=m * compute_mb,
        tensor_parallel_comm_s=m * tp_mb,
        expert_parallel_comm_s=m * ep_mb,
        expert_imbalance=imbalance,
        pipeline_comm_s=m * pp_mb + embedding,
        bubble_s=bubble,
        data_parallel_comm_s=dp,
        optimizer_s=optimizer,
        bubble_fraction=bubble_fraction,
        memory_bytes_per_gpu=memory_bytes(
            model,
            t,
            p,
            d,
            v,
            b,
            m,
            recompute,
            sp and t > 1,
            zero_stage,
            schedule,
            e,
            c,
            flash=cluster.flash_attention,
            shard=shard,
        ),
        tflops_per_gpu=(layer_flops + logit_flops) / step / cluster.num_gpus / 1e12,
        context_parallel_size=c,
        context_parallel_comm_s=m * cp_mb,
        data_parallel_shard_size=shard,
    )


def estimate(
    model: str | ModelSize,
    cluster: Cluster,
    global_batch_size: int,
    *,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    virtual_pipeline_size: int = 1,
    micro_batch_size: int = 1,
    activation_checkpointing: str | None = "full",
    sequence_parallel: bool = False,
    zero_stage: int = 0,
    pipeline_schedule: str = "interleaved_1f1b",
    scatter_gather: bool = True,
    memory_fraction: float = 0.9,
    data_parallel_shard_size: int | None = None,
    expert_imbalance: float = 1.0,
) -> Layout:
    """The estimated ``Layout`` (``tflops_per_gpu``, ``step_time_s`` and its parts) of one layout;
    d is ``cluster.num_gpus / (t * p * c)``. ``expert_imbalance``: the busiest ep rank's routed rows
    over the mean (``ExpertLoad``'s ``moe/rank_imbalance``). A ValueError names the value, the rule it
    breaks and a fix."""
    size = model_size(model)
    t, p, v, b = tensor_parallel_size, pipeline_parallel_size, virtual_pipeline_size, micro_batch_size
    e, c = expert_parallel_size, context_parallel_size
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("tensor_parallel_size", t),
        ("pipeline_parallel_size", p),
        ("expert_parallel_size", e),
        ("context_parallel_size", c),
        ("virtual_pipeline_size", v),
        ("micro_batch_size", b),
    ):
        check_positive(name, value)
    check_options(activation_checkpointing, sequence_parallel, zero_stage, memory_fraction)
    check_imbalance(expert_imbalance)
    if sequence_parallel and t == 1:
        raise ValueError(
            "sequence_parallel=True needs tensor_parallel_size > 1 (it splits activations inside the "
            "TP group); set tensor_parallel_size=2 or more, or sequence_parallel=False"
        )
    if pipeline_schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} is not one of {SCHEDULES}; choose one of those")
    if cluster.num_gpus % (t * p * c):
        names, letters = ("", "") if c == 1 else (" * context_parallel_size", "*c")
        raise ValueError(
            f"tensor_parallel_size * pipeline_parallel_size{names} = {t * p * c} does not divide the cluster's "
            f"{cluster.num_gpus} GPUs (d = GPUs / (t*p{letters}) must be whole); choose t and p{' and c' if c > 1 else ''} "
            f"whose product divides {cluster.num_gpus}"
        )
    reason = context_parallel_reason(size, c, e)
    if reason:
        raise ValueError(reason)
    reason = size.tensor_parallel_reason(t)
    if reason:
        raise ValueError(reason)
    if size.num_layers % (p * v):
        raise ValueError(
            f"pipeline_parallel_size * virtual_pipeline_size = {p} * {v} = {p * v} must divide "
            f"num_layers={size.num_layers} (each model chunk holds whole layers); use a divisor"
        )
    if v > 1 and (p == 1 or pipeline_schedule == "1f1b"):
        raise ValueError(
            f"virtual_pipeline_size={v} needs pipeline_parallel_size > 1 and an interleaving schedule "
            f"(got p={p}, pipeline_schedule={pipeline_schedule!r}); use virtual_pipeline_size=1"
        )
    d = cluster.num_gpus // (t * p * c)
    reason = expert_parallel_reason(size, d, e)
    if reason:
        raise ValueError(reason)
    if global_batch_size % (b * d):
        raise ValueError(
            f"micro_batch_size * data_parallel_size = {b} * {d} = {b * d} must divide "
            f"global_batch_size={global_batch_size} (every replica runs whole microbatches); change b, "
            f"the batch or the GPU count"
        )
    reason = hsdp_reason(data_parallel_shard_size, zero_stage, d * c, e)
    if reason:
        raise ValueError(reason)
    m = global_batch_size // (b * d)
    if v > 1 and m % p:
        raise ValueError(
            f"interleaving (virtual_pipeline_size={v}) needs the microbatch count m = B/(b*d) = {m} to "
            f"be a multiple of pipeline_parallel_size={p}; change the batch or micro_batch_size, or use "
            f"virtual_pipeline_size=1"
        )
    layout = cost(
        size,
        cluster,
        global_batch_size,
        t,
        p,
        v,
        b,
        recompute=activation_checkpointing,
        sp=sequence_parallel,
        zero_stage=zero_stage,
        schedule=pipeline_schedule,
        scatter_gather=scatter_gather,
        e=e,
        c=c,
        shard=data_parallel_shard_size,
        imbalance=expert_imbalance,
    )
    limit = cluster.gpu_memory_bytes * memory_fraction
    if layout.memory_bytes_per_gpu > limit:
        raise ValueError(
            f"t={t}, p={p}, {f'c={c}, ' if c > 1 else ''}v={v}, b={b}, recompute={activation_checkpointing!r} needs "
            f"{layout.memory_bytes_per_gpu / GB:.1f} GB per GPU, over the {limit / GB:.1f} GB usable "
            f"({memory_fraction:.0%} of {cluster.gpu_memory_bytes / GB:.1f} GB); raise t*p, recompute, "
            f"or use zero_stage=1..3"
        )
    return layout
