"""Render the conformance matrix's outcomes into README.md's "Works with" table.

Called at the end of a pytest session (tests/conftest.py); it writes only when the session ran
every cell of the matrix, so a partial run (``-k``) never leaves a half table.
"""

from __future__ import annotations

import datetime
import os
import platform

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BEGIN, END = "<!-- works-with:begin -->", "<!-- works-with:end -->"
MARK = {"passed": "ok", "failed": "FAILS", "skipped": "skipped"}


def write_table(outcomes: dict[tuple[str, str], str]) -> bool:
    from tests.distributed.test_real_models import LAYOUTS, MATRIX_FAMILIES
    from tests.real_models import FAMILY_NAMES

    if any((family, layout) not in outcomes for family in MATRIX_FAMILIES for layout in LAYOUTS):
        return False
    with open(README) as handle:
        text = handle.read()
    if BEGIN not in text or END not in text:
        return False
    import torch

    rows = [
        "| model | " + " | ".join(LAYOUTS) + " |",
        "|---|" + "---|" * len(LAYOUTS),
        *(
            f"| {FAMILY_NAMES[family]} | " + " | ".join(MARK[outcomes[(family, layout)]] for layout in LAYOUTS) + " |"
            for family in MATRIX_FAMILIES
        ),
    ]
    stamp = (
        f"Written by the test run of {datetime.date.today().isoformat()} (torch {torch.__version__}, "
        f"{platform.python_implementation()} {platform.python_version()}) from "
        "`tests/distributed/test_real_models.py::test_conformance`: each cell trains 3 steps with the Trainer "
        "and matches one process (fp32, losses and gradients 1e-5 relative), each rank holding only its share."
    )
    block = "\n".join([BEGIN, stamp, "", *rows, END])
    start, end = text.index(BEGIN), text.index(END) + len(END)
    with open(README, "w") as handle:
        handle.write(text[:start] + block + text[end:])
    return True
