"""The planner's context-parallel axis: each term by hand, the refusals, and the long-context case
(Llama-3-8B at 128k tokens on H100s: cp is the faster layout; without flash attention, the only one that fits)."""

from __future__ import annotations

import pytest

from lightning_ptdp.core.flops import activation_bytes_per_layer
from lightning_ptdp.planner.cost import GB, Cluster, all_gather_seconds
from lightning_ptdp.planner.estimate import BF16, _layer_seconds, cost, estimate, memory_bytes
from lightning_ptdp.planner.models import LLAMA3_8B_128K, ModelSize
from lightning_ptdp.planner.search import plan

LONG = ModelSize(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, seq_length=32_768, vocab_size=32_000)


def test_the_key_value_exchange_is_four_gathers_of_the_whole_sequence_per_layer():
    cluster = Cluster.h100(16)
    for t, c, recompute in ((1, 4, None), (2, 4, "selective"), (2, 8, "full")):
        *_, cp = _layer_seconds(LONG, t, 1, recompute, False, cluster, 1, c)
        kv = BF16 * 32_768 * (4 // t) * 64  # this rank's KV heads (GQA: 4 of 16) over all s tokens
        members = min(c, 8 // t)  # cp ranks are t apart: 8 / t of them on a node
        passes = 6 if recompute == "full" else 4  # K and V, forward and backward (full: forward again)
        assert cp == pytest.approx(passes * all_gather_seconds(kv, c, members, cluster))
    assert _layer_seconds(LONG, 1, 1, None, False, cluster, 1, 1)[3] == 0.0


def test_a_rank_computes_its_share_of_the_layer_and_keeps_its_share_of_the_activations():
    cluster = Cluster.h100(8)
    whole, half = (_layer_seconds(LONG, 1, 1, "selective", False, cluster, 1, c)[0] for c in (1, 2))
    assert 0.45 < half / whole < 0.55  # linear and attention work / c (each rank: s/c queries over s keys)
    args = (LONG, 1, 1, 1, 1, 1, 1, "selective", False, 0, "1f1b")
    shape = dict(hidden_size=1024, num_heads=16, split_sbh=LONG.split_activation_sbh)

    def layer(s: int) -> float:
        return activation_bytes_per_layer(
            s, 1, shape["hidden_size"], shape["num_heads"], 1, False, "selective", split_sbh=shape["split_sbh"]
        )

    gathered = 2 * BF16 * 32_768 / 2 * 4 * 64  # the other half of K and V (4 KV heads of 64), each layer
    # the same state; each of the 8 layers keeps half the tokens' activations and the gathered K/V;
    # without TP the head and loss take half the tokens: half the fp32 logits
    logits = 32_768 * 32_000 * 4
    expected = memory_bytes(*args, 1, 1) + 8 * (layer(16_384) - layer(32_768) + gathered) - logits / 2
    assert memory_bytes(*args, 1, 2) == pytest.approx(expected)


def test_cost_splits_d_by_c_and_reports_the_exchange():
    cluster = Cluster.h100(16)
    at_c1 = cost(LONG, cluster, 16, 2, 1, 1, 1, recompute="selective")
    at_c2 = cost(LONG, cluster, 16, 2, 1, 1, 1, recompute="selective", c=2)
    assert (at_c1.data_parallel_size, at_c2.data_parallel_size) == (8, 4)
    assert at_c2.context_parallel_size == 2 and at_c2.context_parallel_comm_s > 0 == at_c1.context_parallel_comm_s
    assert at_c2.memory_bytes_per_gpu < at_c1.memory_bytes_per_gpu
    terms = ("compute_s", "tensor_parallel_comm_s", "expert_parallel_comm_s", "context_parallel_comm_s")
    terms += ("pipeline_comm_s", "bubble_s", "data_parallel_comm_s", "optimizer_s")
    assert at_c2.step_time_s == pytest.approx(sum(getattr(at_c2, name) for name in terms))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"context_parallel_size": 3}, r"seq_length=32768 is not divisible by 2c = 6.*choose c in \[1, 2, 4"),
        ({"context_parallel_size": 32}, r"\* context_parallel_size = 32 does not divide the cluster's 16 GPUs"),
        ({"context_parallel_size": 0}, r"context_parallel_size"),
    ],
)
def test_estimate_refuses_a_bad_context_parallel_size(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate(
            LONG,
            Cluster.h100(48 if kwargs["context_parallel_size"] == 3 else 16),
            48,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            **kwargs,
        )


def test_llama3_8b_at_128k_at_t8_without_cp_keeps_no_attention_scores_under_flash_attention():
    """64 H100s, t=8, c=1, d=8, ZeRO-1, SP, full recompute, by hand: about 21 GB. Attention that keeps
    its scores adds 5as^2b/t per layer for the layer being recomputed: 344 GB more."""
    s, h, a, layers, vocab, t, d = 131_072, 4096, 32, 32, 128_256, 8, 8
    state = (4 + 12 / d) * LLAMA3_8B_128K.parameters / t  # ZeRO-1: weight and gradient, optimizer state / d
    inputs = layers * 2 * s * h / t  # full recompute keeps each layer's input, split along s by SP
    split = (2 * (h + 2 * 8 * 128) + 2 * h + 6 * 14_336) / h  # GQA's Q, K, V and a SwiGLU MLP
    recomputing = s * h * (10 + split) / t + 4 * a * s / t  # its activations and the kernel's log-sum-exp
    logits = 4 * s * vocab / t
    args = dict(recompute="full", sp=True, zero_stage=1)
    flash = cost(LLAMA3_8B_128K, Cluster.h100(64), 8, t, 1, 1, 1, **args)
    assert flash.memory_bytes_per_gpu == pytest.approx(state + inputs + recomputing + logits, rel=1e-9)
    assert 20 * GB < flash.memory_bytes_per_gpu < 21 * GB
    eager = cost(LLAMA3_8B_128K, Cluster.h100(64, flash_attention=False), 8, t, 1, 1, 1, **args)
    scores = 5 * a * s * s / t - 4 * a * s / t  # the scores, their softmax and dropout mask, not the log-sum-exp
    assert eager.memory_bytes_per_gpu - flash.memory_bytes_per_gpu == pytest.approx(scores, rel=1e-9)
    assert 343 * GB < scores < 344 * GB


@pytest.mark.parametrize("gpus", [8, 64])
def test_llama3_8b_at_128k_on_h100s_fits_without_cp_and_runs_faster_with_it(gpus):
    kwargs = dict(zero_stage=1, sequence_parallel=True, context_parallel_sizes=(1, 2, 4, 8, 16))
    layouts = plan("llama3_8b_128k", Cluster.h100(gpus), 8, **kwargs)
    assert 1 in {x.context_parallel_size for x in layouts}
    assert layouts[0].context_parallel_size > 1  # cp spares the recompute the c=1 layouts need to fit
    assert all(x.memory_bytes_per_gpu <= 72 * GB for x in layouts)
    # attention that keeps its scores: no layout without cp fits (on 8 GPUs, none at all)
    eager = Cluster.h100(gpus, flash_attention=False)
    if gpus == 8:
        with pytest.raises(ValueError, match="does not fit in GPU memory with any layout of 8 GPUs"):
            plan("llama3_8b_128k", eager, 8, **kwargs)
    else:
        assert 1 not in {x.context_parallel_size for x in plan("llama3_8b_128k", eager, 8, **kwargs)}


def test_ptdp_plan_searches_and_prints_context_parallel_layouts(capsys):
    from lightning_ptdp.planner.cli import main, parse_layout

    assert parse_layout("t=4,p=1,c=4")["context_parallel_size"] == 4
    flags = ["llama3_8b_128k", "--gpus", "64", "--global-batch-size", "8", "--zero-stage", "1", "--sequence-parallel"]
    assert main([*flags, "--context-parallel", "1,2,4,8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()[1:5]
    assert header.split()[:5] == ["rank", "t", "p", "c", "d"]
    assert all(int(row.split()[3]) > 1 for row in rows)  # every listed layout splits the sequence
    assert "context_parallel_size=" in out  # the arguments that run the best one
    assert main([*flags, "--layout", "t=4,p=1,c=4,recompute=selective"]) == 0
    assert "CP key/value exchanges" in capsys.readouterr().out


def test_ptdp_plan_refuses_a_bad_context_parallel_list(capsys):
    from lightning_ptdp.planner.cli import main

    with pytest.raises(SystemExit):
        main(["gpt_1.7b", "--gpus", "8", "--global-batch-size", "8", "--context-parallel", "2,x"])
    assert "--context-parallel='2,x' must list whole numbers >= 1" in capsys.readouterr().err
