"""Tests for lightning_ptdp.planner: the layout rules, the cost model's arithmetic, the ranking
against the paper's Table 1 choices, memory rejections, rendering and error messages.

Expected memory figures are written out by hand from the formulas (Korthikanti et al. 2022 for
activations, 16 bytes per parameter for mixed-precision Adam), not by calling the planner twice.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import replace

import pytest

from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.core.flops import gpt_flops_per_iteration, gpt_parameter_count, training_time_seconds
from lightning_ptdp.planner import (
    FIT_ROWS,
    GEMM_EFFICIENCY,
    GPT3_175B,
    TABLE_1,
    Cluster,
    ModelSize,
    estimate,
    fit_gemm_efficiency,
    format_plan,
    layout_arguments,
    model_size,
    paper_layout,
    plan,
)
from lightning_ptdp.planner.cost import all_reduce_seconds, gemm_seconds, wave_efficiency

GB = 1e9
# Float sums of the same terms in a different order: relative difference of a few ulps.
REL = 1e-9

# The planner's top choice at the paper's GPU count and batch with the paper's toolset (no selective
# recompute, no sequence parallelism) is printed by benchmarks/bench_planner.py; at the paper's own
# layouts the estimate is held to Table 1 below (test_estimate_at_the_papers_layouts_matches_table_1).
PAPER_TOOLSET = {"recompute_modes": (None, "full"), "zero_stage": 0}
# Every Table 1 row at its own layout is within it (the largest error today is 8.7%, RESULTS.md planner_table_1).
TABLE_1_BOUND = 0.10
LATER_TOOLSET = {"sequence_parallel": True}


def paper_cluster(name: str) -> Cluster:
    """The row's GPUs as the paper ran them: attention that keeps its scores (Megatron 2021)."""
    return Cluster.paper(TABLE_1[name].num_gpus)


def top_choice(name: str, **options):
    row = TABLE_1[name]
    return plan(name, paper_cluster(name), row.global_batch_size, **options)[0]


def find(layouts, **degrees):
    """The first layout whose fields equal ``degrees``."""
    for layout in layouts:
        if all(getattr(layout, k) == v for k, v in degrees.items()):
            return layout
    raise AssertionError(f"no layout with {degrees}")


# --------------------------------------------------------------------------- Table 1


@pytest.mark.parametrize("name", list(TABLE_1))
def test_table_1_sizes_give_the_printed_parameter_counts(name):
    row = TABLE_1[name]
    assert round(row.model.parameters / 1e9, 1) == row.parameters_billions
    assert row.num_gpus % (row.tensor_parallel_size * row.pipeline_parallel_size) == 0


LARGE_ROWS = ["gpt_76.1b", "gpt_145.6b", "gpt_310.1b", "gpt_529.6b", "gpt_1t"]


@pytest.mark.parametrize("name", LARGE_ROWS)
def test_top_choice_of_the_large_models_is_near_the_papers_layout(name):
    """With the paper's settings (full recompute, b=1) the top choice keeps TP in a node and p within
    2x of the paper's, and the paper's own layout is within 10% of its step time. For the models up
    to 39.1B the planner prefers pipelining with a smaller t to the paper's t=4..8 (it rates the
    t=8 all-reduces at 20-30% of a layer there), so they are not held to this."""
    row = TABLE_1[name]
    best = top_choice(name, recompute_modes=("full",), max_micro_batch_size=1, zero_stage=0)
    assert best.tensor_parallel_size <= 8, best.reason
    assert row.pipeline_parallel_size / 2 <= best.pipeline_parallel_size <= row.pipeline_parallel_size * 2, best.reason
    assert paper_layout(name).step_time_s <= 1.10 * best.step_time_s


def test_table_names_are_accepted_in_any_case_and_with_dashes():
    assert model_size("GPT-1T") == TABLE_1["gpt_1t"].model
    sizes = ModelSize(num_layers=2, hidden_size=64, num_heads=4)
    assert model_size(sizes) is sizes


# --------------------------------------------------------------------------- ranking


def test_ranking_prefers_tensor_parallelism_within_a_node():
    cluster = paper_cluster("gpt_39.1b")
    layouts = plan("gpt_39.1b", cluster, 1536, zero_stage=0)  # ZeRO's choice apart (below)
    across = [i for i, x in enumerate(layouts) if x.tensor_parallel_size == 16]
    assert across, "expected t=16 layouts to fit and be ranked"
    within = [i for i, x in enumerate(layouts) if x.tensor_parallel_size in (2, 4, 8)]
    assert min(within) == 0 and min(across) > 0
    assert "TP within a node (t=" in layouts[0].reason
    assert layouts[across[0]].reason.startswith("TP across nodes (t=16, 8 GPUs/node)")
    # the same t=16 layout on 16-GPU nodes keeps TP on NVLink: 240 GB/s instead of the 8 HCAs'
    # 8 x 25 = 200 GB/s, and 3.4 us per ring step instead of 14 us for the network steps
    slow = layouts[across[0]]
    on_big_nodes = plan("gpt_39.1b", replace(cluster, gpus_per_node=16), 1536, zero_stage=0)
    fast = find(
        on_big_nodes,
        tensor_parallel_size=16,
        pipeline_parallel_size=slow.pipeline_parallel_size,
        virtual_pipeline_size=slow.virtual_pipeline_size,
        micro_batch_size=slow.micro_batch_size,
        activation_checkpointing=slow.activation_checkpointing,
    )
    assert 1.2 < slow.tensor_parallel_comm_s / fast.tensor_parallel_comm_s < 1.3


def test_a_tp_group_straddling_two_nodes_counts_as_across():
    layouts = plan("gpt_145.6b", paper_cluster("gpt_145.6b"), 2304)
    six = find(layouts, tensor_parallel_size=6)  # 96 heads and 12288 are multiples of 6
    assert six.reason.startswith("TP across nodes (t=6, 8 GPUs/node)")


