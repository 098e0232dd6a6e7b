"""Every transformers causal LM at a tiny config, at each layout, against one process (coverage table).

    OMP_NUM_THREADS=1 python -m benchmarks.sweep_transformers [--families 'llama,qwen*'] [--layouts d2,t2]
        [--sample N] [--quick] [--timeout S] [--out sweep.json] [--results benchmarks/RESULTS.md]
        [--update [whole_sweep.json]]

Configs: tests/tiny_configs.py. A cell trains one architecture at one layout on 2 gloo ranks (one pool for the
sweep) and is checked as the conformance matrix checks (tests/distributed/test_real_models.py), then classified
(OUTCOMES); a cell that raises, hangs or breaks the pool is recorded, never stops the sweep. The record
behind the table is kept beside it (results/sweep_transformers.json), so ``--update`` reruns cells of it.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import logging
import random
import re
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import lightning as L

from benchmarks.results import RESULTS, code_version, cpu_description, today, write_section
from tests.distributed.test_context_parallel import LAYOUTS as CP_LAYOUTS
from tests.distributed.test_expert_parallel import LAYOUTS as EP_LAYOUTS
from tests.distributed.test_real_models import GRAD_REL, LOSS_RTOL, STEPS, UPDATE_REL
from tests.distributed.test_real_models import LAYOUTS as MATRIX_LAYOUTS
from tests.fit_utils import FP64_RECHECK, ROUNDOFF_FACTOR
from tests.models import TINY

SECTION = "sweep_transformers"
# (strategy arguments, devices), each the conformance matrices' own; d2-e2 only where a model has experts
LAYOUTS = {
    **{name: MATRIX_LAYOUTS[name] for name in ("d2", "t2", "t2-sp", "p2")},
    "c2": CP_LAYOUTS["c2"],
    "d2-e2": EP_LAYOUTS["d2-e2"],
}
EXPERT_LAYOUTS = ("d2-e2",)
# worst first: the order of the counts' columns
OUTCOMES = {
    "mismatch": "trained, but losses, gradients or weights differ from one process",
    "unsharded": "equal to one process, but a rank holds more than the layout's share, with no warning",
    "exception": "raised an error ptdp did not write (at setup or in a step), or a rank died",
    "hung": "no result within the cell's timeout: killed",
    "warned": "equal to one process, a rank holds more than its share, and ptdp warned",
    "refused": "ptdp refused at setup with its own error (first line recorded)",
    "build_failure": "the tiny config, its model or the one-process run failed: nothing to compare",
    "excluded": "not a decoder-only text model, or not deterministic in training",
    "ok": "equal to one process at fp32 (or, where fp32 differs beyond the tolerances, in fp64 at a million times "
    "tighter tolerances: round-off, its reason says so), each rank holding the layout's share",
}
SAMPLE_SEED = 0
DEFAULT_TIMEOUT_S = 300.0
HEALTH_TIMEOUT = timedelta(seconds=30)  # ranks that all came back meet here; one stuck in a collective does not
REASON_CHARS = 240
CAUSAL_ATOL = 1e-5  # a masked position moves a logit by round-off at most; a bidirectional model by ~1e-1
FP64_VARIANTS = (  # fit_and_record's arguments for a run in fp64
    {"trainer_kwargs": {"precision": "64-true"}},
    {"trainer_kwargs": {"precision": "64-true"}, "model_overrides": {"experts_implementation": "eager"}},
)
_HEALTH: dict[str, Any] = {}


class _Started(L.Callback):
    """Marks the end of setup: the first optimizer step is done (ptdp reads some of the model, the
    attention sites context parallelism splits, in the first forward)."""

    started = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.started = True


@contextlib.contextmanager
def ptdp_warnings():
    """The warnings ptdp logged or raised (first lines) while the block ran."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage().splitlines()[0])

    handler, logger = Collect(level=logging.WARNING), logging.getLogger("lightning_ptdp")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        seen += [str(w.message).splitlines()[0] for w in caught if "lightning_ptdp" in w.filename]
    finally:
        logger.removeHandler(handler)


