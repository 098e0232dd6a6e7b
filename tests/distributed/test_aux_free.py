"""AuxFreeBalancing over 2 gloo ranks: the loads are summed over the ranks holding a router, so each
rank's biases after 3 steps equal one process's on the whole global batch (plain torch at d2;
transformers' DeepSeek-V3, whose e_score_correction_bias it finds, at d2 with e2, and at p2 where each
stage updates the routers it holds)."""

from __future__ import annotations

import pytest
import torch

STEPS = 3
# the same routing decisions give the same integer loads, so the same signs: any difference is a flipped
# choice between near-equal scores, which moves a bias by 2 x rate
BIAS_ATOL = 1e-6


def _fit_plain(devices: int) -> dict:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.callbacks import AuxFreeBalancing
    from lightning_ptdp.testing import quiet_trainer
    from tests.unit.test_aux_free import TinyMoE, batches

    global_batch = 4
    model, callback = TinyMoE(), AuxFreeBalancing(0.05)  # lr 0: routing moves by the biases alone, no round-off
    data = TensorDataset(batches(STEPS, global_batch))
    # rank r reads samples r, r + 2, ...: each global batch is one process's batch, in two halves
    sampler = DistributedSampler(data, shuffle=False) if devices > 1 else None
    loader = DataLoader(data, batch_size=global_batch // devices, sampler=sampler)
    strategy = PTDPStrategy() if devices > 1 else "auto"
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_steps=STEPS, callbacks=[callback], use_distributed_sampler=False
    )
    trainer.fit(model, loader)
    return {"bias": model.router.correction.clone(), "history": list(callback.history)}


def _fit_deepseek(strategy_kwargs: dict | None) -> dict:
    from lightning_ptdp.callbacks import AuxFreeBalancing
    from tests.fit_utils import fit_and_record

    callback = AuxFreeBalancing(1e-2)
    devices = 1 if strategy_kwargs is None else 2
    out = fit_and_record(
        "tiny:deepseek_v3", strategy_kwargs=strategy_kwargs, devices=devices, steps=STEPS, callbacks=[callback]
    )
    biases = {k: v for k, v in out["state"].items() if k.endswith("e_score_correction_bias")}
    held = {r.bias.name: r.bias.tensor.detach().cpu().clone() for r in callback.routers}  # this rank's stage's
    return {"biases": biases, "held": held, "history": list(callback.history)}


@pytest.mark.world_size(2)
def test_d2_biases_equal_one_process(dist_pool):
    ref = _fit_plain(1)
    ranks = dist_pool(2).run(_fit_plain, 2)
    assert ref["history"][0]["router.correction"] > 1.5  # skewed: a real update to compare
    for rank in ranks:
        assert rank["history"] == ref["history"]  # the global loads, step by step
        torch.testing.assert_close(rank["bias"], ref["bias"], rtol=0, atol=BIAS_ATOL)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "layout",
    [{"expert_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}],
    ids=["d2e2", "p2", "t2"],
)
def test_deepseek_v3_biases_equal_one_process(dist_pool, layout):
    """d2-e2: both ranks hold both routers and read half the batch; p2: each rank holds its stage's router;
    t2: both hold both routers (their loads summed over tp too: twice the loads, the same signs)."""
    ref = _fit_deepseek(None)
    ranks = dist_pool(2).run(_fit_deepseek, layout)
    assert sorted(ref["held"]) == sorted(ref["biases"]) and len(ref["held"]) == 2  # found by use, not by name
    assert all(b.abs().sum() > 0 for b in ref["held"].values())
    held = [name for rank in ranks for name in rank["held"]]
    assert sorted(set(held)) == sorted(ref["held"]) and len(held) == (2 if "pipeline_parallel_size" in layout else 4)
    for rank in ranks:
        assert rank["history"] == [{k: v for k, v in step.items() if k in rank["held"]} for step in ref["history"]]
        for name, bias in rank["held"].items():
            torch.testing.assert_close(bias, ref["held"][name], rtol=0, atol=BIAS_ATOL, msg=name)
