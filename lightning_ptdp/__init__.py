"""lightning-ptdp: Megatron-style PTD-P (pipeline x tensor x data) parallelism for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="ptdp")``.
"""

__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ptdp.config import CompileConfig, ParallelConfig
from lightning_ptdp.parallel.dims import ParallelDims
from lightning_ptdp.strategy import PTDPStrategy

if PTDPStrategy.strategy_name not in StrategyRegistry:
    PTDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["CompileConfig", "PTDPStrategy", "ParallelConfig", "ParallelDims", "__version__"]
