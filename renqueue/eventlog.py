"""Writing to and reading from the event log (the ``RQ_EVENTS`` stream).

Every event is published with a JetStream message id derived from the request
id, so publishing the same fact twice stores it once. All terminal events of a
request share one id (``<request_id>:terminal``): JetStream keeps the first and
reports the rest as duplicates, which is how a second completion (a worker that
was presumed dead but was not) is detected and dropped. Past the duplicate
window the same check is made by reading the request's events.

Two ways to read: services (full permissions) walk a request's subjects with
``next_by_subj`` direct gets (:meth:`EventLog.history`); a tenant reads only
through API subjects that name the subject read, which a NATS permission can
confine to the tenant's own subtree: ``last_by_subj`` direct gets
(``$JS.API.DIRECT.GET.<stream>.<subject>``, :meth:`EventLog.terminal_of`) and
named single-filter consumers (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``,
:func:`read_subject`, :meth:`EventLog.read`). ``nats/auth.conf`` grants those.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, Final

import msgspec
from nats.js.api import AckPolicy, DeliverPolicy
from nats.js.errors import NotFoundError

from .messages import (
    EVENT_DECODER,
    TERMINAL_KINDS,
    Event,
    Preempted,
    Promoted,
    Retrying,
    Routed,
    Started,
    Stolen,
    TokenChunk,
    encode,
    is_terminal,
    kind_of,
)
from .subjects import (
    EVENTS_STREAM,
    dlq_subject,
    event_subject,
    events_of_request,
    msg_id,
    token_subject,
)

__all__ = ["EventLog", "delete_consumer", "msg_id_of", "read_subject"]

_MSG_ID: Final = "Nats-Msg-Id"
#: A replay consumer left behind (its reader died) goes away this long after.
_REPLAY_INACTIVE: Final = 10.0
#: Bound on deleting a consumer: closing never waits longer than this.
_DELETE_TIMEOUT: Final = 1.0


def msg_id_of(event: Event) -> str:
    """The JetStream message id that makes publishing ``event`` idempotent
    (scoped by tenant: see :func:`renqueue.subjects.msg_id`)."""
    tenant, rid = event.tenant, event.request_id
    if is_terminal(event):
        return msg_id(tenant, rid, "terminal")
    if isinstance(event, Started | Retrying | Preempted):
        return msg_id(tenant, rid, kind_of(event), event.attempt, event.delivery)
    if isinstance(event, Routed):
        return msg_id(tenant, rid, "routed", event.attempt)
    if isinstance(event, Stolen):
        return msg_id(tenant, rid, "stolen", event.attempt)
    if isinstance(event, Promoted):
        return msg_id(tenant, rid, "promoted", event.to_level)
    return msg_id(tenant, rid, kind_of(event))


async def delete_consumer(js: Any, stream: str, name: str) -> None:
    """Delete a consumer, best effort and bounded: it is ephemeral and expires anyway."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(js.delete_consumer(stream, name), _DELETE_TIMEOUT)


async def read_subject(
    nc: Any,
    js: Any,
    stream: str,
    subject: str,
    *,
    start: int = 1,
    name: str = "rq-read",
    timeout: float = 5.0,  # noqa: ASYNC109 - a bound on silence between messages
) -> list[tuple[int, bytes]]:
    """Messages stored on ``subject`` (wildcards allowed) from stream sequence ``start``.

    Returns ``(stream sequence, data)`` pairs in stream order, up to the last
    message stored when called. Every API subject used names ``subject``, so a
    permission can confine the reader to its own subtree: a ``last_by_subj``
    direct get first says whether anything is stored at or after ``start``
    (usually not: then no consumer is made); if so, a named, single-filter,
    unacknowledged, ephemeral push consumer (``name`` plus a random suffix,
    delivering to an inbox of this connection) replays it and is deleted.
    Raises ``TimeoutError`` if the replay stalls for ``timeout`` seconds.
    """
    try:
        last = await js.get_last_msg(stream, subject, direct=True)
    except NotFoundError:
        return []
    if last.seq < start:
        return []
    if last.seq == start:  # exactly one message, and the get fetched it
        return [(last.seq, last.data or b"")]
    received: asyncio.Queue[Any] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
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
        out: list[tuple[int, bytes]] = []
        pending = info.num_pending or 0
        while pending > 0:
            msg = await asyncio.wait_for(received.get(), timeout)
            if msg.headers and msg.headers.get("Status"):
                continue  # a status message (heartbeat), not stored data
            meta = msg.metadata
            out.append((meta.sequence.stream, msg.data))
            pending = 0 if meta.sequence.stream >= last.seq else meta.num_pending
        return out
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if created:
            await delete_consumer(js, stream, consumer)


