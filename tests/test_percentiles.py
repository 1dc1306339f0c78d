"""Percentiles in the demo and the benchmarks: statistics.quantiles, inclusive method."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from renqueue.demo import _percentile

REPO = Path(__file__).resolve().parents[1]


def _bench_percentile() -> Callable[[Sequence[float], int], float]:
    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered as it loads, as an import would: a dataclass in it looks its
    # module up by name (its string annotations are resolved there).
    sys.modules.setdefault("bench_common", module)
    spec.loader.exec_module(module)
    return module.percentile  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["demo", "bench"])
def percentile(request: pytest.FixtureRequest) -> Callable[[Sequence[float], int], float]:
    return _percentile if request.param == "demo" else _bench_percentile()


def test_p50_is_the_median(percentile: Callable[[Sequence[float], int], float]) -> None:
    for values in ([3.0, 1.0, 2.0], [4.0, 1.0, 3.0, 2.0], [float(i) for i in range(101)]):
        assert percentile(values, 50) == statistics.median(values)


def test_values_interpolate_between_the_closest_ranks(
    percentile: Callable[[Sequence[float], int], float],
) -> None:
    values = [float(i) for i in range(1, 101)]  # 1..100, unsorted below
    values.reverse()
    # Rank (n - 1) * p: the 0th percentile is the minimum, the 100th the maximum.
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([5.0, 5.0, 5.0], 99) == 5.0  # never outside the values seen


def test_one_value_and_no_values(percentile: Callable[[Sequence[float], int], float]) -> None:
    assert percentile([7.5], 99) == 7.5
    assert math.isnan(percentile([], 50))
