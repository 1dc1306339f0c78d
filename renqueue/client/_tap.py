"""The client's event tap: consumers following the tenant's terminal events,
which resolve the handles waiting for their request's end.

One named push consumer on RQ_EVENTS per terminal kind (``completed``,
``failed``, ``rejected``, ``expired``, ``cancelled``), each with the one filter
rq.evt.<tenant>.*.<kind>: a request's other events (submitted, routed,
started, ...) are never delivered to the client, which acts only on its end.
Each create subject names its filter, so a tenant's permissions allow it (an
unnamed or ordered consumer's create subject does not, and cannot be allowed
without exposing every tenant; several filters in one consumer are in its
body, likewise). Push, not pull: a pull needs
$JS.API.CONSUMER.MSG.NEXT.<stream>.<name>, which no permission can confine to
a tenant's own consumers, and a callback cannot swallow a cancellation the
way a pending fetch can. Deliveries are unacknowledged; each carries its
consumer sequence and each idle heartbeat the last one sent, so a loss (slow
consumer, reconnect) shows as a gap, and silence as a consumer that is gone
(deleted after a long disconnect, or a server restart). On either, the tap's
consumers are re-created (a no-op for those that still exist) and the
pending waiters are checked against the log: nothing is missed.

Every delivery is taken on its subject's word, never its payload's: an event
is accepted only if the tap's own consumer delivered it and its subject
``rq.evt.<tenant>.<request_id>.<kind>`` agrees with its payload; anything
else is dropped and counted (``renqueue_misdirected_messages_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import uuid
from typing import TYPE_CHECKING

import msgspec

from ..broker import (
    AckPolicy,
    DeliverPolicy,
    EventLog,
    Message,
    Subscription,
    delete_consumer,
    subject_agrees,
)
from ..errors import NatsError
from ..logs import get_logger, misdirected
from ..schema import (
    EVENT_DECODER,
    EVENTS_STREAM,
    TERMINAL_KINDS,
    Event,
    event_subject,
    is_terminal,
    kind_of,
)
from ._retries import retrying

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["EventTap", "Waiter"]

log = get_logger("client")


class Waiter:
    """One request's terminal event, awaited by every handle of this client
    that follows it through the tap.

    ``holders`` counts the submits of the request still being published and
    the handles given the waiter: it is dropped only when none is left, so a
    submit whose publish raised, or was a duplicate, never takes it from a
    resubmit that shares it. ``stored``: a submit of this client stored the
    request (a publish that was no duplicate), after the tap was following
    events, so the tap (or a sweep of the log) sees its end.

    Each :meth:`wait` awaits a future of its own, which the tap resolves
    directly (one wakeup, one timer): a wait that times out or is cancelled
    ends only itself, never the others or a later one.
    """

    __slots__ = ("_waiting", "closed", "event", "holders", "stored")

    def __init__(self) -> None:
        self.event: Event | None = None
        #: The tap closed before the event came: every wait is cancelled.
        self.closed = False
        self.holders = 0
        self.stored = False
        #: The futures of the waits not ended (a dict: in order, and each
        #: taken out at once when its wait ends, however many there are).
        #: A deadline resolves its wait's future with ``None``, never an
        #: exception, which no one might read (a wait cancelled in the same turn).
        self._waiting: dict[asyncio.Future[Event | None], None] = {}

    def resolve(self, event: Event) -> None:
        """The request ended with ``event``: every wait returns it (the first one only counts)."""
        if self.event is not None or self.closed:
            return
        self.event = event
        for future in self._waiting:
            if not future.done():
                future.set_result(event)
        self._waiting.clear()

    def close(self) -> None:
        """The tap stops: a wait not resolved (and every later one) is cancelled."""
        if self.event is not None:
            return
        self.closed = True
        for future in self._waiting:
            future.cancel()
        self._waiting.clear()

    async def wait(self, timeout: float | None = None) -> Event:  # noqa: ASYNC109 - one deadline
        """The terminal event; :class:`TimeoutError` after ``timeout`` seconds
        (``None``: no limit; not above 0, NaN too: at once), :class:`asyncio.CancelledError`
        if the tap closes first."""
        if self.event is not None:
            return self.event
        if self.closed:
            raise asyncio.CancelledError
        # ``not > 0``: a NaN is no deadline (in the loop's timer heap it
        # would misorder every other timer).
        if timeout is not None and not timeout > 0:
            raise TimeoutError
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Event | None] = loop.create_future()
        self._waiting[future] = None
        timer = None if timeout is None else loop.call_later(timeout, _time_out, future)
        try:
            event = await future
        finally:
            if timer is not None:
                timer.cancel()
            self._waiting.pop(future, None)  # timed out or cancelled: not resolved
        if event is not None:
            return event
        # Timed out; an end the tap saw in the same turn of the loop still counts.
        if self.event is not None:
            return self.event
        raise TimeoutError


def _time_out(future: asyncio.Future[Event | None]) -> None:
    """A wait's deadline: its future says "no event" (``None``)."""
    if not future.done():
        future.set_result(None)


