"""The async client: submit requests, stream their tokens, await their results.

::

    async with await Client.connect("nats://127.0.0.1:4222", tenant="acme") as client:
        handle = await client.submit("Hello!", route="chat-small", priority="high")
        async for chunk in handle.stream():
            print(chunk.text, end="")
        result = await handle.result()

Submits are idempotent: the request id is the JetStream message id, so a
resubmit with the same id (after a timeout, say) creates nothing new and the
returned handle follows the original request. A submit whose publish gets no
answer (the broker restarting, a connection lost) publishes again itself,
under the same id, for :attr:`Client.submit_patience` (30 s) or until the
request's deadline if sooner; only then does the caller get the error.

Results come from the event log. One consumer per client (the *tap*) follows
the tenant's events from the moment of the first submit and resolves waiting
handles; a handle for a request submitted elsewhere or earlier reads that
request's own events instead. Token streams are followed live on the token
subject, with stored chunks read back from ``RQ_TOKENS``, so a subscriber that
starts late or reconnects still gets every chunk, in order, once.

Every message is taken on its subject's word, never its payload's. A tenant
can make the server deliver its own stored messages to any subject (a push
consumer's ``deliver_subject`` is unchecked), so a live token is accepted only
if it arrived on exactly ``rq.tok.<tenant>.<request_id>``, and an event only
if its own consumer delivered it and its subject
``rq.evt.<tenant>.<request_id>.<kind>`` agrees with its payload. Tenants may
write only ``cancel_requested`` events, so a result always comes from an
event the services wrote. Anything else is dropped and counted
(``renqueue_misdirected_messages_total``).

Everything a client does works under a tenant's NATS permissions
(``nats/auth.conf``): every API subject it uses names the tenant's own
subjects. Under per-user permissions, connect with the user's inbox prefix::

    await Client.connect("nats://acme:PASSWORD@host:4222", tenant="acme",
                         inbox_prefix="_INBOX_acme")
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import msgspec

from .broker import (
    AckPolicy,
    Connection,
    DeliverPolicy,
    EventLog,
    Message,
    NatsClient,
    Subscription,
    connect,
    delete_consumer,
    read_subject,
    subject_agrees,
)
from .config import NatsConfig
from .errors import (
    MalformedRequestError,
    NatsClosedError,
    NatsError,
    NatsNoRespondersError,
    NatsPayloadTooLargeError,
    NatsUnavailableError,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    RequestRejectedError,
    TokensExpiredError,
    UnknownPriorityError,
)
from .logs import get_logger, misdirected
from .schema import (
    EVENT_DECODER,
    EVENTS_STREAM,
    REQUEST_DECODER,
    TOKEN_DECODER,
    TOKENS_STREAM,
    Cancelled,
    CancelRequested,
    ChatMessage,
    Completed,
    Event,
    Expired,
    Failed,
    GenerationParams,
    InferenceRequest,
    Rejected,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    Usage,
    encode,
    event_subject,
    is_terminal,
    kind_of,
    msg_id,
    request_limit,
    request_subject,
    token_subject,
)

__all__ = ["Client", "RequestHandle", "Result"]

T = TypeVar("T")

log = get_logger("client")

#: Failures of a read that pass by themselves: a timeout (nats-py's is a
#: TimeoutError too), no responders or a 503 while a stream leader is elected,
#: a connection that is reconnecting. A closed connection is not one of them.
_TRANSIENT: Final = (TimeoutError, NatsUnavailableError)
#: A transient failure of a read is retried after this, doubling up to _RETRY_MAX.
_RETRY_FIRST: Final = 0.1
_RETRY_MAX: Final = 2.0
#: Longest one try of a submit's publish waits for its ack (nats-py's default
#: for a JetStream request); a retry waits no longer than the time left.
_PUBLISH_WAIT: Final = 5.0


class _Published(enum.Enum):
    """What a submit's publish found (:meth:`Client._publish`)."""

    #: This submit stored the request.
    STORED = "stored"
    #: The request was stored before this submit (a resubmit of its id).
    DUPLICATE = "duplicate"
    #: A retry found the request stored after a try whose answer was lost:
    #: stored by that try, all but surely (the broker took it and its ack
    #: went missing), or by a resubmit of the same id at the same moment,
    #: which nothing on the wire tells apart.
    FOUND_ON_RETRY = "found_on_retry"