def test_every_layout_obeys_the_rules_and_the_step_time_adds_up():
    model, batch = TABLE_1["gpt_39.1b"].model, 1536
    cluster = paper_cluster("gpt_39.1b")
    layouts = plan(model, cluster, batch)
    assert all(a.step_time_s <= b.step_time_s + 1e-6 for a, b in itertools.pairwise(layouts))  # ties at 1 us
    for x in layouts:
        t, p, d, v, b = (
            x.tensor_parallel_size,
            x.pipeline_parallel_size,
            x.data_parallel_size,
            x.virtual_pipeline_size,
            x.micro_batch_size,
        )
        assert t * p * d == cluster.num_gpus
        assert model.num_heads % t == 0 and model.hidden_size % t == 0
        assert model.num_layers % (p * v) == 0
        assert batch % (b * d) == 0 and x.num_microbatches == batch // (b * d)
        assert v == 1 or x.num_microbatches % p == 0
        assert x.bubble_fraction == pytest.approx((p - 1) / (v * x.num_microbatches), rel=REL)
        parts = (
            x.compute_s
            + x.tensor_parallel_comm_s
            + x.pipeline_comm_s
            + x.bubble_s
            + x.data_parallel_comm_s
            + x.optimizer_s
        )
        assert x.step_time_s == pytest.approx(parts, rel=REL)
        assert x.memory_bytes_per_gpu <= 0.9 * cluster.gpu_memory_bytes
        assert (x.tensor_parallel_comm_s == 0) == (t == 1)
        assert (x.data_parallel_comm_s == 0) == (d == 1)


def test_data_parallel_all_reduce_and_optimizer_by_hand():
    # gpt_1.7b, t=1, p=1, d=32 on 4 nodes: NCCL's ring over 32 ranks (62 steps, 8 of them over the
    # network) at the 8 HCAs' 200 GB/s per node beats its tree; Adam streams 32 bytes per parameter
    model = TABLE_1["gpt_1.7b"].model
    x = estimate("gpt_1.7b", paper_cluster("gpt_1.7b"), 512, tensor_parallel_size=1, pipeline_parallel_size=1)
    ring = 8.4e-6 + 54 * 3.4e-6 + 8 * 14e-6 + 2 * 31 / 32 * 2 * model.parameters / 200e9
    assert x.data_parallel_comm_s == pytest.approx(ring, rel=REL)
    assert x.optimizer_s == pytest.approx(32 * model.parameters / 2.039e12, rel=REL)
    flops = 96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert x.tflops_per_gpu == pytest.approx(flops / x.step_time_s / 32 / 1e12, rel=REL)
    assert (x.tensor_parallel_comm_s, x.pipeline_comm_s, x.bubble_s) == (0, 0, 0)


def test_gemm_roofline_and_wave_quantization_by_hand():
    a100 = Cluster(num_gpus=8)
    # (2048 x 2304) output: 8 x 18 = 144 tiles of 256 x 128 on 108 SMs -> 2 waves, 144/216 useful
    assert wave_efficiency(2048, 2304, a100) == pytest.approx(144 / 216)
    assert wave_efficiency(2048, 6912, a100) == pytest.approx(1.0)  # 432 tiles = 4 full waves
    seconds = gemm_seconds(2048, 2304, 9216, a100)
    assert seconds == pytest.approx(2 * 2048 * 2304 * 9216 / (312e12 * GEMM_EFFICIENCY) / (144 / 216), rel=REL)


def test_nccl_ring_and_tree_by_hand():
    a100 = Cluster(num_gpus=3072)
    # 8 ranks in a node, 100 MB: the ring's bandwidth term wins
    ring = 8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * 1e8 / 240e9
    assert all_reduce_seconds(1e8, 8, 8, a100) == pytest.approx(ring, rel=REL)
    # 384 ranks one per node, 1 KB: the tree's 2 log2(384) hops beat the ring's 766 steps
    tree = 2 * math.log2(384) * 28e-6 + 1e3 / (0.46 * 25e9)
    assert all_reduce_seconds(1e3, 384, 1, a100) == pytest.approx(tree, rel=REL)


# --------------------------------------------------------------------------- Table 1 and GPT-3


# The paper's Table 1 (Narayanan et al. 2021; also Megatron-LM's 2021 documentation), typed here
# rather than read from the planner: name -> (t, p, GPUs, batch, achieved TFLOP/s per GPU).
PAPER_TABLE_1 = {
    "gpt_1.7b": (1, 1, 32, 512, 137),
    "gpt_3.6b": (2, 1, 64, 512, 138),
    "gpt_7.5b": (4, 1, 128, 512, 142),
    "gpt_18.4b": (8, 1, 256, 1024, 135),
    "gpt_39.1b": (8, 2, 512, 1536, 138),
    "gpt_76.1b": (8, 4, 1024, 1792, 140),
    "gpt_145.6b": (8, 8, 1536, 2304, 148),
    "gpt_310.1b": (8, 16, 1920, 2160, 155),
    "gpt_529.6b": (8, 35, 2520, 2520, 163),
    "gpt_1t": (8, 64, 3072, 3072, 163),
}


def test_estimate_at_the_papers_layouts_matches_table_1():
    """Each row at its own layout: the paper's t and p, b=1, full recompute; v=1 (Table 1 states
    no v). One constant is fitted, GEMM_EFFICIENCY, on two rows (FIT_ROWS: gpt_1.7b and gpt_1t);
    the other eight are predictions. Every row within TABLE_1_BOUND."""
    errors = {}
    for name, (t, p, gpus, batch, paper) in PAPER_TABLE_1.items():
        x = estimate(
            name,
            Cluster.paper(gpus),
            batch,
            tensor_parallel_size=t,
            pipeline_parallel_size=p,
            virtual_pipeline_size=1,
            micro_batch_size=1,
            activation_checkpointing="full",
        )
        errors[name] = x.tflops_per_gpu / paper - 1
    assert FIT_ROWS == ("gpt_1.7b", "gpt_1t")
    assert all(abs(e) <= TABLE_1_BOUND for e in errors.values()), errors


