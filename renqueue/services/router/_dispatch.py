"""Carrying out a bind: the dispatch, the ``routed`` decision, the request's ack.

A :class:`Dispatcher` turns one :class:`~renqueue.policy.Bind` the round
planner decided into its publishes: the :class:`~renqueue.schema.Dispatch` on
the backend's subject and the ``routed`` event, both under per-attempt
message ids (so a bind repeated for the same attempt stores neither twice),
then acks the request's message. A request bound in the first round after
the binder read it has its ``submitted`` event carry the decision instead
(one stored event, under the ``submitted`` message id), published ahead of
the dispatch. It keeps the request's ack timer alive
while the acks are on their way, settles the capacity :class:`Slot` the
round counted, and owns the budget of failed dispatches: a request whose
dispatch fails goes back to wait (nak), and after ``router.max_deliver``
failed dispatches it fails ``undeliverable`` with a dead-letter copy. A
dispatch refused because a store is full (``StoreFullError``: the backend's
dispatch queue or the event log at its byte limit) is not a failed dispatch:
the request waits :data:`STORE_FULL_DELAY` and is bound again, until the
consumer's delivery backstop (``router.max_deliver`` x 20 deliveries).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

import msgspec
from prometheus_client import Counter, Histogram

from ... import metrics
from ...broker import EventLog, JetStream, Message, PubAck, hop, trace_headers
from ...config import Config, parse_duration
from ...errors import NatsNotFoundError, StoreFullError
from ...logs import get_logger
from ...policy import BIND_REASON
from ...schema import (
    DISPATCH_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    Dispatch,
    Event,
    InferenceRequest,
    Routed,
    Started,
    Stolen,
    Submitted,
    TraceParent,
    bound_at_once,
    dispatch_subject,
    encode,
    failed,
    is_terminal,
    msg_id,
    routed,
    router_max_deliveries,
)
from ._capacity import Slot
from ._hold import Held, log_first
from ._ledger import Reserved

__all__ = ["ACKS_TIMEOUT", "STORE_FULL_DELAY", "Dispatcher"]

log = get_logger("router")

#: Seconds a decision's publishes may take to be acked before the dispatch counts
#: as failed (``router.ack_wait`` if that is shorter).
ACKS_TIMEOUT: Final = 10.0
#: The reason of a decision logged again for the dispatch an earlier bind stored.
_EARLIER_DISPATCH_REASON: Final = "dispatched by an earlier bind of this attempt"
#: Requests whose failed dispatches a router remembers (oldest forgotten first).
_FAILURES_KEPT: Final = 10_000
#: A bind refused because a store is full (the backend's dispatch queue, the
#: event log) is tried again this much later, and is no failed dispatch: room
#: comes back as work is done, and the request must not fail for waiting.
STORE_FULL_DELAY: Final = 5.0

#: How long a dispatch whose ack has not come stays counted as on its way;
#: then it counts as stored (nats-py never completes the ack of a publish the
#: server refused without answering).
_UNANSWERED_GRACE: Final = ACKS_TIMEOUT


def _raise_failed(acks: Iterable[asyncio.Future[PubAck]]) -> None:
    """Raise the error of the first of ``acks`` (in their order) that came
    back one (cancelled: ``CancelledError``). Every one that came back is
    read, so none that failed too is left "never retrieved" (as
    ``asyncio.gather`` read them)."""
    first: BaseException | None = None
    for ack in acks:
        if ack.done():
            error = asyncio.CancelledError() if ack.cancelled() else ack.exception()
            if first is None:
                first = error
    if first is not None:
        raise first


def _read_when_answered(ack: asyncio.Future[PubAck]) -> None:
    """Read ``ack``'s answer when it comes (no one awaits it any more): a
    failure is then not reported as a "Future exception was never retrieved"
    (as ``asyncio.shield`` read it)."""
    ack.add_done_callback(lambda done: done.cancelled() or done.exception())


def _settle(slot: Slot, sent: asyncio.Future[PubAck] | None, *, backend: str) -> None:
    """Settle ``slot`` by what became of its dispatch ``sent`` (to ``backend``)."""
    if slot.settled:
        return  # (by ``sent``'s answer: its done callback came first)
    if sent is None or backend != slot.backend:
        slot.dropped()  # never sent, or sent elsewhere (the broker counts it there)
    elif not sent.done():
        _settle_when_answered(slot, sent)  # no answer yet: it may still be stored
    elif sent.cancelled() or sent.exception() is not None or sent.result().duplicate:
        slot.dropped()  # refused, or an earlier dispatch stands
    else:
        slot.stored()  # counted until a broker read that began later counts it


def _settle_when_answered(slot: Slot, sent: asyncio.Future[PubAck]) -> None:
    """Keep ``slot`` counted as on its way until ``sent`` is answered (or the grace ends)."""

    def answered(done: asyncio.Future[PubAck]) -> None:
        if done.cancelled() or done.exception() is not None or done.result().duplicate:
            slot.dropped()
        else:
            slot.stored()

    sent.add_done_callback(answered)
    asyncio.get_running_loop().call_later(_UNANSWERED_GRACE, slot.stored)


class Dispatcher:
    """Carries out the binder's binds (see the module docstring)."""

    def __init__(
        self,
        js: JetStream,
        events: EventLog,
        config: Config,
        *,
        holder: str,
        clock: Callable[[], float],
        end_request: Callable[[InferenceRequest, Event], Awaitable[None]],
    ) -> None:
        self._js = js
        self._log = events
        self._config = config
        self._holder = holder
        self._clock = clock
        self._end_request = end_request
        self._ack_wait = parse_duration(config.router.ack_wait)
        self._max_deliveries = router_max_deliveries(config.router.max_deliver)
        #: Failed dispatches seen, per ``<tenant>:<id>``.
        self._dispatch_failures: dict[str, int] = {}
        #: Requests bound (their decisions stored) by this dispatcher.
        self.routed = 0
        #: Each (backend, priority)'s metrics series (:meth:`_series`).
        self._metrics: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        #: The first request-stream sequence no earlier binder can have seen
        #: (set as a term begins): one below it may have been bound by one.
        self.term_first_seq = 0

    async def bind(
        self,
        item: Held,
        slot: Slot,
        level: str,
        now: float,
        reason: str = BIND_REASON,
        *,
        term: int,
        effective_rank: int,
        reserved: Reserved | None = None,
        probe: bool = False,
        predicted: float | None = None,
        estimated_cost: float = 0.0,
    ) -> None:
        """Dispatch ``item`` to the slot's backend, log the ``routed`` decision, ack it.

        ``effective_rank``: the rank it competed at in the round that bound it
        (:attr:`~renqueue.policy.Bind.effective_rank`).
        ``probe``: the backend's circuit is half-open and this call is its probe.
        Both go under per-attempt message ids, so a bind repeated for the same
        attempt stores neither twice (:meth:`_send`).
        """
        request = item.request
        attempt = request.requeues + 1  # a preempted request is bound anew
        tokens = 0 if reserved is None else reserved.cost.tokens
        dispatch = Dispatch(
            request=request,
            backend=slot.backend,
            attempt=attempt,
            routed_at=now,
            effective_rank=effective_rank,
            reserved_tokens=tokens,
            probe=probe,
        )
        decision = routed(
            request,
            at=now,
            backend=slot.backend,
            attempt=attempt,
            priority=level,
            queue_wait=max(0.0, now - item.submitted),
            reason=reason,
            router=self._holder,
            term=term,
            reserved_tokens=tokens,
            probe=probe,
            complexity_estimate=item.estimate,
            predicted=predicted,
            estimated_cost=estimated_cost,
        )
        attributes: dict[str, str | int] = {
            "renqueue.request_id": request.id,
            "renqueue.tenant": request.tenant,
            "renqueue.backend": slot.backend,
            "renqueue.attempt": attempt,
            "renqueue.priority": level,
        }
        # The binding is the router's span in the request's trace.
        with hop("renqueue.bind", item.trace, kind="producer", attributes=attributes) as trace:
            await self._send(item, slot, dispatch, decision, reserved, trace=trace)

    async def _send(
        self,
        item: Held,
        slot: Slot,
        dispatch: Dispatch,
        decision: Routed,
        reserved: Reserved | None,
        *,
        trace: TraceParent,
    ) -> None:
        """Publish ``dispatch`` and its ``decision``, then ack the request.

        A first delivery in this term publishes both at once (the decision
        right behind the dispatch). A request that may have been bound before
        (delivered again, or stored before this term began) keeps a decision
        already logged for its attempt (its dispatch goes to that backend),
        and otherwise logs its decision only once its dispatch is stored: a
        duplicate means an earlier bind's dispatch stands, and the decision
        names that one's backend, never one the request was not sent to.
        """
        request = item.request
        meta = item.msg.metadata
        # Delivered before, or stored before this term began: an earlier bind
        # (this router's, or a binder's before it) may have dispatched it or
        # logged its decision. A first delivery publishes both at once.
        maybe_bound = meta.num_delivered > 1 or meta.sequence.stream < self.term_first_seq
        sent: asyncio.Future[PubAck] | None = None
        backend: str | None = None
        together: asyncio.Future[PubAck] | None = None
        earlier: tuple[Routed, int] | None = None
        try:
            if maybe_bound:
                earlier = await self._decision_logged(item, dispatch.attempt)
                if earlier is not None:
                    # Its decision is in the log: it stands (the dispatch goes there).
                    logged_to = earlier[0].backend
                    dispatch = msgspec.structs.replace(dispatch, backend=logged_to)
                    decision = msgspec.structs.replace(decision, backend=logged_to)
            elif item.logged is None and item.first is not None:
                # Bound in the first round after it was read: its first word and
                # this decision are one stored event, published ahead of the
                # dispatch, so a dispatch stored never lacks them (a binder that
                # dies between the two leaves a decision logged, which stands
                # for the next one: above).
                together = await self._log.append_async(bound_at_once(item.first, decision))
                item.logged = together
            sent = await self._js.publish_async(
                dispatch_subject(dispatch.backend),
                encode(dispatch),
                headers={
                    "Nats-Msg-Id": msg_id(request.tenant, request.id, "dispatch", dispatch.attempt),
                    **trace_headers(trace),
                },
            )
            # The slot is the broker's to count once the dispatch is stored: settled
            # by its own ack, not after the decision's (a slot counted twice meanwhile
            # is a slot idle: ~6 of 28 on a loaded broker, where acks took 40-120 ms).
            sent.add_done_callback(functools.partial(_settle, slot, backend=dispatch.backend))
            # (A timeout stops the waits for ``sent``, never ``sent`` itself: _kept_alive.)
            if earlier is not None:
                # Logged already (on its own, or carried by its `submitted`):
                # nothing more to log; the reservation is that decision's.
                await self._kept_alive(item.msg, sent, item.logged, spare=sent)
                backend = decision.backend
                if reserved is not None:
                    reserved.logged(backend, earlier[1])
            elif maybe_bound:
                (ack,) = await self._kept_alive(item.msg, sent, spare=sent)
                backend = await self._log_decision(item, decision, ack, reserved)
            elif together is not None:
                backend = await self._logged_together(
                    item, decision, reserved, together=together, dispatched=sent
                )
            else:
                backend = await self._append_decision(item, decision, reserved, sent)
            await item.msg.ack()
        except Exception as exc:  # noqa: BLE001 - the request goes back to wait, nothing lost
            await self._dispatch_failed(item, exc)
            return
        finally:
            if reserved is not None and reserved.seq is None:
                reserved.dropped()  # no decision logged: nothing reserved
            _settle(slot, sent, backend=dispatch.backend)
        self._dispatch_failures.pop(msg_id(request.tenant, request.id), None)
        if backend is not None:
            self.routed += 1
            routed_total, queue_wait = self._series(backend, decision.priority)
            routed_total.inc()
            queue_wait.observe(decision.queue_wait)

    def _series(self, backend: str, priority: str) -> tuple[Counter, Histogram]:
        """The ``routed`` and queue wait series of ``backend`` and ``priority``,
        looked up once (``labels()`` locks and checks on each call)."""
        series = self._metrics.get((backend, priority))
        if series is None:
            series = (
                metrics.ROUTED.labels(backend, priority),
                metrics.QUEUE_WAIT.labels(priority),
            )
            self._metrics[(backend, priority)] = series
        return series

    async def _decision_logged(self, item: Held, attempt: int) -> tuple[Routed, int] | None:
        """For a request that may have been bound before: its first word on its
        own (a copy of one an earlier bind stored is deduplicated), then the
        decision logged for ``attempt``, if any, and the sequence of the event
        that says it.

        The decisions are read only once its first word is stored: an earlier
        bind's ``submitted`` carrying one, still on its way, is then stored too
        (this one was deduplicated into it), or never will be (deduplicated
        into this one: that bind then logs its decision apart, under the
        ``routed`` message id this bind's shares). Read sooner, it could be
        missed, and a second decision logged for the attempt."""
        await log_first(item, self._log)
        await self._kept_alive(item.msg, item.logged, spare=item.logged)
        return await self._log.decision_of(item.request.tenant, item.request.id, attempt)

    async def _log_decision(
        self, item: Held, routed: Routed, ack: PubAck, reserved: Reserved | None
    ) -> str | None:
        """Log the decision of a stored dispatch (``ack``); the backend it names.

        A duplicate means an earlier bind's dispatch stands: the decision
        names that one's backend, or is not logged (``None``) when that
        cannot be read back or the request has ended.
        """
        backend: str | None = routed.backend
        if ack.duplicate:
            backend = await self._earlier_dispatch(item.request, routed.attempt, ack.seq)
            if backend is not None:
                routed = msgspec.structs.replace(
                    routed, backend=backend, reason=_EARLIER_DISPATCH_REASON
                )
        if backend is None:
            await self._kept_alive(item.msg, item.logged)
            return None
        return await self._append_decision(item, routed, reserved)

    async def _append_decision(
        self,
        item: Held,
        routed: Routed,
        reserved: Reserved | None,
        dispatched: asyncio.Future[PubAck] | None = None,
    ) -> str:
        """Publish ``routed`` and await it with the request's ``submitted`` (and,
        if given, its dispatch's) ack; the reservation is then the decision's."""
        logged = await self._log.append_async(routed)
        *_, decision = await self._kept_alive(
            item.msg, dispatched, item.logged, logged, spare=dispatched
        )
        if reserved is not None:
            reserved.logged(routed.backend, decision.seq)
        return routed.backend

    async def _logged_together(
        self,
        item: Held,
        routed: Routed,
        reserved: Reserved | None,
        *,
        together: asyncio.Future[PubAck],
        dispatched: asyncio.Future[PubAck],
    ) -> str:
        """Await ``together``, the ``submitted`` event that carries ``routed``,
        with the dispatch's ack; the reservation is then the decision's.

        Deduplicated (a ``submitted`` of the request is stored already: one the
        round logged on its own while this bind was under way, or a copy read
        again past the requests' duplicate window while the first still
        waits), it may not carry this decision: then ``routed`` is logged on
        its own."""
        stored, _ = await self._kept_alive(item.msg, together, dispatched, spare=dispatched)
        if stored.duplicate and not await self._carries(stored.seq, routed):
            return await self._append_decision(item, routed, reserved)
        if reserved is not None:
            reserved.logged(routed.backend, stored.seq)
        return routed.backend

    async def _carries(self, seq: int, routed: Routed) -> bool:
        """Whether the event stored at ``seq`` carries a decision of ``routed``'s attempt."""
        stored = await self._js.get_msg(EVENTS_STREAM, seq=seq)
        with contextlib.suppress(msgspec.DecodeError):
            event = EVENT_DECODER.decode(stored.data or b"")
            return (
                isinstance(event, Submitted)
                and event.routed is not None
                and (event.tenant, event.request_id) == (routed.tenant, routed.request_id)
                and event.routed.attempt == routed.attempt
            )
        return False

    async def _dispatch_failed(self, item: Held, exc: Exception) -> None:
        """A bind failed: the request waits again (nak), or, out of dispatch
        attempts (or at the consumer's last delivery), fails for the record
        rather than stay stranded in the stream."""
        request = item.request
        if (
            isinstance(exc, StoreFullError)
            and item.msg.metadata.num_delivered < self._max_deliveries
        ):
            log.warning("dispatch refused: a store is full; the request waits", error=str(exc))
            with contextlib.suppress(Exception):
                await item.msg.nak(delay=STORE_FULL_DELAY)
            return
        key = msg_id(request.tenant, request.id)
        failures = self._dispatch_failures.pop(key, 0) + 1
        if (
            failures < self._config.router.max_deliver
            and item.msg.metadata.num_delivered < self._max_deliveries
        ):
            self._dispatch_failures[key] = failures
            while len(self._dispatch_failures) > _FAILURES_KEPT:
                self._dispatch_failures.pop(next(iter(self._dispatch_failures)))
            log.warning(
                "dispatch failed; request returns to its queue", error=str(exc), failures=failures
            )
            with contextlib.suppress(Exception):
                await item.msg.nak(delay=0.5)
            return
        await self._fail_undeliverable(item, exc)

    async def _earlier_dispatch(
        self, request: InferenceRequest, attempt: int, seq: int
    ) -> str | None:
        """The backend an earlier bind of this attempt dispatched to (stored at ``seq``).

        Read from the stored dispatch; once a worker has finished with it (its
        dispatch acked, so gone), from the log: the attempt's ``started`` or
        ``stolen`` event. ``None`` when the request has ended meanwhile (its
        decision is then not logged after its end) or the log does not say.
        """
        with contextlib.suppress(NatsNotFoundError):
            stored = await self._js.get_msg(DISPATCH_STREAM, seq=seq)
            return stored.subject.removeprefix(dispatch_subject(""))
        backend: str | None = None
        for event in await self._log.history(request.tenant, request.id):
            if isinstance(event, Started) and event.attempt == attempt:
                backend = event.backend
            elif isinstance(event, Stolen) and event.attempt == attempt and backend is None:
                backend = event.to_backend
            elif is_terminal(event):
                return None
        if backend is None:
            log.warning(
                "a request was dispatched by an earlier bind and its backend cannot be read back",
                request_id=request.id,
                attempt=attempt,
            )
        return backend

    async def _kept_alive(
        self,
        msg: Message,
        *acks: asyncio.Future[PubAck] | None,
        spare: asyncio.Future[PubAck] | None = None,
    ) -> list[PubAck]:
        """Await ``acks`` (the publishes of a decision; ``None`` skipped) within
        ``ACKS_TIMEOUT`` (or ``router.ack_wait`` if shorter), keeping ``msg``'s
        ack timer alive meanwhile: a slow broker must not let the request be
        redelivered (and bound again) while its decision is still on its way.
        An ack that never comes (nats-py reports a refused ``publish_async``
        only to the error callback) is a failed dispatch. Their results, in
        their order; the first failure raised as soon as it comes.

        Given up on (a failure, a timeout, or this task cancelled), the acks
        still pending are cancelled (which frees their pending slots), all but
        ``spare``: the dispatch's, whose own answer settles its slot
        (:func:`_settle`), or a ``submitted`` event's ack the request's next
        steps await again; its answer is still read when it comes, and every
        failure that came back is read, so none is reported as "never
        retrieved". One ``asyncio.wait`` on the acks themselves: no gathering
        or shielding future between them and this wait."""
        futures = [ack for ack in acks if ack is not None]
        pending = {ack for ack in futures if not ack.done()}
        loop = asyncio.get_running_loop()
        timeout = min(ACKS_TIMEOUT, self._ack_wait)
        deadline = loop.time() + timeout
        interval = max(0.1, self._ack_wait / 3)
        try:
            _raise_failed(futures)  # (one failed already: the others are given up on too)
            while pending:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"no acks for the decision within {timeout:g} s")
                done, pending = await asyncio.wait(
                    pending,
                    timeout=min(interval, remaining),
                    return_when=asyncio.FIRST_EXCEPTION,
                )
                if done:
                    _raise_failed(futures)  # (in their order, not the set's)
                if pending:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
        finally:
            for ack in pending:
                # (One that came back meanwhile cannot be cancelled: read it.)
                if ack is spare or not ack.cancel():
                    _read_when_answered(ack)
        return [ack.result() for ack in futures]

    async def _fail_undeliverable(self, item: Held, exc: Exception) -> None:
        request = item.request
        log.error("dispatch failed on the last delivery; request fails", error=str(exc))
        try:
            await self._log.dead_letter(
                "requests",
                item.msg.data,
                reason=f"undeliverable: {exc}",
                source_subject=item.msg.subject,
                source_seq=item.msg.metadata.sequence.stream,
                tenant=request.tenant,
                request_id=request.id,
            )
            await self._end_request(
                request,
                failed(
                    request.id,
                    request.tenant,
                    at=self._clock(),
                    error_type="undeliverable",
                    reason=f"could not hand the request to a backend: {exc}"[:1000],
                ),
            )
            await item.msg.ack()
        except Exception:
            log.exception("could not record the failure", request_id=request.id)
            with contextlib.suppress(Exception):
                await item.msg.nak(delay=1.0)
