"""Cut an ordinary model into p*v pipeline chunks by running its own forward.

One recording forward (one microbatch) notes the blocks' order and outputs and where each parameter
outside them is used. Each rank keeps its chunks' parameters and gates the blocks and outer modules,
so the model's own forward runs on every stage: an earlier chunk's block hands over the received
activation, the first block after the running chunk stops the forward, another chunk's module
returns a zero stand-in. Only the residual stream crosses a stage. Not torch's ``pipeline()``, whose
torch.export cannot trace our TP blocks (collectives in autograd Functions) or keep control flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ptdp.core.blocks import outer_modules
from lightning_ptdp.core.census import Armed, EveryCall, EveryTorchCall, record_alone
from lightning_ptdp.core.comm import divisors


class PipelineSplitError(ValueError):
    """The model cannot be cut into the requested pipeline chunks; the message says why and what to do."""


@dataclass(frozen=True)
class ChunkLayout:
    """Which blocks each of the p*v chunks holds and which pipeline rank runs it.

    Chunk c holds blocks [c*L/(p*v), (c+1)*L/(p*v)); rank r runs chunks r, r+p, r+2p, ... (the
    paper's interleaved assignment; v=1 is the plain one-chunk-per-rank pipeline).
    """

    num_layers: int
    pp: int
    vpp: int

    def __post_init__(self) -> None:
        chunks = self.pp * self.vpp
        if self.num_layers % chunks:
            fits = [k for k in divisors(self.num_layers) if k > 1]
            vs = [v for v in range(1, self.num_layers + 1) if self.num_layers % (self.pp * v) == 0]
            hint = f"virtual_pipeline_size in {vs} works with pipeline_parallel_size={self.pp}; " if vs else ""
            raise PipelineSplitError(
                f"the model's {self.num_layers} transformer blocks cannot be cut into pipeline_parallel_size("
                f"{self.pp}) * virtual_pipeline_size({self.vpp}) = {chunks} equal chunks; {hint}"
                f"p*v must divide {self.num_layers}: one of {fits}"
            )

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    @property
    def per_chunk(self) -> int:
        return self.num_layers // self.num_chunks

    def chunk_of_block(self, block: int) -> int:
        return block // self.per_chunk

    def blocks_of(self, chunk: int) -> range:
        return range(chunk * self.per_chunk, (chunk + 1) * self.per_chunk)

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def local_chunks(self, rank: int) -> list[int]:
        return list(range(rank, self.num_chunks, self.pp))

    def chunk_at(self, position: int) -> int:
        """The chunk whose code runs after ``position`` blocks (0: before the first block)."""
        return 0 if position == 0 else self.chunk_of_block(position - 1)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tensor.dtype)

    def with_rows(self, rows: int, probe_rows: int) -> tuple[int, ...]:
        return (rows, *self.shape[1:]) if self.shape and self.shape[0] == probe_rows else self.shape


@dataclass
class ProbeRecord:
    """What the recording forward saw (shapes are this rank's, at ``rows`` samples)."""

    rows: int
    block_outputs: list[TensorMeta] = field(default_factory=list)
    block_tails: list[Optional[tuple]] = field(default_factory=list)
    """Per block: (tuple or list, the items after the activation) when it returns one, else None."""
    module_outputs: dict[int, Optional[TensorMeta]] = field(default_factory=dict)  # id(module) -> stand-in shape
    module_chunks: dict[int, set[int]] = field(default_factory=dict)  # id(module) -> chunks that call it
    module_reads: dict[int, set[int]] = field(default_factory=dict)  # id(module) -> chunks reading what it made
    param_chunks: dict[int, set[int]] = field(default_factory=dict)  # id(param) -> chunks that use it


@dataclass(frozen=True)
class _Made:
    """Where a tensor's value comes from, as the recording forward saw it."""

    modules: frozenset[int]  # outer modules whose outputs it was computed from
    chunk: int  # the chunk whose code made it
    from_blocks: bool  # computed from a block's output


class _Flow:
    """A watcher of the census's ``EveryTorchCall``. Follows values through the recording forward: which chunk's code uses each watched parameter,
    and which chunk reads what each outer module made. A later stage re-runs an outer module whose
    result its blocks read (per-layer inputs made once before the first block); a block's
    result read by another chunk's code, other than the activation handed on, cannot cross a stage."""

    def __init__(self, watched: set[int], where: Callable[[], int], record: ProbeRecord) -> None:
        self.watched, self.where, self.record = watched, where, record
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.inside_block = False

    def seen(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        chunk, record = self.where(), self.record
        modules: set[int] = set()
        from_blocks = self.inside_block
        for leaf in tree_leaves((args, kwargs)):
            if not isinstance(leaf, torch.Tensor):
                continue
            if id(leaf) in self.watched:
                record.param_chunks.setdefault(id(leaf), set()).add(chunk)
            made = self.made.get(leaf)
            if made is None:
                continue
            if made.from_blocks and made.chunk < chunk:
                raise PipelineSplitError(
                    f"{getattr(func, '__name__', func)} in chunk {chunk} reads a tensor the blocks of chunk "
                    f"{made.chunk} computed, besides the activation handed from block to block (a key/value "
                    "state shared between layers, block outputs collected for the head); the pipeline split "
                    "sends only that activation between stages. Use pipeline_parallel_size=1 for this model"
                )
            for module in made.modules:
                record.module_reads.setdefault(module, set()).add(chunk)
            modules |= made.modules
            from_blocks = from_blocks or made.from_blocks
        if modules or from_blocks:
            self.tag(result, _Made(frozenset(modules), chunk, from_blocks))

    def tag(self, value: Any, made: _Made) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self.made[leaf] = made


def record_forward(
    model: nn.Module, blocks: list[nn.Module], layout: ChunkLayout, probe: Callable[[], Any], rows: int
) -> ProbeRecord:
    """Run ``probe`` (one ordinary forward on ``rows`` samples) and record what the split needs.

    Raises PipelineSplitError, naming the block or module, for a forward the split cannot cut:
    blocks not each called once in order, a block whose output is not one tensor (or a tuple of one
    and no other tensor), or an activation changed between two blocks."""
    record = ProbeRecord(rows=rows)
    outer = outer_modules(model, blocks)
    state = {"position": 0, "inside": None, "last": None}
    block_index = {id(b): i for i, b in enumerate(blocks)}

    def where() -> int:
        inside = state["inside"]
        return layout.chunk_of_block(inside) if inside is not None else layout.chunk_at(state["position"])

    def before_block(module: nn.Module, args: tuple, kwargs: dict) -> None:
        index = block_index[id(module)]
        if index != state["position"]:
            raise PipelineSplitError(
                f"block {index} ran after {state['position']} blocks; the pipeline split needs the forward to "
                "call every transformer block exactly once, in order"
            )
        if index > 0 and not (args and args[0] is state["last"]):
            raise PipelineSplitError(
                f"block {index} does not receive block {index - 1}'s output as its first argument; the "
                "pipeline split cuts only where one block's output is the next block's input (move code "
                "that changes the activation between blocks into a block)"
            )
        state["inside"] = index
        flow.inside_block = True
        if args and isinstance(args[0], torch.Tensor):  # the activation handed on: this chunk's from here
            flow.tag(args[0], _Made(frozenset(), layout.chunk_of_block(index), True))

    def after_block(module: nn.Module, args: tuple, raw: Any) -> None:
        index = block_index[id(module)]
        output, tail = _activation_and_tail(index, module, raw)
        if output.dim() == 0 or output.shape[0] != rows:
            raise PipelineSplitError(
                f"block {index} returned shape {tuple(output.shape)} for a microbatch of {rows} samples; "
                "the pipeline split needs batch-first activations (batch, sequence, hidden)"
            )
        record.block_outputs.append(TensorMeta.of(output))
        record.block_tails.append(tail)
        if isinstance(raw, (tuple, list)):  # what else it returned: read by a later chunk, it is refused
            flow.tag(list(raw[1:]), _Made(frozenset(), layout.chunk_of_block(index), True))
        state.update(position=index + 1, inside=None, last=output)
        flow.inside_block = False

    def after_outer(module: nn.Module, args: tuple, output: Any) -> None:
        chunk = where()
        record.module_chunks.setdefault(id(module), set()).add(chunk)
        for param in module.parameters(recurse=False):
            record.param_chunks.setdefault(id(param), set()).add(chunk)
        record.module_outputs[id(module)] = TensorMeta.of(output) if type(output) is torch.Tensor else None
        made = flow.made.get(output) if isinstance(output, torch.Tensor) else None
        modules = (made.modules if made else frozenset()) | {id(module)}
        flow.tag(output, _Made(modules, chunk, made.from_blocks if made else False))

    def armed() -> list[Armed]:
        hooks = [b.register_forward_pre_hook(before_block, with_kwargs=True) for b in blocks]
        hooks += [b.register_forward_hook(after_block) for b in blocks]
        hooks += [m.register_forward_hook(after_outer) for m in outer.values()]
        return [*hooks, EveryTorchCall([flow.seen])]

    watched = {id(p) for m in outer.values() for p in m.parameters(recurse=False)}
    flow = _Flow(watched, where, record)

    record_alone(probe, EveryCall(armed))  # the census mechanism, run on the rewritten model: the stages' shapes
    for module in outer.values():  # a later chunk reading what an outer module made runs it again
        for param in module.parameters(recurse=False) if id(module) in record.module_reads else ():
            record.param_chunks.setdefault(id(param), set()).update(record.module_reads[id(module)])
    if state["position"] != len(blocks):
        raise PipelineSplitError(
            f"the probe forward ran {state['position']} of {len(blocks)} transformer blocks; the pipeline "
            "split needs every block called once per forward"
        )
    return record


def _activation_and_tail(index: int, block: nn.Module, output: Any) -> tuple[torch.Tensor, Optional[tuple]]:
    """A block's activation, and (its container, what else it holds) for a tuple or list: only the
    activation crosses a stage, so a tensor in the rest (attention weights a block returns unasked)
    is kept as its ``TensorMeta``. An earlier stage's block gives the rest back beside the received
    activation, a tensor as zeros of its shape, which no later chunk may read (``_Flow`` refuses)."""
    if isinstance(output, torch.Tensor):
        return output, None
    if type(output) in (tuple, list) and output and isinstance(output[0], torch.Tensor):
        rest = tree_map(lambda v: TensorMeta.of(v) if isinstance(v, torch.Tensor) else v, list(output[1:]))
        return output[0], (type(output), tuple(rest))
    raise PipelineSplitError(
        f"block {index} ({type(block).__name__}) returned {type(output).__name__}; the pipeline split sends one "
        "activation tensor between stages, so each block must return a tensor, or a tuple or list of it first"
    )


def _stand_in(value: Any, rows: int, probe_rows: int, device: torch.device) -> Any:
    """A skipped block's extra output: zeros of the recorded shape (expanded: no memory), else the value."""
    if isinstance(value, TensorMeta):
        return torch.zeros((), dtype=value.dtype, device=device).expand(value.with_rows(rows, probe_rows))
    return value


class _ChunkDone(BaseException):
    """Raised by the first block after the running chunk: carries the activation to send.
    A BaseException, so a user's ``except Exception`` in the forward cannot swallow it."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__()
        self.activation = activation


@dataclass
class StageContext:
    """Which chunk the model's forward is running for, and the activation it received."""

    active: Optional[int] = None
    received: Optional[torch.Tensor] = None
    position: int = 0


_OUTSIDE = (
    "pipeline_parallel_size > 1: this rank holds only chunks {chunks} of the model, so its forward runs "
    "inside the pipeline schedule (training_step, validation_step, test_step, predict_step), not directly"
)


@dataclass
class PipelineSplit:
    """This rank's part of the model and how to run one chunk of it."""

    layout: ChunkLayout
    rank: int
    record: ProbeRecord
    context: StageContext
    model: nn.Module
    chunk_param_names: dict[int, list[str]]  # local chunk -> names (on this rank) of the parameters it uses
    tied: list[tuple[str, tuple[int, ...], torch.dtype, Optional[str]]]
    """Parameters used on several ranks, same order everywhere: (original name, shape, dtype, its
    name on this rank or None where not held)."""
    norm_exclude_names: frozenset[str]  # tied parameters whose gradient another rank counts in the norm
    aliases: dict[str, list[str]]  # each name of a kept parameter -> all its names in the original model

    # Parameters are looked up by name when used: FSDP (ZeRO) replaces the Parameter objects.
    def params_of_chunk(self, chunk: int) -> list[nn.Parameter]:
        return [self.model.get_parameter(name) for name in self.chunk_param_names[chunk]]

    def tied_param(self, local_name: Optional[str]) -> Optional[nn.Parameter]:
        return self.model.get_parameter(local_name) if local_name is not None else None

    def norm_exclude(self) -> frozenset[int]:
        return frozenset(id(self.model.get_parameter(name)) for name in self.norm_exclude_names)

    @property
    def local_chunks(self) -> list[int]:
        return self.layout.local_chunks(self.rank)

    def run_chunk(self, chunk: int, received: Optional[torch.Tensor], fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``fn`` (the user's step) with the model in ``chunk``'s mode. Returns (finished, value):
        the step's output on the last chunk, else the activation to send on."""
        ctx = self.context
        ctx.active, ctx.received, ctx.position = chunk, received, 0
        try:
            return True, fn()
        except _ChunkDone as done:
            return False, done.activation
        finally:
            ctx.active, ctx.received = None, None


_GATED_CLASSES: dict[type, type] = {}


def _gated_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that asks the module's gate first. Gating ``__call__`` rather
    than ``forward`` means a block or module another chunk runs is skipped with its hooks (FSDP's
    unshard, sequence-parallel scatter, user hooks): they fire only where the module really runs.
    One subclass per class, so repeated blocks keep one type (as FSDP2 does with its own)."""
    if cls not in _GATED_CLASSES:

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.__dict__["_ptdp_gate"](super(gated, self).__call__, args, kwargs)

        gated = type(f"PipelineGated{cls.__name__}", (cls,), {"__call__": __call__})
        _GATED_CLASSES[cls] = gated
    return _GATED_CLASSES[cls]


def _install_gate(module: nn.Module, gate: Callable[[Callable, tuple, dict], Any]) -> None:
    module.__dict__["_ptdp_gate"] = gate
    if not type(module).__name__.startswith("PipelineGated"):
        module.__class__ = _gated_class(type(module))


def _gate_block(block: nn.Module, index: int, split: PipelineSplit) -> None:
    ctx, layout = split.context, split.layout

    def gate(call: Callable, args: tuple, kwargs: dict) -> Any:
        if ctx.active is None:
            raise RuntimeError(_OUTSIDE.format(chunks=split.local_chunks))
        own = layout.blocks_of(ctx.active)
        if index >= own.stop:
            raise _ChunkDone(args[0].contiguous())
        ctx.position = index + 1
        if index < own.start:
            tail = split.record.block_tails[index]
            if tail is None:
                return ctx.received
            rows, device = ctx.received.shape[0], ctx.received.device
            rest = tree_map(lambda v: _stand_in(v, rows, split.record.rows, device), list(tail[1]))
            return tail[0]((ctx.received, *rest))
        return call(*args, **kwargs)

    _install_gate(block, gate)


def _gate_outer(module: nn.Module, split: PipelineSplit) -> None:
    ctx, layout, meta = split.context, split.layout, split.record.module_outputs.get(id(module))
    reads = split.record.module_reads.get(id(module), set())  # later chunks whose blocks read its output

    def gate(call: Callable, args: tuple, kwargs: dict) -> Any:
        if ctx.active is None:
            raise RuntimeError(_OUTSIDE.format(chunks=split.local_chunks))
        if layout.chunk_at(ctx.position) == ctx.active or ctx.active in reads or meta is None:
            return call(*args, **kwargs)
        # another chunk's module: a zero stand-in, read only by code whose result this chunk ignores; real
        # memory, since the model may write into it in place (embeddings scaled with *=)
        return torch.zeros(meta.shape, dtype=meta.dtype, device=_device_of(module))

    _install_gate(module, gate)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _drop_idle_registrations(model: nn.Module, blocks: list[nn.Module], record: ProbeRecord, local: set[int]) -> None:
    """A weight kept here but registered also in a module no local chunk calls (the last stage's
    token embedding, tied to its LM head) is unregistered from that module, so each kept
    parameter has one home on this rank (FSDP shards it once) and state_dict keys stay honest."""
    outer = outer_modules(model, blocks)
    idle = [
        m
        for m in outer.values()
        if not ((record.module_chunks.get(id(m), {0}) | record.module_reads.get(id(m), set())) & local)
    ]
    idle_ids = {id(m) for m in idle}
    busy = {id(p) for m in outer.values() if id(m) not in idle_ids for p in m.parameters(recurse=False)}
    busy |= {id(p) for block in blocks for p in block.parameters()}
    for module in idle:
        for attr, param in list(module.named_parameters(recurse=False)):
            if id(param) in busy:
                del module._parameters[attr]
                setattr(module, attr, torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape))


def split_model(
    model: nn.Module, blocks: list[nn.Module], layout: ChunkLayout, rank: int, record: ProbeRecord
) -> PipelineSplit:
    """Keep this pipeline rank's chunks of ``model`` (in place) and gate its forward.

    Parameters no local chunk uses are dropped (replaced by a zero stand-in of their shape that
    holds no memory), so optimizers and state dicts see only this rank's part. A parameter used by
    chunks on several ranks (tied embedding and LM head) stays on each of them; ``tied`` lists
    those, in the same order on every rank, for summing their gradients."""
    local = set(layout.local_chunks(rank))
    chunks_of: dict[int, set[int]] = dict(record.param_chunks)
    for index, block in enumerate(blocks):
        for param in block.parameters():
            chunks_of.setdefault(id(param), set()).add(layout.chunk_of_block(index))
    names: dict[int, list[str]] = {}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{module_name}.{attr}" if module_name else attr
            if full not in names.setdefault(id(param), []):
                names[id(param)].append(full)
            if not any(m is module and a == attr for m, a in owners.get(id(param), [])):  # a module reached twice
                owners.setdefault(id(param), []).append((module, attr))
            params[id(param)] = param
    aliases: dict[str, list[str]] = {}
    for pid, param in params.items():
        if chunks_of.get(pid, {0}) & local:  # a parameter the forward never used stays with chunk 0
            for name in names[pid]:
                aliases[name] = names[pid]
            continue
        stand_in = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
        for module, attr in owners[pid]:
            del module._parameters[attr]
            setattr(module, attr, stand_in)
    _drop_idle_registrations(model, blocks, record, local)
    here = {id(p): name for name, p in model.named_parameters()}  # one name per kept parameter
    tied, norm_exclude = [], set()
    chunk_param_names: dict[int, list[str]] = {c: [] for c in sorted(local)}
    for pid, param in params.items():
        chunks = chunks_of.get(pid, {0})
        if len({layout.rank_of(c) for c in chunks}) > 1:
            tied.append((names[pid][0], tuple(param.shape), param.dtype, here.get(pid)))
            if pid in here and layout.rank_of(min(chunks)) != rank:
                norm_exclude.add(here[pid])
        for c in sorted(chunks & local):
            chunk_param_names[c].append(here[pid])
    split = PipelineSplit(
        layout=layout,
        rank=rank,
        record=record,
        context=StageContext(),
        model=model,
        chunk_param_names=chunk_param_names,
        tied=tied,
        norm_exclude_names=frozenset(norm_exclude),
        aliases=aliases,
    )
    for index, block in enumerate(blocks):
        _gate_block(block, index, split)
    for module in outer_modules(model, blocks).values():
        _gate_outer(module, split)
    for module in model.modules():  # modules whose parameters all moved elsewhere are gated too
        if id(module) in record.module_outputs and "_ptdp_gate" not in module.__dict__:
            _gate_outer(module, split)
    return split
