"""Aux-loss-free balancing on a skewed tiny DeepSeek-V3: expert-load imbalance per step, with and without.

One process trains transformers' DeepSeek-V3 at the tests' tiny config (every layer MoE, 4 experts, top-2)
for 50 steps twice from the same start, once with ``AuxFreeBalancing``. Each router's gate is skewed
toward experts 0 and 1 first (their weight rows moved along the mean router input). Imbalance is measured
apart from the callback, from each router's chosen experts: the worst router's max load over mean load.
Writes benchmarks/figures/aux_free_balance.png and the ``aux_free`` section of RESULTS.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.results import RESULTS, code_version, cpu_description, today, write_section
from lightning_ptdp.callbacks.png import Canvas

FIGURE = RESULTS.parent / "figures" / "aux_free_balance.png"
SKEW = 4.0  # logit added to the hot experts for a token at the mean router input
GLOBAL_BATCH = 8
LR = 1e-3  # AdamW; slow enough that the hidden states keep the skewed direction for the run
COLORS = {"without": (200, 60, 50), "with": (40, 110, 200)}


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


class RouterLoads(L.Callback):
    """The worst router's max/mean tokens per expert in each step, from its returned top-k indices."""

    def __init__(self) -> None:
        self.imbalance: list[float] = []
        self._loads: dict[int, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for router in _routers(pl_module):
            router.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, args: Any, output: tuple) -> None:
        load = output[2].flatten().bincount(minlength=router.e_score_correction_bias.numel()).double()
        self._loads[id(router)] = self._loads.get(id(router), 0) + load

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.imbalance.append(max(float(load.max() / load.mean()) for load in self._loads.values()))
        self._loads.clear()


@torch.no_grad()
def skew(model: L.LightningModule, sample: torch.Tensor) -> None:
    """Move each router's weight rows of experts 0 and 1 along its mean input (most tokens pick them), and
    freeze the routers: the skew stays unless the correction biases move."""
    inputs: dict[int, torch.Tensor] = {}

    def keep(router: torch.nn.Module, args: tuple) -> None:
        inputs[id(router)] = args[0].reshape(-1, args[0].shape[-1]).mean(0)

    hooks = [r.register_forward_pre_hook(keep) for r in _routers(model)]
    model.logits(sample)
    for hook in hooks:
        hook.remove()
    for router in _routers(model):
        mean = inputs[id(router)]
        router.weight[:2] += SKEW * mean / mean.square().sum()
        router.weight.requires_grad_(False)  # frozen: AdamW at the tests' lr unlearns a skew in a few steps


def fit(balanced: bool, steps: int, rate: float) -> dict:
    from lightning_ptdp.callbacks import AuxFreeBalancing
    from lightning_ptdp.testing import quiet_trainer
    from tests.fit_utils import SEQ, zoo_data
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("tiny:deepseek_v3")
    model.lr = LR
    data = zoo_data(GLOBAL_BATCH, (steps + 1) * GLOBAL_BATCH * (SEQ + 1), 4 * (SEQ + 1))
    data.setup("fit")
    skew(model, _first_inputs(data))
    loads = RouterLoads()
    callbacks = [loads] + ([AuxFreeBalancing(rate)] if balanced else [])
    start = time.perf_counter()
    quiet_trainer(devices=1, max_steps=steps, callbacks=callbacks).fit(model, data)
    return {"imbalance": loads.imbalance, "seconds": time.perf_counter() - start, "routers": len(_routers(model))}


def _first_inputs(data: Any) -> torch.Tensor:
    batch = next(iter(data.train_dataloader()))
    return batch["input_ids"] if isinstance(batch, dict) else batch[0]


