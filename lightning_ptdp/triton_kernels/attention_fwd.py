"""Flash attention forward: one program per (query block, batch*head), online softmax over
key/value blocks, so no (seq x seq) matrix is ever stored.

Scores are kept in base-2 units (scale * log2(e) folded into one multiplier) so the kernel
uses exp2; the saved per-row log-sum-exp is in the same units and the backward pass reuses it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._config import check_interpreted, dot_precision, seq_bucket, upcast_dots
from .tuning import autotuned

LOG2E = math.log2(math.e)


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32; UPCAST sidesteps the interpreter's broken bf16 dot."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _fwd_kv_sweep(
    acc,
    row_max,
    row_sum,
    q,
    k_ptr,
    v_ptr,
    stride_kn,
    stride_vn,
    offs_m,
    offs_d,
    start,
    stop,
    kv_len,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Folds key/value blocks [start, stop) into the running (acc, row_max, row_sum).

    MASKED=False is the fast path for blocks every query row may fully see; the masked
    path handles the ragged end of the keys and the causal diagonal."""
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_ptr + offs_n[None, :] * stride_kn + offs_d[:, None]  # K^T tile: (D, BLOCK_N)
        v_ptrs = v_ptr + offs_n[:, None] * stride_vn + offs_d[None, :]  # (BLOCK_N, D)
        if MASKED:
            key_ok = offs_n < kv_len
            kt = tl.load(kt_ptrs, mask=key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        scores = _mm(q, kt, PRECISION, UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            visible = key_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + _mm(probs.to(v.dtype), v, PRECISION, UPCAST)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _head_indices(batch_head, num_heads, group_size):
    """(batch, query head, key/value head) of a program on the batch*heads grid axis, as int64.
    Grouped-query attention is pure index mapping: no K/V copies."""
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    return batch, head, head // group_size


@triton.jit
def _kv_bounds(start_m, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(end of the unmasked key blocks, end of all key blocks) for the query rows at start_m."""
    full_end = kv_len // BLOCK_N * BLOCK_N
    end = kv_len
    if CAUSAL:
        # A key block needs no mask when its last key <= the block's first query row.
        full_end = tl.minimum(full_end, (start_m + 1) // BLOCK_N * BLOCK_N)
        end = tl.minimum(end, start_m + BLOCK_M)
    return full_end, end


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads,
    group_size,
    q_len,
    kv_len,
    qk_scale,
    seq_bucket,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # seq_bucket is unused here: it is the autotuning key (tuning.py)
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head, kv_head = _head_indices(batch_head, num_heads, group_size)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_ptr = K + batch * stride_kb + kv_head * stride_kh
    v_ptr = V + batch * stride_vb + kv_head * stride_vh

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    full_end, end = _kv_bounds(start_m, kv_len, BLOCK_M, BLOCK_N, CAUSAL)
    acc, row_max, row_sum = _fwd_kv_sweep(
        acc,
        row_max,
        row_sum,
        q,
        k_ptr,
        v_ptr,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        0,
        full_end,
        kv_len,
        qk_scale,
        BLOCK_N,
        False,
        CAUSAL,
        PRECISION,
        UPCAST,
    )
    acc, row_max, row_sum = _fwd_kv_sweep(
        acc,
        row_max,
        row_sum,
        q,
        k_ptr,
        v_ptr,
        stride_kn,
        stride_vn,
        offs_m,
        offs_d,
        full_end,
        end,
        kv_len,
        qk_scale,
        BLOCK_N,
        True,
        CAUSAL,
        PRECISION,
        UPCAST,
    )

    out = acc / row_sum[:, None]
    o_ptrs = O + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + batch_head.to(tl.int64) * q_len + offs_m, row_max + tl.log2(row_sum), mask=row_ok)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the forward kernel. Returns the output (batch, heads, q_len, head_dim) and
    the per-row log-sum-exp in base-2 units (batch, heads, q_len), fp32."""
    check_interpreted(_attn_fwd)
    batch, heads, q_len, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device=q.device)
    if q_len == 0:
        return out, lse
    _attn_fwd_tuned[lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), batch * heads)](
        q,
        k,
        v,
        out,
        lse,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        heads,
        heads // k.shape[1],
        q_len,
        k.shape[2],
        scale * LOG2E,
        seq_bucket(max(q_len, k.shape[2])),
        CAUSAL=causal,
        HEAD_DIM=head_dim,
        PRECISION=dot_precision(q.dtype),
        UPCAST=upcast_dots(q.dtype),
    )
    return out, lse


_attn_fwd_tuned = autotuned(_attn_fwd, "fwd")
