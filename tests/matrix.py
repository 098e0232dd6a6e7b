"""Which (family, layout) cells of a conformance matrix the default suite runs.

Every family runs at every layout of 2 ranks (cheap, and where each family's own idioms meet the
axis). A layout of more ranks (4 or 8 processes on a 2-core machine: the suite's cost) runs a
covering of the families, rotated so each family meets several such layouts and each layout meets
``per_layout`` families (one by default). A list of families run at one layout (each compiled for a
graph-break check) runs a fixed sample of them (``sampled``). ``PTDP_FULL_MATRIX=1`` runs the whole
cross-product and every listed case (the long run, outside the default suite: see docs/user_guide.md,
Tests).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

FULL = os.environ.get("PTDP_FULL_MATRIX", "") not in ("", "0")
T = TypeVar("T")


def covering(
    families: Sequence[str],
    ranks: Mapping[str, int],
    *,
    per_layout: int = 1,
    pinned: Mapping[str, Sequence[str]] | None = None,
    full: bool = FULL,
) -> list[tuple[str, str]]:
    """(family, layout) cells: each family at each layout of 2 ranks; at a larger one ``per_layout``
    families, the next ones in a rotation over ``families`` (``pinned``: a layout's own choice, kept
    in the full matrix too); ``full``: every family at every layout not pinned."""
    cells, turn = [], 0
    for layout, world in ranks.items():
        if pinned and layout in pinned:
            chosen = list(pinned[layout])
        elif full or world <= 2:
            chosen = list(families)
        else:
            chosen = [families[(turn + k) % len(families)] for k in range(min(per_layout, len(families)))]
            turn += per_layout
        cells += [(family, layout) for family in chosen]
    return cells


def sampled(cases: Sequence[T], every: int, *, full: bool = FULL) -> list[T]:
    """Every ``every``-th of ``cases`` from the first (a fixed sample, the same on every run); all of
    them under ``full``."""
    return list(cases) if full else list(cases)[::every]
