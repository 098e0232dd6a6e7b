"""The plan certificate: before the first step, each rewritten block (the first of each structure)
runs forward and backward under the layout and whole, on the probe's real inputs, on the same
ranks; an output or input gradient beyond the dtype's tolerance refuses, naming the block and the
axes. A position, mask or norm the rewrites did not see becomes a setup error, not a wrong run."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from lightning_ptdp.context_parallel.tail import SequenceShard
from lightning_ptdp.core.blocks import find_block_lists, residual_input, with_input
from lightning_ptdp.core.census import BlockInputs, copy_object
from lightning_ptdp.parallel.certificate_diff import agreed_first, first_difference
from lightning_ptdp.tensor_parallel.consolidate import split_parameters

log = logging.getLogger(__name__)

CERTIFICATE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
"""Relative (norm) error allowed per dtype. A split reorders each sum: its error grows as
sqrt(terms) * eps, 1e-5 for fp32 at 4096 terms; 1e-4 leaves 10x. A wrong position or mask moves
the output by O(1)."""


class PlanCertificateError(RuntimeError):
    """A rewritten block computes something else than the same block run whole."""


@dataclass
class WholeBlock:
    """A whole copy of one block, taken before the rewrites, and the inputs of its first call."""

    name: str
    blocks: list[nn.Module]  # its list, for the list's entry and exit hooks
    index: int
    copy: nn.Module
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class SummedGradients:
    """Under tensor parallelism alone: its group, and the parameters held whole whose gradients the step
    sums over it (``TPReport.partial_grad_params``): the certificate finishes them the same way."""

    group: Any
    partial: frozenset  # ids of the parameters


@dataclass
class CertificateReport:
    blocks: list[str] = field(default_factory=list)
    errors: dict[str, tuple[float, ...]] = field(default_factory=dict)  # block -> (output, input, parameter grad)
    seconds: float = 0.0
    copied_bytes: int = 0  # the whole copies' parameters and buffers, held until the check ends

    def summary(self) -> str:
        worst = ", ".join(f"{name} " + "/".join(f"{e:.1e}" for e in errors) for name, errors in self.errors.items())
        return (
            f"{len(self.blocks)} block structure(s) equal to whole (output/input/parameter-gradient error: {worst}) "
            f"in {self.seconds:.2f}s"
        )


_REWRITTEN = ("_ptdp_tp", "_ptdp_ep", "_ptdp_cp")


def whole_blocks_to_certify(model: nn.Module, config: Any, dims: Any, inputs: BlockInputs) -> list[WholeBlock]:
    """The whole copies to certify the rewrites of t, e and c against; none when the layout rewrites no
    block, when ``certify_plan=False``, or when an earlier stage already rewrote the model."""
    if not config.certify_plan or max(dims.tp, dims.cp, dims.ep) == 1:
        return []
    if any(key in model.__dict__ for key in _REWRITTEN):
        return []
    wholes = capture_whole_blocks(model, inputs)
    if wholes and not _alike_on_every_rank([w.copy for w in wholes]):
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(
                "plan certificate skipped: the ranks built different initial weights for %s (data parallelism "
                "takes rank 0's later); seed every rank alike (L.seed_everything) to have the layout certified",
                wholes[0].name,
            )
        return []
    return wholes


def _alike_on_every_rank(modules: list[nn.Module]) -> bool:
    """Whether every rank holds the same parameter values (sums and sums of squares, exactly)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    sums = [v for m in modules for p in m.parameters() for v in (p.double().sum(), p.double().square().sum())]
    here = torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64, device=_device(modules[0]))
    highest, lowest = here.clone(), -here
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MAX)
    return bool(torch.equal(highest, -lowest))


def layout_axes(config: Any, dims: Any) -> str:
    """The rewriting axes of the layout, as the certificate's messages name them."""
    axes = [f"t={dims.tp}" + (" with sequence parallelism" if config.sequence_parallel else "")] if dims.tp > 1 else []
    axes += [f"c={dims.cp}"] if dims.cp > 1 else []
    axes += [f"e={dims.ep}"] if dims.ep > 1 else []
    return "the layout " + ", ".join(axes)