def test_the_fitted_constant_is_what_the_fit_gives():
    assert fit_gemm_efficiency() == pytest.approx(GEMM_EFFICIENCY, abs=1e-3)


def test_efficiency_rises_with_model_size_as_in_the_paper():
    tflops = [paper_layout(name).tflops_per_gpu for name in ("gpt_39.1b", "gpt_145.6b", "gpt_529.6b")]
    assert tflops == sorted(tflops)


def test_gpt3_175b_on_1024_gpus_against_the_papers_140_tflops_and_34_days():
    # Eq. 4: 8 T P / (n X) with T = 300B tokens, P = 175B, n = 1024, X = 140 TFLOP/s: 34 days
    days = training_time_seconds(300e9, 175e9, 1024, 140e12) / 86400
    assert round(days) == 34 and days == pytest.approx(8 * 300e9 * 175e9 / (1024 * 140e12) / 86400)
    assert round(GPT3_175B.parameters / 1e9, 1) == 174.6  # Eq. 2, the paper's "174.6B" (Table 2)
    best = plan("gpt3_175b", Cluster.paper(1024), 1536, **PAPER_TOOLSET)[0]
    assert best.tflops_per_gpu == pytest.approx(140, rel=0.15)  # no recompute: fewer FLOPs than the paper counts
    assert best.tensor_parallel_size == 8 and best.pipeline_parallel_size > 1
    # Like with like: the paper's 140 counts recomputation's FLOPs (Eq. 4's 8TP) and was measured at a
    # layout it does not state; Table 1's row of the same width and heads (gpt_145.6b) ran t=8, p=8, b=1
    # with full recompute. There (and at p=16) the estimate is held to Table 1's bound. The search's best
    # layout (interleaved, b=2) is not: its +21.6% is the planner's own ranking of a layout the paper
    # did not measure (bench_planner reports it, beside Table 1's "paper layout step / top" column).
    for p in (8, 16):
        x = estimate("gpt3_175b", Cluster.paper(1024), 1536, tensor_parallel_size=8, pipeline_parallel_size=p)
        assert abs(x.tflops_per_gpu / 140 - 1) <= TABLE_1_BOUND, (p, x.tflops_per_gpu)


# --------------------------------------------------------------------------- estimate


def test_estimate_is_the_planners_figure_for_that_layout():
    cluster = paper_cluster("gpt_1t")
    x = estimate("gpt_1t", cluster, 3072, tensor_parallel_size=8, pipeline_parallel_size=64, virtual_pipeline_size=2)
    assert x == replace(
        find(
            plan("gpt_1t", cluster, 3072, zero_stage=0),
            tensor_parallel_size=8,
            pipeline_parallel_size=64,
            virtual_pipeline_size=2,
            micro_batch_size=1,
            activation_checkpointing="full",
        ),
        reason="",
    )
    assert x.bubble_fraction == pytest.approx(63 / (2 * 512))


def test_scatter_gather_and_interleaving_change_the_pipeline_terms():
    args = {"tensor_parallel_size": 8, "pipeline_parallel_size": 12}
    with_sg = estimate("gpt3_175b", Cluster(num_gpus=96), 480, **args, virtual_pipeline_size=2)
    without = estimate("gpt3_175b", Cluster(num_gpus=96), 480, **args, virtual_pipeline_size=2, scatter_gather=False)
    assert without.pipeline_comm_s > 3 * with_sg.pipeline_comm_s  # 8x the bytes over the HCAs
    plain = estimate("gpt3_175b", Cluster(num_gpus=96), 480, **args)
    assert with_sg.bubble_s == pytest.approx(plain.bubble_s / 2, rel=0.05)
    big = Cluster(num_gpus=96, gpu_memory_bytes=1e12)  # GPipe keeps all 480 microbatches' inputs
    gpipe = estimate("gpt3_175b", big, 480, **args, pipeline_schedule="gpipe")
    assert (
        gpipe.step_time_s == pytest.approx(plain.step_time_s)
        and gpipe.memory_bytes_per_gpu > plain.memory_bytes_per_gpu
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"tensor_parallel_size": 3, "pipeline_parallel_size": 1},
            r"tensor_parallel_size \* pipeline_parallel_size = 3 does not divide the cluster's 64 GPUs",
        ),
        (
            {"tensor_parallel_size": 64, "pipeline_parallel_size": 1},
            r"tensor_parallel_size=64 does not divide num_heads=32, num_kv_heads=32 \(each rank takes whole "
            r"heads.*\); choose one of 1, 2, 4, 8, 16, 32",
        ),
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 4},
            r"pipeline_parallel_size \* virtual_pipeline_size = 4 \* 1 = 4 must divide num_layers=30",
        ),
        (
            {
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "virtual_pipeline_size": 3,
                "micro_batch_size": 32,
            },
            r"needs the microbatch count m = B/\(b\*d\) = 1 to be a multiple of pipeline_parallel_size=2",
        ),
        (
            {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "micro_batch_size": 3},
            r"micro_batch_size \* data_parallel_size = 3 \* 64 = 192 must divide global_batch_size=512",
        ),
        (
            {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "virtual_pipeline_size": 2},
            r"virtual_pipeline_size=2 needs pipeline_parallel_size > 1",
        ),
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "activation_checkpointing": "some"},
            r"activation_checkpointing='some' is not one of \(None, 'selective', 'full'\)",
        ),
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "pipeline_schedule": "zigzag"},
            r"pipeline_schedule='zigzag' is not one of",
        ),
        (
            {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "sequence_parallel": True},
            r"sequence_parallel=True needs tensor_parallel_size > 1",
        ),
        (
            {"tensor_parallel_size": 0, "pipeline_parallel_size": 1},
            r"tensor_parallel_size must be a positive integer, got 0",
        ),
    ],
)
def test_estimate_rejects_a_bad_layout_with_the_rule_and_a_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate("gpt_3.6b", Cluster(num_gpus=64), 512, **kwargs)


