"""Kernels of the fused bias + GeLU (entry point: bias_gelu.py). The forward reads x once and
writes gelu(x + bias); the backward recomputes h = x + bias from the saved x
and bias instead of keeping h, and returns dbias = sum of dx over all leading dims.

GeLU forms, with h = x + bias (computed in fp32 whatever the storage dtype):
  "none": y = h * Phi(h),  Phi(h) = (1 + erf(h / sqrt 2)) / 2,   y' = Phi(h) + h * exp(-h^2/2) / sqrt(2 pi)
  "tanh": y = h * sigmoid(2u), u = sqrt(2/pi) (h + 0.044715 h^3)    [(1 + tanh u) / 2 == sigmoid(2u)]
          y' = s + 2 h s (1 - s) u',  s = sigmoid(2u),  u' = sqrt(2/pi) (1 + 3 * 0.044715 h^2)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import check_interpreted, elementwise_tiles

# Row-block programs per column block in the backward: each writes one fp32 partial row of
# dbias, summed afterwards by torch. One per SM on a GPU (on an H100 a sweep from 132 to 4096
# partials found one per SM fastest); this cap elsewhere.
_MAX_DBIAS_PARTIALS = 256


def _dbias_partials(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _MAX_DBIAS_PARTIALS


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _gelu(h, TANH: tl.constexpr):
    if TANH:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2/pi) * (...)
        y = h * _sigmoid(2.0 * u)
    else:
        y = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))  # 1/sqrt(2)
    return y


@triton.jit
def _gelu_grad(h, TANH: tl.constexpr):
    if TANH:
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        s = _sigmoid(2.0 * u)
        du = 0.7978845608028654 * (1.0 + 0.134145 * h * h)  # 0.134145 = 3 * 0.044715
        grad = s + 2.0 * h * s * (1.0 - s) * du
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        grad = cdf + h * tl.exp(-0.5 * h * h) * 0.3989422804014327  # 1/sqrt(2 pi)
    return grad


@triton.jit
def _bias_gelu_fwd(
    X, B, Y, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TANH: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    bias = tl.load(B + cols, mask=col_ok, other=0.0)
    h = x.to(tl.float32) + bias.to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], _gelu(h, TANH).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd(
    X,
    B,
    DY,
    DX,
    DBIAS_PARTIAL,
    n_rows,
    n_cols,
    rows_per_program,
    stride_x,
    stride_dy,
    stride_dx,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TANH: tl.constexpr,
):
    """One program: BLOCK_N columns of rows_per_program rows; writes dx and a partial dbias row."""
    part = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    bias = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    dbias = tl.zeros([BLOCK_N], dtype=tl.float32)
    first_row = part * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for start in range(first_row, last_row, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < last_row)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
        dx = dy.to(tl.float32) * _gelu_grad(x.to(tl.float32) + bias[None, :], TANH)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dbias += tl.sum(dx, 0)
    tl.store(DBIAS_PARTIAL + part.to(tl.int64) * n_cols + cols, dbias, mask=col_ok)


def _rows_view(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(M, n_cols) view with unit column stride, copying only when the layout demands it."""
    rows = t.reshape(-1, n_cols)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor, tanh: bool) -> torch.Tensor:
    check_interpreted(_bias_gelu_fwd)
    n_cols = bias.numel()
    x2 = _rows_view(x, n_cols)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        tiles = elementwise_tiles(n_cols)
        grid = (triton.cdiv(x2.shape[0], tiles.block_m), triton.cdiv(n_cols, tiles.block_n))
        _bias_gelu_fwd[grid](
            x2,
            bias,
            y,
            x2.shape[0],
            n_cols,
            x2.stride(0),
            y.stride(0),
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            TANH=tanh,
            num_warps=tiles.num_warps,
        )
    return y.view(x.shape)


def bias_gelu_backward(
    grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, tanh: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    check_interpreted(_bias_gelu_bwd)
    n_cols = bias.numel()
    x2, dy2 = _rows_view(x, n_cols), _rows_view(grad_y, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(bias)
    tiles = elementwise_tiles(n_cols)
    row_blocks = triton.cdiv(n_rows, tiles.block_m)
    parts = min(row_blocks, _dbias_partials(x.device))
    rows_per_program = triton.cdiv(row_blocks, parts) * tiles.block_m
    parts = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty((parts, n_cols), dtype=torch.float32, device=x.device)
    _bias_gelu_bwd[(parts, triton.cdiv(n_cols, tiles.block_n))](
        x2,
        bias,
        dy2,
        dx,
        partial,
        n_rows,
        n_cols,
        rows_per_program,
        x2.stride(0),
        dy2.stride(0),
        dx.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        TANH=tanh,
        num_warps=tiles.num_warps,
    )
    return dx.view(x.shape), partial.sum(0).to(bias.dtype)
