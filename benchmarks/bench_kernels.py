"""Benchmark the Triton kernels against torch on the same inputs, in the same run; prints JSON.

Attention: TFLOP/s forward and forward+backward, bf16, causal and not, seq 1k..16k, head dim
64 and 128, beside F.scaled_dot_product_attention restricted to its flash backend.
FLOPs (as in the flash-attention papers): forward = 4 * batch * heads * seq^2 * head_dim
(two matmuls of 2*s^2*d each), halved when causal; backward = 2.5x forward, so
forward+backward = 3.5x forward.

Bias-GeLU: effective GB/s forward and backward beside eager torch and torch.compile, and as a
fraction of the device's HBM bandwidth. Bytes counted are the fused minimum for every
implementation (forward reads x, writes y; backward reads x and dy, writes dx), so the numbers
compare like for like: an unfused implementation shows up as a lower effective bandwidth.

    python benchmarks/bench_kernels.py            # on a CUDA GPU
    python benchmarks/bench_kernels.py --smoke    # tiny shapes on the CPU interpreter (checks only)
Without a CUDA device and without --smoke it prints {"status": "skipped", ...} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

# Peak HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # H100 SXM; A100 80GB
HBM_NOTES = {"H100": "H100 SXM figure; a PCIe card has 2.0e12", "A100": "A100 80GB figure; 40GB has 1.56e12"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the Triton CPU interpreter")
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq for attention")
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim for attention")
    parser.add_argument("--gelu-shapes", default="8192x8192,8192x16384,8192x11008",
                        help="rows x cols of the bias-GeLU input (cols = bias size)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.seq_lens, args.head_dims, args.tokens, args.hidden = "48", "16", 96, 32
        args.gelu_shapes, args.no_compile = "40x72", True
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print(json.dumps({"status": "skipped", "reason": "no CUDA device; use --smoke for an interpreter check"}))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"status": "ok", **_environment(device), "attention": [], "bias_gelu": []}
    for seq in _ints(args.seq_lens):
        for head_dim in _ints(args.head_dims):
            for causal in (False, True):
                result["attention"].append(_bench_attention(device, args, seq, head_dim, causal))
    peak = result["hbm_bytes_per_s"]
    for shape in args.gelu_shapes.split(","):
        rows, cols = (int(n) for n in shape.lower().split("x"))
        result["bias_gelu"].append(_bench_bias_gelu(device, rows, cols, peak, compile_=not args.no_compile))
    print(json.dumps(result, indent=1))
    return 0


def _ints(csv: str) -> list[int]:
    return [int(n) for n in csv.split(",") if n]


def _environment(device) -> dict:
    import torch
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"
    key = next((k for k in HBM_BYTES_PER_S if k in name), None)
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hbm_bytes_per_s": HBM_BYTES_PER_S.get(key),
        "hbm_note": HBM_NOTES.get(key),
    }


def _time_ms(fn, grad_to_none=None) -> float:
    """Mean milliseconds per call: triton's do_bench on CUDA, a plain timer on the interpreter."""
    import torch

    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, grad_to_none=grad_to_none)
    fn()  # warm up
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _sdpa_flash(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _bench_attention(device, args, seq: int, head_dim: int, causal: bool) -> dict:
    import torch

    from triton_kernels import flash_attention

    batch, heads = max(1, args.tokens // seq), max(1, args.hidden // head_dim)
    row = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal, "dtype": "bf16",
           "sdpa_backend": "flash" if device.type == "cuda" else "cpu default (smoke run)"}
    try:
        q, k, v, grad = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16)
                         for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        fwd_flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
        impls = {"triton": lambda: flash_attention(q, k, v, causal=causal),
                 "sdpa_flash": lambda: _sdpa_flash(q, k, v, causal)}
        with torch.no_grad():
            row["max_abs_diff"] = (impls["triton"]() - impls["sdpa_flash"]()).abs().max().item()
        for name, fn in impls.items():
            with torch.no_grad():
                fwd_ms = _time_ms(fn)
            both_ms = _time_ms(lambda fn=fn: fn().backward(grad), grad_to_none=[q, k, v])
            row[name] = {"fwd_ms": fwd_ms, "fwd_tflops": fwd_flops / fwd_ms * 1e-9,
                         "fwd_bwd_ms": both_ms, "fwd_bwd_tflops": 3.5 * fwd_flops / both_ms * 1e-9}
        for kind in ("fwd_tflops", "fwd_bwd_tflops"):
            row[f"{kind}_ratio"] = row["triton"][kind] / row["sdpa_flash"][kind]
    except (RuntimeError, ValueError) as err:  # OOM or an unavailable SDPA backend: keep going
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    _free(device)
    return row


def _bench_bias_gelu(device, rows: int, cols: int, peak: float | None, compile_: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from triton_kernels import bias_gelu

    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(cols, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def eager(x, bias):
        return F.gelu(x + bias)

    impls = {"triton": bias_gelu, "eager": eager}
    if compile_:
        impls["compile"] = torch.compile(eager)
    element = x.element_size()
    fwd_bytes, bwd_bytes = 2 * rows * cols * element, 3 * rows * cols * element
    row = {"rows": rows, "cols": cols, "dtype": "bf16", "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes}
    for name, fn in impls.items():
        with torch.no_grad():
            fwd_ms = _time_ms(lambda fn=fn: fn(x, bias))
        out = fn(x, bias)
        bwd_ms = _time_ms(lambda: out.backward(grad, retain_graph=True), grad_to_none=[x, bias])
        stats = {"fwd_ms": fwd_ms, "fwd_gbps": fwd_bytes / fwd_ms * 1e-6,
                 "bwd_ms": bwd_ms, "bwd_gbps": bwd_bytes / bwd_ms * 1e-6}
        if peak:
            stats["fwd_hbm_fraction"] = stats["fwd_gbps"] * 1e9 / peak
            stats["bwd_hbm_fraction"] = stats["bwd_gbps"] * 1e9 / peak
        row[name] = stats
    _free(device)
    return row


def _free(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