def test_estimate_says_how_far_over_memory_a_layout_is():
    with pytest.raises(
        ValueError,
        match=r"t=1, p=1, v=1, b=1, recompute='full' needs [\d.]+ GB per GPU, over the "
        r"72\.0 GB usable \(90% of 80\.0 GB\); raise t\*p",
    ):
        estimate("gpt_18.4b", Cluster(num_gpus=256), 1024, tensor_parallel_size=1, pipeline_parallel_size=1)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("flash", [False, True])
def test_memory_of_a_replicated_layout_by_hand(flash):
    model = TABLE_1["gpt_1.7b"].model
    layouts = plan("gpt_1.7b", Cluster(num_gpus=32, flash_attention=flash), 512, zero_stage=0)
    x = find(
        layouts, tensor_parallel_size=1, pipeline_parallel_size=1, micro_batch_size=1, activation_checkpointing=None
    )
    s, h, a, l, V = model.seq_length, model.hidden_size, model.num_heads, model.num_layers, model.vocab_size
    state = 16 * model.parameters
    # b = 1, every layer keeps everything: the scores, their softmax and dropout mask (5as^2), or a
    # fused kernel's fp32 log-sum-exp per head and query row (4as)
    activations = l * (34 * s * h + (4 * a * s if flash else 5 * a * s * s))
    logits = 4 * s * V
    assert x.memory_bytes_per_gpu == pytest.approx(state + activations + logits, rel=REL)


def test_memory_of_an_interleaved_pipeline_with_full_recompute_by_hand():
    model = TABLE_1["gpt_1t"].model
    layouts = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, zero_stage=0)
    x = find(
        layouts,
        tensor_parallel_size=8,
        pipeline_parallel_size=64,
        virtual_pipeline_size=2,
        micro_batch_size=1,
        activation_checkpointing="full",
    )
    s, h, a, l, V = model.seq_length, model.hidden_size, model.num_heads, model.num_layers, model.vocab_size
    t, p, v = 8, 64, 2
    state = 16 * model.parameters / (t * p)
    # the first stage keeps the inputs (2sbh) of its l/p layers for p microbatches, times the
    # interleaving factor, and one layer's full activations while recomputing it
    kept = 2 * s * h * (l / p) * p * (1 + (p - 1) / (p * v))
    recomputing = s * h * (10 + 24 / t + 5 * a * s / (h * t))
    logits = 4 * s * V / t
    assert x.memory_bytes_per_gpu == pytest.approx(state + kept + recomputing + logits, rel=REL)
    # a fused attention kernel: the recomputing layer holds its log-sum-exp (4 bytes per head and row) instead
    flash = estimate(
        "gpt_1t",
        Cluster(num_gpus=3072),
        3072,
        tensor_parallel_size=t,
        pipeline_parallel_size=p,
        virtual_pipeline_size=v,
    )
    recomputing = s * h * (10 + 24 / t) + 4 * a * s / t
    assert flash.memory_bytes_per_gpu == pytest.approx(state + kept + recomputing + logits, rel=REL)


def test_layouts_over_the_memory_limit_are_dropped():
    layouts = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, zero_stage=0)
    # 16 bytes x 1008B parameters over t*p = 128 ranks is already 126 GB
    assert min(x.tensor_parallel_size * x.pipeline_parallel_size for x in layouts) >= 256
    tight = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, memory_fraction=0.6, zero_stage=0)
    assert 0 < len(tight) < len(layouts)
    assert all(x.memory_bytes_per_gpu <= 0.6 * 80 * GB for x in tight)
    assert any(x.memory_bytes_per_gpu > 0.6 * 80 * GB for x in layouts)


def test_the_search_tries_every_zero_stage_and_finds_a_layout_only_zero_fits():
    # 16 bytes per parameter of 1008B over t*p = 128 ranks is 126 GB: without ZeRO no such layout fits
    without = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, zero_stage=0, recompute_modes=("full",))
    searched = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, recompute_modes=("full",))
    assert {x.zero_stage for x in without} == {0} and {x.zero_stage for x in searched} == {0, 1, 2, 3}
    assert min(x.tensor_parallel_size * x.pipeline_parallel_size for x in without) >= 256
    small = [x for x in searched if x.tensor_parallel_size * x.pipeline_parallel_size <= 128]
    assert small and all(x.zero_stage > 0 for x in small)
    # the optimizer steps 1/d of the parameters from stage 1 on: a sharded stage is the best layout here
    assert searched[0].zero_stage > 0 and searched[0].step_time_s < without[0].step_time_s


def test_zero_sharding_admits_smaller_model_parallel_groups():
    layouts = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, zero_stage=1)
    assert min(x.tensor_parallel_size * x.pipeline_parallel_size for x in layouts) <= 128
    assert all(x.zero_stage == 1 for x in layouts)


# --------------------------------------------------------------------------- rendering


def test_arguments_for_a_pipelined_layout():
    cluster = paper_cluster("gpt_1t")
    x = find(
        plan("gpt_1t", cluster, 3072),
        tensor_parallel_size=8,
        pipeline_parallel_size=64,
        virtual_pipeline_size=2,
        micro_batch_size=1,
        activation_checkpointing="full",
        zero_stage=0,
    )
    args = layout_arguments(x, cluster)
    assert args.python() == (
        "Trainer(strategy=PTDPStrategy(tensor_parallel_size=8, pipeline_parallel_size=64, "
        "data_parallel_size=6, virtual_pipeline_size=2, micro_batch_size=1, "
        "activation_checkpointing='full'), devices=8, num_nodes=384)  # dataloader batch size per rank: 512"
    )
    assert args.cli_flags() == [
        "--trainer.strategy.tensor_parallel_size=8",
        "--trainer.strategy.pipeline_parallel_size=64",
        "--trainer.strategy.data_parallel_size=6",
        "--trainer.strategy.virtual_pipeline_size=2",
        "--trainer.strategy.micro_batch_size=1",
        "--trainer.strategy.activation_checkpointing=full",
        "--trainer.devices=8",
        "--trainer.num_nodes=384",
        "--data.batch_size=512",
    ]
    assert args.hydra_overrides()[:3] == [
        "parallel.tensor_parallel_size=8",
        "parallel.pipeline_parallel_size=64",
        "parallel.data_parallel_size=6",
    ]
    assert args.hydra_overrides()[-3:] == ["trainer.devices=8", "trainer.num_nodes=384", "data.batch_size=512"]
    config = ParallelConfig(**args.strategy)  # every rendered value passes the strategy's validation
    dims = ParallelDims.from_config(config, world_size=cluster.num_gpus)
    assert (dims.pp, dims.dp, dims.tp) == (64, 6, 8)


