"""Fused bias + GeLU: y = gelu(x + bias) in one kernel, as Megatron fuses the MLP's first bias
into its activation. The kernels live in bias_gelu_kernels.py and are imported on first use,
so this module imports without triton.
"""

from __future__ import annotations

import torch

from ._config import SUPPORTED_DTYPES

_APPROXIMATIONS = ("none", "tanh")


# Custom ops, as attention.py's: opaque to torch.compile, traced by their fake implementations.
@torch.library.custom_op("lightning_ptdp::bias_gelu_forward", mutates_args=())
def _forward_op(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    from .bias_gelu_kernels import bias_gelu_forward

    return bias_gelu_forward(x, bias, tanh)


@_forward_op.register_fake
def _(x, bias, tanh):
    return x.new_empty(x.shape)


@torch.library.custom_op("lightning_ptdp::bias_gelu_backward", mutates_args=())
def _backward_op(
    grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    from .bias_gelu_kernels import bias_gelu_backward

    return bias_gelu_backward(grad_y, x, bias, tanh)


@_backward_op.register_fake
def _(grad_y, x, bias, tanh):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _save(ctx, inputs, output) -> None:
    x, bias, ctx.tanh = inputs
    ctx.save_for_backward(x, bias)  # h = x + bias is recomputed in backward


def _backward(ctx, grad_y):
    x, bias = ctx.saved_tensors
    dx, dbias = _backward_op(grad_y, x, bias, ctx.tanh)
    return dx, dbias, None


_forward_op.register_autograd(_backward, setup_context=_save)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) fused, ``approximate`` "none" (erf) or "tanh" as in F.gelu.

    x has any leading shape and last dim == bias.numel(); the result has x's dtype (the add
    and GeLU run in fp32), as the epilogue of a Linear would; dbias comes back in bias's dtype.
    """
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"bias_gelu: approximate={approximate!r}; expected one of {_APPROXIMATIONS}")
    if bias.dim() != 1 or x.dim() == 0 or x.shape[-1] != bias.numel():
        raise ValueError(
            f"bias_gelu: x {tuple(x.shape)} and bias {tuple(bias.shape)} do not match; "
            "bias must be 1-D with size x.shape[-1]"
        )
    if x.dtype not in SUPPORTED_DTYPES or bias.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"bias_gelu: dtypes x {x.dtype}, bias {bias.dtype}; need fp16, bf16 or fp32")
    if x.device != bias.device:
        raise ValueError(f"bias_gelu: x on {x.device} but bias on {bias.device}")
    if bias.stride(0) != 1:
        bias = bias.contiguous()
    return _forward_op(x, bias, approximate == "tanh")
