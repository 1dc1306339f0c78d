"""The binder's hold: requests fetched from the priority subjects and not yet bound.

One queue per level, each bounded by ``router.hold_limit``, so batch work can
never crowd out a critical fetch: a level's fetch loop waits for room in its
own queue only. A held request's message is not acked until the request is
bound or ended; the hold is the router's only state, and a successor's fresh
consumers deliver it again (see :class:`~renqueue.services.Router`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Annotated, Final

import msgspec

from ...broker import EventLog, Message, PubAck
from ...logs import get_logger
from ...schema import (
    SHUTDOWN_NAK_DELAY,
    ComplexityEstimate,
    InferenceRequest,
    Submitted,
    TraceParent,
)

__all__ = ["BOOST_DECODER", "Boost", "Held", "Hold", "first_then", "log_first", "stored_at"]

log = get_logger("router")


def stored_at(msg: Message) -> float:
    """The server's timestamp of a stream message (when it was stored), Unix seconds."""
    return float(msg.metadata.timestamp.timestamp())


class Boost(msgspec.Struct, frozen=True):
    """On ``rq.boost.<tenant>``: a follower asks its coalescing leader to run at its level."""

    leader: str
    rank: Annotated[int, msgspec.Meta(ge=0)]
    submitted: float


BOOST_DECODER: Final = msgspec.json.Decoder(Boost)


class Held(msgspec.Struct, kw_only=True):
    """One held request and the bookkeeping its round-planner snapshot needs."""

    msg: Message
    request: InferenceRequest
    rank: int
    #: When the wait began, in server time: when the broker stored the request
    #: (for a requeue, the time logged in its first ``submitted`` event).
    submitted: float
    touched: float
    #: Promotions already announced as events.
    promoted: int = 0
    #: The request's ``submitted`` event, the log's first word on it (its
    #: request as read, before placement; its trace; ``submitted``).
    first: Submitted | None = None
    #: The ack of the stored event that says ``first``, awaited before the
    #: request's message is acked. ``None`` while it is not yet published: the
    #: intake leaves a request read for the first time to its first round, and
    #: if that round binds it, its binding carries it (one stored event,
    #: :func:`~renqueue.schema.bound_at_once`); otherwise the round logs it on
    #: its own (:func:`log_first`) before anything else about the request.
    logged: asyncio.Future[PubAck] | None = None
    #: The parent's (rank, submitted_at), when the request names a known parent.
    parent: tuple[int, float] | None = None
    #: The most urgent rank already announced as inherited.
    inherited: int | None = None
    #: When this router last asked a backend to preempt a run for it.
    preempt_asked: float | None = None
    #: A run was preempted for it: it never asks again (one per urgent request).
    preempted_one: bool = False
    #: The most urgent (rank, submitted_at) among requests that coalesced onto
    #: this one: the shared call runs at the highest priority of its waiters.
    boost: tuple[int, float] | None = None
    #: The tier its route's estimator gave it (it named none): in ``request.complexity``
    #: from here on, and in its ``routed`` event.
    estimate: ComplexityEstimate | None = None
    #: The cheaper backend it was first told to wait for, and the start
    #: predicted then (see ``policy.Waiting.waiting_for``).
    waiting_for: tuple[str, float] | None = None
    #: The trace it arrived in (the submitting hop's span): its dispatch is
    #: sent under a span of the router's own in the same trace.
    trace: TraceParent | None = None


async def log_first(item: Held, events: EventLog) -> None:
    """Publish ``item``'s ``submitted`` event (pipelined: :attr:`Held.logged`
    is its ack) unless it is published already: before any other event of
    the request that does not carry it."""
    if item.logged is None and item.first is not None:
        logged = await events.append_async(item.first)
        if item.logged is None:  # (its binding may have published it meanwhile)
            item.logged = logged


async def first_then(item: Held, events: EventLog, then: Callable[[], Awaitable[object]]) -> None:
    """:func:`log_first`, then ``then()``: an event about a request the
    intake left unlogged (a promotion, an ending) follows its ``submitted``."""
    await log_first(item, events)
    await then()


