"""Start from pretrained weights, shard by shard: each rank reads only the slices it holds.

``PTDPStrategy(pretrained=PATH)``: a ``.safetensors`` file, a folder of them (a transformers
checkpoint) or a ``torch.save``-d state_dict. Parameters built on meta get storage after TP, EP and
the pipeline split; each rank copies exactly its slices (``pieces.pieces``). Keys are the parameter
names less the common prefix the files lack (or ``pretrained_prefix``), found through a transformers
model's own checkpoint conversions (``FileKeys``: Mixtral's per-expert ``experts.{i}.w1`` files).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn as nn

from lightning_ptdp.checkpoint.pieces import pieces, tp_cuts
from lightning_ptdp.parallel.init import allocate

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Pretrained:
    """Where the starting weights are, and the part of the parameter names the files leave out."""

    path: str
    prefix: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.path.exists(self.path):
            raise ValueError(
                f"pretrained={self.path!r} does not exist; give a .safetensors file, a folder of them "
                "(a transformers checkpoint) or a torch.save-d state_dict"
            )
        if self.prefix is not None and not isinstance(self.prefix, str):
            raise ValueError(
                f"pretrained_prefix={self.prefix!r} must be a string such as 'net.' (or None: found from the keys)"
            )


@dataclass(frozen=True)
class PerExpert:
    """A stacked experts tensor ``[n, ...]`` the files hold one tensor per expert: each of
    ``sources`` formats with ``i``, the expert; several are concatenated along ``dim`` of an expert's
    tensor (Mixtral's ``w1`` and ``w3`` make ``gate_up_proj``)."""

    sources: tuple[str, ...]
    dim: int


Stored = Union[str, PerExpert]


class FileKeys:
    """Where a parameter's values are in the files: its own key, or what the model's transformers
    checkpoint conversions (``transformers.conversion_mapping``) say it was saved as, read backwards:
    plain renamings, and per-expert tensors merged into a stacked one (MergeModulelist on dim 0, then
    at most one Concatenate). Transformers loads those files so; ptdp reads them shard by shard."""

    def __init__(self, model: nn.Module, keys: set[str]) -> None:
        self.keys = keys
        self.renames: list[tuple[str, str]] = []  # (name in the model, name in the files)
        self.mergers: list[tuple[str, tuple[str, ...], Optional[int]]] = []  # (target, sources, concat dim)
        for transform in _conversions(model):
            sources, targets = list(transform.source_patterns), list(transform.target_patterns)
            operations = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(transform, "operations", [])]
            if not operations and len(targets) == 1 and all(map(_plain, [*sources, *targets])):
                self.renames += [(targets[0], source) for source in sources]
            elif len(targets) == 1 and operations[:1] == [("MergeModulelist", 0)] and len(operations) <= 2:
                concat = operations[1][1] if len(operations) == 2 and operations[1][0] == "Concatenate" else None
                if len(operations) == 1 or concat:
                    self.mergers.append((targets[0], tuple(s.replace("*", "{i}") for s in sources), concat))

    def _renamed(self, key: str) -> list[str]:
        out = [key]
        for target, source in self.renames:
            out += [k.replace(target, source) for k in out if target in k]
        return out

    def find(self, key: str) -> Optional[Stored]:
        for candidate in self._renamed(key):
            if candidate in self.keys:
                return candidate
        for target, sources, concat in self.mergers:
            for candidate in self._renamed(key):
                if candidate.endswith(target):
                    stored = tuple(candidate[: -len(target)] + source for source in sources)
                    if all(source.format(i=0) in self.keys for source in stored):
                        return PerExpert(stored, (concat or 1) - 1)
        return None


def _plain(pattern: str) -> bool:
    return not any(c in pattern for c in "^$\\*[](){}|?+")


