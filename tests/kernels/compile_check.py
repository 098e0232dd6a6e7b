"""Compile the kernels for a CUDA architecture on a machine without a GPU, with every tile a real
launch may use (each autotuning candidate), and check their shared memory fits. Catches what the
CPU interpreter cannot
see (layout lowering, PTX/ptxas errors, shared-memory overflow). Run with TRITON_INTERPRET unset:

    python tests/kernels/compile_check.py --arch 90 [--all]

Prints one JSON object; exits 1 if any kernel fails to compile or overflows shared memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from lightning_ptdp.triton_kernels._config import (  # noqa: E402
    attention_candidates,
    attention_tiles,
    dot_precision,
    elementwise_tiles,
)
from lightning_ptdp.triton_kernels.attention_bwd import _attn_bwd_delta, _attn_bwd_dkdv, _attn_bwd_dq  # noqa: E402
from lightning_ptdp.triton_kernels.attention_fwd import _attn_fwd  # noqa: E402
from lightning_ptdp.triton_kernels.bias_gelu_kernels import _bias_gelu_bwd, _bias_gelu_fwd  # noqa: E402

# Opt-in maximum dynamic shared memory per block, bytes (CUDA programming guide, per arch).
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_FP32_POINTERS = {"LSE", "DELTA", "DBIAS_PARTIAL"}
_FLOAT_SCALARS = {"qk_scale", "scale"}


def _signature(fn, dtype: torch.dtype, constexprs: dict) -> dict:
    """Argument types as a launch would specialise them: tensors of ``dtype``, i32 sizes."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in _FP32_POINTERS:
            types[name] = "*fp32"
        elif name in _FLOAT_SCALARS:
            types[name] = "fp32"
        elif name.isupper():
            types[name] = "*" + _TYPE_NAMES[dtype]
        else:
            types[name] = "i32"
    return types


def _configs(full: bool):
    """(label, kernel, dtype, constexprs, tiles) for every launch configuration checked."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,)
    for dtype in dtypes:
        for head_dim in (64, 128) if full else (128,):
            for causal in (False, True) if full else (True,):
                meta = dict(CAUSAL=causal, HEAD_DIM=head_dim, PRECISION=dot_precision(dtype), UPCAST=False)
                label = f"{_TYPE_NAMES[dtype]} d={head_dim} causal={causal}"
                # every tile triton.autotune may pick (the fixed choice first)
                for stage, kernel in (("fwd", _attn_fwd), ("dkdv", _attn_bwd_dkdv), ("dq", _attn_bwd_dq)):
                    for tiles in attention_candidates(stage, head_dim, dtype):
                        blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
                        shape = f"{tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"
                        name = f"{kernel.__name__} {label} {shape}"
                        yield name, kernel, dtype, dict(meta, **blocks), tiles
        bwd = attention_tiles(128, "bwd", dtype)
        yield "attn_bwd_delta", _attn_bwd_delta, dtype, dict(BLOCK_M=bwd.block_m, HEAD_DIM=128), bwd
        tiles = elementwise_tiles(11008)
        for tanh in (False, True) if full else (True,):
            for kernel in (_bias_gelu_fwd, _bias_gelu_bwd):
                blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, TANH=tanh)
                yield f"{kernel.__name__} {_TYPE_NAMES[dtype]} tanh={tanh}", kernel, dtype, blocks, tiles


def check(arch: int, full: bool) -> dict:
    results, failures = [], []
    for label, kernel, dtype, constexprs, tiles in _configs(full):
        source = triton.compiler.ASTSource(
            fn=kernel, signature=_signature(kernel, dtype, constexprs), constexprs=constexprs
        )
        try:
            compiled = triton.compile(
                source,
                target=GPUTarget("cuda", arch, 32),
                options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
            )
        except Exception as err:  # noqa: BLE001 - report every failing kernel, not just the first
            failures.append(f"{label}: {type(err).__name__}: {str(err)[:300]}")
            continue
        shared = compiled.metadata.shared
        if shared > SMEM_LIMIT.get(arch, SMEM_LIMIT[80]):
            failures.append(f"{label}: {shared} bytes of shared memory > sm_{arch} limit {SMEM_LIMIT.get(arch)}")
        results.append({"kernel": label, "shared_bytes": shared})
    return {"arch": arch, "triton": triton.__version__, "compiled": results, "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description="compile the Triton kernels for a CUDA arch, no GPU needed")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80 (A100)")
    parser.add_argument("--all", action="store_true", help="every dtype x head dim x causal, not a sample")
    args = parser.parse_args()
    report = check(args.arch, args.all)
    print(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
