"""The gateway's Prometheus metrics. Labels are endpoint names, status codes and
route names from the config only: never ids, keys or tenants' free text."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["CALLS", "IN_FLIGHT", "LATENCY", "RETRIES_JOINED"]

CALLS = Counter(
    "renqueue_gateway_requests_total",
    "HTTP requests answered by the gateway, by endpoint and status",
    ["endpoint", "status"],
)
LATENCY = Histogram(
    "renqueue_gateway_request_seconds",
    "Time from a request's arrival to the end of its answer (a whole stream included)",
    ["endpoint"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge(
    "renqueue_gateway_in_flight", "Chat completions this gateway process is answering now"
)
RETRIES_JOINED = Counter(
    "renqueue_gateway_retries_joined_total",
    "Retries that joined the request they repeat instead of submitting another, by how "
    "they were recognised (idempotency_key, sdk_retry)",
    ["how"],
)
