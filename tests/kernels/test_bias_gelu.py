"""bias_gelu vs F.gelu(x + bias): values and gradients for x and bias."""

import pytest
import torch

pytest.importorskip("triton")

from lightning_ptdp.triton_kernels import bias_gelu  # noqa: E402
from lightning_ptdp.triton_kernels.reference import bias_gelu_reference  # noqa: E402

# Reference in fp64 from the same inputs; the kernel computes in fp32 and rounds once on store.
# fp32: a few ulps from erf/exp; dbias sums <= 70 rows in a different order.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16: one rounding of y / dx to 8 mantissa bits (eps 7.8e-3); dbias accumulates in fp32
# but is rounded to bf16 once (bias stored in bf16).
BF16_TOL = dict(atol=2e-2, rtol=1e-2)
TOLERANCES = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL}


def _check(device, shape, approximate, dtype=torch.float32, bias_dtype=None):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (2 * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)
    bias = torch.randn(shape[-1], generator=gen).to(device=device, dtype=bias_dtype or dtype)
    grad_y = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    x_leaf, b_leaf = x.clone().requires_grad_(), bias.clone().requires_grad_()
    y = bias_gelu(x_leaf, b_leaf, approximate=approximate)
    dx, dbias = torch.autograd.grad(y, (x_leaf, b_leaf), grad_y)

    x_ref, b_ref = x.double().requires_grad_(), bias.double().requires_grad_()
    y_ref = bias_gelu_reference(x_ref, b_ref, approximate=approximate)
    dx_ref, dbias_ref = torch.autograd.grad(y_ref, (x_ref, b_ref), grad_y.double())

    tol = TOLERANCES[dtype]
    assert (y.dtype, dx.dtype, dbias.dtype) == (dtype, dtype, bias.dtype)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(dx.double(), dx_ref, **tol)
    # dbias sums up to 70 rows of dx: allow the row count's worth of per-element error.
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(dbias.double(), dbias_ref, atol=tol["atol"] * rows, rtol=tol["rtol"])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(1, 1), (5, 33), (2, 7, 70), (3, 2, 5, 129)])
def test_values_and_gradients_fp32(device, approximate, shape):
    _check(device, shape, approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_values_and_gradients_bf16(device, approximate):
    _check(device, (3, 11, 48), approximate, dtype=torch.bfloat16)


def test_bf16_activations_with_fp32_bias_keep_activation_dtype(device):
    """Autocast leaves Linear outputs in bf16 while the bias parameter stays fp32."""
    _check(device, (4, 40), "tanh", dtype=torch.bfloat16, bias_dtype=torch.float32)


def test_non_contiguous_input(device):
    x = torch.randn(6, 40, device=device).t()  # (40, 6), column stride 40
    bias = torch.randn(6, device=device)
    torch.testing.assert_close(bias_gelu(x, bias), bias_gelu_reference(x, bias), **FP32_TOL)


def test_empty_input_gives_zero_bias_grad(device):
    x = torch.zeros(0, 8, device=device, requires_grad=True)
    bias = torch.randn(8, device=device, requires_grad=True)
    bias_gelu(x, bias).sum().backward()
    assert torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize(
    ("x_shape", "bias_shape", "kwargs", "match"),
    [
        ((4, 8), (8,), dict(approximate="fast"), r"approximate='fast'; expected one of \('none', 'tanh'\)"),
        ((4, 8), (7,), {}, r"x \(4, 8\) and bias \(7,\) do not match; bias must be 1-D with size x.shape\[-1\]"),
        ((4, 8), (2, 4), {}, r"bias must be 1-D"),
    ],
)
def test_rejects_bad_arguments(device, x_shape, bias_shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bias_gelu(torch.randn(*x_shape, device=device), torch.randn(*bias_shape, device=device), **kwargs)
