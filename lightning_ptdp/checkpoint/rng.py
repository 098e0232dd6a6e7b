"""Every rank's random generator states in a checkpoint, so a resumed run draws what the
uninterrupted one would have (dropout masks, data order)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

RNG_KEY = "ptdp_rng_states"  # full format: every rank's generator states, in rank order


def collect_rng_states() -> dict[str, Any]:
    """This rank's torch/CUDA/numpy/python generator states (Lightning's own collector)."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    states = _collect_rng_states(include_cuda=torch.cuda.is_available())
    if "numpy" in states:  # its key array as a tensor, so torch.load(weights_only=True) accepts it
        name, keys, *rest = states["numpy"]
        states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), *rest)
    return states


def restore_rng_states(states: Optional[list], rank: int) -> bool:
    """Continue this rank's random streams where the checkpoint left them, if it was saved on as
    many ranks (on another layout the streams are used differently anyway: start from the seed)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not states or len(states) != world:
        return False
    set_rng_state(states[rank])
    return True


def set_rng_state(state: dict[str, Any]) -> None:
    """Undo ``collect_rng_states``: this rank's generators continue from ``state``."""
    from lightning.fabric.utilities.seed import _set_rng_states

    state = dict(state)
    if "numpy" in state:
        import numpy as np

        name, keys, *rest = state["numpy"]
        state["numpy"] = (name, np.asarray(keys.numpy(), dtype=np.uint32), *rest)
    _set_rng_states(state)
