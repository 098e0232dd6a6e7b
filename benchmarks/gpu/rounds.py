"""The training part's statistics: variants timed in alternated rounds (the order rotated each round),
medians and spreads over rounds, ratios paired by round, the kernels measured faster end to end
(what kernels="auto" may route), and the check that every run started from the same weights and batches.
"""

from __future__ import annotations

from statistics import median

from benchmarks.results import stats

ROUNDS = 3
"""Alternated rounds of every variant: the median of 3 survives one disturbed round."""
FIRST_LOSS_RTOL = 3e-5
"""bf16-mixed: the kernels change only rounding order, which moved the first loss by 6.8e-6 of it on the H100
(7.6e-5 at 11.23) and by 3.7e-6 in the smoke run; other rows moved it by 8.3e-4 (H100) and 1.2e-3 (smoke),
other weights (seed 1) by 5.9e-5 in the smoke run. One scalar can still coincide for another seed: the
weight and batch fingerprints cannot."""
WEIGHTS_RTOL = 1e-9
"""The weights' fingerprint is a float64 sum of squares: the same values summed in another order agree to
~1e-15; a model drawn from another seed differs by ~sqrt(2/parameters) (4e-5 at 1.3B)."""
BASELINE = "ptdp-torch"
"""A kernel is judged against ptdp with torch's kernels: the same strategy without it."""


def rotated(items: list, round_index: int) -> list:
    """``items`` starting at ``round_index`` (mod its length): each variant runs first in some round."""
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def summarise(row: dict) -> None:
    """Median, minimum, maximum and spread ((max - min) / median) over ``row["runs"]``."""
    runs = row["runs"]
    tokens = stats([run["tokens_per_s"] for run in runs])  # the one median-and-spread of every benchmark
    row.update(
        rounds=tokens["n"],
        tokens_per_s=tokens["median"],
        tokens_per_s_min=tokens["min"],
        tokens_per_s_max=tokens["max"],
        spread=(tokens["max"] - tokens["min"]) / tokens["median"],
        step_s=median(run["step_s"] for run in runs),
        first_loss=runs[0]["first_loss"],
        final_loss=runs[-1]["final_loss"],
        peak_memory_gb=max((r["peak_memory_gb"] for r in runs if r["peak_memory_gb"] is not None), default=None),
    )


def paired_ratios(row: dict, base: dict) -> list[float]:
    """Tokens/s of ``row`` over ``base`` in each round both ran (the rounds alternate: pairs share the conditions)."""
    base_by_round = {run["round"]: run["tokens_per_s"] for run in base["runs"]}
    return [run["tokens_per_s"] / base_by_round[run["round"]] for run in row["runs"] if run["round"] in base_by_round]


def add_ratio(row: dict, base: dict, label: str) -> None:
    """``ratio_vs_<label>``: the median paired ratio, with its minimum and maximum."""
    ratios = paired_ratios(row, base)
    if ratios:
        ratio = stats(ratios)
        row[f"ratio_vs_{label}"] = ratio["median"]
        row[f"ratio_vs_{label}_range"] = [ratio["min"], ratio["max"]]


def measured_faster(by_name: dict[str, dict], candidates: dict[str, str]) -> list[str]:
    """The kernels (``candidates``: kernel -> the variant that routes it alone) that beat ``BASELINE`` in
    every one of at least ``ROUNDS`` paired rounds."""
    base = by_name.get(BASELINE)
    faster = []
    for kernel, variant in candidates.items():
        ratios = paired_ratios(by_name[variant], base) if base and variant in by_name else []
        if len(ratios) >= ROUNDS and min(ratios) > 1.0:
            faster.append(kernel)
    return sorted(faster)


def same_start(runs: list[dict]) -> dict:
    """Did every run begin from the same weights and read the same batches? The first losses must agree
    within ``FIRST_LOSS_RTOL``, the batch fingerprints be equal, the weight fingerprints within
    ``WEIGHTS_RTOL``; a shuffled sampler or another seed fails all three."""
    firsts = [run["first_loss"] for run in runs if run.get("first_loss") is not None]
    weights = [run["weights"] for run in runs if run.get("weights") is not None]
    batches = [tuple(run["batches"]) for run in runs if run.get("batches") is not None]
    loss_gap = max(firsts) - min(firsts) if firsts else None
    return {
        "first_losses_agree": bool(firsts) and loss_gap <= FIRST_LOSS_RTOL * abs(min(firsts)),
        "first_loss_gap": loss_gap,
        "first_loss_rtol": FIRST_LOSS_RTOL,
        "batches_agree": bool(batches) and len(set(batches)) == 1,
        "weights_agree": bool(weights) and max(weights) - min(weights) <= WEIGHTS_RTOL * max(weights),
        "runs_checked": len(runs),
    }
