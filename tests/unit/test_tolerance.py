"""reordered_sum_tolerance accepts what summing in another order does to fp32 values of size ~10, which
a fixed atol of 1e-6 refuses, and still refuses a real error."""

from __future__ import annotations

import pytest
import torch

from tests.tolerance import REORDERED_SUMS, reordered_sum_tolerance

ROWS, TERMS = 4096, 256


def _sums_in_two_orders() -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums of fp32 terms (results up to ~14, as nanoGPT's logits): added one by one in a shuffled
    order, and correctly rounded (summed in fp64): equal in exact arithmetic, the same on every machine."""
    generator = torch.Generator().manual_seed(0)
    terms = 0.25 * torch.randn(ROWS, TERMS, generator=generator)
    shuffled = torch.zeros(ROWS)
    for column in torch.randperm(TERMS, generator=generator):
        shuffled += terms[:, column]
    return shuffled, terms.double().sum(-1).float()


def test_a_fixed_small_atol_refuses_a_reordered_sum_the_dtype_tolerance_accepts():
    actual, expected = _sums_in_two_orders()
    assert 5 < expected.abs().max() < 20
    assert not torch.equal(actual, expected)  # the order changed the rounding
    with pytest.raises(AssertionError, match="Mismatched elements"):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)  # the fixed tolerance it replaces
    torch.testing.assert_close(actual, expected, **reordered_sum_tolerance(expected))


@pytest.mark.parametrize("error", ["one element off by 1e-4 of the largest", "every element 1e-3 relative"])
def test_the_dtype_tolerance_still_refuses_a_real_error(error):
    actual, expected = _sums_in_two_orders()
    if error.startswith("one"):
        actual[ROWS // 2] += 1e-4 * expected.abs().max()
    else:
        actual = actual * (1 + 1e-3)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        torch.testing.assert_close(actual, expected, **reordered_sum_tolerance(expected))


def test_the_tolerance_follows_the_dtype_and_the_magnitude():
    values = torch.tensor([-10.0, 0.5])
    fp32 = reordered_sum_tolerance(values)
    assert fp32 == {"atol": REORDERED_SUMS * torch.finfo(torch.float32).eps * 10.0, "rtol": 0.0}
    assert reordered_sum_tolerance(10 * values)["atol"] == pytest.approx(10 * fp32["atol"])
    bf16 = reordered_sum_tolerance(values.bfloat16())
    assert bf16["atol"] == pytest.approx(fp32["atol"] * 2**16)  # 8 mantissa bits instead of 24
    assert reordered_sum_tolerance(values, dtype=torch.bfloat16) == bf16