class _Feed:
    """One consumer of the tap: the tenant's terminal events of one kind."""

    __slots__ = ("cseq", "inbox", "kind", "name", "seen", "sub")

    def __init__(self, kind: str, name: str, inbox: str) -> None:
        self.kind = kind
        self.name = name
        self.inbox = inbox
        self.sub: Subscription | None = None
        self.cseq = 0  # consumer sequence of the last delivery
        self.seen = -math.inf  # loop time of the last message or heartbeat; never


class EventTap:
    """The tap of one client (module docstring), and the waiters it resolves.

    It reads the client's connection, tenant and ``tap_heartbeat`` /
    ``tap_inactive_threshold`` as they are at each use.
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        #: The consumers' common name (``<name>-<kind>`` each; made when the
        #: tap is first needed).
        self.name = ""
        #: Its consumers, by name and by inbox.
        self._feeds: dict[str, _Feed] = {}
        self._by_inbox: dict[str, _Feed] = {}
        self._following = False
        self._wake = asyncio.Event()  # a gap was seen: sweep the waiters
        self._watch: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._waiters: dict[str, Waiter] = {}
        self._closed = False

    @property
    def names(self) -> list[str]:
        """The names of the tap's consumers (none before it is first needed)."""
        return list(self._feeds)

    async def close(self) -> None:
        """Stop following: the watch, the consumers, and every waiter still waiting."""
        self._closed = True
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            await asyncio.wait({watch}, timeout=1.0)
        nc = self._client.nc
        if self._following:
            self._following = False
            for feed in self._feeds.values():
                if feed.sub is not None:
                    with contextlib.suppress(NatsError):
                        await feed.sub.unsubscribe()
                    feed.sub = None
            if not nc.is_closed:
                await asyncio.gather(
                    *(delete_consumer(self._client.js, EVENTS_STREAM, name) for name in self._feeds)
                )
        for waiter in self._waiters.values():
            waiter.close()

    # ------------------------------------------------------------- waiters

    def hold(self, request_id: str) -> Waiter:
        """The waiter of ``request_id`` (made if there is none), held once more."""
        waiter = self._waiters.get(request_id)
        if waiter is None:
            waiter = self._waiters[request_id] = Waiter()
        waiter.holders += 1
        return waiter

    def release(self, request_id: str, waiter: Waiter) -> None:
        """A submit gives up its hold on ``waiter``; the last one drops it."""
        waiter.holders -= 1
        if waiter.holders <= 0 and self._waiters.get(request_id) is waiter:
            del self._waiters[request_id]

    async def follow(self, request_id: str) -> Event:
        """The terminal event of this tenant's request ``request_id``, submitted
        earlier or elsewhere: from the log if it has ended, else from the tap
        when it does (the waiter is registered before the log is read, so an
        end between the two is not missed)."""
        await self.ensure()
        waiter = self.hold(request_id)
        client = self._client
        try:
            lookup = functools.partial(EventLog(client.js).terminal_of, client.tenant, request_id)
            ended = await retrying(client.nc, "looking up a result", lookup, request_id=request_id)
            if ended is not None:
                return ended
            return await waiter.wait()
        finally:
            self.release(request_id, waiter)

    # ------------------------------------------------------------- the consumers

    async def ensure(self) -> None:
        if self._following:
            return
        async with self._lock:
            if self._following:
                return
            if self._closed:
                raise RuntimeError("client is closed")
            nc = self._client.nc
            self.name = f"rq-tap-{self._client.tenant}-{uuid.uuid4().hex[:16]}"
            feeds = [
                _Feed(kind, f"{self.name}-{kind}", nc.new_inbox())
                for kind in sorted(TERMINAL_KINDS)
            ]
            try:
                for feed in feeds:
                    feed.sub = await nc.subscribe(feed.inbox, cb=self._deliver)
                await self._create_all(feeds)
            except BaseException:
                for feed in feeds:
                    if feed.sub is not None:
                        with contextlib.suppress(Exception):
                            await feed.sub.unsubscribe()
                raise
            self._feeds = {feed.name: feed for feed in feeds}
            self._by_inbox = {feed.inbox: feed for feed in feeds}
            self._following = True
            self._watch = asyncio.create_task(self._watch_loop(), name=f"renqueue-tap-{self.name}")

    async def _create_all(self, feeds: list[_Feed]) -> None:
        """Create the tap's consumers; if any is refused, delete those made (not
        left to expire unread, five more at each later try) and raise."""
        made = await asyncio.gather(*(self._create(feed) for feed in feeds), return_exceptions=True)
        refused = [error for error in made if isinstance(error, BaseException)]
        if refused:
            await asyncio.gather(
                *(
                    delete_consumer(self._client.js, EVENTS_STREAM, feed.name)
                    for feed, error in zip(feeds, made, strict=True)
                    if error is None
                )
            )
            raise refused[0]

    async def _deliver(self, msg: Message) -> None:
        # Looked up at each message: a test stands in for it.
        await self._on_message(msg)

    async def _create(self, feed: _Feed) -> None:
        """Create one of the tap's consumers; with the same name and config, a
        no-op if it exists."""
        info = await self._client.js.add_consumer(
            EVENTS_STREAM,
            name=feed.name,
            filter_subject=event_subject(self._client.tenant, "*", feed.kind),
            deliver_subject=feed.inbox,
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.NONE,
            idle_heartbeat=self._client.tap_heartbeat,
            inactive_threshold=self._client.tap_inactive_threshold,
            mem_storage=True,
            num_replicas=1,
        )
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        feed.cseq = delivered or 0
        feed.seen = asyncio.get_running_loop().time()

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        reconnects = self._client.nc.reconnects
        # A sweep of the log is owed (a gap or a re-created tap) until one succeeds.
        owed = False
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(1.0, self._client.tap_heartbeat))
            if self._client.nc.is_closed:
                return  # closed under this client (not by it): nothing to follow
            gap = self._wake.is_set()
            self._wake.clear()
            # After a reconnect the server may have lost the (in-memory) tap:
            # don't wait for three missed heartbeats to find out.
            reconnected = self._client.nc.is_connected and self._client.nc.reconnects != reconnects
            if reconnected:
                reconnects = self._client.nc.reconnects
            quiet = loop.time() - 3 * self._client.tap_heartbeat
            silent = [feed for feed in self._feeds.values() if reconnected or feed.seen < quiet]
            owed = owed or gap or bool(silent)
            if not owed:
                continue
            try:
                if silent:
                    # All of them (a no-op for those that exist): one gone
                    # says the others may be (a server restart loses them all).
                    feeds = list(self._feeds.values())
                    async with self._lock:
                        await asyncio.gather(*(self._create(feed) for feed in feeds))
                    log.info("event tap re-created", consumer=self.name)
                # What the tap missed is only in the log: a sweep that fails
                # (a direct get timing out while a node is down) is owed still,
                # though the re-created tap's heartbeats say all is well.
                await self._sweep()
                owed = False
            except Exception as exc:  # noqa: BLE001 - retried at the next beat
                log.warning("event tap recovery failed; retrying", error=str(exc))

    async def _sweep(self) -> None:
        """Resolve waiters whose terminal event the tap may have missed, from the log."""
        events = EventLog(self._client.js)
        limit = asyncio.Semaphore(32)

        async def check(request_id: str) -> None:
            async with limit:
                event = await events.terminal_of(self._client.tenant, request_id)
            if event is not None:
                self._resolve(event)

        results = await asyncio.gather(
            *(check(rid) for rid in list(self._waiters)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def _on_message(self, msg: Message) -> None:
        now = asyncio.get_running_loop().time()
        headers = msg.headers
        if headers and headers.get("Status"):
            self._heartbeat(msg.subject, headers, now)
            return
        try:
            meta = msg.metadata
        except Exception:  # noqa: BLE001 - not a JetStream delivery: not ours
            misdirected("tap", msg.subject)
            return
        feed = self._feeds.get(meta.consumer) if meta.stream == EVENTS_STREAM else None
        if feed is None:
            # Another consumer delivering to this inbox (its name is in the
            # delivery's reply subject, which the server sets).
            misdirected("tap", msg.subject, consumer=meta.consumer)
            return
        feed.seen = now
        cseq = meta.sequence.consumer
        if cseq != feed.cseq + 1:
            self._wake.set()
        feed.cseq = cseq
        # Only the end of a request waited for is decoded. The subject is
        # rq.evt.<tenant>.<request_id>.<kind> (ids have no dots).
        tokens = msg.subject.split(".")
        if len(tokens) != 5 or tokens[3] not in self._waiters:
            return
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        # The subject is the authority: a payload must be what its subject
        # says (kind, tenant, request id). Tenants may publish only on
        # rq.evt.<tenant>.*.cancel_requested, so a terminal event that agrees
        # with its subject was written by the services.
        if event.tenant != self._client.tenant or not subject_agrees(msg.subject, event):
            misdirected("tap", msg.subject, kind=kind_of(event))
            return
        if is_terminal(event):
            self._resolve(event)

    def _heartbeat(self, inbox: str, headers: dict[str, str], now: float) -> None:
        """An idle heartbeat, on a consumer's inbox: it carries the last consumer
        sequence sent."""
        feed = self._by_inbox.get(inbox)
        if feed is None:
            return
        feed.seen = now
        last = headers.get("Nats-Last-Consumer")
        if last is not None and last.isdigit() and int(last) > feed.cseq:
            feed.cseq = int(last)
            self._wake.set()

    def _resolve(self, event: Event) -> None:
        waiter = self._waiters.pop(event.request_id, None)
        if waiter is not None:
            waiter.resolve(event)
