"""ZeRO on the dp axis with FSDP2 (``fully_shard``), one unit per transformer block plus a root
(under pipeline parallelism: plus one per module outside the blocks, see ``apply_zero``).

Stages map onto FSDP2 as follows:
  1, 2  parameters stay whole between forward and backward (``reshard_after_forward=False``);
        gradients are reduce-scattered and the optimizer state is sharded over d. FSDP2 has no
        "full gradients, sharded optimizer" mode, so stage 1 also shards gradients -- what
        Megatron's distributed optimizer does too, at the same communication volume.
  3     parameters are resharded after forward and gathered again for backward.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ptdp.blocks import find_block_lists


def apply_zero(module: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, pipeline: bool = False) -> nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer state over ``dp_mesh`` in place.

    Under pipeline parallelism the model's forward is cut short on every stage but the last, so
    no module enclosing the blocks completes a forward: the modules outside the blocks (embedding,
    final norm, head) become FSDP units of their own instead of one root around them."""
    from torch.distributed.fsdp import fully_shard

    # Lightning calls training_step, not the LightningModule's __call__, so the FSDP root must be
    # a module whose __call__ runs: each child holding parameters (the user's network).
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"zero_stage={zero_stage} needs the parameters of {type(module).__name__} inside submodules "
            "(FSDP shards submodules that the forward calls); move direct nn.Parameters into a submodule"
        )
    reshard = zero_stage == 3
    blocks = [block for _, found in find_block_lists(module) for block in found]
    for block in blocks:
        if any(True for _ in block.parameters()):  # under PP, other stages' blocks hold none
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    if pipeline:
        from lightning_ptdp.pipeline.split import outer_modules

        inside = {id(m) for block in blocks for m in block.modules()}
        for name, outer in outer_modules(module, blocks).items():
            if any(id(m) in inside for m in outer.modules()):
                raise ValueError(
                    f"zero_stage={zero_stage} with pipeline parallelism: '{name}' holds parameters of its own and "
                    "encloses the transformer blocks, whose forward stops early on all stages but the last; move "
                    "its parameters into a submodule (as an nn.Embedding or norm) or use zero_stage=0"
                )
            fully_shard(outer, mesh=dp_mesh, reshard_after_forward=False)
        return module
    # The root keeps its (embedding, head, final norm) parameters gathered until backward, which
    # starts right after its forward anyway; this also keeps backward independent of whether FSDP
    # can hook the root's output (tensor-parallel logits are a tensor subclass).
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=dp_mesh, reshard_after_forward=False)
    return module
