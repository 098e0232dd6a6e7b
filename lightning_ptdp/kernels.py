"""Slot the Triton kernels into an ordinary model, without the model changing a line.

Attention: the model's ``F.scaled_dot_product_attention`` calls go to ``lightning_ptdp.triton_kernels.flash_attention``
where it can run them, else to torch. Bias + GeLU: a biased Linear whose only user is a GeLU (found
by torch.fx tracing each module's own forward) computes ``x @ W^T`` and the GeLU becomes
``bias_gelu(x, linear.bias)``; the bias stays that Linear's parameter. Mechanism: ``_KernelRouter``,
a TorchFunctionMode owned by the model and entered by forward hooks (surviving the pipeline split
and recompute); a fused Linear is matched by its bias's identity, re-read every forward.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from lightning_ptdp.config import KERNEL_MODES
from lightning_ptdp.core.sdpa import sdpa_args
from lightning_ptdp.tensor_parallel.layers import ColumnParallelLinear
from lightning_ptdp.tensor_parallel.sequence_linear import sequence_parallel_linear

log = logging.getLogger(__name__)
_FIX = "use kernels='auto' (Triton only where it can run, torch elsewhere) or kernels='torch'"
_ROUTER_ATTR = "_ptdp_kernel_router"
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class KernelReport:
    """What ``apply_kernels`` did to a model, for logging."""

    mode: str
    """The requested mode: "auto", "triton" or "torch"."""
    backend: str
    """"triton" when calls are being routed to the kernels, "torch" when nothing was installed."""
    attention: tuple[str, ...] = ()
    """Modules whose forward calls F.scaled_dot_product_attention, now routed to flash_attention
    (empty when attention is left to torch: see ``attention_note``)."""
    bias_gelu: tuple[str, ...] = ()
    """Fused pairs, as "linear -> gelu" module paths ("F.gelu" for functional calls)."""
    skipped: tuple[tuple[str, str], ...] = ()
    """(module, reason) for modules torch.fx could not trace: no bias-GeLU fusion inside them;
    their attention calls are still routed at run time."""
    reason: str | None = None
    """Why nothing was installed, when backend is "torch"."""
    attention_note: str | None = None
    """Why attention was left to torch's SDPA ("auto" without a measured gain, context parallelism), if it was."""
    bias_gelu_note: str | None = None
    """Why "auto" left the Linear->GeLU pairs to torch, if it did."""

    def summary(self) -> str:
        """One line for the log."""
        if self.backend == "torch":
            return f"kernels={self.mode!r}: torch ({self.reason})"
        skipped = f", {len(self.skipped)} module(s) untraceable" if self.skipped else ""
        attention = self.attention_note or f"flash attention in {len(self.attention)} module(s)"
        gelu = self.bias_gelu_note or f"bias-GeLU fused in {len(self.bias_gelu)} pair(s)"
        return f"kernels={self.mode!r}: {attention}, {gelu}{skipped}"


