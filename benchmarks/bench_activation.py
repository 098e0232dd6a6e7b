"""Activation memory per microbatch per transformer layer, measured, beside Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models").

    python -m benchmarks.bench_activation

4 gloo ranks (d = 4 / t), the recipes GPT (pre-LN, SDPA attention, Linear-GeLU-Linear MLP,
dropout 0.1 after the attention projection and after the MLP, none inside attention), fp32.
Each row shards the model through ``parallelize`` (the strategy's path: tensor parallel, sequence
parallel, recompute) and counts the bytes autograd saves for backward while block 1 of 3 runs
its forward on each rank: unique storages, parameters and buffers excluded (``SavedBytes``).

The paper's per-layer bytes, 16-bit activations and 1-byte dropout masks (the rows of its Table 2,
derived in the sections named; ``lightning_ptdp.tools.flops.activation_bytes_per_layer`` holds the same):
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
import platform
from collections.abc import Callable
from typing import Any

import torch

MODEL = dict(vocab_size=256, seq_length=256, num_layers=3, num_heads=8, hidden_size=256, dropout=0.1)
BATCH = 2
WORLD_SIZE = 4
MEASURED_BLOCK = 1  # neither first nor last: SP's scatter/gather hooks sit on the end blocks
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]  # (t, sequence_parallel); SP needs t > 1
RECOMPUTE = [None, "selective", "full"]


def formula_bytes(
    *, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str | None = None,
    act_bytes: int = 2, mask_bytes: int = 1, attention_dropout: bool = True,
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

    def __enter__(self) -> SavedBytes:
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


def row(pool: Any, t: int, sp: bool, recompute: str | None) -> dict:
    s, h, a = MODEL["seq_length"], MODEL["hidden_size"], MODEL["num_heads"]
    shape = dict(s=s, b=BATCH, h=h, a=a, t=t, sp=sp, recompute=recompute)
    this_run = dict(act_bytes=4, mask_bytes=4, attention_dropout=False)
    math = formula_bytes(**shape, **this_run)
    # flash keeps no softmax: its output (stored anyway as the projection input) and a b*a*s fp32 log-sum-exp
    flash = formula_bytes(**{**shape, "recompute": recompute or "selective"}, **this_run)
    flash += 4 * BATCH * a * s / t if recompute is None else 0
    result = {"t": t, "sp": sp, "recompute": recompute, "paper_16bit": formula_bytes(**shape)}
    for backend, formula in (("math", math), ("flash", flash)):
        per_rank = pool.run(measure, t, sp, recompute, backend, MODEL, BATCH)
        result |= {
            f"{backend}_bytes": per_rank[0], f"{backend}_formula_fp32": formula,
            f"{backend}_ratio": round(per_rank[0] / formula, 4), f"{backend}_ranks_equal": len(set(per_rank)) == 1,
        }
    return result


def main() -> None:
    from lightning_ptdp.testing import DistributedPool

    rows = []
    with DistributedPool(WORLD_SIZE) as pool:
        for t, sp in LAYOUTS:
            for recompute in RECOMPUTE:
                rows.append(row(pool, t, sp, recompute))
    sbh = MODEL["seq_length"] * BATCH * MODEL["hidden_size"]
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "model": MODEL,
        "batch": BATCH, "world_size": WORLD_SIZE, "dtype": "float32", "sbh": sbh,
        "unsupported": ["t=1 with sequence_parallel (ParallelConfig: SP needs t > 1)"], "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
