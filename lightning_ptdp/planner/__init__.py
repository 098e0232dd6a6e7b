"""Layout planner (``ptdp plan``): a readable cost model of Megatron-style PTD-P training.

``estimate(model, cluster, B, tensor_parallel_size=t, pipeline_parallel_size=p, ...)`` gives one
layout's step time and TFLOP/s per GPU; ``plan(model, cluster, B)`` ranks every valid layout.
No process group and no torch at import: arithmetic on :mod:`lightning_ptdp.tools.flops`.

* ``models``: model shapes (Table 1 of Narayanan et al. 2021, GPT-3 175B);
* ``cost``: the hardware terms (GEMM roofline with wave quantization, memory-bound kernels, NCCL
  ring/tree collectives on the node topology) and the one fitted constant, ``GEMM_EFFICIENCY``;
* ``estimate``: one layout (schedule, bubble, P2P with or without scatter/gather, recompute,
  optimizer, memory limit); ``search``: the ranking and the fit; ``render``: arguments and tables;
* ``calibrate``: the same model on this machine's CPU, predicted against measured (``--calibrate``).
"""

from lightning_ptdp.planner.cli import main
from lightning_ptdp.planner.cost import GEMM_EFFICIENCY, Cluster
from lightning_ptdp.planner.estimate import Layout, estimate
from lightning_ptdp.planner.models import GPT3_175B, MODELS, TABLE_1, ModelSize, PaperConfiguration, model_size
from lightning_ptdp.planner.render import LayoutArguments, format_layout, format_plan, layout_arguments
from lightning_ptdp.planner.search import FIT_ROWS, fit_gemm_efficiency, paper_layout, plan

__all__ = [
    "FIT_ROWS",
    "GEMM_EFFICIENCY",
    "GPT3_175B",
    "MODELS",
    "TABLE_1",
    "Cluster",
    "Layout",
    "LayoutArguments",
    "ModelSize",
    "PaperConfiguration",
    "estimate",
    "fit_gemm_efficiency",
    "format_layout",
    "format_plan",
    "layout_arguments",
    "main",
    "model_size",
    "paper_layout",
    "plan",
]
