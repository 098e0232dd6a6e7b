"""When one rank fails, the others stop soon after and say which rank it was.

In ``Strategy.on_exception`` (``FailureRecords``): a rank that raised its own error records it in
the job's rendezvous store (the run's first record wins); a rank whose collective broke, or whose
launcher sent SIGTERM (raised as ``Terminated`` from setup to teardown), rewrites its message to
lead with that record, keeping type and traceback; with no record, the message names the ranks that
had not reported. Store operations wait at most ``failure_timeout``. docs/architecture.md: details.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_ptdp.config import FAILURE_TIMEOUT

log = logging.getLogger(__name__)

KEY_PREFIX = "ptdp/failure"
_SHOWN_RANKS = 16  # a list of silent ranks longer than this is cut, with the count


def job_store() -> Any:
    # torch has no public accessor for the default group's store; the rendezvous store is it
    return dist.distributed_c10d._get_default_store()


def store_host() -> str:
    """Where the job's store lives, for a message saying it is unreachable."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "torchrun's agent, so the launcher itself stopped"
    return (
        "global rank 0's process (Lightning's launcher), so rank 0 failed or was killed; its own output has the error"
    )


def root_cause(error: BaseException) -> BaseException:
    """torch's pipeline schedule wraps a stage's exception in a RuntimeError; report the original."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def is_transport_error(error: BaseException) -> bool:
    """A broken transfer or collective (the peer is gone) rather than this rank's own failure."""
    text = str(error)
    return isinstance(error, getattr(dist, "DistBackendError", ())) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )


class Terminated(Exception):
    """SIGTERM reached a running rank: its launcher is stopping the job (torchrun does once a rank exits)."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@contextmanager
def store_timeout(store: Any, timeout: timedelta) -> Iterator[Any]:
    """The store with a short timeout: it may have died with rank 0, do not wait minutes."""
    previous = store.timeout
    store.set_timeout(timeout)
    try:
        yield store
    finally:
        store.set_timeout(previous)


class FailureRecords:
    """One run's failure records in the job's store: the first error, and which ranks stopped."""

    def __init__(self, store: Any, run: int, rank: int, world_size: int, timeout: timedelta = FAILURE_TIMEOUT) -> None:
        self.store, self.run, self.rank, self.world_size, self.timeout = store, run, rank, world_size, timeout
        self._sigterm: Optional[str] = None  # None (not caught), "running", "stopping" or "released"
        self._sigterm_previous: Any = None
        self.terminated = False  # a SIGTERM came while this rank was already stopping

    @classmethod
    def open(cls, rank: int, world_size: int, timeout: timedelta = FAILURE_TIMEOUT) -> "FailureRecords":
        """Called on every rank once the process group is up and before the run's first collective,
        so the counts of one run's ranks fall together: an earlier fit's records in the same processes
        (same store) are not read as this one's."""
        store = job_store()
        with store_timeout(store, timeout):
            opened = store.add(f"{KEY_PREFIX}/opened", 1)
        return cls(store, (opened - 1) // world_size, rank, world_size, timeout)

    def _key(self, name: str) -> str:
        return f"{KEY_PREFIX}/{self.run}/{name}"

    def record(self, error: BaseException) -> None:
        """Record this rank's own error for its peers (the first of the run is kept)."""
        try:
            with store_timeout(self.store, self.timeout):
                self._record_first(root_cause(error))
        except Exception as store_error:  # noqa: BLE001 - the peers then say the store is unreachable
            log.warning("rank %d could not record its error in the job's store: %s", self.rank, store_error)

    def _record_first(self, cause: BaseException) -> None:
        self.store.compare_set(self._key("first"), "", f"rank {self.rank} failed with {describe(cause)}")

    def catch_sigterm(self) -> None:
        """From now on SIGTERM raises ``Terminated`` (main thread only; Python runs handlers there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        owner = getattr(previous, "__self__", None)  # a released handler of an earlier run: skip over it
        if isinstance(owner, FailureRecords) and owner._sigterm == "released":
            previous = owner._sigterm_previous
        self._sigterm, self._sigterm_previous = "running", previous
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def release_sigterm(self) -> None:
        """Put back the handler ``catch_sigterm`` found (at the strategy's teardown)."""
        if self._sigterm is None or self._sigterm == "released":
            return
        self._sigterm = "released"
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_previous)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._sigterm == "running":
            raise Terminated(f"rank {self.rank} received SIGTERM: its launcher is stopping the job")
        if self._sigterm == "stopping":  # already on its way out with a non-zero exit: let it say why
            self.terminated = True
            return
        # released, yet still installed (Lightning's signal connector restores what it found at the
        # run's start): behave as the handler that was there before
        previous = self._sigterm_previous
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _stopping(self) -> None:
        """SIGTERM from here on must not interrupt the store operations and the message: it is noted
        only, by this handler directly (Lightning's, in front of it during the run, broadcasts)."""
        if self._sigterm == "running":
            self._sigterm = "stopping"
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def on_exception(self, error: BaseException) -> None:
        """Record this rank's own error; or, when a collective broke under this rank because a peer
        stopped (or its launcher terminated it), make ``error``'s message lead with which rank failed
        and why."""
        self._stopping()
        cause = root_cause(error)
        terminated = isinstance(cause, Terminated)
        broken = terminated or is_transport_error(cause)
        try:
            with store_timeout(self.store, self.timeout):
                if not broken:
                    self._record_first(cause)
                self.store.append(self._key("stopped"), f"{self.rank},")
                explanation = self._explain() if broken else None
        except Exception as store_error:  # noqa: BLE001 - the store died with its host; say so
            if not broken:
                log.warning("rank %d could not record its error in the job's store: %s", self.rank, store_error)
                return
            explanation = f"the job's store is unreachable: it lives in {store_host()}"
        if explanation is None:
            return
        reason = "its launcher terminated it" if terminated else "its collective broke"
        message = f"{explanation} (rank {self.rank} stopped because {reason}: {describe(cause)})"
        log.error("%s", message)  # now, in case the launcher kills this process before the traceback prints
        if len(error.args) <= 1:
            error.args = (message,)

    def _explain(self) -> str:
        first = self._key("first")
        if self.store.check([first]):
            return self.store.get(first).decode()
        stopped = {int(r) for r in self.store.get(self._key("stopped")).decode().split(",") if r}
        silent = [r for r in range(self.world_size) if r not in stopped]
        shown = ", ".join(map(str, silent[:_SHOWN_RANKS]))
        if len(silent) > _SHOWN_RANKS:
            shown += f", ... ({len(silent)} in all)"
        return (
            "no rank recorded an error, so a rank was killed or ran out of memory (SIGKILL, the OOM killer); "
            f"global ranks that had not reported when rank {self.rank} stopped: [{shown}]; "
            "their exit codes and logs say which"
        )
