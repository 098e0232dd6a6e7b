"""The ``ptdp`` console script: the library's command (lightning_ptdp/tools/cli.py) with the
reference GPT on the embedded Markov corpus as the model and data when ``--model`` / ``--data``
name none. The defaults live here because the library never imports the recipes. Installed, this
folder is ``lightning_ptdp.recipes`` (no top-level ``recipes`` claimed), so the defaults name
their modules relative to this package.

    ptdp fit --trainer.strategy.tensor_parallel_size=2 --trainer.devices=2
    python -m recipes.cli fit --model=my_pkg.MyModel --data=my_pkg.MyData
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_ptdp.tools import cli

DEFAULTS = {"model": f"{__package__}.gpt.GPTLightningModule", "data": f"{__package__}.data.MarkovDataModule"}
"""Class paths in this package: ``recipes.`` in a checkout, ``lightning_ptdp.recipes.`` installed."""


def build_cli(args: Optional[Sequence[str]] = None, **kwargs: Any):
    """``lightning_ptdp.tools.cli.build_cli`` with the reference GPT and Markov data as defaults."""
    return cli.build_cli(args, defaults=DEFAULTS, **kwargs)


def main(argv: Optional[Sequence[str]] = None) -> None:
    cli.main(argv, defaults=DEFAULTS)


if __name__ == "__main__":
    main()