def quiet() -> None:
    """Only errors from transformers and Lightning: a sweep's log is its cells."""
    import transformers

    transformers.logging.set_verbosity_error()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_cell(model_type: str, strategy_kwargs: dict, devices: int, steps: int, variant: dict | None = None) -> dict:
    """On every rank: ``fit_and_record`` of the tiny model (``variant``: the fp64 recheck's arguments to
    it), or where it failed. Ranks that all return meet
    at a barrier on a group of their own; a rank that cannot (a peer stuck in a collective) raises, and
    the pool is replaced."""
    import torch.distributed as dist

    from tests.fit_utils import fit_and_record

    if "group" not in _HEALTH:  # every rank's first cell, before anything can fail
        _HEALTH["group"] = dist.new_group(backend="gloo", timeout=HEALTH_TIMEOUT)
        quiet()
    started = _Started()
    with ptdp_warnings() as warned:
        try:
            result = fit_and_record(
                TINY + model_type,
                strategy_kwargs=strategy_kwargs,
                devices=devices,
                steps=steps,
                callbacks=[started],
                **(variant or {}),
            )
        except Exception as error:  # noqa: BLE001 - the cell's outcome
            result = {"error": describe_failure(error, started.started)}
    result["warnings"] = sorted(set(warned))
    try:
        dist.barrier(group=_HEALTH["group"])
    except Exception as error:  # noqa: BLE001 - a peer did not come back: this pool is done
        own = failure_reason(result["error"]) if "error" in result else "returned"
        raise RuntimeError(f"a peer never returned from the cell; this rank {own}") from error
    return result


def describe_failure(error: BaseException, started: bool) -> dict:
    """Where and how a cell failed: the phase, whether ptdp itself raised it, the first line, and the
    innermost frames of ptdp and of the model (the op or idiom that failed)."""
    frames = traceback.extract_tb(error.__traceback__)
    message = (str(error).strip().splitlines() or [""])[0]

    def last(part: str) -> str:
        frame = next((f for f in reversed(frames) if part in f.filename), None)
        return "" if frame is None else f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"

    # a refusal is a ``raise`` written in ptdp, not an op's error surfacing in a ptdp line that called it
    raised_by_ptdp = bool(frames) and "lightning_ptdp" in frames[-1].filename
    raised_by_ptdp = raised_by_ptdp and (frames[-1].line or "").lstrip().startswith("raise")
    return {
        "phase": "step" if started else "setup or first step",
        "refusal": raised_by_ptdp and not started,
        "first_line": f"{type(error).__name__}: {message}",
        "at": f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else "",
        "ptdp": last("lightning_ptdp"),
        "model": last("transformers/models"),
    }


def failure_reason(failure: dict) -> str:
    where = "; ".join(f"{k} {failure[k]}" for k in ("at", "ptdp", "model") if failure.get(k))
    phase = f"{failure['phase']}: " if failure["phase"] else ""
    return f"{phase}{failure['first_line']}" + (f" [{where}]" if where else "")


def classify(
    results: list[dict], ref: dict, layout: str, moe: bool, recheck: Callable[[], list[dict]] | None = None
) -> tuple[str, str]:
    """(outcome, reason) of a cell whose ranks all returned. ``recheck``: the same cell in fp64, run where
    fp32 differs beyond the tolerances and the model has an fp64 reference (tests/fit_utils.py FP64_RECHECK)."""
    from tests.shares import check_moe_share, check_share, expected_moe_shares, expected_shares

    failures = [r["error"] for r in results if "error" in r]
    if failures:
        first = failures[0]
        refused = len(failures) == len(results) and all(f["refusal"] for f in failures)
        return ("refused", first["first_line"]) if refused else ("exception", failure_reason(first))
    warned = sorted({w for r in results for w in r["warnings"]})
    strategy_kwargs, devices = LAYOUTS[layout]
    differs, note = differences(results, ref), []
    if differs and recheck is not None and ref.get("fp64") is not None:
        in_fp64 = recheck()
        if not [r for r in in_fp64 if "error" in r] and not differences(in_fp64, ref["fp64"], FP64_RECHECK):
            note, differs = [f"fp32 round-off ({differs}): in fp64 equal to one process at {FP64_RECHECK:g}x"], ""
    if differs:
        return "mismatch", differs
    try:
        if moe:
            stacked = experts_by_shape(ref)
            full = routed_only(ref["held"], stacked)
            for result in results:
                held = routed_only(result["held"], stacked)
                own, kwargs, ranks = own_stage(full, held, strategy_kwargs, devices)
                expected = expected_moe_shares(own, kwargs, ranks)
                outside = expected_moe_shares(full, strategy_kwargs, devices)["others"]
                check_moe_share({**result, "held": held}, {**expected, "others": outside})
        else:
            for result in results:
                own, kwargs, ranks = own_stage(ref["held"], result["held"], strategy_kwargs, devices)
                expected = expected_shares(own, kwargs, ranks)
                expected["others"] = expected_shares(ref["held"], strategy_kwargs, devices)["others"]
                check_share(result, expected, ref)
    except AssertionError as error:
        share = assertion_text(error)
        share = "; ".join([share, *note])
        return ("warned", f"{share}; warned: {warned[0]}") if warned else ("unsharded", share)
    return "ok", "; ".join(note + warned)


