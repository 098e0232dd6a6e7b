"""Launch settings shared by the kernels: interpreter detection, tile sizes, dot precision.

Nothing here imports triton, so the package stays importable where triton is absent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Head dims the attention kernels are compiled for: tl.dot needs every dim >= 16 and
# tl.arange needs powers of two; 256 would not fit the K/V tiles in shared memory.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# CUDA caps grid axis 1 (our batch*heads axis) at 2**16 - 1 programs.
MAX_GRID_Y = 65535

# Tiles used under TRITON_INTERPRET=1: the smallest tl.dot accepts, so tests on
# tiny shapes still walk several blocks, the ragged tail and the causal diagonal.
INTERPRETER_BLOCK = 16


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks triton to run kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Tiles:
    """Block sizes and launch options of one kernel launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def attention_tiles(head_dim: int, stage: str, dtype: torch.dtype = torch.bfloat16) -> Tiles:
    """Tiles for the attention kernels; ``stage`` is "fwd" or "bwd"."""
    if interpreting():
        return Tiles(INTERPRETER_BLOCK, INTERPRETER_BLOCK, num_warps=1, num_stages=1)
    warps = 8 if head_dim > 64 else 4
    if dtype == torch.float32:
        # 4-byte tiles: the 16-bit tiles below would need up to 256 KB of shared memory at
        # d=128 (measured when compiling for sm_90), over the 227 KB an H100/H200 block may use.
        return Tiles(64, 32, num_warps=warps, num_stages=2) if stage == "fwd" else Tiles(32, 32, warps, 2)
    if stage == "fwd":
        # 128 query rows per program (8 warps x 16 rows at d=128) against 64-key tiles:
        # q tile + 3 stages of K/V tiles stay under ~130 KB of shared memory at d=128 bf16,
        # within both A100 (164 KB) and H100/H200 (228 KB). Not autotuned.
        return Tiles(128, 64, num_warps=warps, num_stages=3)
    # Backward keeps two fp32 accumulators (dK, dV or dQ) of block x head_dim in registers,
    # so 64x64 tiles with 2 stages: conservative, fits sm80 and sm90. Not autotuned.
    return Tiles(64, 64, num_warps=warps, num_stages=2)


# Candidates triton.autotune times on a GPU, once per (sequence bucket, head dim, causal, dtype).
# attention_tiles' fixed choice is among them (timed first), so tuning can only match or beat it;
# each compiles for sm_90 within its shared memory (tests/kernels/compile_check.py compiles every
# one) and computes the same attention (tests/kernels/test_tuning.py); fp32 keeps its small tiles. Hopper reasoning: 128-row query tiles with 3 stages keep
# both warpgroups' wgmma busy in the forward; the backward holds two fp32 accumulators, so
# larger tiles there trade registers for fewer passes over Q (dK/dV) or K/V (dQ).
ATTENTION_CANDIDATES: dict[str, tuple[Tiles, ...]] = {
    "fwd": (Tiles(128, 64, 8, 3), Tiles(128, 64, 4, 3), Tiles(128, 128, 8, 2), Tiles(64, 64, 4, 4)),
    "dkdv": (Tiles(64, 64, 8, 2), Tiles(64, 64, 4, 2), Tiles(32, 128, 8, 2), Tiles(64, 128, 8, 2)),
    "dq": (Tiles(64, 64, 8, 2), Tiles(64, 64, 4, 2), Tiles(128, 32, 4, 3), Tiles(128, 64, 8, 2)),
}
FP32_CANDIDATES: dict[str, tuple[Tiles, ...]] = {
    "fwd": (Tiles(64, 32, 8, 2), Tiles(64, 32, 4, 2)),
    "dkdv": (Tiles(32, 32, 8, 2), Tiles(32, 32, 4, 2)),
    "dq": (Tiles(32, 32, 8, 2), Tiles(32, 32, 4, 2)),
}


def autotune_enabled() -> bool:
    """TRITON_KERNELS_AUTOTUNE=0 launches attention_tiles' fixed choice (no timing, one compile)."""
    return os.environ.get("TRITON_KERNELS_AUTOTUNE", "1").strip() != "0"


def attention_candidates(stage: str, head_dim: int, dtype: torch.dtype) -> tuple[Tiles, ...]:
    """Tiles to time for one launch; ``stage`` is "fwd", "dkdv" or "dq". The fixed choice alone
    when tuning is off or under the interpreter."""
    fixed = attention_tiles(head_dim, "fwd" if stage == "fwd" else "bwd", dtype)
    if interpreting() or not autotune_enabled():
        return (fixed,)
    pool = FP32_CANDIDATES if dtype == torch.float32 else ATTENTION_CANDIDATES
    return (fixed, *(t for t in pool[stage] if t != fixed))


def seq_bucket(length: int) -> int:
    """Autotuning key for a sequence length: the next power of two, at least 128, so ragged
    lengths share one tuning instead of timing every configuration again."""
    return max(128, _next_power_of_2(length))


def elementwise_tiles(n_cols: int) -> Tiles:
    """Tiles for the row-major elementwise kernels (bias-GeLU) over an (M, n_cols) view."""
    if interpreting():
        # Interpreter cost is per program: ~1K-element tiles keep odd test shapes multi-block.
        cols = min(_next_power_of_2(n_cols), 64)
        return Tiles(1024 // cols, cols, num_warps=1, num_stages=1)
    # ~4K elements per program, up to 1024 contiguous columns: enough bytes in flight per SM
    # for a memory-bound kernel. Not autotuned.
    cols = min(_next_power_of_2(n_cols), 1024)
    return Tiles(4096 // cols, cols, num_warps=4, num_stages=1)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs follow torch's TF32 switch, 16-bit inputs are exact."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """The triton interpreter returns garbage for bf16 tl.dot (seen on 3.9): compute in fp32."""
    return interpreting() and dtype == torch.bfloat16


def check_interpreted(kernel: object) -> None:
    """Fail clearly if TRITON_INTERPRET=1 was set only after the kernels were defined."""
    if interpreting() and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after lightning_ptdp.triton_kernels compiled its kernels for the GPU; "
            "set it before the first `import lightning_ptdp.triton_kernels.attention` / `.bias_gelu`."
        )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
