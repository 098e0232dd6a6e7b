"""``ptdp plan --calibrate``: the cost model on this machine's CPU, predicted beside measured.

On 4 gloo processes it measures CPU seconds (a waiting rank's core runs another) of a block at two
sizes, an AdamW step, gloo all-reduces and the core share; timed ``Trainer.fit`` steps of 1- and
6-layer models at p = 1 and of a 2-layer pipeline give the host costs. It then predicts and
measures the 8-layer model at (t, p, d) = (1,1,4), (2,1,2), (1,2,2), (2,2,1), (1,4,1) v=2, each
round at the speed probed around it; nothing is fitted to those times (docs/architecture.md, "The
planner"). The runs themselves are timed by ``measure.py``.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

from lightning_ptdp.planner.cost import HOST_OVERHEADS
from lightning_ptdp.planner.measure import (
    GLOBAL_BATCH,
    MODEL,
    SHALLOW_TIMED,
    TIMED,
    WORLD,
    between_probes,
    measure_layout,
    measure_machine,
    small_estimate,
    small_size,
)

LAYOUTS = ((1, 1, 4, 1), (2, 1, 2, 1), (1, 2, 2, 1), (2, 2, 1, 1), (1, 4, 1, 2))  # (t, p, d, v)
HOST_PROBES = ((1, 1, 4, 1), (2, 1, 2, 1))  # (t, p, d, v) of the timed steps that measure host overheads
HOST_DEPTHS = (1, 6)  # their models' layer counts: shallower than MODEL, so no predicted run is measured twice
PIPELINE_PROBE = (1, 2, 2, 1, 2)  # (t, p, d, v, layers): a one-layer-per-stage pipeline, for the engine's costs
RANK_TIE = 0.05  # layouts measured this close (or within their own rounds' spread) have no order here
ROUNDS = 3  # each layout timed 3 times, every other round in reverse order; medians over the rounds


def fit_cluster(machine: list[dict]) -> tuple[object, dict]:
    """The CPU ``Cluster`` from ``measure_machine``'s per-rank figures (medians over ranks).

    Every figure is CPU seconds of work; with more ranks than cores a rank gets ``share`` of a core
    (measured while all ranks compute; ``cores / ranks`` nominally), so each rate is scaled by it:

    * layer: CPU(b) = layer_overhead + FLOPs(b) / rate + streamed bytes(b) / memory rate, at b=1
      and b=2 (same op count, twice the work): the rate is the slope, the overhead the intercept;
    * memory rate: the AdamW step streams ``OPTIMIZER_BYTES_PER_PARAMETER`` per parameter;
    * gloo ring all-reduce: RING_BASE_LATENCY + 2(n-1) hop + 2(n-1)/n bytes / bandwidth, solved from
      the TP size in pairs and the DP size over all ranks (the model counts 2-byte elements, the
      CPU runs fp32: half the fp32 bandwidth); gloo has no tree all-reduce.
    """
    from lightning_ptdp.planner import Cluster
    from lightning_ptdp.planner.cost import RING_BASE_LATENCY
    from lightning_ptdp.planner.estimate import OPTIMIZER_BYTES_PER_PARAMETER, executed_flops, layer_memory_bytes

    med = {k: statistics.median(m[k] for m in machine) for k in machine[0]}
    share = statistics.median(m[k] for m in machine for k in ("share_b1", "share_b2"))
    nominal = min(1.0, med["cores"] / WORLD)
    size = small_size()
    one = replace(size, num_layers=1)
    memory_rate = OPTIMIZER_BYTES_PER_PARAMETER * med["adam_parameters"] / med["adam_cpu_s"]
    work = {}
    for b in (1, 2):
        flops = executed_flops(one, b, None)[0]
        work[b] = (flops, med[f"block_b{b}_cpu_s"] - 3 * layer_memory_bytes(size, 1, b, False) / memory_rate)
    rate = (work[2][0] - work[1][0]) / (work[2][1] - work[1][1])
    overhead = max(0.0, work[1][1] - work[1][0] / rate)
    a, c = med["tp_all_reduce_cpu_s"] - RING_BASE_LATENCY, med["dp_all_reduce_cpu_s"] - RING_BASE_LATENCY
    b1, b2 = med["tp_bytes"], med["dp_bytes"]
    inverse_bw = (c - 3 * a) / (2 * (WORLD - 1) / WORLD * b2 - 3 * b1)
    if inverse_bw <= 0:  # noise: the DP all-reduce is bandwidth-bound
        inverse_bw = c / (2 * (WORLD - 1) / WORLD * b2)
    hop = max(1e-7, (a - b1 * inverse_bw) / 2)
    whole_core = Cluster(
        num_gpus=WORLD,
        gpus_per_node=WORLD,
        gpu_memory_bytes=1e12,
        peak_flops=rate,
        gemm_efficiency=1.0,
        hbm_bandwidth=memory_rate,
        num_sms=1,
        gemm_tile=(1, 1),
        intra_node_bandwidth=1 / inverse_bw / 2,
        nvlink_hop_latency=hop,
        layer_overhead_s=overhead,
        tree_all_reduce=False,
    )
    cluster = at_speed(whole_core, share)
    figures = {
        "cores": med["cores"],
        "cpu_share_measured": round(share, 3),
        "cpu_share_nominal": round(nominal, 3),
        "block_cpu_s": {"b1": round(med["block_b1_cpu_s"], 5), "b2": round(med["block_b2_cpu_s"], 5)},
        "flops_per_cpu_second": round(rate),
        "layer_overhead_cpu_s": round(overhead, 6),
        "memory_bytes_per_cpu_second": round(memory_rate),
        "adam_cpu_s": round(med["adam_cpu_s"], 5),
        "tp_all_reduce_cpu_s": round(med["tp_all_reduce_cpu_s"], 6),
        "dp_all_reduce_cpu_s": round(med["dp_all_reduce_cpu_s"], 5),
        "all_reduce_fp32_bytes_per_cpu_second": round(1 / inverse_bw),
        "all_reduce_hop_cpu_s": round(hop, 7),
        "wall_clock_doctor_bench": {"busbw": round(med["wall_busbw"]), "all_reduce_4kb_s": round(med["wall_4kb_s"], 6)},
    }
    return cluster, figures


def fit_host_overheads(cluster, share: float, probes: dict) -> tuple[object, dict]:
    """The host costs the micro-benchmarks miss, from timed ``Trainer.fit`` steps of shallow models.

    ``probes`` maps (t, p, d, v, layers) of ``HOST_PROBES`` x ``HOST_DEPTHS`` to a rank's measured CPU
    seconds per step. Each probe's residual (measured minus the model) is split, in this order:
    at t = 1 its growth per layer is added to ``layer_overhead_s`` and what is left at the shallow
    depth is ``loop_overhead_s`` per loop iteration; at t = 2 its growth per layer is
    ``tp_layer_overhead_s`` and what is left at the shallow depth ``tp_microbatch_overhead_s`` per
    microbatch; the pipeline probe's residual (outside its bubble, where no rank works) is
    ``pipeline_chunk_overhead_s`` per chunk and microbatch. Five probes, five terms. Nothing here sees
    the predicted layouts' depth."""
    from lightning_ptdp.planner.estimate import executed_flops

    whole = at_speed(cluster, 1.0 / share)  # rates of a whole core: the estimates are CPU seconds
    low, high = HOST_DEPTHS
    (t1, p1, d1, v1), (t2, p2, d2, v2) = HOST_PROBES
    m1, m2 = GLOBAL_BATCH // d1, GLOBAL_BATCH // d2

    def residual(c, t: int, p: int, d: int, v: int, layers: int) -> float:
        return probes[(t, p, d, v, layers)] - small_estimate(c, t, p, v, layers).step_time_s

    one = lambda c, layers: residual(c, t1, p1, d1, v1, layers)
    two = lambda c, layers: residual(c, t2, p2, d2, v2, layers)
    per_layer = (one(whole, high) - one(whole, low)) / (high - low) / m1
    overhead = whole.layer_overhead_s + per_layer
    if overhead < 0:  # a timed layer costs less than the block's FLOPs at the block-fitted rate: a faster rate
        flops_s = executed_flops(replace(small_size(), num_layers=1), 1, None)[0] / whole.peak_flops
        whole = replace(whole, peak_flops=whole.peak_flops * flops_s / (flops_s + overhead))
    whole = replace(whole, layer_overhead_s=max(0.0, overhead))
    whole = replace(whole, loop_overhead_s=max(0.0, one(whole, low) / m1))
    tp_per_layer = (two(whole, high) - two(whole, low)) / (high - low) / m2
    whole = replace(whole, tp_layer_overhead_s=max(0.0, tp_per_layer))
    whole = replace(whole, tp_microbatch_overhead_s=max(0.0, two(whole, low) / m2))
    t, p, d, v, layers = PIPELINE_PROBE
    x = small_estimate(whole, t, p, v, layers)
    pipeline = (probes[PIPELINE_PROBE] - (x.step_time_s - x.bubble_s)) / (x.num_microbatches * v)
    whole = replace(whole, pipeline_chunk_overhead_s=max(0.0, pipeline))
    figures = {
        "host_probes_cpu_s": {f"t{t} p{p} d{d} v{v} L{n}": round(x, 4) for (t, p, d, v, n), x in probes.items()},
        "layer_overhead_cpu_s_timed": round(whole.layer_overhead_s, 6),
        "flops_per_cpu_second_timed": round(whole.peak_flops),
        "loop_overhead_cpu_s": round(whole.loop_overhead_s, 6),
        "tp_layer_overhead_cpu_s": round(whole.tp_layer_overhead_s, 6),
        "tp_microbatch_overhead_cpu_s": round(whole.tp_microbatch_overhead_s, 6),
        "pipeline_chunk_overhead_cpu_s": round(whole.pipeline_chunk_overhead_s, 6),
        "host_fit_left_at_t2_shallow_cpu_s": round(two(whole, low), 4),
    }
    return at_speed(whole, share), figures