def test_arguments_without_pipelining_use_gradient_accumulation():
    cluster = Cluster(num_gpus=64)
    x = find(
        plan("gpt_3.6b", cluster, 512, sequence_parallel=True),
        pipeline_parallel_size=1,
        tensor_parallel_size=2,
        micro_batch_size=2,
    )
    args = layout_arguments(x, cluster)
    assert "micro_batch_size" not in args.strategy and args.strategy["sequence_parallel"] is True
    assert args.trainer == {"devices": 8, "num_nodes": 8, "accumulate_grad_batches": 8}
    assert args.per_rank_batch_size * x.data_parallel_size * args.trainer["accumulate_grad_batches"] == 512
    assert "--trainer.strategy.sequence_parallel=true" in args.cli_flags()
    assert "parallel.sequence_parallel=true" in args.hydra_overrides()
    assert "++trainer.accumulate_grad_batches=8" in args.hydra_overrides()
    assert "--trainer.accumulate_grad_batches=8" in args.cli_flags()
    ParallelConfig(**args.strategy)


def test_a_single_partial_node_renders_its_gpu_count():
    cluster = Cluster(num_gpus=4)
    args = layout_arguments(plan(ModelSize(num_layers=4, hidden_size=256, num_heads=4), cluster, 8)[0], cluster)
    assert (args.trainer["devices"], args.trainer["num_nodes"]) == (4, 1)


def test_format_plan_shows_the_table_the_reason_and_the_arguments():
    cluster = paper_cluster("gpt_76.1b")
    layouts = plan("gpt_76.1b", cluster, 1792)
    text = format_plan(layouts, cluster, limit=3)
    lines = text.splitlines()
    assert lines[0].split()[:8] == ["rank", "t", "p", "c", "d", "e", "v", "b"]
    assert [line.split()[0] for line in lines[1:4]] == ["1", "2", "3"]
    assert f"best: {layouts[0].reason}" in text
    assert layout_arguments(layouts[0], cluster).python() in text
    assert "--trainer.strategy.tensor_parallel_size=" in text and "parallel.tensor_parallel_size=" in text


# --------------------------------------------------------------------------- errors


def test_a_model_too_large_for_the_cluster_says_how_far_off_it_is():
    with pytest.raises(
        ValueError,
        match=r"\(1008\.0B parameters\) does not fit in GPU memory with any layout "
        r"of 64 GPUs: the smallest need is [\d.]+ GB per GPU \(t=.*over the "
        r"72\.0 GB usable \(90% of 80\.0 GB\); use more GPUs, zero_stage=1\.\.3",
    ):
        plan("gpt_1t", Cluster(num_gpus=64), 64, zero_stage=0)
    with pytest.raises(ValueError, match=r"use more GPUs, sequence_parallel=True or GPUs with more memory"):
        plan("gpt_1t", Cluster(num_gpus=64), 64)  # every stage searched: no stage to suggest


