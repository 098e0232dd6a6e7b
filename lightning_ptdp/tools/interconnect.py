"""The GPU interconnect: NVLink pairs from ``nvidia-smi topo -m``, and collective bandwidth
measured the way nccl-tests reports it (its PERFORMANCE.md). For a collective over n ranks on S
bytes taking t seconds: ``algbw = S / t`` and ``busbw = algbw * factor(n)``, the traffic per link,
comparable with the hardware's peak for any n. S is the whole buffer (all ranks' chunks for
all-gather and reduce-scatter); times are the mean over ranks. ``run_local_benchmark`` uses n local
gloo processes, ``run_launched_benchmark`` the launched group (nccl on GPUs); ``ptdp doctor --bench``
calls one of them. Given a layout's groups, ``AXIS_OPS`` also run inside them, side by side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import shutil
import subprocess
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ptdp.testing import free_port

BENCH_TIMEOUT = timedelta(seconds=120)


def nvlink_pairs(topo_matrix: str) -> int:
    """GPU pairs joined by NVLink in ``nvidia-smi topo -m`` output (cells "NV1".."NV18")."""
    rows = [line.split() for line in topo_matrix.splitlines() if re.match(r"GPU\d+\s", line)]
    return sum(1 for cells in rows for cell in cells if re.fullmatch(r"NV\d+", cell)) // 2


def nvidia_smi_nvlink_pairs() -> Optional[int]:
    """nvlink_pairs of this machine; None without nvidia-smi or when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return nvlink_pairs(out.stdout) if out.returncode == 0 else None


