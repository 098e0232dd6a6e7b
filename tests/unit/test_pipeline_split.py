"""The pipeline split in one process: chunks run one after another reproduce the whole model,
and every input the split cannot handle is refused with a message that says what to do."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.pipeline import ChunkLayout, PipelineSplitError, split_microbatches
from lightning_ptdp.pipeline.apply import transformer_blocks
from lightning_ptdp.pipeline.schedules import check_microbatches, schedule_runs
from lightning_ptdp.pipeline.split import record_forward, split_model
from tests.models import Llama, NanoGPT, ZooConfig


def _record(net: nn.Module, layout: ChunkLayout, idx: torch.Tensor):
    return record_forward(net, transformer_blocks(net), layout, lambda: net(idx), idx.shape[0])


@pytest.mark.parametrize(
    ("family", "pp", "vpp"), [("nanogpt", 2, 1), ("nanogpt", 2, 2), ("llama", 4, 1), ("llama", 2, 2)]
)
def test_chunks_in_sequence_reproduce_the_model(family, pp, vpp):
    """One copy of the model per pipeline rank, each cut to its chunks; chunk c's output fed to
    chunk c+1 gives exactly the unsplit model's logits (the same ops run, so bit-identical)."""
    torch.manual_seed(0)
    net = (NanoGPT if family == "nanogpt" else Llama)(ZooConfig(num_layers=4))
    idx = torch.randint(0, 64, (2, 32))
    expected = net(idx)
    layout = ChunkLayout(num_layers=4, pp=pp, vpp=vpp)
    stages = []
    for rank in range(pp):  # as on each rank: record on its own copy, then cut it
        part = copy.deepcopy(net)
        stages.append(split_model(part, transformer_blocks(part), layout, rank, _record(part, layout, idx)))
        stages[-1].net = part
    activation = None
    for chunk in range(layout.num_chunks):
        stage = stages[layout.rank_of(chunk)]
        finished, activation = stage.run_chunk(chunk, activation, lambda: stage.net(idx))
        assert finished == (chunk == layout.num_chunks - 1)
        if not finished:  # what a stage sends: the (batch, sequence, hidden) residual stream
            assert activation.shape == (2, 32, 32)
    assert torch.equal(activation, expected)
    # every parameter is held by exactly one rank, except a weight tied across stages
    held = [sum(p.numel() for p in stage.net.parameters()) for stage in stages]
    total = sum(p.numel() for p in net.parameters())
    tied = 64 * 32 if family == "nanogpt" else 0  # nanoGPT's wte is its lm_head: on the first and last stage
    assert sum(held) == total + tied
    assert [len(s.tied) for s in stages] == [1 if tied else 0] * pp


def test_a_split_model_refuses_direct_calls():
    net = NanoGPT(ZooConfig())
    idx = torch.randint(0, 64, (2, 32))
    layout = ChunkLayout(num_layers=2, pp=2, vpp=1)
    split_model(net, transformer_blocks(net), layout, 0, _record(net, layout, idx))
    with pytest.raises(
        RuntimeError, match=r"this rank holds only chunks \[0\] of the model, so its forward runs inside"
    ):
        net(idx)


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "match"),
    [
        (
            6,
            4,
            1,
            r"6 transformer blocks cannot be cut into pipeline_parallel_size\(4\) \* virtual_pipeline_size\(1\) = 4 "
            r"equal chunks; p\*v must divide 6: one of \[2, 3, 6\]",
        ),
        (8, 2, 3, r"virtual_pipeline_size in \[1, 2, 4\] works with pipeline_parallel_size=2"),
    ],
)
def test_layers_that_do_not_cut_evenly_are_refused(layers, pp, vpp, match):
    with pytest.raises(PipelineSplitError, match=match):
        ChunkLayout(num_layers=layers, pp=pp, vpp=vpp)


