"""Balanced expert placement (``expert_balance``) against one process: with a router skewed toward
two experts (tests/skew.py) the placement changes after every step, hot experts replicated, weights
and optimizer state moving with them; losses, first gradients and final weights still equal the
single process's, and each rank holds exactly the experts its placement names."""

from __future__ import annotations

import pytest

from tests.matrix import sampled
from tests.real_models import MOE_FAMILIES

BALANCE = {"interval": 1}  # a new placement after every step: three placements in three steps
LAYOUTS = {
    "d4-e4": ({"expert_parallel_size": 4}, 4),
    "d4-e2-zero1": ({"expert_parallel_size": 2, "zero_stage": 1}, 4),
    "t2-d2-e2": ({"expert_parallel_size": 2, "tensor_parallel_size": 2}, 4),
    "p2-d2-e2": (
        {"expert_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"},
        4,
    ),
    "c2-e2": ({"context_parallel_size": 2, "expert_parallel_size": 2}, 2),
}
# one MoE family in two at the widest split (all: PTDP_FULL_MATRIX=1), every layout on two families
# (stacked experts; a ModuleList)
CASES = sorted(
    {
        *((f, "d4-e4") for f in sampled(sorted(MOE_FAMILIES), 2)),
        *((f, lay) for f in ("hf_mixtral", "moe_llama") for lay in LAYOUTS if lay != "p2-d2-e2"),
        *(("hf_mixtral", "p2-d2-e2"), ("hf_qwen2_moe", "p2-d2-e2")),  # ModuleList experts under PP: refused
    }
)
_REFERENCES: dict[str, dict] = {}


def fit_balanced(family: str, strategy_kwargs: dict | None, devices: int) -> dict:
    import lightning as L

    from tests.fit_utils import fit_and_record
    from tests.skew import SkewedRouting

    seen: dict = {}

    class Placements(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            report = getattr(trainer.strategy, "expert_report", None)
            if report is not None:  # the fixed split, a spare slot a rank
                seen["placements"] = [{n: s.placement.slots for n, s in report.sites.items()}]

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            report = getattr(trainer.strategy, "expert_report", None)
            if report is not None:
                seen.setdefault("placements", []).append({n: s.placement.slots for n, s in report.sites.items()})

        def on_train_end(self, trainer, pl_module) -> None:
            report = getattr(trainer.strategy, "expert_report", None)
            if report is None:
                return
            seen["holds"] = {}
            for name, shard in report.sites.items():
                layer = pl_module.get_submodule(name)
                if not any(True for _ in layer.parameters()):
                    continue  # another pipeline stage's layer
                listed = layer.__dict__.get("_ptdp_expert_list")
                if listed is not None:  # the experts with parameters: exactly this rank's
                    experts = getattr(layer, listed[0])
                    held = tuple(j for j in range(len(experts)) if any(True for _ in experts[j].parameters()))
                else:  # stacked: every parameter's rows are its slots
                    held = tuple(sorted({p.shape[0] for p in layer.parameters()}))
                seen["holds"][name] = (held, shard.mine, shard.local)

    result = fit_and_record(
        family,
        strategy_kwargs=strategy_kwargs,
        devices=devices,
        steps=3,
        callbacks=[SkewedRouting(), Placements()],
    )
    return {**result, **seen}


def _reference(family: str) -> dict:
    if family not in _REFERENCES:
        _REFERENCES[family] = fit_balanced(family, None, 1)
    return _REFERENCES[family]


@pytest.mark.parametrize(
    "family, layout", [pytest.param(f, lay, marks=pytest.mark.world_size(LAYOUTS[lay][1])) for f, lay in CASES]
)
def test_balanced_placement_trains_as_one_process(dist_pool, family, layout):
    from tests.distributed.test_expert_parallel import GRAD_REL, LOSS_RTOL, UPDATE_REL
    from tests.fit_utils import assert_ranks_match_reference
    from tests.shares import expected_moe_shares

    kwargs, devices = LAYOUTS[layout]
    kwargs = {**kwargs, "expert_balance": BALANCE}
    results = dist_pool(devices).run(fit_balanced, family, kwargs, devices)
    ref = _reference(family)
    assert_ranks_match_reference(results, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL)
    n = 4  # the zoo's MoE families have 4 experts (tests/real_models.py)
    e = kwargs["expert_parallel_size"]
    shares = expected_moe_shares(ref["held"], kwargs, devices)
    expected, expert_names = shares["experts"], shares["expert_names"]
    for result in results:
        placements = result["placements"]
        first, last = placements[0], placements[-1]
        assert first != last, "the skewed routing moved no expert"
        hot = [j for slots in last.values() for j in range(n) if sum(j in r for r in slots) > 1]
        assert hot, "no expert is replicated after balancing"
        for name, (held, mine, local) in result["holds"].items():
            assert local == n // e + 1 and mine == last[name][mine_rank(last[name], mine)]
            assert held == mine or held == (local,), f"{name}: holds {held}, its placement says {mine}"
        experts = sum(k for name, (k, _) in result["held"].items() if name in expert_names)
        assert experts == expected * (n // e + 1) * e // n  # n/e + 1 experts' parameters, not n/e


def mine_rank(slots: tuple, mine: tuple) -> int:
    return slots.index(mine)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("family", sampled(["hf_mixtral", "moe_llama"], 2))  # stacked rows; ModuleList: full run
def test_a_balanced_checkpoint_resumes_under_another_placement_and_e(dist_pool, tmp_path, tmp_path_factory, family):
    """Saved sharded at d4-e4 with the experts moved every step (replicas on several ranks), resumed
    at d2-e2 without balancing and at d4-e4 with it: the losses continue as if uninterrupted, the final
    weights and optimizer state equal the uninterrupted run's, and the consolidated file holds each
    expert once under the model's own keys."""
    from lightning_ptdp.checkpoint.command import consolidate
    from tests.distributed.test_expert_parallel import LOSS_RTOL, STEPS_PER_EPOCH, run_moe_epochs, uninterrupted
    from tests.distributed.test_resume import assert_same_training_state

    balanced = {"expert_balance": BALANCE}
    path = str(tmp_path / "moe.ckpt")
    whole, end = uninterrupted(dist_pool, tmp_path_factory, family)
    first = dist_pool(4).run(run_moe_epochs, 4, 4, 1, path, None, "sharded", family, 0, balanced)[0]
    assert first == pytest.approx(whole[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    saved = consolidate(path)
    name = {
        "hf_mixtral": "net.model.model.layers.0.mlp.experts.gate_up_proj",
        "moe_llama": "net.layers.0.moe.experts.3.w1.weight",
    }[family]
    experts = [k for k in saved["state_dict"] if ".experts." in k]
    assert family != "hf_mixtral" or saved["state_dict"][name].shape[0] == 4  # each expert once
    assert family != "moe_llama" or len({k.split(".experts.")[1].split(".")[0] for k in experts}) == 4
    for devices, e, layout in ((2, 2, None), (4, 4, balanced)):
        resumed = str(tmp_path / f"d{devices}-e{e}.ckpt")
        losses = dist_pool(devices).run(run_moe_epochs, devices, e, 2, resumed, path, "sharded", family, 0, layout)[0]
        assert losses == pytest.approx(whole[STEPS_PER_EPOCH:], rel=LOSS_RTOL), (devices, e)
        assert_same_training_state(resumed, end, path)
