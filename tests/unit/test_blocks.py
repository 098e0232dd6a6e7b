"""The shared block finder: ModuleList, Sequential and ModuleDict block lists, Linear-like Conv1D."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.core.blocks import find_block_lists, is_linear_like
from lightning_ptdp.parallel.recompute import apply_activation_checkpointing
from lightning_ptdp.pipeline import ChunkLayout
from lightning_ptdp.pipeline.apply import transformer_blocks
from lightning_ptdp.pipeline.split import record_forward, split_model
from lightning_ptdp.tensor_parallel import apply as tp_apply
from tests.models import Llama, LlamaBlock, ZooConfig


class Conv1D(nn.Module):
    """transformers' Conv1D as GPT-2 uses it: weight (in, out), ``nf`` out features."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class Conv1DBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(16, 8), Conv1D(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(torch.relu(self.c_fc(x)))


class TitanLlama(Llama):
    """torchtitan keeps its layers in an nn.ModuleDict keyed "0".."n"."""

    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(cfg) for i in range(cfg.num_layers)})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers.values():
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


class NanoDict(nn.Module):
    """nanoGPT: ``transformer = nn.ModuleDict(wte=..., h=nn.ModuleList(...), ln_f=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(wte=nn.Embedding(16, 8), h=nn.ModuleList(Conv1DBlock() for _ in range(3)), ln_f=nn.LayerNorm(8))
        )


def test_block_containers_of_every_kind_are_found():
    titan = TitanLlama(ZooConfig(num_layers=3))
    assert [(p, len(b)) for p, b in find_block_lists(titan)] == [("layers", 3)]
    assert find_block_lists(titan)[0][1][2] is titan.layers["2"]
    assert [(p, len(b)) for p, b in find_block_lists(NanoDict())] == [("transformer.h", 3)]
    assert [(p, len(b)) for p, b in find_block_lists(nn.Sequential(Conv1DBlock(), Conv1DBlock()))] == [("", 2)]
    # only the outermost list; mixed types and single-Linear children are no blocks
    outer = nn.ModuleList([nn.Sequential(Conv1DBlock(), Conv1DBlock()), nn.Sequential(Conv1DBlock(), Conv1DBlock())])
    assert [p for p, _ in find_block_lists(nn.ModuleDict({"x": outer}))] == ["x"]
    assert find_block_lists(nn.ModuleDict({"a": Conv1DBlock(), "b": nn.Linear(2, 2)})) == []
    assert find_block_lists(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])) == []


def test_a_module_list_with_empty_slots_is_passed_over_not_a_crash():
    # optional per-layer modules kept as None in a ModuleList (a norm only some layers have), beside the blocks
    model = nn.ModuleDict(
        {"norms": nn.ModuleList([None, Conv1DBlock(), None]), "h": nn.ModuleList([Conv1DBlock()] * 2)}
    )
    assert [(p, len(b)) for p, b in find_block_lists(model)] == [("h", 2)]
    assert find_block_lists(nn.ModuleList([None, None])) == []


def test_conv1d_is_linear_like_by_shape_not_import():
    assert is_linear_like(Conv1D(4, 2)) and is_linear_like(nn.Linear(2, 4))
    fake = Conv1D(4, 2)
    del fake.nf
    assert not is_linear_like(fake)
    assert tp_apply.find_block_lists is find_block_lists  # one finder, still importable from apply.py


def test_pipeline_split_and_recompute_use_a_module_dict_of_blocks():
    torch.manual_seed(0)
    net = TitanLlama(ZooConfig(num_layers=4))
    idx = torch.randint(0, 64, (2, 32))
    expected = net(idx)
    layout = ChunkLayout(num_layers=4, pp=2, vpp=1)
    stages = []
    for rank in range(2):
        part = copy.deepcopy(net)
        blocks = transformer_blocks(part)
        record = record_forward(part, blocks, layout, lambda part=part: part(idx), 2)
        stages.append((split_model(part, blocks, layout, rank, record), part))
    activation = None
    for chunk in range(2):
        split, part = stages[chunk]
        _, activation = split.run_chunk(chunk, activation, lambda part=part: part(idx))
    assert torch.equal(activation, expected)

    recomputed = copy.deepcopy(net)
    assert apply_activation_checkpointing(recomputed, "full") == ["layers.0", "layers.1", "layers.2", "layers.3"]
    torch.testing.assert_close(recomputed(idx), expected, rtol=0, atol=0)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential, nn.ModuleDict])
def test_each_container_kind_holds_blocks_in_order(container):
    blocks = [Conv1DBlock(), Conv1DBlock()]
    if container is nn.ModuleDict:
        made = container({"first": blocks[0], "second": blocks[1]})
    else:
        made = container(*blocks) if container is nn.Sequential else container(blocks)
    holder = nn.Module()
    holder.body, holder.norm = made, nn.LayerNorm(8)
    assert find_block_lists(holder) == [("body", blocks)]


def test_block_inputs_run_the_probe_once_and_give_each_reader_its_own_object_inputs():
    """The certificate and TP's recording read one capture; a cache object one reader's run appends
    to is not the one the next reader gets."""
    from lightning_ptdp.core.census import BlockInputs

    class Cached(nn.Module):
        def forward(self, x, cache):
            cache.append(x)
            return x

    blocks = nn.ModuleList([Cached(), Cached()])
    runs = []

    def probe():
        runs.append(1)
        x = torch.ones(1)
        for block in blocks:
            x = block(x, cache=[])

    inputs = BlockInputs(probe)
    first = inputs.of(list(blocks))
    first[id(blocks[0])][1]["cache"].append("a reader's write")
    second = inputs.of([blocks[0]])
    assert len(runs) == 1 and second[id(blocks[0])][1]["cache"] == []


class MixerBlock(nn.Module):
    """A second layer type of a hybrid stack: a gated mixer, two Linears of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.sigmoid(self.gate(x)))


def test_a_hybrid_stack_of_two_layer_types_is_one_block_list_but_a_dict_of_model_parts_is_none():
    """OLMo-hybrid's layers alternate a linear-attention layer and an attention layer in one ModuleList:
    that is the stack (each structure is planned apart); a ModuleDict of two types names parts of a
    model (an encoder beside a decoder), not layers in order."""
    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([MixerBlock(), Conv1DBlock(), MixerBlock()])
    assert [(p, len(b)) for p, b in find_block_lists(hybrid)] == [("layers", 3)]
    parts = nn.Module()
    parts.parts = nn.ModuleDict({"encoder": MixerBlock(), "decoder": Conv1DBlock()})
    assert find_block_lists(parts) == []
