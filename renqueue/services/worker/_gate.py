"""What a delivery must pass before its backend is called.

A dispatch can be delivered when it must not run: its request already ended
(a zombie's run, a second dispatch's run), a worker that died before
answering its delivery had finished it, preempted it, put it back to routing
or seen it stolen, its deadline passed while it waited, or it was cancelled.
:class:`Gate` finds out from the log, without calling the backend, and
completes what was left undone (each step is idempotent), so the delivery
ends as it would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ... import metrics
from ...broker import EventLog
from ...coordination import CancelWatch
from ...logs import get_logger
from ...policy import expired_before_call, past_deadline
from ...schema import FellBack, Preempted, Retrying, Stolen, is_terminal, kind_of
from ._delivery import Delivery
from ._outcomes import Outcomes
from ._stealing import Thief

__all__ = ["Gate"]

log = get_logger("worker")


class Gate:
    """Ends, without a backend call, the deliveries of one backend that must not run."""

    def __init__(
        self,
        events: EventLog,
        outcomes: Outcomes,
        thief: Thief,
        backend_name: str,
        *,
        pooled: bool,
        cancels: CancelWatch | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._events = events
        self._outcomes = outcomes
        self._thief = thief
        self._backend_name = backend_name
        #: Whether its backend is in a pool (a first delivery may have been stolen).
        self._pooled = pooled
        self._cancels = cancels
        self._clock = clock

    async def refuses(self, delivery: Delivery) -> bool:
        """Settle, without calling the backend, a dispatch that must not run:
        already ended (checked on every delivery: a zombie's or a second
        dispatch's run finds the terminal claim), finished or moved by a worker
        that died before acking it, past its deadline, or cancelled."""
        dispatch = delivery.dispatch
        request = dispatch.request
        claim = await self._events.claim_of(request.tenant, request.id)
        if claim is not None:
            log.info("request already ended; dropping this run", ended=kind_of(claim.event))
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
            # Whoever ended it may not have handed out to its followers (a crash
            # after the claim, an ender that skipped it): idempotent, so again.
            await self._outcomes.hand_out(request, claim.event)
            await self._events.settle(claim)  # its event may not be in the log yet
            await delivery.done()
            return True
        first = delivery.delivered == 1
        if (not first or self._pooled) and await self._settled_before(delivery, first=first):
            return True
        now = self._clock()
        if past_deadline(request, now):
            await self._outcomes.finish(delivery, expired_before_call(delivery.run, now))
            return True
        if self._cancels is not None and await self._cancels.was_cancelled(
            request.tenant, request.id, since=dispatch.routed_at
        ):
            await self._outcomes.cancel(delivery, stage="queued")
            return True
        return False

    async def _settled_before(self, delivery: Delivery, *, first: bool = False) -> bool:
        """On a redelivery: was this dispatch finished (before terminal claims
        existed), preempted, put back for a spent quota, or moved by a worker
        that died before acking it?
        Then complete that work and be done. ``first``: a first delivery in a
        pool, where only a move matters (a sibling stole this message while it
        was being delivered here: the copy runs, this one is handed over).

        A move is handed over only while its copy can still run (it is
        stored, or was moved on). A copy gone without an outcome stepped back
        for a run of this very message (the run claim, see the worker's
        ``_start_run``), and that run's worker died: this message is then the
        request's only lease, and it runs.
        """
        dispatch = delivery.dispatch
        request = dispatch.request
        source_seq = delivery.stream_seq
        if first:
            stolen = await self._events.history(request.tenant, request.id, kind="stolen")
            if not any(self._thief.stolen_here(event, dispatch, source_seq) for event in stolen):
                return False
        events = await self._events.history(request.tenant, request.id)
        ended = [event for event in events if is_terminal(event)]
        if ended:
            log.info("redelivered request already finished; dropping")
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
            await self._outcomes.hand_out(request, ended[0])
            await delivery.done()
            return True
        for event in events:
            if isinstance(event, Preempted) and event.attempt == dispatch.attempt:
                await self._outcomes.requeue(delivery, event.delivery, event.by)
                return True
            if isinstance(event, Retrying) and event.requeued and event.attempt == dispatch.attempt:
                log.info("request was put back to routing before; putting it back again")
                await self._outcomes.put_back(delivery)
                return True
            if isinstance(event, FellBack) and event.attempt == dispatch.attempt:
                log.info("request fell back to routing before; putting it back again")
                await self._outcomes.put_back(delivery, fallback=event.fallback)
                return True
        move = next((e for e in events if self._thief.stolen_here(e, dispatch, source_seq)), None)
        return isinstance(move, Stolen) and await self._thief.hand_over(delivery, move, events)
