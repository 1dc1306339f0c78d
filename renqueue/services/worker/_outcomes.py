"""How a delivery ends: recorded in the log first, then its message answered.

Each end is written so that a crash between its steps is harmless: what the
log says comes first, and a redelivery that finds it completes the rest.

- :meth:`Outcomes.finish`: the request's terminal event (``completed``,
  ``failed``, ``expired``: :func:`renqueue.policy.expired_before_call`,
  :func:`~renqueue.policy.expired_running`; ``cancelled``) and its final
  chunk, its coalesced followers served, then the delivery done;
- :meth:`Outcomes.fail`: a copy to the dead-letter stream, then ``failed``;
  :meth:`Outcomes.cancel`: ``cancelled``;
- :meth:`Outcomes.put_back`: back to routing, its reason already logged (a
  spent quota, a fallback); :meth:`Outcomes.requeue`: back to wait, preempted;
- :meth:`Outcomes.hand_back`: none of these (the broker did not answer, a
  put-back failed): delivered again after the failure policy's backoff by
  its delivery count, no failed run counted;
- :meth:`Outcomes.poison`: not a dispatch at all: dead-lettered, given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable

import msgspec
from prometheus_client import Counter

from ... import metrics
from ...backends.base import Backend
from ...broker import EventLog, JetStream, PubAck
from ...coordination import Coalescer, coalesce_key
from ...errors import NatsError, NatsPayloadTooLargeError, StoreFullError
from ...logs import get_logger
from ...policy import FailurePolicy, backoff, cancelled_at_worker
from ...schema import (
    Completed,
    ErrorType,
    Event,
    Failed,
    Fallback,
    InferenceRequest,
    Started,
    TerminalClaim,
    encode,
    final_chunk,
    token_subject,
)
from ._call import reported_limits, settle
from ._delivery import Delivery
from ._yielding import put_back, requeue

__all__ = ["Outcomes"]

log = get_logger("worker")


class Outcomes:
    """Ends the deliveries of one backend's worker, and counts how they ended."""

    def __init__(
        self,
        js: JetStream,
        events: EventLog,
        backend_name: str,
        *,
        backend: Backend,
        policy: FailurePolicy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._events = events
        #: Hands a coalescing group's leader's outcome to its followers.
        self._coalescer = Coalescer(js, clock=clock)
        self._backend_name = backend_name
        self._backend = backend
        self._policy = policy
        self._clock = clock
        # Its series, looked up once (``labels()`` locks and checks on each call).
        self._cost = metrics.COST.labels(backend_name)
        #: Terminal counts by kind (``completed``, ``failed``, ...), as they come.
        self._terminal: dict[str, Counter] = {}
        self.completed = 0
        self.failed = 0
        #: Backend faults in a row in this worker's own calls (a completion resets
        #: it): past its circuit's ``failures`` it steals no work for its pool.
        self.faults_in_a_row = 0

    async def finish(self, delivery: Delivery, event: Event) -> None:
        """Record the terminal event, its final chunk at the run's next
        ``(run, seq)``, then be done: a crash in between means a redelivery
        that finds the terminal claim and drops the run. Followers sharing
        this request's call get their outcome first, so a crash cannot strand
        them."""
        try:
            first = await self._record(delivery, event)
        except NatsPayloadTooLargeError:
            await self._stream_tail(delivery, event)
            raise
        kind = type(event).__name__.lower()
        if first:
            terminal = self._terminal.get(kind)
            if terminal is None:
                terminal = self._terminal[kind] = metrics.TERMINAL.labels(kind)
            terminal.inc()
            if isinstance(event, Completed):
                self.completed += 1
                if event.shared_with is None:
                    self.faults_in_a_row = 0
                self._cost.inc(event.cost)
            elif isinstance(event, Failed):
                self.failed += 1
        else:
            log.warning("duplicate terminal event dropped", kind=kind)
            metrics.DUPLICATES_DROPPED.labels(self._backend_name).inc()
        await delivery.done()

    async def _stream_tail(self, delivery: Delivery, event: Event) -> None:
        """A ``completed`` event too big to record (the run then fails): what
        its final chunk would have carried, the answer's last read, streamed
        as a chunk of its own, so that a streaming client has every piece the
        backend sent, as for every other read."""
        tail = delivery.chunks.tail
        delivery.chunks.tail = None
        if not isinstance(event, Completed) or tail is None:
            return
        final = final_chunk(
            TerminalClaim(event=event, delivery=delivery.number, seq=delivery.chunks.seq, tail=tail)
        )
        chunk = msgspec.structs.replace(final, final=False, finish_reason=None, usage=None)
        request = delivery.dispatch.request
        try:
            await self._js.publish(token_subject(request.tenant, request.id), encode(chunk))
        except NatsError as exc:  # too large itself, or the broker gone: the failure says it
            log.warning("could not stream the answer's last read", error=str(exc))
            return
        delivery.chunks.seq += 1

    async def settle_held(
        self, pending_acks: list[asyncio.Future[PubAck]], started: Started
    ) -> None:
        """Wait until a finished run's publishes are stored (:func:`settle`).

        Its ``started`` is published with an ack not awaited before the
        backend call: a full event log refuses it only once the call has been
        made. Then the run's outcome is held, not handed back (a redelivery
        would call the backend again, and be refused again): ``started`` is
        written again after a backoff until there is room (a duplicate if it
        was stored after all), the lease renewed meanwhile by the run's
        keep-alive. A refused token chunk (only a full server store refuses
        one) is not sent again: the outcome holds the answer."""
        try:
            await settle(pending_acks, self._js.connection)
        except StoreFullError as exc:
            refused = exc
        else:
            return
        refusals = 0
        while True:
            refusals += 1
            await self._hold_for_room(refusals, refused, "until its start is recorded")
            try:
                await self._events.append(started)
            except StoreFullError as exc:
                refused = exc
            else:
                return

    async def _record(self, delivery: Delivery, event: Event) -> bool:
        """Hand ``event`` out to the request's followers, then claim and log it
        (:meth:`EventLog.finish`); whether this claim was the first.

        A full store (the claims' bucket, the event log, the state bucket,
        the server's store) refuses the write: the outcome is held here and
        written again after a backoff, for as long as it takes, the
        delivery's lease renewed meanwhile by its run's keep-alive. Handing
        the dispatch back instead would run it, and pay its backend, again on
        every redelivery while the store is full. A claim made before the
        event log refused its event is this run's own: it counts as first."""
        request = delivery.dispatch.request
        refusals = 0
        while True:
            try:
                if refusals:
                    held = await self._events.claim_of(request.tenant, request.id)
                    if held is not None and held.event == event:
                        await self.hand_out(request, event)
                        await self._events.settle(held)
                        return True
                await self.hand_out(request, event)
                return await self._events.finish(
                    event,
                    delivery=delivery.number,
                    seq=delivery.chunks.seq,
                    tail=delivery.chunks.tail if isinstance(event, Completed) else None,
                    stream=request.stream is not False,
                )
            except StoreFullError as exc:
                refusals += 1
                await self._hold_for_room(refusals, exc, "until there is room")

    async def _hold_for_room(self, refusals: int, refused: StoreFullError, until: str) -> None:
        """Wait out the ``refusals``-th refusal of a full store (capped backoff), saying so."""
        delay = backoff(refusals, self._policy, random.random)
        log.warning(
            f"a store is full: holding the run's outcome {until}",
            error=str(refused),
            retry_in=delay,
            refusals=refusals,
        )
        await asyncio.sleep(delay)

    async def fail(
        self,
        delivery: Delivery,
        *,
        error_type: ErrorType,
        reason: str,
        exhausted_until: float | None = None,
        error_class: str = "",
    ) -> None:
        """Fail the request for good: a copy to the dead-letter stream, then ``failed``."""
        request = delivery.dispatch.request
        await self._events.dead_letter(
            "dispatch",
            delivery.data,
            reason=f"{error_type}: {reason}",
            source_subject=delivery.subject,
            source_seq=delivery.stream_seq,
            tenant=request.tenant,
            request_id=request.id,
        )
        failed = delivery.run.failed(
            at=self._clock(),
            error_type=error_type,
            reason=reason,
            error_class=error_class,
            limits=reported_limits(self._backend),
            quota_exhausted_until=exhausted_until,
        )
        await self.finish(delivery, failed)

    async def cancel(self, delivery: Delivery, *, stage: str) -> None:
        """End the request ``cancelled`` at ``stage``, as its tenant asked."""
        ended = cancelled_at_worker(delivery.run, self._clock(), stage)
        await self.finish(delivery, ended)

    async def hand_out(self, request: InferenceRequest, event: Event) -> None:
        """If ``request`` leads a coalescing group, give its followers their
        outcome from ``event`` (its terminal event). Idempotent."""
        key = coalesce_key(request)
        if key is not None:
            await self._coalescer.leader_ended(request.tenant, request.id, key, event)

    async def requeue(self, delivery: Delivery, run: int, by: str) -> None:
        """Send a preempted request back to wait (:func:`requeue`), its run
        ``run`` preempted ``by`` a request. If that fails, the dispatch is
        handed back (see :meth:`put_back`)."""
        try:
            await requeue(
                self._js, self._events, delivery, run=run, by=by,
                backend=self._backend_name, at=self._clock(),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - not a failed run: handed back
            await self._put_back_failed(delivery, exc)

    async def put_back(self, delivery: Delivery, *, fallback: Fallback | None = None) -> None:
        """Put a request back to routing (:func:`put_back`), its reason already
        logged. If that fails (the copy's publish, the ack), the dispatch is
        handed back with a backoff, not failed: the run did not fail, and the
        redelivery finds the logged reason and puts it back again (the
        :class:`~._gate.Gate`, idempotent), without calling the backend."""
        try:
            await put_back(self._js, delivery, fallback=fallback)
        except Exception as exc:  # noqa: BLE001 - not a failed run: handed back
            await self._put_back_failed(delivery, exc)

    async def _put_back_failed(self, delivery: Delivery, exc: Exception) -> None:
        """Hand the dispatch back after the failure policy's backoff (by its
        delivery count), no failed run counted."""
        delay = self.backoff(delivery)
        log.warning(
            "could not put the request back to routing; handing the dispatch back",
            error=repr(exc),
            retry_in=delay,
        )
        await self.hand_back(delivery, after=delay)

    def backoff(self, delivery: Delivery) -> float:
        """Delay before a message handed back for the broker's sake is delivered
        again: the failure policy's backoff (doubling from ``retry_delay``,
        capped at ``max_retry_delay``, jittered) by the delivery count, so the
        delivery limit spans minutes of broker trouble, not seconds."""
        return backoff(max(1, delivery.delivered), self._policy, random.random)

    async def hand_back(self, delivery: Delivery, *, after: float | None = None) -> None:
        """Have ``delivery`` delivered again after ``after`` seconds (else
        :meth:`backoff`), whatever the broker answers: if it does not take
        the hand-back either, the lease runs out and redelivers it."""
        with contextlib.suppress(Exception):
            await delivery.hand_back(after=self.backoff(delivery) if after is None else after)

    async def poison(self, delivery: Delivery, reason: str) -> None:
        """A message that is not a dispatch: a copy to the dead-letter stream,
        then given up (no worker could run it)."""
        seq = delivery.stream_seq
        log.error("undecodable dispatch message sent to dead letters", seq=seq, reason=reason)
        await self._events.dead_letter(
            "dispatch",
            delivery.data,
            reason=f"malformed: {reason}",
            source_subject=delivery.subject,
            source_seq=seq,
            tenant="unknown",
            request_id=f"dispatch-{seq}",
        )
        await delivery.give_up()
