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


def _world_size(item: pytest.Item) -> int:
    marker = item.get_closest_marker("world_size")
    if marker is not None:
        return marker.args[0]
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in ("devices", "world_size", "tp", "dp"):
        if isinstance(params.get(key), int):
            return params[key]
    return 0


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run distributed tests grouped by world size, so each pool size starts once per session."""
    distributed = [i for i in items if "distributed" in i.nodeid.split("/")]
    if not distributed:
        return
    first = items.index(distributed[0])
    rest = [i for i in items if i not in set(distributed)]
    ordered = sorted(distributed, key=_world_size)
    items[:] = rest[:first] + ordered + rest[first:]
