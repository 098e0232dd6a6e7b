"""Analytic cost model for GPT-style training: parameters, FLOPs, time, memory, MFU.

Formulas: Narayanan et al. 2021 (Megatron-LM, Section 5.1 and Appendix) for parameters, FLOPs and
training time; Korthikanti et al. 2022 (Section 4) for activation memory. Notation: l layers,
h hidden size, V vocabulary, s sequence length, B global batch, b micro-batch, a attention heads,
t / p / d tensor / pipeline / data-parallel sizes. Plain arithmetic, no torch and no process group,
so the planner, the throughput callback and the CLI can call it anywhere.
"""

from __future__ import annotations

import re
from numbers import Real

__all__ = [
    "PEAK_HBM_BYTES_PER_S",
    "PEAK_TFLOPS",
    "achieved_tflops_per_gpu",
    "activation_bytes_per_layer",
    "device_hbm_bandwidth",
    "device_peak_flops",
    "gpt_flops_per_iteration",
    "gpt_parameter_count",
    "model_flops_utilization",
    "model_state_bytes_per_rank",
    "training_time_seconds",
]

RECOMPUTE_MODES = (None, "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)

# Dense (no structured sparsity) tensor-core peaks in TFLOP/s, from the vendor data sheets.
# fp16 equals bf16 on these parts; "tf32" is the tensor-core TF32 rate, "fp32" the plain
# CUDA-core FP32 rate.  The H200 (SXM) has the same compute as the H100 SXM, more memory.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
}

# Peak HBM bandwidth in bytes/s, from the same data sheets (A100: the 80 GB part).
PEAK_HBM_BYTES_PER_S: dict[str, float] = {
    "A100": 2.039e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H200": 4.8e12,
}

# Lower-cased device names (as torch.cuda.get_device_name reports them) -> PEAK_TFLOPS key.
# Order matters: the PCIe H100 is tested before the catch-all H100 (the SXM part reports
# itself as "NVIDIA H100 80GB HBM3").  NVL variants have different clocks and are left
# unknown on purpose (so is the GH200), so the user supplies their peak instead of getting a
# wrong MFU.
_DEVICE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?<![a-z0-9])h100\b(?!.*\bnvl\b).*\bpcie\b"), "H100 PCIe"),
    (re.compile(r"(?<![a-z0-9])h100\b(?!.*\b(?:nvl|pcie)\b)"), "H100 SXM"),
    (re.compile(r"(?<![a-z0-9])h200\b(?!.*\bnvl\b)"), "H200"),
    (re.compile(r"(?<![a-z0-9])a100\b"), "A100"),
)

# Accepted spellings of a compute dtype (torch dtype strings, Lightning precision strings).
_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "16": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "32-true": "fp32",
    "32": "fp32",
}


