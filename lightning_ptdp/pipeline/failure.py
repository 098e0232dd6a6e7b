"""A rank that fails mid-schedule must not leave its pipeline peers blocked in a receive.

The failing rank writes what went wrong to the job's key-value store (the rendezvous store every
rank already shares), then aborts its pipeline process group, which breaks the peers' pending
transfers at once. A peer whose transfer breaks reads the record and raises an error naming the
failed rank and its error, instead of waiting for the collective timeout.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

FAILURE_KEY = "ptdp/pipeline_failure"


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
    return isinstance(error, getattr(dist, "DistBackendError", ())) or "Connection closed by peer" in str(error)


def stop_pipeline(error: BaseException, pp_group: Any, rank: int) -> BaseException:
    """What this rank should raise after ``error`` interrupted a pipeline step."""
    cause = _root_cause(error)
    key = f"{FAILURE_KEY}/{'-'.join(map(str, dist.get_process_group_ranks(pp_group)))}"  # this pipeline's own
    try:
        store = _store()
        if store.check([key]):
            return PipelinePeerFailure(
                f"pipeline step stopped: {store.get(key).decode()} (on this rank: {type(cause).__name__}: {cause})"
            )
        store.set(key, f"rank {rank} failed with {type(cause).__name__}: {cause}")
    except Exception as store_error:  # the store lives in global rank 0's process (Lightning's launcher)
        log.warning("could not reach the job's store: %s", store_error)
        if _is_transport_error(cause):
            return PipelinePeerFailure(
                "pipeline step stopped: the job's store on global rank 0 is unreachable, so rank 0 failed or "
                f"exited; its own output has the error (on this rank: {type(cause).__name__}: {cause})"
            )
    try:
        pp_group.abort() if hasattr(pp_group, "abort") else dist.destroy_process_group(pp_group)
    except Exception as abort_error:
        log.warning("could not abort the pipeline process group: %s", abort_error)
    return error
