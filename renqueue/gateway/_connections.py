"""The gateway's HTTP connections: the limits aiohttp does not set by itself.

aiohttp closes a connection that stays idle (no request in progress) for its
``keepalive_timeout``, counted from the end of each answer (and, here, from
the connection's start); the gateway sets it from ``[gateway] idle_timeout``. It has no
limit on the time a client takes to send a request's headers once it has
begun, so a client sending them a byte at a time (slowloris) would hold a
connection until the idle limit. :class:`GatewayRunner` serves the app
through :class:`_Connection`, aiohttp's protocol with what is missing:

- **a header deadline**: from the first byte of a request to the end of its
  headers, ``[gateway] header_timeout``; past it the client gets a 408
  ``header_timeout`` and the connection is closed;
- **typed answers for what aiohttp's parser refuses** (too many or too long
  headers: 431 ``headers_too_large``; anything else that is not HTTP/1.1:
  400 ``malformed_http``), in OpenAI's shape instead of aiohttp's text page,
  without a traceback in the log for each;
- **counts** of every such refusal (``renqueue_gateway_rejected_total``), of
  connections that ended without a request (``renqueue_gateway_dropped_total``)
  and of the open connections (``renqueue_gateway_connections``);
- **a prompt close after a 408**: a client too slow to send its request is not
  given aiohttp's lingering time (10 s) to send the rest;
- **a send deadline**: a client that stops reading its answer (the
  connection's send buffer stays full for ``[gateway] send_timeout``) has its
  connection dropped, and its call ends as a disconnect; without it a handler
  would wait on the full buffer for as long as the client keeps the
  connection open;
- **a close deadline**: a connection closed (by the idle limit, after a
  408, at shutdown) with answers still unsent gives the client the same
  ``send_timeout`` to take them, then it is dropped: asyncio's close waits
  for a write buffer to empty, for ever to a client that never reads, and
  a buffer under aiohttp's high-water mark (64 KiB) never pauses writing, so
  the send deadline above is not armed for it.

The body's deadline (``[gateway] body_timeout``) is the handler's: it reads
the body (:meth:`Gateway._read_body`). A body whose framing breaks while it
is read (a bad chunk in a later packet) is refused by aiohttp's parser as if
it were the next request; the connection gives the error to the body being
read instead (a 400 ``malformed_body`` at once, not a wait for the deadline)
and is closed after the answer.
"""

from __future__ import annotations

import asyncio
import uuid
from types import TracebackType
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from ..logs import get_logger
from . import _metrics as metrics
from ._errors import ApiError, reason_of

__all__ = [
    "MAX_FIELD_SIZE",
    "MAX_HEADERS",
    "UNROUTED",
    "GatewayRunner",
    "body_deadline",
    "error_response",
    "plain_body",
]

log = get_logger("gateway")

#: aiohttp's own limits on a request's head, set explicitly: the request line
#: and each header line at most 8190 bytes, at most 128 headers.
MAX_FIELD_SIZE: Final = 8190
MAX_HEADERS: Final = 128
#: The endpoint label of an answer given before a request reached a route
#: (``renqueue_gateway_requests_total``), as for a path no route matches.
UNROUTED: Final = "unmatched"
#: Seconds a client that sent too much gets to read the answer before its
#: connection is closed (aiohttp's default ``lingering_time``, stated here).
LINGERING: Final = 10.0


def error_response(error: ApiError, request_id: str | None = None) -> web.Response:
    """``error`` as its HTTP answer, with an ``x-request-id`` (a fresh one without a request)."""
    response = web.Response(status=error.status, body=error.body(), content_type="application/json")
    response.headers.update(error.headers())
    response.headers["x-request-id"] = request_id or ("req-" + uuid.uuid4().hex)
    return response


def plain_body(request: web.BaseRequest) -> None:
    """415 ``unsupported_content_encoding`` for a body sent compressed: the
    gateway does not decompress (``auto_decompress=False``). aiohttp would,
    in its parser, before any handler could refuse: a 4 MB gzip of zeros is
    4 GB to inflate, and the event loop stalled for the 10 s aiohttp spends
    reading (inflating) an unread body after any answer, a 401 included."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(
            415,
            "the body is compressed (Content-Encoding): send it uncompressed",
            code="unsupported_content_encoding",
            param="Content-Encoding",
            retry=False,
        )


class body_deadline:
    """Around the reading of a request's body: 408 ``body_timeout`` when it has
    not all arrived within ``seconds``, 400 ``malformed_body`` when its
    framing is broken (a bad chunk, a length it does not have) or it does not
    decompress by its ``Content-Encoding`` (aiohttp's RequestPayloadError).

    A class, not a generator: it is entered on every call."""

    __slots__ = ("_seconds", "_timeout")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._timeout = asyncio.timeout(seconds)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._timeout.__aexit__(kind, exc, tb)
            if isinstance(exc, TimeoutError):
                raise exc
        except TimeoutError:
            raise ApiError(
                408,
                f"the request's body did not arrive within {self._seconds:g} s of its headers",
                code="body_timeout",
                retry=False,
            ) from None
        if isinstance(exc, HttpProcessingError | web.RequestPayloadError):
            raise ApiError(
                400,
                f"the request's body is not valid HTTP/1.1: {_reason(exc)}",
                code="malformed_body",
            ) from None


class GatewayRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose connections are :class:`_Connection`."""

    def __init__(
        self,
        app: web.Application,
        *,
        header_timeout: float,
        idle_timeout: float,
        send_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            app,
            keepalive_timeout=idle_timeout,
            max_line_size=MAX_FIELD_SIZE,
            max_field_size=MAX_FIELD_SIZE,
            max_headers=MAX_HEADERS,
            lingering_time=LINGERING,
            # Bodies as sent: a compressed one is refused (plain_body), never inflated.
            auto_decompress=False,
            **kwargs,
        )
        self._timeouts = (header_timeout, send_timeout)

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            timeouts=self._timeouts,
            **made._kwargs,
        )


