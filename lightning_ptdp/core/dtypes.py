"""The precision a partial statistic is computed in: fp32 at least, the input's own where finer."""

from __future__ import annotations

import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 where it is coarser (bf16, fp16), as is where it is fp32 or fp64: ``.float()``
    would round an fp64 run (Lightning's precision="64-true") to fp32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
