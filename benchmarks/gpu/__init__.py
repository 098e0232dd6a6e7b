"""Every GPU figure of the project in one process: ``python -m benchmarks.gpu`` (see __main__.py).

Parts, each a module with ``run(ctx, rows) -> dict`` and ``markdown(record) -> str``:
correctness (Triton kernels vs torch, values and gradients), attention (TFLOP/s vs SDPA),
bias_gelu (GB/s vs eager and torch.compile, % of HBM peak), tuning (the tiles autotuning chose),
training (single-GPU tokens/s, TFLOP/s and MFU in alternated rounds: ptdp with each kernel choice vs plain
Lightning, and the kernels measured faster end to end, which kernels="auto" may route; rounds.py).
"""
