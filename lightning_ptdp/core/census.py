"""The model census: one run of the user's step, before any rewrite, with every setup reader's
recorder armed, so no axis probes the model its own way: ``BlockInputs`` (each block structure's
first call: TP's recording, the certificate), the experts' calls (``expert_parallel/discovery.py``
``ExpertCalls``) and ``ParamsReached`` (DDP's unused-parameter search). The run stops once every
recorder has what it needs and keeps autograd only where one reads the graph; the pipeline split
runs the same mechanism on the rewritten model (docs/architecture.md, "One census of the model").
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import Any, Callable, ContextManager, Optional, Protocol, Union

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.hooks import RemovableHandle

from lightning_ptdp.core.blocks import find_block_lists, structure_key
from lightning_ptdp.core.sites import caller_frame

Armed = Union[RemovableHandle, ContextManager]


class Recorder(Protocol):
    """One reader's part of the census."""

    needs_grad: bool
    """The recorder reads the step's autograd graph: the run keeps it."""

    def arm(self, census: "ModelCensus") -> list[Armed]:
        """Hooks (removed after the run) or modes (entered around it); a hook that has recorded what
        it needs calls ``census.recorded()``, which ends the run once every recorder is done."""
        ...

    @property
    def done(self) -> bool: ...

    def finish(self, output: Any) -> None:
        """After the run, with what the step returned (None if the run stopped early)."""
        ...

    # optional: ``on_call(func, args, kwargs, out)``, each torch call of the step (EveryTorchCall, one mode)


class _CensusDone(Exception):
    pass


class ModelCensus:
    """Recorders armed together over one run of ``probe`` (one ordinary step of the user's model)."""

    def __init__(self, probe: Callable[[], Any]) -> None:
        self.probe = probe
        self.recorders: list[Recorder] = []
        self.runs = 0

    def add(self, recorder: Recorder) -> Any:
        self.recorders.append(recorder)
        return recorder

    def recorded(self) -> None:
        """Called by a recorder's hook after it recorded: stop the run once nothing is missing."""
        if all(r.done for r in self.recorders):
            raise _CensusDone

    def run(self) -> None:
        """Run the step once with every recorder armed; each recorder then finishes with its output."""
        pending = [r for r in self.recorders if not r.done]
        if not pending:
            return
        output = None
        with ExitStack() as stack:
            for recorder in pending:
                for armed in recorder.arm(self):
                    if isinstance(armed, RemovableHandle):
                        stack.callback(armed.remove)
                    else:
                        stack.enter_context(armed)
            watchers = [r.on_call for r in pending if hasattr(r, "on_call")]
            if watchers:
                stack.enter_context(EveryTorchCall(watchers))
            self.runs += 1
            try:
                with torch.set_grad_enabled(any(r.needs_grad for r in pending)):
                    output = self.probe()
            except _CensusDone:
                pass
        for recorder in pending:
            recorder.finish(output)


class EveryTorchCall(TorchFunctionMode):
    """One mode for whatever reads a step's torch calls without changing them (the census's recorders,
    AuxFreeBalancing): each call runs as it was, then each watcher sees ``(func, args, kwargs, out)``."""

    def __init__(self, watchers: list[Callable[[Any, tuple, dict, Any], None]]) -> None:
        super().__init__()
        self.watchers = watchers

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for watch in self.watchers:
            watch(func, args, kwargs, out)
        return out


class EveryCall:
    """A recorder of hooks and modes that watch the whole step (nothing stops it early)."""

    needs_grad = False
    done = False

    def __init__(self, armed: Callable[[], list[Armed]]) -> None:
        self.armed = armed

    def arm(self, census: ModelCensus) -> list[Armed]:
        return self.armed()

    def finish(self, output: Any) -> None:
        pass


def record_alone(probe: Callable[[], Any], recorder: Recorder) -> Recorder:
    """A census of ``probe`` with one recorder: a reader used outside ``parallelize``'s census."""
    census = ModelCensus(probe)
    census.add(recorder)
    census.run()  # autograd only if the recorder reads the graph
    return recorder


