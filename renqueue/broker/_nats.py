"""The one boundary with nats-py: typed handles on a connection, and its errors as ours.

Every other module talks to NATS through the handles here — :class:`Connection`,
:class:`JetStream`, :class:`KeyValue`, :class:`Message`, :class:`Subscription`,
:class:`PullSubscription`, :class:`KeyWatcher` — which expose the part of
nats-py Ren-Queue uses, under nats-py's own names and signatures, and nothing
else. They are the only place a nats-py exception is caught: each call raises
a :class:`renqueue.errors.NatsError` instead (``raise ... from`` the original),
by what a caller can do about it::

    NatsError                     any other NATS failure
    ├── NatsUnavailableError      the broker did not answer: no responders, no
    │   │                         stream leader (a 503, with or without a
    │   │                         code, or a "not now" code), a reconnect, a
    │   │                         full outbound buffer: try again
    │   ├── NatsTimeoutError      no answer in time (also a TimeoutError); an
    │   │                         empty fetch
    │   ├── NatsNoRespondersError nobody listens on a request's subject (for a
    │   │                         JetStream publish: no stream stores it)
    │   ├── NatsClosedError       the connection is closed: it will not come back
    │   └── StoreFullError        a stream at its max_bytes (discard new), or the
    │                             server's store full: nothing stored
    ├── NatsNotFoundError         no such message, key, stream, consumer or bucket
    ├── WrongLastSequenceError    a compare-and-set found its subject moved on
    └── NatsApiError              JetStream refused the operation (status, err_code)
        └── TenantBacklogFullError  a submit past router.tenant_backlog (err_code
                                    10077, "maximum messages per subject exceeded")

Data that JetStream returns (publish acks, stored messages, KV entries, stream
and consumer info) and the configs it takes are nats-py's plain dataclasses,
re-exported here under the names the rest of the code uses, so nothing else
imports ``nats``; a test keeps it that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import math
import re
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import msgspec
import nats.aio.client
import nats.aio.subscription
import nats.aio.transport
import nats.errors
import nats.js.errors
from nats.aio.client import Client as _NatsPyClient
from nats.aio.msg import Msg as _Msg
from nats.aio.subscription import Subscription as _Subscription
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    PubAck,
    RawStreamMsg,
    StreamInfo,
)
from nats.js.client import JetStreamContext as _JetStreamContext
from nats.js.kv import KeyValue as _KeyValue

from ..errors import (
    ConnectionFailedError,
    NatsApiError,
    NatsClosedError,
    NatsError,
    NatsNoRespondersError,
    NatsNotFoundError,
    NatsPayloadTooLargeError,
    NatsTimeoutError,
    NatsUnavailableError,
    StoreFullError,
    TenantBacklogFullError,
    WrongLastSequenceError,
)
from ..logs import get_logger

__all__ = [
    "API_TIMEOUT",
    "CONSUMER_EXISTS",
    "CONSUMER_NOT_FOUND",
    "NOT_NOW",
    "PUBLISH_STALL_WAIT",
    "STORE_FULL",
    "STREAM_NAME_IN_USE",
    "STREAM_NOT_FOUND",
    "WRONG_LAST_SEQUENCE",
    "AckPolicy",
    "Connection",
    "ConsumerConfig",
    "ConsumerInfo",
    "DeliverPolicy",
    "JetStream",
    "JetStreamApi",
    "KeyEntry",
    "KeyValue",
    "KeyWatcher",
    "Message",
    "MessageMetadata",
    "NatsClient",
    "PubAck",
    "PullSubscription",
    "StoredMessage",
    "StreamInfo",
    "Subscription",
    "reply_error",
    "translate",
    "wire_size",
]

_T = TypeVar("_T")


class StoredMessage(msgspec.Struct, frozen=True):
    """One message stored in a stream, as a direct or API get returns it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None = None
    #: When the stream stored it (the server's clock).
    time: datetime.datetime | None = None

    @classmethod
    def of(cls, raw: RawStreamMsg) -> StoredMessage:
        return cls(raw.seq or 0, raw.subject or "", raw.data or b"", raw.headers, raw.time)


class KeyEntry(msgspec.Struct, frozen=True):
    """One KV entry (a value: a get never returns a delete marker)."""

    key: str
    value: bytes
    revision: int
    #: ``None`` for a value; ``"DEL"`` or ``"PURGE"`` for a watched delete.
    operation: str | None = None

    @classmethod
    def of(cls, entry: _KeyValue.Entry) -> KeyEntry:
        return cls(entry.key, entry.value or b"", entry.revision or 0, entry.operation)


#: Longest a ``publish_async`` waits for a free slot among the context's
#: pending publishes (then :class:`~renqueue.errors.NatsUnavailableError`).
PUBLISH_STALL_WAIT: Final = 5.0

#: nats-py's own client: an application may hand one to :meth:`Connection.of`.
NatsClient = _NatsPyClient
#: A JetStream delivery's metadata: stream and consumer sequence, deliveries, time.
MessageMetadata = _Msg.Metadata

#: JetStream's "wrong last sequence" errors: a compare-and-set found the
#: subject (a KV key) moved on. 10164 is what a clustered stream sends.
WRONG_LAST_SEQUENCE: Final = frozenset({10071, 10164})
#: JSStreamStoreFailedF: a publish the stream refused to store; its
#: description says why ("maximum messages per subject exceeded", ...).
_STORE_FAILED: Final = 10077
#: JetStream API errors that mean "not now" (nats-server's errors.json),
#: besides any with the HTTP-like code 503. Every other error is a refusal.
NOT_NOW: Final = frozenset(
    {
        10004,  # incomplete results
        10005,  # no suitable peers for placement (a node is still joining)
        10008,  # JetStream system temporarily unavailable (no quorum)
        10009,  # JetStream cluster can not handle request (no leader)
        10076,  # JetStream not enabled (not yet)
        10118,  # stream is offline
        10119,  # consumer is offline
        10167,  # too many requests
        10202,  # cluster member change in progress
    }
)

#: JetStream's "no room" errors (both with status 503): 10077, a stream's
#: limit with ``discard: new`` ("maximum bytes exceeded"; also its messages
#: limit), and 10023, the server's or account's store ("insufficient resources").
STORE_FULL: Final = frozenset({10077, 10023})

#: JetStream API error codes that the provisioning steps act on.
STREAM_NOT_FOUND: Final = 10059
STREAM_NAME_IN_USE: Final = 10058
CONSUMER_NOT_FOUND: Final = 10014
CONSUMER_EXISTS: Final = 10148
#: "delete failed": its description says why (``no message found`` among others).
_MSG_DELETE_FAILED: Final = 10057

#: JetStream API errors that say "no such thing", whatever their status code.
_NOT_FOUND: Final = frozenset(
    {
        10014,  # consumer not found
        10037,  # no message found
        10043,  # sequence not found
        10059,  # stream not found
    }
)

_UNAVAILABLE: Final = (
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionDrainingError,
    nats.js.errors.TooManyStalledMsgsError,
)
#: nats-py's other errors, by what they become (in order: the first match wins).
_BY_TYPE: Final[tuple[tuple[tuple[type[Exception], ...], type[NatsError]], ...]] = (
    ((nats.errors.TimeoutError,), NatsTimeoutError),  # fetch and flush timeouts too
    ((nats.errors.MaxPayloadError,), NatsPayloadTooLargeError),
    ((nats.errors.ConnectionClosedError,), NatsClosedError),
    ((nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError), NatsNoRespondersError),
    (_UNAVAILABLE, NatsUnavailableError),
)


def wire_size(payload: bytes, headers: Mapping[str, str] | None = None) -> int:
    """Bytes a message counts against the server's ``max_payload``: its payload
    and its headers as nats-py writes them (``NATS/1.0``, ``Key: value`` lines,
    each ended by CRLF, and a blank line). An upper bound: nats-py trims values."""
    if headers is None:  # {} is an HPUB too: nats-py sends its (empty) header block
        return len(payload)
    size = len(payload) + _HEADER_FRAME
    for key, value in headers.items():  # a loop, not a generator: on every publish
        size += len(key.encode()) + len(str(value).encode()) + 4
    return size


#: The header block's own bytes: ``NATS/1.0`` and its CRLF, and the blank line's.
_HEADER_FRAME: Final = len(b"NATS/1.0\r\n") + 2


def _refuse_oversized(
    connection: Connection, payload: bytes, headers: Mapping[str, str] | None
) -> None:
    """Raise :class:`NatsPayloadTooLargeError` for a message over the server's
    ``max_payload``, headers counted. nats-py checks the payload alone; the
    server counts both and closes the connection of a client that sends more
    (``maximum payload exceeded``), after which nats-py does not reconnect:
    one oversized message would cut every loop of the process off."""
    size = len(payload) if headers is None else wire_size(payload, headers)
    if size > connection._nc._max_payload:  # not through two properties: on every publish
        raise NatsPayloadTooLargeError(
            f"a message of {size} bytes (headers included) is over the server's "
            f"max_payload of {connection.max_payload}"
        )


def translate(exc: BaseException) -> BaseException:
    """``exc`` as a :class:`~renqueue.errors.NatsError` if it is nats-py's, else itself.

    The one mapping from nats-py's exceptions to ours (see the module
    docstring). The caller raises the result ``from exc``.
    """
    if isinstance(exc, NatsError) or not isinstance(exc, nats.errors.Error):
        return exc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, nats.js.errors.APIError):
        return _api_error(exc, text)
    for kinds, ours in _BY_TYPE:
        if isinstance(exc, kinds):
            return ours(text)
    return NatsError(text)