def _positive_int(name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; {fix}")
    return value


def _positive_number(name: str, value: object, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}; {fix}")
    return float(value)


def gpt_parameter_count(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int) -> int:
    """Parameters of a GPT model, the paper's Eq. 2.

    ``P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh))``, counted term by term (exact, an ``int``):

    * per layer ``12h^2 + 13h``: QKV ``3h^2 + 3h``, attention output ``h^2 + h``, MLP
      ``h -> 4h -> h`` ``8h^2 + 5h``, and two layer norms ``4h``;
    * word embedding ``Vh`` (tied with the output layer, so counted once) and learned
      position embedding ``sh``.

    The final layer norm (``2h``) is left out, as in the paper.
    """
    l = _positive_int("num_layers", num_layers, "pass the number of transformer layers")
    h = _positive_int("hidden_size", hidden_size, "pass the model width")
    v = _positive_int("vocab_size", vocab_size, "pass the (padded) vocabulary size")
    s = _positive_int("seq_length", seq_length, "pass the sequence length in tokens")
    return l * (12 * h * h + 13 * h) + (v + s) * h


def gpt_flops_per_iteration(
    batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    activation_recompute: bool = True,
) -> int:
    """Matmul FLOPs of one training iteration (forward + backward) of a GPT model.

    Only matrix multiplications are counted (a multiply-add is 2 FLOPs); layer norms,
    softmax, GeLU and the optimizer are ignored.  One layer's forward pass costs

    * ``24Bsh^2``: QKV projection ``6Bsh^2``, attention output ``2Bsh^2`` and the two MLP
      matmuls ``16Bsh^2``;
    * ``4Bs^2h``: the scores ``QK^T`` ``2Bs^2h`` and the weighted sum over values ``2Bs^2h``.

    The backward pass costs twice the forward (gradients for inputs and for weights), so a
    layer costs 3 forward passes; with full activation recomputation the forward is run once
    more before the backward, 4 passes in all.  The logit layer (``2BshV`` forward) is not
    recomputed and so always costs 3 passes, ``6BshV``.  Hence

    * ``activation_recompute=True`` (what the paper reports, its Eq. 3):
      ``4 l (24Bsh^2 + 4Bs^2h) + 6BshV = 96Bslh^2 (1 + s/(6h) + V/(16lh))``;
    * ``activation_recompute=False`` (model FLOPs in the PaLM sense, the right numerator
      for MFU): ``3 l (24Bsh^2 + 4Bs^2h) + 6BshV = 72Bslh^2 (1 + s/(6h) + V/(12lh))``.
    """
    big_b = _positive_int("batch_size", batch_size, "pass the global batch size in sequences")
    s = _positive_int("seq_length", seq_length, "pass the sequence length in tokens")
    l = _positive_int("num_layers", num_layers, "pass the number of transformer layers")
    h = _positive_int("hidden_size", hidden_size, "pass the model width")
    v = _positive_int("vocab_size", vocab_size, "pass the (padded) vocabulary size")
    if not isinstance(activation_recompute, bool):
        raise ValueError(f"activation_recompute must be True or False, got {activation_recompute!r}")
    layer_forward = 24 * big_b * s * h * h + 4 * big_b * s * s * h
    layer_passes = 4 if activation_recompute else 3
    logit_layer = 3 * (2 * big_b * s * h * v)
    return layer_passes * l * layer_forward + logit_layer


def training_time_seconds(tokens: float, parameters: float, num_gpus: int, flops_per_gpu: float) -> float:
    """End-to-end training time, Eq. 4 of Narayanan et al.: ``8TP / (nX)`` seconds.

    ``T`` tokens, ``P`` parameters, ``n`` GPUs each sustaining ``X`` FLOP/s (achieved, not
    peak).  The 8 is Eq. 3's 96 divided by 12 (from ``P ~ 12lh^2``) when ``s << 6h`` and
    ``V << 16lh``, i.e. it assumes activation recomputation.
    """
    t = _positive_number("tokens", tokens, "pass the number of training tokens")
    p = _positive_number("parameters", parameters, "pass the model's parameter count")
    n = _positive_int("num_gpus", num_gpus, "pass the number of GPUs")
    x = _positive_number("flops_per_gpu", flops_per_gpu, "pass the achieved throughput per GPU in FLOP/s (e.g. 140e12)")
    return 8.0 * t * p / (n * x)


def model_state_bytes_per_rank(
    parameters: float,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    zero_stage: int = 0,
    bytes_per_param: float = 16,
    *,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
) -> float:
    """Bytes of weights, gradients and optimizer state held by one rank.

    The default 16 bytes per parameter is Adam with mixed precision: a bf16 weight (2) and
    gradient (2), plus 12 bytes of optimizer state: the fp32 master weight (4) and the two
    fp32 Adam moments (4 + 4).  In general the optimizer state is ``bytes_per_param -
    weight_bytes - grad_bytes``.

    Tensor and pipeline parallelism split every parameter over ``t * p`` ranks (evenly: the
    embedding's extra copy on the last stage is ignored).  ZeRO then shards over the ``d``
    data-parallel ranks: stage 1 the optimizer state, stage 2 also the gradients, stage 3
    also the weights.  So with the defaults, per parameter of the rank's ``P/(tp)`` share:
    stage 0 ``16``, stage 1 ``4 + 12/d``, stage 2 ``2 + 14/d``, stage 3 ``16/d``.
    """
    p_count = _positive_number("parameters", parameters, "pass the model's parameter count")
    t = _positive_int("tensor_parallel_size", tensor_parallel_size, "use 1 for no TP")
    p = _positive_int("pipeline_parallel_size", pipeline_parallel_size, "use 1 for no PP")
    d = _positive_int("data_parallel_size", data_parallel_size, "use 1 for no DP")
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}; "
            "use 0 for no sharding, 1/2/3 to shard optimizer/gradients/weights"
        )
    total = _positive_number(
        "bytes_per_param", bytes_per_param, "pass the model-state bytes per parameter (16: mixed-precision Adam)"
    )
    optimizer_bytes = total - weight_bytes - grad_bytes
    if not (weight_bytes >= 0 and grad_bytes >= 0 and optimizer_bytes >= 0):
        raise ValueError(
            f"bytes_per_param ({bytes_per_param}) must cover weight_bytes ({weight_bytes}) + "
            f"grad_bytes ({grad_bytes}), both non-negative; raise bytes_per_param or lower them"
        )
    weights = weight_bytes / d if zero_stage >= 3 else weight_bytes
    grads = grad_bytes / d if zero_stage >= 2 else grad_bytes
    optimizer = optimizer_bytes / d if zero_stage >= 1 else optimizer_bytes
    return p_count / (t * p) * (weights + grads + optimizer)


