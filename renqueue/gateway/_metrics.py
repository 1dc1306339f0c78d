"""The gateway's Prometheus metrics. Labels are endpoint names, status codes and
route names from the config only: never ids, keys or tenants' free text."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "CALLS",
    "CONNECTIONS",
    "DROPPED",
    "IN_FLIGHT",
    "LATENCY",
    "REJECTED",
    "RETRIES_JOINED",
    "of_call",
]

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
REJECTED = Counter(
    "renqueue_gateway_rejected_total",
    "Requests the gateway refused with a 4xx answer, by its error code (docs/gateway.md's "
    "table; a code it does not know is counted as other), the HTTP parser's refusals and "
    "header time-outs included",
    ["reason"],
)
DROPPED = Counter(
    "renqueue_gateway_dropped_total",
    "Calls and connections that ended without an answer, by why: disconnected (the client "
    "went away, or the gateway stopped, during a call), slow_reader (dropped by send_timeout: "
    "it stopped reading its answer), incomplete_request (closed in the "
    "middle of a request's headers), no_request (closed without sending a byte)",
    ["reason"],
)
CONNECTIONS = Gauge("renqueue_gateway_connections", "HTTP connections open to this gateway process")

#: The children of CALLS and LATENCY by (endpoint, status), made once: ``labels()``
#: takes a lock and builds a key on every call. Both labels are bounded (route
#: patterns and HTTP statuses), so this is too.
_CHILDREN: Final[dict[tuple[str, int], tuple[Counter, Histogram]]] = {}


def of_call(endpoint: str, status: int) -> tuple[Counter, Histogram]:
    """The ``CALLS`` and ``LATENCY`` series an answer of ``status`` on ``endpoint`` counts in."""
    children = _CHILDREN.get((endpoint, status))
    if children is None:
        children = _CHILDREN[endpoint, status] = (
            CALLS.labels(endpoint, str(status)),
            LATENCY.labels(endpoint),
        )
    return children
