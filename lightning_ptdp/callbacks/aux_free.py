"""AuxFreeBalancing: DeepSeek-V3's auxiliary-loss-free load balancing, found from the model.

A router's correction bias is a floating 1-D tensor of a module, added to the router's scores just
before the ``topk`` that picks the experts. The first training step follows each such tensor's
value to the topks it reaches; later steps count the experts that topk chose (over every
microbatch and every replica), and after each optimizer step every rank applies DeepSeek-V3's
rule (its Section 2.1.2) in place: ``bias_i += rate * sign(mean_load - load_i)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from lightning_ptdp.core.census import EveryTorchCall
from lightning_ptdp.core.comm import local_tensor

_TOPK = (torch.topk, torch.Tensor.topk)
_ADD = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
_REACH = 32  # ops a bias is followed past its add: a router's topk comes a few ops after, never dozens
_TAINT, _PURE = "_aux_free_taint", "_aux_free_pure"  # tensor attributes, set during the first step only


def _in_backward() -> bool:
    """True while autograd runs a backward (a checkpointed forward's recomputation: not new tokens)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Bias:
    """A floating 1-D tensor ``module.<attr>``, a correction-bias candidate."""

    name: str
    module: nn.Module
    attr: str

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)


@dataclass
class _Router:
    """A found router: its bias, and the topk choosing its experts (the ``ordinal``-th topk call
    during a forward of ``site``, the innermost module running it)."""

    bias: _Bias
    site: nn.Module
    ordinal: int
    counts: torch.Tensor  # tokens per expert since the last update, on this rank