def activation_bytes_per_layer(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    *,
    split_sbh: float = 24.0,
) -> float:
    """Activation bytes one transformer layer keeps for one microbatch (Korthikanti et al.).

    Assumes 16-bit activations and 1-byte dropout masks.  Of the ``34sbh`` that do not
    grow with ``s^2``, plain tensor parallelism replicates ``10sbh`` on every TP rank: the
    inputs of the two layer norms (``4sbh``), of the QKV and first MLP matmuls (``2sbh +
    2sbh``) and the two dropout masks after attention and MLP (``sbh + sbh``).  The other
    ``24sbh`` (Q, K, V, the attention-output and second-MLP inputs, the GeLU input) are
    split over ``t``; sequence parallelism splits the replicated ``10sbh`` along ``s`` too.
    The ``5as^2b`` attention-matrix term (softmax input and output ``4as^2b``, its dropout
    mask ``as^2b``) is split over the heads, hence over ``t``.

    ==========  =====================  ===================================
    recompute   sequence_parallel      bytes per layer
    ==========  =====================  ===================================
    None        False                  ``sbh (10 + 24/t + 5as/(ht))``
    None        True                   ``sbh/t (34 + 5as/h)``
    selective   False                  ``sbh (10 + 24/t)``
    selective   True                   ``sbh 34/t``
    full        False                  ``2sbh`` (the layer input only)
    full        True                   ``2sbh/t`` (the input, split along s)
    ==========  =====================  ===================================

    With ``t = 1`` the first row is the unparallelised ``sbh (34 + 5as/h)``.  Selective
    recompute drops exactly the attention-matrix term, which is cheap to recompute.
    ``split_sbh`` replaces the ``24`` for other layer shapes (grouped-query K/V, a SwiGLU MLP).
    """
    s = _positive_int("seq_length", seq_length, "pass the sequence length in tokens")
    b = _positive_int("micro_batch_size", micro_batch_size, "pass the micro-batch size")
    h = _positive_int("hidden_size", hidden_size, "pass the model width")
    a = _positive_int("num_heads", num_heads, "pass the number of attention heads")
    t = _positive_int("tensor_parallel_size", tensor_parallel_size, "use 1 for no TP")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}; use None to keep all activations"
        )
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    sbh = float(s * b * h)
    if recompute == "full":
        return 2.0 * sbh / t if sequence_parallel else 2.0 * sbh
    attention_matrix = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    if sequence_parallel:
        return sbh * ((10.0 + split_sbh) / t + attention_matrix)
    return sbh * (10.0 + split_sbh / t + attention_matrix)


