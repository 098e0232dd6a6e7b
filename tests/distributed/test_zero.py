"""ZeRO stages 1-3 on the dp axis (1: torch's ZeroRedundancyOptimizer; 2, 3: FSDP2) against one process."""

from __future__ import annotations

import pytest

from tests.fit_utils import assert_matches_reference, fit_and_record

STEPS, GLOBAL_BATCH = 20, 8
# fp32; sharding changes only where sums happen (reduce-scatter instead of all-reduce): the same
# round-off budget as plain data parallelism (see test_data_parallel.py for the measurements).
LOSS_RTOL, GRAD_REL, UPDATE_REL = 1e-5, 1e-5, 1e-4
# exact gradient is zero (see test_data_parallel.py); nanoGPT's fused c_attn bias holds it as its middle
# third, which alone is left out there (fit_utils.without_key_third)
NOISE_DRIVEN = ("attn.key.bias",)


@pytest.mark.parametrize(
    ("family", "devices", "zero_stage"),
    [("gpt", 2, 1), ("llama", 2, 2), ("gpt", 2, 3), ("llama", 4, 3)],
)
def test_zero_matches_single_process(dist_pool, family, devices, zero_stage):
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs={"zero_stage": zero_stage},
        devices=devices,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    # the full state dict is gathered to rank 0 (cpu_offload): compare there
    assert_matches_reference(
        results[0], ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )
    for result in results[1:]:
        assert result["losses"] == pytest.approx(results[0]["losses"], rel=1e-6)
    assert_holds_its_share(results, ref, devices, zero_stage)


def assert_holds_its_share(results: list[dict], ref: dict, dp: int, zero_stage: int, tp: int = 1) -> None:
    """Stage 1: whole parameters (1/t of them under TP), and each element's optimizer state on exactly
    one dp rank, balanced within the largest tensor torch's greedy partition places whole. Stages
    2/3: the state 1/d (FSDP pads a shard by at most one row per tensor); stage 3 also parameters."""
    for result in results:
        if zero_stage == 1:
            assert ref["local_numel"] / tp <= result["local_numel"] <= ref["local_numel"] / tp * 1.1
            assert result["optimizer_numel"] <= ref["optimizer_numel"] / tp / dp * 1.35, result["optimizer_numel"]
        else:
            assert result["optimizer_numel"] <= ref["optimizer_numel"] / tp / dp * 1.1, result["optimizer_numel"]
        if zero_stage == 3:
            assert result["local_numel"] <= ref["local_numel"] / tp / dp * 1.1, (
                result["local_numel"],
                ref["local_numel"],
            )
    if zero_stage == 1 and tp == 1:
        assert sum(r["optimizer_numel"] for r in results) == ref["optimizer_numel"]  # none twice, none lost


@pytest.mark.parametrize(
    ("family", "zero_stage", "sequence_parallel", "overrides"),
    [("gpt", 1, False, None), ("llama", 3, True, None), ("llama", 1, False, {"num_kv_heads": 1})],
    ids=["gpt-zero1-t2-d2", "llama-zero3-t2-d2-sp", "llama-kv-replicated-zero1-t2-d2"],
)
@pytest.mark.world_size(4)
def test_zero_with_tensor_parallel_matches_single_process(dist_pool, family, zero_stage, sequence_parallel, overrides):
    """The third case: one KV head copied to both TP ranks, whose gradients are summed over tp; stage
    1 keeps whole gradients, so it runs where stages 2/3 are refused (the next test)."""
    devices = 4  # t=2 x d=2: each TP shard is sharded again over its dp group
    kwargs = {"zero_stage": zero_stage, "tensor_parallel_size": 2, "sequence_parallel": sequence_parallel}
    clip = {"gradient_clip_val": 0.5}
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs=kwargs,
        devices=devices,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        trainer_kwargs=clip,
        model_overrides=overrides,
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH, trainer_kwargs=clip, model_overrides=overrides)
    for result in results:
        assert_matches_reference(
            result, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
        )
    assert_holds_its_share(results, ref, 2, zero_stage, tp=2)  # sharded by t and again by d


