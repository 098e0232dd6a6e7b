"""A rank that fails mid-schedule must not leave its pipeline peers blocked in a receive.

The failing rank writes what went wrong to the job's key-value store (the rendezvous store every
rank already shares), then aborts its pipeline process group, which breaks the peers' pending
transfers at once. A peer whose transfer breaks reads the record and raises an error naming the
failed rank and its error, instead of waiting for the collective timeout.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

FAILURE_KEY = "ptdp/pipeline_failure"
STORE_TIMEOUT = timedelta(seconds=10)


class PipelinePeerFailure(RuntimeError):
    """Another pipeline rank failed during the step this rank was running."""


def _store() -> Any:
    # torch has no public accessor for the default group's store; the rendezvous store is it
    return dist.distributed_c10d._get_default_store()


def _root_cause(error: BaseException) -> BaseException:
    """torch's schedule wraps a stage's exception in a RuntimeError; report the original."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _is_transport_error(error: BaseException) -> bool:
    """A broken transfer (the peer is gone) rather than this rank's own failure."""
    text = str(error)
    return isinstance(error, getattr(dist, "DistBackendError", ())) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    )


def stop_pipeline(error: BaseException, pp_group: Any, rank: int) -> BaseException:
    """What this rank should raise after ``error`` interrupted a pipeline step."""
    cause = _root_cause(error)
    ranks = dist.get_process_group_ranks(pp_group)
    try:
        outcome = _record(cause, f"{FAILURE_KEY}/{'-'.join(map(str, ranks))}", ranks, rank)
    except Exception as store_error:  # the store lives in global rank 0's process (Lightning's launcher)
        log.warning("could not reach the job's store: %s", store_error)
        outcome = None
        if _is_transport_error(cause):
            outcome = PipelinePeerFailure(
                "pipeline step stopped: the job's store on global rank 0 is unreachable, so rank 0 failed or "
                f"exited; its own output has the error (on this rank: {type(cause).__name__}: {cause})"
            )
    if outcome is not None:
        return outcome
    try:  # this rank is the origin: release its peers where the backend can (NCCL)
        pp_group.abort() if hasattr(pp_group, "abort") else dist.destroy_process_group(pp_group)
    except Exception as abort_error:
        log.warning("could not abort the pipeline process group: %s", abort_error)
    return error


def _record(cause: BaseException, key: str, ranks: list[int], rank: int) -> PipelinePeerFailure | None:
    """Read a peer's failure record (returned as the error to raise) or write this rank's (None)."""
    store = _store()
    previous = store.timeout
    store.set_timeout(STORE_TIMEOUT)  # the store may have died with rank 0: do not wait 10 minutes
    try:
        if store.check([key]):
            return PipelinePeerFailure(
                f"pipeline step stopped: {store.get(key).decode()} (on this rank: {type(cause).__name__}: {cause})"
            )
        if _is_transport_error(cause):  # a peer vanished without a word: killed, or out of memory
            peers = [r for r in ranks if r != rank]
            message = (f"a peer closed its connection without reporting an error (killed? out of memory?); "
                       f"this rank's pipeline peers are global ranks {peers}: their logs and exit codes say which")
            store.set(key, f"rank {rank} stopped: {message}")
            return PipelinePeerFailure(f"pipeline step stopped on rank {rank}: {message} ({cause})")
        store.set(key, f"rank {rank} failed with {type(cause).__name__}: {cause}")
        return None
    finally:
        store.set_timeout(previous)
