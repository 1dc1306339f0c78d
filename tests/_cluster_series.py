"""The cluster-wide series of issue 27's metrics contract: what the exporter
(`renqueue exporter`) serves, and all that deploy/prometheus/rules.yml and
deploy/grafana/dashboards/ may read.

Each series: its type and its label names. Histograms are named without their
``_bucket``/``_sum``/``_count`` suffixes. docs/metrics.md is the contract for
readers; this table is the same list for the tests of deploy/ (and what the
stand-in exporter of tests/test_prometheus_live.py serves).
"""

from __future__ import annotations

from typing import Final, Literal

Kind = Literal["gauge", "counter", "histogram"]

CLUSTER_SERIES: Final[dict[str, tuple[Kind, frozenset[str]]]] = {
    name: (kind, frozenset(labels))
    for name, kind, labels in [
        ("renqueue_level_waiting_requests", "gauge", ["level"]),
        ("renqueue_level_oldest_wait_seconds", "gauge", ["level"]),
        ("renqueue_level_aging_bound_seconds", "gauge", ["level"]),
        ("renqueue_backend_up", "gauge", ["backend"]),
        ("renqueue_backend_circuit_state", "gauge", ["backend", "state"]),
        ("renqueue_backend_slots_in_use", "gauge", ["backend"]),
        ("renqueue_backend_slots_limit", "gauge", ["backend"]),
        ("renqueue_backend_quota_used", "gauge", ["backend", "window", "unit"]),
        ("renqueue_backend_quota_limit", "gauge", ["backend", "window", "unit"]),
        ("renqueue_backend_quota_remaining_ratio", "gauge", ["backend", "window", "unit"]),
        ("renqueue_backend_quota_reset_timestamp_seconds", "gauge", ["backend", "window", "unit"]),
        ("renqueue_backend_learned_limit", "gauge", ["backend", "window", "unit"]),
        ("renqueue_backend_calls_total", "counter", ["backend", "outcome"]),
        ("renqueue_backend_faults_total", "counter", ["backend"]),
        ("renqueue_backend_rate_limited_total", "counter", ["backend"]),
        ("renqueue_backend_spend_dollars_total", "counter", ["backend"]),
        ("renqueue_backend_ttft_seconds", "histogram", ["backend"]),
        ("renqueue_backend_duration_seconds", "histogram", ["backend"]),
        ("renqueue_tenant_spend_today_dollars", "gauge", ["tenant"]),
        ("renqueue_tenant_budget_dollars", "gauge", ["tenant", "kind"]),
        ("renqueue_dlq_messages", "gauge", []),
        ("renqueue_ab_arm_requests_total", "counter", ["route", "arm"]),
        ("renqueue_ab_arm_failures_total", "counter", ["route", "arm"]),
        ("renqueue_binder_term", "gauge", []),
        ("renqueue_binder_present", "gauge", []),
        ("renqueue_projection_lag_events", "gauge", []),
        ("renqueue_projection_lag_seconds", "gauge", []),
    ]
}

#: Series every Prometheus makes of its own for each target.
SCRAPE_SERIES: Final[dict[str, frozenset[str]]] = {"up": frozenset({"job", "instance"})}

_HISTOGRAM_PARTS: Final = ("_bucket", "_sum", "_count")


def series_of(sample_name: str) -> str | None:
    """The contract series a sample name belongs to (a histogram's ``_bucket``
    is its histogram's); ``None`` when it is none of them."""
    if sample_name in CLUSTER_SERIES:
        return sample_name
    for part in _HISTOGRAM_PARTS:
        base = sample_name.removesuffix(part)
        if base != sample_name and CLUSTER_SERIES.get(base, ("", None))[0] == "histogram":
            return base
    return None


def labels_of(sample_name: str) -> frozenset[str]:
    """The label names a sample of the contract (or Prometheus's ``up``) may carry."""
    if sample_name in SCRAPE_SERIES:
        return SCRAPE_SERIES[sample_name]
    series = series_of(sample_name)
    if series is None:
        return frozenset()
    labels = CLUSTER_SERIES[series][1]
    return labels | {"le"} if sample_name.endswith("_bucket") else labels
