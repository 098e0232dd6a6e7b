"""README.md's "Works with" table, rendered from the conformance matrix's definition.

Every cell is a test, `tests/distributed/test_real_models.py::test_conformance[family-layout]`, that
CI runs on every change; a failing cell fails CI, so the table shows what passes. Nothing under
tests/ writes the README: ``python .ci/works_with.py`` rewrites the table after the matrix changes,
and `tests/unit/test_works_with.py` checks that the README holds what this renders.
"""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- works-with:begin -->", "<!-- works-with:end -->"
STAMP = (
    "Each cell is `tests/distributed/test_real_models.py::test_conformance[family-layout]`, which CI runs: "
    "3 steps with the Trainer equal to one process (fp32, losses and gradients 1e-5 relative), each rank "
    "holding only its share. Regenerate with `python .ci/works_with.py` after the matrix changes."
)
MOE_STAMP = (
    "Mixture-of-experts families, `tests/distributed/test_expert_parallel.py`, the same check: e ranks of the d "
    "data-parallel ones split the experts (dN-eM), each holding n_experts / e of them; under t the experts stay "
    "whole on each tp rank (Megatron's expert tensor parallel size 1)."
)


CP_STAMP = (
    "Context parallelism, `tests/distributed/test_context_parallel.py`, the same check: each sequence split over "
    "c ranks (cN), every block holding 1/c of it (1/(c*t) under SP) and, without TP, the head too."
)


def render() -> str:
    """The block between the markers, markers included: the dense matrix, the MoE one, the CP one."""
    from tests.distributed.test_expert_parallel import CASES
    from tests.distributed.test_expert_parallel import LAYOUTS as MOE_LAYOUTS
    from tests.distributed.test_real_models import LAYOUTS, MATRIX_FAMILIES
    from tests.real_models import FAMILY_NAMES, MOE_FAMILIES

    rows = [
        "| model | " + " | ".join(LAYOUTS) + " |",
        "|---|" + "---|" * len(LAYOUTS),
        *(f"| {FAMILY_NAMES[family]} | " + " | ".join("ok" for _ in LAYOUTS) + " |" for family in MATRIX_FAMILIES),
    ]
    moe = [
        "| mixture of experts | " + " | ".join(MOE_LAYOUTS) + " |",
        "|---|" + "---|" * len(MOE_LAYOUTS),
        *(
            f"| {FAMILY_NAMES[family]} | "
            + " | ".join("ok" if (family, layout) in CASES else "-" for layout in MOE_LAYOUTS)
            + " |"
            for family in sorted(MOE_FAMILIES)
        ),
    ]
    return "\n".join([BEGIN, STAMP, "", *rows, "", MOE_STAMP, "", *moe, "", CP_STAMP, "", *_context_rows(), END])


def _context_rows() -> list[str]:
    from tests.distributed.test_context_parallel import ALL, CASES, EXTRA_FAMILIES, EXTRAS, LAYOUTS
    from tests.real_models import FAMILY_NAMES

    columns = [*LAYOUTS, *EXTRAS]

    def cell(family: str, layout: str) -> str:
        done = (family, layout) in CASES or (layout in EXTRAS and family in EXTRA_FAMILIES)
        return "ok" if done else "-"

    from tests.distributed.test_context_parallel import MOE_FAMILIES, MOE_LAYOUTS

    return [
        "| context parallelism | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
        *(f"| {FAMILY_NAMES[f]} | " + " | ".join(cell(f, layout) for layout in columns) + " |" for f in ALL),
        "",
        "| context and expert parallelism | " + " | ".join(MOE_LAYOUTS) + " |",
        "|---|" + "---|" * len(MOE_LAYOUTS),
        *(f"| {FAMILY_NAMES[f]} | " + " | ".join("ok" for _ in MOE_LAYOUTS) + " |" for f in MOE_FAMILIES),
    ]


def readme_block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]
