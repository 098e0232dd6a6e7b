"""Where a sharded dim goes through a recorded call that no rewriting handler owns, from torch's own op knowledge.

The call runs once on meta tensors of its recorded shapes under a ``TorchDispatchMode`` listing the
aten ops it runs, and each is followed in turn: an op tagged ``torch.Tag.pointwise`` keeps the dim
(broadcasting), any other asks DTensor's sharding propagation (a mesh of the shard ratio, built
without a process group) for its output placement given ``Shard(d)`` inputs, then runs on one
rank's share (a global size argument fails there). ``acts_per_slice`` checks a call neither answers
(a depthwise conv, groups = channels) on sample values. ``OpRefused`` says why a call cannot run on shards.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_META = torch.device("meta")


class OpRefused(Exception):
    """The call cannot run on this rank's share of the sharded dim; the message says why."""


class AtenOps(TorchDispatchMode):
    """Lists the aten ops a call runs, with their (meta) arguments and results."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


@functools.cache
def _mesh(size: int) -> DeviceMesh:
    # no process group: propagation reads only the mesh's shape; ratio 1 (key/value heads whole on
    # each rank) asks a 2-rank mesh, as some of DTensor's rules fail on a 1-rank one
    return DeviceMesh("cpu", list(range(max(size, 2))), _init_backend=False, _rank=0)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _run(call: Callable, args: tuple, kwargs: dict, make: Callable[[fx.Node], torch.Tensor]) -> tuple[Any, dict]:
    """``call`` on meta tensors made by ``make`` for each node; devices named in the arguments become meta."""
    made: dict[fx.Node, torch.Tensor] = {}

    def meta(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value not in made:
                made[value] = make(value)
            return made[value]
        return _META if isinstance(value, torch.device) else value

    m_args, m_kwargs = tree_map(meta, args), tree_map(meta, kwargs)
    if "device" in m_kwargs:
        m_kwargs["device"] = _META
    return call(*m_args, **m_kwargs), made


def _empty(node: fx.Node, dim: int | None = None, ratio: int = 1) -> torch.Tensor:
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        raise OpRefused(f"which discovery does not know (its argument '{node.name}' is no tensor)")
    shape = list(meta.shape)
    if dim is not None:
        shape[dim] //= ratio
    return torch.empty(shape, dtype=meta.dtype, device=_META)


def follow_call(call: Callable, args: tuple, kwargs: dict, sharded: dict[fx.Node, int], ratio: int) -> list:
    """The sharded dim of each tensor ``call(*args, **kwargs)`` returns (None: whole on every rank),
    given the sharded dim of each sharded input node, all split ``ratio`` ways."""
    trace = AtenOps()
    try:
        with trace:
            result, made = _run(call, args, kwargs, _empty)
    except Exception as err:  # the user's call on meta tensors may raise anything
        raise OpRefused(
            f"which discovery does not know (it fails on meta tensors: {type(err).__name__}: {err})"
        ) from err
    placed = {id(made[n]): Shard(d) for n, d in sharded.items()}
    spread: dict[int, set[int]] = {}  # whole tensors expanded from size 1: {id: the dims}
    for func, f_args, f_kwargs, out in trace.ops:
        if func is torch.ops.aten.expand.default and isinstance(out, torch.Tensor):
            base = f_args[0]
            spread[id(out)] = {d for d in range(out.dim()) if _size_at(base, d - out.dim()) == 1 < out.size(d)}
        if any(id(t) in placed for t in _tensors((f_args, f_kwargs))):
            _follow_aten(func, f_args, f_kwargs, out, placed, ratio, spread)
    if result is None:  # __setitem__: the tensor it wrote into
        result = made[next(a for a in args if isinstance(a, fx.Node))]
    outs = _tensors(result)
    found = [_dim(placed.get(id(t))) for t in outs]
    _check_share(call, args, kwargs, sharded, ratio, outs, found)
    return found


def on_meta(module: torch.nn.Module) -> Callable:
    """``module``'s forward with its parameters and buffers as meta tensors (no copy of the module)."""
    tensors = {n: torch.empty_like(t, device=_META) for n, t in (*module.named_parameters(), *module.named_buffers())}

    def call(*args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, tensors, args, kwargs)

    return call


