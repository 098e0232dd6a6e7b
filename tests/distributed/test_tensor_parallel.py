"""Tensor (+ sequence) parallelism against the single-process model, for three model families."""

from __future__ import annotations

import pytest
import torch

from tests.fit_utils import assert_matches_reference, fit_and_record, relative_error, strategy_from, zoo_data
from tests.tp_utils import reference_step, token_batch, tp_step

# fp32. A TP rank computes the same sums as the reference split into t partial sums, so values
# differ by round-off only: measured losses <= 1e-6 relative, gradients ~1e-7 of their norm.
LOSS_RTOL = 1e-5
GRAD_REL = 1e-5
# Key-projection biases get an exactly-zero gradient in exact arithmetic (softmax is shift
# invariant per query row): their "gradient" is round-off noise, compared for nothing. nanoGPT's
# fused c_attn bias holds the key bias as its middle third: that third alone is left out (fit_utils).
NOISE_DRIVEN = ("attn.key.bias",)
FAMILIES = ("gpt", "nanogpt", "llama")
LAYERS = 2  # the zoo's blocks per model


def _check_against_reference(result: dict, ref: dict) -> None:
    assert result["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
    assert result["grads"].keys() == ref["grads"].keys()
    for name, expected in ref["grads"].items():
        if not name.endswith(NOISE_DRIVEN):
            err = relative_error(result["grads"][name], expected, expected)
            assert err <= GRAD_REL, f"{name}: gradient relative error {err:.1e}"
    for name, expected in ref["state"].items():  # consolidation gives back the original tensors
        assert torch.equal(result["state"][name], expected), f"consolidated {name} differs"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_matches_single_process(dist_pool, tp, sequence_parallel, family):
    results = dist_pool(tp).run(tp_step, family, sequence_parallel, count=True)
    ref = reference_step(family)
    for result in results:
        _check_against_reference(result, ref)
    shapes = results[0]["local_shapes"]
    heads = 4  # every zoo model has 4 query heads; llama has 2 key/value heads
    assert results[0]["attention_heads"] == [heads // tp] * LAYERS  # the attention core runs on a/t heads
    assert results[0]["logits_local_vocab"] == 64 // tp  # no rank holds full-vocabulary logits
    for name, full in ref["state"].items():
        local = shapes.get(name)
        if local is None or not name.endswith("weight") or len(full.shape) != 2:
            continue
        if "attention.wk" in name or "attention.wv" in name:  # GQA: 2 KV heads, replicated when t > 2
            assert local[0] == full.shape[0] // min(tp, 2)
        elif any(k in name for k in ("attn", "attention", "mlp", "c_fc", "w1", "w2", "w3", "c_proj")):
            assert local[0] * local[1] * tp == full.numel(), f"{name}: {local} is not 1/{tp} of {tuple(full.shape)}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_collectives_are_megatrons(dist_pool, tp, sequence_parallel):
    """Per layer and microbatch: 2 all-reduces forward and 2 backward, or with sequence
    parallelism 2 all-gathers + 2 reduce-scatters each way, plus in backward 2 all-gathers of the
    region inputs' saved 1/t shards (one per region, shared by its Linears; Megatron's trade of
    activation memory for communication). The model adds: the vocab-parallel
    embedding (1 all-reduce), cross-entropy (2: max, then target logit and exp-sum together),
    the LM head's input copy (1 backward all-reduce) and, with SP, leaving the blocks (1 gather
    forward, 1 gather backward for entering them)."""
    result = dist_pool(tp).run(tp_step, "llama", sequence_parallel, count=True)[0]
    fwd, bwd = result["forward_counts"], result["backward_counts"]
    if sequence_parallel:
        assert fwd == {"all_gather_into_tensor": 2 * LAYERS + 1, "reduce_scatter_tensor": 2 * LAYERS, "all_reduce": 3}
        assert bwd == {"all_gather_into_tensor": 4 * LAYERS + 1, "reduce_scatter_tensor": 2 * LAYERS, "all_reduce": 1}
    else:
        assert fwd == {"all_reduce": 2 * LAYERS + 3}
        assert bwd == {"all_reduce": 2 * LAYERS + 1}


@pytest.mark.parametrize(
    ("tp", "padding_idx"), [(2, None), (2, 0), (4, 63)], ids=["t2-frequent-id", "t2-id0", "t4-last-id"]
)
def test_embedding_padding_idx_matches_single_process(dist_pool, tp, padding_idx):
    """nn.Embedding(padding_idx=...) as transformers builds it from pad_token_id: the rank owning the
    row keeps its gradient exactly zero; the other ranks never see the id as theirs."""
    inputs, _ = token_batch()
    if padding_idx is None:  # an id the batch really holds, in the middle of rank 0's rows
        padding_idx = int(torch.bincount(inputs.flatten(), minlength=64)[:32].argmax())
    inputs[0, :4] = padding_idx  # the batch holds the padding id whatever the draw
    overrides = {"padding_idx": padding_idx}
    results = dist_pool(tp).run(tp_step, "llama", False, overrides, inputs=inputs)
    ref = reference_step("llama", overrides, inputs=inputs)
    for result in results:
        _check_against_reference(result, ref)
        grad = result["grads"]["tok_embeddings.weight"]
        assert torch.equal(grad[padding_idx], torch.zeros(32)) and grad.abs().sum() > 0


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2)], ids=["t2-kv-split", "t4-kv-replicated"])
def test_kv_repeat_count_read_from_shapes_matches_single_process(dist_pool, tp, kv_heads):
    """``repeat = q.shape[1] // k.shape[1]`` then ``repeat_interleave(repeat, dim=1)``: on each rank the
    count comes out of its own heads (4/t q over 2/t KV heads, or 1 q over a replicated KV head)."""
    overrides = {"repeat_from_shapes": True, "num_kv_heads": kv_heads}
    results = dist_pool(tp).run(tp_step, "llama", False, overrides)
    ref = reference_step("llama", overrides)
    for result in results:
        _check_against_reference(result, ref)