def copy_object(value: Any) -> Any:
    """A copy of an object input the block may change as it runs (a key/value cache), so the call can
    run again as it was; tensors and plain values are kept as they are."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is passed as it is
        return value


def _kept(value: Any) -> Any:
    """A block input as the census keeps it: a tensor without the step's graph, an object copied."""
    return value.detach() if isinstance(value, torch.Tensor) else copy_object(value)


class BlockInputs:
    """The first call's (args, kwargs) of blocks, shared by every setup reader (the certificate,
    TP's recording); each reader gets its own copy of object inputs, so one reader's run cannot
    change another's. Armed in a census for the blocks named; a block asked for later is captured
    by a census of its own.

    Armed for every block list (``of_block_lists``), it also records the code each block runs: the
    call sites of its torch calls (core/sites.py). ``groups`` parts the blocks of a list by structure
    and by that code, so blocks of one class whose forward takes another branch (a flag, a sliding
    or a full attention by layer) are planned and certified apart; the inputs kept are those of
    the first block of each group."""

    needs_grad = False

    def __init__(self, probe: Callable[[], Any], blocks: Optional[list[nn.Module]] = None) -> None:
        self.probe = probe
        self.wanted: list[nn.Module] = list(blocks or [])
        self.captured: dict[int, tuple[tuple, dict]] = {}
        self.ran = False
        self.structures: dict[int, tuple] = {}  # id(block) -> structure key, for every listed block
        self.code: dict[int, frozenset] = {}  # id(block) -> call sites of its first call
        self.firsts: dict[tuple, int] = {}  # (structure, code) -> id of the first block running it
        self.listed: list[nn.Module] = []  # every block of every block list (of_block_lists)
        self._paths: Optional[_CodePaths] = None  # while a census armed for the blocks' code runs

    @classmethod
    def of_block_lists(cls, model: nn.Module, probe: Callable[[], Any]) -> "BlockInputs":
        """Recording every block of every block list: its code, and the inputs of the first of each
        group (what TP and the certificate read)."""
        inputs = cls(probe)
        inputs.listed = [b for _, blocks in find_block_lists(model) for b in blocks]
        inputs.structures = {id(b): structure_key(b) for b in inputs.listed}
        return inputs

    @property
    def done(self) -> bool:
        code = self.ran or all(id(b) in self.code for b in self.listed)  # code is read in the first run only
        return code and all(id(b) in self.captured for b in self.wanted)

    def arm(self, census: ModelCensus) -> list[Armed]:
        wanted = {id(b) for b in self.wanted}

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if id(module) in wanted and id(module) not in self.captured:
                self.captured[id(module)] = tree_map(_kept, (args, kwargs))
                census.recorded()

        armed: list[Armed] = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in self.wanted]
        self._paths = _CodePaths(self, census) if self.listed and not self.ran else None
        return armed + (self._paths.arm(self.listed) if self._paths else [])

    def on_call(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self._paths is not None:
            self._paths.on_call(func)

    def finish(self, output: Any) -> None:
        self.ran, self._paths = True, None

    def groups(self, blocks: list[nn.Module]) -> list[list[int]]:
        """Indices of ``blocks`` (one list) alike in structure and in the code they ran, in order of first
        appearance; a block the step never called joins the first of its structure."""
        if self.listed and not self.ran:
            try:
                record_alone(self.probe, self)
            except Exception:  # noqa: BLE001 - the step fails alone: reading a block's inputs names which one
                self.ran = True
        first_code: dict[tuple, Optional[frozenset]] = {}
        groups: dict[tuple, list[int]] = {}
        for i, block in enumerate(blocks):
            structure = self.structures.get(id(block)) or structure_key(block)
            code = first_code.setdefault(structure, self.code.get(id(block)))
            groups.setdefault((structure, self.code.get(id(block), code)), []).append(i)
        return list(groups.values())

    def of(self, blocks: list[nn.Module]) -> dict[int, tuple[tuple, dict]]:
        """Each given block's inputs (a block the step never called is absent)."""
        missing = [b for b in blocks if id(b) not in self.captured and (not self.ran or b not in self.wanted)]
        if missing:
            self.wanted += missing
            record_alone(self.probe, self)
        return {id(b): tree_map(copy_object, self.captured[id(b)]) for b in blocks if id(b) in self.captured}


class _CodePaths:
    """While a listed block runs its first call: each torch call's site (outside torch and this
    package) joins that block's code; the block's inputs are kept if its code is new for its
    structure (the first block of a new group)."""

    def __init__(self, inputs: BlockInputs, census: ModelCensus) -> None:
        self.inputs, self.census = inputs, census
        self.running: list[tuple[int, set, tuple]] = []  # (id(block), its sites so far, its kept inputs)

    def arm(self, blocks: list[nn.Module]) -> list[Armed]:
        return [
            *(b.register_forward_pre_hook(self._enter, with_kwargs=True) for b in blocks),
            *(b.register_forward_hook(self._leave) for b in blocks),
        ]

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) not in self.inputs.code:
            self.running.append((id(module), set(), tree_map(_kept, (args, kwargs))))

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.running or self.running[-1][0] != id(module):
            return
        key, sites, kept = self.running.pop()
        inputs = self.inputs
        inputs.code[key] = code = frozenset(sites)
        group = (inputs.structures[key], code)
        if group not in inputs.firsts:
            inputs.firsts[group] = key
            inputs.captured.setdefault(key, kept)
        if not self.running:
            self.census.recorded()

    def on_call(self, func: Any) -> None:
        if self.running:
            frame = caller_frame()
            if frame is not None:
                site = (frame.f_code, frame.f_lasti, func)
                for _, sites, _ in self.running:  # a block inside a block: both ran the call
                    sites.add(site)