def apply_kernels(
    module: nn.Module, mode: str = "auto", *, device: torch.device | None = None, attention: bool = True
) -> KernelReport:
    """Route ``module``'s attention and Linear->GeLU calls to the Triton kernels.

    mode "auto": only the kernels the GPU suite measured faster end to end on this device class
    (``auto_routes``), where they can run (CUDA with triton installed, supported inputs); torch
    elsewhere, and nothing is installed where none was. "triton": always both kernels,
    raising where they cannot run (no CUDA device and TRITON_INTERPRET unset now; unsupported
    attention inputs at call time). "torch": nothing is installed.
    ``device`` is where the model will run (default: its parameters' device, or CUDA when they
    are on the meta device and a GPU is present); ``attention=False`` routes no attention. Calling
    again replaces the previous routing.
    """
    if mode not in KERNEL_MODES:
        choices = ", ".join(repr(m) for m in KERNEL_MODES)
        raise ValueError(f"kernels={mode!r} is not one of {choices}; choose one of those")
    remove_kernels(module)
    if mode == "torch":
        return KernelReport(mode, "torch", reason="kernels='torch' keeps the model's own torch code")
    from lightning_ptdp.triton_kernels.support import device_reason, triton_importable

    target = _target_device(module, device)
    reason = device_reason(target, allow_interpreter=mode == "triton")
    if reason is not None:
        if mode == "triton" and not triton_importable():
            raise RuntimeError(f"kernels='triton' needs triton: {reason}; {_FIX}")
        if mode == "triton":
            interpret = os.environ.get("TRITON_INTERPRET")
            raise RuntimeError(
                f"kernels='triton' needs a CUDA device or TRITON_INTERPRET=1 (the CPU interpreter), but the "
                f"model runs on {target} and TRITON_INTERPRET is {'unset' if interpret is None else repr(interpret)}; "
                f"{_FIX}"
            )
        return KernelReport(mode, "torch", reason=reason)
    routes, why = (frozenset(KERNELS), None) if mode == "triton" else auto_routes(target)
    notes = {name: None if name in routes else why for name in KERNELS}
    if not attention:  # context parallelism gathers keys and values around the model's own SDPA call
        routes, notes["attention"] = routes - {"attention"}, "attention stays on torch's SDPA under context parallelism"
    if not routes:
        return KernelReport(mode, "torch", reason="; ".join(dict.fromkeys(n for n in notes.values() if n)))
    plan = _Plan.discover(module, routes)
    router = _KernelRouter(mode, plan.fused_linears, plan.names, route_attention="attention" in routes)
    for hooked in plan.hooked:  # no hook where nothing is routed
        router.hook(hooked)
    module.__dict__[_ROUTER_ATTR] = router  # the routing belongs to the model, not to a global
    report = KernelReport(
        mode,
        "triton",
        tuple(plan.attention),
        tuple(plan.pairs),
        tuple(plan.skipped),
        attention_note=notes["attention"],
        bias_gelu_note=notes["bias_gelu"],
    )
    log.info(report.summary())
    return report


KERNELS: tuple[str, ...] = ("attention", "bias_gelu")
"""What the router routes: SDPA calls to flash_attention, Linear->GeLU pairs to bias_gelu."""

MEASURED_FASTER: dict[str, frozenset[str]] = {
    # one H100 (benchmarks/RESULTS.md, section gpu-suite): neither Triton kernel beat torch's end to end, in one
    # unrepeated run that predates the suite's alternated rounds and its verdict
    "sm90": frozenset(),
}
"""Per device class (``device_class``), the kernels that the GPU suite's training part measured faster end
to end than ptdp with torch's kernels in every one of its alternated rounds (its ``auto`` verdict). Filled
from suite results only: "auto" routes nothing on a class not listed."""


def device_class(device: torch.device) -> str | None:
    """The key of ``MEASURED_FASTER`` for ``device``: "sm90" for compute capability 9.0 (H100, H200), None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def auto_routes(device: torch.device) -> tuple[frozenset[str], str]:
    """The kernels "auto" routes on ``device`` (its class's ``MEASURED_FASTER`` entry), and why the others stay torch's."""
    name = device_class(device)
    if name is None:
        return frozenset(), f"no CUDA device here ({device}): no kernel is measured faster on it"
    routes = MEASURED_FASTER.get(name)
    if routes is None:
        return frozenset(), f"no end-to-end measurement on {name}: python -m benchmarks.gpu makes one"
    return routes, f"not measured faster end to end on {name} (benchmarks/RESULTS.md, section gpu-suite)"


def routed_kernels(module: nn.Module) -> tuple[str, ...]:
    """The ``KERNELS`` that ``module``'s calls are routed to now (empty when none or never applied)."""
    router = module.__dict__.get(_ROUTER_ATTR)
    if router is None:
        return ()
    routed = {"attention": router.route_attention, "bias_gelu": len(router._fused) > 0}
    return tuple(name for name in KERNELS if routed[name])


def remove_kernels(module: nn.Module) -> None:
    """Undo ``apply_kernels`` on ``module`` (no-op if it was never applied)."""
    router = module.__dict__.pop(_ROUTER_ATTR, None)
    if router is not None:
        router.unhook()


def _target_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    param = next(module.parameters(), None)
    if param is not None and param.device.type != "meta":
        return param.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _OwnForwardTracer(fx.Tracer):
    """Traces only the root module's own forward: every child module stays one call_module node."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self._root = root

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m is not self._root


class _Plan:
    """Which modules to hook and which Linears to fuse, found by tracing each module's own forward."""

    def __init__(self, routes: frozenset[str]) -> None:
        self.routes = routes
        """The ``KERNELS`` routed: a module is hooked only for those (its attention, its Linear->GeLU pairs)."""
        self.attention: list[str] = []
        self.pairs: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self.hooked: list[nn.Module] = []
        self.fused_linears: list[nn.Linear] = []
        self.names: dict[nn.Module, str] = {}

    @classmethod
    def discover(cls, root: nn.Module, routes: frozenset[str]) -> _Plan:
        plan = cls(routes)
        for name, module in root.named_modules():
            plan.names[module] = name or type(module).__name__
            if isinstance(module, _CONTAINERS) or _is_metric(module):
                continue
            if not any(True for _ in module.children()) and type(module).__module__.startswith("torch.nn"):
                continue  # a built-in leaf (Linear, LayerNorm, GELU...): nothing of ours inside
            plan.add(name, module)
        return plan

    def add(self, name: str, module: nn.Module) -> None:
        label = name or type(module).__name__
        try:
            graph = _OwnForwardTracer(module).trace(module)
            owner = module
        except Exception as err:  # noqa: BLE001 - any tracing failure only means "look at run time"
            first_sentence = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:200]
            self.skipped.append((label, f"torch.fx could not trace it: {type(err).__name__}: {first_sentence}"))
            if "attention" in self.routes:  # its attention calls are routed at run time
                self.hooked.append(module)
            return
        calls_attention = "attention" in self.routes and any(
            node.op == "call_function" and node.target is F.scaled_dot_product_attention for node in graph.nodes
        )
        pairs = _linear_gelu_pairs(owner, graph) if "bias_gelu" in self.routes else []
        for linear_path, gelu_label in pairs:
            linear = owner.get_submodule(linear_path)
            self.fused_linears.append(linear)
            prefix = f"{name}." if name else ""
            gelu_path = gelu_label if gelu_label == "F.gelu" else prefix + gelu_label
            self.pairs.append(f"{prefix}{linear_path} -> {gelu_path}")
        if calls_attention:
            self.attention.append(label)
        if calls_attention or pairs:
            self.hooked.append(module)


