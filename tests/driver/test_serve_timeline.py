"""The serving timeline's reduction (bench/serve_timeline.py): busy time, gaps, the host range each gap is given."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from serve_timeline import STEP, Span, busy, reduce  # noqa: E402

US = 1000  # nanoseconds


def test_busy_joins_overlapping_spans() -> None:
    spans = [Span("a", 0, 10), Span("b", 5, 20), Span("c", 30, 40), Span("d", 40, 41)]
    assert busy(spans) == [(0, 20), (30, 41)]


def test_each_gap_goes_to_the_innermost_host_range_at_its_middle() -> None:
    device = [Span("k1", 0, 100 * US), Span("k2", 150 * US, 400 * US), Span("k3", 405 * US, 500 * US)]
    host = [Span(STEP, 0, 300 * US), Span(STEP, 300 * US, 700 * US),
            Span("engine._launch", 90 * US, 200 * US), Span("engine._inputs", 95 * US, 160 * US),
            Span("ahead.settle", 600 * US, 650 * US)]
    out = reduce(device, host, steps=2, min_gap_us=20)
    assert out["window_ms"] == 0.7 and out["device_busy_ms"] == 0.445
    assert out["idle_ms"] == 0.255
    # 100-150 us: _inputs is innermost at 125; 400-405 is under the minimum; 500-700: middle 600 is in settle
    assert out["gaps_over_min_ms"] == {"ahead.settle": 0.2, "engine._inputs": 0.05}
    assert out["host_inclusive_ms"][STEP] == 0.7


def test_a_gap_outside_every_range_is_named_so() -> None:
    device = [Span("k", 0, 10 * US), Span("k", 200 * US, 210 * US)]
    out = reduce(device, [Span(STEP, 0, 210 * US)], steps=1)
    assert out["gaps_over_min_ms"] == {STEP: 0.19}
    assert reduce(device, [], steps=0) == {"error": "no step ranges recorded"}
