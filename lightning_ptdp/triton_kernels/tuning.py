"""triton.autotune over _config's candidate tiles for the attention kernels (imports triton).

Keyed on (sequence bucket, head dim, causal) plus the tensors' dtypes, which triton's autotuner
appends itself. The candidates for a launch are pruned to those of its head dim and dtype
(``attention_candidates``): one, with no timing, under the interpreter or with
TRITON_KERNELS_AUTOTUNE=0. ``chosen()`` reports what each kernel picked, for benchmarks.
"""

from __future__ import annotations

import triton

from ._config import (
    ATTENTION_CANDIDATES,
    FP32_CANDIDATES,
    Tiles,
    attention_candidates,
    attention_tiles,
    interpreting,
)

KEY = ["seq_bucket", "HEAD_DIM", "CAUSAL"]
_TUNED: dict[str, triton.runtime.Autotuner] = {}


def _config(tiles: Tiles) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n}, num_warps=tiles.num_warps, num_stages=tiles.num_stages
    )


def _tiles(config: triton.Config) -> Tiles:
    return Tiles(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


def autotuned(kernel: triton.JITFunction, stage: str) -> triton.runtime.Autotuner:
    """``kernel`` behind triton.autotune; launch it with a grid lambda and without BLOCK_M/N,
    num_warps or num_stages. ``stage``: "fwd", "dkdv" or "dq"."""
    if interpreting():
        pool = [attention_tiles(16, "fwd")]  # the interpreter's one tile size: nothing to time
    else:  # attention_tiles' fixed choices are among these (tests/kernels/test_tuning.py)
        pool = list(dict.fromkeys([*ATTENTION_CANDIDATES[stage], *FP32_CANDIDATES[stage]]))

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        args = {**named_args, **kwargs}
        wanted = attention_candidates(stage, args["HEAD_DIM"], args["Q"].dtype)
        by_tiles = {_tiles(c): c for c in configs}
        return [by_tiles[t] for t in wanted if t in by_tiles] or configs[:1]

    tuner = triton.autotune(
        configs=[_config(t) for t in pool], key=KEY, prune_configs_by={"early_config_prune": prune}
    )(kernel)
    _TUNED[stage] = tuner
    return tuner


def clear() -> None:
    """Forget every tuned choice: the next launch of each key tunes again (a part that ran with
    TRITON_KERNELS_AUTOTUNE=0 leaves its one untimed config cached under the same keys)."""
    for tuner in _TUNED.values():
        tuner.cache.clear()


def chosen() -> list[dict]:
    """One row per tuned key: kernel stage, key, the chosen tiles."""
    rows = []
    for stage, tuner in _TUNED.items():
        for key, config in tuner.cache.items():
            tiles = _tiles(config)
            dtypes = dict.fromkeys(str(k) for k in key[len(KEY) :])  # one per tensor argument: once each
            rows.append(
                {
                    "kernel": stage,
                    "key": [*(str(k) for k in key[: len(KEY)]), *dtypes],
                    "block_m": tiles.block_m,
                    "block_n": tiles.block_n,
                    "num_warps": tiles.num_warps,
                    "num_stages": tiles.num_stages,
                }
            )
    return rows