def is_pointwise(call: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether every aten op ``call`` runs (on meta tensors of its recorded shapes) is tagged pointwise."""
    trace = AtenOps()
    try:
        made = {n: _empty(n) for n in tree_flatten((args, kwargs))[0] if isinstance(n, fx.Node)}  # outside the trace
        with trace:
            _run(call, args, kwargs, made.__getitem__)
    except Exception:  # the user's call on meta tensors may raise anything: not known to be pointwise
        return False
    return bool(trace.ops) and all(torch.Tag.pointwise in func.tags for func, *_ in trace.ops)


def per_head_operands(args: tuple, kwargs: dict, sharded: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Whole inputs of a call that line up with the sharded input with the sharded dim's full size
    (counted from the end), {node: dim}: ALiBi's per-head bias added to head-sharded scores, an
    attention sink's logits concatenated to them. Each rank may take its slice where torch's rule
    takes them split too (``follow_call`` with them sharded): Replicate -> Shard is a local cut."""
    (source, dim), *_ = sharded.items()
    width, back = _empty(source).shape[dim], dim - _empty(source).dim()
    candidates = {}
    for node in tree_flatten((args, kwargs))[0]:
        if isinstance(node, fx.Node) and node not in sharded and getattr(node.meta.get("tensor_meta"), "shape", None):
            shape = node.meta["tensor_meta"].shape
            if len(shape) >= -back and shape[back] == width > 1:
                candidates[node] = len(shape) + back
    return candidates


def _dim(placement: Placement | None) -> int | None:
    if placement is None:
        return None
    if type(placement) is not Shard:  # DTensor's _StridedShard, as after flattening (B, nh) into one dim
        raise OpRefused(
            f"which interleaves the sharded dim with another ({placement}): no rank holds a contiguous share"
        )
    return placement.dim


def _size_at(x: torch.Tensor, back: int) -> int:
    """``x``'s size at ``back`` counted from the end; 1 where ``x`` has no such dim (broadcasting)."""
    return x.size(back) if x.dim() >= -back else 1


def _follow_aten(
    func: Any, args: tuple, kwargs: dict, out: Any, placed: dict[int, Placement], ratio: int, spread: dict | None = None
) -> None:
    # the tag first (any op torch calls pointwise, with a DTensor rule or not), then DTensor's per-op rules: kept by torch
    if torch.Tag.pointwise in func.tags and all(
        type(placed.get(id(t), Shard(0))) is Shard for t in _tensors((args, kwargs))
    ):
        _pointwise(args, kwargs, out, placed)
        return
    mesh = _mesh(ratio)

    def spec(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        placement = placed.get(id(value), Replicate())
        return DTensorSpec(mesh, (placement,), TensorMeta(value.shape, value.stride(), value.dtype))

    propagator = DTensor._op_dispatcher.sharding_propagator
    info = propagator.op_to_schema_info.get(func) or propagator.op_to_schema_info_for_single_dim_strategy.get(func)
    schema = OpSchema(func, tree_map(spec, args), tree_map(spec, kwargs), schema_info=info)
    try:
        sharding = propagator.propagate_op_sharding_non_cached(schema)
    except Exception as err:  # no strategy registered, or one that rejects these inputs
        raise OpRefused(f"which discovery does not know ({func} has no sharding rule: {type(err).__name__})") from err
    wanted = sharding.redistribute_schema
    if (
        wanted is not None
        and _placements(wanted) != _placements(schema)
        and _cut_free(args, kwargs, wanted, placed, spread or {})
    ):
        # a whole operand expanded from size 1 along the dim the rule wants sharded: each rank's cut is free
        for tensor, placement in zip(_tensors((args, kwargs)), _placements(wanted)):
            if not placement.is_replicate():
                placed[id(tensor)] = placement
        schema = OpSchema(func, tree_map(spec, args), tree_map(spec, kwargs), schema_info=info)
        sharding = propagator.propagate_op_sharding_non_cached(schema)
        wanted = sharding.redistribute_schema
    if wanted is not None and _placements(wanted) != _placements(schema):  # not merely localised size args
        given = ", ".join(map(str, _placements(schema)))
        raise OpRefused(
            f"which runs {func} on inputs placed {given}, where torch's sharding rule needs "
            f"{', '.join(map(str, _placements(wanted)))} (a redistribution between ranks; R: whole on each)"
        )
    for tensor, out_spec in zip(_tensors(out), [s for s in tree_flatten(sharding.output_spec)[0] if s is not None]):
        placement = out_spec.placements[0]
        if placement.is_partial():
            raise OpRefused(f"which reduces across the sharded dim ({func} gives {placement} over the ranks)")
        if placement.is_replicate():
            placed.pop(id(tensor), None)
        else:
            placed[id(tensor)] = placement


def _cut_free(args: tuple, kwargs: dict, wanted: OpSchema, placed: dict, spread: dict) -> bool:
    """Whether every redistribution ``wanted`` asks for is Replicate -> Shard(d) of a tensor expanded
    from size 1 along d (the same values at every index there, so each rank's slice is its share)."""
    tensors, wants = _tensors((args, kwargs)), _placements(wanted)
    if len(tensors) != len(wants):
        return False
    moves = [(t, w) for t, w in zip(tensors, wants) if placed.get(id(t), Replicate()) != w]
    return bool(moves) and all(
        id(t) not in placed and type(w) is Shard and w.dim in spread.get(id(t), ()) for t, w in moves
    )


def _placements(schema: OpSchema) -> list:
    leaves = tree_flatten((schema.args_schema, schema.kwargs_schema))[0]
    return [s.placements[0] for s in leaves if isinstance(s, DTensorSpec)]


def _pointwise(args: tuple, kwargs: dict, out: Any, placed: dict[int, Placement]) -> None:
    """Elementwise with broadcasting: every sharded input along the same dim counted from the end,
    every other input of size 1 there (or without that dim)."""
    tensors = _tensors((args, kwargs))
    from_end = {placed[id(t)].dim - t.dim() for t in tensors if id(t) in placed}
    if len(from_end) != 1:
        raise OpRefused("which combines tensors sharded along different dims")
    back = from_end.pop()
    for t in tensors:
        if id(t) not in placed and t.dim() >= -back and t.shape[back] != 1:
            raise OpRefused(f"which mixes the sharded dim with an unsharded tensor of shape {tuple(t.shape)}")
    for t in _tensors(out):
        placed[id(t)] = Shard(t.dim() + back)


def _check_share(call: Callable, args: tuple, kwargs: dict, sharded: dict, ratio: int, outs: list, found: list) -> None:
    """On 1/ratio of each sharded input the call must give 1/ratio of each sharded output."""
    expected = []
    for t, dim in zip(outs, found):
        shape = list(t.shape)
        if dim is not None:
            if shape[dim] % ratio:
                raise OpRefused(f"which gives {shape[dim]} along the sharded dim, not divisible by {ratio}")
            shape[dim] //= ratio
        expected.append(tuple(shape))
    try:
        local, made = _run(call, args, kwargs, lambda n: _empty(n, sharded.get(n), ratio))
        if local is None:  # __setitem__: the tensor it wrote into
            local = made[next(a for a in args if isinstance(a, fx.Node))]
        got = [tuple(t.shape) for t in _tensors(local)]
    except Exception as err:  # a size argument naming the global size fails on the share
        got, why = None, f"{type(err).__name__}: {err}"
    else:
        why = f"gives {got}, not {expected}"
    if got != expected:
        raise OpRefused(
            f"which on 1/{ratio} of the sharded dim {why} (a size argument naming a global size only view, "
            "reshape, expand, split and repeat_interleave rewrite)"
        )


SLICE_RTOL = 1e-5  # fp32: each share's outputs are the same sums as the whole call's, in the kernel's order


def local_edge(edge: int, bounds: tuple[int, ...], ratio: int, part_ratios: tuple[int, ...] = ()) -> int:
    """Where the global boundary ``edge`` of fused parts (``bounds``, 0 ... size) falls in a rank's
    ``share_of``: each part before it at its ratio (its own where ``part_ratios`` gives one)."""
    parts = enumerate(zip(bounds, bounds[1:]))
    return sum((min(b, edge) - a) // (part_ratios[i] if part_ratios else ratio) for i, (a, b) in parts if a < edge)


def share_of(
    x: torch.Tensor, dim: int, rank: int, ratio: int, bounds: tuple[int, ...] = (), part_ratios: tuple[int, ...] = ()
) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` along ``dim``: 1/ratio of each fused part between ``bounds``
    (0 ... size), or of the whole dim without them; a part of its own ratio r (``part_ratios``) is
    cut in r, rank ``rank`` taking piece rank * r // ratio (one whole part on ratio / r ranks)."""
    edges = bounds or (0, x.shape[dim])
    pieces = []
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        r = part_ratios[i] if part_ratios else ratio
        pieces.append(x.narrow(dim, a + (rank * r // ratio) * ((b - a) // r), (b - a) // r))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def acts_per_slice(
    call: Callable,
    args: tuple,
    kwargs: dict,
    source: fx.Node,
    dim: int,
    ratio: int,
    bounds: tuple[int, ...] = (),
    part_ratios: tuple[int, ...] = (),
    rewrite_needed: bool = True,
) -> tuple[int, dict[fx.Node, int], list[int]] | None:
    """Whether ``call`` acts on each 1/ratio share of ``source``'s sharded ``dim`` alone (of each fused
    part between ``bounds``), checked on random values: each share, with the same share of every
    other tensor argument holding that dim's full size in one dim (a depthwise conv's weight [C, 1, k]),
    the others whole, and each int argument naming that size at 1/ratio (its ``groups``), gives that share of one output
    dim. Returns (that output dim, the arguments to cut {node: dim}, the argument leaves divided), or None
    (also where nothing needs cutting or dividing, unless ``rewrite_needed`` is False)."""
    leaves, spec = tree_flatten((args, kwargs))
    width = _empty(source).shape[dim]
    cut: dict[fx.Node, int] = {}
    for node in leaves:
        shape = getattr(node.meta.get("tensor_meta"), "shape", None) if isinstance(node, fx.Node) else None
        if node is not source and shape is not None:
            dims = [d for d, n in enumerate(shape) if n == width]
            if len(dims) > 1:
                return None
            if dims:  # none: read whole by every share (a per-channel weight @ a whole input)
                cut[node] = dims[0]
    divided = [i for i, v in enumerate(leaves) if type(v) is int and v == width]
    local_width = local_edge(width, bounds or (0, width), ratio, part_ratios)
    if width % ratio or rewrite_needed and not divided and not cut:
        return None
    try:
        generator = torch.Generator().manual_seed(0)
        tensors = [n for n in leaves if isinstance(n, fx.Node) and n not in cut and n is not source]
        values = {n: _sample(n, generator) for n in (source, *cut, *tensors)}  # the others whole
        whole = tree_unflatten([values.get(v, v) if isinstance(v, fx.Node) else v for v in leaves], spec)
        expected = call(*whole[0], **whole[1])
        found: set[int] | None = None
        dims = {source: dim, **cut}
        for r in range(ratio):
            local = [
                (share_of(values[v], dims[v], r, ratio, bounds, part_ratios) if v in dims else values[v])
                if isinstance(v, fx.Node)
                else v
                for v in leaves
            ]
            local = [local_width if i in divided else v for i, v in enumerate(local)]
            local_args, local_kwargs = tree_unflatten(local, spec)
            got = call(*local_args, **local_kwargs)
            fits = set()
            for d in range(expected.dim()):
                if got.shape[d] != expected.shape[d] * local_width // width or bounds and expected.shape[d] != width:
                    continue
                want = share_of(expected, d, r, ratio, bounds, part_ratios)
                if want.shape == got.shape and torch.allclose(got, want, rtol=SLICE_RTOL, atol=SLICE_RTOL):
                    fits.add(d)
            found = fits if found is None else found & fits
    except Exception:  # the user's call on samples may raise anything: not known to act per slice
        return None
    if not found or len(found) != 1:
        return None
    return found.pop(), cut, divided


def _sample(node: fx.Node, generator: torch.Generator) -> torch.Tensor:
    meta = node.meta["tensor_meta"]
    if not meta.dtype.is_floating_point:
        raise OpRefused("an integer operand")
    return torch.randn(tuple(meta.shape), generator=generator, dtype=torch.float32).to(meta.dtype)
