"""W3C trace context: the ``traceparent`` a request carries from hop to hop.

A ``traceparent`` (https://www.w3.org/TR/trace-context/) is
``<version>-<trace id>-<parent id>-<flags>``: 2, 32, 16 and 2 lowercase hex
digits (``00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01``). The trace
id names the whole request's trace; the parent id is the span of the hop that
sent the message; each hop sends its own span id under the same trace id.

Reading one is strict, since a client writes it: anything that is not a
well-formed ``traceparent`` (upper case, a trace or parent id of zeros,
version ``ff``, a version ``00`` with more after it, anything over
:data:`MAX_TRACEPARENT` characters) is ``None``, and the hop starts a new trace
instead. What is forwarded is always written anew from the parsed parts
(:attr:`TraceParent.header`, version ``00``, the sampled flag alone), never
the text as received.
Making span ids takes randomness, which is not this pure module's:
``renqueue.broker`` makes them.
"""

from __future__ import annotations

import re
from typing import Final

from msgspec import Struct

__all__ = ["MAX_TRACEPARENT", "TRACEPARENT", "TraceParent", "parse_traceparent"]

#: The header (NATS and HTTP) that carries it.
TRACEPARENT: Final = "traceparent"
#: The longest header read at all (a future version may append fields; the
#: first 55 characters are version 00's).
MAX_TRACEPARENT: Final = 512

#: Version, trace id, parent id and flags (lowercase hex), then what a later
#: version may add after a dash (anything: only its first 55 characters are read).
_SHAPE: Final = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL
)
_SPAN_ID: Final = re.compile(r"[0-9a-f]{16}")
_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16


class TraceParent(Struct, frozen=True, kw_only=True):
    """A parsed ``traceparent``: the trace, the span of the hop that sent it, the flags."""

    #: 32 lowercase hex digits, not all zeros.
    trace_id: str
    #: 16 lowercase hex digits, not all zeros: the sending hop's span.
    parent_id: str
    #: ``01`` (sampled) or ``00``: the one flag version 00 defines.
    flags: str = "01"

    @property
    def header(self) -> str:
        """The ``traceparent`` header value (version ``00``)."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    def child(self, span_id: str) -> TraceParent:
        """The same trace, sent by the hop whose span is ``span_id``."""
        if _SPAN_ID.fullmatch(span_id) is None or span_id == _ZERO_SPAN:
            raise ValueError(f"a span id is 16 lowercase hex digits, not all zeros: {span_id!r}")
        return TraceParent(trace_id=self.trace_id, parent_id=span_id, flags=self.flags)


def parse_traceparent(value: object) -> TraceParent | None:
    """``value`` as a :class:`TraceParent`, or ``None`` if it is not a valid one.

    Never raises: any value (not a string, too long, malformed) is ``None``.
    """
    if not isinstance(value, str) or len(value) > MAX_TRACEPARENT:
        return None
    shape = _SHAPE.fullmatch(value.strip(" \t"))
    if shape is None:
        return None
    version, trace_id, parent_id, flags, more = shape.groups()
    # Version ff is invalid; only a later version than 00 may add fields.
    if version == "ff" or (more is not None and version == "00"):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    # Only the flag this version defines (sampled) is carried on.
    sampled = "01" if int(flags, 16) & 1 else "00"
    return TraceParent(trace_id=trace_id, parent_id=parent_id, flags=sampled)
