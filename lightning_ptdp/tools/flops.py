"""Deprecated location of ``lightning_ptdp.core.flops`` (moved with the foundation layer): importing
it still works for one release and warns. Import ``lightning_ptdp.core.flops`` instead."""

import warnings

from lightning_ptdp.core.flops import *  # noqa: F403
from lightning_ptdp.core.flops import __all__  # noqa: F401

warnings.warn(
    "lightning_ptdp.tools.flops moved to lightning_ptdp.core.flops; import it from there (the old path goes in "
    "the next release)",
    DeprecationWarning,
    stacklevel=2,
)