def draw(runs: dict[str, dict], path: Path = FIGURE) -> Path:
    """Imbalance per step, one line of dots per run, on a 1.0 (balanced) to top-of-data axis."""
    width, height, left, top, plot_w, plot_h = 640, 360, 56, 40, 560, 260
    canvas = Canvas(width, height)
    series = {name: run["imbalance"] for name, run in runs.items()}
    steps = max(len(v) for v in series.values())
    high = max(max(v) for v in series.values())
    canvas.rect(left, top, left + 1, top + plot_h, (0, 0, 0))
    canvas.rect(left, top + plot_h, left + plot_w, top + plot_h + 1, (0, 0, 0))

    def y_of(value: float) -> int:
        return top + plot_h - round((value - 1.0) / max(high - 1.0, 1e-9) * plot_h)

    for value in (1.0, (1.0 + high) / 2, high):
        canvas.rect(left - 4, y_of(value), left, y_of(value) + 1, (0, 0, 0))
        canvas.text(4, y_of(value) - 4, f"{value:.2f}")
    for step in range(0, steps + 1, 10):
        x = left + round(step / steps * plot_w)
        canvas.rect(x, top + plot_h, x + 1, top + plot_h + 4, (0, 0, 0))
        canvas.text(x - 4, top + plot_h + 8, str(step))
    for name, values in series.items():
        points = [(left + round((i + 1) / steps * plot_w), y_of(v)) for i, v in enumerate(values)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):  # a polyline of small squares
            n = max(abs(x1 - x0), abs(y1 - y0)) // 2 + 1
            for t in range(n):
                x, y = x0 + (x1 - x0) * t // n, y0 + (y1 - y0) * t // n
                canvas.rect(x - 1, y - 1, x + 2, y + 2, COLORS[name])
    title = "MAX / MEAN EXPERT LOAD PER STEP, TINY DEEPSEEK-V3"
    canvas.text(left, 12, title)
    for row, name in enumerate(series):
        canvas.rect(left + plot_w - 150, top + 8 + 16 * row, left + plot_w - 138, top + 18 + 16 * row, COLORS[name])
        canvas.text(left + plot_w - 132, top + 8 + 16 * row, f"{name} AuxFree")
    canvas.text(left + plot_w // 2 - 16, height - 22, "STEP")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canvas.png(title.lower()))
    return path


def render(record: dict, command: str) -> str:
    import lightning
    import transformers

    runs, steps = record["runs"], record["steps"]

    def window(values: list[float], lo: int, hi: int) -> str:
        part = values[lo:hi]
        return f"{sum(part) / len(part):.3f}"

    cut = [(0, 1), (1, 10), (10, 25), (steps - 10, steps)]
    header = " | ".join(f"steps {lo + 1}-{hi}" if hi - lo > 1 else f"step {hi}" for lo, hi in cut)
    lines = [
        "## Aux-loss-free balancing (DeepSeek-V3's correction bias, found from the model)",
        "",
        f"- {today()}, {cpu_description()}, one process; torch {torch.__version__}, lightning {lightning.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}, OMP_NUM_THREADS=1.",
        f"- Command: `{command}`.",
        f"- Model: transformers DeepSeek-V3 at the tests' tiny config ({record['routers']} MoE layers, "
        f"{record['experts']} routed experts, top-{record['top_k']}), global batch {GLOBAL_BATCH}, {steps} steps, "
        f"the same seed and data in both runs; each router's gate rows of experts 0 and 1 moved by {SKEW} logits "
        f"along its mean input first, then frozen (only a correction bias can undo the skew), the rest trained by "
        f"AdamW at lr {LR}; `AuxFreeBalancing(rate={record['rate']})`.",
        "- Imbalance: the worst router's max tokens per expert over its mean, in the step, from the routers' own "
        "top-k indices (a hook apart from the callback); 1.0 is balanced, "
        f"{record['experts'] / record['top_k']:.1f} is every token on the same experts. Mean over the steps shown.",
        "",
        f"| run | {header} | s per run |",
        "|---|" + "---|" * (len(cut) + 1),
    ]
    for name, run in runs.items():
        cells = " | ".join(window(run["imbalance"], lo, hi) for lo, hi in cut)
        lines.append(f"| {name} AuxFreeBalancing | {cells} | {run['seconds']:.1f} |")
    lines += [
        "",
        f"![imbalance per step](figures/{FIGURE.name})",
        "",
        "- Written by `benchmarks/aux_free_balance.py`; never edited by hand.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1e-2)
    parser.add_argument("--no-write", action="store_true", help="print the JSON only: no figure, no RESULTS.md")
    args = parser.parse_args(argv)
    commit = code_version()
    runs = {"without": fit(False, args.steps, args.rate), "with": fit(True, args.steps, args.rate)}
    from tests.models import build_model

    config = build_model("tiny:deepseek_v3").net.model.config
    record = {
        "steps": args.steps,
        "rate": args.rate,
        "routers": runs["with"]["routers"],
        "experts": config.n_routed_experts,
        "top_k": config.num_experts_per_tok,
        "runs": runs,
    }
    print(json.dumps(record))
    if not args.no_write:
        draw(runs)
        command = "python -m benchmarks.aux_free_balance " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section("aux_free", render(record, command.strip()), commit=commit)
    return record


if __name__ == "__main__":
    main()