def _decode_events(raws: list[tuple[int, bytes]]) -> list[Event]:
    events: list[Event] = []
    for _, data in raws:
        # A foreign or undecodable message on our subject is skipped.
        with contextlib.suppress(msgspec.DecodeError):
            events.append(EVENT_DECODER.decode(data))
    return events


class EventLog:
    """Appends events, terminal outcomes and dead letters; reads one request's history.

    ``nc`` (the connection of ``js``) is needed only by :meth:`read`.
    """

    def __init__(self, js: Any, *, nc: Any = None, timeout: float = 5.0) -> None:
        self._js = js
        self._nc = nc
        self._timeout = timeout

    def _subject(self, event: Event) -> str:
        return event_subject(event.tenant, event.request_id, kind_of(event))

    async def append(self, event: Event) -> bool:
        """Publish ``event`` and wait for the ack. False if it was a duplicate."""
        ack = await self._js.publish(
            self._subject(event),
            encode(event),
            timeout=self._timeout,
            headers={_MSG_ID: msg_id_of(event)},
        )
        return not ack.duplicate

    async def append_async(self, event: Event) -> asyncio.Future[Any]:
        """Publish ``event`` with a pipelined ack; await the returned future for it."""
        future: asyncio.Future[Any] = await self._js.publish_async(
            self._subject(event), encode(event), headers={_MSG_ID: msg_id_of(event)}
        )
        return future

    async def finish(self, event: Event, *, delivery: int = 1, seq: int = 0) -> bool:
        """Record a terminal ``event`` and close the request's token stream.

        Returns False when the request already had a terminal event: this one
        was dropped by JetStream's deduplication, and nothing else is published.
        """
        if not is_terminal(event):
            raise ValueError(f"{kind_of(event)} is not a terminal event")
        # Both at once (one round trip, not two). The final chunk has an id of
        # its own, so a duplicate terminal's final chunk is dropped as well.
        chunk = TokenChunk(request_id=event.request_id, delivery=delivery, seq=seq, final=True)
        terminal = await self.append_async(event)
        closed = await self._js.publish_async(
            token_subject(event.tenant, event.request_id),
            encode(chunk),
            headers={_MSG_ID: msg_id(event.tenant, event.request_id, "final")},
        )
        ack, _ = await asyncio.wait_for(asyncio.gather(terminal, closed), self._timeout)
        return not ack.duplicate

    async def dead_letter(
        self,
        stage: str,
        payload: bytes,
        *,
        reason: str,
        source_subject: str,
        tenant: str,
        request_id: str,
    ) -> None:
        """Keep a copy of a message that cannot be processed, with why."""
        await self._js.publish(
            dlq_subject(stage),
            payload,
            timeout=self._timeout,
            headers={
                _MSG_ID: msg_id(tenant, request_id, "dlq", stage),
                "Rq-Tenant": tenant,
                "Rq-Reason": reason[:500],
                "Rq-Source-Subject": source_subject,
                "Rq-Request-Id": request_id,
            },
        )

    async def history(self, tenant: str, request_id: str) -> list[Event]:
        """All events of one request, in log order, reading only that request's subjects.

        For services: ``next_by_subj`` gets carry the subject in the request
        body, which permissions cannot check (``tenant`` may be ``*``). A
        tenant uses :meth:`read`.
        """
        subject = events_of_request(tenant, request_id)
        raws: list[tuple[int, bytes]] = []
        seq = 1
        while True:
            try:
                raw = await self._js.get_msg(EVENTS_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return _decode_events(raws)
            raws.append((raw.seq, raw.data or b""))
            seq = raw.seq + 1

    async def read(self, tenant: str, request_id: str) -> list[Event]:
        """Like :meth:`history`, through API subjects a tenant's permissions allow."""
        if self._nc is None:
            raise RuntimeError("EventLog.read needs the connection: EventLog(js, nc=nc)")
        raws = await read_subject(
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
        terminal events (possible only past the duplicate window), the first
        in log order wins, as in :meth:`history`.
        """

        async def last(kind: str) -> Any:
            subject = event_subject(tenant, request_id, kind)
            try:
                return await self._js.get_last_msg(EVENTS_STREAM, subject, direct=True)
            except NotFoundError:
                return None

        found = await asyncio.gather(*(last(kind) for kind in sorted(TERMINAL_KINDS)))
        raws = sorted((raw.seq, raw.data or b"") for raw in found if raw is not None)
        return next((e for e in _decode_events(raws) if is_terminal(e)), None)
