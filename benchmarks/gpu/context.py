"""What every part receives: device, smoke flag, a timer, and the sizes to use."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(kw_only=True)
class Context:
    """The run's settings, shared by the parts."""

    device: torch.device
    smoke: bool
    """Tiny sizes on the CPU interpreter: checks that every code path runs, measures nothing."""
    hbm_bytes_per_s: float | None
    peak_flops: float | None
    """Dense bf16 FLOP/s of the device (flops.PEAK_TFLOPS), None where unknown (CPU)."""
    deadline: float = float("inf")
    """time.monotonic() at which the running part's budget ends (set by the suite)."""

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_ms(self, fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
        """Median milliseconds per call: triton's do_bench (warm-up, L2 flush, CUDA events) on a
        GPU; on the interpreter one warm-up and one timed call (smoke runs check, not measure)."""
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def short_error(err: BaseException) -> str:
    """'Type: first line' of an exception, for a JSON row."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
