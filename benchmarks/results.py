"""benchmarks/RESULTS.md sections written by the scripts themselves, never by hand.

Each script owns one section, fenced by HTML comments (invisible in the rendered Markdown):
``<!-- section:NAME -->`` ... ``<!-- /section:NAME -->``. Writing replaces the section in place,
or appends it when the file has none yet, so a rerun updates the figures instead of adding more.
``stats`` and ``paired_ratio`` are the one way every benchmark reports repeated rounds: median and
spread (min..max), never one run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(name: str, markdown: str, *, path: Path = RESULTS) -> Path:
    """Put ``markdown`` (starting with its ``## `` heading) in section ``name`` of ``path``."""
    start, end = f"<!-- section:{name} -->", f"<!-- /section:{name} -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    first = pattern.search(text)
    if first:  # the first copy is replaced; any later copy is stale and goes, with the blank lines before it
        stale = re.compile(r"\n*" + pattern.pattern, re.DOTALL)
        text = text[: first.start()] + block + stale.sub("", text[first.end() :])
    else:
        text = f"{text.rstrip()}\n\n{block}\n"
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


def stats(values: Sequence[float]) -> dict:
    """Median and spread of repeated rounds: {"values", "median", "min", "max", "n"}."""
    values = list(values)
    return {
        "values": values,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> dict:
    """Ratios of the contenders round by round (both ran in the same round, alternated), as ``stats``,
    plus the ratio of the two medians."""
    result = stats([a / b for a, b in zip(numerator, denominator)])
    result["of_medians"] = statistics.median(numerator) / statistics.median(denominator)
    return result


def spread(s: dict, fmt: str = "{:.3f}") -> str:
    """'median (min-max, n rounds)' of a ``stats`` dict, for the Markdown."""
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])}, n={s['n']})"


@contextlib.contextmanager
def pool_of(world_size: int, pool=None):
    """``pool`` when it has ``world_size`` ranks (run_all shares one pool between benchmarks), else a new one."""
    from lightning_ptdp.testing import DistributedPool

    if pool is not None and pool.world_size == world_size and pool.alive:
        yield pool
    else:
        with DistributedPool(world_size) as own:
            yield own
