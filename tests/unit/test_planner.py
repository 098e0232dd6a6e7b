"""Tests for lightning_ptdp.planner: the layout rules, the cost model's arithmetic, the ranking
against the paper's Table 1 choices, memory rejections, rendering and error messages.

Expected memory figures are written out by hand from the formulas (Korthikanti et al. 2022 for
activations, 16 bytes per parameter for mixed-precision Adam), not by calling the planner twice.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import pytest

from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.parallel.dims import ParallelDims
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
from lightning_ptdp.tools.flops import training_time_seconds

GB = 1e9
# Float sums of the same terms in a different order: relative difference of a few ulps.
REL = 1e-9

# The planner's top choice at the paper's GPU count and batch with the paper's toolset (no selective
# recompute, no sequence parallelism) is printed by benchmarks/bench_planner.py; at the paper's own
# layouts the estimate is held to Table 1 below (test_estimate_at_the_papers_layouts_matches_table_1).
PAPER_TOOLSET = {"recompute_modes": (None, "full")}
LATER_TOOLSET = {"sequence_parallel": True}


def paper_cluster(name: str) -> Cluster:
    return Cluster(num_gpus=TABLE_1[name].num_gpus)


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
    best = top_choice(name, recompute_modes=("full",), max_micro_batch_size=1)
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
    layouts = plan("gpt_39.1b", cluster, 1536)
    across = [i for i, x in enumerate(layouts) if x.tensor_parallel_size == 16]
    assert across, "expected t=16 layouts to fit and be ranked"
    within = [i for i, x in enumerate(layouts) if x.tensor_parallel_size in (2, 4, 8)]
    assert min(within) == 0 and min(across) > 0
    assert "TP within a node (t=" in layouts[0].reason
    assert layouts[across[0]].reason.startswith("TP across nodes (t=16, 8 GPUs/node)")
    # the same t=16 layout on 16-GPU nodes keeps TP on NVLink: 240 GB/s instead of the 8 HCAs'
    # 8 x 25 = 200 GB/s, and 3.4 us per ring step instead of 14 us for the network steps
    slow = layouts[across[0]]
    on_big_nodes = plan("gpt_39.1b", replace(cluster, gpus_per_node=16), 1536)
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


# The paper's Table 1 (Narayanan et al. 2021; also the Megatron-LM README of 2021), typed here
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
    the other eight are predictions. Every row within 10%, as the README says (largest today 8.7%)."""
    errors = {}
    for name, (t, p, gpus, batch, paper) in PAPER_TABLE_1.items():
        x = estimate(
            name,
            Cluster(num_gpus=gpus),
            batch,
            tensor_parallel_size=t,
            pipeline_parallel_size=p,
            virtual_pipeline_size=1,
            micro_batch_size=1,
            activation_checkpointing="full",
        )
        errors[name] = x.tflops_per_gpu / paper - 1
    assert FIT_ROWS == ("gpt_1.7b", "gpt_1t")
    assert all(abs(e) <= 0.10 for e in errors.values()), errors


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
    best = plan("gpt3_175b", Cluster(num_gpus=1024), 1536, **PAPER_TOOLSET)[0]
    assert best.tflops_per_gpu == pytest.approx(140, rel=0.15)  # no recompute: fewer FLOPs than the paper counts
    assert best.tensor_parallel_size == 8 and best.pipeline_parallel_size > 1
    # like with like (the paper's 140 counts recomputation): optimistic, within 25% (README: +21.6%)
    full = plan("gpt3_175b", Cluster(num_gpus=1024), 1536, recompute_modes=("full",))[0]
    assert full.activation_checkpointing == "full" and 1.0 < full.tflops_per_gpu / 140 < 1.25


# --------------------------------------------------------------------------- estimate