def test_no_factorisation_names_the_rules():
    model = ModelSize(num_layers=3, hidden_size=48, num_heads=3)
    with pytest.raises(
        ValueError,
        match=r"no layout of 16 GPUs fits the model and batch.*t \| num_heads \(3\).*"
        r"p \| num_layers \(3\) and d \| global_batch_size \(3\)",
    ):
        plan(model, Cluster(num_gpus=16), 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: model_size("gpt_2t"),
            (
                r"unknown model 'gpt_2t': pass a ModelSize\(\.\.\.\) or one of the "
                r"names gpt_1\.7b, gpt_3\.6b.*gpt3_175b"
            ),
        ),
        (
            lambda: ModelSize(num_layers=2, hidden_size=100, num_heads=3),
            r"hidden_size=100 is not divisible by num_heads=3",
        ),
        (
            lambda: ModelSize(num_layers=0, hidden_size=64, num_heads=4),
            r"ModelSize.num_layers must be a positive integer",
        ),
        (lambda: Cluster(num_gpus=12), r"num_gpus=12 is not a whole number of nodes of 8 GPUs"),
        (
            lambda: replace(Cluster(num_gpus=8), gpu_memory_bytes=-1),
            r"Cluster.gpu_memory_bytes must be a positive number, got -1",
        ),
        (
            lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 512, memory_fraction=1.5),
            r"memory_fraction must be in \(0, 1\], got 1.5",
        ),
        (lambda: Cluster(num_gpus=8, gemm_efficiency=1.5), r"Cluster.gemm_efficiency must be in \(0, 1\], got 1.5"),
        (
            lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 512, recompute_modes=("some",)),
            r"recompute_modes must be a non-empty selection of \(None, 'selective', 'full'\), got \('some',\)",
        ),
        (lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 512, zero_stage=4), r"zero_stage must be 0, 1, 2 or 3"),
        (lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 0), r"global_batch_size must be a positive integer, got 0"),
        (lambda: format_plan([], Cluster(num_gpus=8)), r"format_plan needs at least one layout"),
    ],
)
def test_bad_input_is_rejected_with_the_rule(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_table_1_rows_are_consistent_with_their_own_layouts():
    # the paper's (t, p) must itself be a valid layout at its GPU count and batch
    for name, row in TABLE_1.items():
        t, p = row.tensor_parallel_size, row.pipeline_parallel_size
        d = row.num_gpus // (t * p)
        assert row.model.num_heads % t == 0 and row.model.num_layers % p == 0, name
        assert row.global_batch_size % d == 0, name
        assert math.isclose(row.achieved_tflops_per_gpu / 312, 0.5, abs_tol=0.08), name


# --------------------------------------------------------------------------- ptdp plan


def test_ptdp_plan_prints_the_ranking_and_the_best_arguments(capsys):
    from lightning_ptdp.planner import main

    assert main(["gpt_76.1b", "--gpus", "1024", "--global-batch-size", "1792", "--top", "2"]) == 0
    out = capsys.readouterr().out
    expected = plan("gpt_76.1b", Cluster(num_gpus=1024), 1792)[0]
    assert out.splitlines()[0].startswith("model: 60 layers, hidden 10240, 80 heads, ffn 40960")
    assert out.splitlines()[2].split()[:3] == [
        "1",
        str(expected.tensor_parallel_size),
        str(expected.pipeline_parallel_size),
    ]
    flag = f"--trainer.strategy.tensor_parallel_size={expected.tensor_parallel_size}"
    assert f"best: {expected.reason}" in out and flag in out


def test_ptdp_plan_takes_sizes_and_cluster_flags(capsys):
    from lightning_ptdp.planner import main

    argv = [
        "4,256,4,1000,128",
        "--gpus",
        "4",
        "--global-batch-size",
        "8",
        "--gpu-memory-gb",
        "16",
        "--peak-tflops",
        "989",
        "--sequence-parallel",
    ]
    assert main(argv) == 0
    assert "Trainer(strategy=PTDPStrategy(" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["gpt_1t", "--gpus", "64", "--global-batch-size", "64"],
            (
                r"ptdp plan: the model \(1008\.0B parameters\) "
                r"does not fit"
            ),
        ),
        (["gpt_2t", "--gpus", "8", "--global-batch-size", "8"], r"ptdp plan: unknown model 'gpt_2t'"),
        (["4,256", "--gpus", "8", "--global-batch-size", "8"], r"ptdp plan: .*num_heads"),
    ],
)
def test_ptdp_plan_reports_errors_on_stderr_with_exit_code_2(argv, match, capsys):
    from lightning_ptdp.planner import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_ptdp_plan_layout_prints_that_layouts_estimate(capsys):
    from lightning_ptdp.planner import main

    assert main(["gpt_1t", "--gpus", "3072", "--global-batch-size", "3072", "--layout", "t=8,p=64,v=1,b=1"]) == 0
    out = capsys.readouterr().out
    x = estimate("gpt_1t", Cluster(num_gpus=3072), 3072, tensor_parallel_size=8, pipeline_parallel_size=64)
    assert out.startswith("t=8 p=64 d=6 e=1 v=1 b=1 m=512 recompute=full")
    assert f"estimated {x.tflops_per_gpu:.1f} TFLOP/s per GPU, step {x.step_time_s:.3f} s" in out
    assert "pipeline bubble" in out and "Trainer(strategy=PTDPStrategy(tensor_parallel_size=8" in out


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ("t=8,q=2", r"--layout item 'q=2' is not KEY=VALUE with KEY one of t, p, e, c, v, b, recompute"),
        ("t=8,p=x", r"--layout p='x' must be a whole number"),
        ("t=8", r"--layout needs p \(t and p; e, c, v, b and recompute are optional\)"),
        ("t=8,p=5", r"tensor_parallel_size \* pipeline_parallel_size = 40 does not divide the cluster's 3072 GPUs"),
    ],
)
def test_ptdp_plan_layout_errors(layout, match, capsys):
    from lightning_ptdp.planner import main

    with pytest.raises(SystemExit) as exit_info:
        main(["gpt_1t", "--gpus", "3072", "--global-batch-size", "3072", "--layout", layout])
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_gpt3_175b_is_a_name_everywhere(capsys):
    from lightning_ptdp.planner import main

    assert model_size("gpt3_175b") == GPT3_175B
    assert main(["gpt3_175b", "--gpus", "1024", "--global-batch-size", "1536", "--top", "1"]) == 0
    assert "Trainer(strategy=PTDPStrategy(" in capsys.readouterr().out


# ------------------------------------------------------------------ the model a user has (config.json)
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B config.json, the keys the planner reads
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def test_llama3_8b_config_gives_its_published_parameter_count():
    model = ModelSize.from_hf_config(LLAMA3_8B)
    assert (model.kv_heads, model.ffn_size, model.gated_mlp) == (8, 14336, True)
    assert not (model.biases or model.learned_positions or model.tied_embeddings or model.is_paper_gpt)
    assert model.seq_length == 4096  # max_position_embeddings 8192, capped
    # 8,030,261,248 published, less the final RMSNorm (4,096) that Eq. 2 leaves out too
    assert model.parameters == 8_030_261_248 - 4096


def test_gpt2_config_is_the_papers_gpt():
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    model = ModelSize.from_hf_config(gpt2)
    assert model.is_paper_gpt and model.seq_length == 1024
    assert model.parameters == gpt_parameter_count(12, 768, 50257, 1024)


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_general_flops_reduce_to_the_papers_formula_on_its_gpt(recompute):
    # the term-by-term count against Eq. 3 itself; an untied head changes no FLOPs
    from lightning_ptdp.planner.estimate import executed_flops

    gpt = TABLE_1["gpt_7.5b"].model
    untied = replace(gpt, tied_embeddings=False)
    assert not untied.is_paper_gpt
    assert executed_flops(untied, 512, recompute) == pytest.approx(executed_flops(gpt, 512, recompute), rel=1e-12)
    h, l = gpt.hidden_size, gpt.num_layers
    paper = gpt_flops_per_iteration(512, gpt.seq_length, l, h, gpt.vocab_size, activation_recompute=recompute == "full")
    paper += 4 * 512 * gpt.seq_length**2 * h * l if recompute == "selective" else 0  # the core again
    assert sum(executed_flops(gpt, 512, recompute)) == pytest.approx(paper, rel=1e-12)


