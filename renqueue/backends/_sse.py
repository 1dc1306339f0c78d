"""Server-sent events: an incremental parser of ``text/event-stream`` bodies.

It follows the WHATWG HTML "event stream interpretation" rules
(https://html.spec.whatwg.org/multipage/server-sent-events.html):

- The body is UTF-8 (whatever the ``charset`` says); invalid bytes become
  U+FFFD; one leading byte-order mark is dropped.
- Lines end with CRLF, LF or CR, and a CRLF split across two reads is still
  one line ending.
- ``field: value`` (one space after the colon dropped). ``event`` sets the
  event type, ``data`` lines are joined with ``\\n``, ``id`` sets the last
  event id (not if it holds NUL; it persists across events), ``retry`` takes
  ASCII digits only. Lines starting with ``:`` are comments (keep-alives);
  unknown fields are ignored; a line with no colon is a field with an empty
  value.
- A blank line dispatches the event, if it has data: an event of only
  ``event:``/``id:`` lines is not dispatched (its type is reset). The type
  defaults to ``message``.

Two choices of our own, beyond the spec:

- **The end of the body.** The spec drops an event whose blank line never
  came. :meth:`SSEDecoder.finish` still parses the last, unterminated line and
  returns that incomplete event, so that the caller decides: the OpenAI
  adapter accepts only a bare ``[DONE]`` there (servers that close right
  after it), and drops anything else, as the spec says.
- **A bound.** A line, and an event's data, may not exceed ``max_event_bytes``
  (4 MiB by default, far above any real chunk: a whole long answer in one
  event fits): past it :class:`SSEError` is raised, so a broken or hostile
  server cannot grow our memory without limit.

Why not ``httpx-sse``: its public API yields one event at a time from the
response, hiding where one network read ends and the next begins, and the
adapter turns everything that arrived in one read into one delta (one publish
downstream, bench/README.md); its incremental decoders are private
(``httpx_sse._decoders``). It also dispatches data-less events, keeps no
bound on a line, and keeps no BOM rule. The design card fixes the runtime
dependencies, and this module is small and tested byte by byte
(tests/test_sse.py).

:meth:`SSEDecoder.feed` takes bytes as they arrive and returns the events
they complete; nothing waits for more input than the current line needs.
"""

from __future__ import annotations

from typing import Final

from msgspec import Struct

__all__ = ["MAX_EVENT_BYTES", "SSEDecoder", "SSEError", "ServerSentEvent"]

#: Default bound on one line, and on one event's data, in bytes.
MAX_EVENT_BYTES: Final = 4 * 1024 * 1024

_BOM: Final = b"\xef\xbb\xbf"


class SSEError(ValueError):
    """The stream broke a bound: a line or an event larger than allowed."""


class ServerSentEvent(Struct, frozen=True, kw_only=True, gc=False):
    """One dispatched event.

    ``id`` is the last event id seen so far in the stream (the spec's "last
    event ID", which outlives the event that set it); ``retry`` is the
    reconnection time in milliseconds the stream last asked for, if any.
    """

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


