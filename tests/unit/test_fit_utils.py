"""The comparison helpers of tests/fit_utils.py leave out exactly what round-off drives, no more:
of nanoGPT's fused q | k | v attention bias only the key third."""

from __future__ import annotations

import pytest
import torch

from tests.fit_utils import assert_matches_reference, without_key_third

HIDDEN = 4
NAME = "net.h.0.attn.c_attn.bias"


def _runs(change: slice | None) -> tuple[dict, dict]:
    """A reference and a run equal to it but for ``change`` of the fused bias (weights and gradient)."""
    torch.manual_seed(0)
    initial = torch.randn(3 * HIDDEN)
    grad = torch.randn(3 * HIDDEN)
    grad[HIDDEN : 2 * HIDDEN] = 1e-12 * torch.randn(HIDDEN)  # the key third: round-off only
    final = initial - 0.1 * grad.sign()
    ref = {"losses": [1.0], "first_grads": {NAME: grad}, "initial": {NAME: initial}, "state": {NAME: final}}
    run_grad, run_final = grad.clone(), final.clone()
    if change is not None:
        run_grad[change] += 0.5
        run_final[change] += 0.05
    run = {"losses": [1.0], "first_grads": {NAME: run_grad}, "initial": {NAME: initial}, "state": {NAME: run_final}}
    return run, ref


def _compare(change: slice | None) -> None:
    run, ref = _runs(change)
    assert_matches_reference(run, ref, loss_rtol=1e-5, grad_rel=1e-5, update_rel=1e-3)


def test_the_key_third_of_a_fused_bias_is_left_out():
    _compare(slice(HIDDEN, 2 * HIDDEN))


@pytest.mark.parametrize("third", ["q", "v"])
def test_the_query_and_value_thirds_are_compared(third):
    start = 0 if third == "q" else 2 * HIDDEN
    with pytest.raises(AssertionError, match=r"(gradient|weight) (of )?net\.h\.0\.attn\.c_attn\.bias"):
        _compare(slice(start, start + 1))


def test_other_tensors_stay_whole_and_uneven_fused_biases_are_refused():
    tensor = torch.arange(6.0)
    assert torch.equal(without_key_third("net.h.0.attn.c_proj.bias", tensor), tensor)
    assert without_key_third(NAME, tensor).tolist() == [0.0, 1.0, 4.0, 5.0]
    with pytest.raises(ValueError, match=r"c_attn\.bias has 7 elements, not three equal parts q \| k \| v"):
        without_key_third(NAME, torch.zeros(7))


def test_the_roundoff_floor_raises_a_tolerance_only_to_the_model_own_fp32_spread():
    """A weight whose one-process fp32 run is itself 1e-3 of its update away from fp64 may differ by
    up to ROUNDOFF_FACTOR times that in a layout; twice that still fails."""
    from tests.fit_utils import ROUNDOFF_FACTOR, roundoff_floor

    name = "w"
    initial, update = torch.zeros(8), torch.ones(8)
    ref64 = {"losses": [1.0], "first_grads": {name: update}, "initial": {name: initial}, "state": {name: update}}
    spread = update * 1e-3  # fp32 round-off moved the one-process weights by 1e-3 of the update
    ref = {**ref64, "state": {name: update + spread}}
    floor = roundoff_floor(ref, ref64)
    assert floor["weights"][name] == pytest.approx(1e-3, rel=1e-4)  # fp32 storage of the spread
    near = {**ref, "state": {name: update + spread + 0.9 * ROUNDOFF_FACTOR * spread}}
    far = {**ref, "state": {name: update + spread + 2 * ROUNDOFF_FACTOR * spread}}
    kwargs = {"loss_rtol": 1e-5, "grad_rel": 1e-5, "update_rel": 1e-3}
    assert_matches_reference(near, {**ref, "floor": floor}, **kwargs)
    with pytest.raises(AssertionError, match="weight w: error"):
        assert_matches_reference(near, ref, **kwargs)  # without the floor: the fixed 1e-3
    with pytest.raises(AssertionError, match="weight w: error"):
        assert_matches_reference(far, {**ref, "floor": floor}, **kwargs)
