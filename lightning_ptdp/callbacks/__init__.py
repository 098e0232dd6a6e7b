"""Lightning callbacks for PTD-P training: throughput/MFU, straggler detection, pipeline timeline,
replica consistency."""

from lightning_ptdp.callbacks.consistency import ReplicaConsistency, ReplicaDivergence
from lightning_ptdp.callbacks.straggler import StragglerDetector, StragglerWarning, find_stragglers
from lightning_ptdp.callbacks.throughput import PTDPThroughput
from lightning_ptdp.callbacks.timeline import PipelineTimeline

__all__ = [
    "PTDPThroughput",
    "PipelineTimeline",
    "ReplicaConsistency",
    "ReplicaDivergence",
    "StragglerDetector",
    "StragglerWarning",
    "find_stragglers",
]