def test_vocab_parallel_embedding_refuses_max_norm():
    from lightning_ptdp.tensor_parallel import TPGroup
    from lightning_ptdp.tensor_parallel.layers import VocabParallelEmbedding

    with pytest.raises(
        ValueError,
        match=r"embedding of 64 rows: max_norm=1.0 is not supported .* build the nn.Embedding "
        r"without it",
    ):
        VocabParallelEmbedding(torch.nn.Embedding(64, 8, max_norm=1.0), TPGroup(None, 2, 0))


@pytest.mark.world_size(2)
def test_vocab_not_divisible_is_padded_and_masked(dist_pool):
    overrides = {"vocab_size": 63}
    results = dist_pool(2).run(tp_step, "gpt", False, overrides)
    ref = reference_step("gpt", overrides)
    for result in results:
        _check_against_reference(result, ref)
    assert results[0]["logits_local_vocab"] == 32


STEPS, GLOBAL_BATCH = 20, 8
UPDATE_REL = 1e-4  # as in test_data_parallel: Adam amplifies round-off in tiny gradients


@pytest.mark.parametrize(
    ("family", "devices", "strategy_kwargs"),
    [
        ("gpt", 2, {"tensor_parallel_size": 2, "sequence_parallel": True, "activation_checkpointing": "selective"}),
        ("nanogpt", 4, {"tensor_parallel_size": 4, "activation_checkpointing": "full"}),
        ("llama", 4, {"tensor_parallel_size": 2, "sequence_parallel": True, "activation_checkpointing": "full"}),
    ],
    ids=["gpt-t2-sp-selective", "nanogpt-t4-full", "llama-t2-d2-sp-full"],
)
def test_trainer_fit_matches_single_process(dist_pool, family, devices, strategy_kwargs):
    results = dist_pool(devices).run(
        fit_and_record, family, strategy_kwargs=strategy_kwargs, devices=devices, steps=STEPS, global_batch=GLOBAL_BATCH
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    for result in results:
        assert_matches_reference(
            result, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
        )


# fp64 rounds 2**29 times finer than fp32: the fp32 tolerances times 1e-6 still leave 500x margin over its
# round-off, while a single fp32 rounding inside the layout (measured 5e-8 on the losses) fails them
FP64_REL = 1e-11


@pytest.mark.world_size(2)
def test_fp64_training_stays_fp64_through_the_vocab_split_loss_and_split_norms(dist_pool):
    """precision="64-true": the vocab-parallel cross entropy and a norm over split features compute in
    the input's precision (they upcast bf16 to fp32, and never round fp64 down to it)."""
    kwargs = {"tensor_parallel_size": 2, "sequence_parallel": True}
    fp64 = {"precision": "64-true"}
    results = dist_pool(2).run(fit_and_record, "llama", strategy_kwargs=kwargs, devices=2, steps=3, trainer_kwargs=fp64)
    ref = fit_and_record("llama", steps=3, trainer_kwargs=fp64)
    for result in results:
        assert_matches_reference(
            result, ref, loss_rtol=FP64_REL, grad_rel=FP64_REL, update_rel=FP64_REL * 10, skip=NOISE_DRIVEN
        )


@pytest.mark.world_size(2)
def test_explicit_plan_matches_single_process(dist_pool):
    plan = {"gpt.token_embedding": "vocab_embedding", "gpt.lm_head": "vocab_head"}
    for i in range(LAYERS):
        for name in ("query", "key", "value"):
            plan[f"gpt.blocks.{i}.attn.{name}"] = "colwise"
        plan[f"gpt.blocks.{i}.attn.proj"] = "rowwise"
        plan[f"gpt.blocks.{i}.mlp.fc_in"] = "colwise"
        plan[f"gpt.blocks.{i}.mlp.fc_out"] = "rowwise"
    kwargs = {"tensor_parallel_size": 2}
    results = dist_pool(2).run(
        fit_and_record, "gpt", strategy_kwargs=kwargs, devices=2, steps=5, global_batch=GLOBAL_BATCH, tp_plan=plan
    )
    ref = fit_and_record("gpt", steps=5, global_batch=GLOBAL_BATCH)
    assert_matches_reference(
        results[0], ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )


CLIP = {"gradient_clip_val": 0.05}  # well below the measured gradient norms (~0.3-2): every step clips


@pytest.mark.parametrize(
    ("family", "devices", "strategy_kwargs"),
    [
        ("llama", 4, {"tensor_parallel_size": 4}),  # KV heads replicated: counted once in the norm
        ("gpt", 2, {"tensor_parallel_size": 2, "sequence_parallel": True}),  # SP norms: summed, then counted once
    ],
    ids=["llama-t4", "gpt-t2-sp"],
)
def test_gradient_clipping_uses_the_global_norm(dist_pool, family, devices, strategy_kwargs):
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs=strategy_kwargs,
        devices=devices,
        steps=10,
        global_batch=GLOBAL_BATCH,
        trainer_kwargs=CLIP,
    )
    ref = fit_and_record(family, steps=10, global_batch=GLOBAL_BATCH, trainer_kwargs=CLIP)
    unclipped = fit_and_record(family, steps=10, global_batch=GLOBAL_BATCH)
    # clipping really changed training: AdamW is nearly scale-invariant, so clipping moves the loss
    # only ~1e-3 in 10 steps, but that is still 30x the loss tolerance below
    assert abs(ref["losses"][-1] - unclipped["losses"][-1]) > 3e-4
    assert_matches_reference(
        results[0], ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )


def fit_and_save(path: str) -> dict:
    """Train the GPT at t=2 for a few steps and save a full checkpoint (rank 0 writes it; the
    sharded default is tested in test_sharded_checkpoint.py against this format)."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("gpt")
    data = zoo_data(4, 5000, 1000)
    strategy = PTDPStrategy(tensor_parallel_size=2, checkpoint_format="full")  # one file of whole tensors
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=3)
    trainer.fit(model, data)
    trainer.save_checkpoint(path)
    return {k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


def validate_checkpoint(path: str, devices: int, strategy_kwargs: dict | None) -> float:
    from tests.fit_utils import quiet_trainer
    from tests.models import build_model

    model = build_model("gpt")
    data = zoo_data(4, 5000, 1000)
    strategy = strategy_from(strategy_kwargs)
    trainer = quiet_trainer(devices=devices, strategy=strategy, limit_val_batches=4)
    return trainer.validate(model, data, ckpt_path=path, verbose=False)[0]["val_loss"]


@pytest.mark.world_size(2)
def test_tp_checkpoint_is_the_plain_model_and_loads_on_other_layouts(dist_pool, tmp_path):
    path = str(tmp_path / "tp2.ckpt")
    consolidated = dist_pool(2).run(fit_and_save, path)[0]
    checkpoint = torch.load(path, weights_only=False)
    from tests.models import build_model

    plain = build_model("gpt")
    plain.load_state_dict(checkpoint["state_dict"])  # the original keys and shapes: no process group needed
    for name, value in plain.state_dict().items():
        assert torch.equal(value, consolidated[name]), name
    single = validate_checkpoint(path, 1, None)
    assert dist_pool(2).run(validate_checkpoint, path, 2, {"tensor_parallel_size": 2})[0] == pytest.approx(
        single, rel=1e-5
    )


KERNEL_LOSS_RTOL, KERNEL_GRAD_REL = 1e-4, 1e-4  # fp32 Triton kernels vs torch (tests/kernels tolerances)


@pytest.mark.world_size(2)
def test_triton_kernels_run_on_each_ranks_heads_and_bias_shard(dist_pool):
    """kernels='triton' (CPU interpreter) after the TP rewrite: the blocks' own modules are
    routed, flash attention runs on the rank's a/t heads and bias-GeLU on its bias shard."""
    overrides = {"hidden_size": 64}  # head size 16: the smallest the attention kernel takes
    results = dist_pool(2).run(tp_step, "gpt", True, overrides, False, "triton")
    ref = reference_step("gpt", overrides)
    report = results[0]["kernel_report"]
    assert "blocks.0.attn" in report and "blocks.0.mlp.fc_in -> blocks.0.mlp.gelu" in report, report
    for result in results:
        assert result["kernel_calls"] == {"flash_attention": LAYERS, "bias_gelu": LAYERS}  # forward, each layer
        assert result["loss"] == pytest.approx(ref["loss"], rel=KERNEL_LOSS_RTOL)
        for name, expected in ref["grads"].items():
            if not name.endswith(NOISE_DRIVEN):
                assert relative_error(result["grads"][name], expected, expected) <= KERNEL_GRAD_REL, name


def predict_tokens(devices: int, strategy_kwargs: dict | None) -> torch.Tensor:
    """``trainer.predict`` with the recipe's predict_step (argmax over the vocabulary)."""
    import lightning as L

    from tests.fit_utils import quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("gpt")
    data = zoo_data(4, 1000, 400)
    strategy = strategy_from(strategy_kwargs)
    trainer = quiet_trainer(devices=devices, strategy=strategy, limit_predict_batches=2)
    return torch.cat(trainer.predict(model, data))


@pytest.mark.world_size(2)
def test_predict_gathers_logits_only_when_the_user_needs_them(dist_pool):
    # argmax needs every vocabulary entry: the logits are gathered for it (and only for it)
    results = dist_pool(2).run(predict_tokens, 2, {"tensor_parallel_size": 2})
    expected = predict_tokens(1, None)
    for tokens in results:
        assert torch.equal(tokens, expected)
