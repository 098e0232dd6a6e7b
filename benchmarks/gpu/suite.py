"""Runs the parts in order, each under its own time budget, and writes the JSON, the Markdown and
the suite's section of benchmarks/RESULTS.md. A part that raises or overruns is recorded with its
error and the rows it finished; the next part starts regardless."""

from __future__ import annotations

import json
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before the parts: see IMPORTED_BY_THE_IMAGES_PACKAGES)
import torch
import torchmetrics  # noqa: F401

# What the image's own packages import where they find them installed (torchmetrics imports
# transformers when it is there): only what the suite adds beyond these counts against it.
IMPORTED_BY_THE_IMAGES_PACKAGES = set(sys.modules)

from benchmarks.gpu import attention, bias_gelu, correctness, training, tuning  # noqa: E402 (after the snapshot)
from benchmarks.gpu.context import Context, short_error  # noqa: E402
from benchmarks.results import cpu_description, today, write_section  # noqa: E402

PARTS = {
    "correctness": correctness,
    "attention": attention,
    "bias_gelu": bias_gelu,
    "tuning": tuning,
    "training": training,
}


class PartTimeout(BaseException):
    """Raised in the main thread when a part's budget ends (BaseException: no `except Exception` in
    a library swallows it)."""


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or seconds == float("inf"):
        yield
        return

    def stop(signum, frame):
        raise PartTimeout

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# The project's extras and test dependencies that the GPU image (torch, triton, lightning,
# torchmetrics) lacks, with what they pull in.
NOT_ON_GPU_IMAGE = {
    "hydra",
    "omegaconf",
    "wandb",
    "jsonargparse",
    "transformers",
    "tokenizers",
    "huggingface_hub",
    "safetensors",
    "litgpt",
    "torchtitan",
    "pytest",
    "ruff",
}


def run_part(ctx: Context, name: str, budget_s: float) -> dict:
    rows: list[dict] = []
    record: dict = {"status": "ok", "budget_s": budget_s, "rows": rows}
    start = time.monotonic()
    ctx.deadline = start + budget_s
    try:
        with _alarm(budget_s):
            record.update(PARTS[name].run(ctx, rows) or {})
    except PartTimeout:
        record.update(status="timeout", error=f"stopped at its {budget_s:.0f} s budget after {len(rows)} row(s)")
    except Exception as err:  # noqa: BLE001 - the suite goes on to the next part
        record.update(status="error", error=short_error(err), traceback=traceback.format_exc()[-3000:])
    # the alarm can land in a callback from C++ or a library, which turns it into an ordinary error that a
    # part's per-row `except Exception` records: a part still running at its deadline timed out
    if record["status"] != "timeout" and time.monotonic() > ctx.deadline:
        record.update(status="timeout", error=f"ran past its {budget_s:.0f} s budget ({len(rows)} row(s))")
    record["seconds"] = time.monotonic() - start
    ctx.free()
    return record


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device) -> dict:
    import lightning
    import triton

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (triton interpreter)",
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpu": cpu_description(),
    }


def run_suite(
    *,
    smoke: bool,
    parts: list[str],
    out_dir: Path,
    results_md: Path | None,
    budget_scale: float,
    command: str,
    variants: tuple[str, ...] | None = None,
) -> dict:
    from lightning_ptdp.core.flops import device_hbm_bandwidth, device_peak_flops

    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    env = environment(device)
    try:
        peak = device_peak_flops(env["device"], "bf16") if device.type == "cuda" else None
    except ValueError:
        peak = None
    ctx = Context(
        device=device,
        smoke=smoke,
        hbm_bytes_per_s=device_hbm_bandwidth(env["device"]),
        peak_flops=peak,
        variants=variants,
    )
    record = {
        "suite": "benchmarks.gpu",
        "date": today(),
        "command": command,
        "smoke": smoke,
        **env,
        "hbm_bytes_per_s": ctx.hbm_bytes_per_s,
        "peak_bf16_flops": peak,
        "parts": {},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    # a run of some parts or variants gets its own section and files: it never replaces the whole suite's
    partial = "" if parts == list(PARTS) and variants is None else "-".join(["", *parts, *(variants or ())])
    partial = re.sub(r"[^A-Za-z0-9_.-]+", "_", partial)  # file names of letters, digits, '.', '_', '-' only
    stem = f"gpu_suite{partial}-{'smoke-' if smoke else ''}{re.sub(r'[^A-Za-z0-9]+', '_', env['device']).strip('_')}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    if partial:
        record["partial_title"] = f", {', '.join(parts)} part" + (f": {', '.join(variants)}" if variants else "")
    started = time.monotonic()
    for name in parts:
        print(f"[benchmarks.gpu] {name} ...", file=sys.stderr, flush=True)
        record["parts"][name] = run_part(ctx, name, PARTS[name].BUDGET_S * budget_scale)
        part = record["parts"][name]
        print(f"[benchmarks.gpu] {name}: {part['status']} in {part['seconds']:.1f} s", file=sys.stderr, flush=True)
        record["total_s"] = time.monotonic() - started
        json_path.write_text(json.dumps(record, indent=1, default=str))  # after each part: a killed run keeps them
    # the GPU image has none of these: the suite must not need them (tests/integration/test_gpu_suite.py)
    added = set(sys.modules) - IMPORTED_BY_THE_IMAGES_PACKAGES
    record["absent_on_gpu_image_but_imported"] = sorted({m.split(".")[0] for m in added} & NOT_ON_GPU_IMAGE)
    record["files"] = {"json": str(json_path), "markdown": str(md_path)}
    json_path.write_text(json.dumps(record, indent=1, default=str))
    text = markdown(record)
    md_path.write_text(text)
    if results_md is not None:
        section = "gpu-suite" + ("-partial" if partial else "")
        write_section(section + ("-smoke" if smoke else ""), text, path=results_md)
    return record


def markdown(record: dict) -> str:
    env = "| device | driver | CUDA | cuDNN | torch | triton | lightning |\n|---|---|---|---|---|---|---|\n" + (
        f"| {record['device']} | {record['driver']} | {record['cuda']} | {record['cudnn']} | {record['torch']} | "
        f"{record['triton']} | {record['lightning']} |"
    )
    status = ", ".join(f"{name} {part['status']} ({part['seconds']:.0f} s)" for name, part in record["parts"].items())
    lines = [
        f"## {record['date']} — GPU suite{record.get('partial_title', '')} on {record['device']} (issue 17)",
        "",
        f"Written by `{record['command']}` in {record.get('total_s', 0):.0f} s; JSON: `{record['files']['json']}`.",
        "",
        env,
        "",
        f"Parts: {status}.",
        "",
    ]
    for name, part in record["parts"].items():
        lines.append(f"### {name}")
        if part.get("error"):
            lines.append(f"{part['status']}: {part['error']}")
        try:
            lines.append(PARTS[name].markdown(part))
        except Exception as err:  # noqa: BLE001 - a table that cannot be drawn must not lose the JSON
            lines.append(f"(table failed: {short_error(err)})")
        lines.append("")
    return "\n".join(lines)