def differences(results: list[dict], ref: dict, scale: float = 1.0) -> str:
    """Why the ranks' losses, gradients or weights differ from one process at the matrix's tolerances
    times ``scale`` (its round-off floor included where ``ref`` has one), or "" where they agree."""
    from tests.fit_utils import assert_ranks_match_reference

    tolerances = {"loss_rtol": LOSS_RTOL * scale, "grad_rel": GRAD_REL * scale, "update_rel": UPDATE_REL * scale}
    try:
        assert_ranks_match_reference(results, ref, **tolerances)
    except Exception as error:  # noqa: BLE001 - AssertionError, or a KeyError on a missing name
        return assertion_text(error)
    return ""


def experts_by_shape(ref: dict) -> set[str]:
    """Parameters stacked over the experts by shape, whatever their name: 3-D or more, leading dim the
    tiny config's expert count (JetMoE's ``mlp.input_linear.weight`` [4, 2F, H])."""
    from tests.tiny_configs import MOE_KEYS

    n = MOE_KEYS["num_experts"]
    return {name for name, (_, dim) in ref["held"].items() if dim >= 3 and ref["state"][name].shape[0] == n}


def routed_only(held: dict, stacked: set[str] = frozenset()) -> dict:
    """Shared experts (DeepSeek's ``mlp.shared_experts``) named as the dense MLPs they are: every token
    runs them and no layout splits them over e, but tests/shares.py's EXPERT substring matches them;
    ``stacked`` experts named as experts (tests/shares.py reads names)."""
    renamed = {}
    for name, value in held.items():
        if name in stacked and "experts." not in name:  # mlp.input_linear.weight -> mlp.input_linear.experts.weight
            module, _, leaf = name.rpartition(".")
            name = f"{module}.experts.{leaf}"
        renamed[name.replace("shared_experts.", "shared_mlp.")] = value
    return renamed


_LAYER = re.compile(r"^(.*?(?:^|\.)\d+\.)")


def own_stage(full: dict, held: dict, strategy_kwargs: dict, devices: int) -> tuple[dict, dict, int]:
    """Under PP, what a rank's share is computed from: its own stage's blocks (and everything outside
    the blocks), at p=1 over its devices / p ranks. tests/shares.py divides every block by p, which
    holds only where every block is alike (not with dense first layers before MoE ones)."""
    p = strategy_kwargs.get("pipeline_parallel_size", 1)
    if p == 1:
        return full, strategy_kwargs, devices
    layers = {m.group(1) for name in held if (m := _LAYER.match(name))}
    every = {m.group(1) for name in full if (m := _LAYER.match(name))}
    assert len(layers) * p == len(every), f"a rank holds {len(layers)} of {len(every)} blocks under p={p}"
    own = {name: nd for name, nd in full.items() if (m := _LAYER.match(name)) is None or m.group(1) in layers}
    return own, {**strategy_kwargs, "pipeline_parallel_size": 1}, devices // p


