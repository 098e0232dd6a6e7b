"""Pipeline parallelism: the runtime split (split.py), torch schedules (schedules.py), the
Lightning-step runner (engine.py) with its microbatches, timeline and step results beside it; a
step's gradients belong to parallel/gradients.py."""

from lightning_ptdp.pipeline.apply import apply_pipeline
from lightning_ptdp.pipeline.engine import PipelineEngine
from lightning_ptdp.pipeline.microbatches import split_microbatches
from lightning_ptdp.pipeline.split import ChunkLayout, PipelineSplit, PipelineSplitError
from lightning_ptdp.pipeline.timeline import Span, StepTimeline

__all__ = [
    "ChunkLayout",
    "PipelineEngine",
    "PipelineSplit",
    "PipelineSplitError",
    "Span",
    "StepTimeline",
    "apply_pipeline",
    "split_microbatches",
]
