"""Pipeline parallelism (alone and with tensor, sequence and data parallelism) against the
single-process run of the same model, data and seed, through the ordinary Trainer."""

from __future__ import annotations

import pytest
import torch

from tests.fit_utils import assert_ranks_match_reference, fit_and_record, relative_error

# fp32. A pipeline computes each microbatch's loss exactly as the whole batch's rows would be,
# then sums microbatch gradients: the same values up to summation order. Measured: losses within
# 1e-7 relative, gradients ~1e-7 of their norm.
LOSS_RTOL = 1e-5
GRAD_REL = 1e-5
# Adam divides each element's step by sqrt(v): elements whose gradient is nearly zero (nanoGPT's
# c_attn holds the key weights, whose gradient nearly cancels) turn round-off into update noise.
# Measured up to 2.3e-4 of the 4-step update there, ~1e-6 elsewhere.
UPDATE_REL = 1e-3
# Key-projection biases get an exactly-zero gradient in exact arithmetic: pure round-off.
NOISE_DRIVEN = ("attn.key.bias",)  # nanoGPT's fused c_attn bias: only its key third is left out (fit_utils)
STEPS, GLOBAL_BATCH = 4, 8


def _check(results: list[dict], ref: dict) -> None:
    assert_ranks_match_reference(
        results, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )


LAYOUTS = [
    # (family, devices, layers, strategy kwargs)
    ("nanogpt", 2, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}),
    ("llama", 2, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "gpipe"}),
    ("nanogpt", 2, 4, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 1}),
    (
        "llama",
        2,
        4,
        {
            "pipeline_parallel_size": 2,
            "virtual_pipeline_size": 2,
            "micro_batch_size": 2,
            "pipeline_schedule": "zero_bubble",
        },
    ),
    (
        "gpt",
        2,
        4,
        {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2, "pipeline_schedule": "gpipe"},
    ),
    ("gpt", 4, 4, {"pipeline_parallel_size": 4, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}),
    ("nanogpt", 4, 8, {"pipeline_parallel_size": 4, "virtual_pipeline_size": 2, "micro_batch_size": 1}),
    (
        "gpt",
        4,
        2,
        {
            "pipeline_parallel_size": 2,
            "tensor_parallel_size": 2,
            "sequence_parallel": True,
            "micro_batch_size": 2,
            "activation_checkpointing": "full",
        },
    ),
    ("nanogpt", 4, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 1}),  # d=2
    ("tuple_llama", 2, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 2}),  # blocks return (x, None, weights)
    (
        "llama",
        8,
        2,
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True, "micro_batch_size": 1},
    ),  # d=2
]


def _layout_id(case: tuple) -> str:
    family, devices, _, kw = case
    t, p = kw.get("tensor_parallel_size", 1), kw["pipeline_parallel_size"]
    extra = "-sp" if kw.get("sequence_parallel") else ""
    return f"{family}-t{t}p{p}d{devices // (t * p)}v{kw.get('virtual_pipeline_size', 1)}-{kw.get('pipeline_schedule', 'interleaved_1f1b')}{extra}"


@pytest.mark.parametrize(
    ("family", "devices", "layers", "strategy_kwargs"), LAYOUTS, ids=[_layout_id(c) for c in LAYOUTS]
)
def test_pipeline_matches_single_process(dist_pool, family, devices, layers, strategy_kwargs):
    overrides = {"num_layers": layers}
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs=strategy_kwargs,
        devices=devices,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        model_overrides=overrides,
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH, model_overrides=overrides)
    _check(results, ref)