BUS_FACTORS: dict[str, Callable[[int], float]] = {  # busbw = algbw * factor(n)
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
AXIS_OPS: dict[str, str] = {"ep": "all_to_all", "cp": "all_gather"}
"""Axis -> the collective its groups run every layer (the tokens to their experts, the keys and values)."""


@dataclass(frozen=True)
class BenchRow:
    """One collective at one size; ``size_bytes`` is nccl-tests' S (the whole buffer, all ranks' chunks)."""

    op: str
    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    group: str = "world"
    """"world", or the layout axis (ep, cp) whose groups ran the collective side by side."""


def bench_row(op: str, size_bytes: int, seconds: float, world_size: int, group: str = "world") -> BenchRow:
    algbw = size_bytes / seconds / 1e9  # GB/s with GB = 1e9, as nccl-tests
    return BenchRow(op, size_bytes, seconds * 1e6, algbw, algbw * BUS_FACTORS[op](world_size), group)


def _collective(op: str, nbytes: int, device: torch.device, group=None) -> tuple[Callable[[], object], int]:
    """A zero-argument call running ``op`` in ``group`` (default: the world) on preallocated float32
    buffers, and its size S in bytes. send_recv is the world's ring."""
    n, rank = dist.get_world_size(group), dist.get_rank()
    x = torch.ones(max(n, nbytes // 4 // n * n), device=device)
    out, chunk = torch.empty_like(x), x.numel() // n
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pair = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
    calls = {
        "all_reduce": lambda: dist.all_reduce(x, group=group),
        "all_gather": lambda: gather(out, x[:chunk], group=group),
        "reduce_scatter": lambda: scatter(out[:chunk], x, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, x, group=group),
        "send_recv": lambda: [work.wait() for work in dist.batch_isend_irecv(pair)],
    }
    return calls[op], x.numel() * 4


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(run: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Seconds per call of ``run``, the mean over every rank of the world."""
    for _ in range(warmup):
        run()
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed)
    return elapsed.item() / dist.get_world_size()


def benchmark_collectives(
    sizes: Sequence[int],
    device: torch.device,
    iters: int = 5,
    warmup: int = 2,
    axis_groups: Optional[Mapping[str, list[list[int]]]] = None,
) -> list[BenchRow]:
    """Every collective over the default group, then each ``AXIS_OPS`` op in every group of its axis
    at once (``axis_groups``: axis -> global ranks of each group, as ParallelDims.group_ranks gives);
    called on every rank; the time is the mean over ranks (nccl-tests' default)."""
    rows, n = [], dist.get_world_size()
    if n < 2:
        raise ValueError(f"the collective benchmark needs at least 2 ranks, the group has {n}")
    for op in BUS_FACTORS:
        for nbytes in sizes:
            run, size = _collective(op, nbytes, device)
            rows.append(bench_row(op, size, _time(run, device, iters, warmup), n))
    for axis, groups in (axis_groups or {}).items():
        if len(groups[0]) < 2:
            continue
        group, _ = dist.new_subgroups_by_enumeration(groups)
        for nbytes in sizes:
            run, size = _collective(AXIS_OPS[axis], nbytes, device, group)
            rows.append(bench_row(AXIS_OPS[axis], size, _time(run, device, iters, warmup), len(groups[0]), axis))
    return rows


def _local_worker(
    rank: int, world_size: int, port: int, sizes: Sequence[int], iters: int, results, axis_groups
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=BENCH_TIMEOUT
        )
        rows = benchmark_collectives(sizes, torch.device("cpu"), iters, axis_groups=axis_groups)
        dist.destroy_process_group()
        results.put((rank, "ok", rows))
    except BaseException:  # reported to the parent as a FAIL line
        results.put((rank, "error", traceback.format_exc()))


def run_local_benchmark(
    world_size: int,
    sizes: Sequence[int],
    iters: int = 5,
    start_method: str = "spawn",
    axis_groups: Optional[Mapping[str, list[list[int]]]] = None,
) -> list[BenchRow]:
    """Start ``world_size`` local processes on gloo (CPU) and benchmark the collectives between them."""
    if world_size < 2:
        raise ValueError(f"--bench-ranks={world_size}: the benchmark needs at least 2 ranks")
    ctx = mp.get_context(start_method)
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_local_worker, args=(r, world_size, port, sizes, iters, results, axis_groups), daemon=True)
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = _collect(results, procs, time.monotonic() + BENCH_TIMEOUT.total_seconds())
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {rank}: {value}" for rank, (status, value) in sorted(outcomes.items()) if status != "ok"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return outcomes[0][1]


def _collect(results, procs: list, deadline: float) -> dict[int, tuple[str, object]]:
    """Each rank's (status, value); a rank that died or ran past the deadline is an error."""
    outcomes: dict[int, tuple[str, object]] = {}
    while len(outcomes) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.2)
            outcomes[rank] = (status, value)
            continue
        except queue.Empty:
            pass
        silent = [r for r in range(len(procs)) if r not in outcomes]
        dead = [r for r in silent if not procs[r].is_alive()]
        if dead or time.monotonic() > deadline:
            why = {r: f"process exited with code {procs[r].exitcode}" for r in dead}
            return {**outcomes, **{r: ("error", why.get(r, "no result in time")) for r in silent}}
    return outcomes


def run_launched_benchmark(
    sizes: Sequence[int], iters: int = 5, axis_groups: Optional[Mapping[str, list[list[int]]]] = None
) -> tuple[str, list[BenchRow]]:
    """Under torchrun/SLURM: join the launched group (nccl on GPUs, else gloo) and benchmark it."""
    use_nccl = torch.cuda.is_available() and dist.is_nccl_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_nccl else torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_nccl else "gloo", timeout=BENCH_TIMEOUT)
    try:
        return dist.get_backend(), benchmark_collectives(sizes, device, iters, axis_groups=axis_groups)
    finally:
        dist.destroy_process_group()


def format_benchmark(rows: Sequence[BenchRow]) -> str:
    lines = [f"{'op':<15}{'group':<7}{'size (B)':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    lines += [
        f"{r.op:<15}{r.group:<7}{r.size_bytes:>12}{r.time_us:>12.1f}{r.algbw_gbps:>12.3f}{r.busbw_gbps:>12.3f}"
        for r in rows
    ]
    return "\n".join(lines)


def parse_bytes(text: str) -> list[int]:
    """ "1M,64M" -> [1048576, 67108864] (K, M, G are powers of 1024)."""
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", item.upper())
        if not match:
            raise ValueError(f"{item!r} is not a size like 1M or 512K")
        sizes.append(int(match.group(1)) * scale[match.group(2)])
    return sorted(sizes)


def format_size(nbytes: int) -> str:
    """65536 -> "64 KiB", 3 * 2**29 -> "1.5 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
