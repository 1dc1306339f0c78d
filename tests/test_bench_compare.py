"""``bench/compare.py``'s verdicts, on reports made up for the case (no run needed).

Added latency is the pipeline's minus a direct adapter call's: a faster adapter makes
it grow on the new side while every request got faster. compare must not call that
slower; it must still call a real end-to-end slowdown slower.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare() -> Iterator[ModuleType]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        yield importlib.import_module("compare")
    finally:
        sys.path.remove(str(REPO / "bench"))


def report(*, rps: float, added: float, latency: float) -> dict[str, Any]:
    """The parts of a ``pipeline.py`` report compare reads, at C=16."""
    return {
        "pipeline": {
            "levels": {
                "16": {
                    "requests_per_s": rps,
                    "latency": {"p50_ms": latency, "p99_ms": 2 * latency},
                    "python_cpu_ms_per_request": 1.5,
                }
            }
        },
        "analysis": {
            "levels": {"16": {"added_latency_ms": {"p50_ms": added, "p99_ms": 2 * added}}}
        },
        "broker": {
            "publish_async_windowed": {"msgs_per_s": 30_000.0},
            "publish_one_at_a_time": {
                "msgs_per_s": 4_000.0,
                "latency": {"p50_ms": 0.2, "p99_ms": 0.5},
            },
            "fetch100_ack": {"msgs_per_s": 16_000.0},
        },
    }


def runs(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"side": "old", "report": r} for r in old] + [{"side": "new", "report": r} for r in new]


def test_added_latency_grown_by_a_faster_direct_call_is_not_slower(compare: ModuleType) -> None:
    # Old: 30 ms end to end over a 10 ms direct call. New: 25 ms over a 2 ms one.
    old = [report(rps=500, added=20.0 + d, latency=30.0 + d) for d in (0.0, 0.2, 0.4)]
    new = [report(rps=600, added=23.0 + d, latency=25.0 + d) for d in (0.0, 0.2, 0.4)]
    table, _, _ = compare.summarise(runs(old, new), ["16"])
    for added in ("added_p50_ms", "added_p99_ms"):
        assert table["16"][added]["outcome"] == "baseline_moved", table["16"][added]["verdict"]
        assert "end-to-end" in table["16"][added]["verdict"]
    assert table["16"]["latency_p50_ms"]["outcome"] == "better"
    assert table["16"]["requests_per_s"]["outcome"] == "better"


def test_added_latency_is_slower_when_the_requests_are_slower_too(compare: ModuleType) -> None:
    old = [report(rps=500, added=20.0 + d, latency=30.0 + d) for d in (0.0, 0.2, 0.4)]
    new = [report(rps=400, added=26.0 + d, latency=36.0 + d) for d in (0.0, 0.2, 0.4)]
    table, _, _ = compare.summarise(runs(old, new), ["16"])
    for key in ("added_p50_ms", "added_p99_ms", "latency_p50_ms", "latency_p99_ms"):
        assert table["16"][key]["outcome"] == "slower", table["16"][key]["verdict"]
    assert table["16"]["requests_per_s"]["outcome"] == "slower"


def test_a_noisy_reading_within_its_band_is_no_worse(compare: ModuleType) -> None:
    old = [report(rps=r, added=20.0, latency=30.0) for r in (400, 500, 600)]
    new = [report(rps=r, added=20.0, latency=30.0) for r in (380, 480, 590)]
    table, _, _ = compare.summarise(runs(old, new), ["16"])
    assert table["16"]["requests_per_s"]["outcome"] == "no_worse"


def test_added_latency_slower_with_end_to_end_worse_within_its_band_stays_slower(
    compare: ModuleType,
) -> None:
    """A real regression: the direct call did not move, every request got ~3 ms slower.
    The end-to-end latency's wide band hides its 9 % rise ("no worse"), but no request
    got faster, so the added latency's rise is not a moved baseline: it is slower."""
    old = [report(rps=500, added=20.0 + d, latency=30.0 + 10 * d) for d in (0.0, 0.2, 0.4)]
    new = [report(rps=500, added=23.0 + d, latency=33.0 + 10 * d) for d in (0.0, 0.2, 0.4)]
    table, _, _ = compare.summarise(runs(old, new), ["16"])
    assert table["16"]["latency_p50_ms"]["outcome"] == "no_worse"  # within its band
    for added in ("added_p50_ms", "added_p99_ms"):
        assert table["16"][added]["outcome"] == "slower", table["16"][added]["verdict"]
