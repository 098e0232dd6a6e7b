"""Run a tensor-parallel block's own forward on its shards: the recorded rewrites, applied live.

The forward runs as written under ``_ReplayMode`` (a TorchFunctionMode active only while a TP block
runs). Calls are matched to recorded ones by call site (under torch.compile by order, checked against
the sites eagerly): a shape argument naming a global size along a sharded dim gets its local value,
and every call inside a region reading the region's input gets the entered input (f, or the
all-gathered one under SP, so size reads see the whole sequence). The column Linears take the same
entered input; the row Linear reduces and ends the region. Leaf modules are not matched.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_ptdp.core.sites import CallSite, SiteCounter
from lightning_ptdp.tensor_parallel import collectives as C
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.discovery_types import BlockPlan, OperandSlice, TPDiscoveryError, ancestry
from lightning_ptdp.tensor_parallel.extra_outputs import HeadShardedOutput, wrap_extra_outputs
from lightning_ptdp.tensor_parallel.op_semantics import share_of
from lightning_ptdp.tensor_parallel.recording import outermost_leaves
from lightning_ptdp.tensor_parallel.sequence_linear import SavedInputShard


@torch.compiler.disable  # eagerly: the message reads the user's source line, which dynamo cannot
def _refuse_outside_use(site: CallSite) -> None:
    raise TPDiscoveryError(
        f"tensor parallelism under torch.compile: with sequence_parallel=True the region input read at "
        f"{site.where()} is also used outside its region (a post-norm block adds it to the residual), which only "
        "the uncompiled replay can serve; compile without sequence_parallel, or leave this block uncompiled"
    )


def snapshot_args(graph: fx.Graph) -> dict[fx.Node, tuple]:
    """Each recorded call's arguments before discovery rewrites them."""
    return {n: (n.args, n.kwargs) for n in graph.nodes if "site" in n.meta}


def _ints(value: Any) -> list:
    return tree_flatten(value)[0]


