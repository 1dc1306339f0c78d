"""Writing to and reading from the event log (the ``RQ_EVENTS`` stream).

Every non-terminal event is published with a JetStream message id derived from
the request id, so publishing the same fact twice (a retried publish, a
redelivered run) within the duplicate window stores it once.

Exactly one terminal event per request does not rest on that window, nor on a
message id (tenants may publish into ``RQ_EVENTS``, with any id): every
terminal event goes through :meth:`EventLog.finish`, which first *claims* the
request's outcome by creating the key ``<tenant>.<request_id>`` in the
``rq-terminal`` KV bucket (a compare-and-set: the create fails if the key
exists), a bucket only services can write. The claim holds the encoded event
and its final chunk's ``(delivery, seq)``. Only the creator publishes them; a
loser publishes nothing of its own. A crash between the claim and the publish
leaves a claim whose event is missing from the log: whoever next finds the
claim (a redelivered run checks it before calling the backend; a later
``finish`` loses to it) publishes the claimed event, with
``Nats-Expected-Last-Subject-Sequence: 0`` on its subject, so it is stored at
most once however many find it, and the final chunk if the token stream lacks
it (:meth:`EventLog.settle`). Claims live as long as the events
(``nats.events.max_age``); past that both are gone and a request's outcome is
forgotten (a dispatch redelivered after 30 days would run again).

Two ways to read: services (full permissions) walk a request's subjects with
``next_by_subj`` direct gets (:meth:`EventLog.history`); a tenant reads only
through API subjects that name the subject read, which a NATS permission can
confine to the tenant's own subtree: ``last_by_subj`` direct gets
(``$JS.API.DIRECT.GET.<stream>.<subject>``, :meth:`EventLog.terminal_of`) and
named single-filter consumers (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``,
:func:`read_subject`, :meth:`EventLog.read`). ``nats/auth.conf`` grants those.

Every read trusts the subject, not the payload: a message whose subject is
not the one read is dropped (only what the reader's own consumer delivered,
on the subjects it asked for, is kept), and an event whose payload disagrees
with its subject ``rq.evt.<tenant>.<request_id>.<kind>`` (kind, tenant or
request id: :func:`subject_agrees`) is dropped and counted
(:func:`renqueue.logs.misdirected`). Tenants may publish only on their
``cancel_requested`` subjects, so a terminal event (or any other service
fact) read here was written by the services.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, NamedTuple

import msgspec

from ..errors import NatsError, NatsNotFoundError, WrongLastSequenceError
from ..logs import misdirected
from ..schema import (
    CLAIM_DECODER,
    EVENT_DECODER,
    EVENTS_STREAM,
    TERMINAL_BUCKET,
    TERMINAL_KINDS,
    TOKEN_DECODER,
    TOKENS_STREAM,
    CancelRequested,
    ChunkTail,
    CircuitChanged,
    Coalesced,
    Event,
    FellBack,
    Preempted,
    Probed,
    Promoted,
    Retrying,
    Routed,
    SplitChanged,
    Started,
    Stolen,
    Submitted,
    TerminalClaim,
    cancel_subject,
    dlq_subject,
    encode,
    event_subject,
    events_of_request,
    facts,
    final_chunk,
    is_terminal,
    kind_of,
    msg_id,
    run_claim_key,
    subject_matches,
    terminal_key,
    token_subject,
)
from ._nats import (
    AckPolicy,
    Connection,
    ConsumerInfo,
    DeliverPolicy,
    JetStream,
    Message,
    MessageMetadata,
    PubAck,
    StoredMessage,
    wire_size,
)

__all__ = [
    "DLQ_EXCERPT",
    "DLQ_HOSTILE_EXCERPT",
    "EventLog",
    "StoredClaim",
    "delete_consumer",
    "msg_id_of",
    "publish_stored",
    "read_messages",
    "read_subject",
    "subject_agrees",
    "surely_stored",
]

_MSG_ID: Final = "Nats-Msg-Id"

#: Bytes of a message a dead letter keeps when a whole copy, with the
#: services' headers, would be over the broker's ``max_payload`` (a request
#: refused as too big, published around the client): one message too big
#: makes nats-server close the connection that sent it.
DLQ_EXCERPT: Final = 4096
#: Bytes of a request a dead letter keeps when the request was rejected for
#: its own content (``malformed``, ``out_of_range``: sending it again cannot
#: help, so nothing needs it whole): a hostile tenant's rejections cost the
#: dead-letter stream about this much each, however big they were.
DLQ_HOSTILE_EXCERPT: Final = 2048
_EXPECTED_LAST_SUBJECT_SEQ: Final = "Nats-Expected-Last-Subject-Sequence"
_CLAIMS_STREAM: Final = f"KV_{TERMINAL_BUCKET}"
#: A replay consumer left behind (its reader died) goes away this long after.
_REPLAY_INACTIVE: Final = 10.0
#: Bound on deleting a consumer: closing never waits longer than this.
_DELETE_TIMEOUT: Final = 1.0


class StoredClaim(NamedTuple):
    """A request's terminal claim, as :meth:`EventLog.stored_claim` reads it."""

    claim: TerminalClaim
    #: When the claim was stored (the server's clock, Unix seconds); ``None``
    #: if the server did not say.
    stored: float | None


