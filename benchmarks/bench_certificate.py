"""What the plan certificate costs at setup: the recipes GPT on 2 CPU ranks, certify_plan on and off.

    python -m benchmarks.bench_certificate [--rounds 5] [--write-results]

Each round fits one step per contender (certify on, then off, the order alternating round by
round) at t=2 and at c=2, timing the whole fit; the certificate also reports its own seconds and
the bytes of the whole block copies it holds while it runs. Prints JSON with every round, medians
and spreads; ``--write-results`` writes its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import json
import sys
import time

from benchmarks.results import code_version, cpu_description, pool_of, spread, stats, today, write_section

MODEL = {"vocab_size": 256, "seq_length": 128, "num_layers": 4, "num_heads": 4, "hidden_size": 256}
LAYOUTS = {"t2": {"tensor_parallel_size": 2}, "c2": {"context_parallel_size": 2}}
BATCH = 4


def fit_once(layout: str, certify: bool) -> dict:
    """On every rank: one training step; its wall seconds, and the certificate's report."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.testing import quiet_trainer
    from recipes.gpt import GPTConfig, GPTLightningModule

    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_length"] + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    strategy = PTDPStrategy(**LAYOUTS[layout], certify_plan=certify, kernels="torch")
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=1)
    start = time.perf_counter()
    trainer.fit(GPTLightningModule(GPTConfig(**MODEL)), data)
    seconds = time.perf_counter() - start
    report = strategy._parallelized.certificate
    return {
        "fit_seconds": seconds,
        "certificate_seconds": report.seconds if report else 0.0,
        "copied_bytes": report.copied_bytes if report else 0,
        "model_bytes": sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters()),
    }


def run(rounds: int) -> dict:
    record: dict = {"layouts": {}}
    with pool_of(2) as pool:
        for layout in LAYOUTS:
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for r in range(rounds):
                for certify in (True, False) if r % 2 == 0 else (False, True):
                    runs[certify].append(max(pool.run(fit_once, layout, certify), key=lambda x: x["fit_seconds"]))
            on, off = runs[True], runs[False]
            record["layouts"][layout] = {
                "fit_seconds_certified": stats([x["fit_seconds"] for x in on]),
                "fit_seconds_uncertified": stats([x["fit_seconds"] for x in off]),
                "fit_seconds_added": stats([a["fit_seconds"] - b["fit_seconds"] for a, b in zip(on, off)]),
                "certificate_seconds": stats([x["certificate_seconds"] for x in on]),
                "copied_bytes": on[0]["copied_bytes"],
                "local_model_bytes": on[0]["model_bytes"],
            }
    return record


def render(record: dict, command: str) -> str:
    lines = [
        "## Plan certificate: its cost at setup",
        "",
        f"- {today()}, {cpu_description()}, 2 gloo ranks, OMP_NUM_THREADS=1.",
        f"- `{command}`: recipes GPT {MODEL}, batch {BATCH}; each round fits one step with certify_plan on and "
        "off (order alternating); times are the slower rank's, seconds.",
        "",
        "| layout | fit, certified | fit, not certified | added per round | the certificate itself "
        "| copies held (bytes) | this rank's parameters (bytes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, r in record["layouts"].items():
        lines.append(
            f"| {layout} | {spread(r['fit_seconds_certified'])} | {spread(r['fit_seconds_uncertified'])} | "
            f"{spread(r['fit_seconds_added'])} | {spread(r['certificate_seconds'])} | {r['copied_bytes']} | "
            f"{r['local_model_bytes']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    commit = code_version()
    record = run(args.rounds)
    print(json.dumps(record, indent=1))
    if args.write_results:
        command = "python -m benchmarks.bench_certificate " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section("certificate", render(record, command.strip()), commit=commit)
    return record


if __name__ == "__main__":
    main()
