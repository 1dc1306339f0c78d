"""The ``traceparent`` header on NATS messages: read it, and make each hop's span.

Every message about a request that one hop hands the next (the request's
publish, its dispatch, a request put back) carries the W3C ``traceparent``
header (:mod:`renqueue.schema._trace` parses and spells it). A hop reads the
header of what it received (:func:`trace_of`: ``None`` when missing or not
valid), makes its own span under that trace, or a new trace when there was
none (:func:`next_hop`, or :func:`hop` for a span with a duration), and sends
that on (:func:`trace_headers`). Span and trace ids are random (``os.urandom``),
which is why this lives here and not in the pure schema.

Export is off by default. :func:`export_spans` turns it on for the process:
each :func:`hop` is then an OpenTelemetry span (the ``otel`` extra,
``opentelemetry-api`` and ``-sdk``; imported only then), whose ids are the
ones sent on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

from ..errors import ConfigError
from ..schema import TRACEPARENT, TraceParent, parse_traceparent

if TYPE_CHECKING:
    from ._otel import OtelSpans

__all__ = ["SpanKind", "export_spans", "hop", "next_hop", "trace_headers", "trace_of"]

#: What a hop is to its span's reader (OpenTelemetry's span kinds).
SpanKind = Literal["producer", "consumer", "client", "internal"]

#: The exporter of hops' spans, when :func:`export_spans` turned it on.
_spans: OtelSpans | None = None


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


@contextmanager
def hop(
    name: str,
    parent: TraceParent | str | None,
    *,
    kind: SpanKind = "internal",
    attributes: Mapping[str, str | int] | None = None,
) -> Iterator[TraceParent]:
    """This hop's span under ``parent`` (as :func:`next_hop`) for the block;
    yields the ``traceparent`` to send on. Exported as an OpenTelemetry span
    named ``name`` with ``attributes`` when :func:`export_spans` is on (an
    error leaving the block marks it failed, with the error's type alone)."""
    if isinstance(parent, str):
        parent = parse_traceparent(parent)
    if _spans is None:
        yield next_hop(parent)
        return
    with _spans.span(name, parent, kind=kind, attributes=attributes or {}) as sent:
        yield next_hop(parent) if sent is None else sent


def export_spans(tracer_provider: object | None = None, *, enabled: bool = True) -> None:
    """Export every hop of this process as an OpenTelemetry span, through
    ``tracer_provider`` (an ``opentelemetry.trace.TracerProvider``; the global
    one if ``None``); ``enabled=False`` turns it off again. Needs the ``otel``
    extra (``pip install renqueue[otel]``): :class:`~renqueue.errors.ConfigError`
    without it."""
    global _spans  # noqa: PLW0603 - one switch for the process, as OpenTelemetry's own provider
    if not enabled:
        _spans = None
        return
    try:
        from ._otel import OtelSpans  # noqa: PLC0415 - opentelemetry only when asked for
    except ImportError as exc:
        raise ConfigError(
            "span export needs OpenTelemetry: pip install 'renqueue[otel]'", path="export_spans"
        ) from exc
    _spans = OtelSpans(tracer_provider)  # type: ignore[arg-type] # checked by opentelemetry


def trace_headers(trace: TraceParent) -> dict[str, str]:
    """The header that carries ``trace`` on a NATS message."""
    return {TRACEPARENT: trace.header}


def _random_hex(size: int) -> str:
    """``size`` random bytes in hex, never all zeros (the spec's invalid id).
    What ``secrets.token_hex`` returns, without its two calls (four ids a request)."""
    while True:
        text = os.urandom(size).hex()
        if text.strip("0"):
            return text
