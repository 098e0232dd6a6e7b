"""Activation memory per microbatch per transformer layer, measured, beside Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models").

    python -m benchmarks.bench_activation

4 gloo ranks (d = 4 / t), the recipes GPT (pre-LN, SDPA attention, Linear-GeLU-Linear MLP,
dropout 0.1 after the attention projection and after the MLP, none inside attention), fp32.
Each row shards the model through ``parallelize`` (the strategy's path: tensor parallel, sequence
parallel, recompute) and counts the bytes autograd saves for backward while block 1 of 3 runs
its forward on each rank: unique storages, parameters and buffers excluded (``SavedBytes``).

The paper's per-layer bytes, 16-bit activations and 1-byte dropout masks (the rows of its Table 2,
derived in the sections named; ``lightning_ptdp.core.flops.activation_bytes_per_layer`` holds the same):
  no parallelism                 sbh (34 + 5as/h)            Section 4.1 (Eq. 1)
  TP, t ranks                    sbh (10 + 24/t + 5as/(ht))  Section 4.2.1 (Eq. 2)
  TP + SP                        sbh (34/t + 5as/(ht))       Section 4.2.2
  TP + SP + selective recompute  sbh 34/t                    Section 5 (the 5as^2b core recomputed)
  full recompute                 2sbh                        Table 2 (with SP the input kept is 1/t of it)
``formula_bytes`` rebuilds these from the paper's term list, with the element and mask sizes as
arguments: per layer, replicated under TP: 2 LN inputs, QKV and fc_in inputs (4 elements) and
2 dropout masks; split over t: Q, K, V, the projection input, the GeLU input and the fc_out input
(12 elements); attention core, split over t: softmax output (a*s^2*b elements) and, with attention
dropout, its mask and output. SP splits the replicated part along s too. Defaults (2-byte
elements, 1-byte masks, attention dropout) reproduce the paper; the conversion for this run is
4-byte elements, 4-byte masks (eager CPU dropout saves a float scale tensor of the input's dtype,
not a byte mask) and no attention dropout: sbh (72 + 4as/h) unparallelised, not the paper's
sbh (34 + 5as/h).

Attention runs twice per row: SDPA's "math" backend (unfused, the paper's attention: saves the
a*s^2*b softmax) and "flash" (torch's CPU default for these inputs: saves its output, which the
projection reuses as its input, and a b*a*s fp32 log-sum-exp instead of the softmax, so its
formula is the selective one plus 4bas/t bytes). Ratios are measured / the fp32 formula of that
backend; the paper's 16-bit figure is printed beside them. Prints JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.results import pool_of, stats

TITLE = "activation memory per layer and microbatch: TP, SP, recompute (issue 5)"

MODEL = {"vocab_size": 256, "seq_length": 256, "num_layers": 3, "num_heads": 8, "hidden_size": 256, "dropout": 0.1}
BATCH = 2
WORLD_SIZE = 4
MEASURED_BLOCK = 1  # neither first nor last: SP's scatter/gather hooks sit on the end blocks
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]  # (t, sequence_parallel); SP needs t > 1
RECOMPUTE = [None, "selective", "full"]


def formula_bytes(
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str | None = None,
    act_bytes: int = 2,
    mask_bytes: int = 1,
    attention_dropout: bool = True,
) -> float:
    """Bytes one layer keeps for one microbatch on one rank, term by term as the paper counts
    them; the defaults give the paper's figures (its Table 2)."""
    sbh = s * b * h
    if recompute == "full":  # only the layer input, sharded along s under SP
        return act_bytes * sbh / (t if sp else 1)
    replicated = (4 * act_bytes + 2 * mask_bytes) * sbh
    split = 12 * act_bytes * sbh / t
    core = 0.0
    if recompute != "selective":
        per_score = act_bytes + (act_bytes + mask_bytes if attention_dropout else 0)
        core = per_score * a * s * s * b / t
    return (replicated / t if sp else replicated) + split + core


class SavedBytes:
    """Bytes of the storages autograd saves for backward while active, each storage once;
    parameters and buffers (weights saved by Linear, LayerNorm) are not activations."""

    def __init__(self, model: torch.nn.Module) -> None:
        tensors = [*model.parameters(), *model.buffers()]
        self._excluded = {x.untyped_storage().data_ptr() for x in tensors}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)  # a view saved by several ops (q as bmm and softmax input) counts once
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:  # noqa: PYI034 (Self needs Python 3.11)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def block_saved_bytes(model: torch.nn.Module, block: torch.nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes saved while ``block`` runs inside ``forward()`` (hooks outside any recompute wrapper)."""
    counter = SavedBytes(model)

    def start(*_: Any) -> None:  # a pre-hook's return value would replace the block's inputs
        counter.__enter__()

    def stop(*_: Any) -> None:
        counter.__exit__(None, None, None)

    handles = [block.register_forward_pre_hook(start), block.register_forward_hook(stop)]
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
    return counter.bytes


def measure(t: int, sp: bool, recompute: str | None, backend: str, model: dict, batch: int) -> int:
    """On every rank: build the GPT, shard it through ``parallelize``, count block 1's saved bytes."""
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_ptdp import ParallelConfig, ParallelDims
    from lightning_ptdp.parallel.parallelize import parallelize
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    net = GPT(GPTConfig(**model))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model["vocab_size"], (batch, model["seq_length"]), generator=generator)
    config = ParallelConfig(
        tensor_parallel_size=t, sequence_parallel=sp, activation_checkpointing=recompute, kernels="torch"
    )
    dims = ParallelDims.from_config(config, dist.get_world_size())
    parallelize(net, config=config, dims=dims, mesh=dims.build_mesh("cpu"), probe=lambda: net(ids), training=False)
    chosen = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    with sdpa_kernel([chosen]):
        return block_saved_bytes(net, net.blocks[MEASURED_BLOCK], lambda: net(ids))


