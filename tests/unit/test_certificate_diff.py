"""The plan certificate's search for the first op that differs: a rank's share compared slice by
slice with the whole output, and the op found by walking back from the block's output."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.parallel.certificate import PlanCertificateError, WholeBlock, certify
from lightning_ptdp.parallel.certificate_diff import agreed_first, agrees, first_difference

TOLERANCE = 1e-4


def test_a_share_agrees_when_each_of_its_slices_is_some_slice_of_the_whole():
    whole = torch.randn(2, 8, 3, 4)  # [batch, sequence, heads, head_dim]
    assert agrees(whole + 1e-6, whole, TOLERANCE) is True
    assert agrees(whole * 1.01, whole, TOLERANCE) is False
    assert agrees(whole[:, [0, 1, 6, 7]], whole, TOLERANCE) is True  # CP's load-balanced chunks 0 and 3
    assert agrees(whole[:, :, 1:2], whole, TOLERANCE) is True  # TP: this rank's head
    wrong = whole[:, [0, 1, 6, 7]].clone()
    wrong[:, 2] *= 1.5  # one token's values at another position's
    assert agrees(wrong, whole, TOLERANCE) is False
    assert agrees(whole[:, :4, :1], whole, TOLERANCE) is None  # two dims differ: nothing to compare
    assert agrees(whole[0], whole, TOLERANCE) is None


def test_masks_compare_with_their_infinities():
    mask = torch.full((4, 4), float("-inf")).triu(1)
    assert agrees(mask[2:], mask, TOLERANCE) is True
    wrong = mask[:2].clone()
    wrong[0, 3] = 0.0  # a row the whole mask does not have
    assert agrees(wrong, mask, TOLERANCE) is False
    assert agrees(torch.zeros(4, 4), mask, TOLERANCE) is False


class Net(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.sum(1) * self.scale  # differs first, but never reaches the output
        h = torch.tanh(x)
        h = h * self.scale  # the first op that differs on the way to the output
        return h + total.mean() * 0


def test_the_first_op_that_differs_is_the_earliest_on_the_way_to_the_output():
    x = torch.randn(2, 8, 4)
    found = first_difference(lambda: Net(1.0)(x), lambda: Net(2.0)(x), TOLERANCE)
    text = agreed_first(found)  # no process group: this process's answer
    assert text is not None and text.startswith("mul at ") and "test_certificate_diff.py" in text
    assert text.endswith("(h = h * self.scale  # the first op that differs on the way to the output)")


def test_a_correct_share_has_no_op_that_differs():
    x = torch.randn(2, 8, 4)
    assert first_difference(lambda: Net(1.0)(x), lambda: Net(1.0)(x[:, 4:]), TOLERANCE) is None


def test_the_refusal_names_the_first_op_that_differs():
    whole = WholeBlock("blocks.0", [Net(2.0)], 0, Net(1.0), (torch.randn(2, 8, 4),), {})
    with pytest.raises(PlanCertificateError, match=r"off by .*; the first op that differs: mul at .*\(h = h \* self"):
        certify([whole], "the layout t=2")
