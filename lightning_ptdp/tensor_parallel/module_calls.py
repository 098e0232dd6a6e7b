"""How a module call inside a region meets the sharded dim: the row Linear ends the region, a norm
over all heads' features gets its statistics summed (feature_norm.py), per-head parameters are sliced,
a module of the heads alone is followed by the aten ops its forward runs, and one on rows holding
folded heads must keep each row in place. A mixin of ``ShardPropagation`` (propagation.py)."""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from lightning_ptdp.tensor_parallel.discovery_types import Sharded, _shape
from lightning_ptdp.tensor_parallel.feature_norm import GatheredModule, HeadSlices, feature_norm_of, head_slices_of
from lightning_ptdp.tensor_parallel.op_semantics import OpRefused, follow_call, on_meta, per_head_operands


class ModuleCalls:
    """The module-call handlers of ``ShardPropagation``."""

    def _module(self, node: fx.Node, src: fx.Node) -> None:
        info = self.shard[src]
        if node.target == self.region.row or node.target in self.region.inner_rows:
            if info.dim != len(_shape(src)) - 1 or info.ratio != self.tp_size or info.bounds or info.outer > 1:
                raise self.fail(node, "receives a tensor sharded along a dim other than its features")
            return  # an inner row's output is whole on every rank, as the region's input is
        module = self.gm.get_submodule(node.target)
        if info.outer > 1:
            self._folded_module(node, module, info)
            return
        if isinstance(module, nn.Linear):
            raise self.fail(node, "is a second linear reading the sharded activations")
        tensors = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        sharded = {src: info.dim, **{t: self.shard[t].dim for t in tensors if t in self.shard}}
        if per_head_operands(node.args, node.kwargs, sharded):  # a module call is cut nowhere
            raise self.fail(node, "reads a whole tensor of all heads beside the head-sharded one")
        if any(True for _ in module.parameters()):
            if info.ratio != self.tp_size:
                raise self.fail(node, "has parameters and reads key/value heads replicated over the ranks")
            width = _shape(src)[info.dim]
            if info.bounds and any(width in p.shape for p in module.parameters()):  # sliced as one contiguous share
                raise self.fail(node, "applies weights of every head or feature to heads laid out as fused parts")
            if tensors == [src] and not any(width in p.shape for p in module.parameters()):
                self._parameterless(node, module, src, info, known=True)  # learned scalars: by its aten ops
            elif info.dim == len(_shape(src)) - 1:  # a norm over all heads: statistics summed over tp
                norm = feature_norm_of(module, _shape(src)[-1]) if tensors == [src] else None
                self.region.feature_norms[node.target] = norm or self._gathered(node, tensors, "has parameters")
            else:
                self._per_head_parameters(node, module, src, info)
            # applied to this rank's heads only (a per-head q/k norm, or its slice of a norm over
            # all heads or of per-head weights): its gradient sums over the group, once (a module called twice)
            held = self.region.feature_norms.get(node.target)
            held = {name for name, _ in held.dims} if isinstance(held, HeadSlices) else set()
            paths = (
                [f"{node.target}.{n}" for n, _ in module.named_parameters() if n not in held] if held else [node.target]
            )
            self.region.partial.extend(p for p in paths if p not in self.region.partial)
        if _shape(node) is None:  # a tuple (rotary on q and k): output i is input i, same shape
            self._tuple_module(node)
            return
        if _shape(node) != _shape(src):
            if node.target in self.region.feature_norms or info.bounds or _shape(node) is None:
                raise self.fail(node, "changes the shape of a sharded tensor")
            self._shared_weights(node, module, tensors, info)  # weights all heads share, a new shape
            return
        if tensors == [src] and not any(True for _ in module.parameters()):  # a function of the heads as a module
            self._parameterless(node, module, src, info)
        self._mark(node, info.dim, info)

    def _gathered(self, node: fx.Node, tensors: list[fx.Node], why: str) -> GatheredModule:
        """A module over all heads' features run whole on the gathered features, each rank keeping its
        share of the output: every tensor it reads split evenly along the last dim, the output too."""
        leaves = tree_flatten((node.args, node.kwargs))[0]
        inputs = tuple(i for i, v in enumerate(leaves) if isinstance(v, fx.Node) and v in self.shard)
        infos = [self.shard[leaves[i]] for i in inputs]
        last = [len(_shape(leaves[i])) - 1 for i in inputs]
        even = all(
            (i.dim, i.ratio, i.bounds, i.outer) == (d, self.tp_size, (), 1) for i, d in zip(infos, last)
        ) and len(inputs) == len(tensors)
        if not even or _shape(node) is None or _shape(node)[-1] != _shape(leaves[inputs[0]])[-1]:
            raise self.fail(node, f"{why} over the sharded feature dim (and is no RMSNorm or LayerNorm over them)")
        return GatheredModule(inputs)

    def _shared_weights(self, node: fx.Node, module: nn.Module, tensors: list[fx.Node], info: Sharded) -> None:
        """A module that reshapes the head-sharded tensor with weights all heads share (per-head states
        mixing a shared bank into a bias per head and key, beside whole positions): followed by the aten
        ops its forward runs, as any call (each share checked on samples)."""
        sharded = {t: self.shard[t].dim for t in tensors if t in self.shard}
        if any(self.shard[t].ratio != info.ratio or self.shard[t].bounds for t in sharded):
            raise self.fail(node, "changes the shape of tensors sharded in different ways")
        try:
            dims = follow_call(on_meta(module), node.args, node.kwargs, sharded, info.ratio)
        except OpRefused as refusal:
            raise self.fail(node, f"changes the shape of a sharded tensor, {refusal}") from None
        if len(dims) != 1 or dims[0] is None:
            raise self.fail(node, f"changes the shape of a sharded tensor into {len(dims)} outputs sharded {dims}")
        self.shard[node] = Sharded(dims[0], info.ratio)

    def _folded_module(self, node: fx.Node, module: nn.Module, info: Sharded) -> None:
        """A module on rows holding heads folded in ((B*T*nh, hs): a gated norm over each head's features),
        followed by torch's rules: it must keep each row where it is, so any share of the rows runs alone.
        Its parameters, if any, act on this rank's heads: their gradient is summed over tp."""
        tensors = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        folded = [self.shard.get(t) for t in tensors]
        if any(f is None or (f.dim, f.ratio, f.outer) != (info.dim, info.ratio, info.outer) for f in folded):
            raise self.fail(node, "gets heads folded into another dim beside tensors folded otherwise or whole")
        try:
            dims = follow_call(on_meta(module), node.args, node.kwargs, dict.fromkeys(tensors, info.dim), info.ratio)
        except OpRefused as refusal:
            raise self.fail(node, f"gets heads folded into another dim, {refusal}") from None
        if dims[:1] != [info.dim] or _shape(node) is None or len(_shape(node)) != len(_shape(tensors[0])):
            raise self.fail(node, f"gets heads folded into another dim and moves them to {dims[:1]}")
        if any(True for _ in module.parameters()) and node.target not in self.region.partial:
            self.region.partial.append(node.target)
        self.shard[node] = Sharded(info.dim, info.ratio, (), info.outer)

    def _parameterless(
        self, node: fx.Node, module: nn.Module, src: fx.Node, info: Sharded, known: bool = False
    ) -> None:
        """A module on the sharded tensor alone, without parameters along the sharded dim (an L2 norm, an
        activation, one with learned scalars), is followed like any call, by the aten ops its forward
        runs (its parameters and buffers on meta): one that reduces over the sharded dim (an L2
        norm over all heads' features) is refused. One that cannot run on meta tensors keeps the old
        rule, elementwise (it keeps the shape); modules of several tensors (attention) keep their handlers."""
        try:
            dims = follow_call(on_meta(module), node.args, node.kwargs, {src: info.dim}, info.ratio)
        except OpRefused as refusal:
            if str(refusal).startswith("which discovery does not know") and not known:
                return
            if info.dim == len(_shape(src)) - 1 and not info.bounds:  # over all heads' features (an L2 norm)
                why = f"runs {type(module).__name__}, which {refusal},"
                self.region.feature_norms[node.target] = self._gathered(node, [src], why)
                return
            raise self.fail(node, f"runs {type(module).__name__} on a head-sharded tensor, {refusal}") from None
        if dims[:1] != [info.dim]:
            raise self.fail(node, f"runs {type(module).__name__}, which moves the sharded dim to {dims[:1]}")

    def _per_head_parameters(self, node: fx.Node, module: nn.Module, src: fx.Node, info: Sharded) -> None:
        """Parameters with one entry per head (a (heads, head_dim) q/k norm weight, per-head scalars):
        each rank holds its heads' slice, checked on a sample against the whole module (with the whole
        tensors it also reads, positions, as samples)."""
        slices = head_slices_of(module, _shape(src), info.dim)
        if slices is None:  # one weight shared by all heads (a per-head q/k norm over head_dim)
            return
        inputs = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        names = ", ".join(f"{name} {tuple(module.get_parameter(name).shape)}" for name, _ in slices.dims)
        others = [a for a in inputs if a is not src]
        if any(a in self.shard for a in others) or _shape(node) != _shape(src):
            raise self.fail(
                node, f"holds per-head parameters ({names}) and reads or returns more than one sharded tensor"
            )
        mismatch = slices.mismatch(module, _shape(src), info.dim, self.tp_size, _sample_call(node, src))
        if mismatch is not None:
            raise self.fail(node, f"holds per-head parameters ({names}), and sliced per rank it {mismatch}")
        self.region.feature_norms[node.target] = slices

    def _tuple_module(self, node: fx.Node) -> None:
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        for user in node.users:
            index = user.args[1] if user.target is operator.getitem else None
            source = inputs[index] if isinstance(index, int) and index < len(inputs) else None
            if source is None or _shape(source) != _shape(user):
                raise self.fail(node, "returns tensors that do not match its head-sharded inputs one for one")
            if source in self.shard:
                self._mark(user, self.shard[source].dim, self.shard[source])


def _sample_call(node: fx.Node, src: fx.Node) -> Callable[[torch.Tensor], tuple[Any, Any]]:
    """The recorded call's (args, kwargs) around a sample of ``src``; each other tensor it reads (whole on
    every rank: positions, a scale) a sample with every dim 1 (broadcasting as its leading dims did),
    zeros where integer (a valid index or position), ones otherwise."""

    def other(value: Any) -> Any:
        meta = value.meta.get("tensor_meta") if isinstance(value, fx.Node) else None
        if meta is None or not hasattr(meta, "shape"):
            return value
        fill = torch.zeros if not meta.dtype.is_floating_point else torch.ones
        return fill([1] * len(meta.shape), dtype=meta.dtype)

    def call(x: torch.Tensor) -> tuple[Any, Any]:
        return tree_map(lambda v: x if v is src else other(v), (node.args, node.kwargs))

    return call
