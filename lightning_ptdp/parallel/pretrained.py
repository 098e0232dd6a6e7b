"""Start from pretrained weights, shard by shard: each rank reads only the slices it holds.

``PTDPStrategy(pretrained=PATH)``: a ``.safetensors`` file, a folder of them (a transformers
checkpoint, with or without its index), or a ``torch.save``-d state_dict (read memory-mapped).
``configure_model`` builds parameters on meta (buffers stay real, so rotary tables keep their
values); after TP and the pipeline split each rank allocates its pieces and copies exactly those
slices (``pieces.pieces``, the checkpoints' geometry). Keys are the parameter names less the
longest common prefix the files lack (``net.model.`` for ``self.net``), or ``pretrained_prefix``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

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

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state[key].shape) if self._state is not None else self._shapes[key]

    def read(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + shape) of tensor ``key``: only those bytes are read."""
        box = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        if self._state is not None:
            return self._state[key][box]
        from safetensors import safe_open

        with safe_open(self._files[key], framework="pt") as handle:
            return handle.get_slice(key)[box] if box else handle.get_tensor(key)


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
    strip = _prefix([n for ns in names.values() for n in ns], keys, prefix)
    cuts, count, missing = tp_cuts(model), 0, []
    for name, param in model.named_parameters():
        key = next((n[len(strip) :] for n in names[id(param)] if n.startswith(strip) and n[len(strip) :] in keys), None)
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
