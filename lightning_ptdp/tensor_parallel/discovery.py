"""Find the tensor-parallel plan of a transformer block from its dataflow, not from names.

From one recorded forward with global shapes (recording.py): roles (a Linear fed only by the
residual stream opens a region, column-parallel; the Linear fed by those closes it, row-parallel),
layouts (a split into k parts is a fused projection; the first view splitting the feature dim gives
heads and head size), and rewrites (propagation.py follows the sharded dim and divides each shape
argument naming its global size, so ``self.n_head`` or ``x.size(-1)`` work on 1/t of the heads).
A region whose dataflow defeats this runs whole on every rank while the rest is split.
"""

from __future__ import annotations

import math
import operator

import torch.nn as nn
from torch import fx

from lightning_ptdp.core.blocks import acts_as, is_conv1d, is_linear_like
from lightning_ptdp.tensor_parallel.discovery_types import (
    BlockPlan,
    KeptWhole,
    RegionPlan,
    TPDiscoveryError,
    _call_name,
    _shape,
    plan_hint,
    working_plan_hint,
)
from lightning_ptdp.tensor_parallel.propagation import ShardPropagation
from lightning_ptdp.tensor_parallel.recording import RecordedBlock, record_block


def trace_block(block: nn.Module, args: tuple, kwargs: dict, name: str) -> RecordedBlock:
    """Record one real forward of ``block`` on the inputs of a real call (recording.py)."""
    try:
        return record_block(block, args, kwargs)
    except TPDiscoveryError:
        raise
    except Exception as err:  # the user's forward may raise anything
        raise TPDiscoveryError(
            f"tensor parallelism could not run block '{name}' ({type(block).__name__}) to read its dataflow: "
            f"{type(err).__name__}: {err}; " + plan_hint(name, "<linear>")
        ) from err


def _linear_nodes(gm: RecordedBlock) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and is_linear_like(gm.get_submodule(n.target))]


_INDEXING = {"getitem", "__getitem__", "index_select", "gather", "take_along_dim", "masked_select"}


def _integer(node: fx.Node) -> bool:
    dtype = getattr(node.meta.get("tensor_meta"), "dtype", None)
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


def _from_values(node: fx.Node) -> bool:
    """An integer tensor computed from float values in the block (top-k indices, a routing mask),
    not from positions or the block's own integer inputs."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        meta = n.meta.get("tensor_meta")
        if n is not node and getattr(meta, "dtype", None) is not None and meta.dtype.is_floating_point:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _picks_rows(node: fx.Node) -> bool:
    """Rows of a tensor picked by an index computed from values: a routed expert's ``x[token_idx]``."""
    if _call_name(node) not in _INDEXING:
        return False
    return any(_integer(n) and _from_values(n) for n in node.all_input_nodes[1:])


def _upstream_linears(node: fx.Node, linears: set[fx.Node]) -> tuple[set[fx.Node], bool]:
    """The Linears feeding ``node`` (through anything but another Linear), and whether its input
    rows are picked by the routing on the way; the routing's index is not followed (it picks rows,
    carrying no Linear's values: a router does not feed the experts it routes to)."""
    found, seen, stack, picked = set(), set(), list(node.all_input_nodes), False
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linears:
            found.add(n)
        elif _picks_rows(n):
            picked = True
            stack.append(n.all_input_nodes[0])
        else:
            stack.extend(n.all_input_nodes)
    return found, picked


