"""Tensor-parallel plan discovery without a process group: plans, and errors before training."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_ptdp.tensor_parallel import PartialSplitWarning, TPDiscoveryError, tensor_parallel_plan
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.layers import ShardLayout, VocabShard
from tests.models import build_model


def _net(family: str, **overrides) -> nn.Module:
    module = build_model(family, **overrides)
    return module.gpt if family == "gpt" else module.net


def _plan(net: nn.Module, tp: int):
    ids = torch.zeros(2, 32, dtype=torch.long)
    return tensor_parallel_plan(net, tp, probe=lambda: net(ids))


def _styles(report) -> dict[str, str]:
    return {path.split("*.")[1]: style for path, style, _ in report.entries}


def test_plans_are_found_from_dataflow_for_each_family():
    assert _styles(_plan(_net("gpt"), 2)) == {
        "attn.query": "colwise",
        "attn.key": "colwise",
        "attn.value": "colwise",
        "attn.proj": "rowwise",
        "mlp.fc_in": "colwise",
        "mlp.fc_out": "rowwise",
    }
    assert _styles(_plan(_net("nanogpt"), 2)) == {
        "attn.c_attn": "colwise_fused:3",
        "attn.c_proj": "rowwise",
        "c_fc": "colwise",
        "c_proj": "rowwise",
    }
    llama = _plan(_net("llama"), 4)
    assert _styles(llama) == {
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "w1": "colwise",
        "w3": "colwise",
        "w2": "rowwise",
    }
    details = {path.split("*.")[1]: detail for path, _, detail in llama.entries}
    assert details["attention.wq"].startswith("1/4 heads") and details["attention.wk"].startswith("1/2 heads")
    assert "attention.wo" in llama.summary()


@pytest.mark.parametrize(
    ("family", "tp", "match"),
    [
        (
            "gpt",
            3,
            r"tensor_parallel_size=3 does not divide the 4 attention heads of 'blocks.0.attn.query'; choose tensor_parallel_size from 1, 2 or 4",
        ),
        ("nanogpt", 8, r"tensor_parallel_size=8 does not divide the 4 attention heads of 'h.0.attn.c_attn'"),
        ("llama", 3, r"tensor_parallel_size=3 does not divide the 4 attention heads of 'layers.0.attention.wq'"),
    ],
)
def test_heads_not_divisible_by_t(family, tp, match):
    with pytest.raises(ValueError, match=match):
        _plan(_net(family), tp)


def test_mlp_width_not_divisible_by_t():
    net = _net("gpt", ffn_hidden_size=66, num_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the 2 attention heads"):
        _plan(net, 4)
    with pytest.raises(ValueError, match=r"does not divide the 66 output features of 'blocks.0.mlp.fc_in'"):
        _plan(_net("gpt", ffn_hidden_size=66, num_heads=4), 4)


class ControlFlowBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: not traceable
            x = x * 2
        return x + self.b(F.relu(self.a(x)))


class ControlFlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ControlFlowBlock(), ControlFlowBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_control_flow_in_the_forward_is_read_as_it_runs():
    # data-dependent Python control flow defeated symbolic tracing; the recorded forward just runs it
    net = ControlFlowNet()
    styles = {
        path: style for path, style, _ in tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8))).entries
    }
    assert styles == {"blocks.*.a": "colwise", "blocks.*.b": "rowwise"}


class FailingBlock(ControlFlowBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("needs gradients")


def test_block_that_cannot_run_names_it_and_shows_the_explicit_plan():
    net = ControlFlowNet()
    for block in net.blocks:
        block.__class__ = FailingBlock
    with pytest.raises(
        TPDiscoveryError,
        match=r"could not run block 'blocks.0' \(FailingBlock\).*needs gradients.*tp_plan=\{'blocks.\*.<linear>': 'rowwise'",
    ):
        tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8)))


class HeadSumBlock(nn.Module):
    """Sums over the heads dim inside attention: cannot be split by heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x).view(x.shape[0], x.shape[1], 4, 2).sum(dim=2)
        return x + self.o(h)


