"""What the meta device and the fake process group cannot give a dry run (planner/meta_run.py), supplied.

Shapes where a meta kernel has none, the bytes each collective carries by mesh axis, object
collectives and broadcasts read from the ranks that ran, FSDP2's and autocast's device, and a
peak-only ``MemTracker``. Each lives only inside one dry-run rank's ``fit``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.meta_routing import MetaRouting, RoutingDensity, mapped
from lightning_ptdp.probe import MetaScalarsAsZero

AXES = ("pp", "dp", "cp", "tp", "ep", "edp")  # a group of two axes keeps the first


class MetaShapes(MetaRouting):
    """Shapes on meta where torch's meta kernels give none: ``MetaRouting``'s balanced routing (a
    data-dependent ``nonzero`` takes its upper bound, every element counted, unless the mask compares
    top-k routing choices). An op with no meta kernel runs on zeros on the CPU, as a meta value reads
    as 0 (``MetaScalarsAsZero``); a meta kernel that demands bf16 where the CPU kernel takes the dtype
    given (``_grouped_mm``) runs in bf16. Each read of an unknown value is recorded (``MetaCalls``)."""

    ZEROS_LIMIT = 64 * 2**20  # bytes of CPU zeros an op without a meta kernel may take

    def __init__(self, reads: "MetaCalls") -> None:
        super().__init__(reads)
        self.reads = reads

    def unknown_read(self, metas: list[torch.Tensor]) -> None:
        self.reads.record("a read", metas)

    def on_meta(self, func: Any, args: tuple, kwargs: dict, metas: list[torch.Tensor]) -> Any:
        args, kwargs = self.reads.autocast.cast(func, args, kwargs)  # an op no function-level call cast
        try:
            return super().on_meta(func, args, kwargs, metas)
        except NotImplementedError:
            if sum(t.numel() * t.element_size() for t in metas) > self.ZEROS_LIMIT:
                raise
            counted = func in RoutingDensity.COUNTS and args[0] in self.routing.candidates  # shape known, values too
            if not counted:
                self.reads.record(str(func.overloadpacket.__name__), metas)
            zeros, zeros_kwargs = mapped((args, kwargs), _zeros_on_cpu)
            return self.routing.follow(func, args, kwargs, metas, mapped(func(*zeros, **zeros_kwargs), _to_meta_tensor))
        except RuntimeError as error:
            if "BF16" not in str(error):
                raise
            dtype = next(t.dtype for t in metas if t.is_floating_point())
            bf16 = mapped((args, kwargs), lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
            return mapped(func(*bf16[0], **bf16[1]), lambda t: t.to(dtype) if t.is_floating_point() else t)


class MetaCalls(MetaScalarsAsZero):
    """The dry run's one function-level interception: ``MetaScalarsAsZero`` that remembers each read
    (what, of which parameter or buffer, where in the user's code), so a step that fails on meta says
    which value it needed; ``scaled_dot_product_attention`` as the fused kernel a device runs (its
    output and log-sum-exp, no s x s scores: on meta torch would pick the math path, which keeps them);
    and autocast's casts, which torch applies to CPU tensors only (``AutocastOnMeta``)."""

    _OURS = ("/torch/", "/lightning/", "/lightning_fabric/", "/lightning_utilities/", "/lightning_ptdp/")

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}
        self.seen: list[str] = []
        self.autocast = AutocastOnMeta()

    def name(self, module: torch.nn.Module) -> None:
        """The module's parameters and buffers by name (read again as setup replaces them)."""
        self.names.update(
            {
                id(t): f"{kind} '{n}'"
                for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers()))
                for n, t in items
            }
        )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        autocast = self.autocast
        outer, autocast.dtype = autocast.dtype, autocast.state()  # the ops this call runs see it (at dispatch)
        try:
            args, kwargs = autocast.cast(func, args, kwargs or {})
            if func is torch.nn.functional.scaled_dot_product_attention and args[0].is_meta:
                return _fused_attention(*args, **kwargs)
            return super().__torch_function__(func, types, args, kwargs)
        finally:
            autocast.dtype = outer

    def on_read(self, func: Any, tensor: torch.Tensor) -> None:
        self.record(getattr(func, "__name__", str(func)), [tensor])

    def record(self, what: str, tensors: list[torch.Tensor]) -> None:
        import traceback

        frames = [f for f in traceback.extract_stack()[:-2] if not any(part in f.filename for part in self._OURS)]
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        of = next((self.names[id(t)] for t in tensors if id(t) in self.names), "a tensor of the step")
        read = f"{what} of {of}{where}"
        if read not in self.seen:
            self.seen.append(read)