def test_grouped_query_attention_and_swiglu_change_the_layer_cost():
    from lightning_ptdp.planner.estimate import executed_flops

    llama = ModelSize.from_hf_config(LLAMA3_8B)
    mha = replace(llama, num_kv_heads=None)
    assert llama.layer_matrix_parameters < mha.layer_matrix_parameters
    assert executed_flops(llama, 8, None)[0] < executed_flops(mha, 8, None)[0]
    b, s, h, f, l = 8, llama.seq_length, 4096, 14336, 32
    per_layer = 2 * b * s * (h * (h + 2 * 8 * 128) + h * h + 3 * h * f) + 4 * b * s * s * h
    assert executed_flops(llama, b, None)[0] == 3 * l * per_layer


def test_plan_takes_a_config_json_and_refuses_t_that_splits_a_kv_head(tmp_path, capsys):
    from lightning_ptdp.planner import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    assert main([str(path), "--gpus", "64", "--global-batch-size", "512", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "32 heads (8 kv), ffn 14336 gated" in out and "8.03B parameters" in out
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=16 does not divide num_kv_heads=8.*choose one of 1, 2, 4, 8"
    ):
        llama = ModelSize.from_hf_config(LLAMA3_8B)
        estimate(llama, Cluster(num_gpus=64), 512, tensor_parallel_size=16, pipeline_parallel_size=1)


def test_a_config_without_the_shape_keys_is_refused_with_what_is_missing():
    with pytest.raises(
        ValueError, match=r"config.json has no num_layers \(num_hidden_layers or n_layer or num_layers\)"
    ):
        ModelSize.from_hf_config({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100})


# Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1), the keys the planner reads
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}


def test_a_mixture_of_experts_counts_every_expert_and_runs_k_of_them():
    from lightning_ptdp.planner.estimate import executed_flops

    mixtral = ModelSize.from_hf_config(MIXTRAL_8X7B)
    # Mistral's published sizes: 46.7B parameters, 12.9B active per token (both less the final norm)
    assert mixtral.parameters == 46_702_788_608 and mixtral.active_parameters == 12_879_921_152
    h, f, l = 4096, 14336, 32
    attention = h * (h + 2 * 8 * 128) + h * h
    assert mixtral.layer_matrix_parameters == attention + 8 * 3 * h * f + h * 8  # experts and router stored
    b, s = 8, mixtral.seq_length  # FLOPs: each token through its 2 experts and the router
    assert executed_flops(mixtral, b, None)[0] == 3 * l * (
        2 * b * s * (attention + 2 * 3 * h * f + h * 8) + 4 * b * s * s * h
    )
    assert "x 8 experts, top-2" in mixtral.describe() and "12.88B active per token" in mixtral.describe()
    with pytest.raises(ValueError, match=r"num_experts=8 and experts_per_token=9: a mixture of experts needs both"):
        replace(mixtral, experts_per_token=9)
    with pytest.raises(ValueError, match=r"num_experts=8 and experts_per_token=None"):
        replace(mixtral, experts_per_token=None)


def test_plan_takes_a_mixture_of_experts_config(tmp_path, capsys):
    from lightning_ptdp.planner import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    assert main([str(path), "--gpus", "64", "--global-batch-size", "512", "--top", "3"]) == 0
    assert "46.70B parameters (12.88B active per token)" in capsys.readouterr().out


def test_the_named_mixtral_is_its_config():
    from lightning_ptdp.planner.models import MIXTRAL_8X7B as NAMED

    assert model_size("mixtral_8x7b") == NAMED == ModelSize.from_hf_config(MIXTRAL_8X7B)


def test_expert_parallelism_splits_the_experts_state_over_e_and_leaves_the_rest():
    from lightning_ptdp.planner.estimate import memory_bytes

    mixtral = model_size("mixtral_8x7b")
    args = dict(t=1, p=4, d=16, v=1, b=1, m=16, recompute="full", sp=False, zero_stage=0, schedule="1f1b")
    experts = mixtral.expert_parameters
    assert experts == 32 * 8 * 3 * 4096 * 14336  # every layer's 8 SwiGLU experts
    for e in (2, 4, 8, 16):  # 16 bytes per parameter (Adam, mixed precision), p=4 stages
        saved = memory_bytes(mixtral, **args) - memory_bytes(mixtral, **args, e=e)
        assert saved == pytest.approx(16 * experts / 4 * (1 - 1 / e), rel=1e-12)
    # ZeRO shards the experts' state over the d/e ranks sharing them, the dense state over d
    # (ZeRO-1: the 12 optimizer bytes of a parameter over the ranks holding it: d=16, or d/e=2)
    dense = mixtral.parameters - experts
    saved = memory_bytes(mixtral, **args, e=8) - memory_bytes(mixtral, **{**args, "zero_stage": 1}, e=8)
    assert saved == pytest.approx(12 * (1 - 1 / 16) * dense / 4 + 12 * (1 - 1 / 2) * experts / (8 * 4), rel=1e-12)


def test_the_all_to_all_term_is_the_traffic_formula():
    """Each token's hidden state goes to its k experts and comes back, forward and backward (4
    exchanges a layer, 6 under full recompute), (e-1)/e of it off-rank, over NVLink within a node."""
    from lightning_ptdp.planner.cost import RING_BASE_LATENCY, all_to_all_seconds

    cluster = Cluster.h100(64)
    h, k, s, layers = 4096, 2, 4096, 32
    sent = 2 * h * k * s  # bytes a rank's MoE layer sends per microbatch (b=1), its own share included
    for e, recompute, exchanges in ((8, "full", 6), (4, "selective", 4), (2, "selective", 4)):
        x = estimate(
            "mixtral_8x7b",
            cluster,
            64,
            tensor_parallel_size=1,
            pipeline_parallel_size=8,
            expert_parallel_size=e,
            activation_checkpointing=recompute,
            zero_stage=1,
        )
        one = RING_BASE_LATENCY + cluster.nvlink_hop_latency + (e - 1) / e * sent / cluster.intra_node_bandwidth
        assert all_to_all_seconds(sent, e, e, cluster) == pytest.approx(one, rel=1e-12)
        assert x.expert_parallel_comm_s == pytest.approx(x.num_microbatches * layers / 8 * exchanges * one, rel=1e-12)
    # across nodes the off-node share goes over the GPU's own HCA, at the same time as NVLink's
    two_nodes = all_to_all_seconds(sent, 16, 8, cluster)
    expected = sent / 16 * max(7 / cluster.intra_node_bandwidth, 8 / cluster.inter_node_bandwidth)
    assert two_nodes == pytest.approx(RING_BASE_LATENCY + cluster.network_hop_latency + expected)
    assert all_to_all_seconds(sent, 1, 1, cluster) == 0.0


