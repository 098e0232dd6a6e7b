"""How an experts module was called: where each argument sits (a position or a keyword) and a
short description of a call for refusals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


class ExpertDiscoveryError(ValueError):
    """The model's experts cannot be split as found (the message names the module and the fix)."""


@dataclass(frozen=True)
class ArgSlot:
    """Where an argument of the experts' forward sits: a position, or a keyword name."""

    position: Optional[int] = None
    name: Optional[str] = None

    def get(self, args: tuple, kwargs: dict) -> Any:
        return args[self.position] if self.name is None else kwargs[self.name]

    def put(self, args: list, kwargs: dict, value: Any) -> None:
        if self.name is None:
            args[self.position] = value
        else:
            kwargs[self.name] = value


def slots(args: tuple, kwargs: dict) -> list[tuple[ArgSlot, Any]]:
    return [(ArgSlot(position=i), a) for i, a in enumerate(args)] + [(ArgSlot(name=k), v) for k, v in kwargs.items()]


def describe(args: tuple, kwargs: dict) -> str:
    def one(value: Any) -> str:
        return (
            f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            if torch.is_tensor(value)
            else type(value).__name__
        )

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])