def _is_metric(module: nn.Module) -> bool:
    """torchmetrics metrics are modules too, but never call attention or a GeLU."""
    metrics = sys.modules.get("torchmetrics")
    return metrics is not None and isinstance(module, metrics.Metric)


def _linear_gelu_pairs(module: nn.Module, graph: fx.Graph) -> list[tuple[str, str]]:
    """(linear path, gelu label) for each biased Linear called once whose only user is a GeLU."""
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1 or len(node.users) != 1:
            continue
        linear = module.get_submodule(node.target)
        if not isinstance(linear, (nn.Linear, ColumnParallelLinear)) or linear.bias is None:
            continue
        if getattr(linear, "_ptdp_float8", False):  # parallel/float8.py's mark: torchao runs its matmul
            continue
        (user,) = node.users
        if not user.args or user.args[0] is not node or node in user.args[1:] or node in user.kwargs.values():
            continue
        if user.op == "call_function" and user.target is F.gelu:
            pairs.append((node.target, "F.gelu"))
        elif user.op == "call_module" and isinstance(module.get_submodule(user.target), nn.GELU):
            pairs.append((node.target, user.target))
    return pairs


def _linear_args(input, weight, bias=None, **extra):  # noqa: A002 - F.linear's own parameter names
    return input, weight, bias, extra  # extra: sequence_parallel_linear's shard


def _gelu_args(input, approximate="none"):  # noqa: A002
    return input, approximate


def _storage_key(t: torch.Tensor) -> tuple:
    """Identifies a Linear output by its memory, so a DTensor and its .to_local() view match."""
    if hasattr(t, "to_local"):
        with torch.no_grad():
            t = t.to_local()
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.device)