class AutocastOnMeta:
    """CPU autocast (bf16-mixed on the dry run's CPU accelerator) casts CPU tensors only; on meta its
    casts are asked of torch itself: a call is run under autocast on storage-less fake CPU copies of
    its arguments, and each argument autocast copies to another dtype (a matmul's to bf16, a loss's
    to fp32) is cast so on meta first. Torch's functions are cast where called, so autograd saves
    the copies as on the device; a Python function of another package (a custom autograd Function
    that saves what it chooses) is not, and the ops it runs are cast at dispatch, as temporaries
    (``MetaShapes``). Decided once per call signature."""

    def __init__(self) -> None:
        self.decided: dict[Any, dict[int, torch.dtype]] = {}
        self.fake: Any = None
        self.dtype: Optional[torch.dtype] = None  # autocast's, as the innermost function call saw it

    @staticmethod
    def state() -> Optional[torch.dtype]:
        """Autocast's dtype where a function call sees it enabled (a dispatch mode sees it disabled)."""
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

    def cast(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.dtype is None or _defined_outside_torch(func):
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.is_meta and t.is_floating_point() for t in leaves):
            return args, kwargs
        key = (
            func,
            self.dtype,
            *((t.dtype, t.is_meta) if isinstance(t, torch.Tensor) else _hashable(t) for t in leaves),
        )
        if key not in self.decided:
            self.decided[key] = self._learn(func, leaves, spec)
        for index, dtype in self.decided[key].items():
            if leaves[index].is_meta:
                leaves[index] = leaves[index].to(dtype)
        return tree_unflatten(leaves, spec)

    def _learn(self, func: Any, leaves: list, spec: Any) -> dict[int, torch.dtype]:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        self.fake = self.fake or FakeTensorMode(allow_non_fake_inputs=True)
        quiet = _quiet_logger("torch._subclasses.fake_tensor")  # it logs each refused call; refusals are expected
        with (
            _disable_current_modes(),
            torch._C.DisableTorchFunction(),
            self.fake,
            quiet,
            torch.autocast("cpu", self.dtype),
        ):
            fakes = [_fake_cpu(t) if isinstance(t, torch.Tensor) else t for t in leaves]
            casts = _CastsOf(fakes)
            with casts:
                try:
                    args, kwargs = tree_unflatten(fakes, spec)
                    func(*args, **kwargs)
                except Exception:  # a call fake tensors cannot run (a value read): its arguments stay as they are
                    pass
        return casts.to


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # setLevel, not the attribute: logging caches each level's verdict
    try:
        yield
    finally:
        logger.setLevel(level)


def _defined_outside_torch(func: Any) -> bool:
    return isinstance(func, types.FunctionType) and not (func.__module__ or "").startswith("torch")


class _CastsOf(TorchDispatchMode):
    """The dtype each of ``inputs`` is copied to (autocast's casts reach the dispatcher as ``to`` or ``_to_copy``)."""

    def __init__(self, inputs: list) -> None:
        super().__init__()
        self.index = {id(t): i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        self.to: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _CASTS and args and id(args[0]) in self.index:
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
            if dtype is not None and dtype != args[0].dtype:
                self.to.setdefault(self.index[id(args[0])], dtype)
        return func(*args, **kwargs)


_CASTS = (torch.ops.aten._to_copy, torch.ops.aten.to)  # a function's casts, and autocast's at dispatch


def _fake_cpu(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_meta:
        return tensor
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _hashable(value: Any) -> Any:
    """A call's non-tensor argument as part of its signature: a plain value itself, else its type (the
    key must not keep an object alive, nor the tensors it holds)."""
    return value if isinstance(value, _PLAIN) else type(value)


def _fused_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args), **kwargs)
    query, key, value = named["query"], named["key"], named["value"]
    if named.get("enable_gqa") and key.shape[-3] != query.shape[-3]:  # the kernel reads each kv head per group
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query,
        key,
        value,
        named.get("dropout_p", 0.0),
        named.get("is_causal", False),
        attn_mask=named.get("attn_mask"),
        scale=named.get("scale"),
    )[0]


def _zeros_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tensor.shape, dtype=tensor.dtype) if tensor.is_meta else tensor


def _to_meta_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("meta")


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """torch's FLOP counter has no rule for the grouped GEMM MoE experts run: 2 x rows x K x N, each
    row through its group's matrix (both 2-D: the groups split K)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


EXTRA_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


class Communication(TorchDispatchMode):
    """Sums the bytes of every collective issued (c10d's and the functional ones, which DTensor and
    FSDP2 use), by the mesh axis whose group it ran on."""

    KINDS = (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("all_gather", "all_gather"))
    KINDS += (("allgather", "all_gather"), ("reduce_scatter", "all_gather"), ("broadcast", "all_gather"))
    KINDS += (("alltoall", "all_to_all"), ("all_to_all", "all_to_all"), ("send", "send"))

    def __init__(self, axes: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.axes, self.bytes = axes, {}
        self.calls: dict[tuple[str, str, int], list[int]] = {}
        """(axis, kind, group size) -> [bytes, calls]: what the cost model times (``planner/fit.py``)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        namespace = func.namespace
        if namespace.startswith(("c10d", "_c10d_functional")) and "wait" not in func.__name__:
            self._count(namespace, func.__name__, args)
        return func(*args, **(kwargs or {}))

    def _count(self, namespace: str, name_of_op: str, args: tuple) -> None:
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        tensors = [t for sub in tensors for t in (sub if isinstance(sub, (list, tuple)) else [sub])]
        if namespace != "c10d":
            name = next((a for a in args if isinstance(a, str) and not a.isalpha()), None)
            group = dist.distributed_c10d._resolve_process_group(name) if name else None
        else:
            box = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            group = dist.ProcessGroup.unbox(box) if box is not None else None
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        axis = self.axes.get(ranks, f"{len(ranks)} ranks")
        largest = max((t.numel() * t.element_size() for t in tensors), default=0)
        self.bytes[axis] = self.bytes.get(axis, 0) + largest
        kind = next((kind for part, kind in self.KINDS if part in name_of_op), None)  # recv: the sender's time
        if kind is not None:
            entry = self.calls.setdefault((axis, kind, len(ranks)), [0, 0])
            entry[0], entry[1] = entry[0] + largest, entry[1] + 1


