"""Hold sharded what each rank only reads a share of: a parameter cut to this rank's heads where a call
reads it (a depthwise conv's weight over the heads' channels) is stored as that share alone, so its
memory, gradient and optimizer state split t ways like a column's weight. A parameter read anywhere
else, or through an op that could mix its channels, stays whole and is cut at the call, as before."""

from __future__ import annotations

from torch import fx
from torch.utils._pytree import tree_flatten

from lightning_ptdp.tensor_parallel.discovery_types import OperandSlice, RegionPlan, _shape


def _cut_operands(gm: fx.GraphModule, region: RegionPlan) -> dict[fx.Node, tuple[OperandSlice, set[fx.Node]]]:
    """Each operand node the region's calls cut to this rank's share: its cut (contiguous, in the
    batch's own layout: heads folded into the batch are left to the call) and the calls cutting it."""
    sites = {n.meta["site"]: n for n in gm.graph.nodes if "site" in n.meta}
    found: dict[fx.Node, tuple[OperandSlice, set[fx.Node]]] = {}
    for site, slices in region.operand_slices.items():
        call = sites.get(site)
        if call is None:
            continue
        leaves = tree_flatten((call.args, call.kwargs))[0]
        for cut in slices:
            operand = leaves[cut.index]
            if isinstance(operand, fx.Node) and cut.outer == 1 and not cut.made_inside:
                found.setdefault(operand, (cut, set()))[1].add(call)
    return found


def _ints(node: fx.Node) -> list[int]:
    return [v for v in tree_flatten((node.args, node.kwargs))[0] if isinstance(v, int) and not isinstance(v, bool)]


def _width_dims(node: fx.Node, width: int) -> list[int]:
    return [d for d, size in enumerate(_shape(node) or ()) if size == width]


def _store_as_share(parameter: fx.Node, operands: dict) -> tuple[int, tuple, tuple] | None:
    """(the parameter's dim, fused part bounds, their ratios) when every use of it ends in one cut of the same width,
    through ops reading it alone, keeping exactly one dim of that width and naming no size of it (a
    squeeze, a transpose, an elementwise function; not a view to the config's head count, which the
    model's code would ask of the share too); None otherwise."""
    cuts, stack, seen = [], [parameter], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in operands:
            cut, calls = operands[node]
            if not set(node.users) <= calls:
                return None  # also read whole elsewhere
            cuts.append(cut)
            continue
        if not node.users and node is parameter:
            return None
        for user in node.users:  # a value nothing reads (an argument a kernel wrapper ignored) ends a path
            if user.all_input_nodes != [node] or user.op not in ("call_function", "call_method"):
                return None  # combined with another tensor, or a module's call: it may mix channels
            stack.append(user)
    if not cuts or len({(c.width, c.bounds, c.part_ratios) for c in cuts}) != 1:
        return None
    width, bounds = cuts[0].width, cuts[0].bounds
    if any(len(_width_dims(n, width)) != 1 for n in seen):
        return None
    if any(width in _ints(n) for n in seen if n is not parameter):
        return None  # a size argument naming the whole width (a view to the config's head count)
    return _width_dims(parameter, width)[0], bounds, cuts[0].part_ratios


def _is_parameter(gm: fx.GraphModule, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        return leaf in gm.get_submodule(owner)._parameters
    except AttributeError:
        return False


def stored_cuts(gm: fx.GraphModule, region: RegionPlan) -> dict[str, tuple[int, tuple, tuple]]:
    """Parameter path -> (dim, fused part bounds, their ratios) of each cut parameter every rank can hold as its share."""
    operands = _cut_operands(gm, region)
    found = {}
    for node in gm.graph.nodes:  # a bias as well as a weight; a buffer stays whole (no gradient, no state)
        if node.op == "get_attr" and operands and _is_parameter(gm, node.target):
            share = _store_as_share(node, operands)
            if share is not None:
                found[node.target] = share
    return found
