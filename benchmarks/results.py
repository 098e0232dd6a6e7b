"""benchmarks/RESULTS.md sections written by the scripts themselves, never by hand.

Each script owns one section, fenced by HTML comments (invisible in the rendered Markdown):
``<!-- section:NAME -->`` ... ``<!-- /section:NAME -->``. Writing replaces the section in place,
or appends it when the file has none yet, so a rerun updates the figures instead of adding more.
Every section records the commit its figures came from (``code_version``, read when the run starts).
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
import subprocess
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


# what a run writes itself: a change there is no change to the code that produced the figures
_OUTPUTS = ("benchmarks/RESULTS.md", "benchmarks/results/")


def code_version(root: Path = RESULTS.parent.parent) -> str:
    """The commit the figures come from: 'commit abc1234', with the count of files changed since
    (outputs aside) when the tree is dirty, or 'unknown' outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short=10", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [f for f in changed if not f.startswith(_OUTPUTS)]
    return f"commit {commit}" + (f" plus uncommitted changes to {len(changed)} files" if changed else "")


def write_section(name: str, markdown: str, *, commit: str | None = None, path: Path = RESULTS) -> Path:
    """Put ``markdown`` (starting with its ``## `` heading) in section ``name`` of ``path``, with a
    ``- Code:`` line under the heading: ``commit`` (``code_version()`` as the run started), or the
    checkout's now when None."""
    start, end = f"<!-- section:{name} -->", f"<!-- /section:{name} -->"
    heading, _, rest = markdown.strip().partition("\n")
    rest = rest.lstrip("\n")
    code = f"- Code: {commit or code_version()}." + (
        "\n" if rest.startswith("- ") else "\n\n"
    )  # one list, or two blocks
    block = f"{start}\n{heading}\n\n{code}{rest}\n{end}"
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
