"""Tests for lightning_ptdp.core.flops: the paper's formulas, memory estimates, device peaks.

Expected values are written out independently here (with ``Fraction`` where the paper's
closed forms have fractions), never by calling the function under test a second way.
"""

from fractions import Fraction

import pytest

from lightning_ptdp.core.flops import (
    PEAK_TFLOPS,
    achieved_tflops_per_gpu,
    activation_bytes_per_layer,
    device_peak_flops,
    gpt_flops_per_iteration,
    gpt_parameter_count,
    model_flops_utilization,
    model_state_bytes_per_rank,
    training_time_seconds,
)

SECONDS_PER_DAY = 86_400
# Table 1 of Narayanan et al. uses GPT-2's padded vocabulary and a 2048-token context.
VOCAB, SEQ = 51_200, 2_048

# (heads, hidden, layers) -> parameters in billions, as printed in Table 1.
TABLE_1 = [
    ((24, 2304, 24), 1.7),
    ((32, 3072, 30), 3.6),
    ((32, 4096, 36), 7.5),
    ((48, 6144, 40), 18.4),
    ((64, 8192, 48), 39.1),
    ((80, 10240, 60), 76.1),
    ((96, 12288, 80), 145.6),
    ((128, 16384, 96), 310.1),
    ((128, 20480, 105), 529.6),
    ((160, 25600, 128), 1008.0),
]


def eq2(l, h, v, s):
    return 12 * l * h**2 * (1 + Fraction(13, 12 * h) + Fraction(v + s, 12 * l * h))


def eq3(big_b, s, l, h, v):
    return 96 * big_b * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(("shape", "billions"), TABLE_1)
def test_parameter_count_reproduces_table_1(shape, billions):
    _, hidden, layers = shape
    count = gpt_parameter_count(num_layers=layers, hidden_size=hidden, vocab_size=VOCAB, seq_length=SEQ)
    assert round(count / 1e9, 1) == billions


@pytest.mark.parametrize(("l", "h", "v", "s"), [(1, 1, 1, 1), (2, 12, 50, 7), (24, 2304, VOCAB, SEQ)])
def test_parameter_count_equals_eq2_exactly(l, h, v, s):
    count = gpt_parameter_count(num_layers=l, hidden_size=h, vocab_size=v, seq_length=s)
    assert count == eq2(l, h, v, s)


def test_parameter_count_small_model_by_hand():
    # l=2, h=4: per layer 12*16 + 13*4 = 244, two layers 488; embeddings (10 + 6) * 4 = 64.
    assert gpt_parameter_count(num_layers=2, hidden_size=4, vocab_size=10, seq_length=6) == 552


# --------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(
    ("big_b", "s", "l", "h", "v"), [(1, 6, 1, 1, 16), (3, 12, 2, 6, 32), (1536, 2048, 96, 12288, VOCAB)]
)
def test_flops_with_recompute_equal_eq3_exactly(big_b, s, l, h, v):
    flops = gpt_flops_per_iteration(
        batch_size=big_b, seq_length=s, num_layers=l, hidden_size=h, vocab_size=v, activation_recompute=True
    )
    assert flops == eq3(big_b, s, l, h, v)


def test_flops_default_is_recompute():
    kwargs = dict(batch_size=2, seq_length=8, num_layers=3, hidden_size=4, vocab_size=10)
    assert gpt_flops_per_iteration(**kwargs) == eq3(2, 8, 3, 4, 10)


def test_flops_by_hand_small_model():
    # B=1, s=2, l=1, h=3, V=5. One layer forward: 24*1*2*9 = 432 plus 4*1*4*3 = 48 -> 480.
    # Logit layer forward 2*1*2*3*5 = 60, so 180 for forward + backward.
    kwargs = dict(batch_size=1, seq_length=2, num_layers=1, hidden_size=3, vocab_size=5)
    assert gpt_flops_per_iteration(**kwargs, activation_recompute=True) == 4 * 480 + 180
    assert gpt_flops_per_iteration(**kwargs, activation_recompute=False) == 3 * 480 + 180