def assertion_text(error: BaseException) -> str:
    """The assertion's message, or the asserting line where it has none (a bare ``assert a == b``)."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines()[:3])  # assert_close: what differs
    if text:
        return f"{type(error).__name__}: {text}" if not isinstance(error, AssertionError) else text
    frames = traceback.extract_tb(error.__traceback__)
    return f"assert failed: {frames[-1].line}" if frames else type(error).__name__


@contextlib.contextmanager
def time_limit(seconds: float):
    """TimeoutError in this (main) thread after ``seconds``: the one-process run's per-cell timeout."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no result within {seconds:.0f}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def reference(model_type: str, steps: int, timeout: float) -> tuple[dict | None, str]:
    """The one-process run (fit_and_record's reference), or why there is none: the tiny model did not
    build, its training forward is random (random routing, a dropout the table missed) or not causal
    (a bidirectional encoder), or the run failed."""
    import torch

    from tests.fit_utils import fit_and_record
    from tests.models import build_model

    stage = "tiny config"
    try:
        with time_limit(timeout):
            model = build_model(TINY + model_type).train()
            ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = model.logits(ids)
                if not torch.equal(logits, model.logits(ids)):
                    return None, "excluded: two training forwards of one batch differ (random routing or dropout)"
                other_last = torch.cat([ids[:, :-1], (ids[:, -1:] + 1) % 64], dim=1)
                if not torch.allclose(logits[:, :-1], model.logits(other_last)[:, :-1], rtol=0, atol=CAUSAL_ATOL):
                    return None, "excluded: not causal, earlier positions' logits depend on the last token"
            stage = "one process"
            ref = fit_and_record(TINY + model_type, steps=steps)
            floor, ref64, variant = fp32_floor(model_type, ref, steps)
            return {**ref, "floor": floor, "fp64": ref64, "fp64_variant": variant}, ""
    except Exception as error:  # noqa: BLE001 - the family's outcome
        failure = describe_failure(error, started=False)
        return None, f"build_failure: {stage}: {failure_reason({**failure, 'phase': ''})}"


def fp32_floor(model_type: str, ref: dict, steps: int) -> tuple[dict | None, dict | None, dict | None]:
    """How far fp32 round-off alone moves this model's one-process run (tests/fit_utils.py
    roundoff_floor): against the same run in fp64 (returned too, with the arguments that ran it: the
    fp64 recheck's reference). Experts whose grouped_mm has no fp64 kernel run in fp64 as transformers'
    eager loop (the same sums). Where neither runs, against the same run with each batch in two
    accumulated halves (the same sum in another order, as d2 computes it). None: the fixed tolerances."""
    from tests.fit_utils import fit_and_record, roundoff_floor

    for variant in FP64_VARIANTS:
        try:
            ref64 = fit_and_record(TINY + model_type, steps=steps, **variant)
            return roundoff_floor(ref, ref64), ref64, variant
        except Exception:  # noqa: BLE001 - e.g. an op with no fp64 kernel
            continue
    try:
        return roundoff_floor(ref, fit_and_record(TINY + model_type, steps=steps, accumulate=2)), None, None
    except Exception:  # noqa: BLE001
        return None, None, None


class Pools:
    """One DistributedPool per world size, alive across cells; replaced only after a cell broke it."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.started = 0

    def get(self, world_size: int) -> Any:
        from lightning_ptdp.testing import DistributedPool

        if self.pool is not None and (self.pool.world_size != world_size or not self.pool.alive):
            self.pool.close(force=not self.pool.alive)
            self.pool = None
        if self.pool is None:
            self.pool, self.started = DistributedPool(world_size), self.started + 1
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def run_layout(pools: Pools, model_type: str, layout: str, ref: dict, moe: bool, steps: int, timeout: float) -> dict:
    from lightning_ptdp.testing import RankFailure

    strategy_kwargs, devices = LAYOUTS[layout]
    start = time.monotonic()

    def in_fp64() -> list[dict]:
        variant = ref["fp64_variant"]
        return pools.get(devices).run(run_cell, model_type, strategy_kwargs, devices, steps, variant, timeout=timeout)

    try:
        results = pools.get(devices).run(run_cell, model_type, strategy_kwargs, devices, steps, timeout=timeout)
        outcome, reason = classify(results, ref, layout, moe, in_fp64)
    except RankFailure as failure:  # the pool is closed: the next cell starts a new one
        text = str(failure)
        reason = rank_failure_reason(text)
        outcome = "hung" if "no result within" in reason else "exception"
    except Exception as error:  # noqa: BLE001 - the sweep's own comparison broke: said so, and the sweep goes on
        outcome, reason = "exception", f"the sweep's check failed: {type(error).__name__}: {error}"
    return {"outcome": outcome, "reason": reason, "seconds": round(time.monotonic() - start, 1)}


def rank_failure_reason(text: str) -> str:
    """A failed rank's last line, preferring a rank that raised to one the pool killed while it waited."""
    blocks = [block.strip().splitlines() for block in text.split("--- rank ")[1:]]
    said = [(lines[0].strip("- "), lines[-1].strip()) for lines in blocks if lines]
    raised = [(rank, last) for rank, last in said if "no result within" not in last and "still running" not in last]
    rank, last = (raised or said or [("", text.strip().splitlines()[0])])[0]
    return f"{rank}: {last}" if rank else last