@pytest.mark.parametrize(
    ("family", "zero_stage"),
    [
        ("flat_llama", 1),
        ("nanogpt_dict", 2),
        ("flat_llama", 3),
        ("nanogpt_dict", 3),
        ("nanogpt_dict_tied", 1),
        ("nanogpt_dict_tied", 2),
        ("nanogpt_dict_tied", 3),
        ("nanogpt_bypassed", 3),
    ],
)
def test_zero_on_blocks_held_by_the_lightning_module(dist_pool, family, zero_stage):
    """``self.layers = nn.ModuleList(...)`` on the LightningModule, and nanoGPT's ``transformer``
    ModuleDict: each block and each module outside them is a unit, never the container. nanoGPT's
    wte tied to an lm_head beside the ModuleDict: at stages 2-3 the two are one FSDP group (this
    was refused before), so the tie holds and the weight gets both gradients. A wrapper whose forward
    the step goes around (``self.net.inner(x)``) is no unit either: its embedding was never gathered."""
    results = dist_pool(2).run(
        fit_and_record,
        family,
        strategy_kwargs={"zero_stage": zero_stage},
        devices=2,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    assert_matches_reference(
        results[0], ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )
    assert_holds_its_share(results, ref, 2, zero_stage)


def _tie_after_zero() -> list[bool]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ptdp.data_parallel import apply_fsdp
    from tests.models import build_model

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = apply_fsdp(build_model("nanogpt_dict_tied"), mesh["dp"], 3)
    sharded = model.transformer.wte.weight
    return [model.lm_head.weight is sharded, sharded.to_local().shape[0] < model.lm_head.out_features]


def test_zero3_keeps_a_tie_across_units_on_one_sharded_weight(dist_pool):
    """wte (inside nanoGPT's ModuleDict) and lm_head (beside it) hold one sharded parameter."""
    assert dist_pool(2).run(_tie_after_zero) == [[True, True], [True, True]]


def fit_zero_with_replicated_kv_heads() -> None:
    """ZeRO-2 at t=2 on a Llama with one KV head (replicated over both TP ranks): refused at setup."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer, zoo_data
    from tests.models import build_model

    class Steps(L.Callback):
        started = 0

        def on_train_batch_start(self, *args) -> None:
            Steps.started += 1

    trainer = quiet_trainer(
        devices=4, strategy=PTDPStrategy(zero_stage=2, tensor_parallel_size=2), max_steps=1, callbacks=[Steps()]
    )
    try:
        trainer.fit(build_model("llama", num_kv_heads=1), zoo_data(4, 4000, 100))
    finally:
        assert Steps.started == 0, "a training step ran before the refusal"


@pytest.mark.world_size(4)
def test_zero_with_kv_heads_replicated_over_tp_is_refused_at_setup(dist_pool):
    from lightning_ptdp.testing import RankFailure

    refusal = (
        r"ValueError: zero_stage=2 with tensor_parallel_size=2 > the 1 key/value heads of "
        r"'net\.layers\.0\.attention\.wk': "
        r"each KV head is replicated over 2 TP ranks, and ZeRO cannot sum those copies' sharded gradients\. Use "
        r"zero_stage=0 or 1, or tensor_parallel_size in \[1\] \(dividing the KV heads\)"
    )
    with pytest.raises(RankFailure, match=refusal) as failure:
        dist_pool(4).run(fit_zero_with_replicated_kv_heads)
    assert "4 of 4 ranks failed" in str(failure.value) and "NotImplementedError" not in str(failure.value)


def fit_zero1_with_rank_dependent_group_order() -> None:
    """configure_optimizers lists the parameters in another order on rank 1 (a set would do that)."""
    import torch
    import torch.distributed as dist

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer, zoo_data
    from tests.models import build_model

    model = build_model("llama")
    params = list(model.parameters())
    ordered = params[::-1] if dist.get_rank() == 1 else params
    model.configure_optimizers = lambda: torch.optim.AdamW(ordered, lr=1e-2)
    trainer = quiet_trainer(devices=2, strategy=PTDPStrategy(zero_stage=1), max_steps=1)
    trainer.fit(model, zoo_data(4, 4000, 100))


def test_zero1_refuses_groups_listed_in_another_order_on_another_rank(dist_pool):
    """torch's partition follows the group order: ranks disagreeing would swap parameters silently."""
    from lightning_ptdp.testing import RankFailure

    with pytest.raises(
        RankFailure, match=r"(?s)2 of 2 ranks failed.*list the parameters in a different order on different"
    ):
        dist_pool(2).run(fit_zero1_with_rank_dependent_group_order)
