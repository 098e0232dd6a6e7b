"""Record one real forward of a transformer block as an fx graph, for tensor-parallel discovery.

Not symbolic tracing: the block runs as written on real (or meta) tensors under a
``TorchFunctionMode`` that notes every torch call outside Linear-like and parameter-only leaf
modules, with the tensors it read and made. Python control flow on shapes, decorated or wrapped
forwards, head counts read from config objects and ``*x.shape`` unpacking all just run. Each
node keeps its call site (``CallSite``), so the rewrite can find the same call when the block
runs again (replay.py).
"""

from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ptdp.core.blocks import is_linear_like
from lightning_ptdp.core.sites import SiteCounter


def is_leaf(module: nn.Module) -> bool:
    """Recorded as one node: a Linear-like module, a module marked as a leaf, or one with no Linear
    inside; but not a convolution, nor a module holding one: its functional call is recorded, with
    its weight and ``groups`` as arguments (a depthwise conv over the heads' channels splits by them).
    Nor a module discovery opened (``OPEN``): one whose call as a whole no module rule splits."""
    if is_linear_like(module) or getattr(module, "_ptdp_tp_leaf", False):
        return True
    if module.__dict__.get(OPEN, False):
        return False
    return not any(is_linear_like(m) or isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


OPEN = "_ptdp_tp_open"
"""Set on a leaf module with parameters that a region failed at (a recurrence with per-head weights
and its own head count): the block is recorded again with its calls one by one (apply._opened_plan)."""


def _method_name(func: Any) -> str | None:
    """The Tensor method ``func`` is (``view``, ``__add__``...), or None for a function."""
    name = getattr(func, "__name__", None)
    if name is not None and getattr(torch.Tensor, name, None) is func:
        return name
    return None


def _meta(t: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(shape=tuple(t.shape), dtype=t.dtype)


def written_through(base: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """A tensor after an in-place write into a view of it (``key[..., :d].copy_(k)``): ``base`` itself.
    A graph node only, so what the write read is among what later reads of ``base`` are made from."""
    return base


class _Recorder(TorchFunctionMode):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.nodes: dict[int, fx.Node] = {}  # id(tensor) -> node that made it
        self.alive: list[torch.Tensor] = []  # keeps recorded tensors alive, so ids stay unique
        self.params = {id(p): name for name, p in block.named_parameters()}
        self.params.update({id(b): name for name, b in block.named_buffers()})
        self.depth = 0
        self.sites = SiteCounter()
        self.ordinals: dict[Any, int] = {}  # func -> calls recorded so far (replay's compiled match)

    def node_of(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        node = self.nodes.get(id(value))
        if node is None:
            name = self.params.get(id(value))
            node = self.graph.get_attr(name) if name is not None else self.graph.placeholder(f"input_{len(self.nodes)}")
            self.note(value, node)
        return node

    def note(self, value: torch.Tensor, node: fx.Node) -> None:
        node.meta["tensor_meta"] = _meta(value)
        self.nodes[id(value)] = node
        self.alive.append(value)

    def outputs(self, result: Any, node: fx.Node) -> None:
        if isinstance(result, torch.Tensor):
            self.note(result, node)
        elif isinstance(result, (tuple, list)):  # split/chunk: one getitem node per element, as fx makes
            for i, item in enumerate(result):
                if isinstance(item, torch.Tensor):
                    self.note(item, self.graph.call_function(operator.getitem, (node, i)))

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.depth:
            return result
        method = _method_name(func)
        in_place = method == "__setitem__" or (
            method is not None and method.endswith("_") and not method.endswith("__")
        )
        if not in_place and not any(isinstance(v, torch.Tensor) for v in tree_flatten(result)[0]):
            return result  # shapes, dtypes, sizes: plain values, no dataflow
        site = self.sites.site(func)
        n_args, n_kwargs = tree_map(self.node_of, args), tree_map(self.node_of, kwargs)
        if method == "__getitem__":
            node = self.graph.call_function(operator.getitem, n_args, n_kwargs)
        elif method is not None:
            node = self.graph.call_method(method, n_args, n_kwargs)
        else:
            node = self.graph.call_function(func, n_args, n_kwargs)
        node.meta["site"] = site
        count = self.ordinals.get(func, 0)
        node.meta["ordinal"] = (func, count)
        self.ordinals[func] = count + 1
        if in_place and args and isinstance(args[0], torch.Tensor):
            self.note(args[0], node)  # the mutated tensor now comes from this node
            base = args[0]._base
            if base is not None and id(base) in self.nodes:  # written through a view: so is its base
                self.note(base, self.graph.call_function(written_through, (self.nodes[id(base)], node)))
        elif not any(result is a for a in tree_flatten((args, kwargs))[0]):  # not x.to(x.dtype): x itself
            self.outputs(result, node)
        return result


class RecordedBlock:
    """The recorded graph of one block, resolving call_module targets in the block itself."""

    def __init__(self, block: nn.Module, graph: fx.Graph) -> None:
        self.block, self.graph = block, graph

    def get_submodule(self, target: str) -> nn.Module:
        return self.block.get_submodule(target)


def record_block(block: nn.Module, args: tuple, kwargs: dict) -> RecordedBlock:
    """Run ``block(*args, **kwargs)`` once (no grad) and return its recorded graph. Leaf modules
    are call_module nodes named by their path in ``block``."""
    recorder = _Recorder(block)
    for value in tree_flatten((args, kwargs))[0]:
        recorder.node_of(value)
    names = {m: n for n, m in block.named_modules() if n}
    leaves = outermost_leaves(block)
    handles = []

    def enter(module: nn.Module, m_args: tuple, m_kwargs: dict) -> None:
        if recorder.depth == 0:
            module.__dict__["_ptdp_record_in"] = (
                tree_map(recorder.node_of, m_args),
                tree_map(recorder.node_of, m_kwargs),
            )
        recorder.depth += 1

    def leave(module: nn.Module, m_args: tuple, m_kwargs: dict, output: Any) -> None:
        recorder.depth -= 1
        if recorder.depth == 0:
            n_args, n_kwargs = module.__dict__.pop("_ptdp_record_in")
            node = recorder.graph.call_module(names[module], n_args, n_kwargs)
            recorder.outputs(output, node)

    for leaf in leaves:
        handles.append(leaf.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(leaf.register_forward_hook(leave, with_kwargs=True))
    try:
        with torch.no_grad(), recorder:
            output = block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    out_nodes = [
        recorder.nodes[id(t)]
        for t in tree_flatten(output)[0]
        if isinstance(t, torch.Tensor) and id(t) in recorder.nodes
    ]
    recorder.graph.output(tuple(out_nodes))
    return RecordedBlock(block, recorder.graph)


def outermost_leaves(block: nn.Module) -> list[nn.Module]:
    """The leaf modules recorded as one node each: those inside no other leaf (a norm in a ModuleList
    of norms, a leaf container never called itself, is not one: its calls are recorded one by one)."""
    names = {m: n for n, m in block.named_modules() if n}
    leaf_paths = {n for m, n in names.items() if is_leaf(m)}
    return [m for m, n in names.items() if n in leaf_paths and not _inside(n, leaf_paths)]


def _inside(path: str, paths: set[str]) -> bool:
    """Whether a module path lies under another path of ``paths`` (an outer leaf records it whole)."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in paths for i in range(1, len(parts)))
