"""No document types a figure by hand (tests/figures.py says what a figure is and where one may
stand): measured and estimated figures are in benchmarks/RESULTS.md, written by the scripts."""

from __future__ import annotations

import pytest

from tests.figures import DOCUMENTS, ROOT, hand_typed_figures


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_document_types_a_figure_by_hand(document):
    assert hand_typed_figures(document.read_text()) == [], (
        f"a figure in {document.relative_to(ROOT)}'s prose: point to its benchmarks/RESULTS.md section (written "
        "by a script), render it between generated markers, or write a constant's value as inline code"
    )


def test_the_rule_covers_the_readme_and_the_docs():
    assert [str(path.relative_to(ROOT)) for path in DOCUMENTS] == [
        "README.md",
        "docs/user_guide.md",
        "docs/architecture.md",
    ]


def test_the_figure_rule_catches_measured_numbers_and_spares_code_versions_and_generated_blocks():
    measured = (
        "Activation memory per rank falls to 0.562\nof c=1 at c=2 and 0.314 at c=4. Tokens per second: "
        "15301 at c=1, 11,920 at c=2; 40% less, 3x faster, 11051 tokens/s; Megatron-Core reports 468 TFLOP/s, "
        "in 2026-11-24."
    )
    assert [f.split(": ")[1] for f in hand_typed_figures(measured)] == [
        "0.562",
        "0.314",
        "15301",
        "11,920",
        "40%",
        "3x",
        "11051",
        "468 TFLOP/s",
        "2026",
    ]
    assert hand_typed_figures("line\n\nand 0.5 here")[0] == "line 3: 0.5"
    allowed = (
        "Python 3.11 and torch 2.11 or newer, torch (>= 2.11), torch (2.11+), after Narayanan et al.\n2021: "
        "`pip install torch==2.13.0`; Korthikanti et al. 2022, Section 4.2.2; ``GEMM_EFFICIENCY`` and "
        "`LOSS_RTOL` (`1e-5`).\n"
        "```python\nlr = 3e-4  # 1000 steps\n```\n"
        "<!-- works-with:begin -->\nlosses 1e-5 relative, 8192 tokens\n<!-- works-with:end -->\n"
        "t x p x d on 8 GPUs, 10 min, sm80+, H100, 2c chunks, 1/c of it."
    )
    assert hand_typed_figures(allowed) == []
    assert hand_typed_figures("Section 4.2.2 alone, and torch at 1.5x") == ["line 1: 4.2", "line 1: 1.5"]
