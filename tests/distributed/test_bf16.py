"""bf16 training under every parallel dimension against the single-process bf16 run: per-step
losses and the weights after several optimizer steps, within a tolerance measured in the test.

The noise floor is how far the single-process bf16 run moves from itself when only its rounding
order changes: the same global batches in 2 and in 4 equal parts (``accumulate_grad_batches``),
mathematically the same step and the same sums a d=2 run or a pipeline's microbatches compute,
each part's bf16 gradient rounded on its own. A parallel run must stay within a stated multiple
of that floor; a run one optimizer step behind must not (checked below on a deliberately lagged
result), which the former 2e-2 loss tolerance alone let through.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from tests.fit_utils import fit_and_record

STEPS, GLOBAL_BATCH = 6, 8  # 6 optimizer steps (warmup to lr 1e-2 at step 5): weights moved, still cheap
MODEL = {"num_layers": 4}  # p2v2 needs 4 chunks of one block
NOISE_DRIVEN = ("attn.key.bias",)  # zero gradient in exact arithmetic: Adam turns round-off into full updates
FLOOR_PARTS = (2, 4)  # the reference's global batch in 2 and 4 equal parts: two rounding orders
# Multiple of the floor allowed. The floor is one sample of a random size and the layouts add
# roundings the references lack (TP rounds each rank's partial sum to bf16 before the all-reduce):
# measured parallel / floor ratios reach ~3 (t2 losses, d2 weights). 5 keeps margin against that,
# while one step of lag (~0.24 of the whole update, 0.1-0.5 per tensor) stays >= 4x above 5 floors.
FLOOR_MULTIPLE = 5
# One tensor's error (a bias: 32 elements) scatters more around its one-sample floor: measured up to
# 7x (bf16-true t2-sp, a row-parallel output bias) where the whole model stays under 3x. The whole
# model's check above catches a lag; this one a tensor gone wrong (not updated: error 1, or twice).
TENSOR_FLOOR_MULTIPLE = 10
# Absolute minima of the floors (a floor can come out ~0: the partitioned references give the
# first step's loss to 5e-7). bf16 rounds to u = 2^-9 ~ 2e-3: one such rounding of the logits,
# averaged over a batch's 256 independent token losses of ~4, moves the loss by 4 * 2e-3 / 16 =
# 5e-4; one rounding of every weight update moves the weights by u of their update.
LOSS_FLOOR_MIN = 5e-4
WEIGHT_FLOOR_MIN = 2e-3

LAYOUTS = {
    "d2": (2, {}),
    "d2-zero3": (2, {"zero_stage": 3}),  # FSDP2 shards the fp32 master weights (mixed) or the bf16 ones (true)
    "t2": (2, {"tensor_parallel_size": 2}),
    "t2-sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": True}),
    "p2v2": (2, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2}),  # bf16 crosses
    "t2p2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2}),
    "d2-e2": (2, {"expert_parallel_size": 2}),  # transformers Mixtral: its experts split, tokens exchanged in bf16
    "d2-e2-titan": (2, {"expert_parallel_size": 2}),  # torchtitan Qwen3-MoE, its own bf16 grouped GEMMs
    "c2": (2, {"context_parallel_size": 2}),  # keys and values gathered in bf16, the loss's shares summed
}
FAMILY = {"d2-e2": "hf_mixtral", "d2-e2-titan": "titan_qwen3_moe_bf16"}  # the recipe GPT elsewhere
# bf16-mixed keeps fp32 master weights and reduces fp32 gradients (DDP, FSDP2 and the pipeline's dp
# average all see the fp32 .grad); bf16-true trains bf16 weights. The 4-rank case last: one pool per size.
CASES = [
    pytest.param(precision, layout, marks=pytest.mark.world_size(LAYOUTS[layout][0]), id=f"{precision}-{layout}")
    for precision, layout in [("bf16-mixed", name) for name in LAYOUTS if name != "t2p2"]
    + [("bf16-true", "t2-sp"), ("bf16-true", "p2v2"), ("bf16-true", "d2-e2"), ("bf16-true", "c2")]
    + [("bf16-mixed", "t2p2")]
]


class StateRecorder(L.Callback):
    """The weights after every optimizer step (single process, one batch per step)."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.states.append({k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()})


def _fit(precision: str, family: str = "gpt", **kwargs) -> dict:
    trainer_kwargs = {"precision": precision}
    overrides = MODEL if family == "gpt" else None
    return fit_and_record(
        family,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        model_overrides=overrides,
        trainer_kwargs=trainer_kwargs,
        **kwargs,
    )