@pytest.mark.parametrize(("big_b", "s", "l", "h", "v"), [(4, 16, 2, 8, 100), (512, 2048, 24, 2304, VOCAB)])
def test_flops_without_recompute_from_first_principles(big_b, s, l, h, v):
    tokens = big_b * s
    # (tokens x h) @ (h x 3h); (tokens x h) @ (h x h); (tokens x h) @ (h x 4h) and back.
    qkv, attn_out, mlp = 2 * tokens * h * 3 * h, 2 * tokens * h * h, 2 * (2 * tokens * h * 4 * h)
    scores, weighted_values = 2 * big_b * s * s * h, 2 * big_b * s * s * h
    layer_forward = qkv + attn_out + mlp + scores + weighted_values
    logits_forward = 2 * big_b * s * h * v
    expected = 3 * (l * layer_forward + logits_forward)  # forward + backward (2x forward)
    flops = gpt_flops_per_iteration(
        batch_size=big_b, seq_length=s, num_layers=l, hidden_size=h, vocab_size=v, activation_recompute=False
    )
    assert flops == expected
    # The closed form with 72 in place of 96 and V/(12lh) in place of V/(16lh).
    closed = 72 * big_b * s * l * h**2 * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))
    assert flops == closed


def test_recompute_ratio_is_four_thirds_only_for_the_transformer_layers():
    kwargs = dict(batch_size=8, seq_length=2048, num_layers=96, hidden_size=12288)
    with_rc = gpt_flops_per_iteration(**kwargs, vocab_size=VOCAB, activation_recompute=True)
    without = gpt_flops_per_iteration(**kwargs, vocab_size=VOCAB, activation_recompute=False)
    logits = 6 * 8 * 2048 * 12288 * VOCAB
    assert Fraction(with_rc - logits, without - logits) == Fraction(4, 3)
    ratio = with_rc / without
    assert 1.3 < ratio < 4 / 3  # the un-recomputed logit layer pulls it below 4/3


# --------------------------------------------------------------------------- time, MFU


def test_training_time_gpt3_175b_is_about_34_days():
    seconds = training_time_seconds(tokens=300e9, parameters=175e9, num_gpus=1024, flops_per_gpu=140e12)
    assert seconds == pytest.approx(8 * 300e9 * 175e9 / (1024 * 140e12))
    assert abs(seconds / SECONDS_PER_DAY - 34) < 1


def test_training_time_1t_is_about_84_days():
    seconds = training_time_seconds(tokens=450e9, parameters=1e12, num_gpus=3072, flops_per_gpu=163e12)
    assert abs(seconds / SECONDS_PER_DAY - 84) < 1


def test_achieved_tflops_and_mfu():
    # 3.0e18 FLOPs in 10 s on 8 GPUs = 37.5e15 FLOP/s per GPU = 37500 TFLOP/s.
    assert achieved_tflops_per_gpu(flops_per_iteration=3.0e18, iteration_seconds=10.0, num_gpus=8) == pytest.approx(
        37_500.0
    )
    # 2.0e14 FLOPs in 1 s on 4 devices of 100e12 FLOP/s peak: 2e14 / 4e14 = 0.5.
    mfu = model_flops_utilization(
        flops_per_iteration=2.0e14, iteration_seconds=1.0, num_devices=4, peak_flops_per_device=100e12
    )
    assert mfu == pytest.approx(0.5)


