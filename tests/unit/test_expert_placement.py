"""Expert placement (expert_parallel/placement.py): the balancing rule, the routing among replicas,
and the refusals of ``expert_balance``."""

from __future__ import annotations

import pytest
import torch

from lightning_ptdp.config import ExpertBalanceConfig, ParallelConfig
from lightning_ptdp.expert_parallel.placement import Placement, balance, initial_placement


def test_the_fixed_split_routes_each_expert_to_its_one_rank():
    placement = Placement.contiguous(8, 4)
    experts = torch.tensor([7, 0, 3, 3, 5, 1])
    assert placement.slots == ((0, 1), (2, 3), (4, 5), (6, 7))
    for source in range(4):  # the global slot of expert j is j: the exchange is the unbalanced one
        assert torch.equal(placement.route(experts, source), experts)


def test_a_replicated_experts_rows_go_round_robin_over_its_replicas():
    placement = Placement(4, ((0, 1), (0, 2), (0, 3)))  # expert 0 on every rank
    experts = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2])
    for source in range(3):
        slots = placement.route(experts, source)
        ranks = (slots[:6] // placement.per_rank).tolist()
        assert sorted(ranks) == [0, 0, 1, 1, 2, 2] and ranks[0] == source  # evenly, starting at the source
        assert slots[6:].tolist() == [1, 3]  # experts 1 and 2 have one holder each


def test_balancing_replicates_the_hot_experts_and_levels_the_ranks():
    load = torch.tensor([300, 300, 50, 50, 50, 50, 50, 50])  # two hot experts of eight
    fixed = Placement.contiguous(8, 4).rank_rows(load)
    placement = balance(load, 4, 3)  # n/e + 1 slots a rank
    rows = placement.rank_rows(load)
    assert fixed.max() / fixed.mean() == pytest.approx(8 / 3)  # rank 0 holds both
    assert rows.max() / rows.mean() <= 1.15
    assert {0, 1} <= set(placement.replicated)
    for experts in placement.slots:
        assert len(experts) == 3 and len(set(experts)) == 3  # distinct experts, the cap held
    assert all(placement.holders[j] for j in range(8))  # every expert somewhere


def test_balancing_is_a_function_of_the_counts_alone():
    load = torch.tensor([5, 9, 1, 0, 7, 7, 2, 3])
    assert balance(load, 4, 2) == balance(load.clone(), 4, 2)  # every rank computes the same placement
    assert balance(load, 4, 2).per_rank == 2  # no spare slot: only moves, no replica


def test_spare_slots_start_with_the_next_experts():
    assert initial_placement(4, 2, 3).slots == ((0, 1, 2), (0, 2, 3))
    assert initial_placement(4, 4, "n/e+1").slots == ((0, 1), (1, 2), (2, 3), (0, 3))


def test_expert_balance_takes_a_switch_an_interval_or_a_dict():
    assert ParallelConfig(expert_parallel_size=2, expert_balance=True).expert_balance == ExpertBalanceConfig()
    assert ParallelConfig(expert_parallel_size=2, expert_balance=10).expert_balance.interval == 10
    config = ParallelConfig(expert_parallel_size=2, expert_balance={"experts_per_rank": 3})
    assert config.expert_balance.experts_per_rank == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"expert_balance": True}, r"expert_balance=.* needs expert_parallel_size > 1"),
        ({"expert_parallel_size": 2, "expert_balance": {"interval": 0}}, r"interval=0 must be an integer >= 1"),
        (
            {"expert_parallel_size": 2, "expert_balance": {"experts_per_rank": 0}},
            r"experts_per_rank=0 must be an integer >= 1",
        ),
        ({"expert_parallel_size": 2, "expert_balance": {"every": 3}}, r"unknown keys \['every'\]"),
        ({"expert_parallel_size": 2, "expert_balance": "often"}, r"must be True, False, an interval"),
        ({"expert_parallel_size": 2, "zero_stage": 3, "expert_balance": True}, r"zero_stage=3: FSDP2 shards"),
    ],
)
def test_bad_expert_balance_is_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_a_cap_below_n_over_e_is_refused_at_setup():
    from lightning_ptdp.expert_parallel import EPGroup, ExpertDiscoveryError, apply_expert_parallel
    from tests.models import build_model

    net = build_model("moe_llama").net
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(ExpertDiscoveryError, match=r"experts_per_rank=1: .* need at least n/e = 2 per rank"):
        apply_expert_parallel(net, EPGroup(None, 2, 0), lambda: net(ids), slots=1)
