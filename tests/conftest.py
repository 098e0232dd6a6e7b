"""Shared fixtures. ``dist_pool(n)`` hands out a pool of n gloo ranks, kept alive between tests
(the two sizes used last: asking for a third size closes the one used longest ago)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lightning_ptdp.testing import DistributedPool

# Lightning's tips and torch's thread pools add noise and contention on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Threads per worker past which a pool starts afresh. Torch keeps every process group a test makes (its
# DTensor caches name them, so a task cannot destroy its own), and each gloo group's threads wake every few
# milliseconds: measured 380 threads in each of 8 idle workers, 14% of a core each; 95 and 245 threads in
# each of 4, 1.4% and 3.5%. A fit adds about 9 threads a worker, and a restart costs each rank its imports
# again (5-20 s on the 2-core machine): past 100 a pool restarted every 10 or so tests.
POOL_THREAD_LIMIT = 250


# Pools kept at once. A test that saves on one size and resumes on another goes back and forth between
# two pools; starting one costs each rank torch's and the models' imports (measured 8-18 s on the 2-core
# machine, most of test_resume.py's time), an idle one a few of its gloo threads' wake-ups.
POOLS_KEPT = 2


class _PoolCache:
    def __init__(self) -> None:
        self.pools: dict[int, DistributedPool] = {}  # by world size, the one used last at the end

    def __call__(self, world_size: int) -> DistributedPool:
        pool = self.pools.pop(world_size, None)
        if pool is not None and (not pool.alive or pool.threads() > POOL_THREAD_LIMIT):
            pool.close(force=not pool.alive)
            pool = None
        if pool is None:
            while len(self.pools) >= POOLS_KEPT:
                self.pools.pop(next(iter(self.pools))).close()
            pool = DistributedPool(world_size)
        self.pools[world_size] = pool
        return pool

    def close(self) -> None:
        while self.pools:
            self.pools.popitem()[1].close()


_POOLS = _PoolCache()


@pytest.fixture(scope="session")
def dist_pool():
    yield _POOLS
    _POOLS.close()


@pytest.fixture(autouse=True)
def _no_idle_pool(request):
    """A test outside tests/distributed closes the pools first: the distributed tests run together (see
    below), and an idle pool's gloo threads would take CPU from every test after them."""
    if "distributed" not in request.node.nodeid.split("/"):
        _POOLS.close()
    yield


def _world_size(item: pytest.Item) -> int:
    marker = item.get_closest_marker("world_size")
    if marker is not None:
        return marker.args[0]
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in ("devices", "world_size", "tp", "dp"):
        if isinstance(params.get(key), int):
            return params[key]
    # unmarked: the size most tests use (a test on another size is marked), not ahead of every group
    return 2 if "dist_pool" in getattr(item, "fixturenames", ()) else 0


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run distributed tests grouped by world size, so each pool size starts once per session."""
    distributed = [i for i in items if "distributed" in i.nodeid.split("/")]
    if not distributed:
        return
    first = items.index(distributed[0])
    rest = [i for i in items if i not in set(distributed)]
    ordered = sorted(distributed, key=_world_size)
    items[:] = rest[:first] + ordered + rest[first:]


@pytest.fixture(autouse=True)
def _test_process_left_clean(request):
    """A test that runs a strategy in the pytest process itself (not in a pool rank) leaves its process
    group's store listening on MASTER_PORT and its SIGTERM handler installed: later tests that launch
    processes then meet EADDRINUSE. Fail that test by name, and clean up so the rest of the run is sound."""
    import signal

    import torch.distributed as dist

    port, sigterm = os.environ.get("MASTER_PORT"), signal.getsignal(signal.SIGTERM)
    yield
    leaked = []
    if dist.is_available() and dist.is_initialized():
        leaked.append("a default process group")
        dist.destroy_process_group()
    if os.environ.get("MASTER_PORT") != port:
        leaked.append(f"MASTER_PORT={os.environ.get('MASTER_PORT')}")
        os.environ.pop("MASTER_PORT") if port is None else os.environ.__setitem__("MASTER_PORT", port)
    if signal.getsignal(signal.SIGTERM) is not sigterm:
        leaked.append("a SIGTERM handler")
        signal.signal(signal.SIGTERM, sigterm)
    if leaked:
        pytest.fail(
            f"{request.node.nodeid} left {', '.join(leaked)} in the pytest process: run the strategy in a "
            "dist_pool rank, or Lightning's default strategy for a one-process reference"
        )


_STATUS = pytest.StashKey[object]()


def _checkout_status() -> str | None:
    """``git status --porcelain`` of the checkout, None outside one (an installed copy, a tarball)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=False
    )
    return proc.stdout if proc.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STATUS] = _checkout_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test run never writes into the source tree: the run fails if the checkout's status changed."""
    before, after = session.config.stash.get(_STATUS, None), _checkout_status()
    if before is None or after is None or after == before:
        return
    changed = sorted(set(after.splitlines()) ^ set(before.splitlines()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"the test run changed the checkout (git status): {changed}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
