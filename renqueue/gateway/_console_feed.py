"""The console's live feed: one tail of the event log shared by every open console.

:class:`EventFeed` reads ``RQ_EVENTS`` through one ephemeral, unacknowledged
pull consumer (as the projector does), whatever the number of browsers
watching: each event is decoded and encoded for the browser once, kept in a
ring of the latest ``backlog`` events, and handed to every subscriber's queue.
The tail runs only while a console is open: the first subscriber starts it
(from the last ``backlog`` events of the log, so a console opens on the recent
past), the last one to leave stops it and deletes its consumer.

The tail's failures are its own: whatever goes wrong (the broker away,
``RQ_EVENTS`` missing or replaced), it is logged, every console is told (an
``event: error`` with the reason), and the tail starts again after a capped
backoff, for as long as a console is open. It never raises into the gateway's
supervisor, so an admin's open page cannot make the gateway give up and stop
serving the tenants. When it is back, consoles get an ``event: gap`` (reload
the snapshot); a log that was replaced (re-provisioned: its sequences start
over) is read from its start.

Every line the browser gets has an id of its own, in the order the lines
come (:func:`event_id`): the event's stream sequence, ``<seq>.1`` for the
second line of a stored event that stands for two (a request bound at once:
its ``submitted``, then its ``routed``, both stored at ``<seq>``). A
subscriber that reconnects names the last line it got (SSE's
``Last-Event-ID``); :meth:`EventFeed.since` gives what came after that line
from the ring (the second line of a pair too, when the first was the last
one got), or says that the ring no longer reaches back that far (a *gap*:
the page then reloads its snapshot). A
subscriber too slow to take what comes (its queue full) is closed, never
waited for: the feed keeps pace with the log, and the browser reconnects from
where it was.

:func:`summary` is what the browser gets of an event: its sequence, time,
kind, tenant, request, backend and a short line of its other fields; never a
prompt, and the answer's text only as its length.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import Final

import msgspec

from ..broker import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    JetStream,
    PullSubscription,
    delete_consumer,
    subject_agrees,
)
from ..errors import NatsError, NatsNotFoundError
from ..logs import get_logger
from ..schema import (
    EVENT_DECODER,
    EVENTS_STREAM,
    Event,
    InferenceRequest,
    Submitted,
    facts,
    kind_of,
)
from ..tasks import Supervisor

__all__ = [
    "SHOWN",
    "EventFeed",
    "Position",
    "Subscriber",
    "event_id",
    "parse_event_id",
    "shown",
    "summary",
]

log = get_logger("gateway.console")

#: Events kept for consoles that open or reconnect.
BACKLOG: Final = 500
#: Seconds the tail waits before starting again after a failure: doubled per
#: failure in a row, up to the most; a run of ``_HEALTHY`` seconds starts over.
RETRY_BASE: Final = 0.2
RETRY_MAX: Final = 5.0
_HEALTHY: Final = 30.0
#: A queued frame's sequence that says it is a notice, written whatever the
#: subscriber got (:data:`NOTICE`), or that the log started over (:data:`RESTART`).
NOTICE: Final = 0
RESTART: Final = -1
#: Where a line stands in the feed: the stream sequence of its event, and which
#: of the lines that event stands for (0, or 1 for the ``routed`` of a request
#: bound at once: :func:`~renqueue.schema.facts`). Lines are in this order.
Position = tuple[int, int]
#: A part above any line's: ``(seq, _EVERY_PART)`` is after every line of ``seq``.
_EVERY_PART: Final = 1 << 30
#: The longest ``Last-Event-ID`` taken: a sequence (19 digits), a dot, a part.
_ID_LENGTH: Final = 24
#: Frames a subscriber may have waiting before it is dropped as too slow.
QUEUE_SIZE: Final = 2000
#: The longest value of one field shown in an event's line.
_FIELD_WIDTH: Final = 160
_BATCH: Final = 256
#: What a console shows of each kind of event besides its kind, tenant, request
#: and time: an allow-list, so a field not named here (one a later schema adds)
#: is never shown. A ``submitted`` event's request is shown as its route,
#: priority, message count, deadline and cost cap (never its messages, tools,
#: parameters or metadata); a completion's ``text`` as its length (live) or its
#: first :data:`TEXT_SHOWN` characters (a timeline), its ``tool_calls`` and
#: ``logprobs`` as how many there are (never their arguments or tokens).
SHOWN: Final[dict[str, tuple[str, ...]]] = {
    "submitted": ("request", "traceparent"),
    "rejected": ("error_type", "reason"),
    "routed": (
        "backend", "attempt", "priority", "queue_wait", "reason", "router", "term",
        "reserved_tokens", "probe", "complexity_estimate", "predicted", "estimated_cost",
        "split", "arm",
    ),
    "promoted": ("from_level", "to_level", "waited", "reason"),
    "cancel_requested": ("reason",),
    "preempted": ("backend", "attempt", "delivery", "by"),
    "stolen": ("from_backend", "to_backend", "attempt", "from_seq"),
    "coalesced": ("leader",),
    "started": ("backend", "attempt", "delivery", "worker"),
    "retrying": (
        "backend", "attempt", "delivery", "error_type", "error_class", "reason",
        "retry_after", "limits", "quota_exhausted_until", "requeued",
    ),
    "fell_back": (
        "backend", "attempt", "delivery", "error_type", "error_class", "reason", "fallback",
        "probe", "limits", "retry_after",
    ),
    "circuit": ("backend", "state", "previous", "reason", "router", "term"),
    "probed": ("backend", "ok", "detail", "worker"),
    "ab": ("route", "state", "arm", "previous", "reason", "router", "term", "operator"),
    "completed": (
        "backend", "attempt", "delivery", "text", "usage", "cost", "finish_reason", "ttft",
        "duration", "shared_with", "limits", "reserved_tokens", "tool_calls", "logprobs",
    ),
    "failed": (
        "error_type", "error_class", "reason", "backend", "attempt", "limits",
        "quota_exhausted_until",
    ),
    "expired": ("stage", "reason", "split", "arm"),
    "cancelled": ("stage", "reason"),
}  # fmt: skip
#: The longest completion text a timeline shows, and the longest other string.
TEXT_SHOWN: Final = 200
STRING_SHOWN: Final = 300
#: Fields shown only as how many items they hold.
_COUNTED: Final = frozenset({"tool_calls", "logprobs"})


def shown(event: Event, *, live: bool) -> dict[str, object]:
    """The fields of ``event`` a console may show (:data:`SHOWN`), JSON-ready:
    a completion's text as its length when ``live`` (the event stream), else cut
    at :data:`TEXT_SHOWN` characters (a timeline); other strings cut at
    :data:`STRING_SHOWN`. Pure."""
    out: dict[str, object] = {}
    for name in SHOWN.get(kind_of(event), ()):
        value = getattr(event, name, None)
        if name in _COUNTED and isinstance(value, tuple):
            out[name] = len(value)
        elif isinstance(value, InferenceRequest):
            out[name] = {
                "route": value.route,
                "priority": value.priority,
                "messages": len(value.messages),
                "deadline": value.deadline,
                "max_cost": value.max_cost,
            }
        elif name == "text" and isinstance(value, str):
            out[name] = f"{len(value)} characters" if live else _cut(value, TEXT_SHOWN)
        elif isinstance(value, str):
            out[name] = _cut(value, STRING_SHOWN)
        else:
            out[name] = msgspec.to_builtins(value)
    return out


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def summary(seq: int, event: Event) -> dict[str, object]:
    """What a console shows of ``event`` (stored at ``seq``): JSON-ready. Pure."""
    details = shown(event, live=True)
    if isinstance(event, Submitted):  # the request's figures, in the line itself
        request = details.pop("request")
        details.pop("traceparent", None)
        if isinstance(request, dict):
            details.update((k, v) for k, v in request.items() if k != "max_cost")
    backend = details.pop("backend", None) or details.get("to_backend")
    line = " ".join(f"{key}={_short(value)}" for key, value in details.items() if _said(value))
    return {
        "seq": seq,
        "at": event.at,
        "kind": kind_of(event),
        "tenant": event.tenant,
        "request_id": event.request_id,
        "backend": backend if isinstance(backend, str) else None,
        "line": line,
    }


def _said(value: object) -> bool:
    """Whether a field says anything (not null, empty or an empty list)."""
    return value is not None and not (isinstance(value, (str, list, tuple, dict)) and not value)


def _short(value: object) -> str:
    if isinstance(value, float):
        value = round(value, 4)
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if len(text) <= _FIELD_WIDTH else text[: _FIELD_WIDTH - 3] + "..."


def event_id(position: Position) -> str:
    """The SSE id of the line at ``position``: its event's stream sequence, with
    ``.<part>`` after it for any line but the first of its event. Pure."""
    seq, part = position
    return str(seq) if part == 0 else f"{seq}.{part}"


def parse_event_id(value: str | None) -> Position | None:
    """The position a reconnecting console names (:func:`event_id`'s form:
    ``<seq>`` or ``<seq>.<part>``, ASCII digits); ``None`` (not named) for
    anything else (``str.isdigit`` also takes ``²``). Pure."""
    text = (value or "").strip()
    if not text or len(text) > _ID_LENGTH or not text.isascii():
        return None
    seq, dot, part = text.partition(".")
    if not seq.isdigit() or len(seq) > 19 or (dot and not (part.isdigit() and len(part) < 4)):
        return None
    return int(seq), int(part) if dot else 0


def frame(position: Position, data: bytes) -> bytes:
    """One server-sent event: its id says its position (:func:`event_id`)."""
    return b"id: %s\ndata: %s\n\n" % (event_id(position).encode(), data)


class Subscriber:
    """One open console's queue of frames; ``closed`` once it fell behind."""

    __slots__ = ("closed", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[Position, bytes] | None] = asyncio.Queue(QUEUE_SIZE)
        self.closed = False

    def put(self, item: tuple[Position, bytes]) -> None:
        if self.closed:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.end()

    def end(self) -> None:
        """No more frames: the reader stops at this marker (room is made for it)."""
        self.closed = True
        if self.queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
        self.queue.put_nowait(None)


