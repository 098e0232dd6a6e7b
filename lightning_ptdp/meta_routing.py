"""Top-k routing on the meta device, taken as balanced: what a step on meta (the setup probes of a
model built on meta, the dry run) needs of values it does not have. The choices ``topk`` returns and
the masks made from them are followed, so ``nonzero`` of such a mask (an expert's rows, picked by
``torch.where``) takes the balanced share of rows, and a count of the choices per expert holds its
balanced values, as the EP exchange takes them on meta.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary


class RoutingDensity:
    """Top-k routing on meta: the choices ``topk`` returns, carried through views, and the masks that
    compare them with expert ids (``==``, ``one_hot``), whose share of true elements under balanced
    routing is 1 / the number of candidates; ``nonzero`` of such a mask takes that share. A count of
    the choices per expert (``bincount``, ``histc``) holds its balanced values, and so does what is
    computed from such values alone (a ``cumsum`` of them, read by ``tolist`` as split sizes)."""

    VALUES_LIMIT = 4096  # elements of a tensor whose values are kept on the CPU

    def __init__(self) -> None:
        self.candidates, self.density = WeakIdKeyDictionary(), WeakIdKeyDictionary()  # by identity: no tensor ==
        self.values = WeakIdKeyDictionary()  # meta tensor -> its balanced values, on the CPU

    def follow(self, func: Any, args: tuple, kwargs: dict, metas: list[torch.Tensor], out: Any) -> Any:
        """``out`` of ``func`` on ``args`` (``metas``: its meta tensor arguments), after noting what it carries."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self._follow_values(func, args, kwargs, metas, out)
        if func is torch.ops.aten.topk.default:
            self.candidates[out[1]] = args[0].shape[args[2] if len(args) > 2 else -1]
        elif func in self._SCATTERS and args[2] in self.candidates:  # a mask marking each token's k choices
            dim = args[1] % args[0].dim()
            self.density[out] = args[2].shape[dim] / out.shape[dim]
        elif func in (torch.ops.aten.eq.Tensor, torch.ops.aten.eq.Scalar):
            n = next((self.candidates[a] for a in args if isinstance(a, torch.Tensor) and a in self.candidates), None)
            if n is not None:
                self.density[out] = 1 / n
        elif first is not None and (func.is_view or func in self._COPIES):
            outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
            for table in (self.candidates, self.density):  # a view or copy (or unbind's views) carries what it views
                if first in table:
                    for view in outs:
                        table[view] = table[first]
        return out

    def rows_of(self, mask: torch.Tensor) -> int:
        """``nonzero``'s row count for ``mask``: its balanced share, or every element (the upper bound)."""
        return math.ceil(mask.numel() * self.density.get(mask, 1.0))

    COUNTS = (torch.ops.aten.bincount.default, torch.ops.aten.histc.default)
    _COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.clone.default)
    _SUMS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default)
    _SCATTERS = (torch.ops.aten.scatter.value, torch.ops.aten.scatter_.value, torch.ops.aten.scatter.src)
    _SCATTERS += (torch.ops.aten.scatter_.src,)

    def _follow_values(self, func: Any, args: tuple, kwargs: dict, metas: list[torch.Tensor], out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outs = [out]
        else:  # a tuple of results, or none (a collective's work handle)
            outs = [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (tuple, list)) else []
        if not outs or any(t.numel() > self.VALUES_LIMIT for t in outs):
            return
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in self.COUNTS and first in self.candidates:  # choices per expert: an even share each
            experts, total = self.candidates[first], first.numel()
            counts = [total // experts + (i < total % experts) if i < experts else 0 for i in range(out.shape[0])]
            self.values[out] = torch.tensor(counts, dtype=out.dtype)
            return
        if func in self._SUMS and first in self.density:  # a routing mask summed over tokens: its share of each
            per_output = first.numel() // max(out.numel(), 1)
            self.values[out] = torch.full(out.shape, round(per_output * self.density[first]), dtype=out.dtype)
            return
        if any(t not in self.values for t in metas):
            return
        known = mapped((args, kwargs), lambda t: self.values[t] if t.is_meta else t)
        try:
            result = func(*known[0], **known[1])
        except Exception:  # an op the CPU will not run on these values: they stay unknown
            return
        results = [result] if isinstance(result, torch.Tensor) else [r for r in result if isinstance(r, torch.Tensor)]
        for meta, value in zip(outs, results):
            self.values[meta] = value


class MetaRouting(TorchDispatchMode):
    """Balanced routing for a step on meta: ``nonzero`` takes ``RoutingDensity``'s row count, and a
    value read below Python (an index by a 0-d tensor) the routing's value, else 0. ``scalars``: the
    ``MetaScalarsAsZero`` mode whose Python reads (``tolist``) get the values the routing knows."""

    def __init__(self, scalars: Any) -> None:
        super().__init__()
        self.routing = RoutingDensity()
        scalars.known = self.routing.values

    @staticmethod
    def active() -> bool:
        return any(isinstance(mode, MetaRouting) for mode in _get_current_dispatch_mode_stack())

    def unknown_read(self, metas: list[torch.Tensor]) -> None:
        """Told of a value read below Python that the routing does not know (it reads as 0)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        metas = [t for t in tensors_in(args, kwargs) if t.is_meta]
        if not metas:
            return func(*args, **kwargs)
        if func is torch.ops.aten.nonzero.default:
            return torch.empty((self.routing.rows_of(args[0]), args[0].dim()), dtype=torch.long, device="meta")
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0] in self.routing.values:
                return self.routing.values[args[0]].item()
            self.unknown_read(metas)
            return torch.zeros((), dtype=args[0].dtype).item()
        return self.on_meta(func, args, kwargs, metas)

    def on_meta(self, func: Any, args: tuple, kwargs: dict, metas: list[torch.Tensor]) -> Any:
        """Any other op with a meta tensor argument: run, then followed."""
        return self.routing.follow(func, args, kwargs, metas, func(*args, **kwargs))


def tensors_in(*trees: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(trees) if isinstance(leaf, torch.Tensor)]


def mapped(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return tree_map_only(torch.Tensor, fn, tree)
