"""Following cancellation requests: which requests must not run, or must stop.

A client cancels by publishing a ``cancel_requested`` event to
``rq.cancel.<tenant>.<request_id>`` (``RQ_CANCELS``, which refuses one over
``MAX_CANCEL_BYTES``); the log sources it as
``rq.evt.<tenant>.<request_id>.cancel_requested``, about a millisecond later
(an older client may still publish there directly). Routers and workers
learn of it through one :class:`CancelWatch` per process: a loop (supervised,
see :mod:`renqueue.tasks`) that reads ``rq.evt.*.*.cancel_requested`` through
an ephemeral pull consumer starting ``horizon`` seconds back, so a process
that starts (or restarts) later still knows every recent cancellation. If the
loop fails it is started again from the message after the last one it read:
no cancellation is skipped. A starting watch first reads ``RQ_CANCELS`` too,
from the first message the log's source has not taken in (the last minute
of it when the log has no such source, or one past its end): a cancellation
acknowledged there that the log has not sourced yet (the first after the
stream is made took 134 ms; longer while the server sets the source up again
after a restart; as long as the log is full) is known before any request is
run. A running watch learns of a cancellation once the log has
it: one that arrives while the log's source is being set up again may let
the request start, and then stops it (stage ``running``).

The subject is the authority: a cancellation is known by (tenant, request id)
as its subject names them. Tenants may publish any payload on their own
``cancel_requested`` subjects, so a payload whose ``tenant`` or
``request_id`` disagrees with its subject is ignored: one tenant can never
cancel another's request.

Each router and worker then acts where the request is:

- waiting in a router's hold, or read later from the priority subject: it is
  dropped with a ``cancelled`` event (stage ``queued``), never dispatched;
- sharing another request's call (a coalesced follower): it ends at once
  with its own ``cancelled`` (stage ``queued``) and leaves the group; the
  shared call goes on for the others (:mod:`renqueue.coordination._coalescing`). A router
  looks again once it has recorded a request as a follower, so a
  cancellation read while the request was joining is not missed;
- dispatched but not started: the worker records ``cancelled`` instead of
  calling the backend;
- running: the worker stops the backend call (closing its HTTP stream) and
  records ``cancelled`` (stage ``running``). A worker registers a run before
  it looks for a cancellation, so one that arrives while the run starts is
  not missed.

Past the horizon: a process that starts later does not read cancellations
older than ``horizon``. Before a request runs, routers and workers therefore
ask :meth:`CancelWatch.was_cancelled`, which looks the request's own
``cancel_requested`` subject up in the log when the request is older than
what the watch covers: a cancellation is honoured however old it is (as long
as ``RQ_EVENTS`` keeps it, 30 days by default).

Memory: tenants may publish any number of cancellations, with made-up ids.
A watch holds at most ``keep`` (:data:`KEEP` by default); it forgets the
oldest read first, those past the horizon or over that cap, at O(1) per
cancellation read, and what it covers then starts just after the newest one
it forgot: a request older than that is looked up in the log, as above.

The ``cancelled`` event is terminal and goes through the request's terminal
claim (:meth:`renqueue.broker.EventLog.finish`), so a cancellation that
races a completion leaves exactly one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, NamedTuple

import msgspec

from ..broker import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    JetStream,
    JetStreamApi,
    Message,
    PullSubscription,
    delete_consumer,
)
from ..errors import NatsError, NatsNotFoundError
from ..lifecycle import Lifecycle
from ..logs import get_logger, misdirected
from ..schema import (
    CANCELS_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    FETCH_TIMEOUT,
    MAX_CANCEL_BYTES,
    MAX_REASON_LENGTH,
    CancelRequested,
    cancel_subject,
    event_subject,
)
from ..tasks import Supervisor, cancel_and_wait

__all__ = ["CANCELS", "CancelSource", "CancelWatch", "cancel_of", "read_cancel_source"]

log = get_logger("cancellation")

#: Subject filter of every cancellation request.
CANCELS: Final = "rq.evt.*.*.cancel_requested"

#: Name of the watch's loop under its supervisor.
LOOP: Final = "cancel-watch"

#: Messages fetched at once while catching up.
_BATCH: Final = 256

#: The watch's consumer goes away this long after its process stopped asking.
_INACTIVE: Final = 30.0

#: How long :meth:`CancelWatch.start` waits to have read every logged cancellation.
_CATCH_UP: Final = 10.0

#: How far back a starting watch also reads ``RQ_CANCELS`` itself (seconds):
#: cancellations acknowledged there that the log may not have sourced yet.
_UNSOURCED: Final = 60.0

#: Most cancellations held in memory: past this, the oldest are forgotten
#: (a tenant can publish any number of them, with made-up ids).
KEEP: Final = 100_000


def cancel_of(subject: str, data: bytes) -> CancelRequested | None:
    """The cancellation a message on ``subject`` carries, if subject and payload agree.

    The subject (``rq.evt.<tenant>.<request_id>.cancel_requested``) is the
    authority; a payload naming another tenant or request, or not a
    ``cancel_requested`` event at all, is no cancellation. Nor is one over
    :data:`~renqueue.schema.MAX_CANCEL_BYTES`, or whose ``reason`` is over
    :data:`~renqueue.schema.MAX_REASON_LENGTH` characters, so no ``cancelled``
    event ever copies it. The watch counts each message this refuses, once
    (``renqueue_misdirected_messages_total{receiver="cancels"}``).
    """
    parts = subject.split(".")
    if len(parts) != 5 or parts[:2] != ["rq", "evt"] or parts[4] != "cancel_requested":
        return None
    if len(data) > MAX_CANCEL_BYTES:
        return None
    try:
        event = EVENT_DECODER.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(event, CancelRequested) or (event.tenant, event.request_id) != (
        parts[2],
        parts[3],
    ):
        return None
    if len(event.reason) > MAX_REASON_LENGTH:
        return None
    return event


def _seconds(when: datetime.datetime | None) -> float:
    return when.timestamp() if when is not None else 0.0


class CancelWatch(Lifecycle):
    """The requests recently cancelled, by (tenant, request id), kept current from the log.

    ``supervisor`` runs the watch's loop (a private one when ``None``).
    ``horizon`` is how far back (seconds) a starting watch reads. ``keep``
    bounds the cancellations held in memory: past it the oldest is forgotten
    and the watch's coverage starts after it (see :meth:`was_cancelled`).
    Forgetting is in arrival order, O(1) per cancellation read.
    """

    def __init__(
        self,
        js: JetStream,
        *,
        horizon: float = 86400.0,
        supervisor: Supervisor | None = None,
        clock: Callable[[], float] = time.time,
        keep: int = KEEP,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self._js = js
        self._horizon = horizon
        self._keep = keep
        self._clock = clock
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor("cancel-watch")
        #: (tenant, request id) -> server time the cancellation was stored, in
        #: the order read (the oldest first: forgotten first).
        self._cancelled: OrderedDict[tuple[str, str], float] = OrderedDict()
        #: Cancellations read from ``RQ_CANCELS`` at the start that the log had
        #: not sourced yet (at most ``keep``): each goes once the log's copy is read.
        self._unsourced: set[tuple[str, str]] = set()
        #: Cancellations forgotten (past the horizon, or over ``keep``).
        self.forgotten = 0
        self._listeners: list[Callable[[CancelRequested], None]] = []
        self._caught_up = asyncio.Event()
        #: Every cancellation stored at or after this (server time) is known.
        self._known_since = 0.0
        #: Stream sequence to resume from after a failure (0: from the horizon).
        self._next_seq = 0
        self._name = "cancel-watch"

    @property
    def caught_up(self) -> bool:
        """True once every cancellation logged before the start has been read."""
        return self._caught_up.is_set()

    async def _start(self) -> None:
        """Start the loop; return once every cancellation already logged is known,
        so no router or worker acts on a request before it could know."""
        self._known_since = self._clock() - self._horizon
        await self._read_unsourced()
        self._supervisor.spawn(LOOP, self._follow)
        waiting = asyncio.create_task(self._caught_up.wait())
        failed = asyncio.create_task(self._supervisor.failed.wait())
        try:
            await asyncio.wait({waiting, failed}, timeout=_CATCH_UP, return_when="FIRST_COMPLETED")
        finally:
            await cancel_and_wait([waiting, failed])
        if not self.caught_up:
            log.warning("cancellations still loading; continuing", waited=_CATCH_UP)

    async def _close(self) -> None:
        """Stop the loop (and the private supervisor)."""
        await self._supervisor.cancel(LOOP)
        if self._own_supervisor:
            await self._supervisor.close()

    def listen(self, callback: Callable[[CancelRequested], None]) -> Callable[[], None]:
        """Call ``callback`` for each cancellation read from now on; returns the
        function that removes it again (idempotent), for its owner's stop.

        The event it gets agrees with its subject: its ``tenant`` and
        ``request_id`` can be trusted.
        """
        self._listeners.append(callback)

        def unlisten() -> None:
            self.unlisten(callback)

        return unlisten

    def unlisten(self, callback: Callable[[CancelRequested], None]) -> None:
        """Stop calling ``callback`` (registered with :meth:`listen`); no-op if it is not."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    @property
    def listeners(self) -> int:
        """How many listeners are registered."""
        return len(self._listeners)

    def __len__(self) -> int:
        """How many cancellations are held in memory (at most ``keep``)."""
        return len(self._cancelled)

    def is_cancelled(self, tenant: str, request_id: str) -> bool:
        """Whether ``tenant``'s request ``request_id`` was cancelled (as far as read)."""
        key = (tenant, request_id)
        return key in self._cancelled or key in self._unsourced

    async def was_cancelled(self, tenant: str, request_id: str, since: float) -> bool:
        """Like :meth:`is_cancelled`, for a request that exists since ``since`` (Unix s).

        When ``since`` is before what the watch covers (its horizon, or what it
        forgot), the request's own ``cancel_requested`` subject is looked up in
        the log: one direct get, only for requests that old. ``since`` is best
        the time the request was stored (a cancellation comes after that).
        """
        if self.is_cancelled(tenant, request_id):
            return True
        if since >= self._known_since:
            return False
        subject = event_subject(tenant, request_id, "cancel_requested")
        try:
            raw = await self._js.get_last_msg(EVENTS_STREAM, subject, direct=True)
        except NatsNotFoundError:
            return False
        if cancel_of(subject, raw.data or b"") is None:
            return False
        self._remember((tenant, request_id), _seconds(raw.time))
        return True

    # ------------------------------------------------------------------ loop

    async def _read_unsourced(self) -> None:
        """Hold the cancellations ``RQ_CANCELS`` took that the log has not
        sourced (from its source's position; without one, the last
        :data:`_UNSOURCED` seconds), before the log's are read: the log sources
        each a moment after the client's ack (about a millisecond; longer while
        its source is set up again, after the stream is created or the server
        restarts), and a request cancelled then must not run. Only remembered
        here, apart from the log's (the log's copy is what listeners get,
        what is counted when it is no cancellation, and what replaces this
        one once read). Best effort: a failure is logged, the log still has
        them all."""
        # From exactly what the log has not taken in, however long it waited
        # (the log full for more than a minute, say), else the last minute.
        config = _reader(
            await self._unsourced_since(), max(self._known_since, self._clock() - _UNSOURCED)
        )
        try:
            psub = await self._js.pull_subscribe(
                cancel_subject("*", "*"), stream=CANCELS_STREAM, config=config
            )
        except NatsError as exc:  # no RQ_CANCELS yet (a log provisioned before it)
            log.warning("cannot read RQ_CANCELS; the log's cancellations only", error=str(exc))
            return
        try:
            pending = (await psub.consumer_info()).num_pending
            while pending:
                try:
                    msgs = await psub.fetch(batch=_BATCH, timeout=FETCH_TIMEOUT)
                except TimeoutError:
                    break
                for msg in msgs:
                    pending = msg.metadata.num_pending
                    parts = msg.subject.split(".")
                    if len(parts) != 4:
                        continue
                    logged = event_subject(parts[2], parts[3], "cancel_requested")
                    event = cancel_of(logged, msg.data)
                    if event is not None and len(self._unsourced) < self._keep:
                        self._unsourced.add((event.tenant, event.request_id))
        except NatsError as exc:
            log.warning("reading RQ_CANCELS failed; the log's cancellations only", error=str(exc))
        finally:
            with contextlib.suppress(NatsError):
                await psub.unsubscribe()
            await delete_consumer(self._js, CANCELS_STREAM, psub.consumer)

    async def _unsourced_since(self) -> int | None:
        """The first sequence of ``RQ_CANCELS`` the log has not sourced, if
        the log's source entry tells (``None``: it has none, or one past
        ``RQ_CANCELS``'s end, or the server did not answer)."""
        try:
            source = await read_cancel_source(self._js)
        except NatsError:
            return None
        if source is None or source.taken is None or source.taken > source.last_seq:
            return None
        return source.taken + 1

    async def _subscribe(self) -> PullSubscription:
        config = _reader(self._next_seq or None, self._known_since)
        return await self._js.pull_subscribe(CANCELS, stream=EVENTS_STREAM, config=config)

    async def _follow(self) -> None:
        """Read cancellations until stopped; raise (to be restarted) on any failure."""
        psub = await self._subscribe()
        try:
            if (await psub.consumer_info()).num_pending == 0:
                # Nothing logged since the horizon (or since the last one read).
                self._caught_up.set()
            while True:
                try:
                    msgs = await psub.fetch(batch=_BATCH, timeout=FETCH_TIMEOUT)
                except TimeoutError:
                    self._caught_up.set()  # nothing was pending
                    continue
                for msg in msgs:
                    self._take(msg)
                    self._next_seq = msg.metadata.sequence.stream + 1
                    if msg.metadata.num_pending == 0:
                        self._caught_up.set()
        finally:
            with contextlib.suppress(NatsError):
                await psub.unsubscribe()
            await delete_consumer(self._js, EVENTS_STREAM, psub.consumer)

    def _take(self, msg: Message) -> None:
        event = cancel_of(msg.subject, msg.data)
        if event is None:
            # Not a cancellation of what its subject names (another tenant's, another
            # kind, not JSON, over its size bound): a tenant's word, dropped and counted.
            misdirected("cancels", msg.subject)
            return
        self._remember((event.tenant, event.request_id), _seconds(msg.metadata.timestamp))
        for callback in list(self._listeners):  # a listener may unlisten
            try:
                callback(event)
            except Exception:  # one listener must not starve the others
                log.exception("cancel listener failed", request_id=event.request_id)

    def _remember(self, key: tuple[str, str], stored: float) -> None:
        """Hold one cancellation (the newest read), then forget what is too old
        or too many: from the front, so each read costs O(1) amortised."""
        self._unsourced.discard(key)
        self._cancelled[key] = stored
        self._cancelled.move_to_end(key)
        horizon = stored - self._horizon
        while self._cancelled:
            oldest, at = next(iter(self._cancelled.items()))
            if at >= horizon and len(self._cancelled) <= self._keep:
                return
            del self._cancelled[oldest]
            self.forgotten += 1
            # What the watch covers starts after what it forgot: an older
            # request is looked up in the log (was_cancelled).
            self._known_since = max(self._known_since, math.nextafter(at, math.inf))


