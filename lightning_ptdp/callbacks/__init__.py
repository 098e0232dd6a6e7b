"""Lightning callbacks for PTD-P training: throughput/MFU, straggler detection, pipeline timeline."""

from lightning_ptdp.callbacks.straggler import StragglerDetector, StragglerWarning, find_stragglers
from lightning_ptdp.callbacks.throughput import PTDPThroughput
from lightning_ptdp.callbacks.timeline import PipelineTimeline

__all__ = ["PTDPThroughput", "PipelineTimeline", "StragglerDetector", "StragglerWarning", "find_stragglers"]
