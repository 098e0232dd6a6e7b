"""Pair a block's Linears into column -> row regions from its recorded dataflow alone.

A Linear fed by no other Linear, or only by whole outputs (rows after their reduction, the residual
stream), opens a region as a column; one fed only by columns closes it as its row. A chain of
Linears (a low-rank x -> q_a -> q_b -> heads -> o) pairs wrongly in graph order, so its openers are also tried as the
region's prefix: run on the region's input before the columns (``_region_input``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
from torch import fx

from lightning_ptdp.core.blocks import acts_as, is_linear_like
from lightning_ptdp.tensor_parallel.discovery_types import (
    BlockPlan,
    KeptWhole,
    RegionPlan,
    TPDiscoveryError,
    _call_name,
    _shape,
    ancestry,
)
from lightning_ptdp.tensor_parallel.feature_norm import GatheredModule, HeadSlices
from lightning_ptdp.tensor_parallel.recording import RecordedBlock


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


def find_regions(gm: RecordedBlock, name: str) -> list[Assignment]:
    """Group the block's Linears into column -> row regions from the dataflow alone.

    In graph order: a Linear fed by no other Linear, or only by whole outputs (rows, after their
    reduction, e.g. through the residual stream), opens a region as a column; a Linear fed only by
    columns closes their region as its row. Whole on every rank (``BlockPlan.replicated``): a column
    no row closes (a router, a shared-expert gate: its output reaches no Linear), and the
    experts of a ModuleList MoE, whose rows are picked by the routing (Megatron's expert tensor
    parallel size 1; expert parallelism splits them). Linears joined through column outputs form one
    group; a group that is no single column -> row pair (a Linear fed by a column and by the residual,
    a column feeding two rows) is kept whole (``KeptWhole``), with the reason.

    A chain of Linears (q_a -> q_b -> heads -> o, a low-rank bottleneck) pairs wrongly in graph order:
    q_a would close on q_b and leave o with no row. So the Linears opening such a chain are also
    tried as the region's prefix (run on its input before the columns): the assignment in graph order
    comes first, then the one that splits more of the block's weights, if any (``plan_block`` keeps
    the one that splits more once propagated).
    """
    everything = _linear_nodes(gm)
    found = {n: _upstream_linears(n, set(everything)) for n in everything}
    routed: set[fx.Node] = set()  # a routed expert's Linears, and what they feed: whole on every rank
    for node in everything:
        if found[node][1] or found[node][0] & routed:
            routed.add(node)
    linears = [n for n in everything if n not in routed]
    upstream = {n: found[n][0] for n in linears}
    base = best = _assign(gm, everything, linears, upstream, frozenset(), name)
    # a column whose output reaches Linears only mixed with the residual stream (a hyper-connection's
    # injection weights, a gate): replicated, and the Linears paired again as if it were the stream
    fed = {n: [m for m in linears if n in upstream[m]] for n in linears}
    alone = frozenset(  # not one read after a mixed Linear: pairing again may make that one a column
        n
        for n in linears
        if base.roles[n] == "column" and _only_mixed(fed[n], base.roles) and not _only_mixed(upstream[n], base.roles)
    )
    if alone and base.kept:
        trial = _assign(gm, everything, linears, upstream, frozenset(), name, alone)
        if trial.split > base.split:
            base = best = trial
    tried = {frozenset()}
    for _ in range(len(linears)):  # each round adds the openers of the chains still pairing wrongly
        whole = best.whole | _chain_openers(best, linears, upstream, set(everything))
        if whole in tried:
            break
        tried.add(whole)
        trial = _assign(gm, everything, linears, upstream, whole, name, best.alone)
        if trial.split <= best.split:
            break
        best = trial
    return [base] if best is base else [base, best]


@dataclass
class Assignment:
    """One way to pair the block's Linears: regions, the Linears left whole and why, and how many
    weights the regions split."""

    whole: frozenset
    regions: list[RegionPlan]
    replicated: list[str]
    kept: list[KeptWhole]
    roles: dict
    split: int
    context: tuple = field(repr=False, default=())  # what _assign read, to pair again
    alone: frozenset = frozenset()  # Linears replicated before pairing: their outputs count as the stream's

    def with_whole(self, more: set[str]) -> Assignment:
        """The pairing with the Linears named ``more`` also whole (a column whose sharded output an op
        cannot take: a sparse-attention indexer's scores over all its heads)."""
        gm, everything, linears, upstream, name = self.context
        extra = {n for n in linears if n.target in more}
        return _assign(gm, everything, linears, upstream, self.whole | extra, name, self.alone)


def _assign(
    gm: RecordedBlock,
    everything: list,
    linears: list,
    upstream: dict,
    whole: frozenset,
    name: str,
    alone: frozenset = frozenset(),
) -> Assignment:
    """Roles in graph order, given the Linears ``whole`` that run on their region's input before its
    columns (their outputs are whole on every rank, like the residual stream's), and the Linears
    ``alone``, replicated outside any region (their outputs too)."""
    role: dict[fx.Node, str] = {}
    mixed: dict[fx.Node, str] = {}
    inner: set[fx.Node] = set()  # rows whose reduced output a later row of their region also reads
    group = {n: n for n in linears}  # union-find over Linears joined by a column's (sharded) output

    def root(n: fx.Node) -> fx.Node:
        while group[n] is not n:
            n = group[n]
        return n

    for node in linears:
        feeders = {role[u] for u in upstream[node]} - {"prefix", "alone"}
        if node in alone:
            role[node] = "alone"
            continue
        if node in whole:
            role[node] = "prefix"
            if "column" in feeders:
                mixed[node] = f"block '{name}': linear '{node.target}' reads a column-parallel linear's output"
            continue
        role[node] = "column" if "column" not in feeders else "row" if feeders == {"column"} else "whole"
        rows_in = {u for u in upstream[node] if role[u] == "row"}
        columns_in = {root(u) for u in upstream[node] if role[u] == "column"}
        if feeders == {"column", "row"} and all(root(u) in columns_in for u in rows_in):
            role[node] = "row"  # its region's inner row was reduced inside it, then read beside the heads
            inner |= rows_in
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
        if role[node] not in ("prefix", "alone"):
            members.setdefault(root(node), []).append(node)
    regions, kept = [], []
    for nodes in members.values():
        rows = [n for n in nodes if role[n] == "row" and n not in inner]
        if len(nodes) == 1 and not rows:
            continue  # a column no Linear reads: replicated below
        reason = _unsplittable(nodes, rows, mixed, name, set(everything))
        entry = None
        if reason is None:
            columns = [c for c in nodes if c is not rows[0] and c not in inner]
            entry = _region_input(gm, columns, rows[0], upstream, whole, set(everything), inner & set(nodes))
            if entry is None:
                reason = (
                    f"block '{name}': the column-parallel linears {sorted(c.target for c in columns)} of "
                    f"'{rows[0].target}' read different inputs, not all made from one input of the region"
                )
        if reason is not None:
            kept.append(KeptWhole([n.target for n in nodes], reason))
            continue
        source, prefix = entry
        row = rows[0]
        region = RegionPlan([c.target for c in nodes if c is not row and c not in inner], row.target, source.name)
        region.prefix, region.inner_rows = prefix, [n.target for n in nodes if n in inner]
        regions.append(region)
    if whole and any(n in mixed for n in whole):
        kept.append(KeptWhole([n.target for n in whole if n in mixed], mixed[next(n for n in whole if n in mixed)]))
    grouped = {t for r in regions for t in (*r.columns, r.row, *r.prefix, *r.inner_rows)}
    grouped |= {t for k in kept for t in k.linears}
    order = {n.target: i for i, n in enumerate(everything)}
    regions.sort(key=lambda r: order[r.row])
    split = sum(weight_count(gm, t) for r in regions for t in (*r.columns, r.row, *r.inner_rows))
    replicated = [n.target for n in everything if n.target not in grouped]
    context = (gm, everything, linears, upstream, name)
    return Assignment(whole, regions, replicated, kept, role, split, context, alone)


def _only_mixed(readers: list[fx.Node], roles: dict) -> bool:
    """Whether every Linear a column's output reaches reads it mixed with the residual stream."""
    return bool(readers) and all(roles[r] == "whole" for r in readers)


def weight_count(gm: RecordedBlock, target: str) -> int:
    return sum(p.numel() for p in gm.get_submodule(target).parameters())


def split_weights(gm: RecordedBlock, plan: BlockPlan) -> int:
    """The weights a plan splits over t: its Linears', and the parameters ranks hold a share of (a
    depthwise conv's weight cut where it is read, per-head parameters of a module)."""
    linears = sum(weight_count(gm, t) for r in plan.regions for t in (*r.columns, r.row, *r.gathered, *r.inner_rows))
    params = dict(gm.block.named_parameters())
    shares = {path for r in plan.regions for path in r.stored_cuts}
    shares |= {
        f"{module}.{name}"
        for r in plan.regions
        for module, held in r.feature_norms.items()
        if isinstance(held, HeadSlices)
        for name, _ in held.dims
    }
    return linears + sum(params[p].numel() for p in shares if p in params)


def stream_gates(gm: RecordedBlock, replicated: list[str], tp_size: int) -> list[str]:
    """The plain Linears among ``replicated`` whose output has the shape of the block's hidden state
    (one value per token and stream feature, t dividing them): a router's few scores have not."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    hidden = _shape(output.args[0][0]) if output.args[0] else None
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    return [
        t
        for t in replicated
        if hidden is not None
        and t in calls
        and _shape(calls[t]) == hidden
        and acts_as(linear := gm.get_submodule(t), nn.Linear)
        and type(linear) is nn.Linear
        and linear.out_features % tp_size == 0
    ]


def whole_leaf(gm: RecordedBlock, target: str, held: object) -> bool:
    """A leaf with parameters run whole on the gathered features (no module rule split it)."""
    return isinstance(held, GatheredModule) and any(True for _ in gm.get_submodule(target).parameters())


def failed_leaf(gm: RecordedBlock, error: TPDiscoveryError) -> str:
    """The path of the leaf module with parameters (no Linear) a region failed at, or ""."""
    node = getattr(error, "node", None)
    if node is None or node.op != "call_module":
        return ""
    module = gm.get_submodule(node.target)
    return node.target if not is_linear_like(module) and any(True for _ in module.parameters()) else ""


def _chain_openers(best: Assignment, linears: list, upstream: dict, everything: set) -> set[fx.Node]:
    """The columns of the rows that are no region's end, for the first Linear reading such rows (o,
    reading q_b and kv_b before the block returns anything): tried as their regions' prefix. One
    chain a round, in graph order: fixing it re-pairs the Linears after it."""
    role = best.roles
    for node in linears:
        rows = [u for u in upstream[node] if role[u] == "row" and not _returned(u, everything)]
        if rows:
            return {c for r in rows for c in upstream[r] if role[c] == "column"}
    return set()


def _region_input(
    gm: RecordedBlock,
    columns: list[fx.Node],
    row: fx.Node,
    upstream: dict,
    whole: frozenset,
    linears: set[fx.Node],
    inner: set[fx.Node] = frozenset(),
) -> tuple[fx.Node, list[str]] | None:
    """The one input the region enters (f, or the all-gather under SP) and its prefix: the latest
    tensor that the columns' inputs and the inputs of the ``whole`` Linears feeding the region (a
    low-rank q_a, and kv_a, whose rotary key joins the heads) are all made from, and every path from them
    back to the block's inputs passes through (not a later one some paths skip: RWKV's token shift of
    the input, which each column reads mixed with the input itself), meeting no Linear of another region. The prefix
    lists the parameters (module or parameter paths) of what the region computes whole from that
    input (``_whole_side``), used only there: each rank's gradient of them holds its heads' part. None
    when there is no such input."""
    feeding, stack = set(), [u for n in (*columns, row) for u in upstream[n]]
    while stack:
        node = stack.pop()
        if node in whole and node not in feeding:
            feeding.add(node)
            stack.extend(upstream[node])
    inputs = list(dict.fromkeys([c.args[0] for c in columns] + [w.args[0] for w in feeding]))
    common = set.intersection(*(ancestry(i) for i in inputs))
    if not common:
        return None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for source in sorted(common, key=order.__getitem__, reverse=True):
        passes = _every_path_passes(source, inputs, linears, feeding)
        if passes is None:
            return None
        if passes:
            break
    else:
        return None
    prefix = _whole_side(gm, source, columns, row, order, inner)
    return None if prefix is None else (source, prefix)


def _every_path_passes(
    source: fx.Node, inputs: list[fx.Node], linears: set[fx.Node], feeding: set[fx.Node]
) -> bool | None:
    """Whether every path from ``inputs`` back to the block's inputs passes through ``source``; None
    where one meets a Linear of another region (no earlier tensor can be the region's input either)."""
    before, stack, seen = ancestry(source), list(inputs), set()
    passes = True
    while stack:
        node = stack.pop()
        if node is source or node in seen:
            continue
        if node in linears and node not in feeding:
            return None
        passes &= node not in before  # the residual stream around the input: an earlier one may be it
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return passes


def _whole_side(
    gm: RecordedBlock, source: fx.Node, columns: list[fx.Node], row: fx.Node, order: dict, inner: set = frozenset()
) -> list | None:
    """The parameters of what the region computes whole from its input, or from an inner row's
    reduced output: made from them, read by the row, made from no column's output otherwise (the
    prefix's Linears and norms, a gate or recurrence beside the heads, a scan's dt from an inner row); None
    when one is also used outside that side (its gradient would be summed twice)."""
    sharded, stack = set(columns), list(columns)
    while stack:
        for user in stack.pop().users:
            if user not in sharded and user not in inner:
                sharded.add(user)
                stack.append(user)
    made, stack = {source, *inner}, [source, *inner]
    while stack:
        for user in stack.pop().users:
            if user not in made:
                made.add(user)
                stack.append(user)
    side = (made & ancestry(row)) - sharded - {source} - set(inner)
    owners = {n for n in side if n.op == "call_module" and weight_count(gm, n.target) > 0}
    # parameters read directly, or through values made of parameters alone (a conv's weight.unsqueeze(1));
    # a buffer (a position table also read by the heads) needs no gradient sum
    params = dict(gm.block.named_parameters())
    owners |= {i for n in side for i in n.all_input_nodes if i.op == "get_attr"}
    owners |= {a for n in side for i in n.all_input_nodes if i not in made for a in ancestry(i) if a.target in params}
    calls: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_module", "get_attr"):
            calls.setdefault(n.target, []).append(n)
    for node in owners:
        if any(n not in side for n in calls[node.target] if n.op == "call_module"):
            return None  # the module also runs outside the side
        if node.op == "get_attr" and not _feeds_only(node, side, made):
            return None  # the parameter is also read outside the side
    return [n.target for n in sorted(owners, key=order.__getitem__)]


def _feeds_only(node: fx.Node, side: set[fx.Node], made: set[fx.Node]) -> bool:
    """Whether every use of ``node`` is in ``side``, directly or through values made of parameters alone."""
    return all(u in side or (u not in made and u.op != "output" and _feeds_only(u, side, made)) for u in node.users)


def _unsplittable(
    nodes: list[fx.Node], rows: list[fx.Node], mixed: dict, name: str, linears: set[fx.Node]
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
