"""ZeRO stages 2 and 3 on the dp axis with FSDP2 (``fully_shard``): one unit per transformer block
and per module holding parameters outside them, never a container (it has no forward to hook).
Units sharing a tied weight (nanoGPT's wte and lm_head) are one FSDP group. Stage 2 keeps
parameters whole between forward and backward and reduce-scatters gradients (as Megatron's
distributed optimizer does); stage 3 reshards them after forward. Stage 1 is not FSDP: zero1.py.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ptdp.core.blocks import find_block_lists, outer_modules


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    pipeline: bool = False,
    experts: Sequence[nn.Module] = (),
    expert_mesh: Optional[DeviceMesh] = None,
    called: Optional[set[int]] = None,
) -> nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer state over ``dp_mesh`` in place.

    Under pipeline parallelism the model's forward is cut short on every stage but the last, so
    no module enclosing the blocks completes a forward: the modules outside the blocks (embedding,
    final norm, head) become FSDP units of their own instead of one root around them. ``experts``
    (split by expert parallelism, different on each ep rank) are units of their own first, over
    ``expert_mesh``, the ranks holding the same experts (FSDP averages their gradients there; the
    step's gradient owner rescales that mean to the whole dp size's). ``called``: the ids of the modules
    the census saw the step call (core/census.py ``ModulesCalled``); a module it goes around is no unit."""
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
    for unit in experts:  # before the blocks: a block's unit leaves parameters already sharded alone
        fully_shard(unit, mesh=expert_mesh, reshard_after_forward=reshard)
    blocks = [block for _, found in find_block_lists(module) for block in found]
    units: dict[str, nn.Module] = {}
    tied: list[list[nn.Module]] = []
    if not pipeline:
        units = _units_outside_blocks(module, blocks, zero_stage, called)
        tied = _tie_groups(module, [*blocks, *units.values()])
    grouped = {id(unit) for group in tied for unit in group}
    for block in blocks:
        if any(True for _ in block.parameters()) and id(block) not in grouped:  # under PP others' blocks hold none
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
        if id(unit) not in grouped:
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=False)
    block_ids = {id(b) for b in blocks}
    for group in tied:  # one FSDP group: the tied weight is sharded once and set on every module using it
        only_blocks = all(id(unit) in block_ids for unit in group)
        fully_shard(group, mesh=dp_mesh, reshard_after_forward=reshard and only_blocks)
    if tied:
        _initialize_root(module, [*blocks, *units.values()], dp_mesh)
    return module


class _UnitsRoot(nn.Module):
    """Every FSDP unit under one module, for FSDP2's root; fully_shard refuses a bare container."""

    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, *args: object) -> None:
        raise RuntimeError("the FSDP root of ptdp's units is never called; the units run in the model's forward")


def _initialize_root(module: nn.Module, units: list[nn.Module], dp_mesh: DeviceMesh) -> None:
    """FSDP2 makes the first unit to run forward a root, and a group of modules cannot be one; no
    module encloses the units but the LightningModule, which Lightning never calls. So a holder of
    every unit becomes the root here, initialized now (FSDP2 has no public call for it: its lazy
    init runs in the root's pre-forward), and every unit's state joins its one context."""
    from torch.distributed.fsdp import fully_shard

    holder = fully_shard(_UnitsRoot(units), mesh=dp_mesh, reshard_after_forward=False)
    holder._get_fsdp_state()._lazy_init()
    module.__dict__["_ptdp_fsdp_root"] = holder  # kept alive, not a submodule (no state_dict keys)


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _units_outside_blocks(
    module: nn.Module, blocks: list[nn.Module], zero_stage: int, called: Optional[set[int]] = None
) -> dict[str, nn.Module]:
    """Each child of ``module`` holding parameters, except the blocks (units already). FSDP hooks
    a module's forward, so a container without one (a ModuleList of blocks held by the
    LightningModule, nanoGPT's ``transformer`` ModuleDict) is never a unit, nor a module whose forward
    the step goes around (``called``: a step calling ``self.net.model(...)`` bypasses ``net``): their
    children are. A module the step never reaches at all stays a unit (its parameters unused)."""
    skip = {id(b) for b in blocks}
    units: dict[str, nn.Module] = {}

    def bypassed(child: nn.Module) -> bool:
        return called is not None and id(child) not in called and any(id(m) in called for m in child.modules())

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}{name}"
            if id(child) in skip or not any(True for _ in child.parameters()):
                continue
            if _has_forward(child) and not bypassed(child):
                units[path] = child
                continue
            if any(True for _ in child.parameters(recurse=False)):
                why = "the step calls modules inside it, never it" if _has_forward(child) else "it has no forward"
                raise ValueError(
                    f"zero_stage={zero_stage}: '{path}' ({type(child).__name__}) holds parameters of its own but "
                    f"{why}, so FSDP cannot gather them when they are used; hold them in a module whose forward "
                    "the step calls, or use zero_stage 0 or 1"
                )
            visit(f"{path}.", child)

    visit("", module)
    return units


def _tie_groups(module: nn.Module, units: list[nn.Module]) -> list[list[nn.Module]]:
    """Units that share a parameter, joined transitively (in the units' order); only groups of 2+."""
    index = {id(u): i for i, u in enumerate(units)}
    parent = list(range(len(units)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_unit: dict[int, int] = {}

    def visit(mod: nn.Module, unit: int | None) -> None:
        unit = index.get(id(mod), unit)
        if unit is not None:
            for param in mod.parameters(recurse=False):
                other = first_unit.setdefault(id(param), unit)
                parent[find(other)] = find(unit)
        for child in mod.children():
            visit(child, unit)

    visit(module, None)
    groups: dict[int, list[nn.Module]] = {}
    for i, unit in enumerate(units):
        groups.setdefault(find(i), []).append(unit)
    return [group for group in groups.values() if len(group) > 1]
