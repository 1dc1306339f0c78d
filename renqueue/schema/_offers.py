"""The preemption protocol: an urgent request takes a preemptible run's slot, once.

Core NATS, between the router holding an urgent request and the workers of
its candidate backends. Two phases, so that exactly one run is preempted per
ask, by the worker process that holds it:

1. **Ask.** The router publishes an :class:`Ask` to ``rq.preempt.<backend>.ask``
   of every capable candidate, with a reply inbox. Every worker process of
   those backends receives it (no queue group). A worker holding a run that
   may be preempted for the ask's rank (:func:`renqueue.policy.choose_victim`)
   answers with an :class:`Offer`; the others stay silent.
2. **Confirm.** The router takes the best offer (the first backend in cascade
   order, then the least urgent run, then the most recently started) as soon
   as no better one can come: at once for a run of the least urgent
   preemptible level on the first candidate, else :data:`OFFER_SETTLE`
   seconds after the first offer (every worker hears the ask at the same
   moment), or :data:`OFFER_WINDOW` seconds after the ask when none came; it
   sends a :class:`Confirm` to that worker's
   own subject ``rq.preempt.<backend>.<token>``. The worker preempts its best
   victim for the rank (which may differ from the one offered, if that one
   ended meanwhile) and answers with an :class:`Answer`. A worker that has no
   victim any more answers ``preempted: null`` and the router confirms the
   next offer; a confirm that gets no answer ends the ask (the worker may have
   acted), so one ask never preempts two runs.

One run at most is preempted per urgent request: once a confirm was answered
with a preemption (or went unanswered: the worker may have acted), the router
never asks for that request again. A request whose ask found nothing to
preempt asks again ``PREEMPT_RETRY`` seconds later while it still waits (the
round planner decides when to ask: :func:`renqueue.policy.plan`). Every
subject here is under ``rq.>``, which only the service user may publish to;
replies go to the service user's inbox (``_INBOX_renqueue.>``, granted to it
in ``nats/auth.conf``).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import Meta

__all__ = [
    "ANSWER_DECODER",
    "ASK_DECODER",
    "CONFIRM_DECODER",
    "CONFIRM_TIMEOUT",
    "OFFER_DECODER",
    "OFFER_SETTLE",
    "OFFER_WINDOW",
    "Answer",
    "Ask",
    "Confirm",
    "Offer",
]

#: Seconds the router collects offers after an ask at most (when none comes).
OFFER_WINDOW: Final = 0.2
#: Seconds the router waits for other workers' offers after the first one,
#: unless that one cannot be beaten.
OFFER_SETTLE: Final = 0.02
#: Seconds the router waits for a confirmed worker's answer.
CONFIRM_TIMEOUT: Final = 1.0

Rank = Annotated[int, Meta(ge=0)]


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    """A router needs a slot for request ``by`` (of ``tenant``) at effective ``rank``."""

    by: str
    rank: Rank
    tenant: str = ""


class Offer(msgspec.Struct, frozen=True, kw_only=True):
    """A worker can preempt a run at ``rank``, running for ``running`` seconds.

    ``confirm`` is the worker's own subject, to send the :class:`Confirm` to.
    """

    backend: str
    confirm: str
    rank: Rank
    running: float


class Confirm(msgspec.Struct, frozen=True, kw_only=True):
    """The router chose this worker: preempt one run for ``by`` at ``rank``."""

    by: str
    rank: Rank
    tenant: str = ""


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker did: the run it preempted, or ``None``."""

    preempted: str | None = None


ASK_DECODER: Final = msgspec.json.Decoder(Ask)
OFFER_DECODER: Final = msgspec.json.Decoder(Offer)
CONFIRM_DECODER: Final = msgspec.json.Decoder(Confirm)
ANSWER_DECODER: Final = msgspec.json.Decoder(Answer)
