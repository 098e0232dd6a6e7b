"""Follow the sharded dimension of one region through a recorded block, rewriting shape arguments.

From each column-parallel output (sharded along its features, ratio = global / local size) to
the row-parallel input: views, expand, splits, indexing, repeat_interleave and attention have a
handler each (they rewrite shape arguments or check attention's operands; fused parts: fused_parts.py); every other op follows
torch's own op knowledge (op_semantics.py). Each shape argument that names the global size along
the sharded dim is divided by the ratio (the replay keeps a value already local at run time:
replay.py). Anything else raises TPDiscoveryError.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_ptdp.tensor_parallel.attention_ops import AttentionOps
from lightning_ptdp.tensor_parallel.discovery_types import (
    OperandSlice,
    RegionPlan,
    Sharded,
    TPDiscoveryError,
    _call_name,
    _shape,
    _shape_args,
    ancestry,
    callable_of,
)
from lightning_ptdp.tensor_parallel.fused_parts import FusedParts, part_bounds, scaled_bounds
from lightning_ptdp.tensor_parallel.module_calls import ModuleCalls
from lightning_ptdp.tensor_parallel.op_semantics import (
    OpRefused,
    acts_per_slice,
    follow_call,
    per_head_operands,
)

log = logging.getLogger(__name__)


class ShardPropagation(AttentionOps, FusedParts, ModuleCalls):
    """Follow the sharded dimension from a region's columns to its row, rewriting shape arguments."""

    def __init__(self, gm: fx.GraphModule, region: RegionPlan, ratios: dict[str, int], tp_size: int, name: str):
        self.gm, self.region, self.tp_size, self.name = gm, region, tp_size, name
        self.shard: dict[fx.Node, Sharded] = {}
        self.folded = False  # heads were folded into another dim (Sharded.outer) in this region
        self.pieces: dict[fx.Node, list[Sharded]] = {}  # a split's outputs, where they differ (parts' ratios)
        for n in gm.graph.nodes:
            if n.op == "call_module" and n.target in region.columns:
                bounds, part_ratios = part_bounds(region, n.target, tp_size)
                self.shard[n] = Sharded(len(_shape(n)) - 1, ratios[n.target], bounds, part_ratios=part_ratios)

    def fail(self, node: fx.Node, why: str, parts: int = 0) -> TPDiscoveryError:
        site = node.meta.get("site")
        where = f" (called at {site.where()})" if site is not None else ""
        error = TPDiscoveryError(
            f"block '{self.name}': '{node.format_node()}'{where} {why}, so the region ending in '{self.region.row}' "
            "cannot be split by heads automatically"
        )
        error.node = node  # the op that failed: discovery may keep the columns feeding it whole
        error.parts = parts  # it pairs heads across this many equal parts: discovery may split the columns so
        return error

    def run(self) -> None:
        """Follow the region; where a tensor made from sizes alone reaches a sharded value only through
        whole ones (a scan's zero state times a whole decay, then plus the sharded input), it is made
        at this rank's share from the start and the region followed again."""
        seeds, late, self._behind = dict(self.shard), {}, {}
        recorded = {n: (n.args, n.kwargs) for n in self.gm.graph.nodes}
        while True:
            try:
                self._follow()
                return self._whole_parameters_read()
            except _Restart as restart:
                late.update(restart.fresh)
            for n, (args, kwargs) in recorded.items():
                n.args, n.kwargs = args, kwargs
            self.shard, self.pieces, self._behind = dict(seeds), {}, {}
            self.region.reset_propagation()
            for n, (back, ratio) in late.items():
                self._make_fresh(n, back, ratio)

    def _follow(self) -> None:
        for node in list(self.gm.graph.nodes):
            sharded_inputs = [a for a in node.all_input_nodes if a in self.shard]
            if not sharded_inputs or node.op == "output" and not sharded_inputs:
                continue
            if node.op != "output":
                sharded_inputs += self._fresh_operands(node, sharded_inputs[0])
            if "tensor_meta" not in node.meta and not node.users and node.op != "output":
                continue  # returned its input itself (dropout with p=0): recorded as nothing new
            if node.op == "output":
                self._output(node)
                continue
            if node.op == "call_module":
                self._module(node, sharded_inputs[0])
            else:
                self._function(node, sharded_inputs)
            info = self.shard.get(node)
            if info is not None and "site" in node.meta and _shape(node) is not None and not info.part_ratios:
                self.region.sharded_sites[node.meta["site"]] = (info.dim, info.ratio)

    def _whole_parameters_read(self) -> None:
        """Parameters held whole that an op on sharded values reads, directly or through values made of
        parameters alone (a bank of profiles every head's states multiply): each rank's gradient of them
        holds its heads' part, summed over tp like a module's applied to local heads (``partial``). Not
        those cut at the call (their copy into the region sums them) nor cut parameters."""
        made_of = _parameters_made_of(self.gm.graph, dict(self.gm.block.named_parameters()))
        cut = {*self.region.stored_cuts, *self.region.cut_parameters}  # each rank reads its own share of these
        for node, info in list(self.shard.items()):
            leaves = tree_flatten((node.args, node.kwargs))[0]
            sliced = {leaves[s.index] for s in self.region.operand_slices.get(node.meta.get("site"), ())}
            for operand in node.all_input_nodes:
                if operand in self.shard or operand in sliced or made_of.get(operand) is None:
                    continue
                read = [t for t in made_of[operand] if t not in cut and t not in self.region.partial]
                if read and (info.ratio != self.tp_size or any(r != self.tp_size for r in info.part_ratios)):
                    # a sum over tp would count the copied heads' part once per copy
                    raise self.fail(node, f"reads the whole parameter {read[0]} beside heads copied on several ranks")
                self.region.partial.extend(read)

    def _fresh_operands(self, node: fx.Node, src: fx.Node) -> list[fx.Node]:
        """Tensors made from sizes alone (``torch.zeros(b, heads, k, v)``, a recurrent state) read with a
        head-sharded one and holding the global head count where it holds its heads: made at this rank's
        share (that size argument at 1/ratio; one read from a local shape already is kept) and sharded."""
        info, shape = self.shard[src], _shape(src)
        if shape is None or info.ratio == 1 or info.outer > 1 or info.bounds:
            return []
        back, width = info.dim - len(shape), shape[info.dim]
        fresh, behind = [], {}
        for n in node.all_input_nodes:
            if n in self.shard:
                continue
            if not n.all_input_nodes and self._makes_width(n, back, width):
                self._make_fresh(n, back, info.ratio)
                fresh.append(n)
            elif n.all_input_nodes:  # a whole value: one made from sizes alone behind it meets the heads here
                behind |= dict.fromkeys(self._sized_behind(n), (back, info.ratio))
        behind = {m: v for m, v in behind.items() if self._makes_width(m, back, width)}
        if behind:
            raise _Restart(behind)
        return fresh

    def _sized_behind(self, node: fx.Node) -> frozenset[fx.Node]:
        """The tensors made from sizes alone that ``node`` is made of through whole values only (memoised:
        every op meeting the heads asks of its whole operands, the same chains over and over)."""
        stack = [(node, False)]
        while stack:  # post-order over the whole values behind ``node`` not yet known: inputs first
            n, ready = stack.pop()
            if n in self._behind or n in self.shard:
                continue
            if not ready:
                stack.append((n, True))
                stack.extend((i, False) for i in n.all_input_nodes)
                continue
            made = not n.all_input_nodes and n.op in ("call_function", "call_method") and "site" in n.meta
            inputs = [self._behind.get(i, frozenset()) for i in n.all_input_nodes if i not in self.shard]
            self._behind[n] = frozenset({n} if made else ()).union(*inputs)
        return self._behind.get(node, frozenset())

    @staticmethod
    def _makes_width(n: fx.Node, back: int, width: int) -> bool:
        """``n`` is made from sizes alone with ``width`` at ``back`` (from the end), named once."""
        made = _shape(n)
        if made is None or "site" not in n.meta or len(made) < -back:
            return False
        named = [v for v in tree_flatten((n.args, n.kwargs))[0] if type(v) is int and v == width]
        return made[back] == width and list(made).count(width) == 1 and len(named) == 1

    def _make_fresh(self, n: fx.Node, back: int, ratio: int) -> None:
        """Made at this rank's share: its size argument naming the width at 1/ratio, sharded there."""
        made, width = _shape(n), _shape(n)[back]
        leaves, spec = tree_flatten((n.args, n.kwargs))
        named = next(i for i, v in enumerate(leaves) if type(v) is int and v == width)
        leaves[named] = self._divide(n, width, ratio)
        n.args, n.kwargs = tree_unflatten(leaves, spec)
        self.shard[n] = Sharded(len(made) + back, ratio)

    def _output(self, node: fx.Node) -> None:
        """The block's hidden state must come out whole; an extra output that is head-sharded (eager
        attention's weights), split evenly over the ranks, is gathered when something reads it."""
        outputs = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
        if outputs and outputs[0] in self.shard:
            raise self.fail(node, "returns a head-sharded tensor from the block")
        for index, value in enumerate(outputs[1:], start=1):
            info = self.shard.get(value)
            if info is None:
                continue
            if info.ratio != self.tp_size or info.bounds or info.outer > 1:
                raise self.fail(node, "returns a tensor sharded unevenly (replicated KV heads or fused parts)")
            self.region.sharded_outputs[index] = info.dim
            log.info("block '%s' also returns %s, head-sharded: gathered over tp where read", self.name, value.name)

    def _function(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        handler = getattr(self, f"_op_{_call_name(node)}", None)
        if any(self.shard[i].outer > 1 for i in inputs) and _call_name(node) not in _FOLDED_OK:
            if handler is not None or len({self.shard[i].outer for i in inputs}) > 1:
                raise self.fail(
                    node, "gets heads folded into another dim, which only views, bmm and torch's rules follow"
                )
            handler = None
        if handler is not None:
            handler(node, inputs[0], self.shard[inputs[0]])
        else:
            self._generic(node, inputs)

    def _generic(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        """An op no handler owns: torch's op knowledge says where the sharded dim goes (op_semantics.py)."""
        name, ratio = _call_name(node), self.shard[inputs[0]].ratio
        if (
            any(self.shard[i].ratio != ratio for i in inputs[1:])
            or len({self.shard[i].part_ratios for i in inputs}) > 1
        ):
            raise self.fail(node, "combines tensors split into different numbers of heads")
        shaped = [i for i in inputs if _shape(i) is not None]
        if ratio > 1 and shaped:  # an int up to the rank may be a dim index (unsqueeze): the run on the share checks it
            sizes = {_shape(i)[self.shard[i].dim] for i in shaped}
            rank = max(len(_shape(i)) for i in shaped)
            named = [v for v in tree_flatten((node.args, node.kwargs))[0] if type(v) is int and v > rank]
            named = sorted(sizes.intersection(named))
        else:
            named = []
        if named and self._per_slice(node, inputs):  # the global size as an argument: groups = channels
            return
        call = callable_of(node)
        sharded = {i: self.shard[i].dim for i in inputs}
        try:  # a size argument naming the global size fails the run on the share there
            dims = follow_call(call, node.args, node.kwargs, sharded, ratio)
        except OpRefused as refusal:
            dims = self._with_whole_operands(node, call, sharded, ratio)
            if dims is None and not named and self._per_slice(node, inputs):
                return
            if dims is None and named:
                raise self.fail(
                    node,
                    f"passes {named[0]}, the global size of the sharded dim, to '{name}', "
                    "which only view, reshape, expand, split and repeat_interleave rewrite",
                ) from None
            if dims is None:
                raise self.fail(node, f"applies '{name}' to a head-sharded tensor, {refusal}") from None
        first = self.shard[inputs[0]]
        kept = self._same_parts(node, inputs)
        if first.outer > 1:  # folded heads stay folded only where the op keeps that dim in place
            same = _shape(node) is not None and dims[0] is not None
            if not same or dims[0] - len(_shape(node)) != first.dim - len(_shape(inputs[0])):
                raise self.fail(node, f"moves heads folded into another dim with '{name}'")
        if _shape(node) is not None:  # one tensor
            if dims[0] is not None:
                self._mark(node, dims[0], Sharded(dims[0], ratio, kept, first.outer, first.part_ratios if kept else ()))
        elif any(d is not None for d in dims):  # a tuple, read through getitem (_op_getitem)
            if len(set(dims)) != 1:
                raise self.fail(node, f"returns tensors sharded along different dims {dims} from '{name}'")
            self.shard[node] = Sharded(dims[0], ratio, kept)

    def _per_slice(self, node: fx.Node, inputs: list[fx.Node]) -> bool:
        """A call torch's rules do not follow that acts on each rank's share alone, checked on samples
        (op_semantics.acts_per_slice: a depthwise conv over the heads' channels, its groups and weight
        cut to this rank's); marks its result sharded, recording the cuts for the replay."""
        info = self.shard[inputs[0]]
        if len(inputs) != 1 or info.ratio != self.tp_size or info.outer > 1 or "site" not in node.meta:
            return False
        call = callable_of(node)
        found = acts_per_slice(
            call, node.args, node.kwargs, inputs[0], info.dim, info.ratio, info.bounds, info.part_ratios
        )
        if found is None:
            return False
        dim, cut, divided = found
        leaves, spec = tree_flatten((node.args, node.kwargs))
        local = info.local_width if info.part_ratios else None
        leaves = [
            (local if local is not None else self._divide(node, v, info.ratio)) if i in divided else v
            for i, v in enumerate(leaves)
        ]
        self.region.rewrites_shapes |= bool(divided)
        node.args, node.kwargs = tree_unflatten(leaves, spec)
        if cut:
            self._slice(node, cut, info.bounds, info.part_ratios)
        self._mark(node, dim, Sharded(dim, info.ratio, info.bounds, 1, info.part_ratios))
        return True

    def _with_whole_operands(self, node: fx.Node, call: Any, sharded: dict, ratio: int) -> list | None:
        """The call's dims with its whole per-head operands cut to each rank's heads (ALiBi's bias:
        op_semantics.per_head_operands), recorded for the replay; None where there are none, or
        torch's rule does not take them split either. An operand expanded from a smaller whole tensor
        (a sink's logit per head, expanded to this rank's head count read from q) is cut before it."""
        contiguous = not any(self.shard[i].bounds for i in sharded)  # one contiguous share a rank, not fused parts
        whole = per_head_operands(node.args, node.kwargs, sharded) if ratio == self.tp_size and contiguous else {}
        if not whole or "site" not in node.meta:
            return None
        cut = {n: d for n, d in whole.items() if self._cut_before_expand(n, d, ratio)}
        whole = {n: d for n, d in whole.items() if n not in cut}
        try:
            dims = follow_call(call, node.args, node.kwargs, {**sharded, **cut, **whole}, ratio)
        except OpRefused:
            return None
        if whole:
            self._slice(node, whole)
        return dims

    def _slice(
        self, node: fx.Node, whole: dict[fx.Node, int], bounds: tuple[int, ...] = (), ratios: tuple[int, ...] = ()
    ) -> None:
        leaves = tree_flatten((node.args, node.kwargs))[0]
        source = next(n for n in self.gm.graph.nodes if n.name == self.region.input_node)
        outer = max((self.shard[i].outer for i in node.all_input_nodes if i in self.shard), default=1)
        slices = []
        for n, d in whole.items():
            made_from = ancestry(n)
            of_parameters = not any(m.op == "placeholder" for m in made_from)
            slices.append(
                OperandSlice(
                    leaves.index(n), d, _shape(n)[d], source in made_from, of_parameters, outer, bounds, ratios
                )
            )
            for m in made_from:
                if m.op == "get_attr" and len(_shape(m) or ()) >= 2 and m.target not in self.region.cut_parameters:
                    self.region.cut_parameters.append(m.target)
        self.region.operand_slices[node.meta["site"]] = slices

    def _cut_before_expand(self, node: fx.Node, dim: int, ratio: int) -> bool:
        """``node`` = expand(whole, ...) with the sharded dim's full size already in ``whole``: cut
        ``whole`` at the expand's call and follow the expand as sharded (its size argument rewritten)."""
        if _call_name(node) not in ("expand", "broadcast_to") or "site" not in node.meta or ratio != self.tp_size:
            return False
        src = node.args[0]
        src_dim = dim - (len(_shape(node)) - len(_shape(src))) if isinstance(src, fx.Node) and _shape(src) else -1
        if src_dim < 0 or _shape(src)[src_dim] != _shape(node)[dim]:
            return False
        self._slice(node, {src: src_dim})
        self._op_expand(node, src, Sharded(src_dim, ratio))
        return True

    def _mark(self, node: fx.Node, dim: int, info: Sharded) -> None:
        """``node`` is sharded along ``dim``; a fused column's part boundaries carry over while that
        dim keeps their global size (through an unsqueeze, a transpose, an elementwise op)."""
        keep = bool(info.bounds) and _shape(node) is not None and _shape(node)[dim] == info.bounds[-1]
        if info.part_ratios and not keep:
            raise self.fail(node, "changes the size of a fused projection's features whose parts split differently")
        self.shard[node] = Sharded(dim, info.ratio, info.bounds if keep else (), info.outer, info.part_ratios)

    def _divide(self, node: fx.Node, arg: Any, ratio: int) -> Any:
        if arg == -1:
            return arg
        if arg % ratio:
            raise self.fail(node, f"uses size {arg}, not divisible by {ratio}")
        self.region.rewrites_shapes |= ratio != 1  # an explicit plan would not rewrite it: discovery only
        return arg // ratio

    def _op_view(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """The sharded dim kept whole by the view (heads split off the features, or back), or merged as
        the last of a group of dims (heads folded into the batch: (B, nh, T, hs) -> (B*nh, T, hs),
        each rank's B blocks of its heads, ``Sharded.outer``): its size argument at 1/ratio."""
        shape_in, shape_out = _shape(src), _shape(node)
        prefix = math.prod(shape_in[: info.dim]) * info.outer  # elements before the sharded units
        block = shape_in[info.dim] // info.outer
        cumulative, target, outer = 1, None, 1
        for j, size in enumerate(shape_out):
            if cumulative == prefix and size % info.ratio == 0:
                target = j
                break
            before = prefix // cumulative if prefix % cumulative == 0 else 0
            merged = size // before if before and size % before == 0 else 0  # units of the sharded dim in dim j
            if merged > 1 and merged % info.ratio == 0 and block % merged == 0 and (merged == block or not info.bounds):
                # merged with the dims before it: all of the sharded dim, or its leading factor
                # (the heads of (B, T, nh*hs) -> (B*T*nh, hs)), with every rank's share inside dim j
                target, outer = j, before
                break
            cumulative *= size
        if target is None or (outer > 1 and info.bounds):
            raise self.fail(node, f"reshapes {shape_in} to {shape_out} across the sharded dim")
        args, packed = _shape_args(node)
        if info.part_ratios:  # parts split differently (a replicated KV head): sized part by part
            self._view_parts(node, args, packed, target, info)
            return
        args[target] = self._divide(node, args[target], info.ratio)
        head = list(node.args[: len(node.args) - (1 if packed else len(args))])
        node.args = tuple(head + ([tuple(args)] if packed else args))
        # once heads were folded into the batch, the replay takes any size arguments with the local product:
        # a batch computed as the folded size over the global head count is 1/t of the real one
        self.folded |= info.outer > 1 or outer > 1
        if self.folded:
            node.meta["fold"] = tuple(range(len(head), len(head) + len(args)))
        bounds = (
            info.bounds
            if outer > 1 or info.outer > 1
            else scaled_bounds(info.bounds, _shape(node)[target], shape_in[info.dim])
        )
        self._mark(node, target, Sharded(info.dim, info.ratio, bounds, outer))

    _op_reshape = _op_view

    def _op_expand(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        args, packed = _shape_args(node) if len(node.args) > 1 else ([], False)
        dim = info.dim + len(_shape(node)) - len(_shape(src))  # expand may add leading dims
        ratio, copies = info.ratio, _shape(node)[dim]
        if _shape(src)[info.dim] == 1 < copies:  # one key/value head, whole on every rank, onto the heads
            if not args or copies % self.tp_size:
                raise self.fail(node, f"expands one key/value head to {copies} heads, not divisible by {self.tp_size}")
            args[dim], ratio = copies // self.tp_size, self.tp_size  # each rank: copies for its own heads
            self.region.rewrites_shapes = True
        elif args:
            args[dim] = self._divide(node, args[dim], info.ratio)
        if args:
            node.args = (node.args[0], tuple(args)) if packed else (node.args[0], *args)
        self.shard[node] = Sharded(dim, ratio, info.bounds if ratio == info.ratio else ())

    _op_broadcast_to = _op_expand

    def _op_new_empty(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """A new tensor shaped like the sharded one (``x.new_empty(*x.shape[:-1], d)``, filled in place
        later): sharded where its size names the sharded dim's, at 1/ratio of it."""
        full = node.target == "new_full"
        args, packed = (list(node.args[1]), True) if full else _shape_args(node)
        shape_in, shape_out = _shape(src), _shape(node)
        if len(shape_out) != len(shape_in) or shape_out[info.dim] != shape_in[info.dim] or len(args) != len(shape_out):
            raise self.fail(node, f"makes a new tensor of shape {shape_out} from a tensor sharded along dim {info.dim}")
        args[info.dim] = self._divide(node, args[info.dim], info.ratio)
        rest = node.args[2:] if full else ()
        node.args = (node.args[0], tuple(args), *rest) if packed else (node.args[0], *args)
        self._mark(node, info.dim, info)

    _op_new_zeros = _op_new_ones = _op_new_full = _op_new_empty

    def _op_getitem(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        if _shape(src) is None:  # an element of split/chunk output
            pieces = self.pieces.get(src)
            self._mark(node, info.dim, pieces[node.args[1]] if pieces else info)
            return
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        ndim, dim_in, dim_out = len(_shape(src)), 0, 0
        explicit = sum(1 for i in index if i is not None and i is not Ellipsis)
        for item in index:
            if item is Ellipsis:
                skip = ndim - explicit
                if dim_in <= info.dim < dim_in + skip:
                    self._mark(node, dim_out + info.dim - dim_in, info)
                    return
                dim_in, dim_out = dim_in + skip, dim_out + skip
                continue
            if item is None:
                dim_out += 1
                continue
            if dim_in == info.dim:
                self._mark(node, dim_out, info if item == slice(None) else self._slice_part(node, index, item, info))
                return
            dim_in += 1
            dim_out += 0 if isinstance(item, int) else 1
        self._mark(node, dim_out + info.dim - dim_in, info)

    def _op_repeat_interleave(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs["repeats"]
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) % len(_shape(src))
        if dim != info.dim:
            self._mark(node, info.dim, info)
            return
        if not isinstance(repeats, int) or (repeats * info.ratio) % self.tp_size or info.bounds:
            raise self.fail(node, "repeats key/value heads in a way that does not divide over the ranks")
        local = repeats * info.ratio // self.tp_size
        self.region.rewrites_shapes |= local != repeats
        node.args = (node.args[0], local, *node.args[2:]) if len(node.args) > 1 else node.args
        if len(node.args) < 2:
            node.kwargs = {**node.kwargs, "repeats": local}
        if isinstance(node.kwargs.get("output_size"), int):  # the heads after repeating: this rank's
            node.kwargs = {**node.kwargs, "output_size": self._divide(node, node.kwargs["output_size"], self.tp_size)}
        self.shard[node] = Sharded(dim, self.tp_size)


class _Restart(Exception):
    """Tensors made from sizes alone to make at this rank's share before following the region again."""

    def __init__(self, fresh: dict[fx.Node, tuple[int, int]]) -> None:
        super().__init__()
        self.fresh = fresh


_FOLDED_OK = {"view", "reshape", "matmul", "__matmul__", "bmm", "softmax", "log_softmax"}
"""The handlers that follow heads folded into the batch (``Sharded.outer``); other ops go by torch's rules."""


def _parameters_made_of(graph: fx.Graph, params: dict) -> dict[fx.Node, tuple[str, ...] | None]:
    """For each node, the parameters (paths, in graph order) it is made of when it is made of no block
    input (None otherwise): one pass in graph order, so each operand's answer is a lookup."""
    made_of: dict[fx.Node, tuple[str, ...] | None] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            made_of[node] = None
            continue
        inputs = [made_of[i] for i in node.all_input_nodes]
        own = (node.target,) if node.op == "get_attr" and node.target in params else ()
        made_of[node] = (
            None if any(i is None for i in inputs) else tuple(dict.fromkeys((*own, *(t for i in inputs for t in i))))
        )
    return made_of
