"""Data parallelism (t = p = 1) against the single-process reference."""

from __future__ import annotations

import pytest

from tests.fit_utils import assert_matches_reference, fit_and_record

STEPS = 20
GLOBAL_BATCH = 8
# fp32; the only difference from the reference is summation order (gradient all-reduce, per-rank
# batch means), ~1e-7 relative per operation. Measured: losses ~1e-7, gradients <1e-6 and final
# weights ~1e-6 of their 20-step update. A wrong or missing dp average is off by a factor of d
# in the gradient and changes losses in the 2nd-3rd digit within a few steps.
LOSS_RTOL = 1e-5
GRAD_REL = 1e-5
UPDATE_REL = 1e-4  # Adam divides by sqrt(v): round-off in small gradients shows up 10-100x larger
# The key projection's bias gets an exactly-zero gradient in exact arithmetic (adding a constant
# to every score of a query row leaves its softmax unchanged), so AdamW turns round-off noise into
# +-lr steps that no two summation orders share and that cannot change a loss. Left out of the
# gradient and weight comparisons; every loss is still compared.
NOISE_DRIVEN = ("attn.key.bias",)

_reference_cache: dict[str, dict] = {}


def reference(family: str) -> dict:
    if family not in _reference_cache:
        _reference_cache[family] = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    return _reference_cache[family]


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_dp_matches_single_process(dist_pool, family, dp):
    results = dist_pool(dp).run(
        fit_and_record, family, strategy_kwargs={}, devices=dp, steps=STEPS, global_batch=GLOBAL_BATCH
    )
    ref = reference(family)
    for result in results:
        assert_matches_reference(
            result, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
        )
    # the reference really trained: a run that never stepped would "match" a broken one
    assert ref["losses"][-1] < ref["losses"][0] - 0.1
