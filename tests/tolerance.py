"""Value tolerances that follow the dtype: what rounding can change when the same sums run in another
order, sized by the dtype's resolution at the values' magnitude rather than by a fixed absolute number."""

from __future__ import annotations

import torch

# A sum taken in another order moves its result by a few units of eps at the size of its terms, even
# where the result is small: measured 2.7 (logits at c2, test_context_parallel.py) and 6 (256 terms added
# one by one).
REORDERED_SUMS = 16.0


def reordered_sum_tolerance(
    expected: torch.Tensor, *, factor: float = REORDERED_SUMS, dtype: torch.dtype | None = None
) -> dict[str, float]:
    """``torch.testing.assert_close``'s ``atol`` and ``rtol`` for values whose sums ran in another order:
    ``factor`` x eps x the largest magnitude of ``expected``, for every element (a small logit is the sum
    of large terms too). ``dtype``: the arithmetic's, where the values were cast afterwards (fp32 logits
    of bf16 matmuls); ``expected``'s own by default."""
    eps = torch.finfo(dtype or expected.dtype).eps
    magnitude = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return {"atol": factor * eps * magnitude, "rtol": 0.0}
