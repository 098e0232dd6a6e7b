"""The first op where a rewritten block departs from its whole copy, for the plan certificate's refusal.
Both forwards run under ``_OpFlow`` (a watcher of the census's ``EveryTorchCall``): each torch call on a line of the user's code is keyed by (file,
line, op, its count there), and the rewritten run's ops, compared with the whole run's of the same key,
agree, differ or cannot be compared; ptdp's own calls are not compared (a row Linear's partial sum is
right once reduced). Walking back from the block's output through ops that differ or were not compared,
the earliest in whole-run order is the first op that differs: a rank's partial statistic that stays
partial on purpose (token counts per expert under CP) never reaches the output this way."""

from __future__ import annotations

import linecache
import os
import sys
from collections import Counter
from types import FrameType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ptdp.core.census import EveryTorchCall

_TORCH, _OWN = os.sep + "torch" + os.sep, os.sep + "lightning_ptdp" + os.sep
_SKETCH, _CANDIDATES = 8, 4  # random projections that pick each slice's nearest whole slices; exact checks per slice
Key = tuple[str, int, str, int]  # file, line, op, count of that op on that line


def where(key: Key) -> str:
    """``op at file:line (the line's source)``."""
    file, line, name, _ = key
    return f"{name} at {file}:{line} ({linecache.getline(file, line).strip()})"


def _user_line(frame: Optional[FrameType]) -> Optional[tuple[str, int]]:
    """The user's line making a torch call: the first frame outside torch; None for a call ptdp makes
    itself (its layers, collectives, hooks), though ptdp's TorchFunctionModes pass calls through."""
    while frame is not None:
        file = frame.f_code.co_filename
        if _OWN in file:
            if frame.f_code.co_name != "__torch_function__":
                return None
            frame = frame.f_back
            continue
        if _TORCH not in file:
            return file, frame.f_lineno
        frame = frame.f_back
    return None


