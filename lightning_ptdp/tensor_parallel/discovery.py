"""Find the tensor-parallel plan of a transformer block from its dataflow, not from names.

One block is traced with torch.fx (Linears and parameter-free/linear-free modules as leaves)
and run once with real inputs to learn every tensor's global shape. Then:
  - roles: a Linear whose input reaches the block input without passing another Linear opens a
    region (column-parallel); a Linear fed by such Linears closes it (row-parallel);
  - layouts: a region's split into k equal parts (fused q/k/v, fused gate/up) gives k blocks; the
    first view that splits the feature dim gives heads (units) and head size;
  - rewrites: the sharded dimension is followed through views, transposes, splits, elementwise
    ops and attention; every shape argument that names the global size along it (a head count,
    a hidden size) is divided by its ratio, so forward code that reads ``self.n_head`` or
    ``x.size(-1)`` computes the right thing on 1/t of the heads.
Anything else touching the sharded dimension raises ``TPDiscoveryError`` naming the block and op.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

PLAN_HINT = (
    "pass an explicit plan instead, e.g. PTDPStrategy(tensor_parallel_size=2, tp_plan={{'{block}.{module}': "
    "'rowwise', ...}}), one entry per module path, each 'colwise', 'rowwise', 'colwise_fused:3' (fused q/k/v), "
    "'vocab_embedding' or 'vocab_head'"
)

_ELEMENTWISE = {
    operator.add, operator.mul, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.mul, torch.sub, torch.div, torch.tanh, torch.sigmoid, torch.exp, torch.neg, torch.pow,
    F.gelu, F.silu, F.relu, F.dropout, F.softplus, torch.relu, torch.where,
}
_ELEMENTWISE_METHODS = {
    "add", "mul", "sub", "div", "float", "half", "bfloat16", "to", "type_as", "contiguous", "tanh", "sigmoid",
    "exp", "relu", "neg", "clone", "__mul__", "__add__", "__sub__", "__truediv__", "pow",
}


class TPDiscoveryError(ValueError):
    """The block's dataflow defeated automatic discovery; the message says where and what to do."""


@dataclass
class Sharded:
    dim: int
    ratio: int  # global size / local size along ``dim``


@dataclass
class RegionPlan:
    """One column-parallel -> row-parallel region of a block (attention or MLP)."""

    columns: list[str]
    row: str
    input_node: str
    is_attention: bool = False
    blocks: dict[str, int] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)
    unit_size: dict[str, int] = field(default_factory=dict)


@dataclass
class BlockPlan:
    """The traced graph of one block, its regions, and the shape-argument rewrites it needs."""

    graph: fx.Graph
    regions: list[RegionPlan]
    rewrites: dict[str, dict[int, Any]] = field(default_factory=dict)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, nn.Linear) or getattr(m, "_ptdp_tp_leaf", False):
            return True
        return not any(isinstance(c, nn.Linear) for c in m.modules())


def trace_block(block: nn.Module, args: tuple, kwargs: dict, name: str) -> tuple[fx.GraphModule, list]:
    """Trace ``block`` specialised to the non-tensor arguments of a real call; propagate shapes."""
    bound = inspect.signature(block.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {k: v for k, v in bound.arguments.items() if not _has_tensor(v)}
    try:
        graph = _Tracer().trace(block, concrete_args=concrete)
    except Exception as err:  # fx raises many types for untraceable code
        raise TPDiscoveryError(
            f"tensor parallelism could not trace block '{name}' ({type(block).__name__}): {err}; "
            + PLAN_HINT.format(block=name, module="<linear>")
        ) from err
    gm = fx.GraphModule(block, graph)
    call_args = list(bound.arguments.values())
    ShapeProp(gm).propagate(*call_args)
    return gm, call_args


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _linear_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)]


def _upstream_linears(node: fx.Node, linears: set[fx.Node]) -> set[fx.Node]:
    found, seen, stack = set(), set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linears:
            found.add(n)
        else:
            stack.extend(n.all_input_nodes)
    return found