def find_regions(gm: RecordedBlock, name: str) -> tuple[list[RegionPlan], list[str], list[KeptWhole]]:
    """Group the block's Linears into column -> row regions from the dataflow alone.

    In graph order: a Linear fed by no other Linear, or only by whole outputs (rows, after their
    reduction, e.g. through the residual stream), opens a region as a column; a Linear fed only by
    columns closes their region as its row. Whole on every rank (``BlockPlan.replicated``): a column
    no row closes (a router, Qwen2-MoE's shared-expert gate: its output reaches no Linear), and the
    experts of a ModuleList MoE, whose rows are picked by the routing (Megatron's expert tensor
    parallel size 1; expert parallelism splits them). Linears joined through column outputs form one
    group; a group that is no single column -> row pair (a Linear fed by a column and by the residual,
    a column feeding two rows) is kept whole (``KeptWhole``), with the reason.
    """
    everything = _linear_nodes(gm)
    found = {n: _upstream_linears(n, set(everything)) for n in everything}
    routed: set[fx.Node] = set()  # a routed expert's Linears, and what they feed: whole on every rank
    for node in everything:
        if found[node][1] or found[node][0] & routed:
            routed.add(node)
    linears = [n for n in everything if n not in routed]
    upstream = {n: found[n][0] for n in linears}
    role: dict[fx.Node, str] = {}
    mixed: dict[fx.Node, str] = {}
    group = {n: n for n in linears}  # union-find over Linears joined by a column's (sharded) output

    def root(n: fx.Node) -> fx.Node:
        while group[n] is not n:
            n = group[n]
        return n

    for node in linears:
        feeders = {role[u] for u in upstream[node]}
        role[node] = "column" if "column" not in feeders else "row" if feeders == {"column"} else "whole"
        if role[node] == "whole":
            mixed[node] = (
                f"block '{name}': linear '{node.target}' is fed both by a column-parallel linear and by the "
                "residual stream; only column -> row pairs (attention, MLP) are discovered automatically"
            )
        for u in upstream[node]:
            if role[u] == "column":
                group[root(u)] = root(node)
    members: dict[fx.Node, list[fx.Node]] = {}
    for node in linears:
        members.setdefault(root(node), []).append(node)
    regions, kept = [], []
    for nodes in members.values():
        rows = [n for n in nodes if role[n] == "row"]
        if len(nodes) == 1 and not rows:
            continue  # a column no Linear reads: replicated below
        reason = _unsplittable(nodes, rows, mixed, upstream, name, set(everything))
        if reason is not None:
            kept.append(KeptWhole([n.target for n in nodes], reason))
            continue
        row = rows[0]
        columns = [c.target for c in nodes if c is not row]
        regions.append(RegionPlan(columns, row.target, next(iter(upstream[row])).args[0].name))
    grouped = {t for r in regions for t in (*r.columns, r.row)} | {t for k in kept for t in k.linears}
    order = {n.target: i for i, n in enumerate(everything)}
    regions.sort(key=lambda r: order[r.row])
    return regions, [n.target for n in everything if n.target not in grouped], kept


def _unsplittable(
    nodes: list[fx.Node], rows: list[fx.Node], mixed: dict, upstream: dict, name: str, linears: set[fx.Node]
) -> str | None:
    """Why one group of Linears is no column -> row region, or None when it is one."""
    if any(n in mixed for n in nodes):
        return mixed[next(n for n in nodes if n in mixed)]
    leaving = next((c for c in nodes if c not in rows and _returned(c, linears)), None)
    if leaving is not None:
        return (
            f"block '{name}': the output of column-parallel linear '{leaving.target}' is returned by the block "
            "before a row-parallel linear sums it (a value handed to the next block besides the hidden states): "
            "each rank would return 1/t of its features"
        )
    if len(rows) != 1:
        return (
            f"block '{name}': a column-parallel linear feeds two row-parallel linears "
            f"({' and '.join(repr(r.target) for r in rows)})"
        )
    inputs = {c.args[0] for c in upstream[rows[0]]}
    if len(inputs) != 1:
        return (
            f"block '{name}': the column-parallel linears {sorted(c.target for c in upstream[rows[0]])} of "
            f"'{rows[0].target}' read different inputs"
        )
    return None