def fit_validate_predict(strategy_kwargs: dict | None, devices: int, ckpt: str | None = None) -> dict:
    """The Lightning features a pipeline must keep: sanity check and validation during fit,
    gradient accumulation, clipping by the global norm, a torchmetrics Metric updated in
    validation_step and logged at epoch end, trainer.validate, trainer.predict, save_checkpoint."""
    import lightning as L

    from tests.fit_utils import LossRecorder, quiet_trainer, strategy_from, use_distributed_order, zoo_data
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("gpt", num_layers=4)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    datamodule = zoo_data(GLOBAL_BATCH, 13 * GLOBAL_BATCH * 33, 2 * GLOBAL_BATCH * 33)
    if strategy_kwargs is None:
        use_distributed_order(datamodule, 0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy_from(strategy_kwargs),
        max_steps=6,
        callbacks=[recorder],
        limit_val_batches=2,
        num_sanity_val_steps=1,
        val_check_interval=4,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    trainer.fit(model, datamodule)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    validated = trainer.validate(model, datamodule, verbose=False)[0]
    predictions = torch.cat(trainer.predict(model, dataloaders=datamodule.val_dataloader()))
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
    state = {k: v.detach().cpu().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
    return {
        "initial": initial,
        "losses": recorder.losses,
        "logged": logged,
        "validated": validated,
        "predictions": predictions,
        "state": state,
    }


@pytest.mark.world_size(2)
def test_lightning_features_hold_under_pipeline(dist_pool, tmp_path):
    ckpt = str(tmp_path / "pipeline.ckpt")
    kwargs = {
        "pipeline_parallel_size": 2,
        "virtual_pipeline_size": 2,
        "micro_batch_size": 2,
        "checkpoint_format": "full",
    }
    results = dist_pool(2).run(fit_validate_predict, kwargs, 2, ckpt)
    ref = fit_validate_predict(None, 1)
    assert len(ref["losses"]) == 12  # 6 optimizer steps of 2 accumulated batches
    for result in results:  # every pipeline rank reports the global values, not its stage's
        assert result["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
        assert result["logged"].keys() == ref["logged"].keys() >= {"train_loss", "val_loss", "val_perplexity"}
        for name, value in ref["logged"].items():
            assert result["logged"][name] == pytest.approx(value, rel=LOSS_RTOL), name
        assert result["validated"] == pytest.approx(ref["validated"], rel=LOSS_RTOL)
        assert torch.equal(result["predictions"], ref["predictions"])
    saved = torch.load(ckpt, weights_only=False)["state_dict"]  # loads on one device, no process group
    assert saved.keys() == ref["state"].keys()
    for name, expected in ref["state"].items():
        if not name.endswith(NOISE_DRIVEN):
            err = relative_error(saved[name], expected, expected - ref["initial"][name])
            assert err <= UPDATE_REL, f"{name}: error {err:.1e} of its update"


def one_step_measured(strategy_kwargs: dict, devices: int, family: str = "gpt") -> dict:
    """One training step; per rank: bytes each forward send carried, the schedule's measured
    activations in flight on each local stage, the peak bytes autograd held for backward, and the
    tensors still holding a graph once the step is done."""
    import gc
    import weakref

    import lightning as L
    from torch.distributed.pipelining import stage as torch_stage

    from tests.fit_utils import quiet_trainer, strategy_from, zoo_data
    from tests.models import build_model

    sent: list[int] = []
    live = {"now": 0, "peak": 0}
    original = torch_stage._PipelineStageBase.get_fwd_send_ops

    def counting(self, chunk_id):
        ops = original(self, chunk_id)
        sent.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops))
        return ops

    class Peak(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            params = {p.data_ptr() for p in pl_module.parameters()}

            def pack(tensor):
                if tensor.data_ptr() not in params:
                    size = tensor.numel() * tensor.element_size()
                    live["now"] += size
                    live["peak"] = max(live["peak"], live["now"])
                    weakref.finalize(tensor, lambda s=size: live.__setitem__("now", live["now"] - s))
                return tensor

            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.hooks.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.hooks.__exit__(None, None, None)
            gc.collect()
            live["graphs"] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)

    torch_stage._PipelineStageBase.get_fwd_send_ops = counting
    try:
        L.seed_everything(0, verbose=False)
        trainer = quiet_trainer(
            devices=devices, strategy=strategy_from(strategy_kwargs), max_steps=1, callbacks=[Peak()]
        )
        trainer.fit(build_model(family, num_layers=2), zoo_data(GLOBAL_BATCH, 2 * GLOBAL_BATCH * 33, 33))
    finally:
        torch_stage._PipelineStageBase.get_fwd_send_ops = original
    engine = trainer.strategy.pipeline
    timeline = engine.timeline
    return {
        "sent": [b for b in sent if b],
        "rank": engine.split.rank,
        "in_flight": {c: timeline.max_in_flight(c) for c in engine.split.local_chunks},
        "peak_bytes": live["peak"],
        "graphs_after_step": live["graphs"],
    }


@pytest.mark.world_size(4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_each_tp_rank_sends_its_share_of_the_activation(dist_pool, sequence_parallel):
    """Between stages, with sequence parallelism, each TP rank sends b*s*h/t values per
    microbatch (the scatter/gather optimisation falls out of SP); without it, all b*s*h."""
    t, b, s, h = 2, 2, 32, 32
    kwargs = {
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": t,
        "micro_batch_size": b,
        "sequence_parallel": sequence_parallel,
    }
    results = dist_pool(4).run(one_step_measured, kwargs, 4)
    expected = b * s * h * 4 // (t if sequence_parallel else 1)  # fp32 bytes
    for result in results:
        if result["rank"] == 0:  # first stage: one send per microbatch
            assert result["sent"] == [expected] * (GLOBAL_BATCH // b)
        else:
            assert result["sent"] == []


@pytest.mark.world_size(2)
def test_1f1b_holds_at_most_p_microbatches_where_gpipe_holds_m(dist_pool):
    """First stage, m = 8 microbatches on p = 2 stages: 1F1B starts backward after p forwards,
    GPipe only after all m, measured from the executed schedule and from the bytes autograd holds."""
    common = {"pipeline_parallel_size": 2, "micro_batch_size": 1}
    f1b_ranks = dist_pool(2).run(one_step_measured, {**common, "pipeline_schedule": "1f1b"}, 2)
    gpipe = dist_pool(2).run(one_step_measured, {**common, "pipeline_schedule": "gpipe"}, 2)[0]
    f1b = f1b_ranks[0]
    assert f1b["in_flight"] == {0: 2} and gpipe["in_flight"] == {0: 8}
    # no graph outlives the step: a logged loss or torch's kept stage outputs held the last stage's
    # microbatch graphs (and the chunked loss's saved gradients) until the next step
    assert [r["graphs_after_step"] for r in f1b_ranks] == [0, 0]
    # activation memory follows: about p/m = 1/4 of GPipe's (plus what is not per-microbatch)
    assert f1b["peak_bytes"] < 0.35 * gpipe["peak_bytes"], (f1b["peak_bytes"], gpipe["peak_bytes"])


def bad_pipeline_fits() -> list[str]:
    """Each bad configuration must fail on every rank before any pipeline transfer, leaving the
    process group usable: a good fit runs after them."""
    from tests.fit_utils import fit_and_record

    cases = [
        ({"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"}, 2),  # b=None: m=1 < p
        ({"pipeline_parallel_size": 2, "micro_batch_size": 3}, 2),  # 3 does not divide 8
        ({"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2}, 3),  # 3 blocks, 4 chunks
    ]
    messages = []
    for kwargs, layers in cases:
        try:
            fit_and_record("gpt", strategy_kwargs=kwargs, devices=2, steps=1, model_overrides={"num_layers": layers})
            messages.append("no error")
        except Exception as error:  # noqa: BLE001 - the message is what the test checks
            messages.append(str(error))
    good = fit_and_record(
        "gpt", strategy_kwargs={"pipeline_parallel_size": 2, "micro_batch_size": 2}, devices=2, steps=1
    )
    return [*messages, f"good run: {len(good['losses'])} step"]


@pytest.mark.world_size(2)
def test_bad_pipeline_input_fails_before_any_transfer(dist_pool):
    for messages in dist_pool(2).run(bad_pipeline_fits):
        assert (
            "pipeline_schedule='1f1b' cannot run m=1 microbatches (per-replica batch 8 / micro_batch_size 8)"
            in messages[0]
        )
        assert "counts that work: [2, 3, 4" in messages[0]
        assert (
            "micro_batch_size=3 does not divide the per-replica batch of 8 samples; choose one of [1, 2, 4, 8]"
            in messages[1]
        )
        assert (
            "3 transformer blocks cannot be cut into pipeline_parallel_size(2) * virtual_pipeline_size(2) = 4"
            in messages[2]
        )
        assert "virtual_pipeline_size in [] " not in messages[2] and "one of [3]" in messages[2]
        assert messages[3] == "good run: 1 step"


ZERO_LAYOUTS = [
    ("nanogpt", 4, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "zero_stage": 1}),
    ("llama", 4, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "zero_stage": 2}),
    ("nanogpt", 4, {"pipeline_parallel_size": 2, "micro_batch_size": 1, "zero_stage": 3}),
    (
        "gpt",
        8,
        {
            "pipeline_parallel_size": 2,
            "tensor_parallel_size": 2,
            "sequence_parallel": True,
            "micro_batch_size": 2,
            "zero_stage": 1,
        },
    ),
    ("llama", 8, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "micro_batch_size": 1, "zero_stage": 3}),
    ("gpt", 8, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "micro_batch_size": 2, "zero_stage": 2}),
]


@pytest.mark.parametrize(
    ("family", "devices", "strategy_kwargs"),
    ZERO_LAYOUTS,
    ids=[f"{c[0]}-{_layout_id((c[0], c[1], 2, c[2]))}-zero{c[2]['zero_stage']}" for c in ZERO_LAYOUTS],
)
def test_zero_composes_with_pipeline(dist_pool, family, devices, strategy_kwargs):
    """ZeRO over d=2 inside each pipeline stage (FSDP2 on the stage's blocks), weights tied across
    stages summed shard by shard; the same tolerances as without ZeRO (reduce-scatter sums in
    another order than the reference, nothing else)."""
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs=strategy_kwargs,
        devices=devices,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    _check(results, ref)
