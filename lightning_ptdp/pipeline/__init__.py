"""Pipeline parallelism: the runtime split (split.py), torch schedules (schedules.py), the
Lightning-step runner (engine.py); the gradient work between backward and step is parallel/grads.py."""

from lightning_ptdp.pipeline.apply import apply_pipeline
from lightning_ptdp.pipeline.engine import PipelineEngine, Span, StepTimeline, split_microbatches
from lightning_ptdp.pipeline.split import ChunkLayout, PipelineSplit, PipelineSplitError

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