class _Block(nn.Module):
    def __init__(self, returns_tuple: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.returns_tuple = returns_tuple

    def forward(self, x):
        y = x + self.fc2(self.fc1(x))
        return (y, y.sum()) if self.returns_tuple else y  # a second tensor (tests/models.py TupleLlama)


class _Net(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList(_Block(returns_tuple=mode == "summed") for _ in range(2))

    def forward(self, x):
        if self.mode == "summed":  # what the blocks return beside the activation, summed after them
            total = 0
            for block in self.blocks:
                x, extra = block(x)
                total = total + extra
            return x * total
        if self.mode == "between":
            x = self.blocks[0](x) * 2.0  # changes the activation between the blocks
            return self.blocks[1](x)
        if self.mode == "reuse":
            return self.blocks[0](self.blocks[0](x))
        return self.blocks[1](self.blocks[0](x)[:, :4].repeat(1, 2)) if self.mode == "slice" else x


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("summed", r"add in chunk 1 reads a tensor the blocks of chunk 0 computed, besides the activation"),
        ("between", r"block 1 does not receive block 0's output as its first argument"),
        (
            "reuse",
            r"block 0 ran after 1 blocks; the pipeline split needs the forward to call every transformer block exactly once",
        ),
        ("none", r"the probe forward ran 0 of 2 transformer blocks"),
    ],
)
def test_forwards_the_split_cannot_cut_are_named(mode, match):
    net = _Net(mode)
    x = torch.randn(3, 8)
    with pytest.raises(PipelineSplitError, match=match):
        record_forward(net, list(net.blocks), ChunkLayout(num_layers=2, pp=2, vpp=1), lambda: net(x), 3)


def _two_stages(net: nn.Module, x: torch.Tensor, num_layers: int) -> tuple[list, torch.Tensor]:
    """Each pipeline rank's copy of ``net`` recorded and cut (p=2), and chunk 0's output fed to chunk 1."""
    layout, stages = ChunkLayout(num_layers=num_layers, pp=2, vpp=1), []
    for rank in range(2):
        part = copy.deepcopy(net)
        record = record_forward(part, list(part.blocks), layout, lambda part=part: part(x), x.shape[0])
        stages.append((split_model(part, list(part.blocks), layout, rank, record), part))
    activation = None
    for chunk, (stage, part) in enumerate(stages):
        _, activation = stage.run_chunk(chunk, activation, lambda part=part: part(x))
    return stages, activation


class _PerLayerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, extra, shared: dict):
        h = self.fc1(x) + extra
        if "kv" in shared:  # a later layer reuses the first layer's state
            h = h + shared["kv"]
        elif "store" in shared:
            shared["kv"] = h
        return x + self.fc2(torch.tanh(h))


class _PerLayerNet(nn.Module):
    """Each block reads its slice of inputs an outer module makes once, before the first block (as
    gemma's per-layer inputs); with ``share``, later blocks read the first block's result too (a
    key/value state shared between layers)."""

    def __init__(self, share: bool = False) -> None:
        super().__init__()
        self.embed, self.per_layer = nn.Embedding(16, 8), nn.Linear(8, 4 * 8)
        self.blocks = nn.ModuleList(_PerLayerBlock() for _ in range(4))
        self.head, self.share = nn.Linear(8, 16), share

    def forward(self, idx):
        x = self.embed(idx)
        extras = self.per_layer(x).unflatten(-1, (4, 8))  # [B, T, layers, H]
        shared = {"store": True} if self.share else {}
        for i, block in enumerate(self.blocks):
            x = block(x, extras[:, :, i], shared)
        return self.head(x)


def test_inputs_an_outer_module_makes_once_for_every_block_reach_later_stages():
    """Stage 1 runs the embedding and the per-layer projection again (their weights tied over the
    stages, gradients summed): chunk by chunk the split gives the unsplit model's logits."""
    torch.manual_seed(0)
    net, idx = _PerLayerNet(), torch.randint(0, 16, (2, 5))
    stages, activation = _two_stages(net, idx, num_layers=4)
    assert torch.equal(activation, net(idx))
    assert {name for name, *_ in stages[1][0].tied} == {"embed.weight", "per_layer.weight", "per_layer.bias"}


