"""The model census: one run of the user's step serves every setup reader (core/census.py)."""

import torch
import torch.nn as nn

from lightning_ptdp.core.census import BlockInputs, ModelCensus, ParamsReached
from lightning_ptdp.expert_parallel import ExpertCalls


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Experts(nn.Module):
    """Stacked experts called with top-k routing: hidden [N, H], chosen [N, k], weights [N, k]."""

    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, width, width) * 0.1)

    def forward(self, hidden, top_k_index, top_k_weights):
        picked = self.w[top_k_index[:, 0]]  # [N, H, H]
        return torch.einsum("nh,nhg->ng", hidden, picked) * top_k_weights[:, :1]


class _Model(nn.Module):
    """Two blocks, an MoE tail and an indexer whose output reaches the loss only through top-k ids."""

    def __init__(self, width: int = 8, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(width) for _ in range(2)])
        self.router = nn.Linear(width, n)
        self.experts = _Experts(n, width)
        self.indexer = nn.Linear(width, n)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        scores = self.router(x).softmax(-1)
        weights, chosen = scores.topk(1, dim=-1)
        x = x + self.experts(x, chosen, weights)
        keep = self.indexer(x).argmax(-1)  # ids only: no gradient reaches the indexer
        return x[torch.arange(x.shape[0]), keep % x.shape[1]].sum()


def test_one_run_serves_the_block_inputs_the_experts_calls_and_the_graph():
    torch.manual_seed(0)
    model, runs = _Model(), []

    def probe():
        runs.append(1)
        return model(torch.randn(5, 8))

    census = ModelCensus(probe)
    inputs = census.add(BlockInputs.of_block_lists(model, probe))
    experts = census.add(ExpertCalls(model))
    reached = census.add(ParamsReached(model))
    census.run()
    assert len(runs) == 1
    assert list(inputs.of([model.blocks[0]])[id(model.blocks[0])][0][0].shape) == [5, 8]
    assert not inputs.of([model.blocks[0]])[id(model.blocks[0])][0][0].requires_grad  # no step graph kept
    sites, lists = experts.sites()
    assert [s.name for s in sites] == ["experts"] and lists == []
    assert reached.unused == ["indexer.weight", "indexer.bias"]
    assert len(runs) == 1  # reading did not run the step again


def test_block_inputs_alone_stop_the_run_after_the_last_structure_first_block():
    model, seen = _Model(), []
    model.router.register_forward_hook(lambda *a: seen.append("router"))
    census = ModelCensus(lambda: model(torch.randn(3, 8)))
    inputs = census.add(BlockInputs.of_block_lists(model, census.probe))
    census.run()
    assert seen == [] and len(inputs.captured) == 1  # both blocks share one structure: one capture
    assert inputs.of([model.blocks[1]])  # a block asked for later gets a run of its own
    assert census.runs == 1