async def _retrying(
    nc: Connection, what: str, read: Callable[[], Awaitable[T]], **fields: Any
) -> T:
    """``await read()``, retried with a capped backoff while it fails transiently.

    For reads a caller waits on anyway (a stream's next chunk, a result): a
    broker that does not answer for a while (a reconnect, a node down) delays
    them, it does not end them. The caller's own timeout bounds the wait; a
    closed connection, or any other error, is raised.
    """
    delay = _RETRY_FIRST
    while True:
        try:
            return await read()
        except _TRANSIENT as exc:
            if nc.is_closed or isinstance(exc, NatsClosedError):
                raise
            log.warning(f"{what} failed; retrying", error=repr(exc), retry_in=delay, **fields)
            await asyncio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)


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


def _params(base: GenerationParams | None, **given: Any) -> GenerationParams:
    """``base`` (or the defaults) with the parameters ``given`` (not ``None``) in place."""
    changes = {name: value for name, value in given.items() if value is not None}
    if base is None:
        return GenerationParams(**changes)
    return msgspec.structs.replace(base, **changes) if changes else base


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


#: Live chunks a token follower holds for a reader that is not reading.
_LIVE_CHUNKS: Final = 4096


class _TokenFollower:
    """Every chunk of one request, in order, once: stored ones, then live ones.

    A core subscription to the token subject collects live chunks from the
    start. Stored chunks are read back only when there are any: a
    ``last_by_subj`` direct get says so, and only then a short-lived consumer
    filtered to this one subject replays them (:func:`read_subject`). In the
    common case (following from the submit) nothing is stored yet and no
    JetStream consumer is made: they are server-side objects, costly to create
    at hundreds of streams a second.

    Chunks are handed out by run (``delivery``) and ``seq``. A live chunk
    that skips ahead, a quiet spell of :attr:`IDLE` seconds and a reconnect
    all send the follower back to the store, so a stream ends whenever its
    final chunk is stored, even if its live copy was lost (a reconnect, a slow
    consumer), and a gap whose chunk was not yet committed (a cluster) is
    filled by a later read. A read that fails for a while (a timeout, no
    responders: the server restarting, a node down) is retried with a capped
    backoff, never raised. Once a newer run has begun (a ``restart`` chunk),
    chunks of older runs are void and dropped, late ones from a zombie run
    included.

    The final chunk carries its run and the run's next ``seq``: the stream
    ends once every chunk before it is handed out. A final chunk with
    ``seq`` 0 (a run that streamed nothing, or one written before final
    chunks carried their position) ends it after one more read of the store.

    Chunks are kept ``nats.tokens.max_age`` (1 h by default). A stream that
    cannot end from what is stored (its chunks aged out) would wait forever,
    so a quiet read of the store that finds nothing new looks the request's
    terminal event up: once the request has ended and one more read,
    :attr:`IDLE` seconds later, still finds nothing that ends the stream, it
    raises :class:`TokensExpiredError`; unless a run was handed out from its
    first chunk and only the final chunk is missing (the oldest chunks age
    out first, so that one is late, not gone: see :meth:`_check_expired`).
    """

    #: Seconds of silence after which the store is read again.
    IDLE = 2.0

    def __init__(self, client: Client, tenant: str, request_id: str) -> None:
        self._js = client.js
        self._nc = client.nc
        self._tenant = tenant
        self._request_id = request_id
        self._subject = token_subject(tenant, request_id)
        #: Live chunks not yet taken; bounded, so that a reader that stops
        #: reading holds at most this many (those past it are dropped, and read
        #: from the store when it reads on: a gap, or silence, sends it there).
        self._live: asyncio.Queue[TokenChunk] = asyncio.Queue(maxsize=_LIVE_CHUNKS)
        #: Chunks received and not yet handed out, by (run, seq).
        self._pending: dict[tuple[int, int], TokenChunk] = {}
        self._final: TokenChunk | None = None
        self._run = 0  # the run being handed out (0: none yet)
        self._next = 0  # the next seq of that run
        self._cursor = 1  # next stream sequence to read from the store
        #: Whether the store was read after the final chunk was seen.
        self._read_after_final = False
        #: Whether the store was read since the last chunk was handed out.
        self._read_since_take = False
        self._reconnects = 0
        #: The newest run seen live, and in the store (in stream order): a
        #: chunk of an older run that comes after one of a newer run is from a
        #: zombie (a worker presumed dead), and void.
        self._newest_live = 0
        self._newest_stored = 0
        #: The kind of the request's terminal event, once a quiet read found it.
        self._outcome: str | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        # Subscribe before reading the store, so nothing falls between the two.
        self._reconnects = self._nc.reconnects
        self._sub = await self._nc.subscribe(self._subject, cb=self._on_live)
        await self._read_store()

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(NatsError):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_live(self, msg: Message) -> None:
        # A tenant's push consumer can deliver its own stored messages here:
        # they keep the subject they were stored under. Only the services can
        # publish on this subject (or store on it), so it is the authority.
        if msg.subject != self._subject:
            misdirected("tokens", msg.subject)
            return
        with contextlib.suppress(msgspec.DecodeError):
            chunk = TOKEN_DECODER.decode(msg.data)
            if chunk.request_id == self._request_id:
                with contextlib.suppress(asyncio.QueueFull):
                    self._live.put_nowait(chunk)

    async def _read_store(self) -> None:
        """Read what the store has after the cursor; a transient failure (a
        reconnect, a stream leader election) is retried, never raised."""

        read = functools.partial(
            read_subject,
            self._nc,
            self._js,
            TOKENS_STREAM,
            self._subject,
            start=self._cursor,
            name=f"rq-tok-{self._tenant}",
        )
        stored = await _retrying(
            self._nc, "reading stored tokens", read, request_id=self._request_id
        )
        for seq, data in stored:
            self._cursor = seq + 1
            with contextlib.suppress(msgspec.DecodeError):
                chunk = TOKEN_DECODER.decode(data)
                if chunk.final or chunk.delivery >= self._newest_stored:
                    self._newest_stored = max(self._newest_stored, chunk.delivery)
                    self._add(chunk)
        self._read_since_take = True
        if self._final is not None:
            self._read_after_final = True

    def _add(self, chunk: TokenChunk) -> None:
        if chunk.request_id != self._request_id:
            return
        if chunk.final:
            if self._final is None or chunk.delivery >= self._final.delivery:
                self._final = chunk
            return
        if chunk.delivery < self._run or (chunk.delivery == self._run and chunk.seq < self._next):
            return  # a void run (zombie), or handed out already
        self._pending[(chunk.delivery, chunk.seq)] = chunk

    def _add_live(self, chunk: TokenChunk) -> None:
        if chunk.final or chunk.delivery >= self._newest_live:
            self._newest_live = max(self._newest_live, chunk.delivery)
            self._add(chunk)

    def _take(self) -> TokenChunk | None:
        """The next chunk in order, if it is here."""
        chunk = self._pending.pop((self._run, self._next), None)
        if chunk is None:
            if not self._read_since_take:
                return None  # the store may still have this run's missing chunks
            # A newer run that has begun voids what is left of this one.
            newer = sorted(run for run, seq in self._pending if run > self._run and seq == 0)
            if not newer:
                return None
            self._run, self._next = newer[-1], 0
            self._pending = {k: v for k, v in self._pending.items() if k[0] >= self._run}
            chunk = self._pending.pop((self._run, 0))
        self._next = chunk.seq + 1
        self._read_since_take = False
        return chunk

    def _ended(self) -> TokenChunk | None:
        """The final chunk, once nothing before it is still to come."""
        final = self._final
        if final is None:
            return None
        if final.seq > 0 and final.delivery >= self._run:
            if final.delivery == self._run and self._next >= final.seq:
                return final
            return None
        # seq 0 (the run streamed nothing), or a position that cannot be trusted
        # (a final chunk written before they carried their run's next seq).
        return final if self._read_after_final else None

    async def _check_expired(self) -> None:
        """After a quiet read that found nothing new: has the request ended?

        The first time it has, remember it (its final chunk may be being
        stored right now); the next time, the stored chunks cannot end the
        stream any more: they aged out of the store. Except when a run is
        being handed out from its first chunk and no final chunk is stored:
        chunks age out oldest first, so the final chunk was not written yet
        (its writer crashed after the terminal event; whoever settles the
        request's terminal claim writes it).
        """
        if self._outcome is not None:
            if self._run > 0 and self._final is None:
                return
            raise TokensExpiredError(request_id=self._request_id, outcome=self._outcome)
        try:
            event = await EventLog(self._js).terminal_of(self._tenant, self._request_id)
        except _TRANSIENT:
            return  # looked up again after the next quiet read
        if event is not None:
            self._outcome = kind_of(event)

    async def next(self) -> TokenChunk:
        """The next chunk in order; the final chunk last."""
        while True:
            chunk = self._take()
            if chunk is not None:
                return chunk
            final = self._ended()
            if final is not None:
                return final
            if (self._pending or self._final is not None) and not self._read_since_take:
                # Something is here but not the next chunk: it was missed live.
                await self._read_store()
                continue
            try:
                live = await asyncio.wait_for(self._live.get(), self.IDLE)
            except TimeoutError:
                cursor = self._cursor
                await self._read_store()  # quiet: the store may have what was missed
                if self._cursor == cursor:
                    await self._check_expired()
                continue
            self._add_live(live)
            while not self._live.empty():
                self._add_live(self._live.get_nowait())
            reconnects = self._nc.reconnects
            if reconnects != self._reconnects:
                self._reconnects = reconnects
                await self._read_store()  # live chunks were lost while disconnected


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
        waiter: asyncio.Future[Event] | None = None,
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
        follower = _TokenFollower(self._client, self.tenant, self.id)
        try:
            await asyncio.wait_for(follower.start(), timeout)
            while True:
                chunk = await asyncio.wait_for(follower.next(), timeout)
                if chunk.final:
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
        event = CancelRequested(
            request_id=self.id, tenant=self.tenant, at=time.time(), reason=reason[:500]
        )
        await EventLog(self._client.js, nc=self._client.nc).append(event)

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
        """For a request not followed from its submit: through this client's
        event tap when it is the client's tenant's (at once), else by polling
        the request's own events."""
        if self.tenant == self._client.tenant:
            return await self._client._follow_terminal(self.id)
        lookup = functools.partial(EventLog(self._client.js).terminal_of, self.tenant, self.id)
        delay = 0.05
        while True:
            event = await _retrying(
                self._client.nc, "looking up a result", lookup, request_id=self.id
            )
            if event is not None:
                return event
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


