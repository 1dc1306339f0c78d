"""What the log says about coalesced requests that their group does not: the
followers of a leader whose group expired or was replaced meanwhile
(:func:`followers_in_log`), and the attempt a follower was last preempted
at, which its requeue must pass (:func:`preempted_attempt`).

The ``rq-state`` bucket is not the record of who follows whom; the log is:
each follower's ``coalesced`` event names its leader (see :mod:`._coalescing`).
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from typing import Final

import msgspec

from ..broker import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    JetStream,
    delete_consumer,
    subject_agrees,
    submitted_of,
)
from ..errors import NatsError, NatsNotFoundError
from ..schema import EVENT_DECODER, EVENTS_STREAM, Coalesced, Preempted, event_subject

__all__ = ["followers_in_log", "preempted_attempt"]

#: Seconds subtracted from a leader's submit time (the requests stream's clock)
#: when its followers are looked up in the log (the events stream's clock: on
#: a cluster, another node's).
_CLOCK_SLACK: Final = 60.0
#: Coalesced events read per fetch when followers are looked up in the log.
_SCAN_BATCH: Final = 256


async def followers_in_log(js: JetStream, tenant: str, leader: str) -> list[str]:
    """The requests whose latest ``coalesced`` event names ``leader`` and
    which have not moved on since (routed, or coalesced with another).

    Read from the leader's submit time on: no one joins a leader before
    it is read. A leader with no ``submitted`` event (a tenant hid it, see
    docs/architecture.md) has none found. The tenant's newest coalesced
    event says, in one direct get, whether there is anything to read.
    """
    submitted = await submitted_of(js, tenant, leader)
    if submitted is None:
        return []
    since = submitted.at - _CLOCK_SLACK
    subject = event_subject(tenant, "*", "coalesced")
    try:
        newest = await js.get_last_msg(EVENTS_STREAM, subject, direct=True)
    except NatsNotFoundError:
        return []
    if newest.time is not None and newest.time.timestamp() < since:
        return []
    latest: dict[str, tuple[str, int]] = {}
    start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
    name = f"rq-co-{tenant}-{uuid.uuid4().hex}"
    sub = await js.pull_subscribe(
        subject,
        stream=EVENTS_STREAM,
        config=ConsumerConfig(
            name=name,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=start,
            inactive_threshold=10.0,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    try:
        info = await sub.consumer_info()
        pending = int(info.num_pending or 0)
        while pending > 0:
            for msg in await sub.fetch(batch=_SCAN_BATCH, timeout=5.0):
                meta = msg.metadata
                pending = int(meta.num_pending)
                with contextlib.suppress(msgspec.DecodeError):
                    event = EVENT_DECODER.decode(msg.data)
                    if isinstance(event, Coalesced) and subject_agrees(msg.subject, event):
                        latest[event.request_id] = (event.leader, meta.sequence.stream)
    finally:
        with contextlib.suppress(NatsError):
            await sub.unsubscribe()
        await delete_consumer(js, EVENTS_STREAM, name)
    followers = []
    for follower, (named, seq) in latest.items():
        if named != leader or follower == leader:
            continue
        routed = event_subject(tenant, follower, "routed")
        try:
            moved = (await js.get_last_msg(EVENTS_STREAM, routed, direct=True)).seq
        except NatsNotFoundError:
            moved = 0
        if (moved or 0) < seq:
            followers.append(follower)
    return followers


async def preempted_attempt(js: JetStream, tenant: str, request_id: str) -> int:
    """The attempt of the request's latest ``preempted`` event; 0 if none."""
    subject = event_subject(tenant, request_id, "preempted")
    try:
        raw = await js.get_last_msg(EVENTS_STREAM, subject, direct=True)
        event = EVENT_DECODER.decode(raw.data or b"")
    except (NatsNotFoundError, msgspec.DecodeError):
        return 0
    return event.attempt if isinstance(event, Preempted) else 0
