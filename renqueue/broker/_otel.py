"""Each hop's span exported through OpenTelemetry: the ``otel`` extra, off by default.

Imported only by :func:`renqueue.broker.export_spans`: without that call (and
without the extra installed) nothing in Ren-Queue imports ``opentelemetry``.
A hop's span is started under the ``traceparent`` it received (a remote
parent), its ids are the ones the hop sends on, and it ends when the hop's
work does; what it records is the request's id, tenant and the hop's own
facts (never a prompt, a key or an answer; of an error, its type alone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TracerProvider,
)

from ..schema import TraceParent

__all__ = ["OtelSpans"]

#: The span kinds the hops use, by name (callers need not import opentelemetry).
_KINDS = {
    "producer": SpanKind.PRODUCER,
    "consumer": SpanKind.CONSUMER,
    "client": SpanKind.CLIENT,
    "internal": SpanKind.INTERNAL,
}


class OtelSpans:
    """Starts and ends hops' spans on an OpenTelemetry tracer."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("renqueue", tracer_provider=provider)

    @contextmanager
    def span(
        self,
        name: str,
        parent: TraceParent | None,
        *,
        kind: str,
        attributes: Mapping[str, str | int],
    ) -> Iterator[TraceParent | None]:
        """A span ``name`` under ``parent`` (a new trace if ``None``) for the
        block; yields the ``traceparent`` it sends on, ``None`` when the
        tracer records nothing (no SDK provider: the caller makes its own)."""
        context = None
        if parent is not None:
            remote = SpanContext(
                trace_id=int(parent.trace_id, 16),
                span_id=int(parent.parent_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(int(parent.flags, 16)),
            )
            context = trace.set_span_in_context(NonRecordingSpan(remote))
        span = self._tracer.start_span(
            name, context=context, kind=_KINDS[kind], attributes=dict(attributes)
        )
        ids = span.get_span_context()
        sent = None
        if ids.is_valid:
            flags = "01" if ids.trace_flags.sampled else "00"
            sent = TraceParent(
                trace_id=f"{ids.trace_id:032x}", parent_id=f"{ids.span_id:016x}", flags=flags
            )
        try:
            yield sent
        except asyncio.CancelledError:
            span.add_event("cancelled")  # a preemption or a shutdown: not a failure
            raise
        except BaseException as exc:
            # The error's type, not its message or traceback: what a backend
            # answered may quote the request, and spans leave the process.
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()