def resolved(a: dict, b: dict, tie: float = RANK_TIE) -> bool:
    """Whether two layouts' measured steps differ by more than ``tie`` and by more than either one's
    own spread over its rounds (closer than that, this machine's noise decides their order)."""
    low, high = sorted((a["measured_s"], b["measured_s"]))
    return high / low - 1 > max(tie, a.get("round_spread", 0.0), b.get("round_spread", 0.0))


def same_ranking(rows: list[dict], tie: float = RANK_TIE) -> bool:
    """Whether the predictions order every two layouts as measured, where the measurement resolves
    their order (``resolved``)."""
    for a, b in itertools.combinations(rows, 2):
        low, high = sorted((a, b), key=lambda r: r["measured_s"])
        if resolved(a, b, tie) and high["predicted_s"] <= low["predicted_s"]:
            return False
    return True


def verdict(rows: list[dict], max_error: float, same: bool) -> str:
    """One sentence: whether the 25% target and the measured ranking hold, and if not, where."""
    within = (
        "every layout within 25%"
        if max_error <= 0.25
        else (
            "outside 25%: "
            + ", ".join(f"({r['t']},{r['p']},{r['d']}) {r['error']:+.0%}" for r in rows if abs(r["error"]) > 0.25)
        )
    )
    measured = sorted(rows, key=lambda r: r["measured_s"])
    close = [
        f"({a['t']},{a['p']},{a['d']}) vs ({b['t']},{b['p']},{b['d']}) {b['measured_s'] / a['measured_s'] - 1:.0%} apart"
        for a, b in itertools.pairwise(measured)
        if not resolved(a, b)
    ]
    ranking = "ranking as measured" if same else "ranking differs from measured"
    if close:
        ranking += (
            f" (measured within {RANK_TIE:.0%} or within their rounds' spread, so unordered: " + "; ".join(close) + ")"
        )
    met = max_error <= 0.25 and same
    text = f"Target {'met' if met else 'missed'}: {within}; {ranking}."
    name = lambda r: f"({r['t']},{r['p']},{r['d']})"
    cpu = max(rows, key=lambda r: abs(r["predicted_cpu_s"] / r["measured_cpu_s"] - 1))
    cpu_error = cpu["predicted_cpu_s"] / cpu["measured_cpu_s"] - 1
    text += (
        f" Load-free check, CPU seconds per rank per step: predicted within {abs(cpu_error):.0%} of measured for "
        f"every layout (largest {name(cpu)} {cpu_error:+.0%})."
    )
    if not met:
        text += (
            " The machine's speed, probed around each run, ranged over "
            f"{min(r['speed_vs_calibration'] for r in rows)}-{max(r['speed_vs_calibration'] for r in rows)} "
            "of the calibration's; a change during a run that the probes around it miss is not in the prediction."
        )
    return text