class SSEDecoder:
    """Parses one event stream, fed in pieces as they come off the network."""

    __slots__ = (
        "_cr_ended",
        "_data",
        "_data_bytes",
        "_event",
        "_last_id",
        "_max",
        "_pending",
        "_pending_bytes",
        "_retry",
        "_started",
    )

    def __init__(self, *, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._pending: list[bytes] = []  # an incomplete line, waiting for its line ending
        self._pending_bytes = 0
        self._cr_ended = False  # the last piece ended in CR: a LF next belongs to it
        self._started = False  # past the position of a byte-order mark
        self._event = ""
        self._data: list[str] = []
        self._data_bytes = 0
        self._last_id = ""
        self._retry: int | None = None

    @property
    def last_event_id(self) -> str:
        return self._last_id

    @property
    def retry(self) -> int | None:
        """The reconnection time (ms) the stream asked for, or ``None``."""
        return self._retry

    def feed(self, piece: bytes) -> list[ServerSentEvent]:
        """Take the next bytes of the body; return the events they complete, in order.

        Raises :class:`SSEError` when a line or an event outgrows the bound.
        """
        buffer = self._lines_of(piece)
        if buffer is None:
            return []
        events: list[ServerSentEvent] = []
        limit = self._max
        for line in self._split(buffer):
            if line[:5] == b"data:" and len(line) <= limit:
                # The line nearly every event is made of, read here (as _line reads it).
                self._data_bytes += len(line)
                if self._data_bytes > limit:
                    raise SSEError(f"event-stream event larger than {limit} bytes")
                value = line[6:] if line[5:6] == b" " else line[5:]
                self._data.append(value.decode("utf-8", "replace"))
            elif not line:
                # The blank line that ends nearly every event (as _line reads it).
                if self._data:
                    events.append(self._dispatch())
                else:
                    self._event = ""
            else:
                event = self._line(line)
                if event is not None:
                    events.append(event)
        return events

    def finish(self) -> ServerSentEvent | None:
        """The body ended: the event under way, whose blank line never came, or ``None``.

        The spec discards that event; it is returned so the caller can decide
        (see the module docstring). The last line is parsed even without its
        line ending. The decoder is then ready for a new stream; the last
        event id and retry are kept (they belong to the connection's history).
        """
        line = b"".join(self._pending)
        if not self._started:
            line = line.removeprefix(_BOM)
        self._pending = []
        self._pending_bytes = 0
        self._cr_ended = False
        self._started = False
        if line:
            self._line(line)  # never dispatches: only a blank line does
        if not self._data:
            self._event = ""
            return None
        return self._dispatch()

    # -- internals ----------------------------------------------------------

    def _lines_of(self, piece: bytes) -> bytes | None:
        """``piece`` with what was kept of an incomplete line before it, if a
        line ends in it; else ``None`` (the piece kept, waiting for a line end)."""
        if not piece:
            return None
        if self._cr_ended:
            self._cr_ended = False
            if piece[0] == 0x0A:  # the LF of a CRLF split between two reads
                piece = piece[1:]
                if not piece:
                    return None
        if b"\n" not in piece and b"\r" not in piece:
            # No line ends here: keep the piece (joined once, when one does).
            self._pending.append(piece)
            self._pending_bytes += len(piece)
            if self._pending_bytes > self._max:
                raise SSEError(f"event-stream line longer than {self._max} bytes")
            return None
        if self._pending:
            self._pending.append(piece)
            return b"".join(self._pending)
        return piece

    def _split(self, buffer: bytes) -> list[bytes]:
        """The complete lines of ``buffer``; the incomplete rest is kept for later."""
        if not self._started:
            self._started = True
            buffer = buffer.removeprefix(_BOM)
        if b"\r" in buffer:
            self._cr_ended = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        last = lines.pop()
        self._pending = [last] if last else []
        self._pending_bytes = len(last)
        if self._pending_bytes > self._max:
            raise SSEError(f"event-stream line longer than {self._max} bytes")
        return lines

    def _line(self, raw: bytes) -> ServerSentEvent | None:
        if not raw:
            if not self._data:
                self._event = ""
                return None
            return self._dispatch()
        if len(raw) > self._max:
            raise SSEError(f"event-stream line longer than {self._max} bytes")
        if raw[0] == 0x3A:  # ":" a comment
            return None
        # Split before decoding: the field names are ASCII, so comparing bytes
        # is the same as comparing the decoded text, and only the value is decoded.
        name, colon, value = raw.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data_bytes += len(raw)
            if self._data_bytes > self._max:
                raise SSEError(f"event-stream event larger than {self._max} bytes")
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        elif name == b"id" and b"\0" not in value:
            self._last_id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():  # bytes.isdigit: ASCII digits only
            self._retry = int(value)
        return None

    def _dispatch(self) -> ServerSentEvent:
        event = ServerSentEvent(
            event=self._event or "message",
            data="\n".join(self._data),
            id=self._last_id,
            retry=self._retry,
        )
        self._event = ""
        self._data = []
        self._data_bytes = 0
        return event
