"""Kernel tests run on the Triton CPU interpreter unless a CUDA device is present.

TRITON_INTERPRET=1 is set by the repository-root conftest.py (triton reads it once, at its
first import, which lightning triggers early). Each test module starts with
pytest.importorskip("triton"), so the directory reads as skipped where triton is absent.
"""

import pytest
import torch

from lightning_ptdp.triton_kernels._config import interpreting


def pytest_collection_modifyitems(config, items):
    """Turn a misconfigured run (no GPU and no interpreter) into one clear skip reason."""
    if torch.cuda.is_available() or interpreting():
        return
    skip = pytest.mark.skip(reason="no CUDA device and TRITON_INTERPRET is not 1 (set it before triton is imported)")
    for item in items:
        if "tests/kernels/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where kernel inputs live: the GPU when there is one, else CPU memory for the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