def test_paper_throughput_row_is_consistent():
    # Table 1, 175B row: 1536 sequences of 2048 tokens, 1536 GPUs at 153 TFLOP/s per GPU
    # must take F / (1536 * 153e12) seconds per iteration; feeding that back returns 153.
    flops = gpt_flops_per_iteration(
        batch_size=1536, seq_length=2048, num_layers=96, hidden_size=12288, vocab_size=VOCAB
    )
    seconds = float(eq3(1536, 2048, 96, 12288, VOCAB)) / (1536 * 153e12)
    assert achieved_tflops_per_gpu(flops, seconds, 1536) == pytest.approx(153.0)
    mfu = model_flops_utilization(flops, seconds, 1536, 312e12)
    assert mfu == pytest.approx(153 / 312)


# --------------------------------------------------------------------------- model state


P_TOTAL = 8e9


@pytest.mark.parametrize(
    ("stage", "bytes_per_param"),
    [
        (0, 2 + 2 + 12),
        (1, 2 + 2 + 12 / 4),
        (2, 2 + (2 + 12) / 4),
        (3, (2 + 2 + 12) / 4),
    ],
)
def test_model_state_zero_stages(stage, bytes_per_param):
    got = model_state_bytes_per_rank(
        P_TOTAL, tensor_parallel_size=2, pipeline_parallel_size=4, data_parallel_size=4, zero_stage=stage
    )
    assert got == pytest.approx(P_TOTAL / (2 * 4) * bytes_per_param)


def test_model_state_defaults_are_16_bytes_per_param():
    assert model_state_bytes_per_rank(1000) == 16_000


def test_model_state_custom_split():
    # fp32 weights and grads with Adam moments: 4 + 4 + 8; ZeRO-1 over 2 ranks -> 8 + 4.
    got = model_state_bytes_per_rank(
        1000, data_parallel_size=2, zero_stage=1, bytes_per_param=16, weight_bytes=4, grad_bytes=4
    )
    assert got == 12_000


# --------------------------------------------------------------------------- activations


S, B, H, A, T = 2048, 1, 12288, 96, 8  # GPT-3 175B, as in Korthikanti et al.


def act(**kwargs):
    base = dict(seq_length=S, micro_batch_size=B, hidden_size=H, num_heads=A)
    return activation_bytes_per_layer(**{**base, **kwargs})


def test_activation_no_parallelism():
    # For GPT-3 175B, 5as/h = 5 * 96 * 2048 / 12288 = 80.
    assert act() == S * B * H * (34 + 80)


def test_activation_tensor_parallel():
    assert act(tensor_parallel_size=T) == pytest.approx(S * B * H * (10 + 24 / T + 80 / T))


def test_activation_sequence_parallel_is_exactly_one_over_t():
    assert act(tensor_parallel_size=T, sequence_parallel=True) == pytest.approx(act() / T)
    assert act(tensor_parallel_size=T, sequence_parallel=True) == pytest.approx(S * B * H * 114 / T)


def test_activation_selective_recompute():
    assert act(tensor_parallel_size=T, recompute="selective") == pytest.approx(S * B * H * 13)
    assert act(tensor_parallel_size=T, sequence_parallel=True, recompute="selective") == pytest.approx(
        S * B * H * 34 / T
    )
    assert act(recompute="selective") == S * B * H * 34


def test_activation_full_recompute_keeps_layer_input():
    assert act(tensor_parallel_size=T, recompute="full") == 2 * S * B * H
    assert act(tensor_parallel_size=T, sequence_parallel=True, recompute="full") == pytest.approx(2 * S * B * H / T)


def test_activation_ordering_for_gpt3():
    none, sel, full = (
        act(tensor_parallel_size=T, sequence_parallel=True, recompute=r) for r in (None, "selective", "full")
    )
    assert full < sel < none
    # Concrete sizes in GiB for one layer, one sequence: 114/8, 34/8 and 2/8 bytes x sbh.
    gib = 2**30
    assert none / gib == pytest.approx(2048 * 12288 * 114 / 8 / gib)
    assert round(none / gib, 3) == 0.334 and round(sel / gib, 3) == 0.1


