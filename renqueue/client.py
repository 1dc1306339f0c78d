"""The async client: submit requests, stream their tokens, await their results.

::

    async with await Client.connect("nats://127.0.0.1:4222", tenant="acme") as client:
        handle = await client.submit("Hello!", route="chat-small", priority="high")
        async for chunk in handle.stream():
            print(chunk.text, end="")
        result = await handle.result()

Submits are idempotent: the request id is the JetStream message id, so a
resubmit with the same id (after a timeout, say) creates nothing new and the
returned handle follows the original request.

Results come from the event log. One ordered consumer per client follows the
tenant's events from the moment of the first submit and resolves waiting
handles; a handle for a request submitted elsewhere or earlier reads that
request's own events instead. Token streams are read from ``RQ_TOKENS`` with
an ordered consumer from the first chunk, so a subscriber that starts late or
reconnects still gets every chunk, in order, once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

import msgspec
from nats.js.api import DeliverPolicy
from nats.js.errors import NoStreamResponseError, NotFoundError

from .connection import connect
from .errors import (
    MalformedRequestError,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    RequestRejectedError,
    UnknownPriorityError,
)
from .eventlog import EventLog
from .messages import (
    EVENT_DECODER,
    REQUEST_DECODER,
    TOKEN_DECODER,
    Cancelled,
    ChatMessage,
    Completed,
    Event,
    Expired,
    Failed,
    GenerationParams,
    InferenceRequest,
    Rejected,
    TokenChunk,
    Usage,
    encode,
    is_terminal,
)
from .subjects import TOKENS_STREAM, request_subject, token_subject

__all__ = ["Client", "RequestHandle", "Result"]


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


class _TokenFollower:
    """Every chunk of one request, in order, once: stored ones, then live ones.

    No JetStream consumer per stream (they are server-side objects, costly to
    create and slow to go away at hundreds of streams a second). Instead: a
    core subscription to the token subject collects live chunks from the
    start; stored chunks are read with direct gets from the stream; chunks are
    de-duplicated by (delivery, seq). A gap in the live sequence (chunks lost
    while the connection was down) sends the follower back to the store.
    """

    def __init__(self, client: Client, tenant: str, request_id: str) -> None:
        self._js = client.js
        self._nc = client.nc
        self._subject = token_subject(tenant, request_id)
        self._live: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._ready: collections.deque[TokenChunk] = collections.deque()
        self._seen: set[tuple[int, int, bool]] = set()
        self._cursor = 1  # next stream sequence to read from the store
        self._last: tuple[int, int] = (0, -1)  # (delivery, seq) last handed out
        self._sub: Any = None

    async def start(self) -> None:
        # Subscribe before reading the store, so nothing falls between the two.
        self._sub = await self._nc.subscribe(self._subject, cb=self._on_live)
        await self._read_store()

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_live(self, msg: Any) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            self._live.put_nowait(TOKEN_DECODER.decode(msg.data))

    async def _read_store(self) -> None:
        while True:
            try:
                raw = await self._js.get_msg(
                    TOKENS_STREAM, seq=self._cursor, subject=self._subject, next=True, direct=True
                )
            except NotFoundError:
                return
            self._cursor = raw.seq + 1
            with contextlib.suppress(msgspec.DecodeError):
                self._accept(TOKEN_DECODER.decode(raw.data))

    def _accept(self, chunk: TokenChunk) -> None:
        key = (chunk.delivery, chunk.seq, chunk.final)
        if key not in self._seen:
            self._seen.add(key)
            self._ready.append(chunk)

    async def next(self) -> TokenChunk:
        while not self._ready:
            chunk = await self._live.get()
            delivery, seq = self._last
            skipped = chunk.seq > seq + 1 if chunk.delivery == delivery else chunk.seq > 0
            if skipped:
                await self._read_store()  # missed some live: the store has them, in order
            self._accept(chunk)
        chunk = self._ready.popleft()
        self._last = (chunk.delivery, chunk.seq)
        return chunk


class RequestHandle:
    """A submitted request: its token stream, its events and its result."""

    def __init__(
        self,
        client: Client,
        request_id: str,
        tenant: str,
        *,
        duplicate: bool = False,
        waiter: asyncio.Future[Event] | None = None,
    ) -> None:
        self._client = client
        self._waiter = waiter
        self.id = request_id
        self.tenant = tenant
        #: True when the submit found the request already in the queue (a resubmit).
        self.duplicate = duplicate

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
        ``timeout`` bounds the wait for each next chunk.
        """
        follower = _TokenFollower(self._client, self.tenant, self.id)
        await follower.start()
        try:
            while True:
                chunk = await asyncio.wait_for(follower.next(), timeout)
                if chunk.final:
                    return
                yield chunk
        finally:
            await follower.close()

    async def events(self) -> list[Event]:
        """This request's events so far, in log order."""
        return await EventLog(self._client.js).history(self.tenant, self.id)

    async def result(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the common case, like httpx's timeout=
    ) -> Result:
        """Wait for the request to end. Raises a :class:`RequestFailedError` unless completed."""
        if self._waiter is not None:
            event = await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
        else:
            event = await asyncio.wait_for(self._read_terminal(), timeout)
        return _raise_for(event)

    async def _read_terminal(self) -> Event:
        """Poll the request's own events: for requests not followed from their submit."""
        log = EventLog(self._client.js)
        delay = 0.05
        while (event := await log.terminal_of(self.tenant, self.id)) is None:
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
        return event


