"""Data-parallel axis: replication with DDP (ZeRO-0, ddp.py), ZeRO-1's sharded optimizer state
(zero1.py, torch's ZeroRedundancyOptimizer) and ZeRO 2-3 with FSDP2 (fsdp.py)."""

from lightning_ptdp.data_parallel.ddp import apply_data_parallel
from lightning_ptdp.data_parallel.fsdp import apply_fsdp
from lightning_ptdp.data_parallel.zero1 import shard_optimizer_states

__all__ = ["apply_data_parallel", "apply_fsdp", "shard_optimizer_states"]