# --------------------------------------------------------------------------- device peaks


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989),
        ("nvidia h200", 989),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("H100 SXM", 989),
    ],
)
def test_device_peak_bf16(name, tflops):
    assert device_peak_flops(name) == tflops * 1e12


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA A100-SXM4-40GB", "tf32", 156),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA H100 80GB HBM3", "fp32", 67),
        ("NVIDIA H100 PCIe", "tf32", 378),
        ("NVIDIA H100 PCIe", "fp32", 51),
        ("NVIDIA H200", "tf32", 494.5),
        ("NVIDIA H200", "fp32", 67),
        ("NVIDIA H200", "fp16", 989),
        ("NVIDIA H100 PCIe", "torch.bfloat16", 756),
        ("NVIDIA A100-SXM4-80GB", "BF16-mixed", 312),
    ],
)
def test_device_peak_other_dtypes(name, dtype, tflops):
    assert device_peak_flops(name, dtype=dtype) == pytest.approx(tflops * 1e12)


def test_peak_table_fp16_equals_bf16():
    assert all(row["fp16"] == row["bf16"] for row in PEAK_TFLOPS.values())


def test_device_peak_override_wins_even_for_unknown_device():
    assert device_peak_flops("Some Future GPU", override=2.5e15) == 2.5e15


@pytest.mark.parametrize("name", ["Tesla V100-SXM2-32GB", "NVIDIA H100 NVL", "cpu", ""])
def test_device_peak_unknown_device(name):
    with pytest.raises(ValueError, match=r"unknown device .*: pass peak_flops=\.\.\. \(FLOP/s\)"):
        device_peak_flops(name)


def test_device_peak_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        device_peak_flops("NVIDIA H200", dtype="int8")


def test_device_peak_bad_override():
    with pytest.raises(ValueError, match="override must be a positive number, got -1"):
        device_peak_flops("NVIDIA H200", override=-1)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpt_parameter_count(0, 8, 10, 4), r"num_layers must be a positive integer, got 0"),
        (lambda: gpt_parameter_count(2, 8.0, 10, 4), r"hidden_size must be a positive integer, got 8\.0"),
        (lambda: gpt_parameter_count(2, 8, True, 4), r"vocab_size must be a positive integer, got True"),
        (lambda: gpt_flops_per_iteration(-1, 4, 2, 8, 10), r"batch_size must be a positive integer, got -1"),
        (
            lambda: gpt_flops_per_iteration(1, 4, 2, 8, 10, activation_recompute="yes"),
            r"activation_recompute must be True or False, got 'yes'",
        ),
        (lambda: training_time_seconds(0, 1e9, 8, 1e14), r"tokens must be a positive number, got 0"),
        (lambda: training_time_seconds(1e9, 1e9, 0, 1e14), r"num_gpus must be a positive integer"),
        (
            lambda: model_state_bytes_per_rank(1e9, zero_stage=4),
            r"zero_stage must be one of \(0, 1, 2, 3\), got 4; use 0 for no sharding",
        ),
        (
            lambda: model_state_bytes_per_rank(1e9, tensor_parallel_size=0),
            r"tensor_parallel_size must be a positive integer, got 0; use 1 for no TP",
        ),
        (
            lambda: model_state_bytes_per_rank(1e9, bytes_per_param=3),
            r"bytes_per_param \(3\) must cover weight_bytes \(2\) \+ grad_bytes \(2\)",
        ),
        (lambda: act(recompute="partial"), r"recompute must be one of \(None, 'selective', 'full'\), got 'partial'"),
        (lambda: act(sequence_parallel=1), r"sequence_parallel must be True or False, got 1"),
        (lambda: act(num_heads=0), r"num_heads must be a positive integer, got 0"),
        (
            lambda: model_flops_utilization(1e15, 0, 8, 1e14),
            r"iteration_seconds must be a positive number, got 0; pass the measured",
        ),
        (lambda: achieved_tflops_per_gpu(1e15, 1.0, 0), r"num_gpus must be a positive integer, got 0"),
    ],
)
def test_invalid_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()
