"""A chunk's final gradients sent in buckets during its last backward of the step, as each bucket's
gradients are accumulated (Megatron-Core's overlapped gradient reduction, per pipeline chunk)."""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

BUCKETS_PER_CHUNK = 8  # the last bucket of a chunk is what its backward cannot hide: keep it small


class LastBackwardBuckets:
    """Armed before a chunk's last gradient-producing backward: ``params`` in static buckets, in
    reverse registration order (roughly the order backward finishes them). A bucket is launched
    once every gradient in it was accumulated and every bucket before it was launched, so every dp
    replica launches the same buckets in the same order; ``close`` launches what is left."""

    def __init__(self, params: list[nn.Parameter], launch: Callable[[list[nn.Parameter]], Any]) -> None:
        self.launch = launch
        self.buckets = _split(list(reversed(params)), BUCKETS_PER_CHUNK)
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.next = 0
        self.handles = [
            param.register_post_accumulate_grad_hook(lambda _param, i=index: self._accumulated(i))
            for index, bucket in enumerate(self.buckets)
            for param in bucket
        ]

    def _accumulated(self, index: int) -> None:
        self.waiting[index] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] <= 0:
            self.launch(self.buckets[self.next])
            self.next += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for bucket in self.buckets[self.next :]:  # parameters this backward did not reach, or not by hooks
            self.launch(bucket)
        self.next = len(self.buckets)


def _split(params: list[nn.Parameter], parts: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of about equal element count (at most ``parts``, none empty)."""
    total = sum(p.numel() for p in params)
    target = max(1, -(-total // parts))
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in params:
        if size >= target and buckets[-1]:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += param.numel()
    return [b for b in buckets if b]