def capture_whole_blocks(model: nn.Module, inputs: BlockInputs) -> list[WholeBlock]:
    """A whole copy and the probe's inputs of the first block of each group alike in structure and
    code (core/census.py ``BlockInputs.groups``); nothing for a model on the meta device (no values
    to compare)."""
    if any(p.is_meta for p in model.parameters()):
        log.info("plan certificate skipped: the model is on the meta device (no values to compare)")
        return []
    firsts = [(path, blocks, group[0]) for path, blocks in find_block_lists(model) for group in inputs.groups(blocks)]
    captured = inputs.of([blocks[i] for _, blocks, i in firsts])
    wholes = []
    for path, blocks, i in firsts:
        if id(blocks[i]) not in captured:
            continue
        args, kwargs = captured[id(blocks[i])]
        name = f"{path}.{i}" if path else str(i)
        try:
            whole = copy.deepcopy(blocks[i])
        except Exception as error:  # noqa: BLE001 - e.g. a module holding a process group: alike on every rank
            log.warning("plan certificate skipped for '%s': the block cannot be copied (%s)", name, error)
            continue
        wholes.append(WholeBlock(name, blocks, i, whole, args, kwargs))
    return wholes


def certify(
    wholes: list[WholeBlock],
    axes: str,
    cp_group: Optional[tuple[Any, int]] = None,
    summed: Optional[SummedGradients] = None,
) -> CertificateReport:
    """Compare each rewritten block with its whole copy; every rank of the layout runs this at once
    and all refuse alike (the largest error over the ranks decides). ``cp_group`` (group, c) under
    context parallelism: a rank's input gradient is its own chunks times c, so the sum over cp is c
    times the whole one. ``summed`` (tensor parallelism alone): the gradients of the parameters every
    rank holds whole are compared too, those the step sums over tp summed first."""
    report, start = CertificateReport(), time.perf_counter()
    report.copied_bytes = sum(
        t.numel() * t.element_size() for w in wholes for t in (*w.copy.parameters(), *w.copy.buffers())
    )
    errors, failures, worst_parameter = [], {}, {}
    for whole in wholes:
        block = whole.blocks[whole.index]
        held = _held_whole(block, whole.copy) if summed is not None else []
        with _as_only_block(block, whole.blocks):
            ours = _run(block, whole.args, whole.kwargs, [p for _, p, _ in held])
        theirs = _run(whole.copy, whole.args, whole.kwargs, [c for _, _, c in held])
        ours_ran = not isinstance(ours, BaseException)
        finished = _finished_parameter_grads(held, ours[2] if ours_ran else None, summed)  # a collective: every rank
        if isinstance(theirs, BaseException):
            log.info("plan certificate skipped for '%s': the block fails whole too (%s)", whole.name, theirs)
            errors += [0.0, 0.0, 0.0]
            continue
        if not ours_ran:
            failures[whole.name] = ours
            errors += [float("inf")] * 3
            continue
        out, grad, _ = ours
        if cp_group is not None and grad is not None:
            dist.all_reduce(grad, group=cp_group[0])
            grad = grad / cp_group[1]
        parameter_errors = {
            name: _wrongly_finished(step, other, _or_zeros(t, p))
            for (name, p, _), (step, other), t in zip(held, finished, theirs[2])
        }
        worst = max(parameter_errors, key=parameter_errors.get, default=None)
        worst_parameter[whole.name] = worst
        errors += [_error(out, theirs[0]), _error(grad, theirs[1]), parameter_errors.get(worst, 0.0)]
        report.blocks.append(whole.name)
    errors += [float(whole.name in failures) for whole in wholes]  # raised on some rank: no rank diagnoses
    if dist.is_available() and dist.is_initialized():
        worst = torch.tensor(errors, dtype=torch.float64, device=_device(wholes[0].copy))  # nccl: on the GPU
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        errors = worst.tolist()
    for k, whole in enumerate(wholes):
        report.errors[whole.name] = tuple(errors[3 * k : 3 * k + 3])
        raised = errors[3 * len(wholes) + k] > 0
        _refuse(
            whole, axes, errors[3 * k : 3 * k + 3], failures.get(whole.name), raised, worst_parameter.get(whole.name)
        )
    report.seconds = time.perf_counter() - start
    return report