def select(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The architectures to sweep, and the reason each excluded one among them is out."""
    from tests.tiny_configs import causal_lm_names, exclusion

    names = sorted(causal_lm_names())
    if args.families:
        patterns = args.families.split(",")
        names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    excluded = {name: reason for name in names if (reason := exclusion(name))}
    if args.sample:
        eligible = [n for n in names if n not in excluded]
        names = sorted(random.Random(SAMPLE_SEED).sample(eligible, min(args.sample, len(eligible))))
        excluded = {}
    return names, excluded


def sweep(args: argparse.Namespace) -> dict:
    from tests.shares import EXPERT
    from tests.tiny_configs import causal_lm_names

    names, excluded = select(args)
    steps = 1 if args.quick else STEPS
    classes, pools, families = causal_lm_names(), Pools(), {}
    try:
        for name in names:
            cells: dict[str, dict] = {}
            ref, why = (
                (None, f"excluded: {excluded[name]}") if name in excluded else reference(name, steps, args.timeout)
            )
            moe = ref is not None and any(EXPERT in key for key in ref["held"])
            for layout in args.layouts:
                if layout in EXPERT_LAYOUTS and not moe:
                    continue  # no experts to split (or no model to look for them in)
                if ref is None:
                    outcome, _, reason = why.partition(": ")
                    cells[layout] = {"outcome": outcome, "reason": reason, "seconds": 0.0}
                else:
                    cells[layout] = run_layout(pools, name, layout, ref, moe, steps, args.timeout)
                print(
                    f"{name:28} {layout:6} {cells[layout]['outcome']:13} {cells[layout]['reason'][:150]}",
                    file=sys.stderr,
                    flush=True,
                )
            families[name] = {"class": classes[name], "moe": moe, "cells": cells}
    finally:
        pools.close()
    return {"families": families, "steps": steps, "pools_started": pools.started}


def merged(base: dict, update: dict, results: Path | None) -> dict:
    """``base`` (a whole sweep) with the cells ``update`` reran put in their place; the update is
    listed beside it (when, the code, the command, which cells). A base record written before records
    carried their code takes it from the section it wrote (its ``- Code:`` line)."""
    if base["steps"] != update["steps"] or set(update["layouts"]) - set(base["layouts"]):
        raise SystemExit("--update needs a whole sweep's JSON, of as many steps, covering the rerun layouts")
    if "code" not in base:
        source = results if results is not None and results.exists() else RESULTS
        section = source.read_text().partition(f"<!-- section:{SECTION} -->")[2]
        found = re.search(r"- Code: (.+?)\.\n", section)
        base["code"] = found.group(1) if found else "unrecorded"
    record = {**base, "families": {name: dict(family) for name, family in base["families"].items()}}
    rerun = []
    for name, family in update["families"].items():
        into = record["families"].setdefault(name, {**family, "cells": {}})
        into["cells"] = {**into["cells"], **family["cells"]}
        rerun += [f"{name} {layout}" for layout in family["cells"]]
    note = {k: update[k] for k in ("date", "code", "command", "minutes")}
    record["updates"] = [*base.get("updates", []), {**note, "cells": rerun}]
    return record


def stored_record(results: Path) -> Path:
    """Where the record behind ``results``'s table is kept (written with it, read by ``--update``)."""
    return results.parent / "results" / f"{SECTION}.json"


def load_base(path: Path, results: Path) -> dict:
    """The whole sweep to update: ``path``'s record, or, where it was never kept, the one ``results``'s
    table was rendered from (``from_section``)."""
    if path.exists():
        return json.loads(path.read_text())
    text = results.read_text() if results.exists() else ""
    if f"<!-- section:{SECTION} -->" not in text:
        raise SystemExit(f"--update: no record at {path} and no {SECTION} section in {results} to read one from")
    return from_section(text)


def from_section(text: str) -> dict:
    """The record a rendered section came from, as far as it shows it: outcomes, reasons cut to
    REASON_CHARS, the run's and each update's header; cell seconds are not shown (0)."""
    body = text.partition(f"<!-- section:{SECTION} -->")[2].partition(f"<!-- /section:{SECTION} -->")[0]
    head = re.search(r"- Code: (.+?)\.\n- (\S+), transformers (\S+), torch (\S+), (.+?)\.\n", body)
    run = re.search(r"- `(.+?)`: \d+ of (\d+) architectures.*?; (\d+) steps,.*?; ([\d.]+) min, (\d+) pool", body)
    if head is None or run is None:
        raise SystemExit(f"the {SECTION} section has no header this script wrote")
    updates = [
        {"date": d, "code": code, "command": command, "minutes": float(m), "cells": [""] * int(n)}
        for d, n, code, command, m in re.findall(
            r"- Updated (\S+): (\d+) cells rerun at (.+?) \(`(.+?)`, ([\d.]+) min\)", body
        )
    ]
    tables = [t for t in re.split(r"\n\n", body) if t.startswith("| architecture |")]
    grid, reasons = tables[0].splitlines(), tables[1].splitlines()[2:]
    layouts = [c.strip() for c in grid[0].strip("|").split("|")][1:]
    families: dict[str, dict] = {}
    for line in grid[2:]:
        name, *outcomes = (c.strip() for c in line.strip("|").split("|"))
        moe = name.endswith(" (MoE)")
        cells = {k: {"outcome": o, "reason": "", "seconds": 0.0} for k, o in zip(layouts, outcomes) if o != "-"}
        families[name.removesuffix(" (MoE)")] = {"class": "", "moe": moe, "cells": cells}
    for line in reasons:
        name, layout, _, reason = re.match(r"\| (.+?) \| (.+?) \| (.+?) \| (.*) \|$", line).groups()
        families[name]["cells"][layout]["reason"] = reason.replace("\\|", "|")
    code, date, transformers, torch, cpu = head.groups()
    command, registered, steps, minutes, pools = run.groups()
    return {
        "date": date,
        "transformers": transformers,
        "torch": torch,
        "cpu": cpu,
        "command": command,
        "registered": int(registered),
        "layouts": layouts,
        "families": families,
        "steps": int(steps),
        "pools_started": int(pools),
        "minutes": float(minutes),
        "code": code,
        "updates": updates,
    }


def counts(record: dict) -> dict[str, dict[str, int]]:
    """layout -> outcome -> number of cells."""
    table: dict[str, dict[str, int]] = {layout: dict.fromkeys(OUTCOMES, 0) for layout in record["layouts"]}
    for family in record["families"].values():
        for layout, cell in family["cells"].items():
            table[layout][cell["outcome"]] += 1
    return table


def _cell_text(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def render(record: dict) -> str:
    layouts, table = record["layouts"], counts(record)
    lines = [
        "## Sweep: every transformers causal LM at each layout against one process",
        "",
        f"- {record['date']}, transformers {record['transformers']}, torch {record['torch']}, {record['cpu']}.",
        f"- `{record['command']}`: {len(record['families'])} of {record['registered']} architectures in "
        f"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; tiny configs from tests/tiny_configs.py; {record['steps']} steps, "
        f"fp32, 2 gloo ranks; losses {LOSS_RTOL:g} relative, first gradients {GRAD_REL:g}, weights {UPDATE_REL:g} "
        f"of their update, each raised to {ROUNDOFF_FACTOR:g}x the model's own fp32 round-off where larger (the "
        "one-process run against itself in fp64, or with its batches in two accumulated halves where an op has no "
        "fp64 kernel: tests/fit_utils.py roundoff_floor); a cell beyond them is rerun in fp64 against one process in "
        f"fp64 at {FP64_RECHECK:g}x the tolerances (FP64_RECHECK); then each rank's share (tests/shares.py); "
        f"{record['minutes']:.1f} min, "
        f"{record['pools_started']} pool(s) started.",
    ]
    lines += [
        f"- Updated {update['date']}: {len(update['cells'])} cells rerun at {update['code']} "
        f"(`{update['command']}`, {update['minutes']:.1f} min); the others are the run above's."
        for update in record.get("updates", [])
    ]
    lines += ["", "| layout | " + " | ".join(OUTCOMES) + " | cells |", "|---" * (len(OUTCOMES) + 2) + "|"]
    for layout in layouts:
        row = table[layout]
        lines.append(f"| {layout} | " + " | ".join(str(row[o]) for o in OUTCOMES) + f" | {sum(row.values())} |")
    total = {o: sum(table[layout][o] for layout in layouts) for o in OUTCOMES}
    lines.append("| all | " + " | ".join(str(total[o]) for o in OUTCOMES) + f" | {sum(total.values())} |")
    lines += ["", "Outcomes: " + "; ".join(f"**{o}**: {text}" for o, text in OUTCOMES.items()) + ".", ""]
    lines += ["| architecture | " + " | ".join(layouts) + " |", "|---" * (len(layouts) + 1) + "|"]
    for name, family in record["families"].items():
        cells = [family["cells"].get(layout, {}).get("outcome", "-") for layout in layouts]
        lines.append(f"| {name}{' (MoE)' if family['moe'] else ''} | " + " | ".join(cells) + " |")
    lines += ["", "Every cell that is not ok, with its reason:", ""]
    lines += ["| architecture | layout | outcome | reason |", "|---|---|---|---|"]
    for name, family in record["families"].items():
        for layout, cell in family["cells"].items():
            if cell["outcome"] != "ok":
                lines.append(f"| {name} | {layout} | {cell['outcome']} | {_cell_text(cell['reason'])} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma list of model types or globs (default: all)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--sample", type=int, default=0, help=f"N architectures drawn with seed {SAMPLE_SEED}")
    parser.add_argument("--quick", action="store_true", help="1 training step per cell instead of the matrix's")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per cell")
    parser.add_argument("--out", type=Path, default=None, help="JSON record (default: not written)")
    parser.add_argument("--results", type=Path, default=None, help="RESULTS.md to write the section into")
    parser.add_argument(
        "--update",
        type=Path,
        nargs="?",
        const="kept",
        default=None,
        help="rerun the chosen cells of a whole sweep's JSON (--out; default: the record kept beside the "
        "table), keep its others, write the merged table",
    )
    args = parser.parse_args(argv)
    args.layouts = args.layouts.split(",")
    unknown = [layout for layout in args.layouts if layout not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}: choose from {list(LAYOUTS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    import os

    import torch
    import transformers

    from tests.tiny_configs import causal_lm_names

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it
    quiet()
    args = parse(argv)
    commit, start = code_version(), time.monotonic()
    record = {
        "date": today(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cpu": cpu_description(),
        "command": "python -m benchmarks.sweep_transformers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "registered": len(causal_lm_names()),
        "layouts": args.layouts,
        **sweep(args),
    }
    record["minutes"] = (time.monotonic() - start) / 60
    record["code"] = commit
    results = args.results if args.results is not None else RESULTS
    if args.update is not None:
        base = load_base(stored_record(results) if args.update == "kept" else args.update, results)
        record = merged(base, record, args.results)
    record["counts"] = counts(record)
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
    whole = args.update is not None or (
        not (args.families or args.sample or args.quick) and args.layouts == list(LAYOUTS)
    )
    if args.results is None and not whole:  # a part of the sweep never replaces the recorded whole one
        print("a partial sweep (--families, --sample, --quick or --layouts): RESULTS.md and README left as they are")
        return record
    write_section(SECTION, render(record), commit=record["code"], path=results)
    stored_record(results).parent.mkdir(exist_ok=True)
    stored_record(results).write_text(json.dumps(record, indent=1) + "\n")
    if args.results is None:  # the repository's RESULTS.md: the README's counts block follows it
        from tests.works_with import BLOCKS

        for block in (b for b in BLOCKS if b.name == "sweep"):
            block.path.write_text(block.rewrite(block.path.read_text()))
    return record


if __name__ == "__main__":
    main()