class HeadSumThenMLPBlock(HeadSumBlock):
    """The attention-like region discovery cannot split, then an MLP region it can."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x + self.down(F.relu(self.up(x)))


class HeadSumThenMLPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([HeadSumThenMLPBlock(), HeadSumThenMLPBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def suggested_plan(net: nn.Module, tp: int) -> dict:
    """The explicit plan the discovery error suggests (tests/distributed/test_explicit_plan.py runs it)."""
    import ast

    with pytest.raises(TPDiscoveryError) as error:
        tensor_parallel_plan(net, tp, probe=lambda: net(torch.ones(2, 4, 8)), strict=True)
    return ast.literal_eval(re.search(r"tp_plan=(\{.*?\})", str(error.value)).group(1))


def test_op_across_the_sharded_dim_names_block_op_source_line_and_the_plan_that_works():
    line = inspect.getsourcelines(HeadSumBlock.forward)[1] + 1  # the line of the .sum()
    net = nn.Sequential(HeadSumBlock(), HeadSumBlock())
    with pytest.raises(
        TPDiscoveryError,
        match=rf"block '0': .*sum.* \(called at .*test_tp_discovery\.py:{line} in forward\) .* cannot be split by "
        r"heads automatically; no region of '0' can be split without discovery, so keep its blocks whole",
    ):
        tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8)), strict=True)
    # with a region discovery can split beside it: the plan for exactly that region, as globs
    assert suggested_plan(HeadSumThenMLPNet(), 2) == {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


def test_a_region_discovery_cannot_split_runs_whole_with_one_warning_naming_op_and_line():
    """Without strict_plan the unsplittable region stays whole on every rank and the rest is split; the
    warning names the op, its source line, what stays whole and the replicated share of the block."""
    line = inspect.getsourcelines(HeadSumBlock.forward)[1] + 1
    net = HeadSumThenMLPNet()
    with pytest.warns(PartialSplitWarning) as caught:
        report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8)))
    assert len(caught) == 1  # one warning for the list, not one per block
    message = str(caught[0].message)
    assert re.search(r"keeps q, o whole on every rank in block 'layers.0' .*\(\d+% of each block's parameters", message)
    assert re.search(rf"sum.*test_tp_discovery\.py:{line} in forward.*Split over t: up, down", message)
    assert _styles(report) == {"q": "replicated", "o": "replicated", "up": "colwise", "down": "rowwise"}


class ScaledLinear(nn.Linear):
    """A Linear with a learned output scale of its own (1 at first, so it computes F.linear until it trains)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.scale


def test_a_linear_with_parameters_of_its_own_is_never_swapped_for_a_shard():
    """A shard computes F.linear alone: the Linear's own scale would be lost (silently, while it is 1)."""
    from lightning_ptdp.core.blocks import acts_as

    assert not acts_as(ScaledLinear(4, 4), nn.Linear) and acts_as(nn.Linear(4, 4), nn.Linear)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), ScaledLinear(16, 8)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(32, 8), ScaledLinear(8, 32, bias=False)
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, idx):
            x = self.embed(idx)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    net = Net()
    with pytest.warns(PartialSplitWarning, match=r"'down' is a ScaledLinear whose own forward or parameters go beyond"):
        report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.zeros(2, 4, dtype=torch.long)))
    styles = _styles(report)
    assert styles["up"] == styles["down"] == "replicated" and "head" not in styles  # the head stays whole


class HandsOnBlock(nn.Module):
    """A block that returns, besides the hidden states, a value its router made for the next block (ZAYA's
    router states): down's output leaves the block before its row (out) sums it."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.down, self.out = nn.Linear(8, 16), nn.Linear(16, 8)
        self.up, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)
        self.first = first

    def forward(self, x, carried=None):
        state = self.down(x) if self.first else self.down(x) + carried
        x = x + self.out(torch.tanh(state)) + self.proj(F.gelu(self.up(x)))
        return x, state


def test_a_column_output_the_block_returns_is_gathered_where_the_next_block_reads_it():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([HandsOnBlock(True), HandsOnBlock(False)])

        def forward(self, x):
            carried = None
            for layer in self.layers:
                x, carried = layer(x, carried)
            return x

    net = Net()
    # both blocks split: the first returns its state as this rank's features (tensor_parallel/extra_outputs.py),
    # and the second adds exactly that share to its own column output (the whole state sliced at the add)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialSplitWarning)
        report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8)))
    styles = {path: style for path, style, _ in report.entries}
    for layer in ("layers.0", "layers.1"):
        assert (styles[f"{layer}.down"], styles[f"{layer}.out"]) == ("colwise", "rowwise")
        assert (styles[f"{layer}.up"], styles[f"{layer}.proj"]) == ("colwise", "rowwise")


def test_sequence_parallel_runs_a_block_keeping_a_region_whole_on_the_whole_sequence():
    """Under SP a whole region would see 1/t of the sequence: its block gathers the sequence and says so
    (tests/distributed/test_sequence_parallel_whole_regions.py trains it against one process)."""
    from lightning_ptdp.tensor_parallel import apply_tensor_parallel
    from lightning_ptdp.tensor_parallel.layers import ColumnParallelLinear

    net = HeadSumThenMLPNet()
    with pytest.warns(PartialSplitWarning, match=r"keeps q, o whole .* gather the sequence and run on all of it"):
        apply_tensor_parallel(net, TPGroup(None, 2, 0), sequence_parallel=True, probe=lambda: net(torch.ones(2, 4, 8)))
    assert isinstance(net.layers[0].up, ColumnParallelLinear) and isinstance(net.layers[0].q, nn.Linear)


class RollOrNotBlock(nn.Module):
    """One class, one structure, two code paths: ``roll`` moves each feature to the next one between
    q and o (across any split of q's outputs), as a per-layer flag picks sliding or full attention."""

    def __init__(self, roll: bool) -> None:
        super().__init__()
        self.roll = roll
        self.q, self.o = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.q(x))
        if self.roll:
            h = h.roll(1, dims=-1)
        return x + self.o(h)


