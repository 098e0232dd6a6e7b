"""Expert capacity's rule (expert_parallel/exchange.py): each expert keeps at most ``capacity`` of a
rank's (token, expert) rows, those of the largest routing weights, grouped by expert for the exchange."""

from __future__ import annotations

import pytest
import torch

from lightning_ptdp import ParallelConfig
from lightning_ptdp.expert_parallel.exchange import capacity, within_capacity


def test_each_expert_keeps_its_largest_weights_up_to_its_capacity():
    generator = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 4, (64,), generator=generator)
    experts[:30] = 2  # a hot expert
    weights = torch.rand(64, generator=generator)
    limit = capacity(64, 4, 1.0)
    assert limit == 16
    kept = within_capacity(experts, weights, 4, limit)
    assert torch.equal(experts[kept], experts[kept].sort().values)  # grouped by expert, for the exchange
    for e in range(4):
        mine = (experts == e).nonzero().flatten()
        expected = mine[torch.argsort(-weights[mine], stable=True)][:limit]
        assert sorted(kept[experts[kept] == e].tolist()) == sorted(expected.tolist())
    assert (experts[kept] == 2).sum() == limit < (experts == 2).sum()  # the hot expert was cut
    everything = within_capacity(experts, weights, 4, 64)
    assert sorted(everything.tolist()) == list(range(64))  # no cap reached: every row kept


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"expert_capacity_factor": 0.0, "expert_parallel_size": 2},
            r"expert_capacity_factor=0.0 must be a number > 0",
        ),
        ({"expert_capacity_factor": True, "expert_parallel_size": 2}, r"expert_capacity_factor=True must be a number"),
        ({"expert_capacity_factor": 1.0}, r"expert_capacity_factor=1.0 needs expert_parallel_size > 1"),
    ],
)
def test_a_bad_capacity_is_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