def find_regions(gm: fx.GraphModule, name: str) -> list[RegionPlan]:
    """Group the block's Linears into column -> row regions from the dataflow alone.

    In graph order: a Linear fed by no other Linear, or only by rows (whose outputs are whole again
    after their reduction, e.g. through the residual stream), opens a region as a column; a Linear
    fed only by columns closes their region as its row.
    """
    linears = _linear_nodes(gm)
    upstream = {n: _upstream_linears(n, set(linears)) for n in linears}
    role: dict[fx.Node, str] = {}
    for node in linears:
        feeders = {role[u] for u in upstream[node]}
        if feeders <= {"row"}:
            role[node] = "column"
        elif feeders == {"column"}:
            role[node] = "row"
        else:
            raise TPDiscoveryError(
                f"block '{name}': linear '{node.target}' is fed both by a column-parallel linear and by the "
                "residual stream; only column -> row pairs (attention, MLP) are discovered automatically; "
                + PLAN_HINT.format(block=name, module=node.target)
            )
    regions: list[RegionPlan] = []
    used: set[fx.Node] = set()
    for row in (n for n in linears if role[n] == "row"):
        cols = upstream[row]
        if cols & used:
            raise TPDiscoveryError(
                f"block '{name}': a column-parallel linear feeds two row-parallel linears ('{row.target}' and "
                "another); " + PLAN_HINT.format(block=name, module=row.target)
            )
        inputs = {c.args[0] for c in cols}
        if len(inputs) != 1:
            raise TPDiscoveryError(
                f"block '{name}': the column-parallel linears {sorted(c.target for c in cols)} of '{row.target}' "
                "read different inputs; " + PLAN_HINT.format(block=name, module=row.target)
            )
        ordered = [c for c in linears if c in cols]
        regions.append(RegionPlan([c.target for c in ordered], row.target, next(iter(inputs)).name))
        used.update(cols, {row})
    stray = [n.target for n in linears if n not in used]
    if stray:
        raise TPDiscoveryError(
            f"block '{name}': linear '{stray[0]}' opens a region that no row-parallel linear closes, "
            "so its tensor-parallel role is unknown; " + PLAN_HINT.format(block=name, module=stray[0])
        )
    return regions


def _call_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def _shape_args(node: fx.Node) -> tuple[list, bool]:
    """The shape arguments of view/reshape as a list, and whether they came packed in one tuple."""
    rest = list(node.args[1:]) if node.op == "call_method" or _call_name(node) == "reshape" else []
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return list(rest[0]), True
    return rest, False


