"""Regional torch.compile: each transformer block's forward compiled after ptdp's rewrites.

As torchtitan does, one compiled region per block (repeated blocks share one graph), so compile
time does not grow with depth. The forward is compiled, not the module call: hooks (FSDP2's
unshard, the pipeline gates, the sequence-parallel scatter) stay eager around it. The tensor-parallel
replay traces as ordinary code (replay.py); parallelize keeps the setup probes eager.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn as nn

from lightning_ptdp.config import CompileConfig
from lightning_ptdp.core.blocks import find_block_lists

log = logging.getLogger(__name__)


def apply_compile(module: nn.Module, config: CompileConfig) -> list[str]:
    """Compile every found block's forward once (a second stage reuses it); returns the block paths."""
    compiled = []
    for prefix, blocks in find_block_lists(module):
        for index, block in enumerate(blocks):
            name = f"{prefix}.{index}" if prefix else str(index)
            if "_ptdp_eager_forward" not in block.__dict__:
                block.__dict__["_ptdp_eager_forward"] = block.forward
                block.forward = _compiled_forward(block.forward, name, config)
            compiled.append(name)
    return compiled


def _compiled_forward(forward: Any, name: str, config: CompileConfig) -> Any:
    compiled = torch.compile(forward, **config.kwargs())
    if not config.fullgraph:
        return compiled

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as err:
            reason = str(err).strip().splitlines()[0]
            raise RuntimeError(
                f"compile(fullgraph=True): block '{name}' cannot be traced as one graph: {reason}. Set "
                "fullgraph=False to let dynamo break the graph there, or change that code"
            ) from err

    return run


def compiled_by_user(module: nn.Module) -> bool:
    """A block compiled with ``block.compile()``, or a submodule wrapped by ``torch.compile``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) for m in module.modules())


def warn_checkpoint_break(module: nn.Module, recompute: str | None, tp: int) -> None:
    """The user's own compile around ptdp's full recompute under TP breaks the graph once per block."""
    if recompute == "full" and tp > 1 and compiled_by_user(module):
        log.warning(
            "activation_checkpointing='full' with tensor_parallel_size=%d inside your own torch.compile: dynamo "
            "breaks the graph at each block's checkpoint (the replay's per-forward state changes inside it); "
            "PTDPStrategy(compile=...) compiles inside the checkpoint instead, with no break",
            tp,
        )


def adopt_compiled_module(module: Any) -> bool:
    """A LightningModule compiled whole (``torch.compile(model)``, as Lightning's guide says) is put
    back to its own methods: ptdp compiles its blocks instead (one graph across the pipeline engine,
    the step's collectives and the optimizer is not what dynamo can trace). True if it was compiled."""
    if getattr(module, "_compiler_ctx", None) is None:
        return False
    from lightning.pytorch.utilities.compile import to_uncompiled

    to_uncompiled(module)
    log.warning(
        "torch.compile(lightning_module) under strategy='ptdp': ptdp compiles each transformer block instead "
        "(regional compilation, after its rewrites); pass PTDPStrategy(compile=...) to choose backend and mode"
    )
    return True
