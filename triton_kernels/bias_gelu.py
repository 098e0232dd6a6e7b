"""Fused bias + GeLU: y = gelu(x + bias) in one kernel, as Megatron fuses the MLP's first bias
into its activation. The kernels live in bias_gelu_kernels.py and are imported on first use,
so this module imports without triton.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ._config import SUPPORTED_DTYPES

_APPROXIMATIONS = ("none", "tanh")


class BiasGeluFunction(torch.autograd.Function):
    """y = gelu(x + bias); saves only x and bias (h = x + bias is recomputed in backward)."""

    @staticmethod
    def forward(ctx, x, bias, tanh: bool):
        ctx.save_for_backward(x, bias)
        ctx.tanh = tanh
        from .bias_gelu_kernels import bias_gelu_forward

        return bias_gelu_forward(x, bias, tanh)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, bias = ctx.saved_tensors
        from .bias_gelu_kernels import bias_gelu_backward

        dx, dbias = bias_gelu_backward(grad_y, x, bias, ctx.tanh)
        return dx, dbias, None


@torch.compiler.disable  # opaque to torch.compile: a graph break, the kernel runs as launched
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
    return BiasGeluFunction.apply(x, bias, approximate == "tanh")
