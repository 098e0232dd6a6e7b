"""Flash attention backward, recomputing probabilities from the saved log-sum-exp.

With P = softmax(S), S = scale * Q K^T and O = P V:
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   delta = rowsum(dO * O),
    dQ = scale * dS K,   dK = scale * dS^T Q.
Three launches: delta per query row; one program per key block accumulating dK and dV over
all query rows of every query head that shares the block's key/value head (so grouped-query
gradients are summed in registers, no atomics); one program per query block for dQ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._config import attention_tiles, check_interpreted, dot_precision, seq_bucket, upcast_dots
from .attention_fwd import LOG2E, _head_indices, _kv_bounds, _mm
from .tuning import autotuned


@triton.jit
def _attn_bwd_delta(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_db,
    stride_dh,
    stride_dm,
    num_heads,
    q_len,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch_head = tl.program_id(1)
    batch, head, _ = _head_indices(batch_head, num_heads, 1)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    o = tl.load(
        O + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + batch * stride_db + head * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + batch_head.to(tl.int64) * q_len + offs_m, delta, mask=row_ok)


@triton.jit
def _dkdv_q_sweep(
    dk,
    dv,
    kt,
    vt,
    q_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    stride_qm,
    stride_dm,
    offs_n,
    offs_d,
    start,
    stop,
    q_len,
    kv_len,
    qk_scale,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Adds the contributions of query blocks [start, stop) to one key block's dK and dV."""
    for start_m in range(start, stop, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :]
        do_ptrs = do_ptr + offs_m[:, None] * stride_dm + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < q_len
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_ptr + offs_m)
            delta = tl.load(delta_ptr + offs_m)
        probs = tl.exp2(_mm(q, kt, PRECISION, UPCAST) * qk_scale - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = row_ok[:, None] & (offs_n[None, :] < kv_len)
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            probs = tl.where(visible, probs, 0.0)
        dv += _mm(tl.trans(probs.to(do.dtype)), do, PRECISION, UPCAST)
        dscores = probs * (_mm(do, vt, PRECISION, UPCAST) - delta[:, None])
        dk += _mm(tl.trans(dscores.to(q.dtype)), q, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_db,
    stride_dh,
    stride_dm,
    num_heads,
    group_size,
    q_len,
    kv_len,
    qk_scale,
    scale,
    seq_bucket,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    batch_kv_head = tl.program_id(1)
    num_kv_heads = num_heads // group_size
    batch = (batch_kv_head // num_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % num_kv_heads).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < kv_len
    k_ptrs = K + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
    k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
    v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
    kt = tl.trans(k)
    vt = tl.trans(v)

    # Query blocks [start, first_full) straddle the causal diagonal; [first_full, last_full)
    # need no mask; [last_full, q_len) hold the ragged query tail (or everything, when this
    # key block is itself ragged).
    start = 0
    first_full = 0
    if CAUSAL:
        start = start_n // BLOCK_M * BLOCK_M
        first_full = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, q_len)
    key_block_full = start_n + BLOCK_N <= kv_len
    last_full = tl.where(key_block_full, tl.maximum(q_len // BLOCK_M * BLOCK_M, first_full), first_full)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for member in range(group_size):
        head = kv_head * group_size + member
        row_offset = (batch * num_heads + head) * q_len
        q_ptr = Q + batch * stride_qb + head * stride_qh
        do_ptr = DO + batch * stride_db + head * stride_dh
        lse_ptr = LSE + row_offset
        delta_ptr = DELTA + row_offset
        dk, dv = _dkdv_q_sweep(
            dk,
            dv,
            kt,
            vt,
            q_ptr,
            do_ptr,
            lse_ptr,
            delta_ptr,
            stride_qm,
            stride_dm,
            offs_n,
            offs_d,
            start,
            first_full,
            q_len,
            kv_len,
            qk_scale,
            BLOCK_M,
            True,
            CAUSAL,
            PRECISION,
            UPCAST,
        )
        dk, dv = _dkdv_q_sweep(
            dk,
            dv,
            kt,
            vt,
            q_ptr,
            do_ptr,
            lse_ptr,
            delta_ptr,
            stride_qm,
            stride_dm,
            offs_n,
            offs_d,
            first_full,
            last_full,
            q_len,
            kv_len,
            qk_scale,
            BLOCK_M,
            False,
            CAUSAL,
            PRECISION,
            UPCAST,
        )
        dk, dv = _dkdv_q_sweep(
            dk,
            dv,
            kt,
            vt,
            q_ptr,
            do_ptr,
            lse_ptr,
            delta_ptr,
            stride_qm,
            stride_dm,
            offs_n,
            offs_d,
            last_full,
            q_len,
            q_len,
            kv_len,
            qk_scale,
            BLOCK_M,
            True,
            CAUSAL,
            PRECISION,
            UPCAST,
        )

    # DK and DV are contiguous (batch, kv_heads, kv_len, HEAD_DIM).
    dkv_offs = batch_kv_head.to(tl.int64) * kv_len * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + dkv_offs, (dk * scale).to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + dkv_offs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _dq_kv_sweep(
    dq,
    q,
    do,
    lse,
    delta,
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
    """Adds the contributions of key blocks [start, stop) to one query block's dQ."""
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_ptr + offs_n[:, None] * stride_kn + offs_d[None, :]
        vt_ptrs = v_ptr + offs_n[None, :] * stride_vn + offs_d[:, None]
        if MASKED:
            key_ok = offs_n < kv_len
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=key_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            vt = tl.load(vt_ptrs)
        probs = tl.exp2(_mm(q, tl.trans(k), PRECISION, UPCAST) * qk_scale - lse[:, None])
        if MASKED:
            visible = key_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            probs = tl.where(visible, probs, 0.0)
        dscores = probs * (_mm(do, vt, PRECISION, UPCAST) - delta[:, None])
        dq += _mm(dscores.to(k.dtype), k, PRECISION, UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_db,
    stride_dh,
    stride_dm,
    num_heads,
    group_size,
    q_len,
    kv_len,
    qk_scale,
    scale,
    seq_bucket,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch, head, kv_head = _head_indices(batch_head, num_heads, group_size)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    rows = offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(Q + batch * stride_qb + head * stride_qh + rows, mask=row_ok[:, None], other=0.0)
    do_rows = offs_m[:, None] * stride_dm + offs_d[None, :]
    do = tl.load(DO + batch * stride_db + head * stride_dh + do_rows, mask=row_ok[:, None], other=0.0)
    row_offset = batch_head.to(tl.int64) * q_len
    lse = tl.load(LSE + row_offset + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_offset + offs_m, mask=row_ok, other=0.0)
    k_ptr = K + batch * stride_kb + kv_head * stride_kh
    v_ptr = V + batch * stride_vb + kv_head * stride_vh

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, end = _kv_bounds(start_m, kv_len, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_kv_sweep(
        dq,
        q,
        do,
        lse,
        delta,
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
    dq = _dq_kv_sweep(
        dq,
        q,
        do,
        lse,
        delta,
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
    # DQ is contiguous (batch, heads, q_len, HEAD_DIM).
    dq_offs = row_offset * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + dq_offs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of flash attention, each contiguous and in its input's dtype."""
    check_interpreted(_attn_bwd_dq)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q_len == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty_like(lse)
    tiles = attention_tiles(head_dim, "bwd", q.dtype)  # delta: a row-wise pass, not tuned
    _attn_bwd_delta[(triton.cdiv(q_len, tiles.block_m), batch * heads)](
        out,
        do,
        delta,
        *out.stride()[:3],
        *do.stride()[:3],
        heads,
        q_len,
        BLOCK_M=tiles.block_m,
        HEAD_DIM=head_dim,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    shape_args = (heads, heads // kv_heads, q_len, kv_len, scale * LOG2E, scale, seq_bucket(max(q_len, kv_len)))
    meta = dict(CAUSAL=causal, HEAD_DIM=head_dim, PRECISION=dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype))
    _attn_bwd_dkdv_tuned[lambda m: (triton.cdiv(kv_len, m["BLOCK_N"]), batch * kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *strides, *shape_args, **meta
    )
    _attn_bwd_dq_tuned[lambda m: (triton.cdiv(q_len, m["BLOCK_M"]), batch * heads)](
        q, k, v, do, lse, delta, dq, *strides, *shape_args, **meta
    )
    return dq, dk, dv


_attn_bwd_dkdv_tuned = autotuned(_attn_bwd_dkdv, "dkdv")
_attn_bwd_dq_tuned = autotuned(_attn_bwd_dq, "dq")