def _seq(item: Held) -> int:
    """The stream sequence of the request message ``item`` holds."""
    return int(item.msg.metadata.sequence.stream)


class Hold:
    """The held requests, one bounded queue per level (in level order)."""

    def __init__(self, levels: list[str], limit: int) -> None:
        self._levels = levels
        self._limit = limit
        #: Each level's queue, oldest first (read them; change them through the methods).
        self.queues: dict[str, deque[Held]] = {level: deque() for level in levels}
        self._room = {level: asyncio.Event() for level in levels}
        #: Every held item by its message's stream sequence: membership in O(1)
        #: (a fetch checks each delivery against the hold).
        self._by_seq: dict[int, Held] = {}
        #: ``id()`` of every held item (an item is held while its id is here).
        self._ids: set[int] = set()

    def __iter__(self) -> Iterator[Held]:
        return (item for queue in self.queues.values() for item in queue)

    def room(self, level: str) -> int:
        """How many more requests ``level`` may hold (0 or less: full)."""
        return self._limit - len(self.queues[level])

    async def wait_for_room(self, level: str) -> None:
        """Until a request of ``level`` leaves the hold (bound, ended or handed back)."""
        self._room[level].clear()
        await self._room[level].wait()

    def add(self, level: str, item: Held) -> None:
        self.queues[level].append(item)
        self._by_seq[_seq(item)] = item
        self._ids.add(id(item))

    def holds(self, item: Held) -> bool:
        """Whether ``item`` still waits here (not bound, ended or handed back)."""
        return id(item) in self._ids

    def holds_message(self, msg: Message) -> bool:
        """Whether the stream message ``msg`` is held already (delivered again)."""
        return msg.metadata.sequence.stream in self._by_seq

    def boost(self, tenant: str, boost: Boost) -> bool:
        """Lift the held leader ``boost`` names to its follower's rank; whether it is held."""
        for item in self:
            if item.request.tenant == tenant and item.request.id == boost.leader:
                if item.boost is None or boost.rank < item.boost[0]:
                    item.boost = (boost.rank, boost.submitted)
                return True
        return False

    def remove_request(self, tenant: str, request_id: str) -> Held | None:
        """Take the request ``(tenant, request_id)`` out of the hold, if it is held."""
        for held in self.queues.values():
            for item in held:
                if item.request.tenant == tenant and item.request.id == request_id:
                    held.remove(item)
                    self._forget(item)
                    self._room[self._levels[item.rank]].set()
                    return item
        return None

    def prune(self, gone: set[int]) -> None:
        """Drop the items whose ``id()`` is in ``gone`` (bound or ended in a round)."""
        for level, queue in self.queues.items():
            if gone:
                kept = []
                for item in queue:
                    if id(item) in gone:
                        self._forget(item)
                    else:
                        kept.append(item)
                queue.clear()
                queue.extend(kept)
            if len(queue) < self._limit:
                self._room[level].set()

    def clear(self) -> int:
        """Forget everything held, without naks; how many."""
        dropped = 0
        for level, held in self.queues.items():
            dropped += len(held)
            held.clear()
            self._room[level].set()
        self._by_seq.clear()
        self._ids.clear()
        return dropped

    def _forget(self, item: Held) -> None:
        self._ids.discard(id(item))
        if self._by_seq.get(seq := _seq(item)) is item:
            del self._by_seq[seq]

    async def hand_back(self, levels: Iterable[str], why: str | None = None) -> None:
        """Nak the held requests of ``levels`` back to their queue, for any router.

        The delay outlasts any pull this router left at the server, so they
        are not redelivered into it (see ``SHUTDOWN_NAK_DELAY``).
        """
        items: list[Held] = []
        for level in levels:
            items.extend(self.queues[level])
            self.queues[level].clear()
            self._room[level].set()
        for item in items:
            self._forget(item)
        if items and why is not None:
            log.warning("held requests handed back", count=len(items), reason=why)
        for item in items:
            with contextlib.suppress(Exception):
                await item.msg.nak(delay=SHUTDOWN_NAK_DELAY)
