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
    ancestry,
    callable_of,
    plan_hint,
    working_plan_hint,
)
from lightning_ptdp.tensor_parallel.op_semantics import is_pointwise
from lightning_ptdp.tensor_parallel.propagation import ShardPropagation
from lightning_ptdp.tensor_parallel.recording import RecordedBlock, record_block
from lightning_ptdp.tensor_parallel.regions import (
    Assignment,
    failed_leaf,
    find_regions,
    split_weights,
    stream_gates,
    whole_leaf,
)
from lightning_ptdp.tensor_parallel.stored_cuts import stored_cuts


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


def detect_layouts(gm: RecordedBlock, region: RegionPlan) -> None:
    """Fill ``blocks``, ``units`` and ``unit_size`` of every column from the global shapes."""
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    for col in region.columns:
        node, dim = _cut_at(nodes[col])
        size, one_head = _shape(node)[dim], len(_shape(node)) > len(_shape(nodes[col]))
        parts, blocks = [nodes[col]], 1
        if len(node.users) == 1:
            user = next(iter(node.users))
            if _call_name(user) in ("split", "chunk") and _shape(user) is None and _split_dim(user) == dim:
                chunk_shapes = [_shape(u) for u in user.users]
                pieces = [s[dim] for s in chunk_shapes if s is not None]
                if len(set(pieces)) == 1 and size % pieces[0] == 0:
                    blocks = size // pieces[0]
                    parts = list(user.users)
                elif len(pieces) > 1 and sum(pieces) == size:  # unequal parts: q | k | v with fewer KV heads
                    _unequal_parts(region, col, list(user.users), pieces, one_head)
                    continue
        sliced = _slice_parts(node, size) if dim == len(_shape(node)) - 1 else None
        if sliced is not None:  # qkv[..., :q], qkv[..., q:q + kv], ... (Phi-3)
            part_nodes, pieces = sliced
            if len(set(pieces)) == 1:
                blocks, parts = len(pieces), part_nodes
            else:
                _unequal_parts(region, col, part_nodes, pieces, one_head)
                continue
        units, unit_size = _units_of(parts[0], size // blocks)
        paired = region.paired_parts.get(col, 1)
        if blocks == 1 and paired > 1 and units % paired == 0:  # heads paired across equal parts
            blocks, units = paired, units // paired
        heads = _sliced_heads(parts[0], size, units) if blocks == 1 and units > 1 else None
        if heads is not None:  # heads | key | value cut from the heads dim after the view (multi-query)
            region.parts[col] = heads
            units, blocks = max(heads), len(heads)
        region.blocks[col], region.units[col], region.unit_size[col] = blocks, units, unit_size
    region.is_attention = any(_call_name(n) == "scaled_dot_product_attention" for n in gm.graph.nodes)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def _cut_at(node: fx.Node) -> tuple[fx.Node, int]:
    """Where a column output's parts are cut, and the dim its features are then in: unless a view
    splits it into heads first (a key of one head, (B, T, 1, hs), whose rotary halves are no parts),
    follow its only users while they keep its features whole: adding or dropping size-1 dims
    (GPTBigCode's unsqueeze), moving them (a transpose to channels-first), or keeping their dim's
    size in place (a clip, a depthwise conv and the slice of its padding)."""
    current, dim = node, len(_shape(node)) - 1
    if _units_of(node, _shape(node)[-1])[1] > 1:
        return current, dim
    for _ in range(8):
        # a same-shape call whose result nothing reads (``x.to(x.dtype)``, recorded, x read on) moves nothing
        users = [u for u in current.users if u.op != "output" and (u.users or _shape(u) not in (None, _shape(current)))]
        if len(users) != 1 or users[0].op not in ("call_function", "call_method"):
            break
        moved = _features_after(current, users[0], dim)
        if moved is None:
            break
        current, dim = users[0], moved
    return current, dim


def _features_after(src: fx.Node, user: fx.Node, dim: int) -> int | None:
    """The dim of ``src``'s features (at ``dim``) in ``user``'s output, or None where it may mix them."""
    shape_in, shape_out = _shape(src), _shape(user)
    if shape_out is None or user.args[:1] != (src,):
        return None
    rank = len(shape_in)
    if _call_name(user) in ("transpose", "swapaxes", "swapdims") and len(user.args) == 3:
        a, b = (d % rank for d in user.args[1:])
        return b if dim == a else a if dim == b else dim
    if dim == rank - 1 and shape_out[-1] == shape_in[-1] and _squeezed(shape_out) == _squeezed(shape_in):
        return len(shape_out) - 1
    if len(shape_out) == rank and shape_out[dim] == shape_in[dim] and dim != rank - 1:
        return dim
    return None


def _split_dim(node: fx.Node) -> int:
    """The dim a recorded split or chunk cuts, counted from the start."""
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    return dim % len(_shape(node.args[0]))


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
    """A fused projection split into unequal parts: each part's heads (or features) split over t, a part
    cut again further on (after a conv over them: x | B | C of a state-space mixer) counting as its pieces.
    ``one_head``: the parts were cut after a size-1 dim was added (a heads dim, as GPTBigCode's
    unsqueeze adds): a part never viewed into heads is one head (its single key/value head)."""
    shapes = [shape for part, size in zip(parts, sizes) for shape in _part_shapes(part, size, one_head)]
    unit_sizes = tuple(unit for _, unit in shapes)
    if len(set(unit_sizes)) == 1:
        region.parts[col] = tuple(units for units, _ in shapes)
    else:  # parts of heads beside parts of groups or features: each of its own unit size
        region.parts[col], region.part_sizes[col] = tuple(units for units, _ in shapes), unit_sizes
    units = max(region.parts[col])
    region.blocks[col], region.units[col], region.unit_size[col] = len(shapes), units, math.gcd(*unit_sizes)


def _part_shapes(node: fx.Node, size: int, one_head: bool) -> list[tuple[int, int]]:
    """(units, unit size) of one part of a fused column's output, or of each piece it is cut into
    after ops that keep its features in place (a transpose, a depthwise conv): a split at that dim."""
    cut, dim = _cut_at(node)
    users = [u for u in cut.users if u.op != "output"]
    if cut is not node and len(users) == 1 and _call_name(users[0]) in ("split", "chunk"):
        user = users[0]
        pieces = [(_shape(u) or ())[dim : dim + 1] for u in user.users]
        lengths = [p[0] for p in pieces if p]
        if _shape(user) is None and _split_dim(user) == dim and len(lengths) == len(user.users) > 1:
            if sum(lengths) == size and len(set(lengths)) > 1:
                return [s for u, n in zip(user.users, lengths) for s in _part_shapes(u, n, False)]
    return [_units_of(node, size, one_head)]


def _units_of(node: fx.Node, features: int, one_head: bool = False) -> tuple[int, int]:
    """Follow a column output to the first view that splits its feature dim into (heads, head size),
    through steps that keep the shape or add or drop size-1 dims; none: ``features`` units of 1, or
    with ``one_head`` one unit of ``features``."""
    found = _head_view(node, features)
    if found is not None:
        return found[1], found[2]
    return (1, features) if one_head else (features, 1)


def _sliced_heads(node: fx.Node, features: int, units: int) -> tuple[int, ...] | None:
    """The parts, in heads, of a column output viewed into heads and read only through slices of
    the heads dim that tile it (``qkv[..., :-2, :]``, ``qkv[..., [-2], :]``, ...), or None."""
    found = _head_view(node, features)
    if found is None:
        return None
    view = found[0]
    dim = next(d for d, n in enumerate(_shape(view)) if n == units and math.prod(_shape(view)[d:]) == features)
    cuts = []
    for user in view.users:
        index = user.args[1] if user.target is operator.getitem else None
        index = index if isinstance(index, tuple) else (index,)
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = (*index[:at], *(slice(None),) * (len(_shape(view)) - len(index) + 1), *index[at + 1 :])
        item = index[dim] if len(index) > dim else None
        if isinstance(item, list) and len(item) == 1 and type(item[0]) is int:
            item = slice(item[0] % units, item[0] % units + 1)
        if not isinstance(item, slice) or item.step not in (None, 1):
            return None
        start, stop = (0 if item.start is None else item.start % units), (units if item.stop is None else item.stop)
        cuts.append((start, stop % units or units if stop < 0 else stop))
    cuts.sort()
    if len(cuts) < 2 or cuts[0][0] != 0 or cuts[-1][1] != units or any(a[1] != b[0] for a, b in zip(cuts, cuts[1:])):
        return None
    return tuple(b - a for a, b in cuts)


def _head_view(node: fx.Node, features: int) -> tuple[fx.Node, int, int] | None:
    """(the view, heads, head size) of the first view splitting a column output's features, reached
    through steps that keep the shape or add or drop size-1 dims."""
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
                return user, *split
        if shape_out[-1] != shape_in[-1] or _squeezed(shape_out) != _squeezed(shape_in):
            break
        current = user
    return None


def _feature_split(shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> tuple[int, int] | None:
    """(units, unit size) when a view keeps the leading elements together and splits the last dim
    into (units, *unit): heads, or KV groups of q/k/v heads (torchtitan)."""
    leading, features = math.prod(shape_in[:-1]), shape_in[-1]
    for j in range(len(shape_out) - 1):
        if math.prod(shape_out[:j]) == leading and math.prod(shape_out[j:]) == features:
            return shape_out[j], features // shape_out[j]
    return None


def plan_block(
    gm: RecordedBlock, name: str, tp_size: int, *, strict: bool = False, keep_whole: dict[str, str] | None = None
) -> BlockPlan:
    """Regions, layouts (validated against t) and the rewritten graph for one block. A region the
    propagation cannot split is kept whole (its rewrites undone) and the others are split; with
    ``strict`` it is refused instead, naming the op and the explicit plan that works. Of the ways to
    pair the Linears (``find_regions``, and each with the columns feeding an op that failed kept
    whole, while others remain), the one that splits the most weights once propagated wins.
    ``keep_whole``: row Linear -> why its region stays whole (a trial run of the split failed: trial.py)."""
    recorded = {n: (n.args, n.kwargs) for n in gm.graph.nodes}
    queue = find_regions(gm, name)
    tried = {a.whole for a in queue}
    best: tuple[int, BlockPlan, dict] | None = None
    errors, leaves = [], []
    for _ in range(MAX_PAIRINGS):
        if not queue:
            break
        assignment = queue.pop(0)
        for node, (args, kwargs) in recorded.items():
            node.args, node.kwargs = args, kwargs
            node.meta.pop("fold", None)
        try:
            plan, failures = _propagate(gm, assignment, name, tp_size, recorded, keep_whole or {})
        except ValueError as error:  # t does not divide this pairing's heads: another pairing may do
            errors.append(error)
            continue
        split = split_weights(gm, plan)
        leaves += [leaf for _, error in failures if (leaf := failed_leaf(gm, error)) and leaf not in leaves]
        if best is None or split > best[0]:
            best = (split, plan, {n: (n.args, n.kwargs, n.meta.get("fold")) for n in gm.graph.nodes})
        for trial in _without_failing_columns(gm, assignment, failures):
            if trial.whole not in tried:
                tried.add(trial.whole)
                queue.append(trial)
    if best is None:
        raise errors[0]
    _, plan, rewritten = best
    for node, (args, kwargs, fold) in rewritten.items():
        node.args, node.kwargs = args, kwargs
        node.meta.pop("fold", None)
        if fold:
            node.meta["fold"] = fold
    leaves += [t for r in plan.regions for t, held in r.feature_norms.items() if whole_leaf(gm, t, held)]
    plan.sequence_bound, plan.failed_leaves = _read_outside(gm, plan.regions), leaves
    plan.gates = stream_gates(gm, plan.replicated, tp_size)
    plan.replicated = [t for t in plan.replicated if t not in plan.gates]
    if strict and plan.kept_whole:
        raise TPDiscoveryError(f"{plan.kept_whole[0].reason}; " + working_plan_hint(name, plan.regions, tp_size))
    gm.graph.lint()
    return plan


MAX_PAIRINGS = 6
"""Pairings propagated per block structure at most (each costs one propagation of the block)."""


def _without_failing_columns(gm: RecordedBlock, assignment: Assignment, failures: list) -> list[Assignment]:
    """For each region that failed at an op, the pairing with the columns feeding that op kept whole,
    when others remain to split (a sparse-attention indexer's q and k beside the attention's)."""
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    trials = []
    for region, error in failures:
        failed = getattr(error, "node", None)
        if failed is None:
            continue
        feeding = ancestry(failed)
        culprits = {c for c in region.columns if calls[c] in feeding}
        if culprits and len(culprits) < len(region.columns):
            trials.append(assignment.with_whole(culprits))
    return trials


def _propagate(
    gm: RecordedBlock, assignment: Assignment, name: str, tp_size: int, recorded: dict, keep_whole: dict
) -> tuple[BlockPlan, list]:
    """The plan of one pairing, and the regions propagation could not split, with their errors."""
    regions, replicated, kept = assignment.regions, list(assignment.replicated), list(assignment.kept)
    for region in regions:
        detect_layouts(gm, region)
        _gather_prefix(gm, region, tp_size)
    single = {id(r): keep_whole[r.row] for r in regions if r.row in keep_whole}
    single.update({id(r): reason for r in regions if (reason := _own_forward(gm, r, name)) is not None})
    kept += [KeptWhole(_all_linears(gm, r), single[id(r)]) for r in regions if id(r) in single]
    regions = [r for r in regions if id(r) not in single]
    for region in regions:
        validate_layouts(region, name, tp_size)
    failed_regions, unpaired = [], {}  # region -> its refusal before its columns were split as paired parts
    while True:
        ratios = {col: r.units[col] // max(1, r.units[col] // tp_size) for r in regions for col in r.columns}
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
            node.meta.pop("fold", None)
        paired = {id(r) for r, e in failures if _pair_parts(gm, r, e, name, tp_size) and unpaired.setdefault(id(r), e)}
        failures = [(r, unpaired.pop(id(r), e)) for r, e in failures if id(r) not in paired]
        for region, _ in failures:  # pairing did not help: the other pairings are tried as before
            region.paired_parts.clear()
        failed = {id(region) for region, _ in failures}
        regions = [r for r in regions if id(r) not in failed]
        kept += [KeptWhole(_all_linears(gm, r), str(error)) for r, error in failures]
        failed_regions += failures
        for region in regions:
            region.reset_propagation()
    for region in regions:
        region.stored_cuts = stored_cuts(gm, region)
        region.prefix = [p for p in region.prefix if p not in region.stored_cuts]  # its own rows: no sum
    return BlockPlan(gm.graph, regions, replicated=replicated, kept_whole=kept), failed_regions


def _pair_parts(gm: RecordedBlock, region: RegionPlan, error: TPDiscoveryError, name: str, tp_size: int) -> bool:
    """Where an op pairs heads across equal parts (``error.parts``), split the columns feeding it that
    still split contiguously as that many fused parts, to follow the region again: whether any changed."""
    parts = getattr(error, "parts", 0)
    feeding = ancestry(error.node) if parts > 1 else set()
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    changed = [
        col
        for col in region.columns
        if calls[col] in feeding
        and region.blocks[col] == 1
        and col not in region.parts
        and col not in region.paired_parts
    ]
    if not changed:
        return False
    region.paired_parts.update(dict.fromkeys(changed, parts))
    detect_layouts(gm, region)
    try:
        validate_layouts(region, name, tp_size)
    except ValueError:
        return False
    return True


def _all_linears(gm: RecordedBlock, region: RegionPlan) -> list[str]:
    """The region's Linears, its prefix's included (what stays whole when it cannot be split)."""
    prefix = [t for t in (*region.gathered, *region.prefix) if is_linear_like(_target(gm, t))]
    return [*region.columns, *region.inner_rows, region.row, *prefix]


def _target(gm: RecordedBlock, target: str) -> object:
    try:
        return gm.get_submodule(target)
    except AttributeError:  # a parameter's path
        return None


def _read_outside(gm: RecordedBlock, regions: list[RegionPlan]) -> str:
    """Why a region's input is read outside every region other than elementwise (a post-norm block
    adding it to the residual, which the replay serves on the shard): "" when it is not."""
    nodes = {n.name: n for n in gm.graph.nodes}
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    inside = set().union(*(ancestry(calls[r.row]) for r in regions)) if regions else set()
    for region in regions:
        for user in nodes[region.input_node].users:
            if user in inside or user.op == "output":
                continue
            call = callable_of(user)
            if user.op == "call_module" or not is_pointwise(call, user.args, user.kwargs):
                return f"'{user.format_node()}' reads the input of the region ending in '{region.row}' outside it"
    return ""


def _gather_prefix(gm: RecordedBlock, region: RegionPlan, tp_size: int) -> None:
    """The prefix's Linears that split evenly by output features are gathered columns; the rest of
    the prefix stays whole on every rank, its gradient summed over tp."""
    for target in list(region.prefix):
        module = _target(gm, target)
        if isinstance(module, nn.Linear) and acts_as(module, nn.Linear) and module.out_features % tp_size == 0:
            region.gathered.append(target)
            region.prefix.remove(target)


def _divisors(n: int) -> str:
    return _either([d for d in range(1, n + 1) if n % d == 0])


def _fitting(parts: tuple[int, ...]) -> str:
    """The t that split every part evenly or copy it evenly (fewer units than t)."""
    return _either([t for t in range(1, max(parts) + 1) if all(u % t == 0 or t % u == 0 for u in parts)])


def _either(options: list[int]) -> str:
    """'1, 2 or 4'."""
    return ", ".join(map(str, options[:-1])) + f" or {options[-1]}" if len(options) > 1 else str(options[0])


def _own_forward(gm: RecordedBlock, region: RegionPlan, name: str) -> str | None:
    """Why a region holding a Linear subclass that computes more than F.linear (or trains another
    parameter) cannot be split: its shards run F.linear alone. None when every Linear is plain."""
    for linear in (*region.columns, *region.inner_rows, region.row):
        module = gm.get_submodule(linear)
        if not is_conv1d(module) and not acts_as(module, nn.Linear):
            return (
                f"block '{name}': '{linear}' is a {type(module).__name__} whose own forward or parameters go beyond "
                "F.linear(x, weight, bias), which a column or row shard computes"
            )
    return None


def validate_layouts(region: RegionPlan, name: str, tp_size: int) -> None:
    """Every column's heads (or features) must split over t; only KV heads may be replicated."""
    widest = max(region.units.values())
    for col, parts in region.parts.items():
        if any(units % tp_size if units >= tp_size else tp_size % units for units in parts):
            raise ValueError(
                f"tensor_parallel_size={tp_size} does not divide every part of the fused '{name}.{col}' "
                f"({' | '.join(map(str, parts))} units of {region.unit_size[col]}): each rank needs whole "
                f"heads of every part, or a whole one copied to t / units ranks; choose tensor_parallel_size from "
                f"{_fitting(parts)}"
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
