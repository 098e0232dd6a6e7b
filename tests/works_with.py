"""The "Works with" tables, rendered from the conformance matrices' definitions.

Every cell is a test that CI runs on every change; a failing cell fails CI, so a table shows what
passes. ``BLOCKS`` says which table goes where: the dense and MoE matrices into README.md, the
context-parallel ones into docs/user_guide.md, each between its pair of markers. Nothing under
tests/ writes a document: ``python .ci/works_with.py`` rewrites every block after a matrix
changes, and `tests/unit/test_works_with.py` checks that each document holds what this renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USER_GUIDE = ROOT / "docs" / "user_guide.md"
STAMP = (
    "Each cell is `tests/distributed/test_real_models.py::test_conformance[family-layout]`, which CI runs: "
    "3 steps with the Trainer equal to one process (fp32, losses and gradients 1e-5 relative), each rank "
    "holding only its share. Regenerate with `python .ci/works_with.py` after the matrix changes."
)
MOE_STAMP = (
    "Mixture-of-experts families, `tests/distributed/test_expert_parallel.py`, the same check: e ranks of the d "
    "data-parallel ones split the experts (dN-eM), each holding n_experts / e of them; under t the experts stay "
    "whole on each tp rank (Megatron's expert tensor parallel size 1). The bf16 row trains torchtitan's own "
    "GroupedExperts forward (its grouped GEMMs in bf16) bf16-mixed, within a measured multiple of the "
    "single-process bf16 run's noise floor (`tests/distributed/test_bf16.py`'s check)."
)
CP_STAMP = (
    "Context parallelism, `tests/distributed/test_context_parallel.py`, the same check as the README's table "
    "(3 steps equal to one process, fp32, 1e-5): each sequence split over c ranks (cN), every block holding 1/c "
    "of it (1/(c*t) under SP) and, without TP, the head too. Regenerate with `python .ci/works_with.py`."
)


def table(corner: str, columns: Iterable[str], rows: Iterable[tuple[str, Iterable[bool]]]) -> list[str]:
    """A markdown table: ``ok`` where a cell is tested, ``-`` where it is not."""
    columns = list(columns)
    return [
        f"| {corner} | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
        *(f"| {name} | " + " | ".join("ok" if done else "-" for done in cells) + " |" for name, cells in rows),
    ]


def render_dense_and_moe() -> str:
    """README's block: the dense matrix, then the MoE one."""
    from tests.distributed.test_expert_parallel import FULL_CASES as CASES
    from tests.distributed.test_expert_parallel import LAYOUTS as MOE_LAYOUTS
    from tests.distributed.test_real_models import LAYOUTS, MATRIX_FAMILIES
    from tests.real_models import FAMILY_NAMES, MOE_FAMILIES

    dense = table("model", LAYOUTS, ((FAMILY_NAMES[f], (True for _ in LAYOUTS)) for f in MATRIX_FAMILIES))
    bf16 = titan_bf16_layouts()
    moe = table(
        "mixture of experts",
        MOE_LAYOUTS,
        [
            *((FAMILY_NAMES[f], ((f, layout) in CASES for layout in MOE_LAYOUTS)) for f in sorted(MOE_FAMILIES)),
            (FAMILY_NAMES[TITAN_BF16], (layout in bf16 for layout in MOE_LAYOUTS)),
        ],
    )
    return "\n".join([STAMP, "", *dense, "", MOE_STAMP, "", *moe])


TITAN_BF16 = "titan_qwen3_moe_bf16"


def titan_bf16_layouts() -> set[str]:
    """The layouts torchtitan's own bf16 GroupedExperts forward is checked at: test_expert_parallel's
    cells and test_bf16.py's (its layout named with a ``-titan`` suffix)."""
    from tests.distributed.test_bf16 import FAMILY
    from tests.distributed.test_expert_parallel import TITAN_BF16_LAYOUTS

    return {*TITAN_BF16_LAYOUTS, *(layout.removesuffix("-titan") for layout, f in FAMILY.items() if f == TITAN_BF16)}


def render_context() -> str:
    """The user guide's block: the context-parallel matrix, then context with expert parallelism."""
    from tests.distributed import test_context_parallel as cp
    from tests.real_models import FAMILY_NAMES

    columns = [*cp.LAYOUTS, *cp.EXTRAS]

    def done(family: str, layout: str) -> bool:
        return (family, layout) in cp.FULL_CASES or (layout in cp.EXTRAS and family in cp.EXTRA_FAMILIES)

    dense = table("context parallelism", columns, ((FAMILY_NAMES[f], (done(f, c) for c in columns)) for f in cp.ALL))
    moe = table(
        "context and expert parallelism",
        cp.MOE_LAYOUTS,
        ((FAMILY_NAMES[f], (True for _ in cp.MOE_LAYOUTS)) for f in cp.MOE_FAMILIES),
    )
    return "\n".join([CP_STAMP, "", *dense, "", *moe])


RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def render_sweep() -> str:
    """The README's block: the per-layout counts of the last recorded sweep over every transformers
    causal LM (benchmarks/RESULTS.md, section ``sweep_transformers``, written by the sweep itself)."""
    text = RESULTS.read_text()
    start = text.index("<!-- section:sweep_transformers -->")
    section = text[start : text.index("<!-- /section:sweep_transformers -->")]
    lines = section.splitlines()
    recorded = next(line for line in lines if line.startswith("- 20"))  # "- <date>, transformers ..., torch ..."
    updates = [line.split(":")[0].removeprefix("- Updated ") for line in lines if line.startswith("- Updated ")]
    first = next(i for i, line in enumerate(lines) if line.startswith("| layout |"))
    counts = lines[first : next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))]
    stamp = (
        "Counts of the last run of `python -m benchmarks.sweep_transformers` (every architecture in transformers' "
        f"causal-LM mapping at a tiny config, each cell against one process; recorded {recorded[2:].split(',')[0]}"
        + (f", some cells rerun {updates[-1]}" if updates else "")
        + "). "
        "Per-architecture reasons: [benchmarks/RESULTS.md](benchmarks/RESULTS.md#sweep-every-transformers-causal-lm-"
        "at-each-layout-against-one-process). Regenerate with `python .ci/works_with.py` after a sweep."
    )
    return "\n".join([stamp, "", *counts])


@dataclass(frozen=True)
class Block:
    """A generated block: the document it lives in, its marker name, what renders its body."""

    path: Path
    name: str
    render: Callable[[], str]

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def rendered(self) -> str:
        """The block as it should stand in the document, markers included."""
        return "\n".join([self.begin, self.render(), self.end])

    def held(self, text: str) -> str:
        """The block as ``text`` holds it, markers included."""
        start, end = text.find(self.begin), text.find(self.end)
        if start < 0 or end < start:
            raise ValueError(f"{self.path.name} lacks the markers {self.begin} ... {self.end}")
        return text[start : end + len(self.end)]

    def rewrite(self, text: str) -> str:
        return text.replace(self.held(text), self.rendered())


BLOCKS = (
    Block(README, "works-with", render_dense_and_moe),
    Block(README, "sweep", render_sweep),
    Block(USER_GUIDE, "works-with-context", render_context),
)
