"""What one rank should hold of a model's parameters under a layout, computed from the single-process
model's (name: numel, dim) and the layout alone: the equivalence tests' check that a layout really
splits the model, in bounds no wider than what the layout leaves open."""

from __future__ import annotations

import re

# A rank's expected share of the blocks' parameters (names with a block index, ".3."): the matrices
# split t*p ways (ZeRO 2-3: also d), the vectors (norms, biases) at most replicated over t. The
# slack is FSDP's dim-0 padding (a row per tensor) and vocab padding: 1% of the model.
SHARE_SLACK = 0.01
BLOCK_PARAMETER = re.compile(r"(^|\.)\d+\.")
EXPERT = "experts."  # "mlp.experts.gate_up_proj", "moe.experts.0.w1.weight", torchtitan's "inner_experts.w1_EFD"
# a router ("mlp.gate", torchtitan's "moe.router.gate", JetMoE's "experts.router.layer", Hunyuan's
# "mlp.gate.wg"): one score per expert, kept whole on every rank under TP so that every rank chooses the
# same experts; not a gating column ("output_gate"). Qwen2-MoE's [1, H] "shared_expert_gate" is a vector.
ROUTER = re.compile(r"(^|\.)(gate|router)(\.\w+)?\.weight$")


def is_expert(name: str, dim: int) -> bool:
    """A tensor of per-expert weights that expert parallelism splits: under "experts.", stacked or one
    expert's matrix; not a router, nor a vector every expert shares (JetMoE's experts.bias). ``dim``
    counts the dims of more than one entry (``held_dims``)."""
    return EXPERT in name and dim >= 2 and not ROUTER.search(name)


def held_dims(shape: tuple[int, ...]) -> int:
    """The dims of a parameter that hold more than one entry: a [1, E] routing bias is a vector, a
    depthwise conv's [C, 1, k] weight a matrix."""
    return sum(size > 1 for size in shape)


def _degrees(strategy_kwargs: dict, devices: int) -> tuple[int, int, int, int]:
    t = strategy_kwargs.get("tensor_parallel_size", 1)
    p = strategy_kwargs.get("pipeline_parallel_size", 1)
    return t, p, devices // (t * p), strategy_kwargs.get("zero_stage", 0)


def expected_shares(full: dict[str, tuple[int, int]], strategy_kwargs: dict, devices: int) -> dict:
    """Bounds on what one rank holds, from the single-process model's parameters (name: numel, dim)."""
    t, p, d, zero = _degrees(strategy_kwargs, devices)
    z = d if zero >= 2 else 1  # ZeRO 2-3 (FSDP2) keep parameters sharded at rest
    matrices = sum(n for name, (n, dim) in full.items() if BLOCK_PARAMETER.search(name) and dim >= 2)
    vectors = sum(n for name, (n, dim) in full.items() if BLOCK_PARAMETER.search(name) and dim < 2)
    model = sum(n for n, _ in full.values())
    slack = SHARE_SLACK * model
    return {
        "blocks": (matrices / (t * p * z) - slack, (matrices / t + vectors) / (p * z) + slack),
        "others": (model - matrices - vectors) / z + slack,
        "zero": zero,
        "t": t,
        "d": d,
        "largest": max(n for n, _ in full.values()),
    }


