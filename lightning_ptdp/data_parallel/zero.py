"""ZeRO stages 2 and 3 on the dp axis with FSDP2 (``fully_shard``): one unit per transformer block
and per module holding parameters outside them, never a container (it has no forward to hook).
Stage 2 keeps parameters whole between forward and backward and reduce-scatters gradients (as
Megatron's distributed optimizer does); stage 3 reshards parameters after forward. Stage 1 is
not FSDP (it has no whole-gradient mode): zero1.py. docs/architecture.md has the why.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ptdp.parallel.blocks import find_block_lists, outer_modules


def apply_zero(module: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, pipeline: bool = False) -> nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer state over ``dp_mesh`` in place.

    Under pipeline parallelism the model's forward is cut short on every stage but the last, so
    no module enclosing the blocks completes a forward: the modules outside the blocks (embedding,
    final norm, head) become FSDP units of their own instead of one root around them."""
    from torch.distributed.fsdp import fully_shard

    # Lightning calls training_step, not the LightningModule's __call__, so the FSDP roots must be
    # modules whose __call__ runs: each block, and each child holding parameters outside them (the
    # user's network, or the embedding/norm/head when the LightningModule holds the blocks itself).
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"zero_stage={zero_stage} needs the parameters of {type(module).__name__} inside submodules "
            "(FSDP shards submodules that the forward calls); move direct nn.Parameters into a submodule"
        )
    reshard = zero_stage == 3
    blocks = [block for _, found in find_block_lists(module) for block in found]
    units: dict[str, nn.Module] = {}
    if not pipeline:
        units = _units_outside_blocks(module, blocks, zero_stage)
        _check_ties_within_units(module, [*blocks, *units.values()], zero_stage)
    for block in blocks:
        if any(True for _ in block.parameters()):  # under PP, other stages' blocks hold none
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    if pipeline:
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
    # The units outside the blocks keep their (embedding, head, final norm) parameters gathered
    # until backward, which starts right after their forward anyway; this also keeps backward
    # independent of whether FSDP can hook the root's output (tensor-parallel logits are a subclass).
    for unit in units.values():
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=False)
    return module


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _units_outside_blocks(module: nn.Module, blocks: list[nn.Module], zero_stage: int) -> dict[str, nn.Module]:
    """Each child of ``module`` holding parameters, except the blocks (units already). FSDP hooks
    a module's forward, so a container without one (a ModuleList of blocks held by the
    LightningModule, nanoGPT's ``transformer`` ModuleDict) is never a unit: its children are."""
    skip = {id(b) for b in blocks}
    units: dict[str, nn.Module] = {}

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if id(child) in skip or not any(True for _ in child.parameters()):
                continue
            if _has_forward(child):
                units[path] = child
                continue
            if any(True for _ in child.parameters(recurse=False)):
                raise ValueError(
                    f"zero_stage={zero_stage}: '{path}' ({type(child).__name__}) holds parameters but has no forward, "
                    "so FSDP cannot gather them when they are used; hold them in a module whose forward uses them"
                )
            visit(f"{path}.", child)

    visit("", module)
    return units


def _check_ties_within_units(module: nn.Module, units: list[nn.Module], zero_stage: int) -> None:
    """FSDP shards each unit's parameters on its own: a weight shared by two units (an embedding
    tied to an LM head beside it) would be sharded by one and left stale in the other."""
    unit_ids = {id(u) for u in units}
    owner: dict[int, tuple[nn.Module, str]] = {}

    def visit(path: str, mod: nn.Module, unit: nn.Module | None) -> None:
        unit = mod if id(mod) in unit_ids else unit
        for name, param in mod.named_parameters(recurse=False):
            where = f"{path}{name}"
            first = owner.setdefault(id(param), (unit, where))
            if first[0] is not unit:
                raise ValueError(
                    f"zero_stage={zero_stage}: '{first[1]}' and '{where}' are one tied parameter in two modules "
                    "that FSDP shards separately (no module with a forward encloses both but the LightningModule, "
                    "whose __call__ Lightning does not run); put the network in one nn.Module "
                    "(self.model = MyNet(...)), untie the weights, or use zero_stage=0"
                )
        for name, child in mod.named_children():
            visit(f"{path}{name}.", child, unit)

    visit("", module, None)