class ModulesCalled:
    """The modules whose ``__call__`` the step runs (ZeRO 2-3: FSDP gathers a unit's parameters in the
    unit's forward hooks, so a module the step goes around, calling its children itself, cannot be one)."""

    needs_grad = False
    done = False  # the whole step: the loss may call modules after the blocks

    def __init__(self) -> None:
        self.called: set[int] = set()

    def arm(self, census: ModelCensus) -> list[Armed]:
        return [nn.modules.module.register_module_forward_pre_hook(self._seen)]

    def _seen(self, module: nn.Module, args: Any) -> None:
        self.called.add(id(module))

    def finish(self, output: Any) -> None:
        pass


class ParamsReached:
    """Names of ``module``'s trainable parameters the autograd graph of the step's output tensors
    does not reach: the search DDP's ``find_unused_parameters`` makes each step, made once. Empty
    when the output holds no tensor with a graph (nothing to tell). ``routed``: the experts found by
    structure, and parameters the step reads by index (``experts.gate_up_proj[expert_idx]`` in a loop
    over the experts hit): whether a step reads them follows the data, so a later step may not."""

    needs_grad = True
    done = False  # the whole step: the graph is read from its output

    def __init__(self, module: nn.Module, experts: list[str] = ()) -> None:
        self.module = module
        self.unused: list[str] = []
        self.routed: list[str] = list(experts)  # experts found by structure: routed whatever their call
        self._indexed: set[int] = set()

    _PICKS = {torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select}

    def arm(self, census: ModelCensus) -> list[Armed]:
        return []

    def on_call(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A parameter read one slice at a time, by an integer or tensor index: a loop over the experts a
        step hit reads ``gate_up_proj[expert_idx]`` only for those (an index read with ``.item()`` is a
        plain int here, so a constant index counts too: it costs DDP's search, never correctness)."""
        if func in self._PICKS and args and isinstance(args[0], nn.Parameter):
            index = args[1:] if func is torch.Tensor.__getitem__ else args[2:3]
            if any(isinstance(i, (torch.Tensor, int)) and not isinstance(i, bool) for i in tree_flatten(index)[0]):
                self._indexed.add(id(args[0]))

    def finish(self, output: Any) -> None:
        params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.routed = list(dict.fromkeys([*self.routed, *(n for n, p in params if id(p) in self._indexed)]))
        roots: list[torch.Tensor] = []  # the tensors of the step's output (mappings, sequences, dataclasses)
        apply_to_collection(output, torch.Tensor, lambda t: roots.append(t) if t.requires_grad else None)
        if not roots:
            return
        reached = graph_leaves(roots)
        self.unused = [n for n, p in params if id(p) not in reached]


def graph_leaves(roots: list[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors (parameters) the autograd graphs of ``roots`` accumulate into."""
    reached = {id(t) for t in roots if t.grad_fn is None}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes .grad of
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return reached