def _returned(node: fx.Node, linears: set[fx.Node]) -> bool:
    """Whether ``node``'s value, before any other Linear reads it, reaches the block's hidden-state
    output (an extra output, eager attention's weights, is gathered where read: extra_outputs.py)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "output" and _first_output(user) is n:
                return True
            if user not in seen and user not in linears:
                seen.add(user)
                stack.append(user)
    return False


def _first_output(output: fx.Node) -> object:
    value = output.args[0]
    return value[0] if isinstance(value, (tuple, list)) and value else value


def detect_layouts(gm: RecordedBlock, region: RegionPlan) -> None:
    """Fill ``blocks``, ``units`` and ``unit_size`` of every column from the global shapes."""
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    for col in region.columns:
        node = _cut_at(nodes[col])
        size, one_head = _shape(node)[-1], len(_shape(node)) > len(_shape(nodes[col]))
        parts, blocks = [nodes[col]], 1
        if len(node.users) == 1:
            user = next(iter(node.users))
            if _call_name(user) in ("split", "chunk") and _shape(user) is None:
                chunk_shapes = [_shape(u) for u in user.users]
                pieces = [s[-1] for s in chunk_shapes if s is not None]
                if len(set(pieces)) == 1 and size % pieces[0] == 0:
                    blocks = size // pieces[0]
                    parts = list(user.users)
                elif len(pieces) > 1 and sum(pieces) == size:  # unequal parts: q | k | v with fewer KV heads
                    _unequal_parts(region, col, list(user.users), pieces, one_head)
                    continue
        sliced = _slice_parts(node, size)
        if sliced is not None:  # qkv[..., :q], qkv[..., q:q + kv], ... (Phi-3)
            part_nodes, pieces = sliced
            if len(set(pieces)) == 1:
                blocks, parts = len(pieces), part_nodes
            else:
                _unequal_parts(region, col, part_nodes, pieces, one_head)
                continue
        units, unit_size = _units_of(parts[0], size // blocks)
        region.blocks[col], region.units[col], region.unit_size[col] = blocks, units, unit_size
    region.is_attention = any(_call_name(n) == "scaled_dot_product_attention" for n in gm.graph.nodes)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _cut_at(node: fx.Node) -> fx.Node:
    """Where a column output's parts are cut: unless a view splits it into heads first (a key of one
    head, (B, T, 1, hs), whose rotary halves are no parts), follow its only users while they keep its
    last dim and merely add or drop size-1 dims or keep its shape (GPTBigCode's unsqueeze, a clip)."""
    if _units_of(node, _shape(node)[-1])[1] > 1:
        return node
    current = node
    for _ in range(8):
        users = [u for u in current.users if u.op != "output"]
        if len(users) != 1 or users[0].op not in ("call_function", "call_method"):
            break
        shape_in, shape_out = _shape(current), _shape(users[0])
        if shape_out is None or shape_out[-1] != shape_in[-1] or _squeezed(shape_out) != _squeezed(shape_in):
            break
        current = users[0]
    return current


def _slice_parts(node: fx.Node, size: int) -> tuple[list[fx.Node], list[int]] | None:
    """A column output read only through slices of its last dim that tile it: the parts in order."""
    cuts = []
    for user in node.users:
        index = user.args[1] if user.target is operator.getitem and len(user.args) > 1 else None
        index = index if isinstance(index, tuple) else (index,)
        last = index[-1] if index and (index[0] is Ellipsis or len(index) == len(_shape(node))) else None
        if not isinstance(last, slice) or last.step not in (None, 1):
            return None
        start = 0 if last.start is None else last.start + size * (last.start < 0)
        stop = size if last.stop is None else last.stop + size * (last.stop < 0)
        cuts.append((start, stop, user))
    cuts.sort(key=lambda c: c[0])
    if len(cuts) < 2 or cuts[0][0] != 0 or cuts[-1][1] != size or any(a[1] != b[0] for a, b in zip(cuts, cuts[1:])):
        return None
    return [c[2] for c in cuts], [c[1] - c[0] for c in cuts]


def _unequal_parts(region: RegionPlan, col: str, parts: list[fx.Node], sizes: list[int], one_head: bool) -> None:
    """A fused projection split into unequal parts: each part's heads (or features) split over t.
    ``one_head``: the parts were cut after a size-1 dim was added (a heads dim, as GPTBigCode's
    unsqueeze adds): a part never viewed into heads is one head (its single key/value head)."""
    shapes = [_units_of(part, size, one_head) for part, size in zip(parts, sizes)]
    unit_size = math.gcd(*(unit for _, unit in shapes))
    region.parts[col] = tuple(size // unit_size for size in sizes)
    region.blocks[col], region.units[col], region.unit_size[col] = len(sizes), max(region.parts[col]), unit_size


def _units_of(node: fx.Node, features: int, one_head: bool = False) -> tuple[int, int]:
    """Follow a column output to the first view that splits its feature dim into (heads, head size),
    through steps that keep the shape or add or drop size-1 dims; none: ``features`` units of 1, or
    with ``one_head`` one unit of ``features``."""
    current = node
    for _ in range(8):
        users = [u for u in current.users if u.op != "output"]
        if len(users) != 1:
            break
        user = users[0]
        shape_in, shape_out = _shape(current), _shape(user)
        if shape_out is None or shape_in is None:
            break
        if _call_name(user) in ("view", "reshape") and shape_in[-1] == features:
            split = _feature_split(shape_in, shape_out)
            if split is not None:
                return split
        if shape_out[-1] != shape_in[-1] or _squeezed(shape_out) != _squeezed(shape_in):
            break
        current = user
    return (1, features) if one_head else (features, 1)


def _feature_split(shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> tuple[int, int] | None:
    """(units, unit size) when a view keeps the leading elements together and splits the last dim
    into (units, *unit): heads, or KV groups of q/k/v heads (torchtitan)."""
    leading, features = math.prod(shape_in[:-1]), shape_in[-1]
    for j in range(len(shape_out) - 1):
        if math.prod(shape_out[:j]) == leading and math.prod(shape_out[j:]) == features:
            return shape_out[j], features // shape_out[j]
    return None


def plan_block(gm: RecordedBlock, name: str, tp_size: int, *, strict: bool = False) -> BlockPlan:
    """Regions, layouts (validated against t) and the rewritten graph for one block. A region the
    propagation cannot split is kept whole (its rewrites undone) and the others are split; with
    ``strict`` it is refused instead, naming the op and the explicit plan that works."""
    regions, replicated, kept = find_regions(gm, name)
    for region in regions:
        detect_layouts(gm, region)
    single = {id(r): reason for r in regions if (reason := _single_head_part(r, name, tp_size)) is not None}
    single.update({id(r): reason for r in regions if (reason := _own_forward(gm, r, name)) is not None})
    kept += [KeptWhole([*r.columns, r.row], single[id(r)]) for r in regions if id(r) in single]
    regions = [r for r in regions if id(r) not in single]
    for region in regions:
        validate_layouts(region, name, tp_size)
    ratios = {col: r.units[col] // max(1, r.units[col] // tp_size) for r in regions for col in r.columns}
    recorded = {n: (n.args, n.kwargs) for n in gm.graph.nodes}
    while True:
        failures = []
        for region in regions:
            try:
                ShardPropagation(gm, region, ratios, tp_size, name).run()
            except TPDiscoveryError as error:  # the other regions still run, to split what can be split
                failures.append((region, error))
        if not failures:
            break
        for node, (args, kwargs) in recorded.items():  # undo every rewrite, then split the rest again
            node.args, node.kwargs = args, kwargs
        failed = {id(region) for region, _ in failures}
        regions = [r for r in regions if id(r) not in failed]
        kept += [KeptWhole([*r.columns, r.row], str(error)) for r, error in failures]
        for region in regions:
            region.feature_norms.clear()
            region.partial.clear()
            region.rewrites_shapes = False
    if strict and kept:
        raise TPDiscoveryError(f"{kept[0].reason}; " + working_plan_hint(name, regions, tp_size))
    gm.graph.lint()
    return BlockPlan(gm.graph, regions, replicated, kept)


def _divisors(n: int) -> str:
    options = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(options[:-1]) + f" or {options[-1]}" if len(options) > 1 else options[0]


def _own_forward(gm: RecordedBlock, region: RegionPlan, name: str) -> str | None:
    """Why a region holding a Linear subclass that computes more than F.linear (or trains another
    parameter) cannot be split: its shards run F.linear alone. None when every Linear is plain."""
    for linear in (*region.columns, region.row):
        module = gm.get_submodule(linear)
        if not is_conv1d(module) and not acts_as(module, nn.Linear):
            return (
                f"block '{name}': '{linear}' is a {type(module).__name__} whose own forward or parameters go beyond "
                "F.linear(x, weight, bias), which a column or row shard computes"
            )
    return None


def _single_head_part(region: RegionPlan, name: str, tp_size: int) -> str | None:
    """Why a fused column with a part of one head (multi-query attention's key or value in one
    projection with the queries) cannot be split: no t above 1 splits that part, and a fused layout
    holds no part whole beside the others' shares. None when every fused part has more heads."""
    for col, parts in region.parts.items():
        if tp_size > 1 and min(parts) == 1:
            return (
                f"block '{name}': the fused '{col}' holds parts of {' | '.join(map(str, parts))} heads of "
                f"{region.unit_size[col]}; a part of one head (a key/value head shared by all query heads) would "
                "stay whole on every rank beside the others' shares, which a fused projection's layout cannot hold"
            )
    return None


def validate_layouts(region: RegionPlan, name: str, tp_size: int) -> None:
    """Every column's heads (or features) must split over t; only KV heads may be replicated."""
    widest = max(region.units.values())
    for col, parts in region.parts.items():
        if any(units % tp_size for units in parts):
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide every part of the fused '{name}.{col}' "
                f"({' | '.join(map(str, parts))} units of {region.unit_size[col]}): each rank needs whole "
                f"heads of every part; choose tensor_parallel_size from {_divisors(math.gcd(*parts))}"
            )
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
