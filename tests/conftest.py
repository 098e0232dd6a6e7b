"""Shared fixtures. ``dist_pool(n)`` hands out a pool of n gloo ranks, kept alive between tests
(one pool at a time: asking for another size closes the previous one)."""

from __future__ import annotations

import os

import pytest

from lightning_ptdp.testing import DistributedPool

# Lightning's tips and torch's thread pools add noise and contention on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


class _PoolCache:
    def __init__(self) -> None:
        self.pool: DistributedPool | None = None

    def __call__(self, world_size: int) -> DistributedPool:
        if self.pool is not None and (self.pool.world_size != world_size or not self.pool.alive):
            self.pool.close(force=not self.pool.alive)
            self.pool = None
        if self.pool is None:
            self.pool = DistributedPool(world_size)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


@pytest.fixture(scope="session")
def dist_pool():
    cache = _PoolCache()
    yield cache
    cache.close()
