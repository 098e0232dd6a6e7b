"""Regional compilation (parallel/compile.py) in one process: what it compiles, and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.config import CompileConfig
from lightning_ptdp.parallel.compile import adopt_compiled_module, apply_compile


class Block(nn.Module):
    def __init__(self, untraceable: bool = False) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)  # a block has two Linears at least
        self.untraceable = untraceable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.untraceable:
            torch._dynamo.graph_break()  # stands for any code dynamo cannot put in one graph
        return x + self.proj(torch.relu(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, untraceable: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(untraceable) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_every_block_forward_is_compiled_once_and_hooks_stay_outside():
    torch._dynamo.reset()
    model = Stack()
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(torch.compiler.is_compiling()))
    x = torch.randn(2, 8)
    expected = model(x)
    assert apply_compile(model, CompileConfig(backend="eager")) == ["blocks.0", "blocks.1", "blocks.2"]
    assert apply_compile(model, CompileConfig(backend="eager")) == ["blocks.0", "blocks.1", "blocks.2"]  # not twice
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # the eager backend: the same ops
    assert calls == [False, False]  # the hook runs outside the compiled forward
    assert "_ptdp_eager_forward" in model.blocks[0].__dict__
    assert model.blocks[0].forward is not model.blocks[0].__dict__["_ptdp_eager_forward"]


def test_fullgraph_names_the_block_that_would_break():
    torch._dynamo.reset()
    model = Stack(untraceable=True)
    apply_compile(model, CompileConfig(backend="eager", fullgraph=True))
    with pytest.raises(
        RuntimeError, match=r"compile\(fullgraph=True\): block 'blocks.0' cannot be traced as one graph"
    ):
        model(torch.randn(2, 8))


def test_an_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(
        ValueError, match=r"backend='tvm2' is not a torch.compile backend on this machine; .*'inductor'"
    ):
        apply_compile(Stack(), CompileConfig(backend="tvm2"))


def test_a_module_not_compiled_whole_is_left_alone():
    assert adopt_compiled_module(Stack()) is False
