"""The LM head and cross-entropy, fused (ptdp's default) against unfused: the allocator's peak during
one forward and backward of head + loss, and its time, in one process.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_fused_loss [--rounds 3] [--write-results]

transformers' loss code on an nn.Linear head (no bias): ``F.cross_entropy(head(h).float().view(-1, V),
targets)``, fp32, every target counted. The head runs through ptdp's own fused path
(``parallel/fused_loss.py``) or as it is. Measured in a fresh worker process with the allocator
figure of bench_memory (glibc's in-use bytes, sampled every millisecond and around the step), minus
that figure just before the step: what the step adds on top of the weights and the head's input.
Rounds alternate the order of the two. The logits' bytes (tokens x V x 4) are printed beside them as
the size of the tensor fusion avoids. Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from benchmarks.bench_memory import Sampler, malloc_in_use
from benchmarks.results import cpu_description, paired_ratio, pool_of, spread, stats, today, write_section

TITLE = "LM head + cross-entropy fused against unfused: peak memory and time of one step (issue 39)"
SIZES = {"vocab": 32768, "hidden": 512, "tokens": 1024}  # the issue's: a 32k vocabulary at s=1024


def _step(fused: bool, vocab: int, hidden: int, tokens: int) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from lightning_ptdp.parallel.fused_loss import apply_fused_loss

    torch.manual_seed(0)
    model = nn.ModuleDict({"head": nn.Linear(hidden, vocab, bias=False)})
    if fused:
        apply_fused_loss(model, "head")
    inputs = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    gc.collect()
    base, sampler = malloc_in_use(), Sampler()
    sampler.start()
    start = time.perf_counter()
    loss = F.cross_entropy(model["head"](inputs).float().view(-1, vocab), targets)
    sampler.sample()
    loss.backward()
    seconds = time.perf_counter() - start
    sampler.stop()
    return {"peak_bytes": sampler.peak - base, "seconds": seconds, "loss": loss.item()}


def _rounds(rounds: int, vocab: int, hidden: int, tokens: int) -> dict:
    _step(True, vocab, hidden, tokens)  # warm both paths once (allocator arenas, kernels)
    _step(False, vocab, hidden, tokens)
    runs: dict[str, list] = {"fused": [], "unfused": []}
    for r in range(rounds):
        for fused in (True, False) if r % 2 == 0 else (False, True):
            runs["fused" if fused else "unfused"].append(_step(fused, vocab, hidden, tokens))
    return runs


def run(
    *,
    rounds: int = 3,
    vocab: int = SIZES["vocab"],
    hidden: int = SIZES["hidden"],
    tokens: int = SIZES["tokens"],
    pool=None,
) -> dict:
    with pool_of(1, pool) as workers:
        runs = workers.run(_rounds, rounds, vocab, hidden, tokens)[0]
    peak = {name: [r["peak_bytes"] for r in rows] for name, rows in runs.items()}
    seconds = {name: [r["seconds"] for r in rows] for name, rows in runs.items()}
    return {
        "sizes": {"rounds": rounds, "vocab": vocab, "hidden": hidden, "tokens": tokens, "dtype": "float32"},
        "logits_bytes": tokens * vocab * 4,
        "weight_grad_bytes": vocab * hidden * 4,
        "peak_bytes": {name: stats(values) for name, values in peak.items()},
        "seconds": {name: stats(values) for name, values in seconds.items()},
        "peak_ratio": paired_ratio(peak["fused"], peak["unfused"]),
        "time_ratio": paired_ratio(seconds["fused"], seconds["unfused"]),
        "losses": {name: rows[0]["loss"] for name, rows in runs.items()},
    }


def markdown(result: dict) -> str:
    s, mib = result["sizes"], 2**20

    def mb(values: dict) -> str:
        return spread({k: (v / mib if k != "n" and k != "values" else v) for k, v in values.items()}, "{:.1f}")

    peak, seconds = result["peak_bytes"], result["seconds"]
    return f"""- Sizes: one process, {s["tokens"]} tokens, h={s["hidden"]}, V={s["vocab"]}, {s["dtype"]}; the logits
  would take {result["logits_bytes"] / mib:.1f} MiB, the head's weight gradient {result["weight_grad_bytes"] / mib:.1f} MiB;
  {s["rounds"]} rounds, the two orders alternated.
- Peak added by the step (MiB, median (min-max)): fused {mb(peak["fused"])}, unfused {mb(peak["unfused"])};
  fused over unfused, round by round: {spread(result["peak_ratio"])}.
- Time of forward and backward (s): fused {spread(seconds["fused"])}, unfused {spread(seconds["unfused"])};
  ratio {spread(result["time_ratio"])}.
- Losses: fused {result["losses"]["fused"]:.6f}, unfused {result["losses"]["unfused"]:.6f}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write-results", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = run(rounds=args.rounds)
    print(json.dumps(result, indent=1))
    if args.write_results:
        command = "OMP_NUM_THREADS=1 python -m benchmarks.bench_fused_loss " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        write_section(
            "fused_loss",
            f"## {today()} — {TITLE}\n\n- Hardware: {cpu_description()}, CPU only.\n- Command: `{command.strip()}` "
            f"({time.perf_counter() - started:.0f} s).\n{markdown(result)}- Written by `benchmarks/bench_fused_loss.py`.\n",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
