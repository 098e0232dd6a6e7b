"""Data-parallel axis: replication with DDP (ZeRO-0, ddp.py) and ZeRO 1-3 with FSDP2 (zero.py)."""

from lightning_ptdp.data_parallel.ddp import apply_data_parallel
from lightning_ptdp.data_parallel.zero import apply_zero

__all__ = ["apply_data_parallel", "apply_zero"]
