"""Fused projections' parts through the ops that cut or join them: a split, chunk or slice at the
parts' boundaries is each rank's share of those parts; a cat of sharded tensors, or a repeat of one,
is a fused layout of its inputs; a view keeps the parts at a fixed scale; ops combining sharded
tensors need them laid out alike. A chunk of heads split contiguously into equal parts (DIFF
attention's head pairs) fails naming its parts: discovery then splits the columns feeding it as that
many fused parts (``RegionPlan.paired_parts``). Parts may split differently (a part of fewer heads
than t is copied to the ranks sharing it: ``Sharded.part_ratios``). A mixin of ``ShardPropagation``
(propagation.py)."""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

from torch import fx

from lightning_ptdp.tensor_parallel.discovery_types import RegionPlan, Sharded, TPDiscoveryError, _shape


class FusedParts:
    """The fused-part handlers of ``ShardPropagation``."""

    def _op_split(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """Splits of the sharded dim cut at a fused projection's part boundaries are each rank's share
        of those parts, each at its part's ratio (anything else: the generic path, which refuses it)."""
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % len(_shape(src))
        if dim != info.dim:  # e.g. q | k | v within each KV group (torchtitan)
            self.shard[node] = Sharded(info.dim, info.ratio, info.bounds, part_ratios=info.part_ratios)
            return
        sizes = node.args[1]
        total = _shape(src)[dim]
        cuts = [*range(0, total, sizes), total] if isinstance(sizes, int) else [0, *itertools.accumulate(sizes)]
        if info.ratio > 1 and any(cut not in info.bounds for cut in cuts):
            self._pairing(node, src, info, len(cuts) - 1 if len({b - a for a, b in zip(cuts, cuts[1:])}) == 1 else 0)
            return
        if info.part_ratios:  # parts of different ratios: each piece at its own parts' local size
            if not isinstance(sizes, (list, tuple)):
                raise self.fail(node, "splits parts of different ratios into equal sizes")
            local = [info.local_edge(b) - info.local_edge(a) for a, b in zip(cuts, cuts[1:])]
            self.region.rewrites_shapes |= local != list(sizes)
            node.args = (node.args[0], type(sizes)(local), *node.args[2:])
            self.pieces[node] = [self._piece(info, a, b) for a, b in zip(cuts, cuts[1:])]
            self.shard[node] = Sharded(info.dim, info.ratio)
            return
        new = (
            [self._divide(node, s, info.ratio) for s in sizes]
            if isinstance(sizes, (list, tuple))
            else self._divide(node, sizes, info.ratio)
        )
        node.args = (node.args[0], new, *node.args[2:])
        self.shard[node] = Sharded(info.dim, info.ratio)

    @staticmethod
    def _piece(info: Sharded, start: int, stop: int) -> Sharded:
        """The parts of ``info`` between two of its boundaries, as one sharded tensor of their own."""
        first, last = info.bounds.index(start), info.bounds.index(stop)
        ratios = tuple(info.part_ratio(i) for i in range(first, last))
        if len(set(ratios)) == 1:
            inner = tuple(b - start for b in info.bounds[first : last + 1]) if last - first > 1 else ()
            return Sharded(info.dim, ratios[0], inner)
        return Sharded(info.dim, max(ratios), tuple(b - start for b in info.bounds[first : last + 1]), 1, ratios)

    def _op_cat(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """Sharded tensors joined along their sharded dim (q | k | v projected apart, then one depthwise
        conv over all): each rank's shares side by side, a fused column's layout of parts (its bounds
        the inputs' global sizes). Anything else goes by torch's rules."""
        tensors = node.args[0] if node.args else node.kwargs.get("tensors", ())
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) % len(_shape(node))
        infos = [self.shard.get(t) if isinstance(t, fx.Node) else None for t in tensors]
        if info.ratio != self.tp_size or any(
            i is None or i.dim != dim or i.ratio != info.ratio or i.outer > 1 for i in infos
        ):
            self._generic(node, [t for t in tensors if isinstance(t, fx.Node) and t in self.shard])
            return
        edges = [0]
        for t, i in zip(tensors, infos):
            edges += [edges[-1] + b for b in (i.bounds or (0, _shape(t)[dim]))[1:]]
        self.shard[node] = Sharded(dim, info.ratio, tuple(edges))

    _op_concat = _op_concatenate = _op_cat

    def _op_chunk(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """Chunks of the sharded dim cut at a fused projection's part boundaries are each rank's share
        of every part (a chunk of one rank's heads otherwise, which the generic path refuses)."""
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % len(_shape(src))
        chunks = node.kwargs.get("chunks", node.args[1] if len(node.args) > 1 else None)
        total = info.bounds[-1] if info.bounds else 0
        uneven = dim == info.dim and bool(info.part_ratios)  # equal chunks of parts split differently are not
        if (
            uneven
            or dim != info.dim
            or not total
            or any(i * total // chunks not in info.bounds for i in range(chunks + 1))
        ):
            self._pairing(node, src, info, chunks if dim == info.dim else 0)
            return
        self.shard[node] = Sharded(info.dim, info.ratio)

    def _pairing(self, node: fx.Node, src: fx.Node, info: Sharded, parts: int) -> None:
        """A split or chunk the fused parts do not explain, by torch's rules; where those refuse a cut of
        a contiguous share into ``parts`` equal pieces, the refusal names them (``fail``'s ``parts``)."""
        try:
            self._generic(node, [src])
        except TPDiscoveryError as error:
            if parts > 1 and not info.bounds and info.outer == 1 and info.ratio == self.tp_size:
                error.parts = parts
            raise

    def _op_repeat(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """``x.repeat(..., k, ...)`` copying the sharded dim k times: each rank's share k times over,
        which holds the global result's k copies as fused parts, each split over t."""
        rank = len(_shape(src))
        sizes = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if len(sizes) < rank or any(type(s) is not int for s in sizes) or info.part_ratios or info.outer > 1:
            self._generic(node, [src])
            return
        dim, width = info.dim + len(sizes) - rank, _shape(src)[info.dim]
        inner = info.bounds or (0, width)
        bounds = tuple(sorted({copy * width + b for copy in range(sizes[dim]) for b in inner}))
        self._mark(node, dim, Sharded(dim, info.ratio, bounds if sizes[dim] > 1 else info.bounds))

    def _same_parts(self, node: fx.Node, inputs: list[fx.Node]) -> tuple[int, ...]:
        """The fused parts that sharded ``inputs`` all hold alike (the first's bounds; () where none
        holds parts). Inputs laid out otherwise (parts beside a contiguous share) hold different heads
        at the same place: refused, naming the parts the contiguous ones would need."""
        layouts = {_relative(self.shard[i].bounds) for i in inputs}
        if len(layouts) > 1:
            parts = max(len(b) - 1 for b in layouts)
            raise self.fail(
                node, f"combines heads laid out as {parts} fused parts with heads laid out otherwise", parts
            )
        return self.shard[inputs[0]].bounds if inputs else ()

    def _slice_part(self, node: fx.Node, index: tuple, item: Any, info: Sharded) -> Sharded:
        """``qkv[..., a:b]`` (or ``[..., [i], :]``, one unit) cutting a fused column at its part
        boundaries (q | k | v, or heads | key | value after a view): each rank holds its share of
        every part, so the local cut is at the parts' local offsets. Returns the parts kept."""
        total = info.bounds[-1] if info.bounds else 0
        one = isinstance(item, list) and len(item) == 1 and type(item[0]) is int and total
        cut = slice(item[0] % total, item[0] % total + 1) if one else item
        edges = (
            [0 if e is None else e + total * (e < 0) for e in (cut.start, cut.stop)] if isinstance(cut, slice) else []
        )
        if edges and cut.stop is None:
            edges[1] = total
        if not edges or cut.step not in (None, 1) or any(e not in info.bounds for e in edges):
            raise self.fail(node, "indexes the sharded dim other than at a fused projection's part boundaries")
        local: Any = (
            [self._local_index(node, item[0], info)]
            if one
            else slice(*(None if e is None else self._local_index(node, e, info) for e in (item.start, item.stop)))
        )
        new_index = tuple(local if i is item else i for i in index)
        node.args = (node.args[0], new_index if isinstance(node.args[1], tuple) else local)
        return self._piece(info, *edges)

    def _local_index(self, node: fx.Node, index: int, info: Sharded) -> int:
        """A slice bound at a part boundary, at this rank's offset (negative ones count from the end)."""
        if not info.part_ratios:
            return self._divide(node, index, info.ratio)
        total = info.bounds[-1]
        local = info.local_edge(index % total)
        self.region.rewrites_shapes |= local != index
        return local - info.local_edge(total) if index < 0 else local

    def _view_parts(self, node: fx.Node, args: list, packed: bool, target: int, info: Sharded) -> None:
        """A view of a fused column's features whose parts split differently into (units, unit) (or
        back): dim ``target`` holds the parts at a fixed scale; its size argument is this rank's parts."""
        src = node.all_input_nodes[0]
        scale = Fraction(_shape(node)[target], _shape(src)[info.dim])
        bounds = [b * scale for b in info.bounds]
        if any(b.denominator != 1 for b in bounds) or args[target] not in (-1, _shape(node)[target]):
            raise self.fail(node, "views a fused projection's parts other than as whole units")
        if args[target] != -1:
            args[target] = int(info.local_edge(info.bounds[-1]) * scale)
            self.region.rewrites_shapes = True
        head = list(node.args[: len(node.args) - (1 if packed else len(args))])
        node.args = tuple(head + ([tuple(args)] if packed else args))
        scaled = tuple(int(b) for b in bounds)
        self._mark(node, target, Sharded(target, info.ratio, scaled, 1, info.part_ratios))


def _relative(bounds: tuple[int, ...]) -> tuple[Fraction, ...]:
    """Part boundaries as fractions of the whole: q's heads and fewer key heads in the same parts match."""
    return tuple(Fraction(b, bounds[-1]) for b in bounds) if bounds else (Fraction(0), Fraction(1))


def scaled_bounds(bounds: tuple[int, ...], size: int, old_size: int) -> tuple[int, ...]:
    """Part boundaries after a view changes the dim's size from ``old_size`` to ``size`` (features into
    heads, or back); () where a boundary falls inside a unit."""
    scale = Fraction(size, old_size)
    scaled = [b * scale for b in bounds]
    return tuple(int(b) for b in scaled) if all(b.denominator == 1 for b in scaled) else ()


def part_bounds(region: RegionPlan, col: str, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global boundaries of a fused column's parts along its output features (0 ... size), and each
    part's ratio where they differ (a part of fewer heads than t is replicated: ratio = its heads)."""
    parts = region.parts.get(col) or ((region.units[col],) * region.blocks[col] if region.blocks[col] > 1 else ())
    sizes = region.part_sizes.get(col) or (region.unit_size[col],) * len(parts)
    bounds, edge = [0], 0
    for units, unit in zip(parts, sizes):
        edge += units * unit
        bounds.append(edge)
    ratios = tuple(units // max(1, units // tp_size) for units in parts)
    return (tuple(bounds), ratios if len(set(ratios)) > 1 else ()) if parts else ((), ())
