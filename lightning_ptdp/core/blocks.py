"""The model's repeated transformer blocks, found by structure: the one finder that tensor
parallelism, the pipeline split, ZeRO and activation recompute all use.

A block list is the outermost ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` (torchtitan's
layers "0".."n") whose children are modules with a forward, each holding two or more Linear-like
modules: of one type, or of several in a list (a hybrid stack of attention and linear-attention
layers, planned per structure), not in a dict (an encoder beside a decoder).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn as nn

BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: a Linear whose weight is stored transposed, (in, out), recognised
    by class name, ``nf`` (out features) and a 2-D weight, without importing transformers."""
    weight = getattr(module, "weight", None)
    named = any(cls.__name__ == "Conv1D" for cls in type(module).__mro__)
    return named and hasattr(module, "nf") and isinstance(weight, torch.Tensor) and weight.dim() == 2


def is_linear_like(module: nn.Module) -> bool:
    """nn.Linear, transformers' Conv1D, or a tensor-parallel shard of one (recompute and ZeRO
    look for blocks after tensor parallelism replaced their Linears)."""
    sharded = getattr(type(module), "_ptdp_linear", False)  # the TP layers' class marker (no upward import)
    return isinstance(module, nn.Linear) or sharded or is_conv1d(module)


def is_container(module: nn.Module) -> bool:
    """A ModuleList/ModuleDict without a forward of its own: it only groups modules."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def container_children(container: nn.Module) -> list[nn.Module]:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def acts_as(module: nn.Module, base: type) -> bool:
    """Whether a subclass of nn.Linear / nn.Embedding with its own forward still computes the
    base's (one that only casts does; an embedding that scales its lookup does not): checked on a
    small sample input. The shards run the base computation, so anything else must not be swapped
    for one. A parameter
    besides weight and bias (a learned logit scale, 1 at first) would stop training in the swap."""
    if any(name not in ("weight", "bias") for name, _ in module.named_parameters()):
        return False
    if type(module).forward is base.forward:
        return True
    weight = module.weight
    generator = torch.Generator().manual_seed(0)
    if base is nn.Embedding and weight.is_meta:  # on meta: each row holds its index, without storage (expand)
        rows = torch.arange(module.num_embeddings, dtype=torch.float32).view(-1, 1).expand(weight.shape)
        sample = torch.randint(0, module.num_embeddings, (2, 3), generator=generator)
        try:
            got = torch.func.functional_call(module, {"weight": rows}, (sample,))
        except Exception:  # noqa: BLE001 - a forward that cannot take these computes something else
            return False
        return isinstance(got, torch.Tensor) and torch.equal(got, nn.functional.embedding(sample, rows))
    if weight.is_meta:  # values unknown: only the class can vouch
        return False
    if base is nn.Embedding:
        sample = torch.randint(0, module.num_embeddings, (2, 3), generator=generator).to(weight.device)
        expected = nn.Embedding.forward(module, sample)
    else:
        sample = torch.randn(2, module.in_features, generator=generator).to(weight.device, weight.dtype)
        expected = nn.Linear.forward(module, sample)
    try:
        got = module(sample)
    except Exception:  # noqa: BLE001 - a forward that cannot take (rows, in_features) computes something else
        return False
    return (
        isinstance(got, torch.Tensor)
        and got.shape == expected.shape
        and torch.allclose(got, expected, rtol=1e-4, atol=1e-6)
    )


def find_block_lists(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """(path, blocks in order) of every outermost block list of ``model`` (see the module docstring)."""
    found: list[tuple[str, list[nn.Module]]] = []
    for path, module in model.named_modules():
        if not isinstance(module, BLOCK_CONTAINERS) or len(module) == 0:
            continue
        if any(path.startswith(f"{p}.") for p, _ in found):
            continue
        children = container_children(module)
        if any(child is None for child in children):  # a list of optional modules (norms left out), not blocks
            continue
        hybrid_ok = not isinstance(module, nn.ModuleDict)  # layers in order, not named parts of a model
        if len({type(c) for c in children}) > 1 and not hybrid_ok:
            continue
        if all(not is_container(c) and sum(is_linear_like(m) for m in c.modules()) >= 2 for c in children):
            found.append((path, children))
    return found


def token_embedding_and_head(
    model: nn.Module, inside_blocks: set[int]
) -> tuple[Optional[tuple[str, nn.Embedding]], Optional[tuple[str, nn.Linear]]]:
    """The token embedding (the largest nn.Embedding outside the blocks) and the LM head (the last
    nn.Linear outside them with one output per embedding row, computing a Linear's own forward)."""
    outside = [(p, m) for p, m in model.named_modules() if id(m) not in inside_blocks]
    embeddings = [(p, m) for p, m in outside if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None, None
    embedding = max(embeddings, key=lambda pm: pm[1].num_embeddings)
    heads = [(p, m) for p, m in outside if isinstance(m, nn.Linear) and m.out_features == embedding[1].num_embeddings]
    return embedding, next(((p, m) for p, m in heads[-1:] if acts_as(m, nn.Linear)), None)


def structure_key(block: nn.Module) -> tuple:
    """What makes two blocks alike in structure: module paths, types and parameter shapes."""
    modules = tuple((n, type(m).__name__) for n, m in block.named_modules())
    params = tuple((n, tuple(p.shape)) for n, p in block.named_parameters())
    return modules, params


def structure_groups(blocks: list[nn.Module]) -> list[list[int]]:
    """Indices of the blocks that share one structure (module paths, types, parameter shapes), in
    order of first appearance: a list of one class may hold dense blocks, then MoE ones. Blocks of
    one structure may still run different code: ``census.BlockInputs.groups`` parts those too."""
    groups: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        groups.setdefault(structure_key(block), []).append(i)
    return list(groups.values())


def outer_modules(model: nn.Module, blocks: list[nn.Module]) -> dict[str, nn.Module]:
    """Modules outside the blocks that hold parameters themselves (embeddings, final norm, head)."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return {
        name: module
        for name, module in model.named_modules()
        if id(module) not in inside and any(True for _ in module.parameters(recurse=False))
    }


def residual_input(args: tuple, kwargs: dict) -> Optional[tuple[Union[int, str], torch.Tensor]]:
    """Where a block's residual stream comes in: its first positional floating tensor, else its first
    keyword one (a block called as ``block(hidden_states=x)``); (position or keyword, tensor), or None."""
    for key, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2:
            return key, value
    return None


def with_input(args: tuple, kwargs: dict, key: Union[int, str], value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the input at ``key`` (a position or a keyword) replaced by ``value``."""
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}
