"""Short fits on 2 processes started by Lightning's launcher, then a normal interpreter exit (for
test_clean_exit.py). Usage: python -m tests.integration.short_fit_job LAYOUT FAMILY [FITS], LAYOUT
one of d2, t2, p2, c2, d2-e2. Last at exit, each rank prints how many gloo worker threads it has left."""

from __future__ import annotations

import atexit
import os
import sys

AXES = {"t": "tensor_parallel_size", "p": "pipeline_parallel_size", "c": "context_parallel_size"}
AXES["e"] = "expert_parallel_size"


def report_threads_left() -> None:
    from lightning_ptdp.core.shutdown import gloo_worker_threads

    print(f"rank {os.environ.get('LOCAL_RANK', '0')} left {gloo_worker_threads()} gloo threads", flush=True)


def main(layout: str, family: str, fits: int = 1) -> None:
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer, zoo_data
    from tests.models import build_model

    sizes = {AXES[part[0]]: int(part[1:]) for part in layout.split("-") if part[0] in AXES}
    L.seed_everything(0, verbose=False)
    model = build_model(family)
    for _ in range(fits):  # a second fit reuses the rewritten model and its groups
        trainer = quiet_trainer(devices=2, strategy=PTDPStrategy(**sizes), max_steps=3)
        trainer.fit(model, zoo_data(4, 40 * 33, 8 * 33))
        print(f"rank {trainer.global_rank} finished at step {trainer.global_step}", flush=True)
    MODEL.append(model)  # held to the end, as a script's global model is


MODEL: list = []

if __name__ == "__main__":
    atexit.register(report_threads_left)  # registered before the strategy's hook: runs after it
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
