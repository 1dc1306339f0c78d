"""The answers of admitted requests: generated at the configured pace, in
their dialect's form, whole or streamed, or shaped by a fault.

:func:`plan_answer` says what one answer will be (:class:`Plan`: its
:class:`~.dialects.Reply`, the dialect that writes it, the settings in force
and a fault that shapes it); :class:`Answers` writes it. Speed matters (a
benchmark must measure the pipeline, not this server): the token pieces are
built once per process, a request only glues a per-request prefix to them,
and an instant (``tokens_per_second=0``) stream goes out in a single write.

A client that goes away is an ordinary event (a worker cancelled or
preempted the call): counted in ``disconnects``, never logged as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Final

from aiohttp import web
from msgspec import Struct

from ._fault_injection import FaultKind
from ._settings import Counters, MockSettings
from .dialects import Call, Dialect, ErrorKind, Frames, Reply, token_text

__all__ = [
    "Answers",
    "Plan",
    "dropped",
    "error_response",
    "plan_answer",
    "raw_error",
    "reset",
]

#: How often a hung request looks whether its client is gone, in seconds.
_HANG_POLL: Final = 0.05


class Plan(Struct, frozen=True, kw_only=True):
    """What one admitted request will get: what its answer says, in which format."""

    reply: Reply
    dialect: Dialect
    settings: MockSettings
    #: The fault that shapes this answer (``drip``, ``break``, ...), if any.
    fault: FaultKind | None = None


class Answers:
    """Writes the answers the server admitted, counting what they send in ``counters``.

    ``closing`` is set when the mock closes: hung requests let go of their
    connections.
    """

    def __init__(self, counters: Counters, closing: asyncio.Event) -> None:
        self._counters = counters
        self._closing = closing

    async def run(
        self, request: web.Request, stream: bool, plan: Plan, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Generate the answer, streamed or not (a faulted non-stream answer its way)."""
        counters = self._counters
        counters.in_flight += 1
        counters.max_in_flight_seen = max(counters.max_in_flight_seen, counters.in_flight)
        try:
            if stream:
                counters.streamed += 1
                return await self._stream(request, headers, plan)
            if plan.fault is None or plan.fault == "filtered":
                return await self._complete(request, headers, plan)
            return await self._complete_fault(request, headers, plan)
        finally:
            counters.in_flight -= 1

    async def _stream(
        self, request: web.Request, headers: dict[str, str], plan: Plan
    ) -> web.StreamResponse:
        """The dialect's stream: its opening, the tokens at the configured pace,
        its closing (finish, usage) and end marker (OpenAI: a role chunk, the
        tokens, finish, usage, ``[DONE]``)."""
        counters = self._counters
        count = plan.reply.completion_tokens
        dialect = plan.dialect
        content_type = dialect.content_type
        response = web.StreamResponse(
            headers={**headers, "Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        frames = dialect.frames(plan.reply)
        head, tail, opening = frames.head, frames.tail, frames.opening
        pieces = dialect.pieces_for(plan.reply, count)
        cut = False
        if plan.fault is None:
            closing = frames.closing + frames.done
        else:
            closing, pieces, cut = _faulty_stream(plan, frames)
        rate = plan.settings.tokens_per_second
        loop = asyncio.get_running_loop()
        try:
            # Sending the headers fails too if the client is already gone.
            await response.prepare(request)
            if plan.settings.ttft:
                await asyncio.sleep(plan.settings.ttft)
            start = loop.time()
            sent = 0
            batch = [opening]
            while True:
                # Everything due by now goes out in one write: token i is due
                # at start + i / rate (all at once when rate is 0).
                due = count if not rate else min(count, int((loop.time() - start) * rate) + 1)
                due = max(due, min(sent + 1, count))
                if tail:
                    batch.extend(head + pieces[index] + tail for index in range(sent, due))
                else:
                    batch.extend(head + pieces[index] for index in range(sent, due))
                if due == count:
                    batch.append(closing)
                await response.write(b"".join(batch))
                counters.tokens_out += due - sent
                sent = due
                if sent == count:
                    break
                batch = []
                await asyncio.sleep(max(0.0, start + sent / rate - loop.time()))
            if cut:
                _close(request)
                return response
            await response.write_eof()
        except ConnectionError:
            # The client went away (a worker cancelled or preempted the call):
            # an ordinary event, counted, not an error to log. Stop generating.
            counters.disconnects += 1
            return response
        if plan.fault is None:
            counters.completed += 1
        return response

    async def _complete(
        self, request: web.Request, headers: dict[str, str], plan: Plan
    ) -> web.Response:
        """One JSON answer, after the time the whole generation would take."""
        settings = plan.settings
        count = plan.reply.completion_tokens
        rate = settings.tokens_per_second
        if delay := settings.ttft + (count / rate if rate else 0.0):
            await asyncio.sleep(delay)
            transport = request.transport
            if transport is None or transport.is_closing():
                return self.gone()
        self._counters.tokens_out += count
        if plan.fault is None:
            self._counters.completed += 1
        body = plan.dialect.answer(plan.reply)
        return web.Response(body=body, headers=headers, content_type="application/json")

    def gone(self) -> web.Response:
        """The answer to a client that disconnected: counted; aiohttp drops it quietly."""
        self._counters.disconnects += 1
        return dropped()

    # ----------------------------------------------------------- faults

    async def hang(self, request: web.Request) -> web.Response:
        """Send nothing until the client goes away, or the mock closes (then drop
        the connection unanswered)."""
        closing = self._closing
        while not closing.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return self.gone()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), _HANG_POLL)
        _close(request)
        return dropped()

    async def _complete_fault(
        self, request: web.Request, headers: dict[str, str], plan: Plan
    ) -> web.StreamResponse:
        """A non-streaming ``malformed``, ``break`` or ``drip`` answer."""
        payload = plan.dialect.answer(plan.reply)
        half = payload[: len(payload) // 2]
        if plan.fault == "malformed":
            return web.Response(body=half, headers=headers, content_type="application/json")
        response = web.StreamResponse(headers={**headers, "Content-Type": "application/json"})
        response.content_length = len(payload)
        try:
            await response.prepare(request)
            if plan.fault == "break":
                await response.write(half)
                _close(request)
                return response
            gap = plan.settings.faults.drip_gap
            step = -(-len(payload) // max(1, plan.reply.completion_tokens))
            for offset in range(0, len(payload), step):
                await asyncio.sleep(gap)
                await response.write(payload[offset : offset + step])
            await response.write_eof()
        except ConnectionError:
            self._counters.disconnects += 1
        return response


def plan_answer(
    request_id: str,
    dialect: Dialect,
    body: Call,
    settings: MockSettings,
    fault: FaultKind | None = None,
) -> Plan:
    """What ``body`` gets as ``request_id``: the settings' ``output_tokens``,
    cut to the request's cap (then finish reason ``length``), a tool call if
    it asks for one."""
    cap = body.cap
    cut = cap is not None and cap < settings.output_tokens
    return Plan(
        reply=Reply(
            id=request_id,
            model=body.model,
            prompt_tokens=body.prompt_tokens,
            completion_tokens=settings.output_tokens
            if cap is None
            else min(cap, settings.output_tokens),
            finish_reason="length" if cut else "stop" if body.tool is None else "tool_calls",
            include_usage=body.include_usage,
            openrouter=settings.limit_style in ("openrouter", "openrouter-body"),
            tool=body.tool,
            logprobs=body.logprobs,
        ),
        dialect=dialect,
        settings=settings,
        fault=fault,
    )


def _faulty_stream(plan: Plan, frames: Frames) -> tuple[bytes, list[bytes], bool]:
    """How a faulted stream differs: its ending (after the tokens), its token
    pieces, and whether the connection is cut instead of ended."""
    fault = plan.fault
    dialect = plan.dialect
    count = plan.reply.completion_tokens
    pieces = dialect.pieces_for(plan.reply, count)
    closing = frames.closing
    if fault == "break":
        return b"", pieces, True
    if fault == "no_done":
        return closing, pieces, False
    if fault == "no_finish":
        # The end marker alone (OpenAI's bare [DONE]): no finish reason, no usage.
        return frames.done, pieces, False
    if fault == "sse_error":
        return dialect.stream_error(plan.reply, frames), pieces, False
    if fault == "malformed":
        # Token ``after_tokens``'s line is cut after its text: not JSON.
        index = plan.settings.faults.after_tokens
        if index < count:
            pieces = pieces[:count]
            pieces[index] = dialect.cut(pieces[index], token_text(index))
        else:
            closing = frames.head + b'{"' + dialect.terminator + closing
    return closing + frames.done, pieces, False


def dropped() -> web.Response:
    """The answer to a connection already closed: aiohttp drops it quietly."""
    return web.Response(status=499, reason="Client Closed Request")


def _close(request: web.Request) -> None:
    """Close the connection (what was written is flushed, then FIN)."""
    if (transport := request.transport) is not None:
        transport.close()


def reset(request: web.Request) -> web.Response:
    """Reset the connection (RST, nothing flushed) and answer nothing."""
    if (transport := request.transport) is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return dropped()


def raw_error(status: int, body: bytes, headers: dict[str, str]) -> web.Response:
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def error_response(
    dialect: Dialect,
    status: int,
    kind: ErrorKind,
    message: str,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=dialect.error(status, kind, message),
        status=status,
        headers=headers,
        content_type="application/json",
    )
