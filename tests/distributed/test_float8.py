"""float8 training (torchao's tensorwise recipe, emulated on CPU) under every parallel dimension against
one process running the same recipe: per-step losses and the weights after several optimizer steps.

The reference converts the same Linears with torchao itself (the blocks' Linears), not through ptdp.
Its noise floor is how far the one-process float8 run moves when only its batch is cut into 2 and 4
equal parts (``accumulate_grad_batches``): each part's activations and gradients get their own
float8 scales, exactly the change a d=2 replica, a pipeline microbatch or a TP rank's shard (its own
weight scale) makes. A parallel run must stay within a multiple of that floor (test_bf16's rule);
a run one optimizer step behind must not, and neither may the same layout without float8.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from tests.distributed.test_bf16 import FLOOR_PARTS, GLOBAL_BATCH, MODEL, STEPS, bf16_mismatches, noise_floor
from tests.fit_utils import fit_and_record

pytest.importorskip("torchao.float8")

FLOAT8 = {"recipe": "tensorwise", "emulate": True, "power_of_2_scales": True}
LAYOUTS = {
    "d2": {},
    "d2-zero3": {"zero_stage": 3},  # power-of-2 scales: weights all-gathered in fp32 (see the zero-3 test below)
    "t2": {"tensor_parallel_size": 2},
    "t2-sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "p2": {"pipeline_parallel_size": 2, "micro_batch_size": 2},
    "c2": {"context_parallel_size": 2},
    "d2-zero1": {"zero_stage": 1},
    "t2-recompute": {"tensor_parallel_size": 2, "activation_checkpointing": "full"},
    "t2-sp-compiled": {"tensor_parallel_size": 2, "sequence_parallel": True, "compile": {"backend": "aot_eager"}},
    "d2-e2": {"expert_parallel_size": 2},
}


FAMILY = {"d2-e2": "hf_mixtral"}  # transformers Mixtral: attention in float8, router and stacked experts precise


def convert_blocks(model: torch.nn.Module) -> None:
    """The reference's float8: torchao's own conversion of every Linear in the GPT's blocks."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True)
    convert_to_float8_training(model.gpt.blocks, config=config)


def convert_attention(model: torch.nn.Module) -> None:
    """The MoE reference's float8: torchao's conversion of the attention Linears (Mixtral's router is a
    Linear of one output per expert, its experts stacked weights: both stay precise in ptdp)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True)
    convert_to_float8_training(model.net, module_filter_fn=lambda _, name: ".self_attn." in f".{name}", config=config)


PREPARE = {"gpt": convert_blocks, "hf_mixtral": convert_attention}


def _fit(family: str = "gpt", **kwargs) -> dict:
    overrides = MODEL if family == "gpt" else None
    return fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH, model_overrides=overrides, **kwargs)


@functools.lru_cache(maxsize=None)
def reference(family: str = "gpt") -> tuple[dict, dict]:
    ref = _fit(family, prepare=PREPARE[family])
    partitioned = [_fit(family, prepare=PREPARE[family], accumulate=parts) for parts in FLOOR_PARTS]
    return ref, noise_floor(ref, partitioned)


def _run(pool, layout: str, float8: bool) -> list[dict]:
    kwargs = {**LAYOUTS[layout], **({"float8": FLOAT8} if float8 else {})}
    family = FAMILY.get(layout, "gpt")
    return pool(2).run(
        fit_and_record,
        family,
        strategy_kwargs=kwargs,
        devices=2,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        model_overrides=MODEL if family == "gpt" else None,
    )


def _mismatches(results: list[dict], ref: dict, floor: dict) -> list[str]:
    with_state = [result for result in results if result["state"]]
    assert with_state, "no rank returned the trained weights"
    found = []
    for result in results:
        found += bf16_mismatches({**result, "state": result["state"] or with_state[0]["state"]}, ref, floor)
    return found


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float8_matches_single_process_float8_within_noise_floor(dist_pool, layout):
    ref, floor = reference(FAMILY.get(layout, "gpt"))
    results = _run(dist_pool, layout, float8=True)
    if "compile" in LAYOUTS[layout]:
        assert results[0]["compiled_graphs"] > 0
    found = _mismatches(results, ref, floor)
    assert not found, f"floor: loss {floor['loss']:.1e}, weights {floor['weights']:.1e}; " + "; ".join(found)


@pytest.mark.world_size(2)
def test_the_check_fails_the_layout_without_float8(dist_pool):
    """Negative control: t2 in full precision is not the float8 run (a layout that silently skipped
    float8 on its shards would fail the same way)."""
    ref, floor = reference()
    found = _mismatches(_run(dist_pool, "t2", float8=False), ref, floor)
    assert any(line.startswith("weight") for line in found), found


class Float8AllGatherCheck(L.Callback):
    """Fails the run unless every float8 Linear's FSDP2 shard is torchao's float8-all-gather weight."""

    def on_train_start(self, trainer, pl_module) -> None:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        layers = [m for m in pl_module.modules() if isinstance(m, Float8Linear)]
        assert layers, "no Float8Linear in the model"
        for layer in layers:
            local = layer.weight.to_local() if hasattr(layer.weight, "to_local") else layer.weight
            assert isinstance(local, WeightWithDynamicFloat8CastTensor), type(local)


@pytest.mark.world_size(2)
def test_zero3_gathers_weights_in_float8_and_matches_d2(dist_pool):
    """ZeRO-3 with the tensorwise recipe all-gathers the weights in float8, their scale all-reduced
    over the shard group: the whole tensor's scale, as d2 casts its whole weights. The two runs are the
    same computation and must agree exactly (measured: bitwise); the ZeRO-3 run in full precision differs
    by 15% of the update."""
    float8 = {"recipe": "tensorwise", "emulate": True}
    common = {"devices": 2, "steps": STEPS, "global_batch": GLOBAL_BATCH, "model_overrides": MODEL}
    d2 = dist_pool(2).run(fit_and_record, "gpt", strategy_kwargs={"float8": float8}, **common)
    zero3 = dist_pool(2).run(
        fit_and_record,
        "gpt",
        strategy_kwargs={"zero_stage": 3, "float8": float8},
        callbacks=[Float8AllGatherCheck()],
        **common,
    )
    full = dist_pool(2).run(fit_and_record, "gpt", strategy_kwargs={"zero_stage": 3}, **common)
    d2_state = next(r["state"] for r in d2 if r["state"])
    for run, same in ((zero3, True), (full, False)):
        state = next(r["state"] for r in run if r["state"])
        close = all(torch.allclose(state[k], v, rtol=1e-6, atol=1e-7) for k, v in d2_state.items())
        assert close == same and (run[0]["losses"] == d2[0]["losses"]) == same
