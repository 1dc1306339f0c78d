"""The cluster-wide series, as tests of deploy/ read them: each one's type and
label names, from the exporter's own list (:data:`renqueue.coordination.CLUSTER_SERIES`,
which tests/test_metrics_docs.py checks against docs/metrics.md and a scrape).

Histograms are named without their ``_bucket``/``_sum``/``_count`` suffixes.
"""

from __future__ import annotations

from typing import Final

from renqueue.coordination import CLUSTER_SERIES as _EXPORTED

CLUSTER_SERIES: Final[dict[str, tuple[str, frozenset[str]]]] = {
    series.name: (series.kind, frozenset(series.labels)) for series in _EXPORTED
}

#: Series every Prometheus makes of its own for each target.
SCRAPE_SERIES: Final[dict[str, frozenset[str]]] = {"up": frozenset({"job", "instance"})}

_HISTOGRAM_PARTS: Final = ("_bucket", "_sum", "_count")


def series_of(sample_name: str) -> str | None:
    """The cluster series a sample name belongs to (a histogram's ``_bucket``
    is its histogram's); ``None`` when it is none of them."""
    if sample_name in CLUSTER_SERIES:
        return sample_name
    for part in _HISTOGRAM_PARTS:
        base = sample_name.removesuffix(part)
        if base != sample_name and CLUSTER_SERIES.get(base, ("", None))[0] == "histogram":
            return base
    return None


def labels_of(sample_name: str) -> frozenset[str]:
    """The label names a sample of the cluster series (or Prometheus's ``up``) may carry."""
    if sample_name in SCRAPE_SERIES:
        return SCRAPE_SERIES[sample_name]
    series = series_of(sample_name)
    if series is None:
        return frozenset()
    labels = CLUSTER_SERIES[series][1]
    return labels | {"le"} if sample_name.endswith("_bucket") else labels
