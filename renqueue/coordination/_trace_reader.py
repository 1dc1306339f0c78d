"""Reading a stretch of the event log for a what-if (:func:`read_trace`).

One ephemeral, unacknowledged pull consumer on ``RQ_EVENTS`` delivers every
event stored from the warm-up before ``since`` (:data:`~renqueue.sim.WARMUP`)
up to the last one stored when the read began; it is deleted after. As
everywhere the log is read, the subject is the authority: a message that does
not decode as an event, or whose payload disagrees with its subject
``rq.evt.<tenant>.<id>.<kind>`` (a tenant writing a ``completed`` on its
``cancel_requested`` subject), is dropped and counted, never trusted.

A ``submitted`` event is written by the router that reads the request, so
its store time (the server's clock) is when a router first had it: the
simulation holds each request back from routing that long after it arrived
(the services' reading delay, which a busy machine stretches).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Final

import msgspec
from msgspec import Struct

from ..broker import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    JetStream,
    PullSubscription,
    delete_consumer,
    subject_agrees,
)
from ..errors import NatsError, NatsTimeoutError, RenQueueError
from ..schema import EVENT_DECODER, EVENTS_STREAM, Event, Submitted, facts, msg_id
from ..sim import WARMUP, Trace, trace_of

__all__ = ["Read", "read_events", "read_trace"]

_BATCH: Final = 512
#: Seconds without a message, while some are still due, before the read gives up.
_STALL: Final = 5.0


class Read(Struct, frozen=True, kw_only=True):
    """What :func:`read_events` read."""

    #: The events, in log order.
    events: list[Event]
    #: Messages dropped: undecodable, or disagreeing with their subject.
    dropped: int = 0
    #: When each request was first read by a router: its ``submitted``
    #: event's store time (server clock), by ``<tenant>:<request id>``.
    read_at: dict[str, float] = {}


async def read_events(js: JetStream, *, start: float) -> Read:
    """The events stored at or after ``start`` (Unix time, the server's clock),
    in log order, up to the last stored when called.

    Raises :class:`~renqueue.errors.RenQueueError` when the server stops
    delivering before the last one.
    """
    info = await js.stream_info(EVENTS_STREAM)
    last = int(info.state.last_seq)
    if not info.state.messages or last <= 0:
        return Read(events=[])
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=datetime.datetime.fromtimestamp(max(0.0, start), tz=datetime.UTC),
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        mem_storage=True,
        num_replicas=1,
    )
    psub = await js.pull_subscribe("rq.evt.>", stream=EVENTS_STREAM, config=config)
    events: list[Event] = []
    read_at: dict[str, float] = {}
    dropped = 0
    try:
        pending = int((await psub.consumer_info()).num_pending or 0)
        while pending > 0:
            try:
                msgs = await psub.fetch(_BATCH, timeout=_STALL)
            except NatsTimeoutError as exc:
                raise RenQueueError(
                    f"the event log stopped delivering with {pending} event(s) still due "
                    "(the server too slow to answer, or the events gone); try again"
                ) from exc
            for msg in msgs:
                meta = msg.metadata
                pending = 0 if meta.sequence.stream >= last else int(meta.num_pending)
                if meta.sequence.stream > last:
                    break
                try:
                    event = EVENT_DECODER.decode(msg.data)
                except msgspec.DecodeError:
                    dropped += 1
                    continue
                if not subject_agrees(msg.subject, event):
                    dropped += 1
                    continue
                events.extend(facts(event))  # a submitted bound at once: the pair
                if isinstance(event, Submitted):
                    # Stored as it was read, unless it says when it was read.
                    read = meta.timestamp.timestamp() if event.read is None else event.read
                    read_at.setdefault(msg_id(event.tenant, event.request_id), read)
                if pending == 0:
                    break
    finally:
        await _drop(js, psub)
    return Read(events=events, dropped=dropped, read_at=read_at)


async def _drop(js: JetStream, psub: PullSubscription) -> None:
    with contextlib.suppress(NatsError):
        await psub.unsubscribe()
    await delete_consumer(js, EVENTS_STREAM, psub.consumer)


async def read_trace(js: JetStream, *, since: float, until: float) -> Trace:
    """The :class:`~renqueue.sim.Trace` of the requests submitted in
    ``[since, until)``, read from the log (with its warm-up, and every later
    event: how those requests ended)."""
    read = await read_events(js, start=since - WARMUP)
    return trace_of(
        read.events, since=since, until=until, dropped=read.dropped, read_at=read.read_at
    )
