"""Where triton is absent, the package still imports and every entry point says so clearly."""

import subprocess
import sys

import pytest
import torch

from lightning_ptdp.kernels import apply_kernels
from lightning_ptdp.triton_kernels import support


def test_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import torch\nfrom lightning_ptdp import triton_kernels\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "assert not triton_kernels.triton_available()\n"
        "assert 'triton is not installed' in triton_kernels.attention_supported(q, q, q)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_modes_without_triton(monkeypatch):
    monkeypatch.setattr(support, "triton_importable", lambda: False)
    report = apply_kernels(torch.nn.Linear(2, 2), "auto", device=torch.device("cuda"))
    assert report.backend == "torch" and "triton is not installed" in report.reason
    with pytest.raises(
        RuntimeError, match=r"kernels='triton' needs triton: triton is not installed .* kernels='torch'"
    ):
        apply_kernels(torch.nn.Linear(2, 2), "triton", device=torch.device("cuda"))
