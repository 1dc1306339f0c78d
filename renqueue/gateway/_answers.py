"""The answer to a chat call, and to a look at a request: OpenAI's shapes.

A whole ``chat.completion`` (:meth:`Answers.complete`), or a stream of
``chat.completion.chunk`` events ending in ``data: [DONE]``
(:meth:`Answers.stream`), each with an ``id:`` line a client resumes from
(``Last-Event-ID``, :func:`parse_last_event_id`). A streamed answer's status
line waits for the request's first token, so a request refused or expired
before it streamed anything gets its real status (429, 504, ...) rather than
a 200 with an error inside. A failure after text was sent can only be said
in the stream: an ``error`` event, as OpenAI sends. A write that finds the
client gone raises :class:`ClientGone`.

:func:`request_state` is ``GET /v1/requests/{id}``: where the request is, and
its outcome once it has one.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import msgspec
from aiohttp import web

from ..broker import EventLog, JetStream
from ..client import RequestHandle, Result
from ..errors import RequestFailedError, TokensExpiredError
from ..schema import Completed, Event, Submitted, TokenChunk, is_terminal, kind_of
from ._errors import ApiError, from_terminal
from ._openai import ToolCallPieces, answer_bytes, chunk_bytes, finish_reason, usage

__all__ = ["Answers", "ClientGone", "parse_last_event_id", "request_state"]

#: ``<run>.<seq>``, ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses).
_EVENT_ID_RE: Final = re.compile(r"[0-9]{1,11}\.[0-9]{1,11}")
_SSE_HEADERS: Final = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
_JSON: Final = "application/json"
_DONE: Final = b"data: [DONE]\n\n"


class _After(msgspec.Struct, frozen=True):
    """Where a resumed stream starts (its ``Last-Event-ID``)."""

    #: ``start``: nothing seen; ``role``: the role chunk; ``text``: the chunk at
    #: (delivery, seq); ``end``: the finish chunk; ``usage``: the usage chunk.
    stage: str
    delivery: int = 0
    seq: int = -1


def parse_last_event_id(text: str | None) -> _After:
    """``Last-Event-ID`` -> where to resume. Ids are ``0`` (the role chunk),
    ``<run>.<seq>`` (a text chunk), ``end`` (the finish chunk), ``usage``."""
    if text is None or not text.strip():
        return _After("start")
    value = text.strip()
    if value == "0":
        return _After("role")
    if value in ("end", "usage"):
        return _After(value)
    if _EVENT_ID_RE.fullmatch(value):
        run, _, seq = value.partition(".")
        return _After("text", int(run), int(seq))
    raise ApiError(
        400,
        "Last-Event-ID must be an id this gateway sent (0, <run>.<seq>, end or usage)",
        param="Last-Event-ID",
        code="invalid_header",
    )


def _sse(data: bytes, event_id: str | None = None) -> bytes:
    if event_id is None:
        return b"data: " + data + b"\n\n"
    return b"id: " + event_id.encode() + b"\ndata: " + data + b"\n\n"


class Answers:
    """Answers chat calls from their requests' tokens and events; ``js`` gives
    the gateway's JetStream of the moment (its connection may be renewed)."""

    def __init__(self, js: Callable[[], JetStream]) -> None:
        self._js = js

    async def outcome(self, handle: RequestHandle) -> Result:
        """The request's result; its terminal event's error if it did not complete."""
        try:
            return await handle.result()
        except RequestFailedError as exc:
            event = await _terminal(self._js(), handle)
            if event is None:
                raise ApiError(500, str(exc), type="server_error", code=exc.error_type) from None
            raise from_terminal(event, now=time.time()) from None

    async def complete(self, handle: RequestHandle, route: str, created: int) -> web.Response:
        """The whole answer; ``created``: when the request was made (Unix seconds)."""
        result = await self.outcome(handle)
        body = answer_bytes(handle.id, route, created, result)
        response = web.Response(body=body, content_type=_JSON)
        response.headers["x-request-id"] = handle.id
        response.headers["x-renqueue-backend"] = result.backend
        return response

    async def stream(
        self,
        request: web.Request,
        handle: RequestHandle,
        route: str,
        *,
        created: int,
        include_usage: bool,
        after: _After | None = None,
    ) -> web.StreamResponse:
        """Stream ``handle`` as chat.completion.chunks, from after ``after``.

        ``created``: when the request was made (Unix seconds), the same in
        every chunk of every stream of it, resumed or not."""
        sse = _Sse(handle.id, route, created, include_usage, after or _After("start"))
        chunks = _Chunks(handle)
        try:
            # The status line waits for the first chunk (or the end): a request
            # refused before it streamed anything gets its real status.
            first = await chunks.next()
            if first is None:
                await self.outcome(handle)  # raises the failure, before any byte is sent
            sse.response = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": handle.id})
            await sse.response.prepare(request)
            await sse.begin()
            current = first
            while current is not None:
                if not await sse.text(current):
                    return sse.response  # restarted after text was sent: said in the stream
                current = await chunks.next()
            try:
                result = await self.outcome(handle)
            except ApiError as exc:
                await sse.error(exc)
            else:
                await sse.end(result)
        except TokensExpiredError as exc:
            expired = ApiError(410, str(exc), code="stream_expired", retry=False)
            if sse.response is None:
                raise expired from None
            await sse.error(expired)
        except (ConnectionResetError, RuntimeError) as exc:  # aiohttp's "closing transport"
            if sse.response is None or not _closed_under(exc):
                raise
            # The client went away mid-write: the same as a disconnect.
            raise ClientGone(sse.response) from exc
        finally:
            await chunks.close()
        return sse.response


