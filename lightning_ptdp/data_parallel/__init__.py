"""Data-parallel axis: replication (ZeRO-0) and, later, ZeRO-1/2/3 sharding."""

from lightning_ptdp.data_parallel.ddp import apply_data_parallel
from lightning_ptdp.data_parallel.zero import apply_zero

__all__ = ["apply_data_parallel", "apply_zero"]
