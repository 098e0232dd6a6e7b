"""Lightning callbacks for PTD-P training: throughput/MFU, straggler detection, pipeline timeline,
replica consistency, expert load, aux-loss-free expert balancing."""

from lightning_ptdp.callbacks.aux_free import AuxFreeBalancing
from lightning_ptdp.callbacks.consistency import ReplicaConsistency, ReplicaDivergence
from lightning_ptdp.callbacks.experts import ExpertLoad
from lightning_ptdp.callbacks.straggler import StragglerDetector, StragglerWarning, find_stragglers
from lightning_ptdp.callbacks.throughput import PTDPThroughput
from lightning_ptdp.callbacks.timeline import PipelineTimeline

__all__ = [
    "AuxFreeBalancing",
    "ExpertLoad",
    "PTDPThroughput",
    "PipelineTimeline",
    "ReplicaConsistency",
    "ReplicaDivergence",
    "StragglerDetector",
    "StragglerWarning",
    "find_stragglers",
]