class EventFeed:
    """The shared tail (see the module's docstring). ``js`` gives the current
    JetStream context (the gateway's connection may be renewed)."""

    def __init__(
        self,
        js: Callable[[], JetStream],
        supervisor: Supervisor,
        *,
        backlog: int = BACKLOG,
        name: str = "console-feed",
        fetch_timeout: float = 1.0,
        retry_max: float = RETRY_MAX,
    ) -> None:
        self._js = js
        self._supervisor = supervisor
        self._name = name
        self._fetch_timeout = fetch_timeout
        self._backlog = backlog
        self._retry_max = retry_max
        #: The log's creation time as last seen (a new one: it was replaced).
        self._log_created: object = None
        self._ring: collections.deque[tuple[Position, bytes]] = collections.deque(maxlen=backlog)
        self._subscribers: set[Subscriber] = set()
        self._lock = asyncio.Lock()
        self._running = False
        #: The newest line no longer kept (lines up to it are gone from the ring).
        self._forgotten: Position = (0, 0)
        #: The stream sequence of the last event read (0: none yet).
        self.last_seq = 0
        #: Events handed to subscribers since the feed was made.
        self.delivered = 0
        #: The tail's consumer on ``RQ_EVENTS`` while it has one, and how many it made.
        self.consumer: str | None = None
        self.consumers_made = 0
        #: Why the tail is down (``None`` while it runs), and its failures so far.
        self.down: str | None = None
        self.failures = 0

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def running(self) -> bool:
        return self._running

    async def subscribe(self) -> Subscriber:
        """A new subscriber; starts the tail if it is the first."""
        subscriber = Subscriber()
        async with self._lock:
            self._subscribers.add(subscriber)
            if not self._running:
                self._running = True
                self._supervisor.spawn(self._name, self._run)
        return subscriber

    async def unsubscribe(self, subscriber: Subscriber) -> None:
        """Forget ``subscriber``; stops the tail if it was the last."""
        async with self._lock:
            self._subscribers.discard(subscriber)
            if self._running and not self._subscribers:
                self._running = False
                await self._supervisor.cancel(self._name)

    def since(self, position: Position) -> list[tuple[Position, bytes]] | None:
        """The lines kept after ``position``; ``None`` if some after it are no longer kept."""
        if position < self._forgotten or (self.last_seq and position[0] > self.last_seq):
            return None  # some are gone, or it names events of a log since replaced
        return [(at, data) for at, data in self._ring if at > position]

    def recent(self) -> list[tuple[Position, bytes]]:
        return list(self._ring)

    async def _run(self) -> None:
        """The tail, started again after each failure (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            began = loop.time()
            try:
                await self._tail()
            except Exception as exc:  # every failure is the feed's own, never the gateway's
                if loop.time() - began >= _HEALTHY:
                    failures = 0
                failures += 1
                self.failures += 1
                delay = min(self._retry_max, RETRY_BASE * 2 ** (failures - 1))
                self.down = _reason(exc)
                fields = {"failures": failures, "retry_in": round(delay, 3), "reason": self.down}
                if isinstance(exc, NatsError):
                    log.warning("console feed failed; starting again", **fields)
                else:
                    log.exception("console feed failed; starting again", **fields)
                self._tell(NOTICE, "error", {"reason": self.down, "retry_in": round(delay, 3)})
                await asyncio.sleep(delay)

    def _tell(self, seq: int, event: str, data: dict[str, object]) -> None:
        """Hand every subscriber a notice (``event: <event>``)."""
        notice = b"event: %s\ndata: %s\n\n" % (event.encode(), msgspec.json.encode(data))
        item = ((seq, 0), notice)
        for subscriber in list(self._subscribers):
            subscriber.put(item)

    async def _tail(self) -> None:
        js = self._js()
        start = await self._start_seq(js)
        psub = await _tail_consumer(js, start)
        self.consumer = psub.consumer
        self.consumers_made += 1
        if self.down is not None:
            log.info("console feed is back", was=self.down)
            self.down = None
            self._tell(NOTICE, "gap", {"reason": "the event log's tail is back"})
        try:
            idle = 0
            while True:
                try:
                    msgs = await psub.fetch(_BATCH, timeout=self._fetch_timeout)
                except TimeoutError:
                    msgs = []
                if not msgs:
                    idle += 1
                    if idle % 5 == 0:
                        await psub.consumer_info()  # lost (a server restart): raises, restarts
                    continue
                idle = 0
                for msg in msgs:
                    self._take(int(msg.metadata.sequence.stream), msg.subject, msg.data)
        finally:
            with contextlib.suppress(NatsError):
                await psub.unsubscribe()
            await delete_consumer(js, EVENTS_STREAM, psub.consumer)
            self.consumer = None

    async def _start_seq(self, js: JetStream) -> int:
        """Where the tail starts: after the last event read, if the ring still
        joins up with it, else the last ``backlog`` events of the log."""
        info = await js.stream_info(EVENTS_STREAM)
        last = int(info.state.last_seq)
        replaced = self._log_created is not None and info.created != self._log_created
        self._log_created = info.created
        if replaced or last < self.last_seq:  # re-provisioned: its sequences start over
            log.warning("the event log was replaced: the console feed reads it from its start")
            self._ring.clear()
            self.last_seq, self._forgotten = 0, (0, 0)
            self._tell(RESTART, "gap", {"reason": "the event log was replaced"})
        if self.last_seq and last - self.last_seq <= self._backlog:
            return self.last_seq + 1
        start = max(1, last - self._backlog + 1)
        # What lies before ``start`` is not read: a console that saw less is told.
        self._forgotten = max(self._forgotten, (start - 1, _EVERY_PART))
        return start

    def _take(self, seq: int, subject: str, data: bytes) -> None:
        if seq <= self.last_seq:
            return
        self.last_seq = seq
        try:
            event = EVENT_DECODER.decode(data)
        except msgspec.DecodeError:
            return  # not an event of ours: nothing to show
        if not subject_agrees(subject, event):
            return  # a payload that disagrees with its subject is no fact
        # A request bound at once: its submit and its binding, two lines as
        # before they were stored as one (one sequence, a part each).
        for part, fact in enumerate(facts(event)):
            position = (seq, part)
            encoded = msgspec.json.encode(summary(seq, fact))
            if len(self._ring) == self._backlog:
                self._forgotten = self._ring[0][0]
            self._ring.append((position, encoded))
            item = (position, frame(position, encoded))
            self.delivered += 1
            for subscriber in list(self._subscribers):
                subscriber.put(item)


def _reason(exc: Exception) -> str:
    """What a console is told of a failure (no traceback)."""
    if isinstance(exc, NatsNotFoundError):
        return f"the event log ({EVENTS_STREAM}) is missing: is Ren-Queue provisioned? ({exc})"
    return f"{type(exc).__name__}: {exc}"[:300]


async def _tail_consumer(js: JetStream, start: int) -> PullSubscription:
    """An ephemeral, unacknowledged pull consumer on ``RQ_EVENTS`` from ``start``."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        mem_storage=True,
        num_replicas=1,
    )
    return await js.pull_subscribe("rq.evt.>", stream=EVENTS_STREAM, config=config)
