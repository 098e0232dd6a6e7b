"""What every ``ptdp doctor`` check returns: a status (OK / WARN / FAIL), a name and a message."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    """The outcome of one check: ``status`` is OK, WARN or FAIL; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""