class _OpFlow:
    """A watcher of ``EveryTorchCall`` (core/census.py): hands ``on_op(key, output tensors)`` each torch
    call on a line of the user's code, and keeps for every call (ptdp's too) the calls that made its
    input tensors: the path a difference takes."""

    def __init__(self, on_op: Callable[[Key, list[torch.Tensor]], None]) -> None:
        self.on_op, self.counts = on_op, Counter()
        self.made_by = WeakIdKeyDictionary()  # tensor -> the call that made it
        self.inputs: list[set[int]] = []
        self.keys: list[Optional[Key]] = []

    def seen(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        call = len(self.keys)
        self.inputs.append({self.made_by[t] for t in tree_leaves((args, kwargs)) if _tensor(t) and t in self.made_by})
        tensors = [t for t in tree_leaves(out) if _tensor(t)]
        for t in tensors:
            self.made_by[t] = call
        line, key = _user_line(sys._getframe(2)), None  # the caller of EveryTorchCall's __torch_function__
        if line is not None and tensors and all(t.layout == torch.strided and not t.is_meta for t in tensors):
            site = (*line, getattr(func, "__name__", str(func)))
            key = (*site, self.counts[site])
            self.counts[site] += 1
            with torch._C.DisableTorchFunctionSubclass():  # a plain copy of a SequenceShard, as it is now
                self.on_op(key, [t.detach().clone() for t in tensors])
        self.keys.append(key)

    def upstream(self, tensor: Any, passes: Callable[[int], bool]) -> Optional[set[int]]:
        """The calls ``tensor`` was made from through calls that ``passes``; None when it is not known."""
        if not _tensor(tensor) or tensor not in self.made_by:
            return None
        seen, todo = set(), [self.made_by[tensor]]
        while todo:
            call = todo.pop()
            if call not in seen:
                seen.add(call)
                todo += self.inputs[call] if passes(call) else []
        return seen


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def first_difference(
    run_whole: Callable[[], Any], run_ours: Callable[[], Any], tolerance: float
) -> Optional[tuple[int, Key]]:
    """(index in the whole run, key) of this rank's first op that differs, as the module docstring
    says; ``run_ours`` returns the block's own output (or a tuple starting with it). None when no op does.
    A line calling an op a different number of times in the two runs (EP's loop over this rank's
    experts) has no order to pair the calls by: not compared."""
    whole: dict[Key, tuple[int, list[torch.Tensor]]] = {}
    theirs = _OpFlow(lambda key, outs: whole.setdefault(key, (len(whole), outs)))
    with EveryTorchCall([theirs.seen]):
        run_whole()
    verdicts: dict[Key, Optional[bool]] = {}

    def compare(key: Key, outs: list[torch.Tensor]) -> None:
        _, expected = whole.get(key, (None, None))
        if expected is not None and len(expected) == len(outs):
            each = [agrees(a, b, tolerance) for a, b in zip(outs, expected)]
            verdicts[key] = False if False in each else (None if None in each else True)

    ours = _OpFlow(compare)
    with EveryTorchCall([ours.seen]):
        result = run_ours()
    differs = {k for k, v in verdicts.items() if v is False and ours.counts[k[:3]] == theirs.counts[k[:3]]}
    output = result[0] if isinstance(result, (tuple, list)) and result else result
    passes = lambda call: verdicts.get(ours.keys[call]) is not True  # noqa: E731
    reached = {ours.keys[call] for call in ours.upstream(output, passes) or ()}
    if differs & reached or (_tensor(output) and output in ours.made_by and not passes(ours.made_by[output])):
        differs &= reached  # else the path is cut (an in-place collective) or unknown: every op that differs
    return min(((whole[k][0], k) for k in differs), default=None)


def agrees(ours: torch.Tensor, whole: torch.Tensor, tolerance: float) -> Optional[bool]:
    """Whether ``ours`` equals ``whole`` (relative norm error within ``tolerance``) or is a share of it:
    along the one dim where their sizes differ (TP's heads or features, CP's sequence chunks), each of
    its slices equals some slice of ``whole``. None when they differ in rank or in more dims."""
    dims = [d for d in range(whole.dim()) if ours.shape[d] != whole.shape[d]] if ours.dim() == whole.dim() else []
    if ours.dim() != whole.dim() or len(dims) > 1:
        return None
    a, b = _as_real(ours), _as_real(whole)
    if not dims:
        return bool(_relative(a.reshape(1, -1), b.reshape(1, -1)).item() <= tolerance)
    a, b = a.movedim(dims[0], 0).reshape(a.shape[dims[0]], -1), b.movedim(dims[0], 0).reshape(b.shape[dims[0]], -1)
    if a.shape[0] == 0 or a.shape[1] == 0:
        return True
    if b.shape[0] == 0:
        return False
    probe = torch.randn(a.shape[1], _SKETCH, generator=torch.Generator().manual_seed(0), dtype=a.dtype).to(a.device)
    finite = lambda t: t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # noqa: E731
    nearest = torch.cdist(finite(a) @ probe, finite(b) @ probe)
    nearest = nearest.topk(min(_CANDIDATES, b.shape[0]), dim=1, largest=False).indices
    found = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    for column in nearest.unbind(1):
        found |= _relative(a, b[column]) <= tolerance
    return bool(found.all())


def _as_real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).double() if t.is_complex() else t.double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's ||a - b|| / ||b|| (equal infinities and NaNs count as equal; other non-finite: inf)."""
    same = (a == b) | (a.isnan() & b.isnan())
    difference = torch.where(same, 0.0, a - b).norm(dim=1)
    scale = torch.where(b.isfinite(), b, 0.0).norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return (difference / scale).nan_to_num(nan=float("inf"))


def agreed_first(found: Optional[tuple[int, Key]]) -> Optional[str]:
    """The earliest of the ranks' first differing ops (every rank calls this), as ``where`` says it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Optional[tuple[int, Key]]] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        found = min((f for f in everyone if f is not None), default=None)
    return None if found is None else where(found[1])
