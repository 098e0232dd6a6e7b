"""lightning-ptdp: Megatron-style PTD-P (pipeline x tensor x data) parallelism for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="ptdp")``. The ``ptdp`` command's tools (plan,
doctor, checkpoint) skip that import, and with it torch and Lightning: their names load on first use.
"""

import sys
from pathlib import Path

__version__ = "0.1.0"
__all__ = ["CompileConfig", "PTDPStrategy", "ParallelConfig", "ParallelDims", "__version__"]
_TOOLS = ("plan", "doctor", "checkpoint")  # lightning_ptdp.tools.cli.TOOL_COMMANDS, without importing it


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_ptdp.config import CompileConfig, ParallelConfig
    from lightning_ptdp.core.dims import ParallelDims
    from lightning_ptdp.strategy import PTDPStrategy

    if PTDPStrategy.strategy_name not in StrategyRegistry:
        PTDPStrategy.register_strategies(StrategyRegistry)
    globals().update(
        CompileConfig=CompileConfig, ParallelConfig=ParallelConfig, ParallelDims=ParallelDims, PTDPStrategy=PTDPStrategy
    )


def __getattr__(name: str):
    if name in __all__:
        _register()
        return globals()[name]
    raise AttributeError(f"module 'lightning_ptdp' has no attribute {name!r}")


if not (Path(sys.argv[0]).name == "ptdp" and len(sys.argv) > 1 and sys.argv[1] in _TOOLS):
    _register()
