"""Tests for lightning_ptdp.planner: the layout rules, the cost model's arithmetic, the ranking
against the paper's Table 1 choices, memory rejections, rendering and error messages.

Expected memory figures are written out by hand from the formulas (Korthikanti et al. 2022 for
activations, 16 bytes per parameter for mixed-precision Adam), not by calling the planner twice.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.parallel.dims import ParallelDims
from lightning_ptdp.planner import (
    TABLE_1,
    Cluster,
    ModelSize,
    format_plan,
    layout_arguments,
    model_size,
    plan,
)

GB = 1e9
# Float sums of the same terms in a different order: relative difference of a few ulps.
REL = 1e-9

# Side by side, at the paper's GPU count and batch on 80 GB A100s, 8 per node, with the paper's
# toolset (no selective recompute, no sequence parallelism); the planner's top choice:
#
#   model       GPUs  batch  paper (t, p)  planner (t, p, d, v, b, recompute)
#   gpt_1.7b      32    512   (1, 1)        (2, 1, 16, 1, 4, None)
#   gpt_3.6b      64    512   (2, 1)        (2, 1, 32, 1, 2, None)
#   gpt_7.5b     128    512   (4, 1)        (4, 2, 16, 3, 1, None)
#   gpt_18.4b    256   1024   (8, 1)        (4, 2, 32, 4, 1, None)
#   gpt_39.1b    512   1536   (8, 2)        (4, 4, 32, 6, 1, None)
#   gpt_76.1b   1024   1792   (8, 4)        (8, 4, 32, 5, 1, None)
#   gpt_145.6b  1536   2304   (8, 8)        (8, 16, 12, 1, 1, None)
#   gpt_310.1b  1920   2160   (8, 16)       (8, 12, 20, 8, 1, "full")
#   gpt_529.6b  2520   2520   (8, 35)       (8, 21, 15, 5, 1, "full")
#   gpt_1t      3072   3072   (8, 64)       (8, 64, 6, 2, 1, "full")
#
# With the later toolset (selective recompute + sequence parallelism) the 145.6B picks p=8 and
# the 529.6B p=35, the paper's own values. The planner knows no GEMM efficiency loss at small
# per-GPU matrices, so it sometimes prefers a smaller t and a little pipelining for the small
# models, where the paper used t alone.
PAPER_TOOLSET = dict(recompute_modes=(None, "full"))
LATER_TOOLSET = dict(sequence_parallel=True)


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


@pytest.mark.parametrize("toolset", [PAPER_TOOLSET, LATER_TOOLSET], ids=["paper", "sp+selective"])
@pytest.mark.parametrize("name", list(TABLE_1))
def test_top_choice_keeps_tp_in_a_node_and_p_near_the_papers(name, toolset):
    best = top_choice(name, **toolset)
    paper_p = TABLE_1[name].pipeline_parallel_size
    assert best.tensor_parallel_size <= 8, best.reason
    assert paper_p / 2 <= best.pipeline_parallel_size <= paper_p * 2, (
        f"{name}: planner p={best.pipeline_parallel_size}, paper p={paper_p}; {best.reason}")


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
    # the same t=16 layout on 16-GPU nodes keeps TP on NVLink: its TP time drops by the
    # bandwidth ratio (300 GB/s vs 25 GB/s)
    slow = layouts[across[0]]
    on_big_nodes = plan("gpt_39.1b", replace(cluster, gpus_per_node=16), 1536)
    fast = find(on_big_nodes, tensor_parallel_size=16, pipeline_parallel_size=slow.pipeline_parallel_size,
                virtual_pipeline_size=slow.virtual_pipeline_size, micro_batch_size=slow.micro_batch_size,
                activation_checkpointing=slow.activation_checkpointing)
    assert slow.tensor_parallel_comm_s == pytest.approx(fast.tensor_parallel_comm_s * 12, rel=REL)


def test_a_tp_group_straddling_two_nodes_counts_as_across():
    layouts = plan("gpt_145.6b", paper_cluster("gpt_145.6b"), 2304)
    six = find(layouts, tensor_parallel_size=6)  # 96 heads and 12288 are multiples of 6
    assert six.reason.startswith("TP across nodes (t=6, 8 GPUs/node)")


def test_every_layout_obeys_the_rules_and_the_step_time_adds_up():
    model, batch = TABLE_1["gpt_39.1b"].model, 1536
    cluster = paper_cluster("gpt_39.1b")
    layouts = plan(model, cluster, batch)
    assert all(a.step_time_s <= b.step_time_s + 1e-6 for a, b in zip(layouts, layouts[1:]))  # ties at 1 us
    for x in layouts:
        t, p, d, v, b = (x.tensor_parallel_size, x.pipeline_parallel_size, x.data_parallel_size,
                         x.virtual_pipeline_size, x.micro_batch_size)
        assert t * p * d == cluster.num_gpus
        assert model.num_heads % t == 0 and model.hidden_size % t == 0
        assert model.num_layers % (p * v) == 0
        assert batch % (b * d) == 0 and x.num_microbatches == batch // (b * d)
        assert v == 1 or x.num_microbatches % p == 0
        assert x.bubble_fraction == pytest.approx((p - 1) / (v * x.num_microbatches), rel=REL)
        parts = (x.compute_s * (1 + x.bubble_fraction) + x.tensor_parallel_comm_s
                 + x.pipeline_comm_s + x.data_parallel_comm_s)
        assert x.step_time_s == pytest.approx(parts, rel=REL)
        assert x.memory_bytes_per_gpu <= 0.9 * cluster.gpu_memory_bytes
        assert (x.tensor_parallel_comm_s == 0) == (t == 1)
        assert (x.data_parallel_comm_s == 0) == (d == 1)


def test_compute_time_and_data_parallel_traffic_by_hand():
    # gpt_1.7b, t=1, p=1, d=32, no recompute: Eq. 3's 72-form FLOPs over 32 GPUs at half of
    # 312 TFLOP/s, plus a ring all-reduce of the bf16 gradients across nodes (25 GB/s).
    model = TABLE_1["gpt_1.7b"].model
    layouts = plan("gpt_1.7b", paper_cluster("gpt_1.7b"), 512)
    x = find(layouts, tensor_parallel_size=1, pipeline_parallel_size=1, activation_checkpointing=None)
    l, h, s, V, B = model.num_layers, model.hidden_size, model.seq_length, model.vocab_size, 512
    flops = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert x.compute_s == pytest.approx(flops / (32 * 312e12 * 0.5), rel=1e-9)
    assert x.data_parallel_comm_s == pytest.approx(2 * 31 / 32 * 2 * model.parameters / 25e9, rel=REL)
    assert x.tflops_per_gpu == pytest.approx(flops / x.step_time_s / 32 / 1e12, rel=REL)


# --------------------------------------------------------------------------- memory


def test_memory_of_a_replicated_layout_by_hand():
    model = TABLE_1["gpt_1.7b"].model
    layouts = plan("gpt_1.7b", paper_cluster("gpt_1.7b"), 512)
    x = find(layouts, tensor_parallel_size=1, pipeline_parallel_size=1, micro_batch_size=1,
             activation_checkpointing=None)
    s, h, a, l, V = model.seq_length, model.hidden_size, model.num_heads, model.num_layers, model.vocab_size
    state = 16 * model.parameters
    activations = l * s * h * (34 + 5 * a * s / h)  # b = 1, every layer keeps everything
    logits = 4 * s * V
    assert x.memory_bytes_per_gpu == pytest.approx(state + activations + logits, rel=REL)


def test_memory_of_an_interleaved_pipeline_with_full_recompute_by_hand():
    model = TABLE_1["gpt_1t"].model
    layouts = plan("gpt_1t", paper_cluster("gpt_1t"), 3072)
    x = find(layouts, tensor_parallel_size=8, pipeline_parallel_size=64, virtual_pipeline_size=2,
             micro_batch_size=1, activation_checkpointing="full")
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
    x = find(plan("gpt_1t", cluster, 3072), tensor_parallel_size=8, pipeline_parallel_size=64,
             virtual_pipeline_size=2, micro_batch_size=1, activation_checkpointing="full")
    args = layout_arguments(x, cluster)
    assert args.python() == (
        "Trainer(strategy=PTDPStrategy(tensor_parallel_size=8, pipeline_parallel_size=64, "
        "data_parallel_size=6, virtual_pipeline_size=2, micro_batch_size=1, "
        "activation_checkpointing='full'), devices=8, num_nodes=384)  # dataloader batch size per rank: 512")
    assert args.cli_flags() == [
        "--trainer.strategy.tensor_parallel_size=8", "--trainer.strategy.pipeline_parallel_size=64",
        "--trainer.strategy.data_parallel_size=6", "--trainer.strategy.virtual_pipeline_size=2",
        "--trainer.strategy.micro_batch_size=1", "--trainer.strategy.activation_checkpointing=full",
        "--trainer.devices=8", "--trainer.num_nodes=384", "--data.batch_size=512"]
    assert args.hydra_overrides()[:3] == [
        "parallel.tensor_parallel_size=8", "parallel.pipeline_parallel_size=64", "parallel.data_parallel_size=6"]
    assert args.hydra_overrides()[-3:] == ["trainer.devices=8", "trainer.num_nodes=384", "data.batch_size=512"]
    config = ParallelConfig(**args.strategy)  # every rendered value passes the strategy's validation
    dims = ParallelDims.from_config(config, world_size=cluster.num_gpus)
    assert (dims.pp, dims.dp, dims.tp) == (64, 6, 8)


def test_arguments_without_pipelining_use_gradient_accumulation():
    cluster = Cluster(num_gpus=64)
    x = find(plan("gpt_3.6b", cluster, 512, sequence_parallel=True), pipeline_parallel_size=1,
             tensor_parallel_size=2, micro_batch_size=2)
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
    with pytest.raises(ValueError, match=r"\(1008\.0B parameters\) does not fit in GPU memory with any layout "
                                         r"of 64 GPUs: the smallest need is [\d.]+ GB per GPU \(t=.*over the "
                                         r"72\.0 GB usable \(90% of 80\.0 GB\); use more GPUs, zero_stage=1\.\.3"):
        plan("gpt_1t", Cluster(num_gpus=64), 64)


def test_no_factorisation_names_the_rules():
    model = ModelSize(num_layers=3, hidden_size=48, num_heads=3)
    with pytest.raises(ValueError, match=r"no layout of 16 GPUs fits the model and batch.*t \| num_heads \(3\).*"
                                         r"p \| num_layers \(3\) and d \| global_batch_size \(3\)"):
        plan(model, Cluster(num_gpus=16), 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: model_size("gpt_2t"), r"unknown model 'gpt_2t': pass a ModelSize\(\.\.\.\) or one of the Table 1 "
                                      r"names gpt_1\.7b, gpt_3\.6b"),
        (lambda: ModelSize(num_layers=2, hidden_size=100, num_heads=3),
         r"hidden_size=100 is not divisible by num_heads=3"),
        (lambda: ModelSize(num_layers=0, hidden_size=64, num_heads=4), r"ModelSize.num_layers must be a positive integer"),
        (lambda: Cluster(num_gpus=12), r"num_gpus=12 is not a whole number of nodes of 8 GPUs"),
        (lambda: replace(Cluster(num_gpus=8), gpu_memory_bytes=-1),
         r"Cluster.gpu_memory_bytes must be a positive number, got -1"),
        (lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 512, memory_fraction=1.5),
         r"memory_fraction must be in \(0, 1\], got 1.5"),
        (lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 512, achievable_fraction=0),
         r"achievable_fraction must be in \(0, 1\], got 0"),
        (lambda: plan("gpt_1.7b", Cluster(num_gpus=32), 512, recompute_modes=("some",)),
         r"recompute_modes must be a non-empty selection of \(None, 'selective', 'full'\), got \('some',\)"),
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
    assert out.splitlines()[1].split()[:3] == ["1", str(expected.tensor_parallel_size),
                                               str(expected.pipeline_parallel_size)]
    assert f"best: {expected.reason}" in out and "--trainer.strategy.tensor_parallel_size=8" in out


def test_ptdp_plan_takes_sizes_and_cluster_flags(capsys):
    from lightning_ptdp.planner import main

    argv = ["4,256,4,1000,128", "--gpus", "4", "--global-batch-size", "8", "--gpu-memory-gb", "16",
            "--peak-tflops", "989", "--sequence-parallel"]
    assert main(argv) == 0
    assert "Trainer(strategy=PTDPStrategy(" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["gpt_1t", "--gpus", "64", "--global-batch-size", "64"], r"ptdp plan: the model \(1008\.0B parameters\) "
                                                                  r"does not fit"),
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