class Client:
    """Submits requests for one tenant. Create with :meth:`connect` or from an open connection."""

    def __init__(self, nc: Any, *, tenant: str = "default", owns_connection: bool = False) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.tenant = tenant
        self._owns = owns_connection
        self._tap: Any = None
        self._tap_lock = asyncio.Lock()
        self._waiters: dict[str, asyncio.Future[Event]] = {}
        self._closed = False

    @classmethod
    async def connect(cls, url: str, *, tenant: str = "default", name: str = "client") -> Self:
        return cls(await connect(url, name=name), tenant=tenant, owns_connection=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop following events; close the connection if this client opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tap is not None:
            with contextlib.suppress(Exception):
                await self._tap.unsubscribe()
        for waiter in self._waiters.values():
            waiter.cancel()
        if self._owns:
            await self.nc.drain()

    def build_request(
        self,
        prompt: str | Iterable[ChatMessage | Mapping[str, str]],
        *,
        route: str,
        priority: str = "normal",
        request_id: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        max_cost: float | None = None,
        complexity: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> InferenceRequest:
        """Build and validate a request. ``timeout`` (seconds from now) sets ``deadline``.

        Raises :class:`MalformedRequestError` naming the bad field.
        """
        if isinstance(prompt, str):
            messages: list[Any] = [{"role": "user", "content": prompt}]
        else:
            messages = [
                msgspec.to_builtins(m) if isinstance(m, ChatMessage) else dict(m) for m in prompt
            ]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        now = time.time()
        raw = {
            "id": request_id or uuid.uuid4().hex,
            "tenant": self.tenant,
            "route": route,
            "messages": messages,
            "params": msgspec.to_builtins(
                GenerationParams(
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    stop=stop,
                    seed=seed,
                )
            ),
            "priority": priority,
            "deadline": deadline if timeout is None else now + timeout,
            "max_cost": max_cost,
            "complexity": complexity,
            "metadata": dict(metadata or {}),
            "submitted_at": now,
        }
        try:
            # Decoding validates every constraint (constructors do not).
            return REQUEST_DECODER.decode(msgspec.json.encode(raw))
        except msgspec.ValidationError as exc:
            raise MalformedRequestError(str(exc), request_id=str(raw["id"])) from exc

    async def submit(
        self, prompt: str | Iterable[ChatMessage | Mapping[str, str]], **options: Any
    ) -> RequestHandle:
        """Submit a request (see :meth:`build_request` for the options)."""
        return await self.submit_request(self.build_request(prompt, **options))

    async def submit_request(self, request: InferenceRequest) -> RequestHandle:
        """Submit a built request. Idempotent on ``request.id``."""
        await self._ensure_tap()
        waiter = self._waiters.get(request.id)
        if waiter is None:
            waiter = self._waiters[request.id] = asyncio.get_running_loop().create_future()
        try:
            ack = await self.js.publish(
                request_subject(request.priority, request.tenant),
                encode(request),
                headers={"Nats-Msg-Id": request.id},
            )
        except NoStreamResponseError as exc:
            self._waiters.pop(request.id, None)
            raise UnknownPriorityError(request.priority, request_id=request.id) from exc
        except BaseException:
            self._waiters.pop(request.id, None)
            raise
        if ack.duplicate:
            # The original may have ended before this client followed events.
            self._waiters.pop(request.id, None)
            return RequestHandle(self, request.id, request.tenant, duplicate=True)
        return RequestHandle(self, request.id, request.tenant, waiter=waiter)

    def handle(self, request_id: str) -> RequestHandle:
        """A handle for a request submitted earlier or elsewhere."""
        return RequestHandle(self, request_id, self.tenant, duplicate=True)

    # -------------------------------------------------------------- event tap

    async def _ensure_tap(self) -> None:
        async with self._tap_lock:
            if self._tap is not None:
                return
            self._tap = await self.js.subscribe(
                f"rq.evt.{self.tenant}.*.*",
                cb=self._on_event,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.NEW,
            )

    async def _on_event(self, msg: Any) -> None:
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        if is_terminal(event):
            waiter = self._waiters.pop(event.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(event)