def mesh_axes(dims: ParallelDims) -> dict[tuple[int, ...], str]:
    """Each mesh axis's groups, by their ranks (a group of one rank is no axis)."""
    found: dict[tuple[int, ...], str] = {}
    for axis in AXES:
        for ranks in dims.group_ranks(axis):
            if len(ranks) > 1:
                found.setdefault(tuple(ranks), axis)
    return found


class Broadcasts:
    """What each source rank broadcast, in order, for the ranks dry-run after it: the pipeline's last
    stage runs first, so the others read the step's results it shares (pipeline/step_results.py)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], list] = {}

    def patched(self) -> Callable[..., None]:
        counts: dict[int, int] = {}

        def broadcast_object_list(objects: list, src: Optional[int] = None, group: Any = None, **kw: Any) -> None:
            src = kw.get("group_src") if src is None else src
            if group is not None and kw.get("group_src") is not None:
                src = dist.get_global_rank(group, src)
            n = counts[src] = counts.get(src, 0) + 1
            if src == dist.get_rank():
                self.sent[(src, n)] = list(objects)
            elif (src, n) in self.sent:
                objects[:] = self.sent[(src, n)]
            # else: the source runs later (or never); each rank keeps its own objects, as all build alike

        return broadcast_object_list


@contextlib.contextmanager
def fake_group_reads(broadcasts: Broadcasts) -> Iterator[None]:
    """What reads values the fake group or the meta device cannot give, replaced for the dry run:
    object collectives (each rank's own object stands for every rank's: all ranks build the same
    model from the same code; a broadcast gives what its source sent if that rank ran already), the
    pipeline's static-or-dynamic vote, FSDP2's device (meta: its gathered parameters hold no bytes)
    and autocast on meta tensors (the CPU's)."""
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_init,
        _fsdp_param_group,
        _fsdp_state,
        _fully_shard,
    )
    from torch.distributed.pipelining.stage import InferenceMode, PipelineStage

    def all_gather_object(out: list, obj: Any, group: Any = None) -> None:
        out[:] = [obj] * len(out)

    def gather_object(obj: Any, out: Optional[list] = None, dst: int = 0, group: Any = None, **_: Any) -> None:
        if out is not None:
            out[:] = [obj] * len(out)

    def own_vote(stage: PipelineStage, received_result: Any = None) -> torch.Tensor:
        # every stage of ptdp's engine votes alike (each has its shapes)
        return torch.tensor([0 if InferenceMode.needs_dynamic(stage._user_meta, True) else 1], dtype=torch.int32)

    def batch_isend_irecv(
        ops: list,
    ) -> list:  # coalescing asks the group's backend for the tensors' device: meta has none
        return [
            dist.isend(o.tensor, o.peer, o.group, o.tag)
            if o.op is dist.isend
            else dist.irecv(o.tensor, o.peer, o.group, o.tag)
            for o in ops
        ]

    device_handle = _fsdp_param_group._get_device_handle  # FSDP2's streams and events: the CPU's no-ops on meta

    def handle(device_type: str) -> Any:
        return device_handle("cpu" if device_type == "meta" else device_type)

    class autocast(torch.amp.autocast):  # a model's autocast on its tensors' device: the CPU's rules on meta
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    patches = [
        (torch, "autocast", autocast),
        (torch.amp, "autocast", autocast),
        (dist, "all_gather_object", all_gather_object),
        (dist, "gather_object", gather_object),
        (dist, "broadcast_object_list", broadcasts.patched()),
        (dist, "batch_isend_irecv", batch_isend_irecv),
        (PipelineStage, "_warmup_backward_result", own_vote),
        (_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params", lambda group: None),
        (_fully_shard, "_get_device_from_mesh", lambda mesh: torch.device("meta")),
        (
            _fsdp_init,
            "_move_states_to_device",
            lambda params, buffers, device: None,
        ),  # they stay: meta, or a small buffer
        *((module, "_get_device_handle", handle) for module in (_fsdp_param_group, _fsdp_collectives, _fsdp_state)),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def step_peak_tracker() -> Any:
    """torch's ``MemTracker`` for its peak alone: its per-module statistics refuse a module called
    twice before its backward (a pipeline stage's microbatches), and the dry run reads no module's."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepPeak(MemTracker):
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            pass

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            pass

        def _pre_bw_hook(self, module: Any, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            pass

    return StepPeak()
