"""Explicit tp_plan: globs, their errors, Conv1D shards and tied weights (no process group needed:
every check runs before a collective)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.core.plans import resolve_plan
from lightning_ptdp.tensor_parallel import apply_explicit_plan
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.consolidate import local_shard
from lightning_ptdp.tensor_parallel.explicit_plan import ColumnParallelConv1D
from lightning_ptdp.tensor_parallel.layers import ShardLayout
from tests.models import build_model
from tests.unit.test_blocks import Conv1D


def _tp(rank: int = 0) -> TPGroup:
    return TPGroup(None, 2, rank)


def test_globs_expand_over_module_paths():
    net = build_model("llama").net
    plan = {"layers.*.attention.w[qkv]": "colwise", "layers.1.attention.wq": "colwise", "output": "vocab_head"}
    resolved = resolve_plan(net, plan, "tp_plan")
    assert sorted(resolved) == sorted([f"layers.{i}.attention.w{x}" for i in range(2) for x in "qkv"] + ["output"])


def test_a_pattern_matching_nothing_names_close_paths():
    net = build_model("llama").net
    with pytest.raises(
        ValueError,
        match=r"tp_plan key 'layers.\*.attn.wq' matches no module of Llama; close paths: "
        r"layers.0.attention.wq.* globs over them",
    ):
        resolve_plan(net, {"layers.*.attn.wq": "colwise"}, "tp_plan")


def test_a_module_matched_with_two_styles_is_refused():
    net = build_model("llama").net
    with pytest.raises(
        ValueError,
        match=r"'layers.0.w2' is matched by 'layers.\*.w\*' \('colwise'\) and by "
        r"'layers.\*.w2' \('rowwise'\); one module takes one style",
    ):
        resolve_plan(net, {"layers.*.w*": "colwise", "layers.*.w2": "rowwise"}, "tp_plan")


def test_a_non_linear_module_is_refused_by_the_linear_styles():
    net = build_model("llama").net
    with pytest.raises(
        ValueError,
        match=r"tp_plan\['norm'\]='colwise' needs a Linear-like module \(nn.Linear or "
        r"transformers' Conv1D\), found RMSNorm",
    ):
        apply_explicit_plan(net, {"norm": "colwise"}, _tp())


@pytest.mark.parametrize("rank", [0, 1])
def test_conv1d_column_shard_keeps_the_transposed_layout(rank):
    conv = Conv1D(12, 8)  # weight (in=8, out=12): three fused parts of 4
    layout = ShardLayout(3, 4, 1, 2)
    shard = ColumnParallelConv1D(conv, layout, _tp(rank))
    assert shard.weight.shape == (8, 6)  # (in, out/t), as Conv1D stores it
    assert torch.equal(shard.weight, local_shard(shard, "weight", conv.weight.detach()))
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(shard(x), conv(x)[..., layout.indices(rank)])


@pytest.mark.parametrize(
    ("plan", "given"),
    [
        ({"net.lm_head": "vocab_head"}, r"'net.lm_head': 'vocab_head', 'net.model.embed_tokens' \(not in tp_plan\)"),
        (
            {"net.model.embed_tokens": "vocab_embedding"},
            r"'net.lm_head' \(not in tp_plan\), 'net.model.embed_tokens': 'vocab_embedding'",
        ),
    ],
)
def test_sharding_one_side_of_a_tied_weight_is_refused(plan, given):
    """Before: the planned side got its own shard and the other kept the old weight, untied, and
    training ran 2-4e-2 away from one process with no error."""
    pytest.importorskip("transformers")
    model = build_model("hfplan_llama_tied")
    with pytest.raises(
        ValueError,
        match=rf"a weight tied between {given}; sharding one would silently untie it.*"
        r"give the embedding 'vocab_embedding' and every module sharing its weight 'vocab_head'",
    ):
        apply_explicit_plan(model, plan, _tp())


def test_a_tie_outside_the_vocabulary_pair_is_refused():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.ModuleDict({"a": a, "b": b})
    with pytest.raises(
        ValueError, match=r"tp_plan shards 'a.weight', a weight tied between 'a': 'colwise', 'b': 'colwise'"
    ):
        apply_explicit_plan(model, {"*": "colwise"}, _tp())


def test_discovery_refuses_a_tie_it_would_break():
    """The vocabulary split takes the last vocab-sized Linear as the head; an embedding tied to
    another module would leave that module training the old whole weight."""
    from lightning_ptdp.tensor_parallel.apply import TPReport, _shard_vocabulary

    model = nn.ModuleDict({"emb": nn.Embedding(8, 4), "tied": nn.Linear(4, 8, bias=False), "head": nn.Linear(4, 8)})
    model["tied"].weight = model["emb"].weight
    with pytest.raises(
        ValueError, match=r"the token embedding 'emb' shares its weight with tied, which is not the LM head"
    ):
        _shard_vocabulary(model, _tp(), set(), TPReport(2, False))


def test_unequal_fused_parts_give_each_rank_whole_heads_of_every_part():
    """'colwise_fused:4|2|2': q | k | v of 4, 2 and 2 heads (of 8 features each) in one Linear;
    rank 1 of 2 holds q heads 2-3, k head 1 and v head 1, never a plain contiguous column cut."""
    model = nn.ModuleDict({"qkv": nn.Linear(16, 64)})
    report = apply_explicit_plan(model, {"qkv": "colwise_fused:4|2|2"}, TPGroup(group=None, size=2, rank=1))
    rows = model["qkv"].layout.indices(1).tolist()
    assert rows == [*range(16, 32), *range(40, 48), *range(56, 64)]
    assert report.entries[0][1] == "colwise_fused:4|2|2"
    with pytest.raises(ValueError, match=r"'colwise_fused:a\|b\|c'"):
        apply_explicit_plan(nn.ModuleDict({"qkv": nn.Linear(16, 64)}), {"qkv": "colwise_fused:4|x"}, _tp())