class _Waiter:
    """The future of one request's terminal event, shared by every handle of
    this client that follows it through the tap.

    ``holders`` counts the submits of the request still being published and
    the handles given the future: it is dropped only when none is left, so a
    submit whose publish raised, or was a duplicate, never takes it from a
    resubmit that shares it. ``stored``: a submit of this client stored the
    request (a publish that was no duplicate), after the tap was following
    events, so the tap (or a sweep of the log) sees its end.
    """

    __slots__ = ("future", "holders", "stored")

    def __init__(self, future: asyncio.Future[Event]) -> None:
        self.future = future
        self.holders = 0
        self.stored = False


class Client:
    """Submits requests for one tenant. Create with :meth:`connect` or from an open connection."""

    #: Idle heartbeat of the event tap; three missed ones mean it is gone.
    tap_heartbeat: float = 5.0
    #: How long the server keeps the tap while no one listens (a disconnect).
    tap_inactive_threshold: float = 30.0
    #: Seconds a submit that finds no stream (a cluster electing a leader, or a
    #: level that is not configured) is retried before UnknownPriorityError.
    no_stream_grace: float = 3.0
    #: Seconds a submit keeps publishing a request again while the broker does
    #: not answer (less if its deadline comes first); then the last error is
    #: raised. Keep it well inside ``nats.duplicate_window`` (10 minutes): a
    #: retry past the window would store a second copy of a stored request.
    submit_patience: float = 30.0

    def __init__(
        self,
        nc: Connection | NatsClient,
        *,
        tenant: str = "default",
        owns_connection: bool = False,
    ) -> None:
        self.nc = Connection.of(nc)
        self.js = self.nc.jetstream()
        self.tenant = tenant
        self._owns = owns_connection
        self._tap_sub: Subscription | None = None
        self._tap_name = ""
        self._tap_inbox = ""
        self._tap_cseq = 0  # consumer sequence of the last tap delivery
        self._tap_seen = -math.inf  # loop time of the last tap message or heartbeat; never
        self._tap_wake = asyncio.Event()  # a gap was seen: sweep the waiters
        self._tap_watch: asyncio.Task[None] | None = None
        self._tap_lock = asyncio.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._closed = False

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        tenant: str = "default",
        name: str = "client",
        inbox_prefix: str | None = None,
        user_credentials: str | None = None,
    ) -> Self:
        """Connect to ``url`` (``nats://user:password@host:port`` for a password user).

        ``inbox_prefix`` is the inbox the user may subscribe to (``_INBOX_acme``
        in ``nats/auth.conf``); ``user_credentials`` a NATS ``.creds`` file.
        """
        config = NatsConfig(credentials_file=user_credentials, inbox_prefix=inbox_prefix)
        return cls(
            await connect(url, name=name, config=config), tenant=tenant, owns_connection=True
        )

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
        watch, self._tap_watch = self._tap_watch, None
        if watch is not None:
            watch.cancel()
            await asyncio.wait({watch}, timeout=1.0)
        if self._tap_sub is not None:
            with contextlib.suppress(NatsError):
                await self._tap_sub.unsubscribe()
            self._tap_sub = None
            if not self.nc.is_closed:
                await delete_consumer(self.js, EVENTS_STREAM, self._tap_name)
        for waiter in self._waiters.values():
            waiter.future.cancel()
        if self._owns:
            await self.nc.drain()

    def build_request(
        self,
        prompt: str | Iterable[ChatMessage | Mapping[str, Any]],
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
        params: GenerationParams | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        max_cost: float | None = None,
        complexity: int | None = None,
        metadata: Mapping[str, str] | None = None,
        parent_id: str | None = None,
        dedupe_key: str | None = None,
        coalesce: bool = False,
    ) -> InferenceRequest:
        """Build and validate a request, without sending it (see :meth:`submit_request`).

        The parameters are those of :meth:`submit`. Raises
        :class:`MalformedRequestError` naming the bad field.
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
                _params(
                    params,
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
            "parent_id": parent_id,
            "dedupe_key": dedupe_key,
            "coalesce": coalesce,
        }
        try:
            # Decoding validates every constraint (constructors do not).
            return REQUEST_DECODER.decode(msgspec.json.encode(raw))
        except msgspec.ValidationError as exc:
            raise MalformedRequestError(str(exc), request_id=str(raw["id"])) from exc

    async def submit(
        self,
        prompt: str | Iterable[ChatMessage | Mapping[str, Any]],
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
        params: GenerationParams | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - sets the request's deadline
        deadline: float | None = None,
        max_cost: float | None = None,
        complexity: int | None = None,
        metadata: Mapping[str, str] | None = None,
        parent_id: str | None = None,
        dedupe_key: str | None = None,
        coalesce: bool = False,
    ) -> RequestHandle:
        """Submit a request; the handle streams its tokens and waits for its result.

        Idempotent on ``request_id``: submitting the same id again returns a
        handle on the original (``handle.duplicate``), within the stream's
        duplicate window.

        Args:
            prompt: The user's message, or the whole conversation as
                :class:`ChatMessage` objects (content parts, tool calls and
                tool results included) or mappings of their fields.
            route: The model group to run on (a ``[routes.<name>]`` of the config).
            priority: A level name from the config (``critical``, ``high``,
                ``normal``, ``low``, ``batch`` by default).
            request_id: The id (letters, digits, ``_``, ``-``; up to 128); a
                random one when ``None``. Scoped by tenant.
            system: A system message put before the prompt.
            max_tokens: Upper bound on generated tokens (backend default if ``None``).
            temperature: Sampling temperature (backend default if ``None``).
            top_p: Nucleus sampling (backend default if ``None``).
            stop: Stop sequences (backend default if ``None``).
            seed: Sampling seed, for backends that take one.
            params: Every generation parameter the wire carries (tools,
                ``tool_choice``, ``response_format``, penalties, logprobs,
                ``user``, pass-through ``extra``, ...); ``max_tokens``,
                ``temperature``, ``top_p``, ``stop`` and ``seed`` given
                as arguments too replace its own.
            timeout: Seconds from now until the deadline; overrides ``deadline``.
            deadline: The deadline as a Unix time in seconds. A request not
                finished by then ends expired. ``None``: no deadline.
            max_cost: A spend ceiling in US dollars: never bound to a backend
                whose estimated cost (prompt and ``max_tokens``, or 1024 output
                tokens, at its prices) is above it; rejected
                (``over_cost_cap``) when no backend of the route can meet it.
            complexity: The lowest backend tier that can do the job (0-100).
            metadata: Up to 64 string pairs carried along, for your own use.
            parent_id: A request this one is part of: it never runs at a lower
                effective priority than that parent (same tenant).
            dedupe_key: Requests of this tenant with the same key share one
                backend call.
            coalesce: Share a call with identical requests (same route,
                messages and parameters).

        A publish the broker does not answer (a restart, a lost connection)
        is sent again under the same id, with a capped backoff, for
        :attr:`submit_patience` seconds or until the deadline if sooner: the
        duplicate window (far longer) makes that safe, and a retry that finds its first
        try stored is not a duplicate (``handle.found_on_retry`` says so).

        Raises:
            MalformedRequestError: A parameter fails validation (the field is named).
            UnknownPriorityError: No stream takes ``priority``.
            NatsPayloadTooLargeError: The request is over what the broker takes.
            NatsUnavailableError: The broker did not answer for
                :attr:`submit_patience` (or until the deadline): the last try's error, often a
                :class:`NatsTimeoutError`. The request may have been stored
                all the same; submit it again with the same id to find out.
        """
        request = self.build_request(
            prompt,
            route=route,
            priority=priority,
            request_id=request_id,
            system=system,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            params=params,
            timeout=timeout,
            deadline=deadline,
            max_cost=max_cost,
            complexity=complexity,
            metadata=metadata,
            parent_id=parent_id,
            dedupe_key=dedupe_key,
            coalesce=coalesce,
        )
        return await self.submit_request(request)

    async def submit_request(self, request: InferenceRequest) -> RequestHandle:
        """Submit a built request. Idempotent on ``request.id``; retried as
        :meth:`submit` says."""
        if request.tenant != self.tenant:
            # Not on this client's tap: the handle reads the request's own events.
            return self._handle_on(request, await self._publish(request))
        await self._ensure_tap()
        # A handle or a submit of this client may already wait for this id (a
        # resubmit): they share one waiter, held until none of them needs it.
        waiter = self._waiters.get(request.id)
        if waiter is None:
            future = asyncio.get_running_loop().create_future()
            waiter = self._waiters[request.id] = _Waiter(future)
        waiter.holders += 1
        try:
            published = await self._publish(request)
        except BaseException:
            self._release(request.id, waiter)
            raise
        if published is _Published.STORED:
            waiter.stored = True
        elif not waiter.stored:
            # Stored before this client followed events (by another client,
            # or a publish whose ack was lost), or found by a retry (by this
            # submit's lost try, after the tap followed, or by a resubmit at
            # the same moment, maybe before): it may have ended already,
            # unseen by the tap. The handle reads the request's own events.
            self._release(request.id, waiter)
            return self._handle_on(request, published)
        return self._handle_on(request, published, waiter=waiter.future)

    def _handle_on(
        self,
        request: InferenceRequest,
        published: _Published,
        *,
        waiter: asyncio.Future[Event] | None = None,
    ) -> RequestHandle:
        """The handle a submit of ``request`` returns, saying what its publish found."""
        return RequestHandle(
            self,
            request.id,
            request.tenant,
            duplicate=published is _Published.DUPLICATE,
            found_on_retry=published is _Published.FOUND_ON_RETRY,
            waiter=waiter,
        )

    async def _follow_terminal(self, request_id: str) -> Event:
        """The terminal event of this tenant's request ``request_id``, submitted
        earlier or elsewhere: from the log if it has ended, else from the tap
        when it does (the waiter is registered before the log is read, so an
        end between the two is not missed)."""
        await self._ensure_tap()
        waiter = self._waiters.get(request_id)
        if waiter is None:
            future = asyncio.get_running_loop().create_future()
            waiter = self._waiters[request_id] = _Waiter(future)
        waiter.holders += 1
        try:
            lookup = functools.partial(EventLog(self.js).terminal_of, self.tenant, request_id)
            ended = await _retrying(self.nc, "looking up a result", lookup, request_id=request_id)
            if ended is not None:
                return ended
            return await asyncio.shield(waiter.future)
        finally:
            self._release(request_id, waiter)

    def _release(self, request_id: str, waiter: _Waiter) -> None:
        """A submit gives up its hold on ``waiter``; the last one drops it."""
        waiter.holders -= 1
        if waiter.holders <= 0 and self._waiters.get(request_id) is waiter:
            del self._waiters[request_id]

    async def _publish(self, request: InferenceRequest) -> _Published:
        """Publish ``request``: stored now, stored before (a resubmit), or
        found stored by a retry.

        "No responders" means no stream listens on the subject: the level is
        not configured, or, for a few seconds, a cluster is electing the
        stream's leader. So it is retried with the same message id (a publish
        is idempotent) for :attr:`no_stream_grace` seconds before it is taken
        to mean an unknown level.

        A publish the broker does not answer (no ack in time, a reconnect, a
        full outbound buffer, a 503) is retried with the same message id,
        after a capped backoff, for :attr:`submit_patience` seconds or until
        the request's deadline if sooner (never past the broker's duplicate
        window, which would store a second copy); then the last error is
        raised. A closed connection, and every other error (a request over
        the broker's limit, a refusal), is raised at once. A try that timed
        out may have been stored (its ack lost): a retry the broker reports
        as a duplicate then found that try, not someone else's request.
        """
        data = encode(request)
        limit = request_limit(self.nc.max_payload)
        if len(data) > limit:
            # Refused here: over the broker's limit the server would close
            # this connection, and every request on it would wait.
            raise NatsPayloadTooLargeError(
                f"request {request.id} is {len(data)} bytes, over the {limit} the broker "
                "takes (its max_payload less the services' headroom)"
            )
        loop = asyncio.get_running_loop()
        subject = request_subject(request.priority, request.tenant)
        headers = {"Nats-Msg-Id": msg_id(request.tenant, request.id)}
        patience = self.submit_patience
        if request.deadline is not None:
            patience = min(patience, request.deadline - time.time())
        give_up = loop.time() + patience
        no_stream_until: float | None = None
        no_stream_delay = 0.05
        delay = _RETRY_FIRST
        wait: float | None = None  # the first try waits as long as nats-py does
        maybe_stored = False  # an earlier try may be stored, its ack lost
        while True:
            try:
                ack = await self.js.publish(subject, data, headers=headers, timeout=wait)
            except NatsNoRespondersError as exc:
                now = loop.time()
                if no_stream_until is None:
                    no_stream_until = now + self.no_stream_grace
                if now + no_stream_delay > no_stream_until:
                    raise UnknownPriorityError(request.priority, request_id=request.id) from exc
                await asyncio.sleep(no_stream_delay)
                no_stream_delay = min(0.5, no_stream_delay * 2)
                continue
            except NatsClosedError:
                raise
            except _TRANSIENT as exc:
                if self.nc.is_closed:
                    raise
                maybe_stored = maybe_stored or isinstance(exc, TimeoutError)
                left = give_up - loop.time()
                if left <= delay:
                    raise  # the deadline (or the patience) allows no other try
                log.warning(
                    "the broker did not answer a submit; publishing it again under the same id",
                    request_id=request.id,
                    error=repr(exc),
                    retry_in=delay,
                )
                await asyncio.sleep(delay)
                wait = min(_PUBLISH_WAIT, left - delay)
                delay = min(_RETRY_MAX, delay * 2)
                no_stream_until = None
                continue
            if not ack.duplicate:
                return _Published.STORED
            return _Published.FOUND_ON_RETRY if maybe_stored else _Published.DUPLICATE

    def handle(self, request_id: str) -> RequestHandle:
        """A handle for a request submitted earlier or elsewhere."""
        return RequestHandle(self, request_id, self.tenant, duplicate=True)

    # -------------------------------------------------------------- event tap
    #
    # A named push consumer on RQ_EVENTS with the one filter rq.evt.<tenant>.*.*:
    # its create subject names the filter, so a tenant's permissions allow it
    # (an unnamed or ordered consumer's create subject does not, and cannot be
    # allowed without exposing every tenant). Push, not pull: a pull needs
    # $JS.API.CONSUMER.MSG.NEXT.<stream>.<name>, which no permission can confine
    # to a tenant's own consumers, and a callback cannot swallow a cancellation
    # the way a pending fetch can. Deliveries are unacknowledged; each carries
    # its consumer sequence and each idle heartbeat the last one sent, so a
    # loss (slow consumer, reconnect) shows as a gap, and silence as a consumer
    # that is gone (deleted after a long disconnect, or a server restart). On
    # either, the tap is re-created (a no-op if it still exists) and the
    # pending waiters are checked against the log: nothing is missed.

    async def _ensure_tap(self) -> None:
        async with self._tap_lock:
            if self._tap_sub is not None:
                return
            if self._closed:
                raise RuntimeError("client is closed")
            self._tap_name = f"rq-tap-{self.tenant}-{uuid.uuid4().hex[:16]}"
            self._tap_inbox = self.nc.new_inbox()
            sub = await self.nc.subscribe(self._tap_inbox, cb=self._on_tap)
            try:
                await self._create_tap()
            except BaseException:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
                raise
            self._tap_sub = sub
            self._tap_watch = asyncio.create_task(
                self._watch_tap(), name=f"renqueue-tap-{self._tap_name}"
            )

    async def _create_tap(self) -> None:
        """Create the tap consumer; with the same name and config, a no-op if it exists."""
        info = await self.js.add_consumer(
            EVENTS_STREAM,
            name=self._tap_name,
            filter_subject=event_subject(self.tenant, "*", "*"),
            deliver_subject=self._tap_inbox,
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.NONE,
            idle_heartbeat=self.tap_heartbeat,
            inactive_threshold=self.tap_inactive_threshold,
            mem_storage=True,
            num_replicas=1,
        )
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        self._tap_cseq = delivered or 0
        self._tap_seen = asyncio.get_running_loop().time()

    async def _watch_tap(self) -> None:
        loop = asyncio.get_running_loop()
        reconnects = self.nc.reconnects
        # A sweep of the log is owed (a gap or a re-created tap) until one succeeds.
        owed = False
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tap_wake.wait(), min(1.0, self.tap_heartbeat))
            if self.nc.is_closed:
                return  # closed under this client (not by it): nothing to follow
            gap = self._tap_wake.is_set()
            self._tap_wake.clear()
            # After a reconnect the server may have lost the (in-memory) tap:
            # don't wait for three missed heartbeats to find out.
            reconnected = self.nc.is_connected and self.nc.reconnects != reconnects
            if reconnected:
                reconnects = self.nc.reconnects
            silent = reconnected or loop.time() - self._tap_seen > 3 * self.tap_heartbeat
            owed = owed or gap or silent
            if not owed:
                continue
            try:
                if silent:
                    async with self._tap_lock:
                        await self._create_tap()
                    log.info("event tap re-created", consumer=self._tap_name)
                # What the tap missed is only in the log: a sweep that fails
                # (a direct get timing out while a node is down) is owed still,
                # though the re-created tap's heartbeats say all is well.
                await self._sweep()
                owed = False
            except Exception as exc:  # noqa: BLE001 - retried at the next beat
                log.warning("event tap recovery failed; retrying", error=str(exc))

    async def _sweep(self) -> None:
        """Resolve waiters whose terminal event the tap may have missed, from the log."""
        events = EventLog(self.js)
        limit = asyncio.Semaphore(32)

        async def check(request_id: str) -> None:
            async with limit:
                event = await events.terminal_of(self.tenant, request_id)
            if event is not None:
                self._resolve(event)

        results = await asyncio.gather(
            *(check(rid) for rid in list(self._waiters)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def _on_tap(self, msg: Message) -> None:
        self._tap_seen = asyncio.get_running_loop().time()
        headers = msg.headers
        if headers and headers.get("Status"):
            # An idle heartbeat carries the last consumer sequence sent.
            last = headers.get("Nats-Last-Consumer")
            if last is not None and last.isdigit() and int(last) > self._tap_cseq:
                self._tap_cseq = int(last)
                self._tap_wake.set()
            return
        try:
            meta = msg.metadata
        except Exception:  # noqa: BLE001 - not a JetStream delivery: not ours
            misdirected("tap", msg.subject)
            return
        if meta.stream != EVENTS_STREAM or meta.consumer != self._tap_name:
            # Another consumer delivering to this inbox (its name is in the
            # delivery's reply subject, which the server sets).
            misdirected("tap", msg.subject, consumer=meta.consumer)
            return
        cseq = meta.sequence.consumer
        if cseq != self._tap_cseq + 1:
            self._tap_wake.set()
        self._tap_cseq = cseq
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        # The subject is the authority: a payload must be what its subject
        # says (kind, tenant, request id). Tenants may publish only on
        # rq.evt.<tenant>.*.cancel_requested, so a terminal event that agrees
        # with its subject was written by the services.
        if event.tenant != self.tenant or not subject_agrees(msg.subject, event):
            misdirected("tap", msg.subject, kind=kind_of(event))
            return
        if is_terminal(event):
            self._resolve(event)

    def _resolve(self, event: Event) -> None:
        waiter = self._waiters.pop(event.request_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(event)