def _weight_errors(state: dict, ref: dict) -> tuple[dict[str, float], float]:
    """Per tensor and over all of them: ||w - w_ref|| / ||w_ref - w_init||, the error measured
    against how far training moved the weights."""
    errors, diff2, moved2 = {}, 0.0, 0.0
    for name, expected in ref["state"].items():
        if name.endswith(NOISE_DRIVEN) or not expected.is_floating_point():
            continue
        diff = float((state[name].double() - expected.double()).norm()) ** 2
        moved = float((expected.double() - ref["initial"][name].double()).norm()) ** 2
        if moved == 0:  # a buffer training never moves (torchtitan's expert bias): it must stay put
            errors[name] = 0.0 if diff == 0 else float("inf")
            continue
        errors[name] = (diff / moved) ** 0.5
        diff2, moved2 = diff2 + diff, moved2 + moved
    return errors, (diff2 / moved2) ** 0.5


def noise_floor(ref: dict, partitioned: list[dict]) -> dict:
    """The largest difference between the reference and its re-partitioned runs: per-step loss
    (the largest over steps: rounding noise grows as training goes on), weights per tensor and
    over all tensors; each at least its stated minimum."""
    loss = max(abs(a - b) for other in partitioned for a, b in zip(other["losses"], ref["losses"]))
    per_tensor: dict[str, float] = {}
    whole = 0.0
    for other in partitioned:
        errors, total = _weight_errors(other["state"], ref)
        whole = max(whole, total)
        for name, err in errors.items():
            per_tensor[name] = max(per_tensor.get(name, 0.0), err)
    whole = max(whole, WEIGHT_FLOOR_MIN)
    return {"loss": max(loss, LOSS_FLOOR_MIN), "weights": whole, "per_tensor": per_tensor}


def bf16_mismatches(result: dict, ref: dict, floor: dict) -> list[str]:
    """What exceeds its multiple of the floor: each step's loss and the weights over all tensors
    (FLOOR_MULTIPLE), each tensor's (TENSOR_FLOOR_MULTIPLE, of the larger of its own floor and the
    whole model's). Empty: the run matches."""
    found = []
    assert len(result["losses"]) == len(ref["losses"]) == STEPS
    loss_tol = FLOOR_MULTIPLE * floor["loss"]
    for step, (got, want) in enumerate(zip(result["losses"], ref["losses"])):
        if abs(got - want) > loss_tol:
            found.append(f"step {step} loss {got:.5f} vs {want:.5f}: off by {abs(got - want):.1e} > {loss_tol:.1e}")
    errors, whole = _weight_errors(result["state"], ref)
    if whole > FLOOR_MULTIPLE * floor["weights"]:
        found.append(f"weights: error {whole:.2e} of the update > {FLOOR_MULTIPLE} x floor {floor['weights']:.2e}")
    for name, err in errors.items():
        tol = TENSOR_FLOOR_MULTIPLE * max(floor["per_tensor"][name], floor["weights"])
        if err > tol:
            found.append(f"weight {name}: error {err:.2e} of its update > {tol:.2e}")
    return found


@functools.lru_cache(maxsize=None)
def reference(precision: str, family: str = "gpt") -> tuple[dict, dict, list[dict]]:
    """The single-process bf16 run, its noise floor, and its weights after every step."""
    recorder = StateRecorder()
    ref = _fit(precision, family, callbacks=[recorder])
    partitioned = [_fit(precision, family, accumulate=parts) for parts in FLOOR_PARTS]
    assert len(recorder.states) == STEPS
    return ref, noise_floor(ref, partitioned), recorder.states


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_the_check_fails_a_run_one_step_behind(precision):
    """The reference's own losses (what a 2e-2 loss check compared) with its weights one optimizer
    step behind: the weights must fail, by a wide margin, while the floor itself is small."""
    ref, floor, states = reference(precision)
    assert not bf16_mismatches(ref, ref, floor)
    lagged = {"losses": list(ref["losses"]), "state": states[-2]}
    found = bf16_mismatches(lagged, ref, floor)
    assert found and all(line.startswith("weight") for line in found), found
    _, whole = _weight_errors(lagged["state"], ref)
    assert whole > 2 * FLOOR_MULTIPLE * floor["weights"], (whole, floor)  # not a near miss


@pytest.mark.parametrize(("precision", "layout"), CASES)
def test_bf16_matches_single_process_within_noise_floor(dist_pool, precision, layout):
    devices, strategy_kwargs = LAYOUTS[layout]
    family = FAMILY.get(layout, "gpt")
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs=strategy_kwargs,
        devices=devices,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        model_overrides=MODEL if family == "gpt" else None,
        trainer_kwargs={"precision": precision},
    )
    ref, floor, _ = reference(precision, family)
    with_state = [result for result in results if result["state"]]
    assert with_state, "no rank returned the trained weights"
    for result in results:  # every rank reports the global-batch loss
        state = result["state"] or with_state[0]["state"]
        found = bf16_mismatches({**result, "state": state}, ref, floor)
        assert not found, f"floor: loss {floor['loss']:.1e}, weights {floor['weights']:.1e}; " + "; ".join(found)
    dtype = torch.float32 if precision == "bf16-mixed" else torch.bfloat16  # mixed: fp32 master weights
    assert all(v.dtype == dtype for v in with_state[0]["state"].values() if v.is_floating_point())
