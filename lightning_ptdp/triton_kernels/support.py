"""Can the Triton kernels run here, on these inputs? Answers without importing triton eagerly."""

from __future__ import annotations

import importlib.util

import torch

from ._config import MAX_GRID_Y, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, interpreting

# Looked up once, at import: dynamo refuses to trace importlib's find_spec (seen with torch 2.11),
# and flash_attention asks this while torch.compile traces it.
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_importable() -> bool:
    """True when the ``triton`` package can be found (it is not imported here)."""
    return _TRITON_FOUND


def triton_available() -> bool:
    """True when triton is installed and has somewhere to run: a CUDA device or the interpreter."""
    return triton_importable() and (torch.cuda.is_available() or interpreting())


def device_reason(device: torch.device, *, allow_interpreter: bool = True) -> str | None:
    """Why the kernels cannot run on ``device`` (None when they can)."""
    if not triton_importable():
        return "triton is not installed (pip install 'lightning-ptdp[triton]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and allow_interpreter and interpreting():
        return None
    return f"tensors are on {device.type!r}; the Triton kernels need a CUDA device" + (
        " or TRITON_INTERPRET=1 with CPU tensors" if allow_interpreter else ""
    )


def attention_supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = True,
    *,
    allow_interpreter: bool = True,
) -> str | None:
    """None when ``flash_attention`` can compute ``F.scaled_dot_product_attention`` with these
    arguments, otherwise a human-readable reason. ``is_causal`` and ``scale`` are always
    supported; they are accepted so the SDPA argument list can be passed through unchanged.
    ``enable_gqa`` defaults to True here (flash_attention itself always maps query heads to
    their key/value group); pass SDPA's value to reproduce its refusal of unequal heads."""
    del is_causal, scale
    if attn_mask is not None:
        return "attn_mask is given; the flash kernel only does causal or unmasked attention"
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p}; the flash kernel has no attention dropout (use 0 or eval mode)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"expected 4-D (batch, heads, seq, head_dim) q/k/v, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}; need one of fp16, bf16, fp32 for all three"
    if not (q.device == k.device == v.device):
        return f"q/k/v on different devices ({q.device}, {k.device}, {v.device})"
    return _shape_reason(q, k, v, enable_gqa) or device_reason(q.device, allow_interpreter=allow_interpreter)


def _shape_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> str | None:
    (batch, heads, _, head_dim), (kb, kv_heads, kv_len, kd) = q.shape, k.shape
    if head_dim not in SUPPORTED_HEAD_DIMS or kd != head_dim or v.shape[-1] != head_dim:
        return (
            f"head_dim q/k/v = {head_dim}/{kd}/{v.shape[-1]}; the flash kernel needs equal head dims "
            f"in {SUPPORTED_HEAD_DIMS}"
        )
    if kb != batch or v.shape[:3] != k.shape[:3]:
        return f"q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} disagree on batch or kv length"
    if kv_heads == 0 or heads % kv_heads:
        return f"{heads} query heads is not a multiple of {kv_heads} key/value heads"
    if kv_heads != heads and not enable_gqa:
        return f"{heads} query heads vs {kv_heads} key/value heads needs enable_gqa=True"
    if batch * heads > MAX_GRID_Y:
        return f"batch*heads = {batch * heads} exceeds the kernel grid limit {MAX_GRID_Y}"
    if kv_len == 0:
        return "key/value sequence is empty"
    return None