def test_blocks_of_one_structure_running_other_code_are_planned_apart():
    """The plan of the first block served every block of its structure: the rolled blocks' q and o were
    split like the first's and the roll ran on each rank's shard (a silent wrong result); the census
    records each block's calls, and the blocks running other code get their own plan."""
    net = nn.Sequential(RollOrNotBlock(False), RollOrNotBlock(True), RollOrNotBlock(False), RollOrNotBlock(True))
    with pytest.warns(PartialSplitWarning, match=r"keeps q, o whole on every rank in block '1'"):
        report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8)))
    styles = {path: style for path, style, _ in report.entries}
    assert styles == {"{0,2}.q": "colwise", "{0,2}.o": "rowwise", "{1,3}.q": "replicated", "{1,3}.o": "replicated"}


def test_shard_layouts():
    fused = ShardLayout(blocks=3, units=4, unit_size=2, tp_size=2)
    assert fused.indices(1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]  # its heads of q, k and v
    kv = ShardLayout(blocks=1, units=2, unit_size=3, tp_size=4)
    assert [kv.indices(r).tolist() for r in range(4)] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert kv.replication == 2
    with pytest.raises(ValueError, match=r"3 units cannot be replicated evenly over tensor_parallel_size=4"):
        ShardLayout(blocks=1, units=3, unit_size=1, tp_size=4)


def test_vocab_padding():
    shard = VocabShard.of(63, TPGroup(group=None, size=2, rank=1))
    assert (shard.padded_size, shard.start, shard.local, shard.valid) == (64, 32, 32, 31)


def test_state_dict_hooks_of_sharded_modules_run_only_on_whole_tensors():
    """torchtitan's fused wqkv splits itself into wq/wk/wv in a state_dict hook: on a TP shard that
    would cut the shard as a whole tensor, so the hooks come off the module (sharded checkpoints key
    by parameter name) and run on whole tensors where a full checkpoint is written or read."""
    from lightning_ptdp.tensor_parallel.state_dict_hooks import run_load_pre_hooks, run_save_hooks

    net = _net("llama")
    attention = net.layers[0].attention
    seen = []

    def split_qkv_on_save(module, state_dict, prefix, local_metadata):
        seen.append((module, prefix))
        state_dict[f"{prefix}wq.renamed"] = state_dict.pop(f"{prefix}wq.weight")

    def merge_qkv_on_load(module, state_dict, prefix, *args):
        state_dict[f"{prefix}wq.weight"] = state_dict.pop(f"{prefix}wq.renamed")

    attention.register_state_dict_post_hook(split_qkv_on_save)
    attention.register_load_state_dict_pre_hook(merge_qkv_on_load)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    tensor_parallel_plan(net, 2, probe=lambda: net(tokens))
    assert not attention._state_dict_hooks and not attention._load_state_dict_pre_hooks
    plain = net.state_dict()
    assert "layers.0.attention.wq.weight" in plain and not seen  # keyed by parameter name
    saved = run_save_hooks(net, dict(plain))
    assert seen == [(attention, "layers.0.attention.")] and "layers.0.attention.wq.renamed" in saved
    loaded = run_load_pre_hooks(net, saved, strict=True)
    assert (
        loaded.keys() == plain.keys()
        and loaded["layers.0.attention.wq.weight"] is plain["layers.0.attention.wq.weight"]
    )
    assert run_save_hooks(net, {}) == {}  # a rank without the whole module's tensors runs nothing


class CastingEmbedding(nn.Embedding):
    """An embedding subclass with a forward of its own that is still a lookup (torchtitan's)."""

    def forward(self, idx):
        return super().forward(idx).to(self.weight.dtype)


class ScaledEmbedding(nn.Embedding):
    """A lookup scaled by sqrt(width) (Gemma's): no plain lookup, so no vocab shard may replace it."""

    def forward(self, idx):
        return super().forward(idx) * self.embedding_dim**0.5


def test_an_embedding_built_on_meta_is_checked_as_a_lookup_without_storage():
    """On meta the rows are stand-ins holding their index (an expand, no storage): a subclass that still
    looks rows up is split by vocabulary as it would be with real weights; a scaled one is not."""
    from lightning_ptdp.core.blocks import acts_as

    with torch.device("meta"):
        casting, scaled = CastingEmbedding(50_000, 1024), ScaledEmbedding(50_000, 1024)
    assert acts_as(casting, nn.Embedding) and not acts_as(scaled, nn.Embedding)