def _known_device(device_name: str) -> str | None:
    lowered = device_name.lower()
    for pattern, key in _DEVICE_PATTERNS:
        if pattern.search(lowered):
            return key
    return None


def device_peak_flops(device_name: str, dtype: str = "bf16", override: float | None = None) -> float:
    """Dense peak FLOP/s (not TFLOP/s) of one device for a compute dtype.

    ``device_name`` is matched case-insensitively, as reported by
    ``torch.cuda.get_device_name`` ("NVIDIA H100 80GB HBM3" is the SXM H100, "NVIDIA
    A100-SXM4-80GB" an A100) or as a ``PEAK_TFLOPS`` key.  ``dtype`` accepts ``bf16``,
    ``fp16``, ``tf32``, ``fp32`` and common spellings (``torch.bfloat16``, ``bf16-mixed``).
    A given ``override`` (FLOP/s) is returned as is, for devices not in the table.
    """
    if override is not None:
        return _positive_number("override", override, "pass the device's peak in FLOP/s (e.g. 989e12), or None")
    if not isinstance(dtype, str) or dtype.strip().lower() not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of 'bf16', 'fp16', 'tf32', 'fp32'")
    key = _known_device(device_name) if isinstance(device_name, str) else None
    if key is None:
        raise ValueError(
            f"unknown device {device_name!r}: pass peak_flops=... (FLOP/s); known devices: {', '.join(PEAK_TFLOPS)}"
        )
    return PEAK_TFLOPS[key][_DTYPE_ALIASES[dtype.strip().lower()]] * 1e12


def device_hbm_bandwidth(device_name: str) -> float | None:
    """Peak HBM bytes/s of a device named as ``device_peak_flops`` accepts; None when unknown."""
    key = _known_device(device_name) if isinstance(device_name, str) else None
    return PEAK_HBM_BYTES_PER_S.get(key) if key is not None else None


def achieved_tflops_per_gpu(flops_per_iteration: float, iteration_seconds: float, num_gpus: int) -> float:
    """Throughput per GPU in TFLOP/s, as the paper reports it: ``F / (time * n) / 1e12``.

    Pass ``F`` from :func:`gpt_flops_per_iteration` with ``activation_recompute=True`` to
    compare with the paper's tables.
    """
    f = _positive_number(
        "flops_per_iteration", flops_per_iteration, "pass the FLOPs of one iteration (gpt_flops_per_iteration)"
    )
    seconds = _positive_number(
        "iteration_seconds", iteration_seconds, "pass the measured wall-clock time of one iteration"
    )
    n = _positive_int("num_gpus", num_gpus, "pass the number of GPUs")
    return f / (seconds * n) / 1e12


def model_flops_utilization(
    flops_per_iteration: float, iteration_seconds: float, num_devices: int, peak_flops_per_device: float
) -> float:
    """Fraction of peak reached: ``F / (time * n * peak)``, in [0, 1] for a sane count.

    Which ``F`` decides what is measured: without recompute (model FLOPs) this is MFU;
    with the paper's Eq. 3 (recompute counted) it is closer to hardware FLOPs utilization.
    """
    f = _positive_number(
        "flops_per_iteration", flops_per_iteration, "pass the FLOPs of one iteration (gpt_flops_per_iteration)"
    )
    seconds = _positive_number(
        "iteration_seconds", iteration_seconds, "pass the measured wall-clock time of one iteration"
    )
    n = _positive_int("num_devices", num_devices, "pass the number of devices")
    peak = _positive_number(
        "peak_flops_per_device", peak_flops_per_device, "pass the peak in FLOP/s, e.g. device_peak_flops(name)"
    )
    return f / (seconds * n * peak)