def test_a_parameter_no_forward_uses_stays_with_the_first_chunk():
    """Saved and loaded like any other (a checkpoint holds every entry): rank 0 keeps it."""
    net, idx = _PerLayerNet(), torch.randint(0, 16, (2, 5))
    net.unused = nn.Linear(8, 8)
    layout = ChunkLayout(num_layers=4, pp=2, vpp=1)
    held = []
    for rank in range(2):
        part = copy.deepcopy(net)
        split_model(
            part,
            list(part.blocks),
            layout,
            rank,
            record_forward(part, list(part.blocks), layout, lambda part=part: part(idx), 2),
        )
        held.append({n for n, _ in part.named_parameters() if n.startswith("unused.")})
    assert held == [{"unused.weight", "unused.bias"}, set()]


def test_a_block_result_read_by_a_later_stage_is_refused():
    net, idx = _PerLayerNet(share=True), torch.randint(0, 16, (2, 5))
    with pytest.raises(PipelineSplitError, match=r"in chunk 1 reads a tensor the blocks of chunk 0 computed"):
        record_forward(net, list(net.blocks), ChunkLayout(num_layers=4, pp=2, vpp=1), lambda: net(idx), 2)


class _ListBlock(nn.Module):
    """Returns a list, as GPT-1 (transformers' openai-gpt) does: [hidden, attention weights if asked]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return [x + self.fc2(torch.tanh(self.fc1(x)))]


class _ListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ListBlock() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)[0]
        return x


def test_blocks_returning_a_list_are_cut_like_a_tuple():
    torch.manual_seed(0)
    net, x = _ListNet(), torch.randn(3, 8)
    stages, activation = _two_stages(net, x, num_layers=2)
    assert torch.equal(activation, net(x))
    assert stages[0][0].record.block_tails == [(list, ()), (list, ())]


class _InPlaceScaledNet(_ListNet):
    """Scales what an outer module made in place before the blocks (CTRL's ``inputs_embeds *= sqrt(d)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)

    def forward(self, x):
        h = self.embed(x)
        h *= 2.0
        return super().forward(h)


def test_a_later_stage_may_write_into_another_chunk_module_output():
    """Its stand-in holds memory, so the in-place scale runs on it (its result is not used there)."""
    torch.manual_seed(0)
    net, x = _InPlaceScaledNet(), torch.randn(3, 8)
    _, activation = _two_stages(net, x, num_layers=2)
    assert torch.equal(activation, net(x))


def test_a_model_without_blocks_is_refused():
    with pytest.raises(
        PipelineSplitError, match=r"Linear has no nn.ModuleList/nn.Sequential/nn.ModuleDict of repeated blocks"
    ):
        transformer_blocks(nn.Linear(4, 4))


def test_microbatches_split_every_tensor_and_share_the_rest():
    batch = {"ids": torch.arange(8).view(4, 2), "mask": torch.ones(4, 2), "name": "x"}
    micro, rows = split_microbatches(batch, 2)
    assert rows == 2 and len(micro) == 2
    assert torch.equal(micro[1]["ids"], torch.tensor([[4, 5], [6, 7]])) and micro[1]["name"] == "x"


def test_a_micro_batch_size_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(
        ValueError,
        match=r"micro_batch_size=3 does not divide the per-replica batch of 8 samples; choose one of \[1, 2, 4, 8\]",
    ):
        split_microbatches((torch.zeros(8, 4), torch.zeros(8, 4)), 3)


@pytest.mark.parametrize(
    ("schedule", "m", "pp", "match"),
    [
        (
            "1f1b",
            2,
            4,
            r"'1f1b' cannot run m=2 microbatches .*1F1B needs at least pipeline_parallel_size=4 microbatches; counts that work: \[4, 5, 6",
        ),
        (
            "interleaved_1f1b",
            9,
            4,
            r"cannot run m=9 .*divisible by max\(1, m // 4\); counts that work: \[1, 2, 3, 4, 5, 6, 7, 8, 10, 12",
        ),
    ],
)
def test_a_microbatch_count_the_schedule_cannot_run_is_refused(schedule, m, pp, match):
    assert not schedule_runs(schedule, m, pp)
    with pytest.raises(ValueError, match=match):
        check_microbatches(schedule, m, pp, batch_rows=m, micro_batch_size=1)
    assert schedule_runs("gpipe", m, pp)
