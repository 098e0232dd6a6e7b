"""Deprecated location of ``lightning_ptdp.tools.flops`` (moved in 0.1.0): importing it still works for
one release and warns. Import ``lightning_ptdp.tools.flops`` instead."""

import warnings

from lightning_ptdp.tools.flops import *  # noqa: F403
from lightning_ptdp.tools.flops import __all__  # noqa: F401

warnings.warn(
    "lightning_ptdp.flops moved to lightning_ptdp.tools.flops; import it from there (the old path goes in the "
    "next release)",
    DeprecationWarning,
    stacklevel=2,
)
