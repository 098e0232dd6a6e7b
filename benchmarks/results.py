"""benchmarks/RESULTS.md sections written by the scripts themselves, never by hand.

Each script owns one section, fenced by HTML comments (invisible in the rendered Markdown):
``<!-- section:NAME -->`` ... ``<!-- /section:NAME -->``. Writing replaces the section in place,
or appends it when the file has none yet, so a rerun updates the figures instead of adding more.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(name: str, markdown: str, *, path: Path = RESULTS) -> Path:
    """Put ``markdown`` (starting with its ``## `` heading) in section ``name`` of ``path``."""
    start, end = f"<!-- section:{name} -->", f"<!-- /section:{name} -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text, count=1) if pattern.search(text) else f"{text.rstrip()}\n\n{block}\n"
    path.write_text(text)
    return path


def today() -> str:
    return datetime.date.today().isoformat()


def cpu_description() -> str:
    """'<model name>, N cores visible' from /proc/cpuinfo where there is one."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores visible"
