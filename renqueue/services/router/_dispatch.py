"""Carrying out a bind: the dispatch, the ``routed`` decision, the request's ack.

A :class:`Dispatcher` turns one :class:`~renqueue.policy.Bind` the round
planner decided into its publishes: the :class:`~renqueue.wire.Dispatch` on
the backend's subject and the ``routed`` event, both under per-attempt
message ids (so a bind repeated for the same attempt stores neither twice),
then acks the request's message. It keeps the request's ack timer alive
while the acks are on their way, settles the capacity :class:`Slot` the
round counted, and owns the budget of failed dispatches: a request whose
dispatch fails goes back to wait (nak), and after ``router.max_deliver``
failed dispatches it fails ``undeliverable`` with a dead-letter copy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import msgspec

from ... import metrics
from ...config import Config, parse_duration
from ...errors import NatsNotFoundError
from ...logs import get_logger
from ...policy import BIND_REASON
from ...wire._eventlog import EventLog
from ...wire._messages import Dispatch, Event, Failed, InferenceRequest, Routed, Started, encode
from ...wire._nats import JetStream, Message, PubAck
from ...wire._subjects import DISPATCH_STREAM, dispatch_subject, msg_id, router_max_deliveries
from ._capacity import Slot
from ._hold import Held

__all__ = ["ACKS_TIMEOUT", "Dispatcher"]

log = get_logger("router")

#: Seconds a decision's publishes may take to be acked before the dispatch counts
#: as failed (``router.ack_wait`` if that is shorter).
ACKS_TIMEOUT: Final = 10.0
#: The reason of a decision logged again for the dispatch an earlier bind stored.
_EARLIER_DISPATCH_REASON: Final = "dispatched by an earlier bind of this attempt"
#: Requests whose failed dispatches a router remembers (oldest forgotten first).
_FAILURES_KEPT: Final = 10_000

_T = TypeVar("_T")


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
        self._policies = config.level_policies()
        self._ack_wait = parse_duration(config.router.ack_wait)
        self._max_deliveries = router_max_deliveries(config.router.max_deliver)
        #: Failed dispatches seen, per ``<tenant>:<id>``.
        self._dispatch_failures: dict[str, int] = {}
        #: The first request-stream sequence no earlier binder can have seen
        #: (set as a term begins): one below it may have been bound by one.
        self.term_first_seq = 0
        #: Requests bound (their decisions stored) by this dispatcher.
        self.routed = 0

    async def bind(
        self,
        item: Held,
        slot: Slot,
        level: str,
        now: float,
        reason: str = BIND_REASON,
        *,
        term: int,
    ) -> None:
        """Dispatch ``item`` to ``backend`` and log the ``routed`` decision, then ack it.

        Both are published under per-attempt message ids, so a bind repeated
        for the same attempt stores neither twice. A request that may have
        been bound before (delivered again, or stored before this term began:
        the last binder may have dispatched it and died before it logged the
        decision) waits for its dispatch's ack first: a duplicate means that
        earlier dispatch stands, and the decision logged is that one's
        backend, never one the request was not sent to.
        """
        request = item.request
        backend = slot.backend
        wait = max(0.0, now - item.submitted)
        attempt = request.requeues + 1  # a preempted request is bound anew
        dispatch = Dispatch(
            request=request,
            backend=backend,
            attempt=attempt,
            routed_at=now,
            effective_rank=item.key(now, self._policies)[0],
        )
        routed = Routed(
            request_id=request.id,
            tenant=request.tenant,
            at=now,
            backend=backend,
            attempt=attempt,
            priority=level,
            queue_wait=wait,
            reason=reason,
            router=self._holder,
            term=term,
        )
        sent: asyncio.Future[PubAck] | None = None
        try:
            sent = await self._js.publish_async(
                dispatch_subject(backend),
                encode(dispatch),
                headers={"Nats-Msg-Id": msg_id(request.tenant, request.id, "dispatch", attempt)},
            )
            await self._log_decision(item, routed, sent, slot)
            await item.msg.ack()
        except Exception as exc:  # noqa: BLE001 - the request goes back to wait, nothing lost
            if sent is None or not sent.done() or sent.cancelled() or sent.exception() is not None:
                slot.dropped()  # (stored late after all: the next broker read counts it)
            elif sent.result().duplicate:
                slot.dropped()
            else:
                slot.stored()
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
                    "dispatch failed; request returns to its queue",
                    error=str(exc),
                    failures=failures,
                )
                with contextlib.suppress(Exception):
                    await item.msg.nak(delay=0.5)
                return
            # Out of dispatch attempts (or at the consumer's last delivery):
            # fail it for the record rather than leave it stranded in the stream.
            await self._fail_undeliverable(item, exc)
            return
        self._dispatch_failures.pop(msg_id(request.tenant, request.id), None)
        self.routed += 1
        metrics.ROUTED.labels(backend, level).inc()
        metrics.QUEUE_WAIT.labels(level).observe(wait)

    async def _log_decision(
        self, item: Held, routed: Routed, sent: asyncio.Future[PubAck], slot: Slot
    ) -> None:
        """Log ``routed`` once its dispatch (``sent``) is stored; count the slot.

        A request that may have been bound before (delivered again, or stored
        before this term began) waits for the dispatch's ack before logging:
        a duplicate means an earlier bind's dispatch stands, and the decision
        logged names that one's backend.
        """
        meta = item.msg.metadata
        if meta.num_delivered > 1 or meta.sequence.stream < self.term_first_seq:
            ack = await self._kept_alive(item.msg, sent)
            if not ack.duplicate:
                slot.stored()
            else:
                slot.dropped()
                earlier = await self._earlier_dispatch(item.request, routed.attempt, ack.seq)
                if earlier is None:
                    await self._kept_alive(item.msg, self._acks(item.logged))
                    return
                routed = msgspec.structs.replace(
                    routed, backend=earlier, reason=_EARLIER_DISPATCH_REASON
                )
            logged = await self._log.append_async(routed)
            await self._kept_alive(item.msg, self._acks(item.logged, logged))
            return
        logged = await self._log.append_async(routed)
        ack, *_ = await self._kept_alive(item.msg, self._acks(sent, item.logged, logged))
        if ack.duplicate:  # not for a first delivery in this term; never counted twice
            slot.dropped()
        else:
            slot.stored()

    @staticmethod
    def _acks(*acks: asyncio.Future[PubAck] | None) -> Awaitable[list[PubAck]]:
        """The acks given (``None`` skipped), awaited together, in their order."""
        return asyncio.gather(*(ack for ack in acks if ack is not None))

    async def _earlier_dispatch(
        self, request: InferenceRequest, attempt: int, seq: int
    ) -> str | None:
        """The backend an earlier bind of this attempt dispatched to (stored at ``seq``).

        Read from the stored dispatch, or, once a worker took it, from the
        attempt's ``started`` event. ``None`` when neither says (the run is
        over and its dispatch gone): that decision is then not logged again.
        """
        with contextlib.suppress(NatsNotFoundError):
            stored = await self._js.get_msg(DISPATCH_STREAM, seq=seq)
            return stored.subject.removeprefix(dispatch_subject(""))
        for event in reversed(await self._log.history(request.tenant, request.id, kind="started")):
            if isinstance(event, Started) and event.attempt == attempt:
                return event.backend
        log.warning(
            "a request was dispatched by an earlier binder and its decision cannot be read back",
            request_id=request.id,
            attempt=attempt,
        )
        return None

    async def _kept_alive(self, msg: Message, acks: Awaitable[_T]) -> _T:
        """Await ``acks`` (the publishes of a decision) within ``ACKS_TIMEOUT``
        (or ``router.ack_wait`` if shorter),
        keeping ``msg``'s ack timer alive meanwhile: a slow broker must not let
        the request be redelivered (and bound again) while its decision is
        still on its way. An ack that never comes (nats-py reports a refused
        ``publish_async`` only to the error callback) is a failed dispatch."""
        loop = asyncio.get_running_loop()
        timeout = min(ACKS_TIMEOUT, self._ack_wait)
        deadline = loop.time() + timeout
        interval = max(0.1, self._ack_wait / 3)
        waiting = asyncio.ensure_future(acks)
        try:
            while not waiting.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"no acks for the decision within {timeout:g} s")
                await asyncio.wait({waiting}, timeout=min(interval, remaining))
                if not waiting.done():
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
            return waiting.result()
        finally:
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(BaseException):
                    await waiting

    async def _fail_undeliverable(self, item: Held, exc: Exception) -> None:
        request = item.request
        log.error("dispatch failed on the last delivery; request fails", error=str(exc))
        try:
            await self._log.dead_letter(
                "requests",
                item.msg.data,
                reason=f"undeliverable: {exc}",
                source_subject=item.msg.subject,
                tenant=request.tenant,
                request_id=request.id,
            )
            await self._end_request(
                request,
                Failed(
                    request_id=request.id,
                    tenant=request.tenant,
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