def check_share(result: dict, expected: dict, ref: dict) -> None:
    held = result["held"]
    blocks = sum(n for name, (n, _) in held.items() if BLOCK_PARAMETER.search(name))
    others = sum(n for name, (n, _) in held.items() if not BLOCK_PARAMETER.search(name))
    low, high = expected["blocks"]
    copied = result.get("replicated", 0)  # key/value heads fewer than t: each rank holds one whole
    assert low <= blocks <= high + copied, (
        f"a rank holds {blocks} block parameters; a balanced split holds {low:.0f}-{high:.0f}"
        + (f" (+{copied} of key/value heads copied over ranks)" if copied else "")
    )
    assert others <= expected["others"], f"a rank holds {others} other parameters, more than {expected['others']:.0f}"
    # Adam keeps two tensors per parameter: ZeRO-1 spreads them over d by whole tensors (balanced to
    # within the largest), ZeRO-3 shards them with the parameters, and otherwise each rank keeps its own.
    state = result["optimizer_numel"]
    if expected["zero"] == 1:
        share = ref["optimizer_numel"] / (expected["t"] * expected["d"]) + 2 * expected["largest"]
        assert state <= share, f"ZeRO-1 rank holds {state} optimizer elements, more than {share:.0f}"
    else:
        assert state <= 2 * result["local_numel"], (state, result["local_numel"])


def _total(full: dict[str, tuple[int, int]], keep) -> int:
    return sum(n for name, (n, dim) in full.items() if keep(name, dim))


def expected_moe_shares(full: dict[str, tuple[int, int]], strategy_kwargs: dict, devices: int) -> dict:
    """What one rank holds of a MoE model: exactly its n/e experts (whole under TP, Megatron's expert TP
    size 1; under PP its stage's layers'; ZeRO 2-3 also shards them over the d/e ranks sharing them);
    of the dense blocks the matrices split t ways but the routers, whole, and the vectors anywhere from
    split (column-parallel biases) to whole (norms); outside the blocks the embedding and head split t.
    Bounds widen only by FSDP's dim-0 padding (SHARE_SLACK), and only where ZeRO 2-3 shards."""
    t, p, d, zero = _degrees(strategy_kwargs, devices)
    e = strategy_kwargs.get("expert_parallel_size", 1)
    z, z_experts = (d, d // e) if zero >= 2 else (1, 1)
    dense = {name: nd for name, nd in full.items() if not is_expert(name, nd[1])}
    in_block = {name: nd for name, nd in dense.items() if BLOCK_PARAMETER.search(name)}
    outside = {name: nd for name, nd in dense.items() if name not in in_block}
    routers = _total(in_block, lambda name, dim: ROUTER.search(name))
    split = _total(in_block, lambda name, dim: dim >= 2 and not ROUTER.search(name))
    vectors = _total(in_block, lambda name, dim: dim < 2)
    head = _total(outside, lambda name, dim: dim >= 2)
    pad = SHARE_SLACK * sum(n for n, _ in full.values()) if zero >= 2 else 0
    blocks = ((split + vectors) / t + routers) / (p * z), (split / t + vectors + routers) / (p * z)
    others_high = (head / t + _total(outside, lambda name, dim: dim < 2)) / z + pad
    return {
        "experts": _total(full, is_expert) // (e * p * z_experts),
        # each parameter's kind is the whole model's: a rank's share of an expert stack may hold one expert
        "expert_names": {name for name, (_, dim) in full.items() if is_expert(name, dim)},
        "blocks": (blocks[0] - pad, blocks[1] + pad),
        # under PP the first stage holds the embedding and the last the head: only an upper bound there
        "others": ((head / t / z - pad) if p == 1 else 0, others_high),
    }


def check_moe_share(result: dict, expected: dict) -> None:
    held = result["held"]
    experts = sum(n for name, (n, _) in held.items() if name in expected["expert_names"])
    assert experts == expected["experts"], f"a rank holds {experts} expert parameters, not {expected['experts']}"
    for part, in_part in (("blocks", True), ("others", False)):
        got = sum(
            n
            for name, (n, _) in held.items()
            if name not in expected["expert_names"] and bool(BLOCK_PARAMETER.search(name)) == in_part
        )
        low, high = expected[part]
        copied = result.get("replicated", 0) if in_part else 0  # key/value heads fewer than t, each held whole
        assert low <= got <= high + copied, (
            f"a rank holds {got} dense {part} parameters; the layout gives {low:.0f}-{high:.0f}"
            + (f" (+{copied} of key/value heads copied over ranks)" if copied else "")
        )