class _Sse:
    """One streamed answer: what was sent, and what comes next (see
    :func:`parse_last_event_id` for the event ids)."""

    def __init__(
        self, request_id: str, route: str, created: int, include_usage: bool, after: _After
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.include_usage = include_usage
        self.after = after
        self.created = created
        self.response: web.StreamResponse | None = None
        self.text_sent = after.stage not in {"start", "role"}
        self.tool_calls = ToolCallPieces(request_id)

    def _chunk(self, **fields: Any) -> bytes:
        return chunk_bytes(
            self.request_id, self.route, self.created, with_usage=self.include_usage, **fields
        )

    async def _write(self, data: bytes, event_id: str | None = None) -> None:
        assert self.response is not None
        await self.response.write(_sse(data, event_id))

    async def begin(self) -> None:
        if self.after.stage == "start":
            await self._write(self._chunk(role="assistant", content=""), "0")

    async def text(self, chunk: TokenChunk) -> bool:
        """Send ``chunk`` unless the client has it; False if it voids text already sent."""
        after = self.after
        if after.stage in {"end", "usage"}:
            return True
        if after.stage == "text" and chunk.delivery == after.delivery and chunk.seq <= after.seq:
            if chunk.restart:
                self.tool_calls.restart()
            self.tool_calls.seen(chunk.tool_calls)  # the client has their first pieces
            return True
        if chunk.restart:
            if self.text_sent:
                await self._write(_restarted(self.request_id))
                return False
            self.tool_calls.restart()
        pieces = self.tool_calls.pieces(chunk.tool_calls)
        data = self._chunk(
            # A piece of tool calls alone has no content, as OpenAI's.
            content=chunk.text if chunk.text or not pieces else None,
            tool_calls=pieces,
            logprobs=chunk.logprobs,
        )
        await self._write(data, f"{chunk.delivery}.{chunk.seq}")
        self.text_sent = True
        return True

    async def end(self, result: Result) -> None:
        if self.after.stage not in {"end", "usage"}:
            finish = finish_reason(result.finish_reason, tool_calls=bool(result.tool_calls))
            await self._write(self._chunk(finish=finish), "end")
        if self.include_usage and self.after.stage != "usage":
            counts = usage(result.usage.prompt_tokens, result.usage.completion_tokens)
            await self._write(self._chunk(final_usage=counts), "usage")
        assert self.response is not None
        await self.response.write(_DONE)
        await self.response.write_eof()

    async def error(self, exc: ApiError) -> None:
        """A failure after the status line: an ``error`` event, as OpenAI sends."""
        await self._write(exc.body())


class ClientGone(Exception):
    """A write failed: the client's connection is gone (its answer is ``response``)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client gone")
        self.response = response


class _Chunks:
    """A handle's chunks one at a time (``None`` at the end); closes its follower."""

    def __init__(self, handle: RequestHandle) -> None:
        self._iter: AsyncIterator[TokenChunk] = handle.stream()

    async def next(self) -> TokenChunk | None:
        try:
            return await anext(self._iter)
        except StopAsyncIteration:
            return None

    async def close(self) -> None:
        aclose = getattr(self._iter, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def _terminal(js: JetStream, handle: RequestHandle) -> Event | None:
    return await EventLog(js).terminal_of(handle.tenant, handle.id)


def _closed_under(exc: BaseException) -> bool:
    """A write failed because the client's connection is gone."""
    return isinstance(exc, ConnectionResetError) or "closing transport" in str(exc).lower()


def _restarted(request_id: str) -> bytes:
    return ApiError(
        500,
        f"request {request_id} was restarted on another run after part of its answer was"
        " streamed (a preemption or a retry): the text sent is void. GET"
        f" /v1/requests/{request_id}/stream (no Last-Event-ID) streams the new run",
        type="server_error",
        code="stream_restarted",
    ).body()


_RUNNING: Final = frozenset({"started", "coalesced"})
_WAITING: Final = frozenset({"submitted", "routed", "retrying", "fell_back", "preempted", "stolen"})


def request_state(request_id: str, route: str, events: list[Event]) -> dict[str, Any]:
    """``GET /v1/requests/{id}``: where the request is, and its outcome once it has one."""
    status = "queued"
    out: dict[str, Any] = {"id": request_id, "object": "renqueue.request", "model": route}
    for event in events:
        kind = kind_of(event)
        if isinstance(event, Submitted):
            out["created"] = int(event.request.submitted_at)
            out["priority"] = event.request.priority
            out["deadline"] = event.request.deadline
        if is_terminal(event):
            status = kind
            if isinstance(event, Completed):
                out["backend"] = event.backend
                out["cost"] = event.cost
                out["result"] = msgspec.json.decode(
                    answer_bytes(request_id, route, int(event.at), event)
                )
            else:
                error = from_terminal(event, now=time.time())
                out["error"] = msgspec.json.decode(error.body())["error"]
            break
        if kind in _RUNNING:
            status = "running"
        elif kind in _WAITING:
            status = "queued" if kind != "routed" else "routed"
    out["status"] = status
    return out