#: Event types published without a message id (see :func:`msg_id_of`), as a
#: tuple: ``isinstance`` with ``A | B`` builds the union on every call.
_NO_MSG_ID: Final = (Started, Retrying, FellBack, Probed, CancelRequested)


def msg_id_of(event: Event) -> str | None:
    """The JetStream message id that makes publishing ``event`` idempotent
    (scoped by tenant: see :func:`renqueue.schema.msg_id`), or ``None``.

    Tenants may publish into ``RQ_EVENTS`` with any message id, so an id can be
    pre-occupied: nothing that matters may rest on one. Terminal events have
    none: they are published once, by the holder of the request's terminal
    claim (see the module docstring). ``started``, ``retrying`` and
    ``fell_back`` have none: each is published once, by the worker running
    that run (in a pool, the holder of the run's claim), so a forged id cannot
    hide a run or a failed run (which the retry budget counts); nor has
    ``probed`` (published by a worker when its probe's answer changes). A
    ``coalesced`` event names its leader in its id: a follower put back (its
    leader ended on its own) may join another leader within the duplicate
    window, and that second join is a fact of its own, while a retried
    publish of the same join is stored once. A ``circuit`` change is the
    binder's, once per change: its time is in its id; so is an ``ab``
    change's (with its state), the binder's or an operator's.
    ``cancel_requested`` has none: it is idempotent, and a tenant publishing
    the id of another's cancellation first (on its own subject) would drop it.
    """
    tenant, rid = event.tenant, event.request_id
    if is_terminal(event):
        raise ValueError(f"{kind_of(event)} is terminal: publish it with EventLog.finish")
    if isinstance(event, _NO_MSG_ID):
        return None
    parts: tuple[object, ...] = ()
    if isinstance(event, Preempted):
        parts = (event.attempt, event.delivery)
    elif isinstance(event, Routed):
        parts = (event.attempt,)
    elif isinstance(event, Stolen):
        parts = (event.attempt, event.from_seq)
    elif isinstance(event, Coalesced):
        parts = (event.leader,)
    elif isinstance(event, Promoted):
        parts = (event.to_level,)
    elif isinstance(event, CircuitChanged):
        parts = (repr(event.at),)
    elif isinstance(event, SplitChanged):
        parts = (event.state, repr(event.at))
    return msg_id(tenant, rid, kind_of(event), *parts)


def _headers(event: Event) -> dict[str, str] | None:
    message_id = msg_id_of(event)
    return None if message_id is None else {_MSG_ID: message_id}