def _conversions(model: nn.Module) -> list[Any]:
    """The checkpoint conversions of the first transformers model inside ``model`` (none without one)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return list(get_model_conversion_mapping(inner)) if inner is not None else []


class WeightSource:
    """Named tensors in safetensors files or a torch state_dict, read a slice at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: dict[str, str] = {}
        self._state: Optional[dict[str, torch.Tensor]] = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        if os.path.isdir(path):
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"pretrained={path!r} is a folder without .safetensors files")
            for name in files:
                for key in self._keys_of(os.path.join(path, name)):
                    self._files[key] = os.path.join(path, name)
        elif path.endswith(".safetensors"):
            self._files = {key: path for key in self._keys_of(path)}
        else:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self._state = state.get("state_dict", state) if isinstance(state, dict) else state

    def _keys_of(self, file: str) -> list[str]:
        with open(file, "rb") as handle:  # the safetensors header: 8-byte length, then JSON
            size = int.from_bytes(handle.read(8), "little")
            header = {k: v for k, v in json.loads(handle.read(size)).items() if k != "__metadata__"}
        self._shapes.update({k: tuple(v["shape"]) for k, v in header.items()})
        return list(header)

    def keys(self) -> set[str]:
        return set(self._state) if self._state is not None else set(self._files)

    def shape(self, key: Stored) -> tuple[int, ...]:
        if isinstance(key, PerExpert):
            keys = self.keys()
            n = next(i for i in range(len(keys) + 1) if key.sources[0].format(i=i) not in keys)
            parts = [self.shape(s.format(i=0)) for s in key.sources]
            width = sum(part[key.dim] for part in parts)
            return (n, *parts[0][: key.dim], width, *parts[0][key.dim + 1 :])
        return tuple(self._state[key].shape) if self._state is not None else self._shapes[key]

    def read(self, key: Stored, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + shape) of tensor ``key``: only those bytes are read (per
        expert: only the files of the experts in the box)."""
        box = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        if isinstance(key, PerExpert):
            experts = range(offsets[0], offsets[0] + shape[0])
            whole = [torch.cat([self._whole(s.format(i=i)) for s in key.sources], key.dim) for i in experts]
            return torch.stack(whole)[(slice(None), *box[1:])]
        if self._state is not None:
            return self._state[key][box]
        from safetensors import safe_open

        with safe_open(self._files[key], framework="pt") as handle:
            return handle.get_slice(key)[box] if box else handle.get_tensor(key)

    def _whole(self, key: str) -> torch.Tensor:
        return self.read(key, (0,) * len(self.shape(key)), self.shape(key))


def _prefix(names: list[str], keys: set[str], given: Optional[str]) -> str:
    if given is not None:
        return given
    candidates = {""} | {name[: i + 1] for name in names for i, c in enumerate(name) if c == "."}
    return max(candidates, key=lambda p: (sum(n.startswith(p) and n[len(p) :] in keys for n in names), -len(p)))


@torch.no_grad()
def load_pretrained(
    model: nn.Module,
    path: str,
    *,
    prefix: Optional[str] = None,
    aliases: Optional[dict[str, list[str]]] = None,
    device: torch.device = torch.device("cpu"),
) -> int:
    """Copy this rank's pieces of every parameter from ``path``; returns the elements read. A
    parameter on the meta device gets storage first. Missing keys or shapes that differ raise."""
    source = WeightSource(path)
    keys = source.keys()
    allocate(model, device)
    names = {}  # id(param) -> every name it has (tied weights may be saved under one of them)
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).extend([name, *(aliases or {}).get(name, [])])
    located = FileKeys(model, keys)
    strip = _prefix([n for ns in names.values() for n in ns], keys, prefix)
    cuts, count, missing = tp_cuts(model), 0, []
    for name, param in model.named_parameters():
        candidates = (located.find(n[len(strip) :]) for n in names[id(param)] if n.startswith(strip))
        key = next((k for k in candidates if k is not None), None)
        if key is None:
            missing.append(name)
            continue
        entry = pieces(param, cuts.get(name))
        if source.shape(key) != tuple(entry.full_shape):
            raise ValueError(
                f"pretrained={path!r}: '{key}' has shape {source.shape(key)}, but parameter '{name}' is "
                f"{tuple(entry.full_shape)} in the model; build the model with the checkpoint's config"
            )
        for piece in entry.items:
            piece.local.copy_(source.read(key, piece.offsets, tuple(piece.local.shape)).to(piece.local.device))
            count += piece.local.numel()
    if missing:
        raise ValueError(
            f"pretrained={path!r} has no weights for {len(missing)} parameter(s), e.g. {missing[:3]} (looked up "
            f"without the prefix {strip!r}); pass pretrained_prefix='...' to name the part of the parameter names "
            f"the files leave out; the files hold keys such as {sorted(keys)[:3]}"
        )
    log.info("pretrained: %d elements read from %s (prefix %r stripped)", count, path, strip)
    return count


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters created inside go to the meta device (their initial values are never needed);
    buffers stay real. Each parameter exists on the CPU for the moment of its creation only."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
