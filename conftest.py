"""Repository-root pytest setup, loaded before every other conftest.

Without a CUDA device the Triton kernel tests (tests/kernels) run on the Triton CPU
interpreter. Triton chooses interpreted vs compiled when it is first imported, and
``import lightning`` (in tests/conftest.py) already imports it, so the switch has to be set
here, before anything else.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