def _topk_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor, int]:
    x = args[0] if args else kwargs["input"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return x, dim


class _Finder:
    """The census's kind of watcher (``EveryTorchCall``). Over the first step: a bias's value is followed from an add of it (or a pure cast/view of it)
    to another tensor; a topk over as many entries as the bias has, whose input the bias reached
    (the nearest such bias, within _REACH ops), marks a router. Also counts each such topk's choices."""

    def __init__(self, candidates: list[_Bias], model: nn.Module) -> None:
        self.mode = EveryTorchCall([self.seen])
        self.candidates = candidates
        self.index = {id(c.tensor): i for i, c in enumerate(candidates)}
        self.stack: list[list] = []  # [module, topk calls in its forward so far], innermost last
        self.latest: dict[int, tuple[nn.Module, int]] = {}  # bias index -> its last topk (site, ordinal)
        self.counts: dict[tuple[int, int, int], torch.Tensor] = {}  # (bias, id(site), ordinal) -> counts
        inside = {id(m) for m in model.modules()}

        def enter(module: nn.Module, args: Any) -> None:
            if id(module) in inside:
                self.stack.append([module, 0])

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1][0] is module:
                self.stack.pop()

        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(enter),
            nn.modules.module.register_module_forward_hook(leave, always_call=True),
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _source(self, t: torch.Tensor) -> Optional[int]:
        return self.index.get(id(t), getattr(t, _PURE, None))

    def seen(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if _in_backward():
            return
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _TOPK:
            self._topk(args, kwargs, out)
        sources = {self._source(t) for t in tensors}
        taint: dict[int, int] = {}
        for t in tensors:
            for b, d in getattr(t, _TAINT, {}).items():
                if d < _REACH:
                    taint[b] = min(taint.get(b, _REACH), d + 1)
        if func in _ADD and len(tensors) == 2 and len(sources) == 2 and None in sources:
            (b,) = sources - {None}
            other = tensors[0] if self._source(tensors[1]) == b else tensors[1]
            if other.dim() and other.shape[-1] == self.candidates[b].tensor.numel():
                taint[b] = 0  # bias + scores
        pure = next(iter(sources)) if len(sources) == 1 and None not in sources else None
        if taint or pure is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in self.index:
                    setattr(t, _PURE, pure)
                    setattr(t, _TAINT, taint)

    def _topk(self, args: tuple, kwargs: dict, out: Any) -> None:
        for frame in self.stack:
            frame[1] += 1
        if not self.stack:
            return
        x, dim = _topk_input(args, kwargs)
        size = x.shape[dim]
        reached = [(d, b) for b, d in getattr(x, _TAINT, {}).items() if self.candidates[b].tensor.numel() == size]
        if not reached:
            return
        _, b = min(reached)
        site, ordinal = self.stack[-1][0], self.stack[-1][1] - 1
        self.latest[b] = (site, ordinal)
        key = (b, id(site), ordinal)
        counts = local_tensor(out[1]).flatten().bincount(minlength=size)
        self.counts[key] = self.counts.get(key, 0) + counts


class _Counter:
    """During one forward of a router's site: add the chosen experts of its router topks to their counts."""

    def __init__(self, routers: dict[int, _Router]) -> None:
        self.routers, self.calls = routers, 0

    def seen(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func in _TOPK:
            router = self.routers.get(self.calls)
            if router is not None:
                router.counts += local_tensor(out[1]).flatten().bincount(minlength=router.counts.numel())
            self.calls += 1


class AuxFreeBalancing(pl.Callback):
    """Balance mixture-of-experts routing without an auxiliary loss (routers choosing by topk(scores + bias)):
    after each optimizer step, each router's correction bias moves by ``rate`` toward balance:
    up for experts that got fewer tokens than the mean in the step, down for those that got more.

    Loads are global: summed over the ranks holding the same router (under PTDPStrategy a pipeline
    stage's ranks: dp, cp and tp; the world for other distributed strategies), so every rank applies
    the same update. Logs ``moe/aux_free_imbalance`` (the worst router's max load over
    its mean load, in the step); ``history`` keeps each step's value per router, by bias name.
    """

    def __init__(self, rate: float = 1e-3, *, keep: int = 1000) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(
                f"AuxFreeBalancing(rate={rate!r}): the bias update rate must be a number > 0 (DeepSeek-V3 used "
                "1e-3 for most of its training). Pass a positive rate, e.g. AuxFreeBalancing(rate=1e-3)"
            )
        self.rate = float(rate)
        self.routers: list[_Router] = []
        self.history: deque[dict[str, float]] = deque(maxlen=keep)
        self._finder: Optional[_Finder] = None
        self._hooks: list[Any] = []
        self._found = False
        self._step = -1
        self._group: Optional[tuple] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._group = None  # this run's mesh

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._found or self._finder is not None:
            return
        self._step = trainer.global_step
        candidates = [
            _Bias(f"{path}.{attr}" if path else attr, module, attr)
            for path, module in pl_module.named_modules()
            for attr, t in [*module.named_buffers(recurse=False), *module.named_parameters(recurse=False)]
            if t is not None and t.dim() == 1 and t.is_floating_point()
        ]
        self._finder = _Finder(candidates, pl_module)
        self._finder.mode.__enter__()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stop_finder()  # the optimizer's own ops are no routing

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if trainer.global_step == self._step:
            return  # accumulating: the optimizer has not stepped yet
        self._step = trainer.global_step
        if not self._found:
            self._stop_finder()
            self._take_routers(trainer, pl_module)
        self._update(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_finder()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_finder()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _stop_finder(self) -> None:
        finder = self._finder
        if finder is None or self._found:
            return
        if finder.mode in _active_modes():
            finder.mode.__exit__(None, None, None)
        finder.close()

    def _take_routers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        finder = self._finder
        for b, (site, ordinal) in sorted(finder.latest.items(), key=lambda kv: finder.candidates[kv[0]].name):
            counts = finder.counts[(b, id(site), ordinal)]
            self.routers.append(_Router(finder.candidates[b], site, ordinal, counts.to(torch.float64)))
        self._finder, self._found = None, True
        held = torch.tensor([len(self.routers)], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized():  # a pipeline stage may hold no router; a model has one
            dist.all_reduce(held)
        if not int(held):
            raise RuntimeError(
                f"AuxFreeBalancing found no router correction bias in {type(pl_module).__name__}: it looks for a "
                "floating 1-D buffer or parameter of a module added to router scores before a torch.topk over as "
                "many entries as it has (DeepSeek-V3's e_score_correction_bias), and this model's first training "
                "step had none. Its routing has no bias to balance: drop AuxFreeBalancing from the callbacks"
            )
        by_site: dict[int, dict[int, _Router]] = {}
        for router in self.routers:
            by_site.setdefault(id(router.site), {})[router.ordinal] = router
        for router in self.routers:
            wanted = by_site.pop(id(router.site), None)
            if wanted is not None:
                self._hooks += _count_during_forward(router.site, wanted)

    @torch.no_grad()
    def _update(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.routers:
            return
        device = trainer.strategy.root_device
        loads = torch.cat([r.counts.to(device) for r in self.routers])
        if self._group is None:
            self._group = (_stage_group(trainer),)  # built once: flattening a mesh is a collective
        group = self._group[0]
        if group is not False:
            dist.all_reduce(loads, group=group)
        loads = loads.cpu().split([r.counts.numel() for r in self.routers])
        step: dict[str, float] = {}
        for router, load in zip(self.routers, loads):
            router.counts.zero_()
            mean = load.mean()
            if not mean > 0:
                continue  # this router saw no tokens in the step
            bias = local_tensor(router.bias.tensor)
            bias.add_((mean - load).sign().to(device=bias.device, dtype=bias.dtype), alpha=self.rate)
            step[router.bias.name] = float(load.max() / mean)
        self.history.append(step)
        if step:
            pl_module.log("moe/aux_free_imbalance", max(step.values()), rank_zero_only=True, sync_dist=False)


def _active_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


def _count_during_forward(site: nn.Module, routers: dict[int, _Router]) -> list[Any]:
    """Hooks that watch each training forward of ``site`` with a _Counter (not a checkpoint's recomputation)."""
    running: list[Optional[EveryTorchCall]] = []

    def before(module: nn.Module, args: Any) -> None:
        counter = EveryTorchCall([_Counter(routers).seen]) if module.training and not _in_backward() else None
        if counter is not None:
            counter.__enter__()
        running.append(counter)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        counter = running.pop() if running else None
        if counter is not None:
            counter.__exit__(None, None, None)

    return [site.register_forward_pre_hook(before), site.register_forward_hook(after, always_call=True)]


def _stage_group(trainer: pl.Trainer) -> Any:
    """The ranks holding the same routers: all of a pipeline stage's (PTDPStrategy), the world for other
    distributed strategies; False in one process. tp ranks may read the same tokens or (sequence
    parallelism) different ones: summed either way, since the rule and the ratio ignore a common factor."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from lightning_ptdp.strategy import PTDPStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, PTDPStrategy):
        return None if dist.get_world_size() > 1 else False
    mesh = strategy.device_mesh
    names = tuple(n for n in mesh.mesh_dim_names if n != "pp")
    stage = mesh[names] if len(names) > 1 else mesh[names[0]]
    if stage.size() == 1:
        return False
    return (stage._flatten("_".join(names)) if len(names) > 1 else stage).get_group()  # as dims.replica_mesh does
