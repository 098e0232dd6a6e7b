"""Where a torch call comes from in the user's code: the calling instruction (``CallSite``), so a
call recorded once can be found again when the same code runs (tensor_parallel/replay.py), and
blocks of one class that run different code can be told apart (core/census.py ``BlockInputs``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package


@dataclass(frozen=True)
class CallSite:
    """A torch call in user code: the calling instruction, the function, and its occurrence count."""

    code: CodeType
    lasti: int
    func: Any
    occurrence: int

    def where(self) -> str:
        """The user's source line of the call."""
        line = next((ln for start, end, ln in self.code.co_lines() if start <= self.lasti < end and ln), None)
        return f"{self.code.co_filename}:{line or self.code.co_firstlineno} in {self.code.co_name}"


def caller_frame() -> Any:
    """The innermost frame outside torch and this package: the user's code making the call."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith((_TORCH_DIR, _OWN_DIR))):
        frame = frame.f_back
    return frame


class SiteCounter:
    """Numbers repeated calls of one call site within one block forward (loops, helpers called twice)."""

    def __init__(self) -> None:
        self.seen: dict[tuple, int] = {}

    def site(self, func: Any) -> CallSite | None:
        frame = caller_frame()
        if frame is None:
            return None
        key = (frame.f_code, frame.f_lasti, func)
        count = self.seen.get(key, 0)
        self.seen[key] = count + 1
        return CallSite(frame.f_code, frame.f_lasti, func, count)