def detect_layouts(gm: fx.GraphModule, region: RegionPlan) -> None:
    """Fill ``blocks``, ``units`` and ``unit_size`` of every column from the global shapes."""
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    for col in region.columns:
        node = nodes[col]
        size = _shape(node)[-1]
        parts, blocks = [node], 1
        if len(node.users) == 1:
            user = next(iter(node.users))
            if _call_name(user) in ("split", "chunk") and _shape(user) is None:
                chunk_shapes = [_shape(u) for u in user.users]
                pieces = {s[-1] for s in chunk_shapes if s is not None}
                if len(pieces) == 1 and size % next(iter(pieces)) == 0:
                    blocks = size // next(iter(pieces))
                    parts = list(user.users)
        units, unit_size = _units_of(parts[0], size // blocks)
        region.blocks[col], region.units[col], region.unit_size[col] = blocks, units, unit_size
    region.is_attention = any(_call_name(n) == "scaled_dot_product_attention" for n in gm.graph.nodes)


def _units_of(node: fx.Node, features: int) -> tuple[int, int]:
    """Follow a column output to the first view that splits its feature dim into (heads, head size)."""
    current = node
    for _ in range(8):
        users = [u for u in current.users if u.op != "output"]
        if len(users) != 1:
            break
        user = users[0]
        shape_in, shape_out = _shape(current), _shape(user)
        if _call_name(user) in ("view", "reshape") and shape_out and shape_in and len(shape_out) == len(shape_in) + 1:
            if shape_out[-2] * shape_out[-1] == features:
                return shape_out[-2], shape_out[-1]
        if shape_out is None or shape_in is None or shape_out != shape_in:
            break
        current = user
    return features, 1


class _Propagation:
    """Follow the sharded dimension from a region's columns to its row, rewriting shape arguments."""

    def __init__(self, gm: fx.GraphModule, region: RegionPlan, ratios: dict[str, int], tp_size: int, name: str):
        self.gm, self.region, self.tp_size, self.name = gm, region, tp_size, name
        self.shard: dict[fx.Node, Sharded] = {}
        self.local_ints: set[fx.Node] = set()
        for n in gm.graph.nodes:
            if n.op == "call_module" and n.target in region.columns:
                self.shard[n] = Sharded(len(_shape(n)) - 1, ratios[n.target])

    def fail(self, node: fx.Node, why: str) -> TPDiscoveryError:
        return TPDiscoveryError(
            f"block '{self.name}': '{node.format_node()}' {why}, so the region ending in '{self.region.row}' "
            "cannot be split by heads automatically; " + PLAN_HINT.format(block=self.name, module=self.region.row)
        )

    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            sharded_inputs = [a for a in node.all_input_nodes if a in self.shard]
            if not sharded_inputs or node.op == "output" and not sharded_inputs:
                continue
            if node.op == "output":
                raise self.fail(node, "returns a head-sharded tensor from the block")
            if node.op == "call_module":
                self._module(node, sharded_inputs[0])
            else:
                self._function(node, sharded_inputs)

    def _module(self, node: fx.Node, src: fx.Node) -> None:
        info = self.shard[src]
        if node.target == self.region.row:
            if info.dim != len(_shape(src)) - 1:
                raise self.fail(node, "receives a tensor sharded along a dim other than its features")
            return
        module = self.gm.get_submodule(node.target)
        if isinstance(module, nn.Linear):
            raise self.fail(node, "is a second linear reading the sharded activations")
        if any(True for _ in module.parameters()) and info.dim == len(_shape(src)) - 1:
            raise self.fail(node, "has parameters over the sharded feature dim")
        if _shape(node) != _shape(src):
            raise self.fail(node, "changes the shape of a sharded tensor")
        self.shard[node] = Sharded(info.dim, info.ratio)

    def _function(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        name = _call_name(node)
        src = inputs[0]
        info = self.shard[src]
        handler = getattr(self, f"_op_{name}", None)
        if handler is not None:
            handler(node, src, info)
        elif node.target in _ELEMENTWISE or (node.op == "call_method" and name in _ELEMENTWISE_METHODS):
            self._elementwise(node, inputs)
        elif name in ("dim", "size") or (node.op == "call_function" and node.target is getattr):
            self._op_size(node, src, info)
        else:
            raise self.fail(node, f"applies '{name}' to a head-sharded tensor, which discovery does not know")

    def _op_size(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        # x.size() of a sharded tensor is already local at run time: never divide it again
        if node.args[1:] and isinstance(node.args[1], int):
            if node.args[1] % len(_shape(src)) == info.dim:
                self.local_ints.add(node)
            return
        for user in node.users:
            if user.target is operator.getitem and isinstance(user.args[1], int):
                if user.args[1] % len(_shape(src)) == info.dim:
                    self.local_ints.add(user)

    def _elementwise(self, node: fx.Node, inputs: list[fx.Node]) -> None:
        info = self.shard[inputs[0]]
        out = _shape(node)
        if any(self.shard[i].dim - len(_shape(i)) != info.dim - len(_shape(inputs[0])) for i in inputs[1:]):
            raise self.fail(node, "combines tensors sharded along different dims")
        if any(self.shard[i].ratio != info.ratio for i in inputs[1:]):
            raise self.fail(node, "combines tensors split into different numbers of heads")
        offset = len(out) - len(_shape(inputs[0]))
        dim = info.dim + offset
        for other in node.all_input_nodes:
            shape = _shape(other)
            if other in self.shard or shape is None:
                continue
            pos = dim - (len(out) - len(shape))
            if pos >= 0 and shape[pos] != 1:
                raise self.fail(node, f"mixes the sharded dim with an unsharded tensor of shape {tuple(shape)}")
        self.shard[node] = Sharded(dim, info.ratio)

    def _divide(self, node: fx.Node, arg: Any, ratio: int) -> Any:
        if isinstance(arg, fx.Node):
            if arg in self.local_ints:
                return arg
            with self.gm.graph.inserting_before(node):
                return self.gm.graph.call_function(operator.floordiv, (arg, ratio))
        if arg == -1:
            return arg
        if arg % ratio:
            raise self.fail(node, f"uses size {arg}, not divisible by {ratio}")
        return arg // ratio

    def _op_view(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        shape_in, shape_out = _shape(src), _shape(node)
        prefix = math.prod(shape_in[: info.dim])
        cumulative, target = 1, None
        for j, size in enumerate(shape_out):
            if cumulative == prefix and size % info.ratio == 0:
                target = j
                break
            cumulative *= size
        if target is None:
            raise self.fail(node, f"reshapes {shape_in} to {shape_out} across the sharded dim")
        args, packed = _shape_args(node)
        args[target] = self._divide(node, args[target], info.ratio)
        head = list(node.args[: len(node.args) - (1 if packed else len(args))])
        node.args = tuple(head + ([tuple(args)] if packed else args))
        self.shard[node] = Sharded(target, info.ratio)

    _op_reshape = _op_view

    def _op_split(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        if dim % len(_shape(src)) != info.dim:
            raise self.fail(node, "splits along a dim other than the sharded one")
        sizes = node.args[1]
        new = [self._divide(node, s, info.ratio) for s in sizes] if isinstance(sizes, (list, tuple)) else self._divide(node, sizes, info.ratio)
        node.args = (node.args[0], new, *node.args[2:])
        self.shard[node] = Sharded(info.dim, info.ratio)

    def _op_chunk(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        self.shard[node] = Sharded(info.dim, info.ratio)

    def _op_getitem(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        if _shape(src) is None:  # an element of split/chunk output
            self.shard[node] = Sharded(info.dim, info.ratio)
            return
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        ndim, dim_in, dim_out = len(_shape(src)), 0, 0
        explicit = sum(1 for i in index if i is not None and i is not Ellipsis)
        for item in index:
            if item is Ellipsis:
                skip = ndim - explicit
                if dim_in <= info.dim < dim_in + skip:
                    self.shard[node] = Sharded(dim_out + info.dim - dim_in, info.ratio)
                    return
                dim_in, dim_out = dim_in + skip, dim_out + skip
                continue
            if item is None:
                dim_out += 1
                continue
            if dim_in == info.dim:
                if item != slice(None):
                    raise self.fail(node, "indexes the sharded dim")
                self.shard[node] = Sharded(dim_out, info.ratio)
                return
            dim_in += 1
            dim_out += 0 if isinstance(item, int) else 1
        self.shard[node] = Sharded(dim_out + info.dim - dim_in, info.ratio)

    def _op_transpose(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        ndim = len(_shape(src))
        a, b = (d % ndim for d in node.args[1:3])
        dim = b if info.dim == a else a if info.dim == b else info.dim
        self.shard[node] = Sharded(dim, info.ratio)

    def _op_permute(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
        ndim = len(_shape(src))
        self.shard[node] = Sharded([d % ndim for d in dims].index(info.dim), info.ratio)

    def _op_flatten(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        ndim = len(_shape(src))
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        start, end = start % ndim, end % ndim
        if start < info.dim <= end:
            raise self.fail(node, "flattens the sharded dim into an outer one")
        dim = info.dim if info.dim <= start else info.dim - (end - start)
        self.shard[node] = Sharded(dim, info.ratio)

    def _op_stack(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        ndim = len(_shape(node))
        position = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % ndim
        self.shard[node] = Sharded(info.dim + (1 if position <= info.dim else 0), info.ratio)

    def _op_cat(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        position = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(_shape(node))
        if position == info.dim:
            raise self.fail(node, "concatenates along the sharded dim")
        self.shard[node] = Sharded(info.dim, info.ratio)

    def _op_repeat_interleave(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs["repeats"]
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) % len(_shape(src))
        if dim != info.dim:
            self.shard[node] = Sharded(info.dim, info.ratio)
            return
        if not isinstance(repeats, int) or (repeats * info.ratio) % self.tp_size:
            raise self.fail(node, "repeats key/value heads in a way that does not divide over the ranks")
        local = repeats * info.ratio // self.tp_size
        node.args = (node.args[0], local, *node.args[2:]) if len(node.args) > 1 else node.args
        if len(node.args) < 2:
            node.kwargs = {**node.kwargs, "repeats": local}
        self.shard[node] = Sharded(dim, self.tp_size)

    def _op_scaled_dot_product_attention(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        q, k = node.args[0], node.args[1]
        heads_dim = len(_shape(q)) - 3
        for t in (q, k, node.args[2]):
            if t not in self.shard or self.shard[t].dim != heads_dim:
                raise self.fail(node, "gets q/k/v that are not all split along their heads dim")
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if isinstance(mask, fx.Node) and _shape(mask) and len(_shape(mask)) == 4 and _shape(mask)[1] > 1:
            raise self.fail(node, "uses a per-head attention mask")
        if self.shard[k].ratio != self.shard[q].ratio and not node.kwargs.get("enable_gqa", False):
            raise self.fail(node, "gets different numbers of local query and key heads")
        self.shard[node] = Sharded(heads_dim, self.shard[q].ratio)


def plan_block(gm: fx.GraphModule, name: str, tp_size: int) -> BlockPlan:
    """Regions, layouts (validated against t) and the rewritten graph for one block."""
    regions = find_regions(gm, name)
    ratios: dict[str, int] = {}
    for region in regions:
        detect_layouts(gm, region)
        validate_layouts(region, name, tp_size)
        for col in region.columns:
            ratios[col] = region.units[col] // max(1, region.units[col] // tp_size)
    for region in regions:
        _Propagation(gm, region, ratios, tp_size, name).run()
    gm.graph.lint()
    return BlockPlan(gm.graph, regions)


def _divisors(n: int) -> str:
    options = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(options[:-1]) + f" or {options[-1]}" if len(options) > 1 else options[0]


def validate_layouts(region: RegionPlan, name: str, tp_size: int) -> None:
    """Every column's heads (or features) must split over t; only KV heads may be replicated."""
    widest = max(region.units.values())
    for col in region.columns:
        units = region.units[col]
        what = "attention heads" if region.is_attention and region.unit_size[col] > 1 else "output features"
        if units == widest and units % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide the {units} {what} of '{name}.{col}'"
                f"; choose tensor_parallel_size from {_divisors(units)}"
            )
        if units < widest and units % tp_size and tp_size % units:
            raise ValueError(
                f"tensor_parallel_size={tp_size} neither divides nor is a multiple of the {units} key/value heads "
                f"of '{name}.{col}'; choose tensor_parallel_size from {_divisors(units)} or a multiple of {units}"
            )