class _KernelRouter(TorchFunctionMode):
    """Routes SDPA and fused Linear->GeLU calls while a hooked module's forward runs."""

    def __init__(
        self, mode: str, fused_linears: list[nn.Linear], names: dict[nn.Module, str], *, route_attention: bool = True
    ) -> None:
        super().__init__()
        self.mode = mode
        self.route_attention = route_attention
        self._fused = weakref.WeakSet(fused_linears)
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary(names)
        self._handles: list[Any] = []
        self._local = threading.local()  # per thread: backward recompute may run on another thread

    # -- pickling / deepcopy: rebuild the weak containers and the thread-local state ----------
    def __getstate__(self) -> dict:
        return {
            "mode": self.mode,
            "fused": list(self._fused),
            "names": dict(self._names),
            "handles": self._handles,
            "route_attention": self.route_attention,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["mode"], state["fused"], state["names"], route_attention=state["route_attention"])
        self._handles = state["handles"]

    # -- hooks ------------------------------------------------------------------------------
    def hook(self, module: nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._enter, prepend=True))
        self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _state(self) -> threading.local:
        state = self._local
        if not hasattr(state, "stack"):
            state.stack, state.biases, state.pending = [], {}, {}
        return state

    def _enter(self, module: nn.Module, args: Any) -> None:
        state = self._state()
        if not state.stack:
            self.__enter__()
            state.biases = {id(lin.bias): (lin.bias, lin) for lin in self._fused if lin.bias is not None}
        state.stack.append(module)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._state()
        if not state.stack or state.stack[-1] is not module:
            return  # our pre-hook did not run for this call (an earlier pre-hook raised)
        state.stack.pop()
        if state.stack:
            return
        self.__exit__(None, None, None)
        leftovers = [self._names.get(linear, "?") for _, _, linear in state.pending.values()]
        state.pending.clear()
        if leftovers and sys.exc_info()[1] is None:
            raise RuntimeError(
                f"kernels: the output of {', '.join(leftovers)} was fused with its GeLU at trace time, but at "
                "run time it was used by something else, so its bias was never added. The forward's dataflow "
                f"differs from what torch.fx traced (data-dependent branches?); {_FIX}"
            )

    # -- routing ----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs) if self.route_attention else func(*args, **kwargs)
        if func is F.linear or func is sequence_parallel_linear:
            return self._linear(func, args, kwargs)
        if func is F.gelu:
            return self._gelu(func, args, kwargs)
        return func(*args, **kwargs)

    def _where(self) -> str:
        stack = self._state().stack
        return self._names.get(stack[-1], type(stack[-1]).__name__) if stack else "?"

    def _attention(self, func, args, kwargs):
        from lightning_ptdp.triton_kernels import attention_supported, flash_attention

        try:
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = sdpa_args(*args, **kwargs)
        except TypeError:  # an SDPA argument this version does not know: leave it to torch
            return func(*args, **kwargs)
        q, k, v = _autocast(q, k, v)
        reason = attention_supported(
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_interpreter=self.mode == "triton"
        )
        if reason is None:
            return flash_attention(q, k, v, causal=is_causal, scale=scale)
        if self.mode == "triton":
            raise ValueError(
                f"kernels='triton' cannot run scaled_dot_product_attention in {self._where()}: {reason}; {_FIX}"
            )
        return func(*args, **kwargs)

    def _linear(self, func, args, kwargs):
        x, weight, bias, extra = _linear_args(*args, **kwargs)
        entry = self._state().biases.get(id(bias)) if bias is not None else None
        if entry is None or entry[0] is not bias:
            return func(*args, **kwargs)
        out = func(x, weight, **extra)
        self._state().pending[_storage_key(out)] = (out, bias, entry[1])  # strong ref until its GeLU
        return out

    def _gelu(self, func, args, kwargs):
        x, approximate = _gelu_args(*args, **kwargs)
        pending = self._state().pending
        entry = pending.pop(_storage_key(x), None) if pending else None
        if entry is None:
            return func(*args, **kwargs)
        bias = entry[1]
        if hasattr(bias, "to_local") and not hasattr(x, "to_local"):
            bias = bias.to_local()  # tensor parallel: this rank's shard of the bias
        if self._bias_gelu_reason(x, bias) is None:
            from lightning_ptdp.triton_kernels import bias_gelu

            return bias_gelu(x, bias, approximate=approximate)
        return func(x + bias, approximate=approximate)

    def _bias_gelu_reason(self, x: torch.Tensor, bias: torch.Tensor) -> str | None:
        from lightning_ptdp.triton_kernels._config import SUPPORTED_DTYPES
        from lightning_ptdp.triton_kernels.support import device_reason

        if hasattr(x, "to_local"):
            return "distributed tensor"
        if x.dtype not in SUPPORTED_DTYPES or bias.dtype not in SUPPORTED_DTYPES:
            return f"dtype {x.dtype}"
        reason = device_reason(x.device, allow_interpreter=self.mode == "triton")
        if reason is not None and self.mode == "triton":
            raise RuntimeError(f"kernels='triton' cannot run bias-GeLU in {self._where()}: {reason}; {_FIX}")
        return reason


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast as autocast would cast SDPA's inputs (the mode sees the call before autocast does)."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