async def publish_stored(
    js: JetStream,
    subject: str,
    payload: bytes,
    message_id: str,
    *,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Publish ``payload`` on ``subject`` (with ``headers`` besides its
    message id) so that a copy is surely stored.

    For a message whose source is acked (or deleted) once it is published: a
    requeue. ``message_id`` makes a retried publish store it once, but
    deduplication is stream-wide and tenants publish into the same streams
    with ids of their choice: a "duplicate" ack may mean that another tenant
    took the id first, on its own subject, and nothing of ours was stored.
    So a duplicate counts only when the message it names is still there, on
    ``subject``, with ``payload`` (:func:`surely_stored`).
    """
    ack = await js.publish(subject, payload, headers={**(headers or {}), _MSG_ID: message_id})
    await surely_stored(js, ack, subject, payload, message_id, headers=headers)


async def surely_stored(
    js: JetStream,
    ack: PubAck,
    subject: str,
    payload: bytes,
    message_id: str,
    *,
    headers: Mapping[str, str] | None = None,
    consumed: Callable[[], Awaitable[bool]] | None = None,
) -> PubAck:
    """The ack of a copy of ``payload`` surely stored on ``subject``, given
    ``ack``, the answer to publishing it there under ``message_id`` (with
    ``headers`` besides): ``ack`` itself, unless it is a duplicate whose
    message is not ours.

    Deduplication is stream-wide and tenants publish with ids of their
    choice: a duplicate counts only when the message it names is still
    there, on ``subject``, with ``payload``. Otherwise the payload is
    published again under ``message_id`` plus a random suffix (a uuid4, which
    nobody can take first), and that publish's ack is returned (its errors
    raised). Trade-off: a genuine retry whose first copy was already
    consumed is then stored twice, and may run twice; the terminal claim
    keeps one outcome (and the dispatch's own message id usually drops the
    second). ``consumed``, when given, tells that trade-off's case apart: asked
    only when the message the duplicate names is gone, it says whether ours
    was there and has been read (the forwarder: its request is admitted or
    ended, which only the services can log); then the duplicate stands. For
    publishes whose acks are awaited together (the forwarder's).
    """
    if not ack.duplicate:
        return ack
    stored = None
    if ack.seq:
        with contextlib.suppress(NatsNotFoundError):
            stored = await js.get_msg(ack.stream, seq=ack.seq)
    if stored is not None and stored.subject == subject and stored.data == payload:
        return ack  # ours, from an earlier try, still waiting to be read
    if stored is None and consumed is not None and await consumed():
        return ack  # ours, from an earlier try, read since
    again = {**(headers or {}), _MSG_ID: f"{message_id}:{uuid.uuid4().hex}"}
    return await js.publish(subject, payload, headers=again)


async def delete_consumer(js: JetStream, stream: str, name: str) -> None:
    """Delete a consumer, best effort and bounded: it is ephemeral and expires anyway."""
    with contextlib.suppress(NatsError, TimeoutError):
        await asyncio.wait_for(js.delete_consumer(stream, name), _DELETE_TIMEOUT)


async def read_subject(
    nc: Connection,
    js: JetStream,
    stream: str,
    subject: str,
    *,
    start: int = 1,
    name: str = "rq-read",
    timeout: float = 5.0,  # noqa: ASYNC109 - a bound on silence between messages
) -> list[tuple[int, bytes]]:
    """Messages stored on ``subject`` (wildcards allowed) from stream sequence ``start``.

    Returns ``(stream sequence, data)`` pairs in stream order, up to the last
    message stored when called (see :func:`read_messages`).
    """
    return [
        (seq, data)
        for seq, _, data in await read_messages(
            nc, js, stream, subject, start=start, name=name, timeout=timeout
        )
    ]


async def read_messages(
    nc: Connection,
    js: JetStream,
    stream: str,
    subject: str,
    *,
    start: int = 1,
    name: str = "rq-read",
    timeout: float = 5.0,  # noqa: ASYNC109 - a bound on silence between messages
) -> list[tuple[int, str, bytes]]:
    """Messages stored on ``subject`` (wildcards allowed) from stream sequence ``start``.

    Returns ``(stream sequence, subject, data)`` triples in stream order, up
    to the last message stored when called. Every API subject used names
    ``subject``, so a permission can confine the reader to its own subtree: a
    ``last_by_subj`` direct get first says whether anything is stored at or
    after ``start`` (usually not: then no consumer is made); if so, a named,
    single-filter, unacknowledged, ephemeral push consumer (``name`` plus a
    random suffix, delivering to an inbox of this connection) replays it and
    is deleted. Only that consumer's deliveries of messages stored on
    ``subject`` are kept: anything else arriving on the inbox (another
    consumer delivering there) is dropped and counted.
    Raises ``TimeoutError`` if the replay stalls for ``timeout`` seconds.
    """
    try:
        last = await js.get_last_msg(stream, subject, direct=True)
    except NatsNotFoundError:
        return []
    if last.seq < start:
        return []
    if last.seq == start:  # exactly one message, and the get fetched it
        if not subject_matches(subject, last.subject or ""):
            misdirected("read", last.subject or "", expected=subject)
            return []
        return [(last.seq, last.subject, last.data or b"")]
    return await _replay(
        nc, js, stream, subject, start=start, last=last.seq, name=name, timeout=timeout
    )


async def _replay(
    nc: Connection,
    js: JetStream,
    stream: str,
    subject: str,
    *,
    start: int,
    last: int,
    name: str,
    timeout: float,  # noqa: ASYNC109 - a bound on silence between messages
) -> list[tuple[int, str, bytes]]:
    """:func:`read_messages`' replay of ``subject`` from ``start`` to ``last``
    by a consumer of its own, deleted after."""
    received: asyncio.Queue[Message] = asyncio.Queue()

    async def on_msg(msg: Message) -> None:
        received.put_nowait(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg)
    consumer = f"{name}-{uuid.uuid4().hex}"
    created = False
    try:
        info = await js.add_consumer(
            stream,
            name=consumer,
            filter_subject=subject,
            deliver_subject=inbox,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=_REPLAY_INACTIVE,
            mem_storage=True,
            num_replicas=1,
        )
        created = True
        out: list[tuple[int, str, bytes]] = []
        if not _anything_to_deliver(info):
            return out  # the message at `last` is gone since the get (aged out)
        while True:
            msg = await asyncio.wait_for(received.get(), timeout)
            if msg.headers and msg.headers.get("Status"):
                continue  # a status message (heartbeat), not stored data
            meta = _delivered(msg, stream, consumer, subject)
            if meta is None:
                misdirected("read", msg.subject, expected=subject)
                continue
            out.append((meta.sequence.stream, msg.subject, msg.data))
            if meta.sequence.stream >= last or meta.num_pending == 0:
                return out
    finally:
        with contextlib.suppress(NatsError):
            await sub.unsubscribe()
        if created:
            await delete_consumer(js, stream, consumer)


def _anything_to_deliver(info: ConsumerInfo) -> bool:
    """Whether a push consumer just created will deliver anything, from its
    create response: messages pending, or some already delivered (deliveries
    begin as soon as it exists, and may be counted out of ``num_pending``
    before the response is written). Only a consumer with neither has
    nothing to deliver: its ``num_pending: 0`` alone does not say so."""
    delivered = info.delivered.consumer_seq if info.delivered is not None else 0
    return bool(info.num_pending) or bool(delivered)


def _delivered(msg: Message, stream: str, consumer: str, subject: str) -> MessageMetadata | None:
    """The delivery's metadata, if ``consumer`` of ``stream`` delivered it and it
    was stored on ``subject``; ``None`` for anything else on the inbox."""
    try:
        meta = msg.metadata
    except NatsError:  # not a JetStream delivery
        return None
    if (
        meta.stream != stream
        or meta.consumer != consumer
        or not subject_matches(subject, msg.subject)
    ):
        return None
    return meta


def subject_agrees(subject: str, event: Event) -> bool:
    """Whether ``event`` is what its subject ``rq.evt.<tenant>.<id>.<kind>`` says it is.

    The subject is the authority (NATS permissions check it; nothing checks a
    payload): kind, tenant and request id must all match it.
    """
    parts = subject.split(".")
    return (
        len(parts) == 5
        and parts[:2] == ["rq", "evt"]
        and parts[2] == event.tenant
        and parts[3] == event.request_id
        and parts[4] == kind_of(event)
    )


async def submitted_of(
    js: JetStream, tenant: str, request_id: str, *, first: bool = False, direct: bool = True
) -> Submitted | None:
    """The ``submitted`` event of ``tenant``'s request ``request_id``, if one is stored.

    The one lookup of a request's submit. A request is submitted once within
    the requests stream's duplicate window; one submitted again under the same
    id after it has a second ``submitted`` event. By default this is the newer
    (one get of the last message on the subject, ``direct``: any replica may
    answer, a lagging one may not know it yet; ``direct=False`` asks the
    stream's leader). ``first=True`` reads the older, as the request's history
    does (the DLQ's requeue marks). A payload that disagrees with its subject
    (another tenant's, another id) is no answer.
    """
    subject = event_subject(tenant, request_id, "submitted")
    if first:
        history = await EventLog(js).history(tenant, request_id, kind="submitted")
        return next((event for event in history if isinstance(event, Submitted)), None)
    try:
        raw = await js.get_last_msg(EVENTS_STREAM, subject, direct=direct)
    except NatsNotFoundError:
        return None
    return _submitted_in(subject, raw.data or b"")


def _submitted_in(subject: str, data: bytes) -> Submitted | None:
    """``data`` as the ``submitted`` event its ``subject`` says it is, else None."""
    try:
        event = EVENT_DECODER.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(event, Submitted) or not subject_agrees(subject, event):
        return None
    return event


def _decode_events(raws: list[tuple[int, str, bytes]]) -> list[Event]:
    """The events of ``(seq, subject, data)`` messages, skipping undecodable
    ones and dropping (and counting) those whose payload disagrees with their
    subject: a ``completed`` payload on a ``cancel_requested`` subject (which
    tenants may write) is no completion."""
    events: list[Event] = []
    for _, subject, data in raws:
        try:
            event = EVENT_DECODER.decode(data)
        except msgspec.DecodeError:
            continue  # a foreign or undecodable message on our subject
        if not subject_agrees(subject, event):
            misdirected("events", subject, kind=kind_of(event))
            continue
        events.extend(facts(event))  # a submitted bound at once: the pair, as written apart
    return events


class EventLog:
    """Appends events, terminal outcomes and dead letters; reads one request's history.

    ``nc`` (the connection of ``js``) is needed only by :meth:`read`.
    """

    def __init__(
        self, js: JetStream, *, nc: Connection | None = None, timeout: float = 5.0
    ) -> None:
        self._js = js
        self._nc = nc
        self._timeout = timeout

    def _subject(self, event: Event) -> str:
        if isinstance(event, CancelRequested):
            # A cancellation goes through RQ_CANCELS (size-capped by the
            # broker), which the log sources onto its cancel_requested subject.
            return cancel_subject(event.tenant, event.request_id)
        return event_subject(event.tenant, event.request_id, kind_of(event))

    async def append(self, event: Event) -> bool:
        """Publish non-terminal ``event`` and wait for the ack. False if it was a duplicate."""
        ack = await self._js.publish(
            self._subject(event),
            encode(event),
            timeout=self._timeout,
            headers=_headers(event),
        )
        return not ack.duplicate

    async def append_async(self, event: Event) -> asyncio.Future[PubAck]:
        """Publish non-terminal ``event`` with a pipelined ack; await the returned future."""
        return await self._js.publish_async(
            self._subject(event), encode(event), headers=_headers(event)
        )

    async def finish(
        self,
        event: Event,
        *,
        delivery: int | None = None,
        seq: int | None = None,
        tail: ChunkTail | None = None,
        stream: bool = True,
    ) -> bool:
        """End the request with terminal ``event``, exactly once, and close its token stream.

        The one way a terminal event is written (workers, routers, coalescing
        followers, the advisory reader). Claims the outcome first (see the
        module docstring); returns False when the request already had one:
        then nothing of ``event`` is published, and the earlier claim's event
        and final chunk are made sure of instead.

        ``delivery``/``seq`` place the final chunk: the number of the run that
        ends the request and that run's next chunk ``seq`` (the defaults for a
        missing one: ``1`` and ``0``). With neither given (a caller that ran
        nothing: a router), the final chunk follows the last chunk stored for
        the request, or is ``(1, 0)`` if there is none. ``tail``: what of a
        ``completed`` event the final chunk carries itself (the run's last
        read, not streamed in a chunk of its own). ``stream`` false (a request
        submitted with ``stream`` false): no final chunk at all.
        """
        if not is_terminal(event):
            raise ValueError(f"{kind_of(event)} is not a terminal event")
        if stream and delivery is None and seq is None:
            delivery, seq = await self._after_last_chunk(event.tenant, event.request_id)
        claim = TerminalClaim(
            event=event, delivery=delivery or 1, seq=seq or 0, tail=tail, stream=stream
        )
        if not await self._create(terminal_key(event.tenant, event.request_id), encode(claim)):
            existing = await self.claim_of(event.tenant, event.request_id)
            if existing is not None:
                await self.settle(existing)
            return False
        await self._publish_terminal(claim, check_final=False)
        return True

    async def claim_of(self, tenant: str, request_id: str) -> TerminalClaim | None:
        """The request's terminal claim, if it has one (one direct get)."""
        stored = await self.stored_claim(tenant, request_id)
        return None if stored is None else stored.claim

    async def stored_claim(self, tenant: str, request_id: str) -> StoredClaim | None:
        """The request's terminal claim and when it was stored, if it has one
        (one direct get)."""
        subject = f"$KV.{TERMINAL_BUCKET}.{terminal_key(tenant, request_id)}"
        try:
            raw = await self._js.get_msg(_CLAIMS_STREAM, subject=subject, direct=True)
        except NatsNotFoundError:
            return None
        stored = None if raw.time is None else raw.time.timestamp()
        return StoredClaim(CLAIM_DECODER.decode(raw.data or b""), stored)

    async def settle(self, claim: TerminalClaim) -> None:
        """Make sure a claimed outcome is in the log: publish its event if it is
        missing (stored at most once), and its final chunk if the token stream
        does not end with it. Idempotent; for a claim someone else made."""
        await self._publish_terminal(claim, check_final=True)

    async def claim_run(self, tenant: str, request_id: str, attempt: int, run: int) -> bool:
        """Claim run ``run`` of ``attempt`` of a request: True for the one caller
        that creates the claim, False for every other (a pooled dispatch taken
        by two replicas at once)."""
        return await self._create(run_claim_key(tenant, request_id, attempt, run), b"")

    async def run_claimed(self, tenant: str, request_id: str, attempt: int, run: int) -> bool:
        """Whether run ``run`` of ``attempt`` of a request is claimed (one direct get)."""
        subject = f"$KV.{TERMINAL_BUCKET}.{run_claim_key(tenant, request_id, attempt, run)}"
        try:
            await self._js.get_msg(_CLAIMS_STREAM, subject=subject, direct=True)
        except NatsNotFoundError:
            return False
        return True

    async def _create(self, key: str, value: bytes) -> bool:
        """Create ``key`` in the ``rq-terminal`` bucket; False if it exists (compare-and-set)."""
        try:
            await self._js.publish(
                f"$KV.{TERMINAL_BUCKET}.{key}",
                value,
                timeout=self._timeout,
                headers={_EXPECTED_LAST_SUBJECT_SEQ: "0"},
            )
        except WrongLastSequenceError:
            return False
        return True

    async def _publish_terminal(self, claim: TerminalClaim, *, check_final: bool) -> None:
        event = claim.event
        if not claim.stream:
            await self._store_terminal(event)  # a request nobody streams: no chunk
            return
        chunk = final_chunk(claim)
        subject = token_subject(event.tenant, event.request_id)

        async def close_stream() -> None:
            if check_final:
                with contextlib.suppress(NatsNotFoundError, msgspec.DecodeError):
                    last = await self._js.get_last_msg(TOKENS_STREAM, subject, direct=True)
                    if TOKEN_DECODER.decode(last.data or b"").final:
                        return
            # Its own message id: a repeat within the tokens' duplicate window
            # is dropped, and one past it is the same (delivery, seq) again.
            await self._js.publish(
                subject,
                encode(chunk),
                timeout=self._timeout,
                headers={_MSG_ID: msg_id(event.tenant, event.request_id, "final")},
            )

        # Both at once (one round trip, not two).
        await asyncio.gather(self._store_terminal(event), close_stream())

    async def _store_terminal(self, event: Event) -> None:
        """Publish ``event`` unless its subject already holds one: the claim
        allows one terminal event per request, so a stored one is this one."""
        with contextlib.suppress(WrongLastSequenceError):  # stored by an earlier try
            await self._js.publish(
                self._subject(event),
                encode(event),
                timeout=self._timeout,
                headers={_EXPECTED_LAST_SUBJECT_SEQ: "0"},
            )

    async def _after_last_chunk(self, tenant: str, request_id: str) -> tuple[int, int]:
        """``(delivery, seq)`` right after the last chunk stored for the request."""
        try:
            last = await self._js.get_last_msg(
                TOKENS_STREAM, token_subject(tenant, request_id), direct=True
            )
            chunk = TOKEN_DECODER.decode(last.data or b"")
        except (NatsNotFoundError, msgspec.DecodeError):
            return 1, 0
        return chunk.delivery, chunk.seq + (0 if chunk.final else 1)

    async def dead_letter(
        self,
        stage: str,
        payload: bytes,
        *,
        reason: str,
        source_subject: str,
        tenant: str,
        request_id: str,
        source_seq: int | None = None,
        copy: str | None = None,
        keep: int | None = None,
    ) -> None:
        """Keep a copy of a message that cannot be processed, with why.

        Its ``Nats-Msg-Id`` is ``<tenant>:<request_id>:dlq:<stage>`` (a copy
        recorded again, after a redelivery, is stored once within ``RQ_DLQ``'s
        duplicate window), or, given ``copy``, ``...:<stage>:<copy>``: a copy of
        another message under the same request id (a resubmit refused because
        the request had already ended), kept beside the first one's.

        A message whose whole copy would be over the broker's ``max_payload``
        with these headers (only a request within a few hundred bytes of the
        limit, refused as too big: whatever the services admit leaves
        :data:`~renqueue.schema.REQUEST_HEADROOM`) is kept as an excerpt: its
        first :data:`DLQ_EXCERPT` bytes, with headers ``Rq-Original-Size``
        (bytes), ``Rq-Original-Sha256`` and, given ``source_seq``,
        ``Rq-Original-Seq`` (its sequence in the stream it came from).
        Whatever a message's size, its dead letter fits the broker's limit.
        Given ``keep`` (bytes), a message longer than that is kept as an
        excerpt of that many bytes, with the same headers, whatever its size.
        """
        headers = {
            _MSG_ID: msg_id(tenant, request_id, "dlq", stage, *([] if copy is None else [copy])),
            "Rq-Tenant": tenant,
            "Rq-Reason": reason[:500],
            "Rq-Source-Subject": source_subject,
            "Rq-Request-Id": request_id,
        }
        excerpt = None
        if keep is not None and len(payload) > keep:
            excerpt = keep
        elif wire_size(payload, headers) > self._js.connection.max_payload:
            excerpt = DLQ_EXCERPT
        if excerpt is not None:
            headers["Rq-Original-Size"] = str(len(payload))
            headers["Rq-Original-Sha256"] = hashlib.sha256(payload).hexdigest()
            if source_seq is not None:
                headers["Rq-Original-Seq"] = str(source_seq)
            payload = payload[:excerpt]
        await self._js.publish(dlq_subject(stage), payload, timeout=self._timeout, headers=headers)

    async def history(self, tenant: str, request_id: str, *, kind: str = "*") -> list[Event]:
        """All events of one request (of one ``kind``, if given), in log order,
        reading only that request's subjects. A ``submitted`` event that
        carries the request's binding is read as the pair it stands for
        (:func:`~renqueue.schema.facts`): ``kind="routed"`` finds that
        binding too, ``kind="submitted"`` the ``submitted`` alone.

        For services: ``next_by_subj`` gets carry the subject in the request
        body, which permissions cannot check (``tenant`` may be ``*``). A
        tenant uses :meth:`read`.
        """
        if kind == "*":
            return _decode_events(await self._raws(events_of_request(tenant, request_id)))
        # A request bound at once has its binding in its `submitted` event.
        kinds = ("submitted", "routed") if kind == "routed" else (kind,)
        found = await asyncio.gather(
            *(self._raws(event_subject(tenant, request_id, each)) for each in kinds)
        )
        raws = sorted(raw for each in found for raw in each)
        return [event for event in _decode_events(raws) if kind_of(event) == kind]

    async def decision_of(
        self, tenant: str, request_id: str, attempt: int
    ) -> tuple[Routed, int] | None:
        """The ``routed`` decision logged for the request's ``attempt``, if
        any, and the sequence of the stored event that says it (its own, or
        the request's ``submitted`` when it was bound at once)."""
        found = await asyncio.gather(
            *(
                self._raws(event_subject(tenant, request_id, each))
                for each in ("submitted", "routed")
            )
        )
        for seq, subject, data in sorted((raw for each in found for raw in each), reverse=True):
            for event in _decode_events([(seq, subject, data)]):
                if isinstance(event, Routed) and event.attempt == attempt:
                    return event, seq
        return None

    async def _raws(self, subject: str) -> list[tuple[int, str, bytes]]:
        """Every message on ``subject`` (may have wildcards), in log order:
        ``(seq, subject, data)``."""
        raws: list[tuple[int, str, bytes]] = []
        seq = 1
        while True:
            try:
                raw = await self._js.get_msg(EVENTS_STREAM, seq=seq, subject=subject, next=True)
            except NatsNotFoundError:
                return raws
            raws.append((raw.seq, raw.subject or "", raw.data or b""))
            seq = raw.seq + 1

    async def read(self, tenant: str, request_id: str) -> list[Event]:
        """Like :meth:`history`, through API subjects a tenant's permissions allow."""
        if self._nc is None:
            raise RuntimeError("EventLog.read needs the connection: EventLog(js, nc=nc)")
        raws = await read_messages(
            self._nc,
            self._js,
            EVENTS_STREAM,
            events_of_request(tenant, request_id),
            name=f"rq-evt-{tenant}",
            timeout=self._timeout,
        )
        return _decode_events(raws)

    async def terminal_of(self, tenant: str, request_id: str) -> Event | None:
        """The request's terminal event, if it has one.

        One ``last_by_subj`` direct get per terminal kind, all at once: one
        round trip, allowed by a tenant's permissions. Should a request have two
        terminal events (possible only for requests ended before terminal
        claims existed), the first in log order wins, as in :meth:`history`.
        """

        async def last(kind: str) -> StoredMessage | None:
            subject = event_subject(tenant, request_id, kind)
            try:
                return await self._js.get_last_msg(EVENTS_STREAM, subject, direct=True)
            except NatsNotFoundError:
                return None

        found = await asyncio.gather(*(last(kind) for kind in sorted(TERMINAL_KINDS)))
        raws = sorted(
            (raw.seq, raw.subject or "", raw.data or b"") for raw in found if raw is not None
        )
        return next((e for e in _decode_events(raws) if is_terminal(e)), None)