def _or_zeros(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else torch.zeros_like(like)


def _held_whole(block: nn.Module, copy_of_block: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(name, parameter, the copy's) of each trained parameter the rewritten block holds whole (the copy's
    shape, and no TP layout: a shard of copied key/value heads may have every row, and its gradient is
    summed by the copies' own rule): norms, biases after a reduction, a bank every head reads."""
    theirs = dict(copy_of_block.named_parameters())
    split = {id(p) for _, p, _, _ in split_parameters(block)}  # shards, even where one holds every row
    return [
        (name, p, theirs[name])
        for name, p in block.named_parameters()
        if p.requires_grad and name in theirs and theirs[name].shape == p.shape and not p.is_meta and id(p) not in split
    ]


def _finished_parameter_grads(
    held: list, grads: Optional[list], summed: Optional[SummedGradients]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(as the step finishes it, the other way) of each held parameter's gradient: its sum over tp where
    the step sums it, else this rank's own. One flat all-reduce, which every rank joins (zeros where its
    block raised or a parameter got no gradient)."""
    if summed is None or not held:
        return []
    local = [_or_zeros(g, p) for g, (_, p, _) in zip(grads or [None] * len(held), held)]
    total = torch.cat([g.flatten() for g in local])
    dist.all_reduce(total, group=summed.group)
    totals = [piece.view_as(g) for piece, g in zip(total.split([g.numel() for g in local]), local)]
    return [(t, g) if id(p) in summed.partial else (g, t) for (_, p, _), g, t in zip(held, local, totals)]


def _wrongly_finished(step: torch.Tensor, other: torch.Tensor, theirs: torch.Tensor) -> float:
    """The error of a gradient the step finishes wrongly: left partial where its sum over tp is the whole
    one, or summed where this rank's own already is; 0 for any other difference (the output and input
    gradient checks, and training, judge those: a router's gradient may follow rules this check does not
    model)."""
    tolerance = CERTIFICATE_RTOL.get(theirs.dtype, CERTIFICATE_RTOL[torch.float32])
    error = _error(step, theirs)
    return error if error > tolerance and _error(other, theirs) <= tolerance else 0.0


def _refuse(
    whole: WholeBlock,
    axes: str,
    errors: list[float],
    failure: Optional[BaseException],
    raised: bool,
    worst_parameter: Optional[str] = None,
) -> None:
    fix = (
        "Keep that axis at 1 for this model, or split it by hand (tp_plan / ep_plan); certify_plan=False skips "
        "this check"
    )
    if failure is not None and _own_refusal(failure):
        raise failure  # a refusal an axis wrote (context parallelism meets its first forward here)
    if failure is not None:
        raise PlanCertificateError(
            f"plan certificate: block '{whole.name}' under {axes} raised {type(failure).__name__}: {failure}; the "
            f"same block runs whole. {fix}"
        ) from failure
    dtype = next((p.dtype for p in whole.copy.parameters() if p.is_floating_point()), torch.float32)
    tolerance = CERTIFICATE_RTOL.get(dtype, CERTIFICATE_RTOL[torch.float32])
    what_parameter = f"gradient of {worst_parameter}" if worst_parameter else "parameter gradient"
    for what, error in zip(("output", "input gradient", what_parameter), errors):
        if error > tolerance:
            first_op = "" if raised else _first_op_note(whole, errors[0], tolerance)
            raise PlanCertificateError(
                f"plan certificate: block '{whole.name}' under {axes} differs from the same block run whole: its "
                f"{what} is off by {error:.2e} (relative, > {tolerance:.0e} for {dtype}); something the rewrite "
                f"did not see (a position, a mask, a per-head weight) is computed from this rank's share"
                f"{first_op}. {fix}"
            )


def _first_op_note(whole: WholeBlock, output_error: float, tolerance: float) -> str:
    """Where the rewritten block first departs from its copy (certificate_diff.py); every rank runs it
    together, since the rewritten block's collectives need them all."""
    block = whole.blocks[whole.index]

    def ours() -> Any:  # the block's own output, before the exit hooks (CP's gather) take it
        outputs: list = []
        with _as_only_block(block, whole.blocks):
            hook = block.register_forward_hook(lambda _m, _a, out: outputs.append(out), prepend=True)
            try:
                _run(block, whole.args, whole.kwargs)
            finally:
                hook.remove()
        return outputs[0] if outputs else None

    try:
        found = first_difference(lambda: _run(whole.copy, whole.args, whole.kwargs), ours, tolerance)
    except Exception as error:  # noqa: BLE001 - the refusal stands without the note
        log.info("plan certificate: the first op that differs was not found (%s)", error)
        found = None
    text = agreed_first(found)
    if text is not None:
        return f"; the first op that differs: {text}"
    if output_error <= tolerance:
        return "; the forward agrees (the difference is in the backward)"
    return "; no single op differs beyond the tolerance (the difference builds up)"


def _own_refusal(error: BaseException) -> bool:
    """An error this library raises on purpose: its own class, or a ValueError raised in its code."""
    if type(error).__module__.startswith("lightning_ptdp"):
        return True
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = frame.tb_frame.f_code.co_filename if frame is not None else ""
    return isinstance(error, ValueError) and where.startswith(_OWN_DIR)


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _error(ours: Optional[torch.Tensor], theirs: Optional[torch.Tensor]) -> float:
    if ours is None or theirs is None:
        return 0.0 if ours is None and theirs is None else float("inf")
    if ours.shape != theirs.shape:
        return float("inf")
    scale = theirs.double().norm().clamp_min(torch.finfo(torch.float32).tiny)
    return ((ours.double() - theirs.double()).norm() / scale).item()


def _run(block: nn.Module, args: tuple, kwargs: dict, params: list = ()) -> Any:
    """(first output, gradient of the residual input, gradients of ``params``) of ``block`` in eval mode,
    or the exception."""
    training = block.training
    try:
        block.train(False)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            args, kwargs = tree_map(copy_object, (args, kwargs))  # a fresh key/value cache for each run
            slot = residual_input(args, kwargs)  # positional, or a keyword (block(hidden_states=x))
            hidden = None if slot is None else slot[1].detach().clone().requires_grad_(True)
            if slot is not None:
                args, kwargs = with_input(args, kwargs, slot[0], hidden)
            out = block(*args, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, SequenceShard):
                out = out.whole()
            out = out.as_subclass(torch.Tensor) if type(out) is not torch.Tensor else out
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
            wanted = ([hidden] if hidden is not None else []) + list(params)
            grads = (
                list(torch.autograd.grad((out * cotangent).sum(), wanted, allow_unused=True))
                if wanted and out.requires_grad
                else [None] * len(wanted)
            )
            grad = grads.pop(0) if hidden is not None else None
        return out.detach(), grad, grads
    except Exception as error:  # noqa: BLE001 - reported with the block's name by certify
        return error
    finally:
        block.train(training)


@contextlib.contextmanager
def _as_only_block(block: nn.Module, blocks: list[nn.Module]) -> Iterator[None]:
    """Run ``block`` as if it were its list's only block: the first block's forward pre-hooks (SP's
    scatter, CP's cut of the residual stream) and the last block's forward hooks (the gathers), beside
    its own (the replay's)."""
    first, last = blocks[0], blocks[-1]
    tables = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
    exits = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
    saved = {t: getattr(block, t) for t in (*tables, *exits)}
    try:
        for t in tables:
            setattr(block, t, OrderedDict({**getattr(first, t), **saved[t]}))
        for t in exits:
            setattr(block, t, OrderedDict({**saved[t], **getattr(last, t)}))
        yield
    finally:
        for t, value in saved.items():
            setattr(block, t, value)
