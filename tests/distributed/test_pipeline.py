"""Pipeline parallelism (alone and with tensor, sequence and data parallelism) against the
single-process run of the same model, data and seed, through the ordinary Trainer."""

from __future__ import annotations

import pytest
import torch

from tests.fit_utils import assert_matches_reference, fit_and_record, relative_error

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
NOISE_DRIVEN = ("attn.key.bias", "attn.c_attn.bias")
STEPS, GLOBAL_BATCH = 4, 8


def _check(results: list[dict], ref: dict) -> None:
    """Every rank: losses and final (gathered) weights as the reference; the gradients each rank
    holds as the reference's (a weight tied across stages under its stage's own name)."""
    seen = set()
    for result in results:
        assert_matches_reference(
            {**result, "first_grads": {}}, {**ref, "first_grads": {}},
            loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN,
        )
        assert result["state"].keys() == ref["state"].keys()
        for name, grad in result["first_grads"].items():
            if name not in ref["first_grads"]:  # a tied weight named by the last stage's module
                name = next(k for k in ref["first_grads"] if torch.equal(ref["initial"][k], result["initial"][name]))
            seen.add(name)
            if not name.endswith(NOISE_DRIVEN):
                err = relative_error(grad, ref["first_grads"][name], ref["first_grads"][name])
                assert err <= GRAD_REL, f"gradient of {name}: relative error {err:.2e}"
    assert seen == set(ref["first_grads"]), "some gradients are held by no rank"


LAYOUTS = [
    # (family, devices, layers, strategy kwargs)
    ("nanogpt", 2, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}),
    ("llama", 2, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "gpipe"}),
    ("nanogpt", 2, 4, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 1}),
    ("llama", 2, 4, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2,
                     "pipeline_schedule": "zero_bubble"}),
    ("gpt", 2, 4, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2,
                   "pipeline_schedule": "gpipe"}),
    ("gpt", 4, 4, {"pipeline_parallel_size": 4, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}),
    ("nanogpt", 4, 8, {"pipeline_parallel_size": 4, "virtual_pipeline_size": 2, "micro_batch_size": 1}),
    ("gpt", 4, 2, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True,
                   "micro_batch_size": 2, "activation_checkpointing": "full"}),
    ("nanogpt", 4, 2, {"pipeline_parallel_size": 2, "micro_batch_size": 1}),  # d=2
    ("llama", 8, 2, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True,
                     "micro_batch_size": 1}),  # d=2
]


def _layout_id(case: tuple) -> str:
    family, devices, _, kw = case
    t, p = kw.get("tensor_parallel_size", 1), kw["pipeline_parallel_size"]
    extra = "-sp" if kw.get("sequence_parallel") else ""
    return f"{family}-t{t}p{p}d{devices // (t * p)}v{kw.get('virtual_pipeline_size', 1)}-{kw.get('pipeline_schedule', 'interleaved_1f1b')}{extra}"


@pytest.mark.parametrize(("family", "devices", "layers", "strategy_kwargs"), LAYOUTS, ids=[_layout_id(c) for c in LAYOUTS])
def test_pipeline_matches_single_process(dist_pool, family, devices, layers, strategy_kwargs):
    overrides = {"num_layers": layers}
    results = dist_pool(devices).run(
        fit_and_record, family, strategy_kwargs=strategy_kwargs, devices=devices, steps=STEPS,
        global_batch=GLOBAL_BATCH, model_overrides=overrides,
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH, model_overrides=overrides)
    _check(results, ref)
