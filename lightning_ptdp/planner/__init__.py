"""Layout planner (``ptdp plan``): a readable cost model of Megatron-style PTD-P training.

``estimate(model, cluster, B, tensor_parallel_size=t, pipeline_parallel_size=p, ...)`` gives one
layout's step time and TFLOP/s per GPU; ``plan(model, cluster, B)`` ranks every valid layout.
Modules: ``models`` (Table 1 shapes, GPT-3 175B; ``latent``: DeepSeek's MLA), ``cost`` (hardware terms, the one fitted constant),
``estimate`` (one layout), ``search``, ``render``, ``cli`` (``ptdp plan``; a transformers config.json too);
``fit`` (``dry_run``: the user's own model through ptdp's setup on a fake process group, ``meta_run``).
No process group and no torch at import. docs/architecture.md ("The planner") has every term.
"""

from lightning_ptdp.planner.cli import main
from lightning_ptdp.planner.cost import GEMM_EFFICIENCY, Cluster
from lightning_ptdp.planner.estimate import Layout, estimate
from lightning_ptdp.planner.fit import check_fits, dry_run, format_dry_run
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
    "check_fits",
    "dry_run",
    "estimate",
    "fit_gemm_efficiency",
    "format_dry_run",
    "format_layout",
    "format_plan",
    "layout_arguments",
    "main",
    "model_size",
    "paper_layout",
    "plan",
]
