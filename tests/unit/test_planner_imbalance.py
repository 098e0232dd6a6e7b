"""The planner charges a hot expert to the busiest ep rank (``expert_imbalance``): its experts' GEMMs and
the exchanges it receives, not the mean; ``ptdp plan`` says what balanced routing would buy."""

from __future__ import annotations

import pytest

from lightning_ptdp.planner import Cluster, ModelSize, estimate, plan
from lightning_ptdp.planner.cli import main
from tests.unit.test_planner_deepseek import DEEPSEEK_V3

CLUSTER = Cluster.h100(64)
EP_LAYOUT = dict(tensor_parallel_size=1, pipeline_parallel_size=4, expert_parallel_size=8, zero_stage=2)


def _mixtral(imbalance: float, **layout):
    return estimate("mixtral_8x7b", CLUSTER, 256, expert_imbalance=imbalance, **{**EP_LAYOUT, **layout})


def test_a_busier_rank_costs_its_experts_and_its_exchanges():
    balanced, hot = _mixtral(1.0), _mixtral(1.5)
    assert balanced.expert_imbalance == 1.0 and hot.expert_imbalance == 1.5
    assert hot.compute_s > balanced.compute_s
    assert hot.expert_parallel_comm_s > balanced.expert_parallel_comm_s
    assert hot.tensor_parallel_comm_s == balanced.tensor_parallel_comm_s  # the rest of the layer as it was
    assert hot.data_parallel_comm_s == balanced.data_parallel_comm_s


def test_imbalance_is_at_most_e_and_nothing_without_expert_parallelism_or_experts():
    assert _mixtral(100.0).step_time_s == _mixtral(8.0).step_time_s  # every row on one of e = 8 ranks
    assert _mixtral(100.0).expert_imbalance == 8.0
    no_ep = dict(expert_parallel_size=1)  # each rank routes to its own copy of every expert
    assert _mixtral(3.0, **no_ep).step_time_s == _mixtral(1.0, **no_ep).step_time_s
    dense = [
        estimate("gpt_1.7b", Cluster.h100(8), 64, tensor_parallel_size=1, pipeline_parallel_size=1, expert_imbalance=x)
        for x in (1.0, 4.0)
    ]
    assert dense[0].step_time_s == dense[1].step_time_s and dense[1].expert_imbalance == 1.0


@pytest.mark.parametrize("value", [0.5, True, "2"])
def test_an_imbalance_below_one_or_not_a_number_is_refused(value):
    with pytest.raises(ValueError, match=r"expert_imbalance=.* must be a number >= 1.0: the busiest"):
        _mixtral(value)
    with pytest.raises(ValueError, match=r"must be a number >= 1.0"):
        plan("mixtral_8x7b", CLUSTER, 256, expert_imbalance=value)


def test_the_search_charges_the_imbalance_to_every_expert_layout():
    balanced = plan("mixtral_8x7b", CLUSTER, 256)
    hot = plan("mixtral_8x7b", CLUSTER, 256, expert_imbalance=2.0)
    assert hot[0].step_time_s >= balanced[0].step_time_s
    assert all(x.expert_imbalance == min(2.0, x.expert_parallel_size) for x in hot if x.expert_parallel_size > 1)


@pytest.mark.parametrize("model", ["mixtral_8x7b", "deepseek_v3"])
def test_ptdp_plan_says_what_balanced_routing_buys(model, tmp_path, capsys):
    if model == "deepseek_v3":  # a DeepSeek-V3-class model at 16 layers, from its config's shapes
        import json

        config = tmp_path / "config.json"
        config.write_text(json.dumps({**DEEPSEEK_V3, "num_hidden_layers": 16}))
        model, gpus = str(config), "256"
        assert ModelSize.from_hf_config({**DEEPSEEK_V3, "num_hidden_layers": 16}).num_experts == 256
    else:
        gpus = "64"
    main([model, "--gpus", gpus, "--global-batch-size", "512", "--expert-imbalance", "2", "--top", "1"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("routing imbalance 2:"))
    hot, balanced = (float(part.split(" s (")[0].split()[-1]) for part in line.split(";"))
    assert balanced <= hot and line.endswith("less")
    main(["gpt_1.7b", "--gpus", "8", "--global-batch-size", "64", "--expert-imbalance", "2", "--top", "1"])
    assert "routing imbalance" not in capsys.readouterr().out  # a dense model: nothing to balance
