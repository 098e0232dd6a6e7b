"""Hold sharded what each rank only reads a share of: a parameter cut to this rank's heads where a call
reads it (a depthwise conv's weight over the heads' channels) is stored as that share alone, so its
memory, gradient and optimizer state split t ways like a column's weight. A parameter read anywhere
else, or through an op that could mix its channels, stays whole and is cut at the call, as before."""

from __future__ import annotations

from torch import fx
from torch.utils._pytree import tree_flatten

from lightning_ptdp.tensor_parallel.discovery_types import OperandSlice, RegionPlan, _shape, callable_of
from lightning_ptdp.tensor_parallel.op_semantics import acts_per_slice


def _cut_operands(gm: fx.GraphModule, region: RegionPlan) -> dict[fx.Node, tuple[OperandSlice, set[fx.Node]]]:
    """Each operand node the region's calls cut to this rank's share: its cut (contiguous, in the
    batch's own layout: heads folded into the batch are left to the call) and the calls cutting it;
    one made from the region's input too (a scan's decay from dt) holds no parameter alone, which
    ``_store_as_share`` checks."""
    sites = {n.meta["site"]: n for n in gm.graph.nodes if "site" in n.meta}
    found: dict[fx.Node, tuple[OperandSlice, set[fx.Node]]] = {}
    for site, slices in region.operand_slices.items():
        call = sites.get(site)
        if call is None:
            continue
        leaves = tree_flatten((call.args, call.kwargs))[0]
        for cut in slices:
            operand = leaves[cut.index]
            if isinstance(operand, fx.Node) and cut.outer == 1:
                found.setdefault(operand, (cut, set()))[1].add(call)
    return found


def _ints(node: fx.Node) -> list[int]:
    return [v for v in tree_flatten((node.args, node.kwargs))[0] if isinstance(v, int) and not isinstance(v, bool)]


def _width_dims(node: fx.Node, width: int) -> list[int]:
    return [d for d, size in enumerate(_shape(node) or ()) if size == width]


def _store_as_share(parameter: fx.Node, operands: dict) -> tuple[tuple[int, tuple, tuple], set[str]] | None:
    """((the parameter's dim, fused part bounds, their ratios), the other parameters it needs held
    too) when every use of it ends in one cut of the same width, through ops keeping exactly one dim
    of that width and naming no size of it (a squeeze, a transpose, an elementwise function; not a
    view to the config's head count, which the model's code would ask of the share too). An op may
    read other tensors: whole ones without that width (a per-channel weight @ a whole input), and
    ones of that width made from other parameters alone (those held too), if it acts on each share
    alone (checked on samples). None otherwise."""
    cuts, stack, seen, mixing = [], [parameter], set(), []
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
            if user.op not in ("call_function", "call_method"):
                return None  # a module's call: it may mix channels
            if user.all_input_nodes != [node]:
                mixing.append((user, node))
            stack.append(user)
    if not cuts or len({(c.width, c.bounds, c.part_ratios) for c in cuts}) != 1:
        return None
    width, bounds = cuts[0].width, cuts[0].bounds
    if any(len(_width_dims(n, width)) != 1 for n in seen if _shape(n) is not None or n.users):
        return None  # (a call returning its input, ``w.float()`` of a float w, records no value)
    if any(width in _ints(n) for n in seen if n is not parameter):
        return None  # a size argument naming the whole width (a view to the config's head count)
    partners: set[str] = set()
    for user, node in mixing:
        for other in user.all_input_nodes:
            if other is not node and other not in seen and width in (_shape(other) or ()):
                sources = _width_sources(other, width)
                if sources is None:
                    return None  # of that width, made from the block's inputs: read whole
                partners |= sources
        if not _acts_per_share(user, node, width):
            return None
    return (_width_dims(parameter, width)[0], bounds, cuts[0].part_ratios), partners


def _width_sources(node: fx.Node, width: int) -> set[str] | None:
    """The parameters a value of ``width`` gets that dim from (through values holding it), or None where
    it comes from anything else (the block's inputs, a tensor made from sizes)."""
    found, stack, seen = set(), [node], set()
    while stack:
        n = stack.pop()
        if n in seen or width not in (_shape(n) or ()):
            continue
        seen.add(n)
        if n.op == "get_attr":
            found.add(n.target)
        elif n.op != "call_function" and n.op != "call_method" or not n.all_input_nodes:
            return None
        else:
            stack.extend(n.all_input_nodes)
    return found


def _acts_per_share(user: fx.Node, node: fx.Node, width: int) -> bool:
    """Whether ``user`` gives each rank's share of its output from the shares of its inputs of ``width``."""
    call = callable_of(user)
    dim = _width_dims(node, width)[0]
    return acts_per_slice(call, user.args, user.kwargs, node, dim, 2, rewrite_needed=False) is not None


def _is_parameter(gm: fx.GraphModule, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        return leaf in gm.get_submodule(owner)._parameters
    except AttributeError:
        return False


def stored_cuts(gm: fx.GraphModule, region: RegionPlan) -> dict[str, tuple[int, tuple, tuple]]:
    """Parameter path -> (dim, fused part bounds, their ratios) of each cut parameter every rank can hold
    as its share: alone, or with the other parameters its values meet before the cut (held together)."""
    operands = _cut_operands(gm, region)
    found, needs = {}, {}
    for node in gm.graph.nodes:  # a bias as well as a weight; a buffer stays whole (no gradient, no state)
        if node.op == "get_attr" and operands and _is_parameter(gm, node.target):
            share = _store_as_share(node, operands)
            if share is not None:
                found[node.target], needs[node.target] = share
    while any(not needs[p] <= set(found) for p in found):  # a partner kept whole keeps it whole too
        found = {p: v for p, v in found.items() if needs[p] <= set(found)}
    return found
