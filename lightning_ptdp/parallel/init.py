"""Initialisation that gives every element the same value on any layout, so a model built on the
meta device can be materialised shard by shard and still equal the single-process model.

A model says how each parameter starts with ``init_rule(name) -> Normal | Constant`` and
``init_seed``, on the module that builds the whole model (names relative to it also seed the draws,
so on a block class every block would start alike). A Normal tensor is drawn ``ROWS_PER_DRAW`` rows
at a time, each block from a generator seeded by (seed, name, block index): a rank draws only the
blocks its rows lie in. ``initialize`` fills an ordinary model; ``materialize`` a meta-built shard.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn as nn

from lightning_ptdp.checkpoint.pieces import pieces, tp_cuts

ROWS_PER_DRAW = 64  # rows drawn from one generator: small enough that a shard draws little it discards


@dataclass(frozen=True)
class Normal:
    std: float
    mean: float = 0.0


@dataclass(frozen=True)
class Constant:
    value: float


Init = Union[Normal, Constant]


def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill(
    out: torch.Tensor, offsets: tuple[int, ...], full_shape: tuple[int, ...], init: Init, seed: int, name: str
) -> None:
    """Write into ``out`` the values the whole tensor ``name`` of ``full_shape`` has at ``offsets``."""
    if isinstance(init, Constant):
        out.fill_(init.value)
        return
    rows = full_shape[0] if full_shape else 1
    first, last = (offsets[0], offsets[0] + out.shape[0]) if full_shape else (0, 1)
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], out.shape[1:]))
    for block in range(first // ROWS_PER_DRAW, -(-last // ROWS_PER_DRAW)):
        start = block * ROWS_PER_DRAW
        count = min(ROWS_PER_DRAW, rows - start)
        generator = torch.Generator().manual_seed(_seed(seed, name, block))
        drawn = torch.randn((count, *full_shape[1:]), generator=generator, dtype=torch.float32)
        lo, hi = max(first, start), min(last, start + count)
        part = drawn[(slice(lo - start, hi - start), *inner)] if full_shape else drawn.reshape(())
        target = out[lo - first : hi - first] if full_shape else out
        target.copy_(part * init.std + init.mean)


def _rule_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that define ``init_rule``, deepest first (a parameter takes its nearest one)."""
    owners = [(path, m) for path, m in model.named_modules() if callable(getattr(m, "init_rule", None))]
    return sorted(owners, key=lambda item: -len(item[0]))


def _rule_for(owners: list[tuple[str, nn.Module]], name: str) -> tuple[nn.Module, str]:
    for path, owner in owners:
        if not path or name.startswith(f"{path}."):
            return owner, name[len(path) + 1 :] if path else name
    raise ValueError(
        f"parameter {name!r} was created on the meta device but no module around it defines init_rule(name); "
        "give the module that builds it init_rule(name) -> lightning_ptdp.parallel.init.Normal | Constant (and init_seed), "
        "or build the model in __init__ instead of configure_model"
    )


@torch.no_grad()
def initialize(model: nn.Module) -> None:
    """Fill every parameter of an ordinary (unsharded) model by its ``init_rule``."""
    owners = _rule_owners(model)
    for name, param in model.named_parameters():
        owner, relative = _rule_for(owners, name)
        fill(param, (0,) * param.dim(), tuple(param.shape), owner.init_rule(relative), owner.init_seed, relative)


def is_on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def allocate(model: nn.Module, device: torch.device) -> set[int]:
    """Storage on ``device`` for every parameter still on the meta device (one new Parameter per
    old one keeps tied weights tied), and real zero stand-ins for the pipeline split's. Returns
    the ids of the new parameters. Buffers cannot be recovered from meta: refused."""
    on_meta = [name for name, b in model.named_buffers() if b.is_meta]
    if on_meta:
        raise ValueError(
            f"buffer(s) {', '.join(on_meta[:3])} are on the meta device: their values cannot be recovered. "
            "Create buffers with an explicit device (device='cpu') in configure_model, or compute them in forward"
        )
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in new:
                    fresh = nn.Parameter(torch.zeros_like(param, device=device), param.requires_grad)
                    fresh.__dict__.update(param.__dict__)  # attributes users set on parameters (tags)
                    new[id(param)] = fresh
                module._parameters[attr] = new[id(param)]
    for module in model.modules():  # the pipeline split's zero stand-ins for other stages' weights
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta and value.dim() and not any(value.stride()):
                setattr(module, attr, torch.zeros((), dtype=value.dtype, device=device).expand(value.shape))
    return set(map(id, new.values()))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, aliases: Optional[dict[str, list[str]]] = None) -> int:
    """Give the meta parameters of a (TP-cut, pipeline-split) model storage on ``device`` and the
    values their elements have in the single-process model. Returns the elements initialised."""
    owners = _rule_owners(model)
    fresh = allocate(model, device)
    if not fresh:
        return 0
    cuts, count = tp_cuts(model), 0
    for name, param in model.named_parameters():
        if id(param) not in fresh:
            continue
        canonical = (aliases or {}).get(name, [name])[0]  # a tied weight is drawn under its first name
        owner, relative = _rule_for(owners, canonical)
        entry = pieces(param, cuts.get(name))
        for piece in entry.items:  # vocabulary padding rows belong to no piece: they stay zero
            fill(piece.local, piece.offsets, entry.full_shape, owner.init_rule(relative), owner.init_seed, relative)
            count += piece.local.numel()
    return count
