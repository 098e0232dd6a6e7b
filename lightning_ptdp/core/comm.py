"""Small distributed utilities every layer uses: flat collectives, errors raised on every rank,
tensors made picklable. Nothing here knows about tensor, pipeline or data parallelism."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in order: the choices an error message offers."""
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_shape(value: Any) -> Optional[tuple[int, ...]]:
    """The shape of a tensor-like value (anything with ``.shape``), None for other values."""
    return tuple(value.shape) if hasattr(value, "shape") else None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's data of a tensor that ZeRO may have sharded into a DTensor (a view, writable)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def detached_cpu(value: Any) -> Any:
    """``value`` with every tensor in it detached and copied to CPU (for pickling across ranks)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, value)


def flat_all_reduce(tensors: list[torch.Tensor], group: Any, scale: float = 1.0) -> None:
    """All-reduce ``tensors`` in place through one flat buffer per dtype (one collective each)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def all_reduce_grads(params: list[nn.Parameter], group: Any, scale: float = 1.0) -> None:
    """Sum (times ``scale``) the gradients of ``params`` over ``group`` in one flat buffer per dtype,
    built from the parameter list so it is identical on every rank whatever each backward reached:
    a missing gradient contributes zeros, and stays None only where no rank has one (as one process)."""
    if not params:
        return
    had = [p.grad is not None for p in params]
    for param, present in zip(params, had):
        if not present:
            param.grad = torch.zeros_like(param)
    flags = torch.tensor(had, dtype=torch.float32, device=local_tensor(params[0]).device)
    flat_all_reduce([*(local_tensor(p.grad) for p in params), flags], group, scale)
    for param, anywhere in zip(params, summed_flags(flags, had)):
        if not anywhere:
            param.grad = None


def summed_flags(flags: torch.Tensor, own: list[bool]) -> list:
    """The all-reduced had-gradient flags; on meta (a dry run: the fake group sums nothing) the rank's own."""
    return own if flags.is_meta else flags.tolist()


def raise_on_every_rank(problems: list[str], error: type[Exception] = ValueError) -> None:
    """Raise the problems any rank found, on every rank, before anyone enters a collective that
    would wait for the rank that stopped. A problem every rank has is said once; one that only
    some ranks have names them. A collective: every rank calls it, with its own (maybe empty) list."""
    everyone: list[Any] = [problems]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
    ranks: dict[str, list[int]] = {}
    for rank, found in enumerate(everyone):
        for problem in found:
            ranks.setdefault(problem, []).append(rank)
    if ranks:
        raise error("; ".join(p if len(r) == len(everyone) else f"{p} (on ranks {r})" for p, r in ranks.items()))


class PendingAllReduce:
    """``all_reduce_grads`` started without waiting: the collective runs on the process group's own
    threads while this rank goes on computing; ``wait`` puts the results into ``.grad``."""

    def __init__(self, params: list[nn.Parameter], group: Any, scale: float = 1.0) -> None:
        self.params, self.scale = params, scale
        self.started = time.perf_counter()
        self.done: Optional[float] = None
        self._had = had = [p.grad is not None for p in params]
        device = local_tensor(params[0]).device
        tensors = [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p)) for p in params]
        tensors.append(torch.tensor(had, dtype=torch.float32, device=device))
        self._buckets: list[tuple[torch.Tensor, list[int], Any]] = []
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(index)
        for indices in by_dtype.values():
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
            work = dist.all_reduce(flat, group=group, async_op=True)
            self._buckets.append((flat, indices, work))
        self._tensors = tensors
        works = [work for *_, work in self._buckets]
        try:  # when the last bucket arrives, for the timeline (gloo and nccl both have futures)
            works[-1].get_future().then(lambda _: setattr(self, "done", time.perf_counter()))
        except (AttributeError, RuntimeError):
            pass

    def wait(self) -> None:
        for flat, indices, work in self._buckets:
            work.wait()
            if self.scale != 1.0:
                flat.mul_(self.scale)
            offset = 0
            for i in indices:
                tensor = self._tensors[i]
                self._tensors[i] = flat[offset : offset + tensor.numel()].view_as(tensor)
                offset += tensor.numel()
        self.done = self.done or time.perf_counter()
        flags = summed_flags(self._tensors[-1], self._had)
        for param, reduced, anywhere in zip(self.params, self._tensors, flags):
            if not anywhere:  # no rank has a gradient for it: stays None, as in one process
                param.grad = None
            elif param.grad is None:
                param.grad = reduced.clone()
            else:
                local_tensor(param.grad).copy_(reduced)
