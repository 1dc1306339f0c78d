"""A submitted request as its caller holds it: :class:`RequestHandle`, and its
:class:`Result` once it has completed (any other end raises the error a
caller can act on)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

from ..broker import EventLog
from ..errors import (
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    RequestRejectedError,
    TokensNotStreamedError,
)
from ..schema import (
    Cancelled,
    Completed,
    Event,
    Expired,
    Failed,
    Rejected,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    Usage,
    cancel_requested,
)
from ._retries import retrying
from ._tokens import TokenFollower

if TYPE_CHECKING:
    from ._client import Client
    from ._tap import Waiter

__all__ = ["RequestHandle", "Result"]


class Result(msgspec.Struct, frozen=True, kw_only=True):
    """A completed request."""

    request_id: str
    text: str
    usage: Usage
    backend: str
    cost: float
    finish_reason: str | None = None
    ttft: float | None = None
    duration: float = 0.0
    #: The tools the model asked to call (its ``text`` may then be empty).
    tool_calls: tuple[ToolCall, ...] = ()
    #: The answer's tokens' log probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()


def _raise_for(event: Event) -> Result:
    """Turn a terminal event into a result, or the error a caller can act on."""
    if isinstance(event, Completed):
        return Result(
            request_id=event.request_id,
            text=event.text,
            usage=event.usage,
            backend=event.backend,
            cost=event.cost,
            finish_reason=event.finish_reason,
            ttft=event.ttft,
            duration=event.duration,
            tool_calls=event.tool_calls,
            logprobs=event.logprobs,
        )
    rid = event.request_id
    if isinstance(event, Rejected):
        raise RequestRejectedError(event.reason, request_id=rid, error_type=event.error_type)
    if isinstance(event, Expired):
        raise RequestExpiredError(
            event.reason or "deadline passed", request_id=rid, error_type="expired"
        )
    if isinstance(event, Cancelled):
        raise RequestCancelledError(
            event.reason or "cancelled", request_id=rid, error_type="cancelled"
        )
    if isinstance(event, Failed):
        raise RequestFailedError(event.reason, request_id=rid, error_type=event.error_type)
    raise TypeError(f"not a terminal event: {event!r}")


class RequestHandle:
    """A submitted request: its token stream, its events and its result."""

    def __init__(
        self,
        client: Client,
        request_id: str,
        tenant: str,
        *,
        duplicate: bool = False,
        found_on_retry: bool = False,
        waiter: Waiter | None = None,
        traceparent: str | None = None,
        streamed: bool | None = None,
    ) -> None:
        self._client = client
        self._waiter = waiter
        self.id = request_id
        self.tenant = tenant
        #: True when the submit found the request already in the queue (a resubmit).
        self.duplicate = duplicate
        #: True when the submit published again after a try whose answer was
        #: lost, and the broker had the request by then: stored by that try,
        #: all but surely, so ``duplicate`` is False; a resubmit of the same id
        #: at the same moment would look the same (the gateway checks the body
        #: under an ``Idempotency-Key`` then, as for a duplicate).
        self.found_on_retry = found_on_retry
        #: The W3C ``traceparent`` header the submit published the request
        #: with (its ``trace_id`` names the request's trace); ``None`` for a
        #: handle not made by a submit (:meth:`Client.handle`).
        self.traceparent = traceparent
        #: Whether the request was submitted to be streamed (its ``stream``
        #: field); ``None`` for a handle not made by a submit (not known).
        self.streamed = streamed

    def __repr__(self) -> str:
        return f"RequestHandle(id={self.id!r}, tenant={self.tenant!r})"

    async def stream(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - per-chunk bound, not a whole-call one
    ) -> AsyncIterator[TokenChunk]:
        """Yield text chunks in order until the request ends.

        A chunk with ``restart=True`` begins a new run of the request (the
        earlier run was interrupted): text streamed before it is void.
        ``timeout`` bounds the wait for each next chunk. The final chunk
        (``final=True``) is yielded, last, when it carries text, tool calls
        or log probabilities (the backend's last read, which also ended its
        stream); one without is not.

        A request this handle submitted with ``stream=False`` has no chunks:
        this raises :class:`TokensNotStreamedError` at once. (Through a
        handle that did not submit it, :meth:`Client.handle`, such a request
        looks like one whose chunks aged out: :class:`TokensExpiredError`
        once it has ended.)

        Chunks are kept ``nats.tokens.max_age`` (1 h by default). For a
        request that has ended and whose chunks are no longer all stored,
        this raises :class:`TokensExpiredError` after the chunks it could
        yield in order (usually none: the oldest age out first), within a few
        seconds; it never makes up chunks from the ``completed`` event.
        :meth:`result` still has the outcome and a completed request's text.
        A request with no terminal event (not ended yet, never submitted, or
        older than ``nats.events.max_age``) is waited for, as is a broker
        that does not answer for a while (a restart, a node down).
        """
        if self.streamed is False:
            raise TokensNotStreamedError(request_id=self.id)
        follower = TokenFollower(self._client, self.tenant, self.id)
        try:
            timeout = _kept(timeout)
            await asyncio.wait_for(follower.start(), timeout)
            while True:
                chunk = await asyncio.wait_for(follower.next(), timeout)
                if chunk.final:
                    if chunk.text or chunk.tool_calls or chunk.logprobs:
                        yield chunk
                    return
                yield chunk
        finally:
            await follower.close()

    async def events(self) -> list[Event]:
        """This request's events so far, in log order."""
        return await EventLog(self._client.js, nc=self._client.nc).read(self.tenant, self.id)

    async def cancel(self, reason: str = "") -> None:
        """Ask for the request to be cancelled.

        A queued request never runs; a running one is stopped at the backend.
        Either way it ends with a ``cancelled`` event, and :meth:`result`
        raises :class:`RequestCancelledError`. A request that already ended is
        not changed. Idempotent.
        """
        event = cancel_requested(self.id, self.tenant, at=time.time(), reason=reason[:500])
        await EventLog(self._client.js, nc=self._client.nc).append(event)

    async def result(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the common case, like httpx's timeout=
    ) -> Result:
        """Wait for the request to end. Raises a :class:`RequestFailedError` unless completed."""
        if self._waiter is not None:
            event = await self._waiter.wait(timeout)
        else:
            event = await asyncio.wait_for(self._read_terminal(), _kept(timeout))
        return _raise_for(event)

    async def _read_terminal(self) -> Event:
        """For a request not followed from its submit: through this client's
        event tap when it is the client's tenant's (at once), else by polling
        the request's own events."""
        if self.tenant == self._client.tenant:
            return await self._client._follow_terminal(self.id)
        lookup = functools.partial(EventLog(self._client.js).terminal_of, self.tenant, self.id)
        delay = 0.05
        while True:
            event = await retrying(
                self._client.nc, "looking up a result", lookup, request_id=self.id
            )
            if event is not None:
                return event
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


def _kept(timeout: float | None) -> float | None:
    """``timeout`` as a deadline the event loop can keep: a NaN (or a negative
    number) is none (in the loop's timer heap a NaN misorders every other timer
    of the loop), so it is 0, time out at once, as :meth:`Waiter.wait` does."""
    return timeout if timeout is None or timeout > 0 else 0.0
