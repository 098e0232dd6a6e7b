"""Run a function on N gloo ranks, reusing the processes across calls.

Starting a process that imports torch and Lightning costs seconds. ``DistributedPool`` starts N
workers and the default process group once, then runs one function after another on all ranks and
returns the per-rank results. Each worker looks to Lightning like a torchrun child (RANK,
LOCAL_RANK, WORLD_SIZE... set), so a function may build a ``Trainer(devices=N)`` and call ``fit``.
A failure or a timeout tears the pool down: no worker is left mid-collective for the next call.
``quiet_trainer`` is the Trainer the tests and benchmarks time: training only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

DEFAULT_CALL_TIMEOUT_S = 600.0
QUIET_TRAINER = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)
"""Trainer settings that leave training alone: no logger, checkpoints, progress bar, summary or validation."""
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def quiet_trainer(**kwargs: Any) -> Any:
    """A Lightning Trainer with ``QUIET_TRAINER``'s settings; ``kwargs`` add to or override them."""
    import lightning as L

    return L.Trainer(**{**QUIET_TRAINER, **kwargs})


class RankFailure(RuntimeError):
    """One or more ranks raised or died; the message holds each failed rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn: Any, threads: int) -> None:
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
    }
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    while True:
        payload = conn.recv_bytes()
        try:
            task = pickle.loads(payload)  # unpickled here, so a function workers cannot import is reported
            if task is None:
                break
            fn, args, kwargs = task
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # report everything, including KeyboardInterrupt/SystemExit in user code
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class DistributedPool:
    """N spawned worker processes sharing one gloo process group."""

    def __init__(self, world_size: int, *, threads_per_rank: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, child, threads_per_rank), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT_S, **kwargs: Any) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by the workers (a module-level function). On any failure the
        pool is closed and RankFailure raised with the failed ranks' tracebacks.
        """
        if not self.alive:
            raise RuntimeError("DistributedPool is closed (a previous call failed); create a new pool")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        stuck_reason = f"no result within the call's timeout ({timeout:.0f}s)"
        while pending:
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.05):
                    pending.discard(rank)
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        status, value = "error", f"process died (exit code {proc.exitcode})"
                    if status == "ok":
                        results[rank] = value
                    else:
                        failures[rank] = value
                        # the others may now wait forever in a collective: give them a short grace
                        deadline = min(deadline, time.monotonic() + 10.0)
                        stuck_reason = f"still running 10s after rank {rank} failed; killed"
                elif not proc.is_alive():
                    pending.discard(rank)
                    failures[rank] = f"process exited with code {proc.exitcode}"
            if pending and time.monotonic() > deadline:
                for rank in pending:
                    failures.setdefault(rank, stuck_reason)
                break
        if failures:
            self.close(force=True)
            report = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
            raise RankFailure(f"{len(failures)} of {self.world_size} ranks failed running {fn.__name__}:\n{report}")
        return results

    def threads(self) -> int:
        """The most threads any worker holds (0 where /proc cannot tell): every gloo group a task made
        keeps its threads, and each wakes every few milliseconds even while the pool is idle."""
        counts = [0]
        for proc in self._procs:
            try:
                counts.append(len(os.listdir(f"/proc/{proc.pid}/task")))
            except OSError:
                pass
        return max(counts)

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if not force and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []

    def __enter__(self) -> "DistributedPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list:
    """One-shot form: start a pool, run ``fn`` on every rank, close the pool."""
    with DistributedPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)


class CollectiveCounter:
    """Counts torch.distributed collectives, and the bytes of their tensors, while active.

    Patches the ``torch.distributed`` module attributes (library code calls them through the
    module, so every call is seen); for tests and benchmarks, never for training runs.
    """

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    NAMES += ("all_gather_single", "reduce_scatter_single")  # what FSDP2 calls

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.by_group: dict[tuple[str, tuple[int, ...]], int] = {}
        """Bytes by (name, the group's global ranks)."""
        self._saved: dict[str, Any] = {}

    def start(self) -> "CollectiveCounter":
        import torch
        import torch.distributed as dist

        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] = self.counts.get(_name, 0) + 1
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]  # FSDP2 passes keywords
                largest = max((a.numel() * a.element_size() for a in tensors), default=0)
                self.bytes[_name] = self.bytes.get(_name, 0) + largest
                group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                key = (_name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
                self.by_group[key] = self.by_group.get(key, 0) + largest
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def stop(self) -> dict[str, int]:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}
        return dict(self.counts)

    def __enter__(self) -> "CollectiveCounter":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
