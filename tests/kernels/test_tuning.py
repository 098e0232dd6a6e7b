"""Autotuning candidates: the fixed tiles are always among them, and every candidate computes
the same attention (run on the interpreter with that candidate forced, ragged and causal)."""

from itertools import zip_longest

import pytest
import torch

pytest.importorskip("triton")

from lightning_ptdp.triton_kernels import flash_attention
from lightning_ptdp.triton_kernels._config import (
    ATTENTION_CANDIDATES,
    FP32_CANDIDATES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    attention_tiles,
    seq_bucket,
)
from lightning_ptdp.triton_kernels.reference import attention_reference

STAGES = ("fwd", "dkdv", "dq")


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_fixed_tiles_are_candidates(monkeypatch, dtype, head_dim):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's tiles (read at call time)
    pool = FP32_CANDIDATES if dtype == torch.float32 else ATTENTION_CANDIDATES
    for stage in STAGES:
        assert attention_tiles(head_dim, "fwd" if stage == "fwd" else "bwd", dtype) in pool[stage]


def test_sequence_buckets():
    assert [seq_bucket(n) for n in (1, 128, 129, 1000, 4096, 5000)] == [128, 128, 256, 1024, 4096, 8192]


def _block_shapes(stage):
    shapes = [(t.block_m, t.block_n) for t in (*ATTENTION_CANDIDATES[stage], *FP32_CANDIDATES[stage])]
    return list(dict.fromkeys(shapes))


CASES = list(zip_longest(*(_block_shapes(stage) for stage in STAGES)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces one candidate on the interpreter")
@pytest.mark.parametrize("blocks", CASES, ids=lambda b: "-".join(f"{s[0]}x{s[1]}" if s else "same" for s in b))
def test_every_candidate_tile_is_correct(monkeypatch, blocks):
    import triton

    from lightning_ptdp.triton_kernels import attention_bwd, attention_fwd  # noqa: F401 - builds the tuned kernels
    from lightning_ptdp.triton_kernels.tuning import _TUNED

    for stage, shape in zip(STAGES, blocks):
        if shape is not None:
            config = triton.Config({"BLOCK_M": shape[0], "BLOCK_N": shape[1]}, num_warps=1, num_stages=1)
            monkeypatch.setattr(_TUNED[stage], "configs", [config])
    gen = torch.Generator().manual_seed(0)
    for causal, q_len, kv_len in ((True, 150, 150), (False, 97, 170)):
        q = torch.randn(1, 4, q_len, 32, generator=gen, requires_grad=True)
        k, v = (torch.randn(1, 2, kv_len, 32, generator=gen, requires_grad=True) for _ in range(2))
        grad = torch.randn(1, 4, q_len, 32, generator=gen)
        out = flash_attention(q, k, v, causal=causal)
        got = torch.autograd.grad(out, (q, k, v), grad)
        ref = attention_reference(q.double(), k.double(), v.double(), causal=causal)
        want = torch.autograd.grad(ref, (q, k, v), grad.double())
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


def test_clear_forgets_what_an_untuned_part_cached(monkeypatch, device):
    """The GPU suite's correctness part runs with TRITON_KERNELS_AUTOTUNE=0; the attention benchmark
    after it must tune its keys itself, not reuse that part's one config (benchmarks/gpu/correctness.py)."""
    from lightning_ptdp.triton_kernels import flash_attention, tuning

    monkeypatch.setenv("TRITON_KERNELS_AUTOTUNE", "0")
    q = torch.randn(1, 2, 64, 16, device=device)
    flash_attention(q, q, q)
    # on a GPU that launch cached its one untimed config under its key; the interpreter has one
    # candidate and caches nothing, so put one there as the GPU would
    for tuner in tuning._TUNED.values():
        tuner.cache.setdefault((1024, 16, False), tuner.configs[0])
    assert tuning.chosen()
    tuning.clear()
    assert tuning.chosen() == []
