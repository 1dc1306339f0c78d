"""The worker's side of the preemption protocol (:mod:`renqueue.schema._offers`).

Every worker of a backend hears each ask (the run to preempt may be in any of
them) and offers its best victim, or stays silent; the router confirms one
offer, on that worker's own subject, and only that worker preempts. A run is
judged at the level it was bound at: one that aged to the top is not
preemptible, or aging could never get it through. A preempted request goes
back to wait on its priority subject, keeping its submit time (:func:`requeue`).
"""

from __future__ import annotations

import time
import uuid
from typing import Protocol

import msgspec

from ... import metrics
from ...broker import EventLog, JetStream, Message, hop, publish_stored, trace_headers
from ...logs import get_logger, misdirected
from ...policy import LevelPolicy, choose_victim
from ...schema import (
    ASK_DECODER,
    CONFIRM_DECODER,
    MAX_REQUEUES,
    PREEMPT_ASK,
    Answer,
    Fallback,
    Offer,
    encode,
    msg_id,
    preempt_subject,
    preempt_subjects,
    request_subject,
    subject_matches,
)
from ...schema import Run as Recorded  # its events; ``Run`` here is a call as preemption sees it
from ._delivery import Delivery

__all__ = ["Preemptible", "Run", "Stoppable", "put_back", "requeue"]

log = get_logger("worker")


class Stoppable(Protocol):
    """A backend call in progress that can be stopped (a
    :class:`~._call.CallStop`, or a task); ``done()`` once there is nothing
    left to stop (ended, or being stopped already)."""

    def cancel(self) -> object: ...

    def done(self) -> bool: ...


class Run(msgspec.Struct, kw_only=True):
    """A backend call in progress, as preemption sees it."""

    rank: int
    started: float
    call: Stoppable
    preempted_by: str | None = None
    #: False for a run of a request put back :data:`MAX_REQUEUES` times
    #: already: it cannot be put back again, so it is never preempted.
    may_requeue: bool = True

    def is_live(self) -> bool:
        return self.preempted_by is None and not self.call.done()


class Preemptible:
    """The runs of one worker that a router may preempt, by request (``<tenant>:<id>``)."""

    def __init__(self, backend_name: str, policies: list[LevelPolicy]) -> None:
        self._backend_name = backend_name
        self._policies = policies
        #: This worker's own token: confirms come on ``rq.preempt.<backend>.<token>``.
        self.token = uuid.uuid4().hex
        self.runs: dict[str, Run] = {}

    async def on_message(self, msg: Message) -> None:
        """A router needs a slot for an urgent request: on an ask, offer this
        worker's best victim (or stay silent); on a confirm addressed to this
        worker, preempt it (cancel its call) and answer which run it was."""
        if not subject_matches(preempt_subjects(self._backend_name), msg.subject):
            # A tenant's push consumer delivering here: its messages keep their own subjects.
            misdirected("preempt", msg.subject)
            return
        token = msg.subject.rsplit(".", 1)[-1]
        if token == PREEMPT_ASK:
            try:
                ask = ASK_DECODER.decode(msg.data)
            except msgspec.DecodeError:
                return
            victim = self.victim(ask.rank)
            if victim is None or not msg.reply:
                return
            run = self.runs[victim]
            offer = Offer(
                backend=self._backend_name,
                confirm=preempt_subject(self._backend_name, self.token),
                rank=run.rank,
                running=max(0.0, time.monotonic() - run.started),
            )
            await msg.respond(encode(offer))
            return
        if token != self.token:
            return  # a confirm for another worker of this backend
        try:
            confirm = CONFIRM_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            await msg.respond(encode(Answer()))
            return
        victim = self.victim(confirm.rank)
        if victim is not None:
            run = self.runs[victim]
            run.preempted_by = confirm.by
            run.call.cancel()
            log.info("preempting a run", request_id=str(victim), by=confirm.by)
        await msg.respond(encode(Answer(preempted=None if victim is None else str(victim))))

    def victim(self, rank: int) -> str | None:
        """The key of the run to give up for a request at ``rank``; ``None`` if none may be."""
        return choose_victim(
            {
                key: (run.rank, run.started)
                for key, run in self.runs.items()
                if run.is_live() and run.may_requeue
            },
            rank,
            self._policies,
        )


async def requeue(
    js: JetStream,
    events: EventLog,
    delivery: Delivery,
    *,
    run: int,
    by: str,
    backend: str,
    at: float,
) -> None:
    """Send a preempted request back to wait, keeping its submit time (aging credit).

    In this order, each step idempotent: the ``preempted`` event of run
    number ``run`` (so a redelivery knows), the request back on its priority
    subject, the delivery done.
    """
    preempted = Recorded.of(delivery.dispatch, run, backend=backend).preempted(at=at, by=by)
    await events.append(preempted)
    await put_back(js, delivery, fallback=None)
    metrics.TERMINAL.labels("preempted").inc()


async def put_back(js: JetStream, delivery: Delivery, *, fallback: Fallback | None = None) -> None:
    """Put a dispatched request back to routing, then be done with its delivery.

    The copy goes to its level's requeue subject (``rq.req.<level>.<tenant>.requeue``,
    which only the services may publish to) with ``requeues`` set to this
    attempt, so its next dispatch is a new attempt under new message ids. It
    keeps its wait when the log says why it was put back (the event the
    caller recorded first: ``preempted``, or a ``retrying`` that says
    ``requeued``). Idempotent: the copy's message id is
    ``<tenant>:<id>:requeue:<attempt>``. A request put back
    :data:`MAX_REQUEUES` times already cannot be (``ValueError``): its
    callers end it instead. ``fallback``: its new place in its route's
    cascade after a backend failed it (else it keeps the one it has).
    """
    dispatch = delivery.dispatch
    request = dispatch.request
    if dispatch.attempt > MAX_REQUEUES:
        raise ValueError(
            f"request {request.id} was put back {MAX_REQUEUES} times already; not again"
        )
    again = msgspec.structs.replace(
        request,
        requeues=dispatch.attempt,
        fallback=request.fallback if fallback is None else fallback,
    )
    # Acked only once a copy is surely stored: a tenant may have taken
    # this message id first (see publish_stored).
    attributes: dict[str, str | int] = {
        "renqueue.request_id": request.id,
        "renqueue.tenant": request.tenant,
        "renqueue.attempt": dispatch.attempt,
    }
    # Put back in the same trace, under this worker's span.
    with hop("renqueue.put_back", delivery.trace, kind="producer", attributes=attributes) as trace:
        await publish_stored(
            js,
            request_subject(request.priority, request.tenant, requeue=True),
            encode(again),
            msg_id(request.tenant, request.id, "requeue", dispatch.attempt),
            headers=trace_headers(trace),
        )
    # The slot goes to whoever waits for it (after a preemption: the urgent
    # request): announced once the broker counts it free.
    await delivery.done(confirmed=True)