@dataclass(frozen=True)
class Rewrite:
    """One call's argument leaves at record time (global) and after discovery (local)."""

    site: CallSite
    global_leaves: tuple
    local_leaves: tuple
    fold: tuple = ()
    """A view's size leaves: any values with the local product get the local ones (after heads folded
    into the batch, a batch computed as the folded size over the global head count is 1/t of it)."""
    ratio: int | None = field(init=False, compare=False)
    """Global / local size of the leaves discovery divided, where one ratio divides them all (set once:
    ``apply`` runs at every call, and dynamo traces it)."""

    def __post_init__(self) -> None:
        ratios = {g // l for g, l in zip(self.global_leaves, self.local_leaves) if _split_size(g, l)}
        object.__setattr__(self, "ratio", ratios.pop() if len(ratios) == 1 else None)

    def apply(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves, spec = tree_flatten((args, kwargs))
        if len(leaves) != len(self.global_leaves):
            raise TPDiscoveryError(self._mismatch("takes different arguments than when it was recorded"))
        settled = ()
        if self.fold and self._refolds(leaves):
            settled = self.fold
            for i in settled:
                leaves[i] = self.local_leaves[i]
        for i, (glob, loc) in enumerate(zip(self.global_leaves, self.local_leaves)):
            if glob is loc or glob == loc or isinstance(glob, fx.Node) or i in settled:
                continue
            if leaves[i] == glob:
                leaves[i] = loc
            elif leaves[i] != loc:
                raise TPDiscoveryError(
                    self._mismatch(f"passes {leaves[i]} where {glob} (global) or {loc} (local) was expected")
                )
        return tree_unflatten(self._read_locally(leaves), spec)

    def _read_locally(self, leaves: list) -> list:
        """A view's sizes computed from a size read of the shard (``x.size(-1) // n_head``: the local
        features over the global head count) where the recording read the global one: each such leaf,
        1/ratio of its recorded value, is that value, when only then do the sizes hold the tensor's elements."""
        tensor, ratio = leaves[0] if leaves and isinstance(leaves[0], torch.Tensor) else None, self.ratio
        if tensor is None or ratio is None:
            return leaves
        sizes = [i for i, v in enumerate(leaves) if type(v) is int and type(self.global_leaves[i]) is int]
        kept = [i for i in sizes if self.global_leaves[i] == self.local_leaves[i]]  # not the sharded dim's
        read = [i for i in kept if leaves[i] != self.global_leaves[i] and leaves[i] * ratio == self.global_leaves[i]]
        if not read or -1 in (leaves[i] for i in sizes) or math.prod(leaves[i] for i in sizes) == tensor.numel():
            return leaves
        fixed = [self.local_leaves[i] if i in read else v for i, v in enumerate(leaves)]
        return fixed if math.prod(fixed[i] for i in sizes) == tensor.numel() else leaves

    def _refolds(self, leaves: list) -> bool:
        """Size leaves neither all global nor all local, whose product is the local one (loops, not
        generators: dynamo traces this when the block is compiled)."""
        given, local, glob = 1, 1, True
        for i in self.fold:
            given, local = given * leaves[i], local * self.local_leaves[i]
            glob = glob and leaves[i] == self.global_leaves[i]
        return not glob and given == local

    def _mismatch(self, why: str) -> str:
        return (
            f"tensor parallelism: the call to {getattr(self.site.func, '__name__', self.site.func)} at "
            f"{self.site.where()} {why}; the block must run the same code path as the recorded forward"
        )


def _split_size(glob: Any, loc: Any) -> bool:
    return type(glob) is int and type(loc) is int and 0 < loc < glob and glob % loc == 0


@dataclass(frozen=True)
class Source:
    """Where a region's input comes from: a leaf module's output, a call's result, or a block input."""

    kind: str  # "module", "site" or "input"
    key: Any  # module path, CallSite, or index among the block's tensor inputs
    index: int | None = None  # element of a tuple result


@dataclass
class BlockProgram:
    """What one block of a list needs at run time; shared by every block of the list."""

    rewrites: dict[CallSite, Rewrite] = field(default_factory=dict)
    sources: list[Source] = field(default_factory=list)
    outside: dict[CallSite, set[int]] = field(default_factory=dict)  # calls reading a region input outside it
    source_sites: dict[CallSite, list[int]] = field(default_factory=dict)
    funcs: frozenset = frozenset()
    by_ordinal: dict[tuple, CallSite] = field(default_factory=dict)  # (func, n-th call) -> its site
    sites: frozenset = frozenset()  # every call site the replay acts on
    sharded_outputs: dict[int, int] = field(default_factory=dict)  # extra outputs gathered where read
    slices: dict[CallSite, list[OperandSlice]] = field(default_factory=dict)  # whole per-head operands
    entering: dict[int, list[str]] = field(default_factory=dict)  # region -> its leaves reading its input
    sized: dict[CallSite, tuple[int, int]] = field(default_factory=dict)  # head-sharded results: (dim, ratio)

    @classmethod
    def build(cls, graph: fx.Graph, plan: BlockPlan, before: dict[fx.Node, tuple]) -> BlockProgram:
        program = cls()
        for node, (args, kwargs) in before.items():
            if node.args is not args or node.kwargs is not kwargs:
                glob, loc = _ints((args, kwargs)), _ints((node.args, node.kwargs))
                if len(glob) == len(loc) and any(g != l for g, l in zip(glob, loc) if not isinstance(g, fx.Node)):
                    fold = node.meta.get("fold", ())
                    program.rewrites[node.meta["site"]] = Rewrite(node.meta["site"], tuple(glob), tuple(loc), fold)
        nodes = {n.name: n for n in graph.nodes}
        calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for k, region in enumerate(plan.regions):
            program.sharded_outputs.update(region.sharded_outputs)
            program.slices.update(region.operand_slices)
            program.sized.update(region.sharded_sites)
            source = nodes[region.input_node]
            program.sources.append(_source_of(source, placeholders))
            if program.sources[-1].kind == "site":
                program.source_sites.setdefault(program.sources[-1].key, []).append(k)
            inside = ancestry(calls[region.row])
            for user in source.users:
                if user not in inside and "site" in user.meta:
                    program.outside.setdefault(user.meta["site"], set()).add(k)
            if region.prefix or region.gathered:  # its leaves reading the input, columns too, enter it by a hook
                program.entering[k] = [u.target for u in source.users if u in inside and u.op == "call_module"]
        sites = {*program.rewrites, *program.outside, *program.source_sites, *program.slices, *program.sized}
        program.funcs = frozenset(site.func for site in sites)
        program.by_ordinal = {n.meta["ordinal"]: n.meta["site"] for n in graph.nodes if n.meta.get("site") in sites}
        program.sites = frozenset(sites)
        return program


def _source_of(node: fx.Node, placeholders: list[fx.Node]) -> Source:
    if node.op == "placeholder":
        return Source("input", placeholders.index(node))
    if node.op == "call_module":
        return Source("module", node.target)
    if "site" in node.meta:
        return Source("site", node.meta["site"])
    parent, index = node.args[0], node.args[1]  # an element of a tuple result
    if parent.op == "call_module":
        return Source("module", parent.target, index)
    return Source("site", parent.meta["site"], index)


class RegionEntry:
    """One region of one block in one forward: its input, entered once (f), and its SP shard."""

    def __init__(self, tp: TPGroup, sequence_parallel: bool) -> None:
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.source: torch.Tensor | None = None
        self.entered: torch.Tensor | None = None
        self.shard: SavedInputShard | None = None

    def activate(self, tensor: torch.Tensor) -> None:
        self.source, self.entered, self.shard = tensor, None, None

    def enter(self, x: torch.Tensor) -> tuple[torch.Tensor, SavedInputShard | None]:
        if x is self.entered:
            return x, self.shard
        if x is not self.source:
            self.activate(x)
        if self.entered is None:
            if self.sequence_parallel:
                self.entered = C.gather_from_sp_region(x, self.tp)
                # compiled: dynamo cannot trace the shared Regather's side effects, so the Linears save X whole
                saving_shard = torch.is_grad_enabled() and not torch.compiler.is_compiling()
                self.shard = SavedInputShard(x, self.tp) if saving_shard else None
            else:
                self.entered = C.copy_to_tp_region(x, self.tp)
        return self.entered, self.shard

    def finish(self) -> None:
        self.source = self.entered = self.shard = None


class BlockRuntime:
    """The per-block state the replay needs: its program, region entries and leaf depth."""

    def __init__(self, block: nn.Module, program: BlockProgram, tp: TPGroup, sequence_parallel: bool) -> None:
        self.program, self.tp = program, tp
        self.entries = [RegionEntry(tp, sequence_parallel) for _ in program.sources]
        self.on_shards = sequence_parallel  # replicated parameters' gradients are summed after backward
        self.sites = SiteCounter()
        self.calls: dict[Any, int] = {}  # func -> calls so far in this forward
        self.mismatch: CallSite | None = None  # an eager call whose order differs from the recording
        self.depth = 0
        self.sharded: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # this forward's head-sharded results
        self.input_sources = [(s.key, k) for k, s in enumerate(program.sources) if s.kind == "input"]
        for k, source in enumerate(program.sources):
            if source.kind == "module":
                block.get_submodule(source.key).register_forward_hook(
                    functools.partial(self._produced, k, source.index)
                )

    def _produced(self, k: int, index: int | None, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.depth == 0:  # the top-level leaf itself (its depth hook ran first)
            entered = self.source_made(k, output if index is None else output[index])
            if entered is not None:  # compiled SP: the leaf's output becomes the gathered input
                return entered if index is None else _replace(output, index, entered)
        return None

    def source_made(self, k: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """Region ``k``'s input was made. Eager: watch for its reads. Compiled with SP: enter it now and
        hand the gathered tensor on (dynamo reads sizes without the mode, so reads cannot be swapped)."""
        entry = self.entries[k]
        if not (entry.sequence_parallel and torch.compiler.is_compiling()):
            entry.activate(tensor)
            return None
        shared = next((e for e in self.entries if e is not entry and e.entered is tensor), None)
        if shared is not None:  # one leaf feeds two regions (GPT-J): both read the one gathered input
            entry.source, entry.entered, entry.shard = shared.source, shared.entered, None
            return None
        entry.activate(tensor)
        site = next((site for site, regions in self.program.outside.items() if k in regions), None)
        if site is not None:
            _refuse_outside_use(site)
        self.depth += 1  # the entry's own ops run under the replay mode here: leave them alone
        try:
            return entry.enter(tensor)[0]
        finally:
            self.depth -= 1

    def watch_leaves(self, block: nn.Module) -> None:
        """Count leaf-module depth, so calls inside Linears, norms, etc. are not matched."""
        enter, leave = _depth_hooks(self)
        for module in outermost_leaves(block):  # as recorded: a norm in a list of norms is not one
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave, prepend=True)

    def site(self, func: Any) -> CallSite | None:
        """The recorded call this one is. Eager: by call site (code, instruction, occurrence), and
        checked against the order of calls. Compiled: by order (the n-th call of ``func``), since
        dynamo cannot read frames; the eager check is what makes the two agree."""
        n = self.calls.get(func, 0)
        self.calls[func] = n + 1
        expected = self.program.by_ordinal.get((func, n))
        if torch.compiler.is_compiling():
            if self.mismatch is not None:
                raise TPDiscoveryError(
                    f"tensor parallelism under torch.compile: the call at {self.mismatch.where()} runs in a "
                    "different order than when the block was recorded, so calls cannot be matched without "
                    "their frames; run this block uncompiled"
                )
            return expected
        site = self.sites.site(func)
        if site != expected and (site in self.program.sites or expected is not None):
            self.mismatch = site or expected
        return site

    def start(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Reset for one forward; returns the block's arguments (a region input among them entered
        already when compiled with SP, see ``source_made``)."""
        self.sites = SiteCounter()
        self.calls = {}
        self.depth = 0
        if not torch.compiler.is_compiling():  # dynamo cannot trace a weak dict (compiled: local shapes)
            self.sharded = WeakTensorKeyDictionary()
        for entry in self.entries:
            entry.finish()
        if not self.input_sources:
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        for index, k in self.input_sources:
            entered = self.source_made(k, leaves[positions[index]])
            if entered is not None:
                leaves[positions[index]] = entered
        return tree_unflatten(leaves, spec)


def _depth_hooks(runtime: BlockRuntime) -> tuple[Callable, Callable]:
    """The leaf hooks as plain functions, not bound methods: a leaf module shared with another model
    (a global activation instance) keeps them, and ``deepcopy`` copies a function by reference but a
    bound method with its runtime (and process group), which cannot be copied."""

    def enter(module: nn.Module, args: tuple) -> None:
        runtime.depth += 1

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        runtime.depth -= 1

    return enter, leave


class _ReplayMode(TorchFunctionMode):
    def __init__(self, runtime: BlockRuntime) -> None:
        super().__init__()
        self.rt = runtime

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rt = self.rt
        if rt.depth:
            return func(*args, **kwargs)
        if (
            func in _SHAPE_READS
            and not kwargs
            and len(args) == 1
            and not torch.compiler.is_compiling()
            and args[0] in rt.sharded
        ):
            return GlobalShape.of(func(*args), *rt.sharded[args[0]])
        if any(type(a) is GlobalShape for a in (*args, *kwargs.values())):  # handed on as the size it is
            args = tuple(torch.Size(a) if type(a) is GlobalShape else a for a in args)
            kwargs = {k: torch.Size(v) if type(v) is GlobalShape else v for k, v in kwargs.items()}
        program = rt.program
        site = rt.site(func) if func in program.funcs else None
        active = [e for e in rt.entries if e.source is not None]
        if active and any(_reads(a, e.source) for e in active for a in args):
            skip = program.outside.get(site, ()) if site is not None else ()
            for k, entry in enumerate(rt.entries):
                if entry.source is not None and k not in skip:
                    entered, _ = entry.enter(entry.source)
                    args = tuple(_swap(a, entry.source, entered) for a in args)
        if site is not None and site in program.rewrites:
            args, kwargs = program.rewrites[site].apply(args, kwargs)
        if site is not None and site in program.slices:
            args, kwargs = _own_heads(args, kwargs, program.slices[site], rt.tp, rt.on_shards)
        result = func(*args, **kwargs)
        if site in program.sized and isinstance(result, torch.Tensor) and not torch.compiler.is_compiling():
            rt.sharded[result] = program.sized[site]
        if site is not None and site in program.source_sites:
            for k in program.source_sites[site]:
                index = program.sources[k].index
                entered = rt.source_made(k, result if index is None else result[index])
                if entered is not None:
                    result = entered if index is None else _replace(result, index, entered)
        return result


_SHAPE_READS = frozenset({torch.Tensor.size, torch.Tensor.shape.__get__})


class GlobalShape(tuple):
    """A head-sharded tensor's local shape that also compares equal to its global one: the model's own
    check of a whole shape against the config's head count (``attn.size() != (bsz * num_heads, t, s)``)
    passes on the shard. Indexing, unpacking and arithmetic see the local sizes (torch.Size cannot be
    subclassed: this is a tuple with its ``numel``)."""

    global_shape: tuple

    @classmethod
    def of(cls, local: torch.Size, dim: int, ratio: int) -> GlobalShape:
        shape = cls(local)
        shape.global_shape = tuple(n * ratio if i == dim % len(local) else n for i, n in enumerate(local))
        return shape

    def __eq__(self, other: object) -> bool:
        return tuple.__eq__(self, other) is True or self.global_shape == other

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__

    def numel(self) -> int:
        return math.prod(self)


def _own_heads(
    args: tuple, kwargs: dict, slices: list[OperandSlice], tp: TPGroup, on_shards: bool
) -> tuple[tuple, dict]:
    """Each whole per-head operand cut to this rank's heads; one that needs a gradient and is not made
    from the region's input enters the region first (its gradient, this rank's heads only, summed over
    tp: every rank gets all heads'), unless it is made of the block's parameters alone and the block
    runs on 1/t of the sequence, where every replicated parameter's gradient is summed over tp after
    backward. One made from a local size
    already (a key head expanded to this rank's head count) is kept."""
    leaves, spec = tree_flatten((args, kwargs))
    for cut in slices:
        whole = leaves[cut.index]
        if isinstance(whole, HeadShardedOutput):  # another block's sharded output: its local part is the slice
            if (whole._dim, whole._tp) == (cut.dim, tp):
                leaves[cut.index] = whole.local()
                continue
            whole = whole.whole()
        if whole.shape[cut.dim] == cut.local_width(tp.size):
            continue
        if whole.requires_grad and not (cut.made_inside or (on_shards and cut.of_parameters)):
            whole = C.copy_to_tp_region(whole, tp)
        if cut.bounds:  # a fused projection's parts: this rank's share of each
            leaves[cut.index] = share_of(whole, cut.dim, tp.rank, tp.size, cut.bounds, cut.part_ratios)
            continue
        blocks = whole.unflatten(cut.dim, (cut.outer, cut.width // cut.outer))  # heads folded into the batch
        size = blocks.shape[cut.dim + 1] // tp.size
        leaves[cut.index] = blocks.narrow(cut.dim + 1, tp.rank * size, size).flatten(cut.dim, cut.dim + 1)
    return tree_unflatten(leaves, spec)


def _reads(value: Any, tensor: torch.Tensor) -> bool:
    return value is tensor or (isinstance(value, (list, tuple)) and any(v is tensor for v in value))


def _replace(items: Any, index: int, value: Any) -> Any:
    return type(items)(value if i == index else v for i, v in enumerate(items))


def _swap(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    if value is old:
        return new
    if isinstance(value, (list, tuple)) and any(v is old for v in value):
        return type(value)(new if v is old else v for v in value)
    return value


def install_replay(block: nn.Module, runtime: BlockRuntime, whole_sequence: TPGroup | None = None) -> None:
    """Run ``block``'s own forward under the replay from now on (an instance attribute: the
    class, its hooks and wrappers such as transformers' GradientCheckpointingLayer stay).
    ``whole_sequence``: a block in a sequence-parallel list that keeps a region whole runs on the
    whole sequence, without SP: its residual input gathered (gradient: this rank's chunk) and its
    output cut back to this rank's chunk (gradient: gathered), so every rank sees the full gradient."""
    forward = block.forward

    @functools.wraps(forward)
    def replayed(*args: Any, **kwargs: Any) -> Any:
        if whole_sequence is not None:
            args = (C.gather_from_sp_region_split_grad(args[0], whole_sequence), *args[1:])
        args, kwargs = runtime.start(args, kwargs)
        with _ReplayMode(runtime):
            out = forward(*args, **kwargs)
        out = wrap_extra_outputs(out, runtime.program.sharded_outputs, runtime.tp)
        if whole_sequence is None:
            return out
        if isinstance(out, tuple):
            return (C.scatter_to_sp_region(out[0], whole_sequence), *out[1:])
        return C.scatter_to_sp_region(out, whole_sequence)

    block.__dict__["_ptdp_runtime"] = runtime
    block.forward = replayed