class CancelSource(NamedTuple):
    """Where the event log's copying of ``RQ_CANCELS`` stands."""

    #: The last sequence of ``RQ_CANCELS`` the log took in (its source entry's
    #: ``seq``); ``None``: the log has no source of ``RQ_CANCELS``.
    taken: int | None
    #: ``RQ_CANCELS``'s last sequence, and how many messages it holds.
    last_seq: int
    messages: int

    @property
    def unsourced(self) -> int:
        """How many of its messages the log has not taken in: all of them
        without a source, or with one past its end (the stream was made
        again; the server notices only after a while)."""
        if self.taken is None or self.taken > self.last_seq:
            return self.messages
        return min(self.messages, self.last_seq - self.taken)


async def read_cancel_source(js: JetStream) -> CancelSource | None:
    """Read :class:`CancelSource` (``None`` without ``RQ_CANCELS``): from the
    log's source entry's ``seq``, not its ``lag``, which stays 0 while the log
    is full and the copy waits."""
    api = JetStreamApi(js)
    events, cancels = await asyncio.gather(
        api.call(f"STREAM.INFO.{EVENTS_STREAM}"), api.call(f"STREAM.INFO.{CANCELS_STREAM}")
    )
    state = cancels.get("state") if isinstance(cancels, dict) and "error" not in cancels else None
    if not isinstance(state, dict):
        return None
    sources = (events.get("sources") if isinstance(events, dict) else None) or []
    taken = [int(s.get("seq", 0)) for s in sources if s.get("name") == CANCELS_STREAM]
    return CancelSource(
        taken=taken[0] if taken else None,
        last_seq=int(state.get("last_seq", 0)),
        messages=int(state.get("messages", 0)),
    )


def _reader(start_seq: int | None, since: float) -> ConsumerConfig:
    """An ephemeral reader's consumer: from ``start_seq`` if given, else from
    the server time ``since``; no acks, in memory, one replica."""
    if start_seq is not None:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq
        )
    else:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.datetime.fromtimestamp(since, tz=datetime.UTC),
        )
    config.ack_policy = AckPolicy.NONE
    config.inactive_threshold = _INACTIVE
    config.mem_storage = True
    config.num_replicas = 1
    return config
