"""Which failures blame the backend, not the request: one rule for the
fold's health counts, the circuits' and the A/B rollbacks'."""

from __future__ import annotations

from typing import Final

#: Error types that say the backend, not the request, is at fault. Only these
#: count towards the failure streak that makes a backend unhealthy. A 429
#: (``rate_limited``) means the backend is up and busy: the rate limiter's
#: business, not health's. ``backend_bad_request`` blames the request.
BACKEND_FAULTS: Final = frozenset({"backend_unavailable", "backend_fatal"})

#: Failure classes (``error_class``, :class:`renqueue.errors.FailureClass`)
#: that say the backend is at fault; an event with a class is judged by it
#: (a context too long, a content filter, a bad request, a 429, or a call
#: longer than ``total_timeout``, which its length may explain, say nothing
#: of the backend's health), one without (older events) by :data:`BACKEND_FAULTS`.
BACKEND_FAULT_CLASSES: Final = frozenset(
    {
        "connect",
        "connect_timeout",
        "first_token_timeout",
        "stall",
        "overloaded",
        "server_error",
        "malformed",
        "broken_stream",
        "unavailable",
    }
)


def is_backend_fault(error_type: str, error_class: str = "") -> bool:
    """Whether a failure blames the backend: by its class when it has one
    (:data:`BACKEND_FAULT_CLASSES`), else (older events) by its type (:data:`BACKEND_FAULTS`)."""
    return error_class in BACKEND_FAULT_CLASSES if error_class else error_type in BACKEND_FAULTS
