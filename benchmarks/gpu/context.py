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
    variants: tuple[str, ...] | None = None
    """The training part's variants to run (None: all of them)."""
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

    def graph_time_ms(self, fn: Callable[[], Any], replays: int = 20, calls_per_graph: int = 10) -> float:
        """Median GPU milliseconds per call of ``fn`` replayed from a CUDA graph: the kernels' own
        time, without the Python/dispatcher cost of launching them (see ``launch_us``); on the
        interpreter, ``time_ms``."""
        if not self.cuda:
            return self.time_ms(fn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles, autotunes) outside the capture
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(replays + 1):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls_per_graph)
        times = sorted(times[1:])  # the first replay uploads the graph
        return times[len(times) // 2]

    def launch_us(self, fn: Callable[[], Any], calls: int = 100) -> float:
        """Host microseconds per call of ``fn``, queued without waiting for the device."""
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls * 1e6
        if self.cuda:
            torch.cuda.synchronize()
        return host

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def short_error(err: BaseException) -> str:
    """'Type: first line' of an exception, for a JSON row."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