def row(pool: Any, t: int, sp: bool, recompute: str | None, model: dict, batch: int) -> dict:
    s, h, a = model["seq_length"], model["hidden_size"], model["num_heads"]
    shape = {"s": s, "b": batch, "h": h, "a": a, "t": t, "sp": sp, "recompute": recompute}
    this_run = {"act_bytes": 4, "mask_bytes": 4, "attention_dropout": False}
    math = formula_bytes(**shape, **this_run)
    # flash keeps no softmax: its output (stored anyway as the projection input) and a b*a*s fp32 log-sum-exp
    flash = formula_bytes(**{**shape, "recompute": recompute or "selective"}, **this_run)
    flash += 4 * batch * a * s / t if recompute is None else 0
    result = {"t": t, "sp": sp, "recompute": recompute, "paper_16bit": formula_bytes(**shape)}
    for backend, formula in (("math", math), ("flash", flash)):
        per_rank = pool.run(measure, t, sp, recompute, backend, model, batch)
        result |= {
            f"{backend}_bytes": stats(per_rank),
            f"{backend}_formula_fp32": formula,
            f"{backend}_ratio": stats([b / formula for b in per_rank]),
        }
    return result


def run(*, layouts: list | None = None, model: dict | None = None, batch: int = BATCH, pool=None) -> dict:
    """One round: the bytes are a count (the same on every rank and every run), not a timing; the
    spread reported is over the ranks."""
    model, layouts = model or MODEL, layouts or LAYOUTS
    rows = []
    with pool_of(WORLD_SIZE, pool) as workers:
        for t, sp in layouts:
            for recompute in RECOMPUTE:
                rows.append(row(workers, t, sp, recompute, model, batch))
    return {
        "benchmark": "activation_bytes_per_layer",
        "sizes": {
            "model": model,
            "batch": batch,
            "world_size": WORLD_SIZE,
            "dtype": "float32",
            "layouts": [list(x) for x in layouts],
            "rounds": 1,
            "sbh": model["seq_length"] * batch * model["hidden_size"],
        },
        "unsupported": ["t=1 with sequence_parallel (ParallelConfig: SP needs t > 1)"],
        "rows": rows,
    }


def markdown(result: dict) -> str:
    s, m = result["sizes"], result["sizes"]["model"]
    mib = 2**20
    lines = []
    for r in result["rows"]:
        cells = [str(r["t"]), "yes" if r["sp"] else "no", r["recompute"] or "none", f"{r['paper_16bit'] / mib:.3f}"]
        for backend in ("math", "flash"):
            b, ratio = r[f"{backend}_bytes"], r[f"{backend}_ratio"]
            ranks = "" if b["min"] == b["max"] else f" ({b['min'] / mib:.3f}-{b['max'] / mib:.3f})"
            cells += [
                f"{r[f'{backend}_formula_fp32'] / mib:.3f}",
                f"{b['median'] / mib:.3f}{ranks}",
                f"{ratio['median']:.3f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join("  " + line for line in lines)
    ratios = [r[f"{k}_ratio"][x] for r in result["rows"] for k in ("math", "flash") for x in ("min", "max")]
    equal = all(r[f"{k}_bytes"]["min"] == r[f"{k}_bytes"]["max"] for r in result["rows"] for k in ("math", "flash"))
    as_h = m["num_heads"] * m["seq_length"] / m["hidden_size"]
    return f"""- Sizes: {s["world_size"]} gloo ranks (d = {s["world_size"]}/t); recipes GPT l={m["num_layers"]} h={m["hidden_size"]}
  a={m["num_heads"]} V={m["vocab_size"]} s={m["seq_length"]}, b={s["batch"]}, dropout {m.get("dropout", 0)}, fp32; as/h = {as_h:g}.
- Measured: the bytes autograd saves for backward while block 1 runs its forward on each rank
  (saved-tensor hooks; each storage once; parameters and buffers excluded), after `parallelize`
  applied TP, SP and recompute as the strategy does. A count, not a timing: one round; the median
  is over ranks ({"every rank counted the same bytes in every row" if equal else "ranks differ where a range is shown"}).
- Formulas: Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks, attention
  dropout): sbh(34 + 5as/h) unparallelised. Re-derived term by term for this run (`formula_bytes`):
  4-byte activations, 4-byte dropout masks (eager CPU dropout saves a float scale tensor of the
  input's dtype), no attention dropout (the recipes GPT has none): sbh(72 + 4as/h) unparallelised.
  "math" is SDPA's unfused backend (the a*s^2*b softmax is saved); "flash" (torch's CPU default)
  saves its output and a b*a*s log-sum-exp instead, so its formula is the selective one + 4bas/t bytes.
  t=1 with SP is not a layout (`ParallelConfig` refuses sequence_parallel without t > 1).

  | t | SP | recompute | paper, 16-bit | fp32 formula, math | measured, math | ratio | fp32 formula, flash | measured, flash | ratio |
  |---|---|---|---|---|---|---|---|---|---|
{table}

  (MiB per layer per microbatch per rank.) **Measured / re-derived formula: {min(ratios):.3f} to
  {max(ratios):.3f} over every row and backend**; the excess is LayerNorm's saved mean and rstd (16sb
  bytes), which the paper leaves out. Under SP the column Linears of a region save only their 1/t
  input shard (`tensor_parallel/sequence_linear.py`) and the region gathers it again in backward, as
  Megatron does (the extra all-gathers are in the tensor-parallel section's collective table).
"""


def main() -> None:
    print(json.dumps(run(), indent=1))


if __name__ == "__main__":
    main()