def test_plan_searches_e_and_puts_the_experts_on_ep_rather_than_tp():
    """Mixtral-8x7B on 64 H100s: every layout's e divides d and the 8 experts; the best one uses
    expert parallelism, and at the same p, e=8 with t=1 beats e=4 with t=2 (Megatron-Core's MoE
    guide finds the same: "EP8TP1 is better than EP4TP2 for 8x7B")."""
    cluster = Cluster.h100(64)
    layouts = plan("mixtral_8x7b", cluster, 256)
    assert all(x.data_parallel_size % x.expert_parallel_size == 0 and 8 % x.expert_parallel_size == 0 for x in layouts)
    assert {x.expert_parallel_size for x in layouts} == {1, 2, 4, 8}
    assert layouts[0].expert_parallel_size > 1 and "EP " in layouts[0].reason
    kwargs = dict(pipeline_parallel_size=4, activation_checkpointing="selective", virtual_pipeline_size=4, zero_stage=1)
    ep8 = estimate("mixtral_8x7b", cluster, 256, tensor_parallel_size=1, expert_parallel_size=8, **kwargs)
    ep4 = estimate("mixtral_8x7b", cluster, 256, tensor_parallel_size=2, expert_parallel_size=4, **kwargs)
    assert ep8.step_time_s < ep4.step_time_s
    assert layout_arguments(ep8, cluster).strategy["expert_parallel_size"] == 8
    dense = plan("gpt_1.7b", Cluster(num_gpus=32), 512)
    assert {x.expert_parallel_size for x in dense} == {1}


@pytest.mark.parametrize(
    "model, e, match",
    [
        ("mixtral_8x7b", 3, r"expert_parallel_size=3 must divide num_experts=8 and the data-parallel size d=16"),
        ("mixtral_8x7b", 16, r"expert_parallel_size=16 must divide num_experts=8 .* choose one of 1, 2, 4, 8"),
        ("gpt_1.7b", 2, r"expert_parallel_size=2 needs a mixture of experts, but the model is dense"),
    ],
)
def test_estimate_refuses_an_expert_parallel_size_that_cannot_split(model, e, match):
    with pytest.raises(ValueError, match=match):
        estimate(model, Cluster.h100(64), 256, tensor_parallel_size=1, pipeline_parallel_size=4, expert_parallel_size=e)


def test_ptdp_plan_layout_takes_e(capsys):
    from lightning_ptdp.planner import main

    argv = [
        "mixtral_8x7b",
        "--gpus",
        "64",
        "--global-batch-size",
        "256",
        "--layout",
        "t=1,p=4,e=8,v=4,recompute=selective",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("t=1 p=4 d=16 e=8 v=4") and "EP all-to-alls" in out and "expert_parallel_size=8" in out


def test_hsdp_trades_cross_node_traffic_for_memory_and_the_planner_picks_it_where_the_network_is_slow():
    """HSDP in groups of a node's 8: the state is 1/8 instead of 1/64 (more memory), the all-gathers stay
    on NVLink and only 1/8 of the gradients cross nodes. On a DGX H100's eight 400 Gb/s HCAs per node a
    ring over all 64 is about as fast as NVLink, so FSDP over all is cheaper; at 25 Gb/s per GPU HSDP
    wins, and the planner, searching the shard size, picks it and writes its argument."""
    from lightning_ptdp.planner.cost import GB, Cluster
    from lightning_ptdp.planner.estimate import estimate
    from lightning_ptdp.planner.render import layout_arguments
    from lightning_ptdp.planner.search import plan

    layout = dict(tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=3, micro_batch_size=1)
    for cluster, hsdp_faster in ((Cluster.h100(64), False), (Cluster.h100(64, inter_node_bandwidth=3.125 * GB), True)):
        fsdp = estimate("gpt_7.5b", cluster, 512, **layout)
        hsdp = estimate("gpt_7.5b", cluster, 512, **layout, data_parallel_shard_size=8)
        assert (fsdp.data_parallel_shard_size, hsdp.data_parallel_shard_size) == (None, 8)
        assert hsdp.memory_bytes_per_gpu > fsdp.memory_bytes_per_gpu
        assert (hsdp.data_parallel_comm_s < fsdp.data_parallel_comm_s) == hsdp_faster
    best = plan("gpt_7.5b", cluster, 512, zero_stage=3)[0]
    assert best.data_parallel_shard_size == 8
    assert layout_arguments(best, cluster).strategy["data_parallel_shard_size"] == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"zero_stage": 3, "data_parallel_shard_size": 3},
            r"data_parallel_shard_size=3 must divide the 64 .*1, 2, 4, 8",
        ),
        ({"zero_stage": 1, "data_parallel_shard_size": 8}, r"data_parallel_shard_size=8 is HSDP.*zero_stage 2 or 3"),
    ],
)
def test_bad_hsdp_estimates_are_refused(kwargs, match):
    from lightning_ptdp.planner.cost import Cluster
    from lightning_ptdp.planner.estimate import estimate

    with pytest.raises(ValueError, match=match):
        estimate("gpt_7.5b", Cluster.h100(64), 512, tensor_parallel_size=1, pipeline_parallel_size=1, **kwargs)