class _Server(web.Server):
    """aiohttp's server, making :class:`_Connection` protocols."""

    def __init__(self, handler: Any, *, timeouts: tuple[float, float], **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._timeouts = timeouts

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, timeouts=self._timeouts, loop=self._loop, **self._kwargs)


class _Connection(web.RequestHandler):
    """One client connection: aiohttp's protocol with a header deadline and typed refusals."""

    __slots__ = (
        "_armed_at",
        "_broken",
        "_close_timer",
        "_got_bytes",
        "_header_timeout",
        "_header_timer",
        "_open",
        "_send_timeout",
        "_send_timer",
        "_started",
        "_transport",
        "stalled",
    )

    def __init__(
        self, manager: web.Server, *, timeouts: tuple[float, float], **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout, self._send_timeout = timeouts
        self._send_timer: asyncio.TimerHandle | None = None
        #: Aborts a closed connection whose answers the client does not take.
        self._close_timer: asyncio.TimerHandle | None = None
        #: The connection's transport, kept after aiohttp lets go of it on a close.
        self._transport: asyncio.Transport | None = None
        #: Dropped because the client stopped reading its answer (``send_timeout``).
        self.stalled = False
        self._header_timer: asyncio.TimerHandle | None = None
        #: The connection's request count when the header timer was armed.
        self._armed_at = 0
        self._got_bytes = False
        self._open = False
        #: Requests whose handling began (the rest of ``_request_count`` never got a turn).
        self._started = 0
        #: The body being read broke its framing: closed after the answer.
        self._broken = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._keepalive_handle is None and self._keepalive_timeout > 0:
            # The idle limit from the connection's start, so that one that never
            # sends a byte is closed too (aiohttp arms it itself since
            # aio-libs/aiohttp#13681; not before).
            close_time = self._loop.time() + self._keepalive_timeout
            self._next_keepalive_close_time = close_time
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)
        self._open = True
        metrics.CONNECTIONS.inc()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._transport = None  # before aiohttp's own force_close below
        for timer in (self._send_timer, self._close_timer):
            if timer is not None:
                timer.cancel()
        self._send_timer = self._close_timer = None
        if self._header_timer is not None:
            # Gone in the middle of a request's headers (a half-closed or
            # dropped connection).
            self._disarm()
            metrics.DROPPED.labels("incomplete_request").inc()
        elif not self._got_bytes and self._open:
            # Opened and closed (by the client, or by the idle limit) without a byte.
            metrics.DROPPED.labels("no_request").inc()
        if self._open:
            self._open = False
            metrics.CONNECTIONS.dec()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        # The send buffer is full: the client has until the deadline to take some.
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self._loop.call_later(self._send_timeout, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _not_reading(self) -> None:
        """The send buffer stayed full for ``send_timeout``: drop the connection
        (what it holds is never read); its call ends as a disconnect."""
        self._send_timer = None
        transport = self.transport
        if transport is None or not self.writing_paused:
            return
        self.stalled = True
        log.debug("client not reading its answer; dropping it", timeout=self._send_timeout)
        if self._current_request is None:
            metrics.DROPPED.labels("slow_reader").inc()  # no call to count it
        transport.abort()

    def force_close(self) -> None:
        super().force_close()
        self._abort_later()

    def _abort_later(self) -> None:
        """The connection is closing: if answers are still unsent, the client
        has ``send_timeout`` to take them before the connection is dropped."""
        transport = self._transport
        if (
            transport is None
            or self._close_timer is not None
            or not transport.is_closing()
            or not transport.get_write_buffer_size()
        ):
            return
        self._close_timer = self._loop.call_later(self._send_timeout, self._unsent)

    def _unsent(self) -> None:
        self._close_timer = None
        transport = self._transport
        if transport is None:
            return
        log.debug("connection closed with its answers unread; dropping it")
        metrics.DROPPED.labels("slow_reader").inc()
        transport.abort()

    async def start(self) -> None:
        try:
            await super().start()
        finally:
            # aiohttp closes the transport itself at the end of a connection
            # that was not force-closed (no keep-alive, a close asked for).
            self._abort_later()
            # Requests read whole but never handled: the connection was lost
            # (or the gateway stopped) before their turn came.
            unanswered = self._request_count - self._started
            if unanswered > 0:
                metrics.DROPPED.labels("disconnected").inc(unanswered)

    async def _handle_request(
        self,
        request: web.BaseRequest,
        start_time: float | None,
        request_handler: Any,
    ) -> tuple[web.StreamResponse, bool]:
        self._started += 1  # from here on the middleware or handle_error counts it
        done = await super()._handle_request(request, start_time, request_handler)
        if done[0].status == 408 or self._broken:
            # Too slow to send its request, or its body broken (answered):
            # closed now, without aiohttp's lingering for the rest of its body.
            self.force_close()
        return done

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        awaiting = self._header_timer is None and self._awaiting_request()
        super().data_received(data)
        if not data:
            return
        self._got_bytes = True
        if self._request_count != count:
            self._disarm()  # the headers are in (or refused as malformed)
            self._body_broken()
        elif awaiting and not self._force_close:
            # The first bytes of a request, not its whole head (a whole one in a
            # packet, the usual case, costs no timer): the rest has until the deadline.
            self._armed_at = count
            self._header_timer = self._loop.call_later(self._header_timeout, self._too_slow)

    def _body_broken(self) -> None:
        """The parser refused what came while a handler reads a body: the
        refusal is the body's (its chunks), not a next request's; given to
        the body, whose reader answers 400 ``malformed_body``."""
        request = self._current_request
        if request is None or request.content.is_eof() or len(self._messages) != 1:
            return
        message, _ = self._messages[-1]
        exc = getattr(message, "exc", None)  # aiohttp's _ErrInfo
        if not isinstance(exc, HttpProcessingError):
            return
        self._messages.pop()
        self._request_count -= 1
        self._broken = True
        request.content.set_exception(exc)
        self.close()  # nothing more is read from it

    def _awaiting_request(self) -> bool:
        """Waiting for a request's headers: no request in progress or queued."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._messages

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        """The header deadline passed: a 408, then the connection is closed."""
        self._header_timer = None
        transport = self.transport
        if transport is None or not self._awaiting_request():
            return
        if self._request_count != self._armed_at:
            return
        error = ApiError(
            408,
            f"the request's headers did not arrive within {self._header_timeout:g} s",
            code="header_timeout",
            retry=False,
        )
        metrics.REJECTED.labels(error.code).inc()
        metrics.CALLS.labels(UNROUTED, "408").inc()
        log.debug("request headers too slow; closing the connection", timeout=self._header_timeout)
        transport.write(_raw(error))
        self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """What aiohttp answers itself (a request its parser refused, or an
        exception that got past the gateway's middleware), as an OpenAI error."""
        if isinstance(exc, ConnectionError):
            # The client went away mid-call (the middleware counted it).
            error = ApiError(400, "the client closed the connection", code="malformed_http")
        elif status < 500:
            error = _refused(exc)
            metrics.REJECTED.labels(reason_of(error.code)).inc()
            metrics.CALLS.labels(UNROUTED, str(error.status)).inc()
            log.debug("request refused by the HTTP parser", code=error.code, status=error.status)
        else:
            if exc is not None:
                log.error(
                    "gateway error outside its handlers",
                    exc_info=(type(exc), exc, exc.__traceback__),
                )
            error = ApiError(status, "internal error", type="server_error")
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already being sent")
        response = error_response(error)
        response.force_close()
        return response


def _refused(exc: BaseException | None) -> ApiError:
    """The answer to a request aiohttp's parser refused."""
    text = _reason(exc) if isinstance(exc, HttpProcessingError) else ""
    if isinstance(exc, LineTooLong) or "Too many headers" in text:
        return ApiError(
            431,
            f"the request's head is too large: a line or header over {MAX_FIELD_SIZE} bytes,"
            f" or more than {MAX_HEADERS} headers",
            code="headers_too_large",
        )
    detail = text or "unreadable request"
    return ApiError(400, f"not a valid HTTP/1.1 request: {detail}", code="malformed_http")


def _reason(exc: HttpProcessingError | web.RequestPayloadError) -> str:
    """What aiohttp's parser says is wrong, without what it quotes: its
    messages quote the refused line (``Invalid header value char:`` then the
    bytes, an ``Authorization`` line and its key included), which must not
    go back in an answer a client may log."""
    text = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
    first = str(text).split("\n", 1)[0].split(":", 1)[0]
    return first.split("'", 1)[0].split('"', 1)[0].strip()[:200]


_REASONS: Final = {408: "Request Timeout"}


def _raw(error: ApiError) -> bytes:
    """``error`` as a whole HTTP/1.1 answer, for a connection that has no request object."""
    body = error.body()
    head = (
        f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-request-id: req-{uuid.uuid4().hex}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body
