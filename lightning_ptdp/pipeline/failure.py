"""A rank that fails mid-schedule must not leave its pipeline peers blocked in a receive.

The failing stage records its error in the job's store (``lightning_ptdp.faults.records``) and then
aborts its pipeline process group, which breaks the peers' pending transfers at once where the
backend can (NCCL; under gloo the failed rank's process exiting does). Recording comes first, so
a peer whose transfer breaks finds the record when the strategy's ``on_exception`` reports it.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist

from lightning_ptdp.faults.records import FailureRecords, Terminated, is_transport_error, root_cause

log = logging.getLogger(__name__)


def stop_pipeline(error: BaseException, pp_group: Any, records: Optional[FailureRecords]) -> None:
    """After ``error`` interrupted a pipeline step on this rank: if it is this rank's own error,
    record it and release the peers; a broken transfer (a peer stopped) or the launcher's SIGTERM is
    reported by on_exception."""
    cause = root_cause(error)
    if is_transport_error(cause) or isinstance(cause, Terminated):
        return
    if records is not None:
        records.record(error)
    try:
        pp_group.abort() if hasattr(pp_group, "abort") else dist.destroy_process_group(pp_group)
    except Exception as abort_error:  # noqa: BLE001 - the error being raised matters more
        log.warning("could not abort the pipeline process group: %s", abort_error)
