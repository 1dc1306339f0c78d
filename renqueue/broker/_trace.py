"""The ``traceparent`` header on NATS messages: read it, and make each hop's span.

Every message about a request that one hop hands the next (the request's
publish, its dispatch, a request put back) carries the W3C ``traceparent``
header (:mod:`renqueue.schema._trace` parses and spells it). A hop reads the
header of what it received (:func:`trace_of`: ``None`` when missing or not
valid), makes its own span under that trace, or a new trace when there was
none (:func:`next_hop`), and sends that on (:func:`trace_headers`). Span and
trace ids are random (``secrets``), which is why this lives here and not in
the pure schema.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from ..schema import TRACEPARENT, TraceParent, parse_traceparent

__all__ = ["next_hop", "trace_headers", "trace_of"]


def trace_of(headers: Mapping[str, str] | None) -> TraceParent | None:
    """The valid ``traceparent`` of a message's ``headers``, else ``None``."""
    if not headers:
        return None
    return parse_traceparent(headers.get(TRACEPARENT))


def next_hop(parent: TraceParent | str | None) -> TraceParent:
    """This hop's span under ``parent``'s trace (a header value is validated
    first); a new trace when ``parent`` is ``None`` or not a valid one."""
    if isinstance(parent, str):
        parent = parse_traceparent(parent)
    span = _random_hex(8)
    if parent is None:
        return TraceParent(trace_id=_random_hex(16), parent_id=span)
    return parent.child(span)


def trace_headers(trace: TraceParent) -> dict[str, str]:
    """The header that carries ``trace`` on a NATS message."""
    return {TRACEPARENT: trace.header}


def _random_hex(size: int) -> str:
    """``size`` random bytes in hex, never all zeros (the spec's invalid id)."""
    while True:
        text = secrets.token_hex(size)
        if text.strip("0"):
            return text
