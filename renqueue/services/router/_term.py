"""The binder's term: the lease, and the loops that fetch and bind while it is held.

Exactly one router binds at a time: the holder of the binder's lease
(:mod:`renqueue.coordination._lease`, a key in the ``rq-leases`` KV bucket
that the server expires ``router.lease_ttl`` after its last renewal); the
others stand by, seeking the lease every 100 ms (:meth:`Term.lease_loop`,
which sleeps while a term runs here: only its end gives it anything to do).
Renewals run in a loop of their own (:meth:`Term.renew_loop`), so a term that
is slow to begin never lets the lease run out.

A new binder's term first deletes and re-creates the router consumers, so
everything its predecessor held (dead or stopped) is delivered to it at once;
then it runs one fetch loop per level (the intake's), the dispatch loop (the
round's) and the keepalive, which keeps the held requests' ack timers alive
while those loops run and hands a level's requests back when one is down. A
router binds only while its lease is valid (renewed within ``ttl``, less a
margin), so a binder whose renewals stall stops binding before anyone else
can start. A term ends when the lease is lost, or given up: a binder one of
whose binding loops keeps failing, or whose term cannot begin, gives the
lease up and sits the race out for a while, so a healthy router binds. What
it held is then forgotten, not nak'ed: the next binder's fresh consumers
deliver it.

With binding split in groups (docs/scaling.md) a router runs one term per
group whose lease it holds (``binder.<group>``), each with its own consumers,
hold and books; ``may_seek`` keeps it from seeking more leases than its share
(:class:`~._share.Share`), and :meth:`Term.give_up` hands one back when it
holds more.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, Final

from ... import metrics
from ...broker import PullSubscription, renew_router_consumers
from ...config import parse_duration
from ...errors import RenQueueError
from ...logs import get_logger
from ...schema import LEASE_BUCKET, REQUESTS_STREAM, router_consumer
from ...tasks import Supervisor
from ._intake import Intake
from ._parts import Parts
from ._round import Round

__all__ = ["Term", "loop_name"]

log = get_logger("router")

#: A binder one of whose binding loops failed this many times in a row gives the lease up.
_GIVE_UP_AFTER_FAILURES: Final = 3


def loop_name(router: str, what: str) -> str:
    """The supervisor's name for router ``router``'s loop ``what``."""
    return f"{router}-{what}"


class Term:
    """The binder's lease and the term this router binds in (see the module docstring)."""

    def __init__(
        self,
        parts: Parts,
        *,
        name: str,
        supervisor: Supervisor,
        intake: Intake,
        round_: Round,
        group: str | None = None,
        may_seek: Callable[[], bool] = lambda: True,
        seek_lock: asyncio.Lock | None = None,
    ) -> None:
        self._nc = parts.nc
        self._js = parts.js
        self._clock = parts.clock
        self._lease = parts.lease
        self._hold = parts.hold
        self._levels = list(parts.config.priorities)
        self._ack_wait = parse_duration(parts.config.router.ack_wait)
        self._name = name
        self._supervisor = supervisor
        self._intake = intake
        self._round = round_
        #: The binding group this term binds (None: binding is not split).
        self.group = group
        #: Whether this router may seek the lease now (its share of the groups).
        self._may_seek = may_seek
        #: Held while judging ``may_seek`` and seeking: a router's terms seek
        #: one at a time, so two cannot both take the last lease of its share.
        self._seek_lock = seek_lock if seek_lock is not None else asyncio.Lock()
        self._consumer_configs: list[dict[str, Any]] = []
        #: The lease term whose fetch and dispatch loops run (None: standing by).
        self.current: int | None = None
        self._binding_loops: list[str] = []
        self._pull_subs: list[PullSubscription] = []
        #: Until when (loop time) this router stays out of the race for the
        #: lease after giving it up.
        self._sit_out_until = -math.inf  # loop time; never sat out
        #: Until when it sits out for failing (not for its share of the groups).
        self._failed_until = -math.inf
        #: Terms that failed to begin in a row (reset when one begins).
        self._failed_beginnings = 0
        #: Terms begin and end one at a time (the lease and renewal loops both end them).
        self._lock = asyncio.Lock()
        #: Set while no term runs here (cleared when one begins, set when it ends):
        #: what the lease loop waits for while a term runs.
        self._ended = asyncio.Event()
        self._ended.set()

    async def open(self, consumer_configs: list[dict[str, Any]]) -> None:
        """Judge the lease by the bucket's ttl, and seek it once (bind if it is free).

        ``consumer_configs``: the router consumers a term re-creates.
        """
        self._consumer_configs = consumer_configs
        # The server expires the lease by the bucket's max_age, which the last
        # process to provision set: judge validity by the shorter. (Not
        # suppressed: a router that cannot read it must not guess.)
        info = await self._js.stream_info(f"KV_{LEASE_BUCKET}")
        if info.config.max_age:
            self._lease.ttl = min(self._lease.ttl, float(info.config.max_age))
        # One attempt now, so a lone router binds as soon as it has started.
        # A term that cannot begin yet is the lease loop's to retry (and, if
        # it never can, to give the lease up): not a reason to fail the start.
        if await self._seek():
            async with self._lock:
                try:
                    await self._begin_counted()
                except RenQueueError as exc:  # JetStream refused or did not answer
                    log.warning("the binder's term could not begin", error=str(exc))

    async def close(self) -> None:
        """End the term, if one runs (the router stops)."""
        async with self._lock:
            await self._end(None)

    async def lease_loop(self) -> None:
        """Seek the binder's lease while not holding it; begin a term once held.

        Renewals run in their own loop (:meth:`renew_loop`), so a term that
        is slow to begin (re-creating consumers on a cluster) never lets the
        lease run out. A term begins only while the lease is valid, so a
        router whose lease expired meanwhile never re-creates the consumers
        of a binder that took over.

        While a term of the lease held runs, there is nothing to seek or
        begin until it ends (the lease lost or given up: :meth:`_end`), so
        the loop waits for that instead of looking every ``poll``.
        """
        poll = min(0.1, self._lease.ttl / 5)
        loop = asyncio.get_running_loop()
        while True:
            if self.current is not None and self.current == self._lease.term:
                await self._ended.wait()
                continue
            if not self._lease.held and (
                loop.time() < self._sit_out_until or not await self._seek()
            ):
                await asyncio.sleep(poll)
                continue
            if self.current != self._lease.term and self._lease.valid():
                async with self._lock:
                    if self.current != self._lease.term and self._lease.valid():
                        await self._begin_counted()
            await asyncio.sleep(poll)

    async def renew_loop(self) -> None:
        """Renew the lease every ``ttl / 5`` while held; end the term when it is lost.

        A renewal that raises (a timeout, a reconnect) ends the loop for the
        supervisor to restart: the lease stays held, and binding is fenced
        (:meth:`Lease.valid`) until a renewal succeeds again. A binder one of
        whose binding loops failed 3 times in a row, or whose term failed to
        begin 3 times in a row, gives the lease up and stays out of the race
        for ``5 * ttl``, so a healthy router binds.
        """
        ttl = self._lease.ttl
        while True:
            await asyncio.sleep(ttl / 5)
            if not self._lease.held:
                continue
            if not await self._lease.renew():
                async with self._lock:
                    await self._end("the binder's lease was lost")
                continue
            failing = [
                name
                for name in self._binding_loops
                if self._supervisor.failures(loop_name(self._name, name)) >= _GIVE_UP_AFTER_FAILURES
            ]
            if failing and self.current is not None:
                why = f"a binding loop keeps failing: {', '.join(failing)}"
            elif self.current is None and self._failed_beginnings >= _GIVE_UP_AFTER_FAILURES:
                # Held, but the term cannot begin (its consumers cannot be
                # re-created): renewing on would keep every router from binding.
                why = "the binder's term cannot begin"
            else:
                continue
            await self.give_up(why)

    async def _seek(self) -> bool:
        """Seek the lease if this router may hold one more (see ``may_seek``)."""
        async with self._seek_lock:
            return self._may_seek() and await self._lease.try_acquire()

    def sitting_out(self) -> bool:
        """Whether this term gave its lease up for failing and sits the race out
        (binding split in groups: the router then does not count in the share,
        so another router may take the group meanwhile)."""
        return asyncio.get_running_loop().time() < self._failed_until

    async def give_up(self, why: str, *, failing: bool = True) -> None:
        """End the term, give the lease up and, ``failing``, stay out of the race
        for ``5 * ttl`` (:meth:`sitting_out`). Not failing (given up for the
        router's share of the groups) it does not sit out: the share alone
        keeps it from seeking the lease again, and lets it as soon as its
        share grows (a sit-out left that group without a binder meanwhile)."""
        if failing:
            self._sit_out_until = asyncio.get_running_loop().time() + 5 * self._lease.ttl
            self._failed_until = self._sit_out_until
        self._failed_beginnings = 0
        async with self._lock:
            await self._end(why)
        await self._lease.release()
        log.warning(
            "router gave the binder's lease up", router=self._name, group=self.group, reason=why
        )

    async def _begin_counted(self) -> None:
        """:meth:`_begin`, counting failed beginnings in a row (the give-up rule)."""
        try:
            await self._begin()
        except Exception:
            self._failed_beginnings += 1
            raise
        self._failed_beginnings = 0

    async def _begin(self) -> None:
        """This router holds the lease: take the router consumers over and bind.

        The consumers are re-created first, so every request the previous
        binder held (dead, or stopped) is delivered here at once instead of
        after ``router.ack_wait``.
        """
        await self._end(None)  # anything a failed earlier attempt left running
        term = self._lease.term
        await self._round.begin()
        await renew_router_consumers(self._nc, self._consumer_configs)
        for level in self._levels:
            psub = await self._js.pull_subscribe_bind(
                durable=router_consumer(level, self.group), stream=REQUESTS_STREAM
            )
            self._pull_subs.append(psub)
            self._supervise(
                f"fetch-{level}", functools.partial(self._intake.fetch_loop, level, psub)
            )
        self._supervise("dispatch", functools.partial(self._round.loop, term or 0))
        self._supervise("keepalive", self._keepalive_loop)
        self.current = term
        self._ended.clear()
        metrics.BINDING.labels(self._name).set(1)
        log.info("router is binding", router=self._name, term=term, group=self.group)

    async def _end(self, why: str | None) -> None:
        """Stop fetching and binding; forget what was held (not nak'ed: the
        next binder's fresh consumers deliver it, and a nak from here would
        only deliver it to that binder twice)."""
        names, self._binding_loops = self._binding_loops, []
        await self._supervisor.cancel(*(loop_name(self._name, name) for name in names))
        for psub in self._pull_subs:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        self._pull_subs.clear()
        self._round.end()
        dropped = self._hold.clear()
        was = self.current
        self.current = None
        self._ended.set()
        metrics.BINDING.labels(self._name).set(0)
        if why is not None and was is not None:
            log.warning("router stands by", router=self._name, term=was, reason=why, held=dropped)

    def _supervise(self, what: str, factory: Callable[[], Any]) -> None:
        """Run binding loop ``what`` under the supervisor, until the term ends."""
        self._binding_loops.append(what)
        self._supervisor.spawn(loop_name(self._name, what), factory)

    def _running(self, what: str) -> bool:
        return self._supervisor.healthy(loop_name(self._name, what))

    async def _keepalive_loop(self) -> None:
        """Held requests wait for room: keep their ack timers from running out,
        but only while the loops that would bind them run. A level whose
        fetch loop, or a router whose dispatch loop, is down (failed, in its
        backoff) hands its held requests back instead, for another router."""
        interval = max(0.1, self._ack_wait / 3)
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            dispatching = self._running("dispatch")
            for level, held in self._hold.queues.items():
                if not (dispatching and self._running(f"fetch-{level}")):
                    await self._hold.hand_back([level], "a loop that would bind them is down")
                    continue
                for item in list(held):
                    if now - item.touched >= interval:
                        with contextlib.suppress(Exception):
                            await item.msg.in_progress()
                        item.touched = now
