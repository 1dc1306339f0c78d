"""Work stealing: a worker with room takes work queued on busy replicas of its pool.

Backends that share a ``pool`` serve the same model. A dispatch queued on a
replica whose slots are all taken waits there (its consumer's
``max_ack_pending``), while another replica may sit idle; the idle replica's
worker moves it to its own subject. Every move is logged first (a ``stolen``
event), its copy stored under a message id naming the source message, and the
source deleted only once the copy is stored and only if the replica's consumer
has not delivered it meanwhile: a request is never lost, and runs once (the
run claim decides between an original and its copy delivered at once).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec

from ...broker import EventLog, JetStream, StoredMessage, trace_headers, trace_of
from ...errors import NatsNotFoundError
from ...logs import get_logger
from ...policy import ALL_FEATURES, needs
from ...schema import (
    DISPATCH_DECODER,
    DISPATCH_STREAM,
    Dispatch,
    Stolen,
    TraceParent,
    dispatch_subject,
    encode,
    msg_id,
    stolen,
    worker_consumer,
)
from ._delivery import Delivery

__all__ = ["STEAL_INTERVAL", "Thief"]

log = get_logger("worker")

#: Seconds between looks at pool siblings' queues while this worker has room.
STEAL_INTERVAL: Final = 0.1


class Thief:
    """Moves dispatches queued on ``siblings`` to ``backend_name``'s subject."""

    def __init__(
        self,
        js: JetStream,
        events: EventLog,
        backend_name: str,
        siblings: list[str],
        *,
        slots: int,
        clock: Callable[[], float] = time.time,
        supports: frozenset[str] = ALL_FEATURES,
    ) -> None:
        self._js = js
        #: What this backend can do (its config's ``supports``): a request
        #: needing more stays with its sibling, which the router chose for it.
        self._supports = supports
        self._log = events
        self._backend_name = backend_name
        self._siblings = siblings
        self._slots = slots
        self._clock = clock

    async def steal(self) -> int:
        """While this worker has free slots and nothing of its own queued, move
        work queued on busy siblings of its pool to its own subject; how many.

        The queued dispatches are read from the stream directly: a sibling's
        consumer will not hand them to anyone while its slots are full
        (``max_ack_pending``), which is exactly when they should be stolen.
        """
        own = worker_consumer(self._backend_name)
        mine = await self._js.consumer_info(DISPATCH_STREAM, own)
        free = self._slots - (mine.num_ack_pending or 0) - (mine.num_pending or 0)
        moved = 0
        for sibling in self._siblings:
            if free <= 0:
                break
            info = await self._js.consumer_info(DISPATCH_STREAM, worker_consumer(sibling))
            seq = (info.delivered.stream_seq if info.delivered else 0) + 1
            for _ in range(min(free, info.num_pending or 0)):
                try:
                    raw = await self._js.get_msg(
                        DISPATCH_STREAM, seq=seq, subject=dispatch_subject(sibling), next=True
                    )
                except NatsNotFoundError:
                    break
                seq = raw.seq + 1
                if await self.steal_one(raw, sibling):
                    free -= 1
                    moved += 1
        return moved

    async def steal_one(self, raw: StoredMessage, sibling: str) -> bool:
        """Move one queued dispatch (stream sequence ``raw.seq``) from ``sibling`` here.

        In this order: the ``stolen`` event, the copy on this backend's
        subject, the original deleted from the stream, only once the copy is
        known to be stored and only if the sibling's consumer has not
        delivered it meanwhile. A delivered original is its run's lease: if
        it were deleted and that run's worker died, nothing would deliver the
        request again (the copy's run steps back, see below). So a delivered
        original stays, and both runs claim the same run (``claim_run``): the
        second steps back (see the worker's ``_start_run``), one call. A worker delivered an
        original after its ``stolen`` event was logged hands it over to the
        copy instead (the worker's :class:`~._gate.Gate`), so the original deleted in the
        moment between the look and the delete never runs.
        """
        try:
            dispatch = DISPATCH_DECODER.decode(raw.data)
        except msgspec.DecodeError:
            return False  # the sibling's worker dead-letters it
        request = dispatch.request
        fallback = request.fallback
        if dispatch.probe or (fallback is not None and self._backend_name in fallback.excluded):
            # A half-open circuit's probe call belongs to that backend; a
            # request this backend failed is not taken back behind the router's back.
            return False
        if not needs(request) <= self._supports:
            return False  # tools, images, ... this replica's model lacks
        await self._log.append(
            stolen(
                dispatch,
                at=self._clock(),
                from_backend=sibling,
                to_backend=self._backend_name,
                from_seq=raw.seq,
            )
        )
        if await self.move(dispatch, self._backend_name, raw.seq, trace_of(raw.headers)) is None:
            return False
        sibling_consumer = await self._js.consumer_info(DISPATCH_STREAM, worker_consumer(sibling))
        delivered = sibling_consumer.delivered
        if delivered is not None and delivered.stream_seq >= raw.seq:
            log.info("a stolen request was delivered to its replica meanwhile; keeping it",
                     request_id=request.id, sibling=sibling)  # fmt: skip
            return True
        # Gone already: another thief moved it at the same moment (its copy
        # and ours share the id: one is stored), or its worker acked it.
        with contextlib.suppress(NatsNotFoundError):
            await self._js.delete_msg(DISPATCH_STREAM, raw.seq)
        log.info("stole a queued request", request_id=request.id, sibling=sibling)
        return True

    async def move(
        self,
        dispatch: Dispatch,
        to_backend: str,
        source_seq: int,
        trace: TraceParent | None = None,
    ) -> tuple[int, bool] | None:
        """Store a copy of the dispatch at stream sequence ``source_seq`` on
        ``to_backend``'s subject. When the copy is stored (now or before):
        its stream sequence and whether it is still there (gone: it was run,
        moved on, or stepped back, see the worker's :class:`~._gate.Gate`), so the source may
        be removed; ``None`` when it is not stored and the source must stay.

        The copy's message id names the source message (``stolen:<attempt>:<seq>``),
        so each move has its own id (A -> B -> A moves twice, under two ids) and
        a duplicate can only be a copy of this very source: an earlier try of
        this move, or another thief moving it at the same moment. The copy
        keeps the source's ``trace`` (the router's span: it is the same dispatch).
        """
        request = dispatch.request
        moved = msgspec.structs.replace(dispatch, backend=to_backend)
        ack = await self._js.publish(
            dispatch_subject(to_backend),
            encode(moved),
            headers={
                "Nats-Msg-Id": msg_id(
                    request.tenant, request.id, "stolen", dispatch.attempt, source_seq
                ),
                **({} if trace is None else trace_headers(trace)),
            },
        )
        if not ack.duplicate:
            return int(ack.seq), True
        # Stored before: still queued, or already run and acked (gone). Delete
        # the source only if what is stored under this id is this request.
        try:
            copy = await self._js.get_msg(DISPATCH_STREAM, seq=ack.seq)
        except NatsNotFoundError:
            return int(ack.seq), False
        with contextlib.suppress(msgspec.DecodeError):
            stored = DISPATCH_DECODER.decode(copy.data or b"")
            if (stored.request.tenant, stored.request.id, stored.attempt) == (
                request.tenant,
                request.id,
                dispatch.attempt,
            ):
                return int(ack.seq), True
        log.error(
            "a move's copy was not stored and its id is taken; keeping the source",
            request_id=request.id,
            seq=source_seq,
        )
        return None

    async def hand_over(self, delivery: Delivery, move: Stolen, events: list[Any]) -> bool:
        """Finish a thief's ``move`` of this delivery's message and be done
        with it, if the copy can still run; False (keep and run this message)
        otherwise.

        A copy's first run has the number of this message's first run (runs are
        numbered per attempt), so on a redelivery whose first run is claimed (an
        earlier delivery of this message ran, and its worker died), no copy can run:
        every copy steps back for that claim, however many moves away it is (A -> B
        -> A). This message then runs, with a run number of its own. (If the claim
        was a copy's own run, still going, the backend is called twice; the
        terminal claim keeps one outcome.)
        """
        request = delivery.dispatch.request
        first_run = delivery.number - delivery.delivered + 1
        if delivery.delivered > 1 and await self._log.run_claimed(
            request.tenant, request.id, delivery.dispatch.attempt, first_run
        ):
            log.info(
                "an earlier run of this message claimed the run its stolen copy would need;"
                " running the original",
                request_id=request.id,
            )
            return False
        moved = await self.move(
            delivery.dispatch, move.to_backend, delivery.stream_seq, delivery.trace
        )
        if moved is None:
            return False  # the copy is not stored: keep this message
        copy_seq, stored = moved
        if stored or any(isinstance(e, Stolen) and e.from_seq == copy_seq for e in events):
            await delivery.done()
            return True
        log.info("a stolen copy stepped back and its run is gone; running the original")
        return False

    def stolen_here(self, event: Any, dispatch: Dispatch, source_seq: int) -> bool:
        """Whether ``event`` records a sibling moving the message at ``source_seq``."""
        return (
            isinstance(event, Stolen)
            and event.attempt == dispatch.attempt
            and event.from_backend == self._backend_name
            and event.from_seq in (0, source_seq)
        )