def test_estimate_is_the_planners_figure_for_that_layout():
    cluster = paper_cluster("gpt_1t")
    x = estimate("gpt_1t", cluster, 3072, tensor_parallel_size=8, pipeline_parallel_size=64, virtual_pipeline_size=2)
    assert x == replace(
        find(
            plan("gpt_1t", cluster, 3072),
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
            r"tensor_parallel_size=64 must divide num_heads=32 and hidden_size=3072 \(each rank takes whole heads\)",
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


def test_memory_of_a_replicated_layout_by_hand():
    model = TABLE_1["gpt_1.7b"].model
    layouts = plan("gpt_1.7b", paper_cluster("gpt_1.7b"), 512)
    x = find(
        layouts, tensor_parallel_size=1, pipeline_parallel_size=1, micro_batch_size=1, activation_checkpointing=None
    )
    s, h, a, l, V = model.seq_length, model.hidden_size, model.num_heads, model.num_layers, model.vocab_size
    state = 16 * model.parameters
    activations = l * s * h * (34 + 5 * a * s / h)  # b = 1, every layer keeps everything
    logits = 4 * s * V
    assert x.memory_bytes_per_gpu == pytest.approx(state + activations + logits, rel=REL)


def test_memory_of_an_interleaved_pipeline_with_full_recompute_by_hand():
    model = TABLE_1["gpt_1t"].model
    layouts = plan("gpt_1t", paper_cluster("gpt_1t"), 3072)
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


def test_layouts_over_the_memory_limit_are_dropped():
    layouts = plan("gpt_1t", paper_cluster("gpt_1t"), 3072)
    # 16 bytes x 1008B parameters over t*p = 128 ranks is already 126 GB
    assert min(x.tensor_parallel_size * x.pipeline_parallel_size for x in layouts) >= 256
    tight = plan("gpt_1t", paper_cluster("gpt_1t"), 3072, memory_fraction=0.6)
    assert 0 < len(tight) < len(layouts)
    assert all(x.memory_bytes_per_gpu <= 0.6 * 80 * GB for x in tight)
    assert any(x.memory_bytes_per_gpu > 0.6 * 80 * GB for x in layouts)


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
    assert lines[0].split()[:6] == ["rank", "t", "p", "d", "v", "b"]
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
        plan("gpt_1t", Cluster(num_gpus=64), 64)


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
    assert out.splitlines()[1].split()[:3] == [
        "1",
        str(expected.tensor_parallel_size),
        str(expected.pipeline_parallel_size),
    ]
    assert f"best: {expected.reason}" in out and "--trainer.strategy.tensor_parallel_size=8" in out


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
    assert out.startswith("t=8 p=64 d=6 v=1 b=1 m=512 recompute=full")
    assert f"estimated {x.tflops_per_gpu:.1f} TFLOP/s per GPU, step {x.step_time_s:.3f} s" in out
    assert "pipeline bubble" in out and "Trainer(strategy=PTDPStrategy(tensor_parallel_size=8" in out


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ("t=8,q=2", r"--layout item 'q=2' is not KEY=VALUE with KEY one of t, p, v, b, recompute"),
        ("t=8,p=x", r"--layout p='x' must be a whole number"),
        ("t=8", r"--layout needs p \(t and p; v, b and recompute are optional\)"),
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


# ------------------------------------------------------------------ CPU calibration (no processes)
def _synthetic_machine(rate: float, overhead: float, memory_rate: float, bw: float, hop: float, share: float) -> dict:
    """What ``measure_machine`` would report on a CPU that follows the model exactly."""
    from lightning_ptdp.planner.cost import RING_BASE_LATENCY
    from lightning_ptdp.planner.estimate import executed_flops, layer_memory_bytes
    from lightning_ptdp.planner.measure import WORLD, small_size

    size = small_size()
    one = replace(size, num_layers=1)
    params, tp_bytes = 6_000_000, size.seq_length * size.hidden_size * 4
    figures = {
        "cores": 2,
        "share_b1": share,
        "share_b2": share,
        "adam_parameters": params,
        "adam_cpu_s": 32 * params / memory_rate,
        "tp_bytes": tp_bytes,
        "dp_bytes": params * 4,
        "tp_all_reduce_cpu_s": RING_BASE_LATENCY + 2 * hop + tp_bytes / bw,
        "dp_all_reduce_cpu_s": RING_BASE_LATENCY + 2 * (WORLD - 1) * hop + 2 * (WORLD - 1) / WORLD * params * 4 / bw,
        "wall_busbw": 2e7,
        "wall_4kb_s": 9e-3,
    }
    for b in (1, 2):
        work = executed_flops(one, b, None)[0] / rate + 3 * layer_memory_bytes(size, 1, b, False) / memory_rate
        figures[f"block_b{b}_cpu_s"] = overhead + work
    return figures


def test_calibration_fit_recovers_the_rates_and_scales_them_by_the_cpu_share():
    from lightning_ptdp.planner.calibrate import fit_cluster

    machine = _synthetic_machine(rate=30e9, overhead=8e-3, memory_rate=5e9, bw=1e9, hop=50e-6, share=0.5)
    cluster, figures = fit_cluster([machine] * 4)
    assert figures["flops_per_cpu_second"] == pytest.approx(30e9, rel=1e-6)
    assert figures["layer_overhead_cpu_s"] == pytest.approx(8e-3, rel=1e-6)
    assert figures["memory_bytes_per_cpu_second"] == pytest.approx(5e9, rel=1e-6)
    assert figures["all_reduce_fp32_bytes_per_cpu_second"] == pytest.approx(1e9, rel=1e-6)
    assert figures["all_reduce_hop_cpu_s"] == pytest.approx(50e-6, rel=1e-4)
    # half a core each: every rate halves, every fixed cost doubles; fp32 bytes in 2-byte units
    assert cluster.peak_flops == pytest.approx(15e9, rel=1e-6)
    assert cluster.layer_overhead_s == pytest.approx(16e-3, rel=1e-6)
    assert cluster.hbm_bandwidth == pytest.approx(2.5e9, rel=1e-6)
    assert cluster.intra_node_bandwidth == pytest.approx(0.25e9, rel=1e-6)
    assert cluster.nvlink_hop_latency == pytest.approx(100e-6, rel=1e-4)
    assert not cluster.tree_all_reduce


def test_layer_overhead_adds_per_layer_and_microbatch_and_defaults_to_zero():
    base = Cluster(num_gpus=8)
    assert base.layer_overhead_s == 0.0 and base.tree_all_reduce
    slow = replace(base, layer_overhead_s=1e-3)
    kwargs = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "activation_checkpointing": None}
    size = ModelSize(num_layers=4, hidden_size=512, num_heads=8, seq_length=256, vocab_size=1024)
    a, b = estimate(size, base, 16, **kwargs), estimate(size, slow, 16, **kwargs)
    assert b.compute_s - a.compute_s == pytest.approx(4 * 2 * 1e-3)  # 4 layers, m = 16 / 8 = 2
    with pytest.raises(ValueError, match="layer_overhead_s"):
        Cluster(num_gpus=8, layer_overhead_s=-1.0)


def test_host_overheads_enter_per_tp_layer_tp_microbatch_and_loop_iteration():
    base = Cluster(num_gpus=8)
    assert base.tp_layer_overhead_s == 0.0 and base.loop_overhead_s == 0.0
    size = ModelSize(num_layers=4, hidden_size=512, num_heads=8, seq_length=256, vocab_size=1024)
    slow = replace(base, tp_layer_overhead_s=1e-3, loop_overhead_s=2e-3, tp_microbatch_overhead_s=5e-3)

    def both(**layout):
        kwargs = {"activation_checkpointing": None, **layout}
        return estimate(size, base, 64, **kwargs), estimate(size, slow, 64, **kwargs)

    a, b = both(tensor_parallel_size=2, pipeline_parallel_size=1)  # d = 4, m = 16: the loop runs 16 times
    assert b.tensor_parallel_comm_s - a.tensor_parallel_comm_s == pytest.approx(16 * (4 * 1e-3 + 5e-3))
    assert b.compute_s - a.compute_s == pytest.approx(16 * 2e-3)
    a, b = both(tensor_parallel_size=1, pipeline_parallel_size=2)  # under a pipeline: once per step, no TP
    assert b.compute_s - a.compute_s == pytest.approx(2e-3)
    chunked = replace(slow, pipeline_chunk_overhead_s=3e-3)
    kwargs = {"activation_checkpointing": None, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    c = estimate(size, chunked, 64, virtual_pipeline_size=2, **kwargs)  # d = 4, m = 16, 2 chunks per rank
    d = estimate(size, slow, 64, virtual_pipeline_size=2, **kwargs)
    assert c.pipeline_comm_s - d.pipeline_comm_s == pytest.approx(16 * 2 * 3e-3)
    assert b.tensor_parallel_comm_s == a.tensor_parallel_comm_s == 0.0
    for name in ("tp_layer_overhead_s", "tp_microbatch_overhead_s", "pipeline_chunk_overhead_s", "loop_overhead_s"):
        with pytest.raises(ValueError, match=name):
            Cluster(num_gpus=8, **{name: -1.0})


def test_host_overhead_fit_recovers_the_costs_the_timed_steps_were_made_of():
    """Timed-step CPU seconds built from known overheads on top of a fitted cluster: the residual
    split finds each of them again (exact arithmetic, so a tight tolerance)."""
    from lightning_ptdp.planner.calibrate import (
        HOST_DEPTHS,
        HOST_PROBES,
        PIPELINE_PROBE,
        fit_cluster,
        fit_host_overheads,
    )
    from lightning_ptdp.planner.measure import GLOBAL_BATCH, small_estimate

    def timed_cpu(truth) -> dict:  # CPU seconds per step: no rank works in a pipeline's bubble
        keys = [(*layout, n) for layout in HOST_PROBES for n in HOST_DEPTHS] + [PIPELINE_PROBE]
        steps = {(t, p, d, v, n): small_estimate(truth, t, p, v, n) for t, p, d, v, n in keys}
        return {key: x.step_time_s - x.bubble_s for key, x in steps.items()}

    machine = _synthetic_machine(rate=30e9, overhead=8e-3, memory_rate=5e9, bw=1e9, hop=50e-6, share=0.5)
    cluster, _ = fit_cluster([machine] * 4)
    truth = replace(cluster, peak_flops=30e9, hbm_bandwidth=5e9, intra_node_bandwidth=0.5e9, nvlink_hop_latency=50e-6)
    truth = replace(truth, layer_overhead_s=11e-3, loop_overhead_s=20e-3, tp_layer_overhead_s=3e-3)
    truth = replace(truth, tp_microbatch_overhead_s=5e-3, pipeline_chunk_overhead_s=4e-3)
    fitted, figures = fit_host_overheads(cluster, 0.5, timed_cpu(truth))
    assert figures["layer_overhead_cpu_s_timed"] == pytest.approx(11e-3, rel=1e-6)
    assert figures["loop_overhead_cpu_s"] == pytest.approx(20e-3, rel=1e-6)
    assert figures["tp_layer_overhead_cpu_s"] == pytest.approx(3e-3, rel=1e-6)
    assert figures["tp_microbatch_overhead_cpu_s"] == pytest.approx(5e-3, rel=1e-6)
    assert figures["pipeline_chunk_overhead_cpu_s"] == pytest.approx(4e-3, rel=1e-6)
    assert figures["host_fit_left_at_t2_shallow_cpu_s"] == pytest.approx(0.0, abs=1e-9)
    assert fitted.loop_overhead_s == pytest.approx(40e-3, rel=1e-6)  # at half a core: twice the wall time
    assert GLOBAL_BATCH % HOST_PROBES[1][2] == 0

    # A timed layer cheaper than the block benchmark's FLOPs at its rate (no overhead left to take
    # from): the rate rises to match instead of the difference being clipped away.
    faster = replace(truth, peak_flops=40e9, layer_overhead_s=0.0)
    fitted, figures = fit_host_overheads(cluster, 0.5, timed_cpu(faster))
    assert figures["flops_per_cpu_second_timed"] == pytest.approx(40e9, rel=1e-6)
    assert figures["layer_overhead_cpu_s_timed"] == 0.0
    assert figures["loop_overhead_cpu_s"] == pytest.approx(20e-3, rel=1e-6)
    assert figures["tp_layer_overhead_cpu_s"] == pytest.approx(3e-3, rel=1e-6)
    assert figures["pipeline_chunk_overhead_cpu_s"] == pytest.approx(4e-3, rel=1e-6)


def test_ranking_ignores_layouts_measured_within_the_tie_and_no_others():
    from lightning_ptdp.planner.calibrate import same_ranking

    rows = [{"measured_s": 1.0, "predicted_s": 1.3}, {"measured_s": 1.03, "predicted_s": 1.2}]
    assert same_ranking(rows)  # 3% apart: their order is the machine's noise
    rows.append({"measured_s": 2.0, "predicted_s": 1.25})
    assert not same_ranking(rows)  # twice as slow measured, predicted faster than the first
    # 10% apart, but one layout's own rounds spread 15%: the measurement does not order them
    noisy = [{"measured_s": 1.0, "predicted_s": 1.2, "round_spread": 0.15}, {"measured_s": 1.1, "predicted_s": 1.1}]
    assert same_ranking(noisy)
    noisy[0]["round_spread"] = 0.02
    assert not same_ranking(noisy)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_step_clock_stamps_once_per_optimizer_step_under_gradient_accumulation(accumulate):
    # At p = 1 a Lightning batch is one microbatch; a stamp per batch, or one extra before the first
    # step ends, would time the wrong window (it once counted 5 steps' CPU as 4).
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ptdp.planner.measure import step_clock
    from lightning_ptdp.testing import quiet_trainer

    clock = step_clock()
    trainer = quiet_trainer(max_steps=4, accumulate_grad_batches=accumulate, callbacks=[clock], limit_val_batches=0)
    L.seed_everything(0, verbose=False)
    trainer.fit(BoringModel())
    assert len(clock.stamps) == len(clock.cpu) == 4
    assert clock.stamps == sorted(clock.stamps)
