"""Prometheus metrics. Labels are backend, route and priority names only: never ids or keys."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "BACKEND_CALLS",
    "BACKEND_LATENCY",
    "BINDING",
    "COST",
    "DUPLICATES_DROPPED",
    "ENDED_RESUBMITS",
    "FORWARDED",
    "FORWARD_DUPLICATES",
    "FORWARD_REJECTED",
    "FORWARD_RETRIES",
    "IN_FLIGHT",
    "MISDIRECTED",
    "QUEUE_WAIT",
    "REJECTED",
    "ROUTED",
    "TERMINAL",
    "TOKENS",
]

ROUTED = Counter("renqueue_routed_total", "Routing decisions made", ["backend", "priority"])
REJECTED = Counter(
    "renqueue_rejected_total", "Requests rejected as invalid, by error type", ["error_type"]
)
TERMINAL = Counter("renqueue_terminal_total", "Requests that reached a terminal state", ["kind"])
BINDING = Gauge(
    "renqueue_router_binding",
    "1 while the router holds the binder's lease and binds requests, else 0",
    ["router"],
)
QUEUE_WAIT = Histogram(
    "renqueue_queue_wait_seconds",
    "Time from submit to routing decision",
    ["priority"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
#: This process's workers' calls (the cluster's are ``renqueue_backend_calls_total``,
#: from the exporter: docs/metrics.md).
BACKEND_CALLS = Counter(
    "renqueue_worker_calls_total",
    "Backend calls made by this process's workers, by outcome (completed, or the error's code)",
    ["backend", "outcome"],
)
BACKEND_LATENCY = Histogram(
    "renqueue_backend_call_seconds",
    "Duration of a backend call",
    ["backend"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TOKENS = Counter(
    "renqueue_tokens_total", "Tokens by backend and direction", ["backend", "direction"]
)
COST = Counter("renqueue_cost_dollars_total", "Spend in US dollars", ["backend"])
IN_FLIGHT = Gauge("renqueue_worker_in_flight", "Requests being served by this process", ["backend"])
DUPLICATES_DROPPED = Counter(
    "renqueue_duplicate_completions_total",
    "Completions dropped because the request already had a terminal event",
    ["backend"],
)
ENDED_RESUBMITS = Counter(
    "renqueue_ended_resubmits_total",
    "Requests a router did not admit because their id had already ended, by level",
    ["priority"],
)
MISDIRECTED = Counter(
    "renqueue_misdirected_messages_total",
    "Messages dropped because their subject is not one the receiver subscribed for, "
    "or disagrees with their payload (see renqueue.schema), by receiver",
    ["receiver"],
)
FALLBACKS = Counter(
    "renqueue_fallbacks_total",
    "Requests a backend failed that went back to routing for another candidate, "
    "by the backend that failed and the failure's class",
    ["backend", "error_class"],
)
COST_CAP_OVERRUNS = Counter(
    "renqueue_cost_cap_overruns_total",
    "Calls whose real cost exceeded their request's max_cost (bound within it by the estimate)",
    ["backend"],
)
AB_PLACED = Counter(
    "renqueue_ab_placed_total",
    "Requests of a route with an A/B split placed on one of its arms by the binder",
    ["route", "arm"],
)
AB_ROLLBACKS = Counter(
    "renqueue_ab_rollbacks_total",
    "Automatic rollbacks of an A/B split to its control arm, decided by this binder",
    ["route"],
)
#: The forwarder's (binding split in groups: renqueue/services/router/_forward.py).
FORWARDED = Counter(
    "renqueue_forwarded_total",
    "Requests sent without their route that this router's forwarder stored under it "
    "(binding split in groups), by route and level",
    ["route", "priority"],
)
FORWARD_REJECTED = Counter(
    "renqueue_forward_rejected_total",
    "Requests sent without their route that this router's forwarder refused and "
    "dead-lettered instead of forwarding, by error type",
    ["error_type"],
)
FORWARD_RETRIES = Counter(
    "renqueue_forward_retries_total",
    "Requests (or put-backs) this router's forwarder handed back to be tried again, "
    "their copy not stored, by kind and the error's code",
    ["kind", "reason"],
)
FORWARD_DUPLICATES = Counter(
    "renqueue_forward_duplicates_total",
    "Forwarded copies JetStream called duplicates, checked by this router's forwarder, "
    "by what the check found",
    ["outcome"],
)