def at_speed(cluster, k: float):
    """The CPU ``Cluster`` with every rate times ``k`` (and every fixed cost over it)."""
    return replace(
        cluster,
        peak_flops=cluster.peak_flops * k,
        hbm_bandwidth=cluster.hbm_bandwidth * k,
        intra_node_bandwidth=cluster.intra_node_bandwidth * k,
        nvlink_hop_latency=cluster.nvlink_hop_latency / k,
        **{name: getattr(cluster, name) / k for name in HOST_OVERHEADS},
    )


def calibrate() -> dict:
    """Measure this machine, then predict and measure the five layouts; one dict of the figures."""
    from lightning_ptdp.testing import DistributedPool

    pool = DistributedPool(WORLD)
    try:
        machine = pool.run(measure_machine)
        # the host probes' and the layouts' runs, in alternated rounds; every timed run sits between two
        # speed probes: this VM's speed drifts with other users' jobs
        host_keys = [(*layout, layers) for layout in HOST_PROBES for layers in HOST_DEPTHS] + [PIPELINE_PROBE]
        keys = host_keys + [(*layout, MODEL["num_layers"]) for layout in LAYOUTS]
        timed: dict[tuple, list] = {key: [] for key in keys}
        for index in range(ROUNDS):
            for key in keys if index % 2 == 0 else keys[::-1]:
                steps = SHALLOW_TIMED if key[4] <= 2 else TIMED
                timed[key].append(between_probes(pool, measure_layout, *key, steps))
    finally:
        pool.close()
    cluster, figures = fit_cluster(machine)
    reference = statistics.median(m["block_b1_cpu_s"] for m in machine)
    host = {  # each probe's CPU seconds per step at the calibration's speed, median over its rounds
        key: statistics.median(
            statistics.median(cpu for _, _, cpu in out) * reference / block for out, _, block in timed[key]
        )
        for key in host_keys
    }
    runs = {key[:4]: timed[key] for key in keys[len(host_keys) :]}
    cluster, host_figures = fit_host_overheads(cluster, figures["cpu_share_measured"], host)
    figures.update(host_figures)
    # A TP rank sleeps at each collective until its partner has run: it gets less of a core than a
    # t = 1 rank does. The shallow probes' CPU / wall over their timed steps measures how much less.
    in_run = {
        n: statistics.median(s for k in host_keys if k[:2] == (n, 1) for o, _, _ in timed[k] for _, s, _ in o)
        for n in (1, 2)
    }
    figures["host_probes_share_in_run"] = {f"t{n}": round(x, 3) for n, x in in_run.items()}
    tp_factor = in_run[2] / in_run[1]
    figures["tp_share_factor"] = round(tp_factor, 3)
    rows = []
    for (t, p, d, v), rounds in runs.items():
        out = [rank for ranks, _, _ in rounds for rank in ranks]
        per_round, guesses = [], []
        for ranks, share, block in rounds:  # each timed run predicted at the speed probed around it
            speed = share / figures["cpu_share_measured"] * reference / block  # this VM then over at calibration
            tp_share = tp_factor if t > 1 else 1.0
            x = small_estimate(at_speed(cluster, speed * tp_share), t, p, v)
            # On an oversubscribed CPU a pipeline's bubble is time when about half the ranks compute (the
            # stages filling or draining), and they get up to twice the share: a whole core here.
            bubble = x.bubble_s * (share / min(1.0, 2 * share) - 1)
            guesses.append((x.step_time_s + bubble, x, bubble, share, block, speed, tp_share))
            per_round.append(statistics.median(step for step, _, _ in ranks))
        seconds = statistics.median(per_round)
        predicted, x, bubble, share, block, speed, tp_share = sorted(guesses, key=lambda g: g[0])[len(guesses) // 2]
        rows.append(
            {
                "t": t,
                "p": p,
                "d": d,
                "v": v,
                "m": x.num_microbatches,
                "predicted_s": round(predicted, 4),
                "measured_s": round(seconds, 4),
                "measured_rounds_s": [round(step, 4) for step in per_round],
                "predicted_rounds_s": [round(g[0], 4) for g in guesses],
                "round_spread": round(max(per_round) / min(per_round) - 1, 3),
                "error": round(predicted / seconds - 1, 3),
                "cpu_share_probed": round(share, 3),
                "block_cpu_probed_s": round(block, 5),
                "speed_vs_calibration": round(speed, 3),
                "cpu_share_during_run": round(statistics.median(busy for _, busy, _ in out), 3),
                "predicted_cpu_s": round((x.step_time_s - x.bubble_s) * share * tp_share, 4),
                "measured_cpu_s": round(statistics.median(cpu for _, _, cpu in out), 4),
                "parts_s": {
                    k: round(getattr(x, k + "_s"), 4)
                    for k in (
                        "compute",
                        "tensor_parallel_comm",
                        "pipeline_comm",
                        "bubble",
                        "data_parallel_comm",
                        "optimizer",
                    )
                }
                | {"bubble": round(x.bubble_s + bubble, 4)},
            }
        )
    max_error = max(abs(r["error"]) for r in rows)
    same = same_ranking(rows)
    order = lambda key: [(r["t"], r["p"], r["d"]) for r in sorted(rows, key=lambda r: r[key])]
    return {
        "model": MODEL,
        "global_batch_size": GLOBAL_BATCH,
        "world_size": WORLD,
        "rounds": ROUNDS,
        **figures,
        "layouts": rows,
        "same_ranking": same,
        "same_order_without_ties": order("predicted_s") == order("measured_s"),
        "max_abs_error": max_error,
        "target_met": max_error <= 0.25 and same,
        "verdict": verdict(rows, max_error, same),
        "raw": machine,
    }


def main(argv: object = None) -> int:
    import json
    import sys

    result = calibrate()
    sys.stdout.write(json.dumps(result, indent=1) + "\n")  # the command's output: JSON on stdout
    return 0 if result["target_met"] else 1