def _api_error(exc: nats.js.errors.APIError, text: str) -> NatsError:
    # nats-py's KV errors do not always set the API error's fields.
    status: int | None = getattr(exc, "code", None)
    err_code: int | None = getattr(exc, "err_code", None)
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or (
        err_code in WRONG_LAST_SEQUENCE
    ):
        return WrongLastSequenceError(text)
    description = getattr(exc, "description", None)
    if (
        isinstance(exc, nats.js.errors.NotFoundError)
        or err_code in _NOT_FOUND
        or (err_code == _MSG_DELETE_FAILED and _says_gone(str(description)))
    ):
        return NatsNotFoundError(text)  # KV keys and buckets too; a delete of what is gone
    if err_code == _STORE_FAILED and "per subject" in str(description):
        # A stream's max_msgs_per_subject with discard_new_per_subject: on
        # RQ_REQUESTS, router.tenant_backlog (a 503, but no "not now": refused).
        return TenantBacklogFullError(str(description), status=status, err_code=err_code)
    if err_code in STORE_FULL:
        return StoreFullError(str(description or text), err_code=err_code)
    if (
        isinstance(exc, nats.js.errors.ServiceUnavailableError)
        or status == 503
        or err_code in NOT_NOW
    ):
        # A 503 status on a pull's reply (a restarting server, a consumer
        # without a leader) comes as nats-py's ServiceUnavailableError without
        # a code: it is the same "not now" as a 503 API error.
        return NatsUnavailableError(text)
    return NatsApiError(description or text, status=status, err_code=err_code)


def _says_gone(description: str) -> bool:
    """Whether a failed delete's description says the message is not there."""
    return "no message found" in description.lower()


async def _call(operation: Awaitable[_T]) -> _T:
    """``await operation``, its nats-py errors translated."""
    try:
        return await operation
    except nats.errors.Error as exc:
        raise translate(exc) from exc


class _AckFuture(asyncio.Future[PubAck]):
    """The future of a publish's ack that :class:`_Context` registers with
    nats-py: one future per publish, whose errors are ours. Whatever sets an
    exception on it (nats-py's ack handler, our own, a timeout) sets the
    one :func:`translate` makes of it, so nothing relays it through a second future (a
    done callback and a turn of the event loop more on every publish, and a
    request makes several)."""

    def set_exception(self, exception: type[BaseException] | BaseException) -> None:
        if isinstance(exception, type):
            exception = exception()
        ours = translate(exception)
        if ours is not exception:
            ours.__cause__ = exception  # as ``raise ours from exception`` would
        super().set_exception(ours)


class _Relay(asyncio.Future[PubAck]):
    """The future :meth:`JetStream.publish_async` returns over a context that is
    not a :class:`_Context` (nats-py's own, as an application or a test may
    hand one): it ends as nats-py's (``source``) does, with nats-py's errors
    translated, and cancelling it cancels ``source`` (nats-py then frees its
    pending slot)."""

    def __init__(self, source: asyncio.Future[PubAck]) -> None:
        super().__init__(loop=source.get_loop())
        self._source = source
        source.add_done_callback(self._relay)

    def cancel(self, msg: Any | None = None) -> bool:
        if not self._source.done():
            self._source.cancel()
        return super().cancel(msg)

    def _relay(self, done: asyncio.Future[PubAck]) -> None:
        if self.done():
            return
        if done.cancelled():
            super().cancel()
        elif (exc := done.exception()) is not None:
            self.set_exception(translate(exc))
        else:
            self.set_result(done.result())


class _AckReply(msgspec.Struct):
    """A JetStream publish ack as the server writes it (JSON): the fields
    :class:`PubAck` has, or an ``error``. Unknown fields are ignored, as
    nats-py's ``PubAck.from_response`` ignores them."""

    stream: str | None = None
    seq: int | None = None
    domain: str | None = None
    duplicate: bool | None = None
    batch: str | None = None
    count: int | None = None
    val: str | None = None
    error: dict[str, Any] | None = None


_ACK_DECODER: Final = msgspec.json.Decoder(_AckReply)
#: The header of a status reply, and the status that says no stream stored it.
_STATUS: Final = "Status"
_NO_RESPONDERS: Final = "503"


def _pub_ack(data: bytes) -> PubAck:
    """The :class:`PubAck` in a publish's reply; nats-py's (typed) ``APIError``
    if the reply is a JetStream error. What nats-py 2.16 reads, with msgspec
    instead of ``json`` and a dataclass built field by field (a reply whose
    fields are not of the expected types is read as nats-py reads it)."""
    try:
        reply = _ACK_DECODER.decode(data)
    except msgspec.DecodeError:
        response = json.loads(data)
        if "error" in response:
            nats.js.errors.APIError.from_error(response["error"])  # raises the typed error
        return PubAck.from_response(response)
    if reply.error is not None:
        nats.js.errors.APIError.from_error(reply.error)  # raises the typed error
    if reply.stream is None or reply.seq is None:
        # nats-py's ``PubAck.from_response`` raised a TypeError on it (the
        # future then waited for good): no stream stored it, as far as it says.
        raise nats.errors.Error(f"a reply to a publish that is not an ack: {data[:200]!r}")
    return PubAck(
        stream=reply.stream,
        seq=reply.seq,
        domain=reply.domain,
        duplicate=reply.duplicate,
        batch_id=reply.batch,
        batch_size=reply.count,
        val=reply.val,
    )


#: The last token of a reply subject, after its context's or its client's own
#: prefix (which holds a NUID of its own), is the next of these in hex
#: (``format(next(_TOKENS), "x")``, written out where it is used: a call less
#: on every request): unique within the process, and not as long as nats-py's
#: NUIDs (22 characters, 26 with its random bytes), so never one of theirs.
#: nats-py draws a NUID (a loop over its characters) and two random bytes (a
#: ``urandom`` system call) per request.
_TOKENS: Final = itertools.count(1)


log = get_logger("nats")

#: nats-py's private parts this module relies on (``pyproject.toml`` pins 2.16),
#: on its client and on its JetStream context. :func:`_require_nats_py_parts`
#: checks them when a connection or a context is made: a nats-py that moved one
#: fails at start, saying which, instead of misbehaving (a request registered
#: where no reply handler looks waits out its timeout, every time).
_CLIENT_PARTS: Final = (
    "_resp_map",  # where _request_sub_callback finds a request's future
    "_resp_sub_prefix",
    "_init_request_sub",
    "_request_sub_callback",
    "_process_msg",  # _Client overrides it: replies and acks taken inline
    "_build_message",
    "_error_cb",  # _Client._report: what the reading task reports goes there
    "stats",
    "_skip_subject_validation",  # _Client.publish: nats-py's own, in one call
    "_max_pending_size",
    "_max_payload",
    "_flush_queue",
    "_flush_pending",
    "_request_new_style",  # what request() calls: _Client overrides it
    "_parse_header_lines",  # what _process_headers calls: _Client overrides it
    "_process_headers",
    "_inbox_prefix",
    "_nuid",
    "_transport",  # Connection.attempt_failed, _close
    "_connect_to_server",  # _Client overrides it (and _process_connect_init)
    "_process_connect_init",
    "_status",  # _close: what nats-py's close did not finish, this does
    "_pending",
    "_pending_data_size",
    "_reconnection_task",
    "_reading_task",
    "_ping_interval_task",
    "_flusher_task",
    "_subs",
)
#: What :func:`_close` reaches inside a TCP transport (to let its socket go)
#: and a subscription (to end its task; and its count of messages, which
#: :meth:`_Client._process_msg` keeps): attributes its ``__init__`` sets.
_TRANSPORT_PARTS: Final = ("_io_writer", "_bare_io_writer")
_SUBSCRIPTION_PARTS: Final = ("_wait_for_msgs_task", "_received")
_CONTEXT_PARTS: Final = (
    "_publish_async_futures",  # where the ack handler finds a publish's future
    "_publish_async_completed_event",
    "_publish_async_pending_semaphore",
    "_async_reply_prefix",
    "_init_async_reply",
    "_handle_async_reply",  # what _init_async_reply subscribes: _Context overrides it
    "_timeout",
    "_prefix",
)


def _require_nats_py_parts(
    owner: object, base: type, parts: tuple[str, ...], checked: set[type]
) -> None:
    """Raise a ``RuntimeError`` naming the parts of nats-py's ``base`` (a
    method the class lacks, an attribute ``owner`` lacks) this module relies
    on and does not find. Classes are checked once, instances every time
    (cheap: a handful of ``hasattr``)."""
    missing = [name for name in parts if not hasattr(owner, name)]
    if base not in checked:
        missing += [
            f"{base.__name__}.{name}"
            for name in parts
            if callable(getattr(type(owner), name, None)) and not hasattr(base, name)
        ]
        if not missing:
            checked.add(base)
    if missing:
        raise RuntimeError(
            "this nats-py is not the one renqueue.broker relies on (pyproject.toml pins "
            f"nats-py 2.16: its private parts): missing {', '.join(sorted(set(missing)))}"
        )


def _require_close_parts(checked: set[type]) -> None:
    """:func:`_require_nats_py_parts` for what a close reaches in nats-py's TCP
    transport and subscriptions, on an instance of each (made once a process:
    neither does any I/O when made)."""
    transport = nats.aio.transport.TcpTransport
    subscription = nats.aio.subscription.Subscription
    if transport not in checked:
        made = transport()  # type: ignore[no-untyped-call]  # nats-py: unannotated
        _require_nats_py_parts(made, transport, _TRANSPORT_PARTS, checked)
    if subscription not in checked:
        _require_nats_py_parts(subscription(None), subscription, _SUBSCRIPTION_PARTS, checked)


