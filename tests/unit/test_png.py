"""The dependency-free PNG writer behind PipelineTimeline: what is drawn is what is read back."""

from __future__ import annotations

import pytest

from lightning_ptdp.callbacks.png import Canvas, read_png


def test_rectangles_text_and_title_round_trip():
    canvas = Canvas(40, 20)
    canvas.rect(5, 5, 15, 10, (200, 10, 10))
    canvas.text(20, 2, "F1", color=(0, 0, 255), scale=1)
    width, height, texts, rows = read_png(canvas.png("step 3: bubble 12.5%"))
    assert (width, height, texts) == (40, 20, {"Title": "step 3: bubble 12.5%"})
    pixel = lambda x, y: tuple(rows[y][3 * x : 3 * x + 3])  # noqa: E731
    assert pixel(5, 5) == pixel(14, 9) == (200, 10, 10)
    assert pixel(15, 9) == pixel(4, 5) == (255, 255, 255)
    assert pixel(20, 2) == (0, 0, 255) and pixel(21, 3) == (255, 255, 255)  # "F": top bar, then hollow


def test_a_corrupted_png_is_refused():
    data = bytearray(Canvas(4, 4).png())
    data[-20] ^= 0xFF
    with pytest.raises(ValueError, match="bad CRC"):
        read_png(bytes(data))
