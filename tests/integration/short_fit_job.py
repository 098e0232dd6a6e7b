"""A short fit on 2 processes started by Lightning's launcher, then a normal interpreter exit
(for test_clean_exit.py). Usage: python -m tests.integration.short_fit_job {dp|tp}"""

from __future__ import annotations

import sys


def main(layout: str) -> None:
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer, zoo_data
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    strategy = PTDPStrategy(tensor_parallel_size=2 if layout == "tp" else 1)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=3)
    trainer.fit(build_model("gpt"), zoo_data(4, 40 * 33, 8 * 33))
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