_CHECKED: Final[set[type]] = set()

#: Each client's contexts (:class:`_Context`): a close ends their acks' futures.
_CONTEXTS: Final[weakref.WeakKeyDictionary[_NatsPyClient, weakref.WeakSet[_Context]]] = (
    weakref.WeakKeyDictionary()
)


class _Context(_JetStreamContext):
    """nats-py's JetStream context, with its asynchronous acks' errors delivered,
    and every publish's ack read from one subscription.

    nats-py 2.16 reads a ``publish_async`` ack that is a JetStream error with
    ``APIError.from_error``, which raises instead of returning: the error
    escaped its reply handler to the connection's error callback, and the
    publish's future went on waiting for its timeout. A stream at its byte
    limit (``store_full``), a wrong expected sequence: each publish waited out
    its ack timeout, as if the broker did not answer. Here the error ends the
    future, as nats-py means it to. And a ``publish_async`` whose publish
    raises ends the future it registered (:meth:`publish_async`) instead of
    leaving it pending, holding one of the context's pending slots for good.

    Per message, what nats-py does costs a request several futures, timers
    and turns of the event loop; here (measured in ``bench/pipeline.py``):
    one future per publish (an :class:`_AckFuture`, registered where
    nats-py's reply handler finds it); its token a counter
    (:data:`_TOKENS`); acks read with msgspec; and a
    publish that waits for its ack (:meth:`publish_acked`) is a request
    without a timer of its own (:func:`_request`), instead of nats-py's
    request (a future, a done callback, ``wait_for``'s future and timer).
    """

    def __init__(self, conn: _NatsPyClient, **params: Any) -> None:
        super().__init__(conn, **params)
        _require_nats_py_parts(self, _JetStreamContext, _CONTEXT_PARTS, _CHECKED)
        _CONTEXTS.setdefault(conn, weakref.WeakSet()).add(self)

    async def publish_async(  # noqa: PLR0917 - nats-py's signature
        self,
        subject: str,
        payload: bytes = b"",
        wait_stall: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> asyncio.Future[PubAck]:
        """nats-py 2.16's ``publish_async``, but a publish that raises (its
        outbound buffer full while reconnecting, a closing connection, a
        cancellation while it flushes) cancels the future it registered. In
        nats-py that future stayed pending for good and held one of the
        context's pending slots: a reconnect under load refused thousands,
        and once they held every slot no ``publish_async`` on the connection
        got one again."""
        if not self._async_reply_prefix:
            await self._init_async_reply()
        assert self._async_reply_prefix
        hdr = headers
        if stream is not None:
            hdr = {**(hdr or {}), "Nats-Expected-Stream": stream}
        if msg_ttl is not None:
            hdr = {**(hdr or {}), "Nats-TTL": str(int(msg_ttl))}
        slots = self._publish_async_pending_semaphore
        try:
            if wait_stall is None:
                await slots.acquire()
            else:
                await asyncio.wait_for(slots.acquire(), timeout=wait_stall)
        except (TimeoutError, asyncio.CancelledError):
            raise nats.js.errors.TooManyStalledMsgsError from None
        key = format(next(_TOKENS), "x")
        inbox = self._async_reply_prefix[:]
        inbox.extend(key.encode())
        future = _AckFuture()
        futures = self._publish_async_futures

        def handle_done(_: asyncio.Future[PubAck]) -> None:
            futures.pop(key, None)
            if not futures:
                self._publish_async_completed_event.set()
            slots.release()

        future.add_done_callback(handle_done)
        futures[key] = future
        self._publish_async_completed_event.clear()
        try:
            await self._nc.publish(subject, payload, reply=inbox.decode(), headers=hdr)
        except BaseException:
            future.cancel()  # nothing was sent, or nothing can be told of it
            raise
        return future

    async def publish_acked(
        self,
        subject: str,
        payload: bytes,
        *,
        timeout: float,  # noqa: ASYNC109 - nats-py's own parameter
        headers: dict[str, Any] | None,
    ) -> PubAck:
        """Publish and wait up to ``timeout`` for the ack, as nats-py's ``publish``
        (the same errors), as a request on the client's one reply subscription
        with one future and no timer of its own (:func:`_request`). Not on this
        context's asynchronous acks' subscription: a context made per call
        (``Connection.jetstream(timeout=...)``) would subscribe once more per
        context, for the connection's life. It takes none of
        ``publish_async``'s pending slots: the caller waits for its ack."""
        msg = await _request(self._nc, subject, payload, timeout, headers)
        if msg.headers and msg.headers.get(_STATUS) == _NO_RESPONDERS:
            raise nats.js.errors.NoStreamResponseError  # no stream stores the subject
        try:
            return _pub_ack(msg.data)
        except nats.errors.Error:
            raise
        except Exception as exc:  # not JSON, not an ack or an error: told, typed
            text = f"a reply to a publish that is not an ack: {type(exc).__name__}: {exc}"
            raise nats.errors.Error(text) from exc

    async def _init_async_reply(self) -> None:
        await super()._init_async_reply()
        if isinstance(self._nc, _Client):
            assert self._async_reply_prefix
            self._nc.take_inline(self._async_reply_prefix, self._ack_arrived)

    async def _handle_async_reply(self, msg: _Msg) -> None:
        """What nats-py's subscription calls (a client not a :class:`_Client`)."""
        self._ack_arrived(msg)

    def _ack_arrived(self, msg: _Msg) -> None:
        """An ack (or an error) for a publish of this context: ends its future.

        nats-py 2.16's ``_handle_async_reply``, but the ack read with msgspec,
        and an error ending the future instead of escaping (nats-py's
        ``APIError.from_error`` raises)."""
        # The token is the reply subject's tail, as nats-py reads it.
        token = msg.subject[len(self._async_reply_prefix or b"") :]
        future = self._publish_async_futures.get(token)
        if future is None or future.done():
            return
        headers = msg.headers
        if headers and headers.get(_STATUS) == _NO_RESPONDERS:
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            ack = _pub_ack(msg.data)
        except nats.errors.Error as exc:
            future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - not JSON, not an ack or an error: told
            # Whoever can publish to the reply subject can send anything: the
            # publish ends with an error instead of waiting for good (an
            # exception escaping here goes to the error callback, not to it).
            text = f"a reply to a publish that is not an ack: {type(exc).__name__}: {exc}"
            future.set_exception(nats.errors.Error(text))
        else:
            future.set_result(ack)


def _nats_py_constant(name: str) -> Any:
    """nats-py 2.16's private constant ``name`` of ``nats.aio.client``: a nats-py
    without it fails when this module is imported, naming it (as
    :func:`_require_nats_py_parts` does for a connection's parts)."""
    try:
        return getattr(nats.aio.client, name)
    except AttributeError:
        raise RuntimeError(
            "this nats-py is not the one renqueue.broker relies on (pyproject.toml pins "
            f"nats-py 2.16: its private parts): missing nats.aio.client.{name}"
        ) from None


def _nats_py_part(owner: type, name: str) -> Any:
    """nats-py 2.16's private helper ``name`` of the class ``owner``: a nats-py
    without it fails when this module is imported, naming it."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise RuntimeError(
            "this nats-py is not the one renqueue.broker relies on (pyproject.toml pins "
            f"nats-py 2.16: its private parts): missing {owner.__qualname__}.{name}"
        ) from None


#: nats-py's helpers for what :func:`_last_direct` and :func:`_metadata_of`
#: read: a direct get's time and error, a delivery's metadata with a domain.
_parse_utc_iso: Final[Callable[[str], datetime.datetime]] = _nats_py_part(
    RawStreamMsg, "_parse_utc_iso"
)
_metadata_from_reply: Final[Callable[[str], MessageMetadata]] = _nats_py_part(
    _Msg.Metadata, "_from_reply"
)
_api_error_from_msg: Final[Callable[[_Msg], Any]] = _nats_py_part(
    nats.js.errors.APIError, "from_msg"
)

#: nats-py 2.16's own patterns and states, for :meth:`_Client.publish`.
_SUBJECT_INVALID: Final[re.Pattern[str]] = _nats_py_constant("_SUBJECT_INVALID_RE")
_HEADER_KEY: Final[re.Pattern[str]] = _nats_py_constant("_HEADER_KEY_RE")
_HEADER_VALUE_NEWLINES: Final[dict[int, str]] = _nats_py_constant("_HEADER_VALUE_NEWLINES")
_CLOSED: Final = _NatsPyClient.CLOSED
_DRAINING_PUBS: Final = _NatsPyClient.DRAINING_PUBS
_CONNECTED: Final = _NatsPyClient.CONNECTED
_DRAINING_SUBS: Final = _NatsPyClient.DRAINING_SUBS


def _header_block(headers: Mapping[str, str]) -> bytes:
    """nats-py 2.16's header block (``_send_publish``): names trimmed, an empty
    one skipped, one that is not a token refused, values trimmed and their
    line breaks made spaces."""
    lines = [b"NATS/1.0\r\n"]
    for name, value in headers.items():
        key = name.strip()
        if not key:
            continue
        if not _HEADER_KEY.fullmatch(key):
            raise nats.errors.BadHeaderError(key)
        value_bytes = value.strip().translate(_HEADER_VALUE_NEWLINES).encode()
        lines.append(b"%b: %b\r\n" % (key.encode(), value_bytes))
    lines.append(b"\r\n")
    return b"".join(lines)


def _expire_request(future: asyncio.Future[_Msg]) -> None:
    """A request's deadline passed: no reply in time."""
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


class _Deadlines:
    """When each of a client's requests stops waiting for its reply, watched by
    one timer set for the earliest.

    A timer per request (``call_later``, and its ``cancel`` when the reply
    came: seven calls into asyncio, and the event loop's heap) cost every
    direct get and acked publish, about five a request. Here a request is a
    dict entry, and the timer moves only when a request's deadline comes
    before the one it is set for: with requests of one timeout, when it goes
    off (a deadline that, its reply come, usually no longer counts). A
    request still ends at its deadline, not later."""

    __slots__ = ("_at", "_timer", "_waiting")

    def __init__(self) -> None:
        self._waiting: dict[asyncio.Future[_Msg], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        #: When the timer goes off: never while none is set.
        self._at = math.inf

    def watch(
        self, future: asyncio.Future[_Msg], timeout: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        """End ``future`` with ``nats.errors.TimeoutError`` in ``timeout`` seconds
        unless it ends, or is :meth:`forget`-ten, before."""
        deadline = loop.time() + timeout
        self._waiting[future] = deadline
        if self._timer is None or deadline < self._at:
            if self._timer is not None:
                self._timer.cancel()
            self._at = deadline
            self._timer = loop.call_at(deadline, self._expire, loop)

    def forget(self, future: asyncio.Future[_Msg]) -> None:
        self._waiting.pop(future, None)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._at = math.inf
        waiting = self._waiting
        now = loop.time()
        for future in [future for future, deadline in waiting.items() if deadline <= now]:
            del waiting[future]
            _expire_request(future)
        if waiting:
            self._at = min(waiting.values())
            self._timer = loop.call_at(self._at, self._expire, loop)


#: Each client's :class:`_Deadlines`.
_DEADLINES: Final[weakref.WeakKeyDictionary[_NatsPyClient, _Deadlines]] = (
    weakref.WeakKeyDictionary()
)


class _Client(_NatsPyClient):
    """nats-py's client, its requests waited for under one timer, and its
    reconnects stopped when asked.

    nats-py 2.16's request (``_request_new_style``) registers a future with a
    done callback, draws a NUID and two random bytes (a ``urandom`` system
    call) for the reply subject, and waits under ``asyncio.wait_for`` (a
    future, a timer and a callback more): on every direct get and JetStream
    API call. Here: a counter's token (:data:`_TOKENS`), the future
    registered where nats-py's reply handler finds it, the client's one
    timer for all its requests (:class:`_Deadlines`); the same
    errors (``nats.errors.TimeoutError`` after ``timeout``, a draining
    connection refused).

    nats-py's close cancels the task that reconnects, once; but each attempt
    waits under ``asyncio.wait_for``, which on Python 3.11 swallows a
    cancellation that comes as what it waits for ends (an attempt refused, a
    node hanging up before its INFO). The attempt's error is then caught as
    a failed attempt, and the task went on reconnecting after the close, for
    good (the event loop's shutdown waited for it, for good too). Here an
    attempt does not begin, nor go on to its handshake, in a task asked to
    stop (the first connect too: :meth:`Connection.open`'s timeout). Asked
    since the connect began, as ``asyncio.timeout`` counts: a caller's task
    that caught a cancellation before and went on (without ``uncancel()``)
    still connects."""

    #: The first connect's task, and the cancellations it had when it began.
    _connecting_in: tuple[asyncio.Task[Any], int] | None = None

    def __init__(self) -> None:
        super().__init__()
        #: Subscriptions (by sid) whose messages are handed over as they are
        #: read (:meth:`take_inline`).
        self._inline: dict[int, Callable[[_Msg], None]] = {}

    async def _init_request_sub(self) -> None:
        await super()._init_request_sub()
        assert self._resp_sub_prefix
        self.take_inline(self._resp_sub_prefix, self._reply_arrived)

    def take_inline(self, prefix: bytearray, take: Callable[[_Msg], None]) -> None:
        """Hand each message of the subscription on ``<prefix>*`` (made just
        before: requests' replies, ``publish_async`` acks) to ``take`` as it is
        read, in the reading task.

        In nats-py each went into the subscription's queue, for its task to
        wake up (a turn of the event loop) and call its callback (a
        coroutine), which then woke the task waiting for it (another turn):
        on every request's reply and every publish's ack. ``take`` only ends a
        future: it never waits, nor does it need the order a queue keeps
        (messages are still taken in the order they are read)."""
        subject = prefix.decode() + "*"
        for sid, sub in self._subs.items():
            if sub.subject == subject:
                self._inline[sid] = take

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """nats-py 2.16's ``publish`` (with its ``_send_publish`` and
        ``_send_command``) in one call: the same checks in the same order, the
        same errors, the same bytes queued (a test compares them), with its
        own patterns. nats-py's made seven calls more of every publish (its
        status properties, its subject check twice, its command builders):
        about twelve publishes a request, acks included."""
        if not self._skip_subject_validation:
            if not subject or _SUBJECT_INVALID.search(subject):
                raise nats.errors.BadSubjectError
            if reply and _SUBJECT_INVALID.search(reply):
                raise nats.errors.BadSubjectError
        size = len(payload)
        if self._status != _CONNECTED:
            self._refuse_unconnected(size)
        if size > self._max_payload:
            raise nats.errors.MaxPayloadError
        if not subject:
            raise nats.errors.BadSubjectError
        if headers is None:
            command = b"%b%b\r\n" % (f"PUB {subject} {reply} {size}\r\n".encode(), payload)
        else:
            block = _header_block(headers)
            line = f"HPUB {subject} {reply} {len(block)} {len(block) + size}\r\n"
            command = b"%b%b%b\r\n" % (line.encode(), block, payload)
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += size
        self._pending.append(command)
        self._pending_data_size += len(command)
        if self._max_pending_size > 0 and self._pending_data_size > self._max_pending_size:
            await self._flush_pending(force_flush=True)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    def _refuse_unconnected(self, size: int) -> None:
        """nats-py's refusals of a publish of ``size`` bytes while not connected:
        closed, draining what is left to send, or (reconnecting) its buffer
        disabled or full. Draining its subscriptions, it still publishes."""
        status = self._status
        if status == _CLOSED:
            raise nats.errors.ConnectionClosedError
        if status == _DRAINING_PUBS:
            raise nats.errors.ConnectionDrainingError
        if status != _DRAINING_SUBS and (
            self._max_pending_size <= 0 or size + self._pending_data_size > self._max_pending_size
        ):
            raise nats.errors.OutboundBufferLimitError

    def _reply_arrived(self, msg: _Msg) -> None:
        """nats-py 2.16's ``_request_sub_callback``: a reply ends its request's future."""
        future = self._resp_map.get(msg.subject[len(self._resp_sub_prefix or b"") :])
        if future is not None and not future.done():
            future.set_result(msg)

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        """nats-py 2.16's, but a message of a subscription taken inline
        (:meth:`take_inline`) is handed over at once.

        This runs in the task that reads the socket: what escapes it ends that
        task (nats-py logs it and stops reading), and every message of the
        connection then stalls until pings find it stale. So what a taker
        raises, and what nats-py raises reading a message (a header block
        shorter than ``NATS/1.0`` and its line end: an ``IndexError``, which
        anyone who may publish to one of our subjects can send), is reported to
        the error callback (:meth:`_report`) and the message dropped."""
        try:
            take = self._inline.get(sid)
            if take is None:
                await super()._process_msg(sid, subject, reply, data, headers)
                return
            stats = self.stats
            stats["in_msgs"] += 1
            stats["in_bytes"] += len(data)
            sub = self._subs.get(sid)
            if sub is None:  # unsubscribed meanwhile
                return
            sub._received += 1
            hdr = await self._process_headers(headers) if headers else None
            take(self._build_message(sid, subject, reply, data, hdr))
        except (OSError, nats.errors.ProtocolError):
            raise  # what nats-py's reading task reconnects on (a flow control reply's write)
        except Exception as exc:  # noqa: BLE001 - the reading task must go on
            name = subject.decode("utf-8", "replace")
            error = NatsError(f"a message on {name!r} dropped: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            await self._report(error)

    async def _report(self, error: Exception) -> None:
        """``error`` to nats-py's error callback, from the reading task: one
        that raises (an application's) is logged, not let end the task."""
        try:
            await self._error_cb(error)
        except Exception as exc:  # the reading task must go on
            log.exception(
                "nats error callback failed",
                error=f"{type(error).__name__}: {error}",
                callback_error=f"{type(exc).__name__}: {exc}",
            )

    async def connect(self, *args: Any, **kwargs: Any) -> None:
        task = asyncio.current_task()
        self._connecting_in = None if task is None else (task, task.cancelling())
        try:
            await super().connect(*args, **kwargs)
        finally:
            self._connecting_in = None

    async def _connect_to_server(self, s: Any) -> None:
        self._stop_if_cancelled()
        await super()._connect_to_server(s)

    async def _process_connect_init(self) -> None:
        self._stop_if_cancelled()
        await super()._process_connect_init()

    def _stop_if_cancelled(self) -> None:
        """Raise ``CancelledError`` in a task asked to stop since its connect
        began (whether or not an ``asyncio.wait_for`` swallowed the
        cancellation on its way): nats-py's reconnecting task, at all."""
        task = asyncio.current_task()
        if task is None:
            return
        began = self._connecting_in
        before = began[1] if began is not None and began[0] is task else 0
        if task.cancelling() > before:
            raise asyncio.CancelledError

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        """nats-py 2.16's header parser (``Name: Value`` lines), the same result
        for every input (a test compares them), without a generator expression
        over each name's characters: it ran for every header of every message
        received (a stored event's message id, a pull's status)."""
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            # nats-py skips a name with whitespace in it (``str.isspace``, which
            # is what ``split`` cuts at): then it is not one piece, itself.
            if key and key.split() != [key]:
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out

    async def _request_new_style(
        self,
        subject: str,
        payload: bytes,
        timeout: float = 1,  # noqa: ASYNC109 - nats-py's
        headers: dict[str, Any] | None = None,
    ) -> _Msg:
        return await _request(self, subject, payload, timeout, headers)


async def _request(
    nc: _NatsPyClient,
    subject: str,
    payload: bytes,
    timeout: float,  # noqa: ASYNC109 - nats-py's
    headers: dict[str, Any] | None,
) -> _Msg:
    """nats-py 2.16's ``_request_new_style`` on ``nc`` (its one reply
    subscription, its registry of requests), with a counter's token and the
    client's one timer (:class:`_Deadlines`): the reply,
    ``nats.errors.TimeoutError`` after ``timeout``, a draining connection
    refused. A no-responders status is the reply (its caller reads it), as
    in nats-py."""
    if nc._status == _DRAINING_PUBS:  # nats-py's is_draining_pubs
        raise nats.errors.ConnectionDrainingError
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    assert nc._resp_sub_prefix
    key = format(next(_TOKENS), "x")
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_Msg] = loop.create_future()
    responses = nc._resp_map
    responses[key] = future
    deadlines = _DEADLINES.get(nc)
    if deadlines is None:
        deadlines = _DEADLINES[nc] = _Deadlines()
    deadlines.watch(future, timeout, loop)
    try:
        await nc.publish(
            subject, payload, reply=nc._resp_sub_prefix.decode() + key, headers=headers
        )
        return await future
    finally:
        deadlines.forget(future)
        responses.pop(key, None)


#: What nats-py 2.16 refuses in a stream's name (``nats.js.manager``).
_BAD_STREAM_NAME: Final = re.compile(r"[>*. /\\\t\r\n]")
#: The texts of the errors a direct get's status replies become (as
#: :func:`translate` words nats-py's), made once.
_NO_RESPONDERS_TEXT: Final = str(nats.errors.NoRespondersError())
_NOT_FOUND_TEXT: Final = str(nats.js.errors.NotFoundError())


async def _last_direct(context: _Context, stream: str, subject: str) -> StoredMessage:
    """The last message stored on ``subject`` in ``stream``, by a direct get:
    nats-py 2.16's ``get_msg(stream, subject=subject, direct=True)``, the same
    request, reply and errors, read straight into a :class:`StoredMessage`.

    nats-py checks the stream's name a character at a time (a generator), dumps
    an empty JSON body it then drops, and raises a 404 as an exception that
    :func:`translate` reads (three objects and their text): on several gets a
    request (terminal and run claims, last chunks), most of them 404s. A reply
    without the ``Nats-Subject`` header (nats-py: a ``KeyError``) is a
    :class:`NatsError`."""
    if not stream or _BAD_STREAM_NAME.search(stream):
        raise ValueError(
            f"nats: invalid stream name: {stream!r}" if stream else "nats: stream name is required"
        )
    api_subject = f"{context._prefix}.DIRECT.GET.{stream}.{subject}"
    try:
        msg = await _request(context._nc, api_subject, b"", context._timeout, None)
    except nats.errors.Error as exc:
        raise translate(exc) from exc
    headers = msg.headers or {}
    status = headers.get(_STATUS)
    if status == _NO_RESPONDERS:  # what nats-py's request() checks first
        raise NatsNoRespondersError(_NO_RESPONDERS_TEXT)
    data = msg.data
    if status and not data:
        if status == "404":
            raise NatsNotFoundError(_NOT_FOUND_TEXT)
        try:
            _api_error_from_msg(msg)  # raises the typed error
        except nats.errors.Error as exc:
            raise translate(exc) from exc
    stored_on = headers.get("Nats-Subject")
    if stored_on is None:
        raise NatsError(f"a reply to a direct get of {api_subject} without Nats-Subject")
    seq = headers.get("Nats-Sequence")
    stamp = headers.get("Nats-Time-Stamp")
    return StoredMessage(
        int(seq) if seq else 0,
        stored_on,
        data or b"",
        msg.headers,
        _parse_utc_iso(stamp) if stamp else None,
    )


_SequencePair: Final = MessageMetadata.SequencePair
#: Tokens of an ack subject without a domain:
#: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>``.
_ACK_TOKENS: Final = 9


def _metadata_of(reply: str) -> MessageMetadata:
    """nats-py 2.16's ``Msg.metadata`` of a delivery whose ack subject is
    ``reply``: the same fields, the same errors (ours). The form without a
    domain (what our streams deliver) is read here, two calls fewer on every
    delivery; any other by nats-py (a test compares them)."""
    tokens = reply.split(".")
    if len(tokens) == _ACK_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        return MessageMetadata(
            sequence=_SequencePair(stream=int(tokens[5]), consumer=int(tokens[6])),
            num_pending=int(tokens[8]),
            num_delivered=int(tokens[4]),
            timestamp=datetime.datetime.fromtimestamp(
                int(tokens[7]) / 1_000_000_000.0, datetime.UTC
            ),
            stream=tokens[2],
            consumer=tokens[3],
        )
    try:
        return _metadata_from_reply(reply)
    except nats.errors.Error as exc:
        raise translate(exc) from exc


class Message:
    """One message delivered to a subscription or a pull consumer."""

    __slots__ = ("_meta", "_msg", "data", "headers", "reply", "subject")

    def __init__(self, msg: _Msg) -> None:
        self._msg = msg
        # Read once here (plain attributes): a property each, read on every
        # message by several layers, cost a call per read.
        self.subject: str = msg.subject
        self.reply: str = msg.reply
        self.data: bytes = msg.data
        self.headers: dict[str, str] | None = msg.headers
        self._meta: MessageMetadata | None = None

    @property
    def metadata(self) -> MessageMetadata:
        """The JetStream delivery's metadata; :class:`NatsError` if it is not one."""
        meta = self._meta
        if meta is None:
            meta = self._meta = _metadata_of(self.reply)
        return meta

    async def ack(self) -> None:
        try:  # not through _call: a coroutine less on every message
            await self._msg.ack()
        except nats.errors.Error as exc:
            raise translate(exc) from exc

    async def ack_sync(self, timeout: float = 1.0) -> None:  # noqa: ASYNC109 - nats-py's own
        """Ack, and wait until the broker has taken it (its consumer counts no
        longer include the message)."""
        await _call(self._msg.ack_sync(timeout=timeout))

    async def nak(self, delay: float | None = None) -> None:
        await _call(self._msg.nak(delay=delay))

    async def term(self) -> None:
        await _call(self._msg.term())

    async def in_progress(self) -> None:
        await _call(self._msg.in_progress())

    async def respond(self, data: bytes) -> None:
        await _call(self._msg.respond(data))


#: A callback for the messages of a :class:`Subscription`.
Handler = Callable[[Message], Awaitable[None]]


class Subscription:
    """A core NATS subscription whose messages go to a callback."""

    __slots__ = ("_sub",)

    def __init__(self, sub: _Subscription) -> None:
        self._sub = sub

    @property
    def subject(self) -> str:
        return self._sub.subject

    async def unsubscribe(self) -> None:
        await _call(self._sub.unsubscribe())


def _take_buffered_first(sub: _Subscription) -> None:
    """Make ``sub.next_msg`` take a message without a task of its own.

    nats-py's ``next_msg`` runs every call in a task of its own, under
    ``asyncio.wait_for`` (a second task), with a ``uuid4`` to name it, even
    when the message is already in the subscription's queue, so a
    ``fetch(n)`` costs two tasks and at least one turn of the event loop *per
    message*. In a busy process a turn is long: the projector, fetching 512
    events at a time, fell seconds behind the log. A message that is already
    buffered is taken at once here, with the same bookkeeping as nats-py's
    own (pending size, ``task_done``); one that is not is awaited in the
    caller's task, under ``asyncio.timeout`` (one timer, no task): every
    fetch waits so at least once (the server's answer to its pull request).
    As in nats-py, the wait ends in ``nats.errors.TimeoutError`` after
    ``timeout``, and in ``ConnectionClosedError`` when the connection is
    closed meanwhile (nats-py's ``close`` cancels what is registered in the
    subscription's ``_pending_next_msgs_calls``: here a future whose
    cancellation interrupts the wait). Set per instance: the nats-py class is
    left as it is, and so is a subscription of a nats-py whose internals are
    not the ones this relies on (``pyproject.toml`` pins 2.16).
    """
    names = ("_pending_queue", "_pending_size", "_conn", "_pending_next_msgs_calls")
    if not all(hasattr(sub, name) for name in names):
        return
    original = sub.next_msg

    async def next_msg(timeout: float | None = 1.0) -> _Msg:  # noqa: ASYNC109 - nats-py's
        queue = sub._pending_queue
        conn = sub._conn
        calls = sub._pending_next_msgs_calls
        if conn.is_closed or calls is None:
            return await original(timeout)
        if queue.empty():
            msg = await _wait(queue, calls, conn, timeout)
        else:
            msg = queue.get_nowait()
        sub._pending_size -= len(msg.data)
        queue.task_done()
        return msg

    async def _wait(
        queue: asyncio.Queue[_Msg],
        calls: dict[Any, Any],
        conn: _NatsPyClient,
        timeout: float | None,  # noqa: ASYNC109 - nats-py's
    ) -> _Msg:
        task = asyncio.current_task()
        assert task is not None
        closer: asyncio.Future[None] = task.get_loop().create_future()
        waiting = True

        def on_close(_: asyncio.Future[None]) -> None:
            if waiting and not task.done():
                task.cancel()

        closer.add_done_callback(on_close)
        calls[closer] = closer
        try:
            async with asyncio.timeout(timeout):
                return await queue.get()
        except TimeoutError:
            if conn.is_closed:
                raise nats.errors.ConnectionClosedError from None
            raise nats.errors.TimeoutError from None
        except asyncio.CancelledError:
            if closer.cancelled() and conn.is_closed:
                task.uncancel()
                raise nats.errors.ConnectionClosedError from None
            raise
        finally:
            waiting = False
            calls.pop(closer, None)

    sub.next_msg = next_msg  # type: ignore[method-assign]


class PullSubscription:
    """A pull consumer's subscription: :meth:`fetch` asks for messages."""

    __slots__ = ("_sub",)

    def __init__(self, sub: _JetStreamContext.PullSubscription) -> None:
        self._sub = sub
        _take_buffered_first(sub._sub)

    async def fetch(
        self,
        batch: int = 1,
        timeout: float | None = 5,  # noqa: ASYNC109 - nats-py's own parameter
        heartbeat: float | None = None,
    ) -> list[Message]:
        """Up to ``batch`` messages; :class:`NatsTimeoutError` when none come within ``timeout``."""
        try:
            msgs = await self._sub.fetch(batch, timeout, heartbeat)
        except nats.errors.Error as exc:
            raise translate(exc) from exc
        except TimeoutError as exc:
            # nats-py raises the builtin one when the deadline passed between its
            # no-wait probe and its waiting pull (seen under load), its own otherwise.
            raise NatsTimeoutError(f"no message within {timeout} s") from exc
        return [Message(msg) for msg in msgs]

    @property
    def consumer(self) -> str:
        """The consumer's name."""
        name: str = self._sub._consumer  # nats-py keeps it only here
        return name

    async def consumer_info(self) -> ConsumerInfo:
        return await _call(self._sub.consumer_info())

    async def unsubscribe(self) -> None:
        await _call(self._sub.unsubscribe())


_STOPPED: Final = KeyEntry("", b"", 0, "STOP")


class KeyWatcher:
    """Updates of watched KV keys (:meth:`KeyValue.watch`)."""

    __slots__ = ("_watcher",)

    def __init__(self, watcher: _KeyValue.KeyWatcher) -> None:
        self._watcher = watcher

    async def updates(self, timeout: float = 5.0) -> KeyEntry | None:  # noqa: ASYNC109
        """The next entry: ``None`` once the initial values are delivered (then
        only later changes come); :class:`NatsTimeoutError` after ``timeout``
        without one. ``is_stop(entry)`` after :meth:`close`."""
        entry = await _call(self._watcher.updates(timeout=timeout))  # type: ignore[no-untyped-call]
        if entry is None:
            return None
        if entry is self._watcher.STOP_ITER:
            return _STOPPED
        return KeyEntry.of(entry)

    @staticmethod
    def is_stop(entry: KeyEntry) -> bool:
        """Whether ``entry`` is the marker :meth:`updates` returns after :meth:`close`."""
        return entry is _STOPPED

    async def close(self) -> None:
        await _call(self._watcher.stop())  # type: ignore[no-untyped-call]


class KeyValue:
    """One KV bucket."""

    __slots__ = ("_connection", "_kv")

    #: The most a KV write's headers can be (an expected revision, a TTL).
    _HEADERS: Final = {"Nats-Expected-Last-Subject-Sequence": "1" * 20, "Nats-TTL": "1" * 20}

    def __init__(self, kv: _KeyValue, connection: Connection) -> None:
        self._kv = kv
        self._connection = connection

    def _fits(self, value: bytes) -> None:
        _refuse_oversized(self._connection, value, self._HEADERS)

    async def get(self, key: str) -> KeyEntry:
        """The key's entry; :class:`NatsNotFoundError` if it has none (or was deleted)."""
        return KeyEntry.of(await _call(self._kv.get(key)))

    async def latest(self, key: str) -> KeyEntry | None:
        """The key's entry, its delete (or purge) marker if it was deleted
        (``operation`` says which), or ``None`` if it was never written. A
        compare-and-set after a delete names the marker's revision."""
        try:
            return KeyEntry.of(await self._kv.get(key))
        except nats.js.errors.KeyNotFoundError as exc:
            marker = exc.entry
            if marker is None:
                return None
            return KeyEntry(key, b"", marker.revision or 0, marker.operation or exc.op or "DEL")
        except nats.errors.Error as exc:
            raise translate(exc) from exc

    async def put(self, key: str, value: bytes) -> int:
        self._fits(value)
        return await _call(self._kv.put(key, value))

    async def create(self, key: str, value: bytes, msg_ttl: float | None = None) -> int:
        """Write ``key`` if it has no value; :class:`WrongLastSequenceError` if it has."""
        self._fits(value)
        return await _call(self._kv.create(key, value, msg_ttl=msg_ttl))

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        """Write ``key`` if its revision is ``last``; :class:`WrongLastSequenceError` if not."""
        self._fits(value)
        return await _call(self._kv.update(key, value, last=last))

    async def delete(self, key: str, last: int | None = None) -> bool:
        """Delete ``key`` (if its revision is ``last``; :class:`WrongLastSequenceError` if not)."""
        return await _call(self._kv.delete(key, last=last))

    async def keys(self) -> list[str]:
        """Every key with a value; empty for an empty bucket."""
        try:
            return await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        except nats.errors.Error as exc:
            raise translate(exc) from exc

    async def watch(self, keys: str) -> KeyWatcher:
        return KeyWatcher(await _call(self._kv.watch(keys)))


class JetStream:
    """A JetStream context: publish with acks, read streams, consumers, KV buckets."""

    def __init__(self, js: _JetStreamContext, connection: Connection) -> None:
        self._js = js
        #: The connection this context publishes on.
        self.connection = connection

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - nats-py's own parameter
        stream: str | None = None,
        headers: dict[str, str] | None = None,
        msg_ttl: float | None = None,
    ) -> PubAck:
        """Publish and wait for the stream's ack."""
        hdr = headers
        if stream:
            hdr = {**(hdr or {}), "Nats-Expected-Stream": stream}
        if msg_ttl is not None:
            hdr = {**(hdr or {}), "Nats-TTL": str(int(msg_ttl))}
        _refuse_oversized(self.connection, payload, hdr)
        context = self._js
        if isinstance(context, _Context):
            wait = context._timeout if timeout is None else timeout
            try:  # not through _call: a coroutine less on every publish
                return await context.publish_acked(subject, payload, timeout=wait, headers=hdr)
            except nats.errors.Error as exc:
                raise translate(exc) from exc
        return await _call(
            context.publish(
                subject, payload, timeout=timeout, stream=stream, headers=headers, msg_ttl=msg_ttl
            )
        )

    async def publish_async(
        self,
        subject: str,
        payload: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> asyncio.Future[PubAck]:
        """Publish without waiting; the returned future ends with the ack (or a
        :class:`NatsError`). Await it, or cancel it to stop waiting.

        With too many publishes pending, waits up to :data:`PUBLISH_STALL_WAIT`
        for a slot (then :class:`~renqueue.errors.NatsUnavailableError`); a
        caller cancelled meanwhile gets :class:`asyncio.CancelledError`.
        """
        # nats-py bounds the wait for a slot with ``asyncio.wait_for``: a task
        # and a timer per publish, even when a slot is free. Bounded only when
        # it may have to wait (the semaphore is nats-py's, pinned 2.16).
        _refuse_oversized(self.connection, payload, headers)
        slots = getattr(self._js, "_publish_async_pending_semaphore", None)
        stall = PUBLISH_STALL_WAIT if slots is None or slots.locked() else None
        try:
            future = await self._js.publish_async(
                subject, payload, wait_stall=stall, headers=headers
            )
        except nats.js.errors.TooManyStalledMsgsError as exc:
            # nats-py turns a cancellation while waiting for a free slot into
            # this error: a cancelled caller is told it was cancelled.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from exc
            raise translate(exc) from exc
        except nats.errors.Error as exc:
            raise translate(exc) from exc
        # Ours ends with our errors already; nats-py's own is relayed (a context
        # that is not ours: an application's).
        return future if isinstance(future, _AckFuture) else _Relay(future)

    async def get_msg(
        self,
        stream_name: str,
        seq: int | None = None,
        subject: str | None = None,
        direct: bool = False,
        next: bool = False,
    ) -> StoredMessage:
        """One stored message; :class:`NatsNotFoundError` if there is none."""
        context = self._js
        if direct and subject and seq is None and not next and isinstance(context, _Context):
            return await _last_direct(context, stream_name, subject)
        return StoredMessage.of(
            await _call(
                self._js.get_msg(stream_name, seq=seq, subject=subject, direct=direct, next=next)
            )
        )

    async def get_last_msg(
        self, stream_name: str, subject: str, direct: bool = False
    ) -> StoredMessage:
        """The last message stored on ``subject``; :class:`NatsNotFoundError` if none."""
        context = self._js
        if direct and subject and isinstance(context, _Context):
            return await _last_direct(context, stream_name, subject)
        return StoredMessage.of(
            await _call(self._js.get_last_msg(stream_name, subject, direct=direct))
        )

    async def delete_msg(self, stream_name: str, seq: int) -> bool:
        return await _call(self._js.delete_msg(stream_name, seq))

    async def stream_info(self, name: str) -> StreamInfo:
        return await _call(self._js.stream_info(name))

    async def consumer_info(
        self,
        stream: str,
        consumer: str,
        timeout: float | None = None,  # noqa: ASYNC109 - nats-py's own parameter
    ) -> ConsumerInfo:
        info: ConsumerInfo = await _call(self._js.consumer_info(stream, consumer, timeout))
        return info

    async def add_consumer(
        self, stream: str, config: ConsumerConfig | None = None, **params: Any
    ) -> ConsumerInfo:
        """Create (or update) a consumer; ``params`` are :class:`ConsumerConfig` fields."""
        return await _call(self._js.add_consumer(stream, config, **params))

    async def delete_consumer(self, stream: str, consumer: str) -> bool:
        return await _call(self._js.delete_consumer(stream, consumer))

    async def pull_subscribe(
        self,
        subject: str,
        durable: str | None = None,
        stream: str | None = None,
        config: ConsumerConfig | None = None,
    ) -> PullSubscription:
        """A pull subscription on ``subject`` (creating the consumer ``config`` describes)."""
        return PullSubscription(
            await _call(self._js.pull_subscribe(subject, durable, stream, config))
        )

    async def pull_subscribe_bind(
        self, durable: str, stream: str, *, pending_msgs_limit: int | None = None
    ) -> PullSubscription:
        """A pull subscription on the existing consumer ``durable`` of ``stream``."""
        if pending_msgs_limit is None:
            sub = await _call(self._js.pull_subscribe_bind(durable=durable, stream=stream))
        else:
            sub = await _call(
                self._js.pull_subscribe_bind(
                    durable=durable, stream=stream, pending_msgs_limit=pending_msgs_limit
                )
            )
        return PullSubscription(sub)

    async def key_value(self, bucket: str) -> KeyValue:
        """The bucket ``bucket``; :class:`NatsNotFoundError` if it does not exist."""
        return KeyValue(await _call(self._js.key_value(bucket)), self.connection)

    @property
    def api_prefix(self) -> str:
        """The JetStream API subject prefix (``$JS.API``, or a domain's)."""
        # nats-py exposes no public accessor; the prefix carries the domain.
        prefix: str = self._js._prefix
        return prefix

    @property
    def context(self) -> _JetStreamContext:
        """nats-py's context, for what the handles do not cover (tests, benchmarks)."""
        return self._js


class Connection:
    """A connection to NATS (see :func:`renqueue.broker.connect` for how one is opened)."""

    @classmethod
    def of(cls, nc: Connection | _NatsPyClient) -> Connection:
        """``nc`` itself, or nats-py's client ``nc`` wrapped (an application's own)."""
        return nc if isinstance(nc, Connection) else cls(nc)

    def __init__(self, nc: _NatsPyClient | None = None) -> None:
        """Wrap nats-py's ``nc``, or (without one) a client still to be :meth:`open`ed."""
        self._nc = nc if nc is not None else _Client()
        _require_nats_py_parts(self._nc, _NatsPyClient, _CLIENT_PARTS, _CHECKED)
        _require_close_parts(_CHECKED)
        self._js: JetStream | None = None
        #: Set when the connection ends without :meth:`close` or :meth:`drain`:
        #: the server closed it (nats-py does not reconnect after a protocol
        #: error such as ``maximum payload exceeded``). Call :meth:`closed_by_server`
        #: from nats-py's ``closed_cb`` (see :func:`renqueue.broker.connect`).
        self.lost = asyncio.Event()
        self._closing = False

    async def open(self, timeout: float, **options: Any) -> None:  # noqa: ASYNC109
        """Connect with nats-py's ``options``, the first connect bounded by
        ``timeout``; :class:`ConnectionFailedError` when no server answers in
        time (the half-open client is closed). The caller words the error: it
        knows the URL and what the error callback saw."""
        try:
            async with asyncio.timeout(timeout):
                await self._nc.connect(**options)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            self._closing = True
            await _close(self._nc)
            raise ConnectionFailedError(str(exc) or type(exc).__name__) from exc
        except asyncio.CancelledError:
            # Cancelled while connecting (a shutdown): no half-open client is left.
            self._closing = True
            with contextlib.suppress(Exception):
                await asyncio.shield(_close(self._nc))
            raise

    @property
    def max_payload(self) -> int:
        """The server's largest message (headers and payload), in bytes."""
        return self._nc._max_payload

    def jetstream(self, *, timeout: float | None = None) -> JetStream:
        """This connection's JetStream context; with ``timeout`` (seconds per
        API request; nats-py's default is 5) a context of its own."""
        if timeout is not None:
            return JetStream(_Context(self._nc, timeout=timeout), self)
        if self._js is None:
            self._js = JetStream(_Context(self._nc), self)
        return self._js

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """Publish (core NATS: no ack). :class:`NatsPayloadTooLargeError` for a
        message over the server's ``max_payload``, headers counted."""
        _refuse_oversized(self, payload, headers)
        try:  # not through _call: a coroutine less on every publish
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
        except nats.errors.Error as exc:
            raise translate(exc) from exc

    async def subscribe(self, subject: str, cb: Handler, queue: str = "") -> Subscription:
        """Subscribe ``cb`` to ``subject``; it is called with each :class:`Message`."""

        async def deliver(msg: _Msg) -> None:
            await cb(Message(msg))

        return Subscription(await _call(self._nc.subscribe(subject, queue=queue, cb=deliver)))

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,  # noqa: ASYNC109 - nats-py's own parameter
        headers: dict[str, str] | None = None,
    ) -> Message:
        """Publish and wait for one reply; :class:`NatsUnavailableError` (no responders)
        or :class:`NatsTimeoutError` when none comes."""
        _refuse_oversized(self, payload, headers)
        return Message(
            await _call(self._nc.request(subject, payload, timeout=timeout, headers=headers))
        )

    def new_inbox(self) -> str:
        return self._nc.new_inbox()

    async def flush(self, timeout: int = 10) -> None:  # noqa: ASYNC109
        await _call(self._nc.flush(timeout))

    async def drain(self) -> None:
        """Drain the subscriptions, then what is left to send, then close. A drain
        that fails still ends closed (then raises): nats-py refuses one while
        reconnecting, and the connection went on reconnecting after it, for good.
        A drain gives up, closed, with :class:`NatsUnavailableError`, once the
        server is gone (see :func:`_drain_unless_gone`): nats-py's own drain
        waited about 20 s for a stopped server, 10 s for one just killed."""
        self._closing = True
        try:
            if self._nc.is_connected and not self._nc.is_draining:
                await _drain_unless_gone(self._nc)
            else:  # nats-py's refusal (reconnecting, closed), or a drain under way
                await _call(self._nc.drain())
        finally:
            await _close(self._nc)  # closed already after a drain: what is left, if anything

    async def close(self) -> None:
        """Close for good, in bounded time whatever the server does (see :func:`_close`)."""
        self._closing = True
        await _close(self._nc)

    def attempt_failed(self) -> None:
        """Called from nats-py's ``error_cb``: while (re)connecting, the error is a
        failed attempt, and nats-py leaves that attempt's socket open when the server
        accepted the TCP connection but never sent its INFO (a node shutting down or
        starting): it reuses the transport and overwrites its stream writer on the
        next attempt, so the socket stays open until garbage collection (one per
        attempt through a whole-cluster restart). Close it now. Closed too: an
        attempt that a close's cancellation did not stop (see :class:`_Client`) ends
        while the client says it is closed, and its socket was left the same way."""
        if not (self._nc.is_connecting or self._nc.is_reconnecting or self._nc.is_closed):
            return
        transport = self._nc._transport  # nats-py keeps it only in a private attribute
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.close()  # type: ignore[no-untyped-call]  # nats-py: unannotated

    def closed_by_server(self) -> bool:
        """Called when nats-py reports the connection closed: sets :attr:`lost`
        (and returns True) unless this side closed it. Either way what still
        waits for an answer fails as closed: nothing reads one any more (a
        ``publish_async`` ack's future waited for good)."""
        _fail_waiting(self._nc)
        if self._closing:
            return False
        self.lost.set()
        return True

    @property
    def is_closed(self) -> bool:
        return self._nc.is_closed

    @property
    def closed_unasked(self) -> bool:
        """Closed, and not by this side. nats-py closes on a server's ``-ERR`` in a
        task of its own, which races the reconnect that the socket's end starts:
        it can end closed without calling back, :attr:`lost` never set."""
        return self._nc.is_closed and not self._closing

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    @property
    def reconnects(self) -> int:
        """How many times this connection has reconnected."""
        return int(self._nc.stats["reconnects"])

    @property
    def last_error(self) -> BaseException | None:
        return self._nc.last_error

    @property
    def connected_server(self) -> str | None:
        """``host:port`` of the server connected to, if any."""
        url = self._nc.connected_url
        return None if url is None else f"{url.hostname}:{url.port}"

    @property
    def client(self) -> _NatsPyClient:
        """nats-py's client, for what the handles do not cover (tests, benchmarks)."""
        return self._nc


#: Longest :meth:`Connection.close` lets nats-py wait for the server to take
#: what is left to send, and for its socket to close: then the socket is let
#: go (a server stopped or cut off takes nothing, and nats-py waited for good).
CLOSE_WAIT: Final = 5.0


#: Longest :meth:`Connection.drain` waits for the server to answer the ping
#: it sends as it begins (seconds; nats-py's flush takes whole ones): nats-py's
#: own flush timeout, and the connection's default ``nats.ping_interval``. A
#: server that answers later is taken for gone, and the handlers still busy
#: with its messages are cancelled: on a loaded machine a live server's pong
#: (or the client's loop reading it) can take seconds, so the bound is not
#: short. A connection seen lost (nats-py reconnecting) is given up at once.
DRAIN_ANSWER: Final = 10


async def _drain_unless_gone(nc: _NatsPyClient) -> None:
    """nats-py's drain, given up (then :class:`NatsUnavailableError`) once the
    server is seen gone: when the ping sent as the drain begins is not answered
    within :data:`DRAIN_ANSWER` (a server stopped, or cut off), or when nats-py
    starts reconnecting (the connection lost: it stops reading, and no pong can
    come). nats-py's drain waited out a 10 s flush for each subscription and
    another for what was left to send, for nothing (or raised the socket's
    ``ConnectionResetError``). What a server that answered has taken stays
    taken; what it has not (an ack, a publish) was never acked to anyone, and
    the broker delivers the message again. The drain's tasks (and its
    subscriptions') end before this returns (see :func:`_ended`)."""
    reading = nc._reading_task
    reconnecting_before = nc._reconnection_task  # a new one: the connection was lost

    def lost() -> bool:
        return nc._reconnection_task is not reconnecting_before

    answered = asyncio.ensure_future(nc.flush(DRAIN_ANSWER))
    draining = asyncio.ensure_future(nc.drain())
    waits: set[asyncio.Future[Any]] = {draining, answered}
    if reading is not None:
        waits.add(reading)
    try:
        while not draining.done():
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if lost():
                break
            if answered in done and not draining.done():
                waits.discard(answered)
                if answered.cancelled() or answered.exception() is not None:
                    raise NatsUnavailableError(
                        f"nats: the server did not answer within {DRAIN_ANSWER}s; "
                        "closed without draining"
                    )
            if reading is not None and reading in done:
                waits.discard(reading)  # nats-py's own close of a drain that ends
    finally:
        await _ended({answered, draining})
    exc = None if draining.cancelled() else draining.exception()
    if lost():
        raise NatsUnavailableError(
            "nats: the connection was lost while draining; closed without draining"
        ) from exc
    if exc is not None:
        raise translate(exc) from exc


async def _ended(tasks: set[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` until they end, for at most :data:`CLOSE_WAIT`: again
    and again, as a first cancellation may be swallowed (nats-py's drain
    catches one, then flushes). Their outcomes are read (none is reported
    as never retrieved)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CLOSE_WAIT
    left = {task for task in tasks if not task.done()}
    while left and loop.time() < give_up:
        for task in left:
            task.cancel()
        _, left = await asyncio.wait(left, timeout=0.1)
    for task in tasks - left:
        if not task.cancelled():
            task.exception()


#: Each client's close under way (:func:`_close`).
_CLOSING: Final[weakref.WeakKeyDictionary[_NatsPyClient, asyncio.Future[None]]] = (
    weakref.WeakKeyDictionary()
)


async def _close(nc: _NatsPyClient) -> None:
    """:func:`_close_once`, or, while another close of ``nc`` is under way,
    wait for that one: a second close found the client closed already and
    let its socket go at once, under the first still flushing, and returned
    before it."""
    under_way = _CLOSING.get(nc)
    if under_way is not None:
        await asyncio.wait({under_way})
        return
    _CLOSING[nc] = done = asyncio.get_running_loop().create_future()
    try:
        await _close_once(nc)
    finally:
        del _CLOSING[nc]
        done.set_result(None)


async def _close_once(nc: _NatsPyClient) -> None:
    """nats-py's ``close``, bounded, and whatever it left undone done.

    nats-py's close flushes what is left to send and waits until its socket
    is closed, both for as long as the server takes: for good when the
    server is stopped (``SIGSTOP``) or cut off (no reset), with the socket
    full. Reconnecting (or connecting), it also wrote what was published
    meanwhile into the dead or half-open socket of the last attempt: to a
    stopped server, the same wait; to a closed socket, a
    ``ConnectionResetError`` out of its close, which then skipped the rest
    (its subscriptions' tasks were left running). And a reconnect whose
    cancellation was swallowed (see :class:`_Client`) outlived the close.
    Here: what is published while reconnecting is dropped (no server gets it
    once the reconnecting stops); the socket is aborted after
    :data:`CLOSE_WAIT`; every task of the client's ends, the socket is
    closed and the client is left closed.
    """
    if not nc.is_connected:
        nc._pending = []
        nc._pending_data_size = 0
    closing = asyncio.ensure_future(nc.close())
    try:
        await asyncio.wait({closing}, timeout=CLOSE_WAIT)
        if not closing.done():
            _abort(nc._transport)  # the waits on the socket end with it
            await asyncio.wait({closing}, timeout=CLOSE_WAIT)
    finally:
        # Cancelled at any of these waits (a shutdown's timeout, then the event
        # loop's), the close still ends what it can without waiting.
        try:
            if not closing.done():
                closing.cancel()
                await asyncio.wait({closing}, timeout=CLOSE_WAIT)
        finally:
            await _closed_for_good(nc)
    exc = closing.exception() if closing.done() and not closing.cancelled() else None
    if exc is not None and not isinstance(exc, OSError):  # an OSError: the socket was gone
        raise translate(exc) from exc


async def _closed_for_good(nc: _NatsPyClient) -> None:
    """End what nats-py's close left behind: its tasks (a reconnect that
    went on), its subscriptions' tasks (a close that raised), its socket."""
    nc._status = _NatsPyClient.CLOSED
    current = asyncio.current_task()
    tasks = {
        task
        for task in (
            nc._reconnection_task,
            nc._reading_task,
            nc._ping_interval_task,
            nc._flusher_task,
            *(sub._wait_for_msgs_task for sub in nc._subs.values()),
        )
        if task is not None and not task.done() and task is not current
    }
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CLOSE_WAIT
    try:
        while tasks and loop.time() < give_up:
            for task in tasks:
                task.cancel()  # again: a first cancellation may have been swallowed
            _, tasks = await asyncio.wait(tasks, timeout=0.1)
    finally:  # cancelled while waiting for them too
        nc._subs.clear()
        _fail_waiting(nc)
        _abort(nc._transport)
    # asyncio closes an aborted socket on the loop's next turn. Not its writer's
    # wait_closed(): nats-py's reconnect awaited that future and, cancelled, cancelled it.
    await asyncio.sleep(0)


def _fail_waiting(nc: _NatsPyClient) -> None:
    """End every request and every ``publish_async`` ack still waited for on
    ``nc`` as closed: nothing reads a reply after a close, and they waited out
    their timeouts (a submit's publish then said the broker did not answer, a
    reason to try again), or for good (an ack's future has no timer)."""
    waiting = [*nc._resp_map.values()]
    for context in _CONTEXTS.get(nc, ()):
        waiting += context._publish_async_futures.values()
    for future in waiting:
        if not future.done():
            future.set_exception(nats.errors.ConnectionClosedError())


def _writers(transport: object) -> list[asyncio.StreamWriter]:
    """nats-py's TCP transport's stream writers: the TLS one, and the bare one under it."""
    found = (getattr(transport, name, None) for name in ("_io_writer", "_bare_io_writer"))
    return [writer for writer in found if isinstance(writer, asyncio.StreamWriter)]


def _abort(transport: object) -> None:
    """Close nats-py's TCP transport at once, what it still had to send dropped."""
    for writer in _writers(transport):
        writer.transport.abort()


#: How long one raw JetStream API request waits for its reply.
API_TIMEOUT: Final = 5.0


class JetStreamApi:
    """Raw JetStream API requests (``$JS.API.<operation>``, JSON in and out).

    For what nats-py's context does not expose whole (a stream's or a
    consumer's config as the server holds it, compared field by field when
    provisioning). A reply JetStream cannot give *yet* (no answer in time, no
    responders, a 503 or "not now" API error) raises
    :class:`~renqueue.errors.NatsUnavailableError`; any other API error is
    returned in the reply, for :func:`reply_error` to read.
    """

    def __init__(self, js_or_nc: Connection | JetStream, *, patience: float = 0.0) -> None:
        #: How long a caller waits per step while JetStream cannot answer.
        self.patience = patience
        if isinstance(js_or_nc, JetStream):
            # The prefix carries the JetStream domain, if the context has one.
            self.nc: Connection = js_or_nc.connection
            self._prefix = js_or_nc.api_prefix
        else:
            self.nc = js_or_nc
            self._prefix = "$JS.API"

    async def call(self, operation: str, payload: Mapping[str, Any] | None = None) -> Any:
        subject = f"{self._prefix}.{operation}"
        body = b"" if payload is None else json.dumps(payload).encode()
        try:
            reply = await self.nc.request(subject, body, timeout=API_TIMEOUT)
        except NatsTimeoutError as exc:
            raise NatsTimeoutError(
                f"JetStream did not answer {subject} within {API_TIMEOUT:g}s"
            ) from exc
        except NatsClosedError:
            raise
        except NatsUnavailableError as exc:
            raise NatsUnavailableError(
                f"JetStream did not answer {subject} ({exc}): is JetStream enabled "
                "on this server, and has it started?"
            ) from exc
        try:
            response = json.loads(reply.data)
        except json.JSONDecodeError as exc:
            raise NatsError(f"JetStream sent a non-JSON reply to {subject}") from exc
        error = response.get("error") if isinstance(response, dict) else None
        if isinstance(error, dict) and (
            error.get("code") == 503 or error.get("err_code") in NOT_NOW
        ):
            raise NatsUnavailableError(
                f"JetStream cannot answer {subject} yet: {error.get('description')}"
            )
        return response


def reply_error(response: Any) -> tuple[int, str] | None:
    """``(err_code, description)`` of a raw API reply's error, ``None`` on success."""
    error = response.get("error") if isinstance(response, dict) else None
    if not error:
        return None
    if not isinstance(error, dict):
        return 0, str(error)
    return int(error.get("err_code", 0) or 0), str(error.get("description", error))
