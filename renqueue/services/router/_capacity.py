"""What each backend has room for, as the binder counts it.

A backend's in-flight count is its worker consumer's ``num_pending +
num_ack_pending`` as the broker last said (read at most every
``router.capacity_refresh``), plus the binder's own dispatches the broker
may not have counted yet: those whose store is not confirmed, and those
confirmed after that read began. Both stay counted until a read that began
after their store confirmed replaces them, so a slow store never lets a
refresh free the same slots twice (over-filling the backend's FIFO, where a
later critical request would wait behind batch work). Counting a dispatch
twice for a moment errs the safe way: a slot frees one read later.

Workers announce freed slots on ``rq.capacity.<backend>`` (core NATS): the
announcement wakes the binder and makes the next read of that backend
immediate when the slot can matter, that is when the backend's counted room
cannot take every held request that may go there; the count itself comes
only from the broker. With room to spare a freed slot changes no decision
(the count only errs high), and the read waits for ``router.capacity_refresh``:
a busy backend frees a slot per completed call, and a read per freed slot put
a broker round trip in front of nearly every round. The worker consumer's
``max_ack_pending`` caps concurrency at the broker in any case.

With ``router.require_worker`` (off by default), room counts only where a
worker asks for work: a worker with a free slot always has a pull waiting on its consumer
(``num_waiting``), so a consumer with room and no pull waiting has no live
worker (stopped, restarting, crashed, not started yet). Such a backend counts
as full until a worker pulls again: nothing more is bound there, and requests
wait in their priority subjects or go to another backend of the route, instead
of waiting in a queue no one reads. (What is already queued there waits for a
worker, or for a pool sibling to steal it.)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping

from ...broker import JetStream
from ...config import Config
from ...policy import BackendView
from ...schema import DISPATCH_STREAM, worker_consumer

__all__ = ["Capacity", "Slot"]


class Capacity:
    """Per-backend in-flight count: the broker's word plus what it may not have seen.

    Each dispatch is counted from :meth:`dispatching` until a broker read that
    began after :meth:`stored` replaces it; :meth:`dropped` (never stored, or
    deduplicated as an earlier one) stops counting it at once.
    """

    def __init__(
        self,
        js: JetStream,
        config: Config,
        refresh: float,
        *,
        health: Callable[[str], bool] = lambda _name: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._js = js
        self._clock = clock
        self._health = health
        self._config = config
        self._refresh = refresh
        self._require_worker = config.router.require_worker
        #: The broker's count at its last read.
        self._known: dict[str, int] = dict.fromkeys(config.backends, 0)
        #: Dispatches on their way: store not yet confirmed.
        self._unconfirmed: dict[str, int] = dict.fromkeys(config.backends, 0)
        #: Confirmed since the last read began (that read may have missed them).
        self._confirmed: dict[str, int] = dict.fromkeys(config.backends, 0)
        #: When each backend's count was last read (``clock`` time); never: -inf
        #: (a monotonic clock starts near 0 at boot: 0.0 would be "just now").
        self._at: dict[str, float] = dict.fromkeys(config.backends, -math.inf)
        #: Backends a worker announced a freed slot of since their last read.
        self._freed: set[str] = set()

    def in_flight(self, backend: str) -> int:
        return self._known[backend] + self._unconfirmed[backend] + self._confirmed[backend]

    def views(self) -> dict[str, BackendView]:
        return {
            name: BackendView(
                name=name,
                capacity=backend.limits.concurrency,
                in_flight=self.in_flight(name),
                tier=backend.tier,
                healthy=self._health(name),
                context_window=backend.context_window,
                cost_input_per_mtok=backend.cost_input_per_mtok,
                cost_output_per_mtok=backend.cost_output_per_mtok,
                features=backend.supports,
            )
            for name, backend in self._config.backends.items()
        }

    def dispatching(self, backend: str) -> Slot:
        """A dispatch to ``backend`` was decided; its store is on its way.

        Settle the slot returned once: :meth:`Slot.stored` when the broker
        confirmed the dispatch, :meth:`Slot.dropped` when it was not stored
        (or was a duplicate of an earlier one). Settling again does nothing.
        """
        self._unconfirmed[backend] += 1
        return Slot(self, backend)

    def _settle(self, backend: str, *, stored: bool) -> None:
        self._unconfirmed[backend] = max(0, self._unconfirmed[backend] - 1)
        if stored:
            self._confirmed[backend] += 1

    def freed(self, backend: str) -> None:
        """A worker announced a freed slot: read this backend's count at the next
        refresh that it can matter to (see :meth:`refresh`)."""
        if backend in self._at:
            self._freed.add(backend)

    async def refresh(
        self,
        backends: list[str],
        *,
        force: bool = False,
        demand: Mapping[str, int] | None = None,
    ) -> None:
        """Read the broker's count of each of ``backends`` that is due: every
        ``refresh`` seconds, and at once after a freed slot was announced if
        its counted room is short of ``demand`` (how many held requests may
        go there; ``None``: always short). The reads go out together: a round
        waits one round trip for them, not one per backend."""
        now = self._clock()
        due = [
            name
            for name in backends
            if force
            or now - self._at[name] >= self._refresh
            or (name in self._freed and not self._room_for(name, demand))
        ]
        if len(due) <= 1:
            for name in due:  # (the usual case: no task to gather one read in)
                await self._read(name, now)
            return
        results = await asyncio.gather(
            *(self._read(name, now) for name in due), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _read(self, name: str, now: float) -> None:
        """Read backend ``name``'s count from the broker (begun at ``now``)."""
        self._freed.discard(name)
        # Confirmed before this read began: the broker's answer counts them.
        confirmed, self._confirmed[name] = self._confirmed[name], 0
        try:
            info = await self._js.consumer_info(DISPATCH_STREAM, worker_consumer(name))
        except BaseException:
            self._confirmed[name] += confirmed
            raise
        known = (info.num_pending or 0) + (info.num_ack_pending or 0)
        capacity = self._config.backends[name].limits.concurrency
        if self._require_worker and not info.num_waiting and known < capacity:
            # Room, but no worker asks for work there: none is alive.
            known = capacity
        self._known[name] = known
        self._at[name] = now

    def _room_for(self, name: str, demand: Mapping[str, int] | None) -> bool:
        """Whether ``name``'s counted room takes every request of ``demand`` there."""
        if demand is None:
            return False
        capacity = self._config.backends[name].limits.concurrency
        return self.in_flight(name) + demand.get(name, 0) <= capacity


class Slot:
    """One decided dispatch, counted by :class:`Capacity` until it is settled."""

    __slots__ = ("_capacity", "backend", "settled")

    def __init__(self, capacity: Capacity, backend: str) -> None:
        self._capacity = capacity
        self.backend = backend
        #: Settled already (read only: :meth:`stored` and :meth:`dropped` set it).
        self.settled = False

    def stored(self) -> None:
        """The broker confirmed the dispatch: counted until a later read counts it."""
        self._settle(stored=True)

    def dropped(self) -> None:
        """The dispatch was not stored, or was a duplicate: no longer counted."""
        self._settle(stored=False)

    def _settle(self, *, stored: bool) -> None:
        if not self.settled:
            self.settled = True
            self._capacity._settle(self.backend, stored=stored)
