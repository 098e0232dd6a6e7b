"""flash_attention vs the materialised-softmax reference: values and gradients."""

import re

import pytest
import torch

pytest.importorskip("triton")

from lightning_ptdp.triton_kernels import attention_supported, flash_attention  # noqa: E402
from lightning_ptdp.triton_kernels.reference import attention_reference  # noqa: E402

# Reference is computed in fp64 from the same (already rounded) inputs.
# fp32: fp32 accumulation over <= 65 keys, summed in a different order by the online softmax.
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
# fp16 (eps 9.8e-4): P and dS are rounded to fp16 before the second matmul of each pass.
FP16_TOL = dict(atol=5e-3, rtol=5e-3)
# bf16 (eps 7.8e-3): same roundings with 8 mantissa bits; gradients sum ~65 such terms.
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
TOLERANCES = {torch.float32: FP32_TOL, torch.float16: FP16_TOL, torch.bfloat16: BF16_TOL}


def _inputs(device, batch=1, heads=2, kv_heads=None, q_len=17, kv_len=None, head_dim=16, dtype=torch.float32):
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = q_len if kv_len is None else kv_len
    gen = torch.Generator().manual_seed(q_len * 131 + kv_len * 7 + head_dim + heads + kv_heads)

    def make(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = make(batch, heads, q_len, head_dim)
    k = make(batch, kv_heads, kv_len, head_dim)
    v = make(batch, kv_heads, kv_len, head_dim)
    grad_out = make(batch, heads, q_len, head_dim)
    return q, k, v, grad_out


def _check(q, k, v, grad_out, causal, scale=None):
    """Kernel values and (dq, dk, dv) against the fp64 reference, with the dtype's tolerance."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal, scale=scale)
    grads = torch.autograd.grad(out, leaves, grad_out)

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_leaves, causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double())

    tol = TOLERANCES[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, **tol, msg=lambda m: f"output: {m}")
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.shape == want.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize(
    ("causal", "seq"), [(False, 1), (True, 1), (False, 17), (True, 17), (True, 33), (False, 65), (True, 65)]
)
def test_odd_sequence_lengths(device, causal, seq):
    _check(*_inputs(device, q_len=seq), causal=causal)


@pytest.mark.parametrize(
    ("head_dim", "seq", "causal"), [(32, 20, True), (64, 33, False), (64, 33, True), (128, 17, True)]
)
def test_head_dims(device, head_dim, seq, causal):
    _check(*_inputs(device, q_len=seq, head_dim=head_dim), causal=causal)


@pytest.mark.parametrize(("kv_heads", "causal"), [(2, True), (1, False), (1, True)])
def test_grouped_query_heads_sum_key_value_gradients(device, kv_heads, causal):
    _check(*_inputs(device, heads=4, kv_heads=kv_heads, q_len=33), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "causal"), [(16, False), (64, True)])
def test_half_precision(device, dtype, head_dim, causal):
    _check(*_inputs(device, q_len=33, head_dim=head_dim, dtype=dtype), causal=causal)


@pytest.mark.parametrize(("q_len", "kv_len"), [(17, 40), (40, 17)])
def test_unequal_query_and_key_lengths_causal_top_left(device, q_len, kv_len):
    _check(*_inputs(device, q_len=q_len, kv_len=kv_len), causal=True)


def test_explicit_scale_and_batch(device):
    _check(*_inputs(device, batch=2, q_len=18), causal=True, scale=0.3)


def test_strided_inputs_from_sequence_major_layout(device):
    """Models usually make q/k/v with .view(B, T, H, D).transpose(1, 2): non-contiguous."""
    q, k, v, grad_out = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(device, q_len=19))
    assert not q.is_contiguous()
    _check(q, k, v, grad_out, causal=True)


def test_matches_torch_sdpa(device):
    q, k, v, _ = _inputs(device, heads=4, kv_heads=2, q_len=24)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(flash_attention(q, k, v, causal=True), want, **FP32_TOL)


@pytest.mark.parametrize(
    ("shape", "call", "reason"),
    [
        ({}, dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), "attn_mask is given"),
        ({}, dict(dropout_p=0.1), r"dropout_p=0.1"),
        (dict(kv_heads=2), dict(enable_gqa=False), "needs enable_gqa=True"),
    ],
)
def test_attention_supported_rejects_sdpa_arguments(device, shape, call, reason):
    q, k, v, _ = _inputs(device, heads=4, q_len=8, **shape)
    assert attention_supported(q, k, v) is None
    assert re.search(reason, attention_supported(q, k, v, **call))


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        (dict(head_dim=48), r"head_dim q/k/v = 48/48/48; .* in \(16, 32, 64, 128\)"),
        (dict(head_dim=256), r"head_dim q/k/v = 256/"),
        (dict(dtype=torch.float64), r"dtypes torch.float64/.*need one of fp16, bf16, fp32"),
        (dict(kv_heads=3), "4 query heads is not a multiple of 3 key/value heads"),
    ],
)
def test_flash_attention_rejects_unsupported_shapes(device, shape, reason):
    q, k, v, _ = _inputs(device, heads=4, q_len=8, **shape)
    assert re.search(reason, attention_supported(q, k, v))
    with pytest.raises(ValueError, match=f"flash_attention cannot run these inputs: {reason}"):
        flash_attention(q, k, v)


def test_attention_supported_rejects_3d_and_cpu_without_interpreter(monkeypatch):
    q = torch.randn(2, 8, 16)
    assert "expected 4-D" in attention_supported(q, q, q)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q4 = torch.randn(1, 2, 8, 16)
    assert "need a CUDA device" in attention_supported(q4, q4, q4)
