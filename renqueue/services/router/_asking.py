"""The router's side of the preemption protocol (:mod:`renqueue.schema._offers`).

One ask frees at most one slot: every worker of the candidate backends is
asked for an offer, and only the best offer is confirmed; a confirm that gets
no answer ends the ask (the worker may have acted).

The offers are collected for as long as a better one may still come, not for
a fixed time: an offer no other can beat (a run of the least urgent
preemptible level on the first candidate in cascade order) is confirmed at
once; otherwise the router waits :data:`OFFER_SETTLE` after the first offer
for the other workers' (they hear the ask at the same moment), and
:data:`OFFER_WINDOW` at most when none comes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec

from ...broker import Connection, Message
from ...errors import NatsNoRespondersError, NatsTimeoutError
from ...logs import get_logger, misdirected
from ...schema import (
    ANSWER_DECODER,
    CONFIRM_TIMEOUT,
    OFFER_DECODER,
    OFFER_SETTLE,
    OFFER_WINDOW,
    Ask,
    Confirm,
    InferenceRequest,
    Offer,
    encode,
    preempt_subject,
)

__all__ = ["ask_preemption"]

log = get_logger("router")


async def ask_preemption(
    nc: Connection,
    request: InferenceRequest,
    rank: int,
    backends: list[str],
    *,
    waiting: Callable[[], bool],
    least_urgent: int | None = None,
) -> bool:
    """Free one slot for ``request`` (at ``rank``) on one of ``backends``.

    ``waiting`` says whether the request still needs the slot (it may be
    bound, expired, cancelled or handed back meanwhile: then nothing is
    preempted for it). ``least_urgent``: the least urgent rank a run may be
    preempted at (:func:`renqueue.policy.least_urgent_victim`): such an offer
    on ``backends[0]`` is taken without waiting for more. True when a run was
    preempted for it, or a confirm went unanswered (the worker may have
    acted): it must then never ask again.
    """
    order = {name: index for index, name in enumerate(backends)}
    offers: list[Offer] = []
    arrived = asyncio.Event()

    async def collect(msg: Message) -> None:
        if msg.subject != inbox:
            misdirected("offers", msg.subject)
            return
        with contextlib.suppress(msgspec.DecodeError):
            offer = OFFER_DECODER.decode(msg.data)
            if offer.backend in order:
                offers.append(offer)
                arrived.set()

    def unbeatable() -> bool:
        return least_urgent is not None and any(
            order[offer.backend] == 0 and offer.rank >= least_urgent for offer in offers
        )

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    try:
        ask = encode(Ask(by=request.id, tenant=request.tenant, rank=rank))
        for backend in backends:
            await nc.publish(preempt_subject(backend), ask, reply=inbox)
        await _until_settled(arrived, offers, unbeatable)
        # What came by now (no await since): a later offer is not weighed.
        # Cascade order first (where the request would be routed), then the
        # least urgent run, then the most recently started (least work lost).
        ranked = sorted(
            offers, key=lambda offer: (order[offer.backend], -offer.rank, offer.running)
        )
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if not waiting():
        return False
    confirm = encode(Confirm(by=request.id, tenant=request.tenant, rank=rank))
    for offer in ranked:
        if not waiting():
            return False
        try:
            reply = await nc.request(offer.confirm, confirm, timeout=CONFIRM_TIMEOUT)
        except NatsNoRespondersError:
            continue  # that worker is gone: it preempted nothing
        except NatsTimeoutError:
            # It may have acted: one request must never preempt two runs.
            log.warning("no answer to a preemption; not asking another", by=request.id)
            return True
        try:
            answer = ANSWER_DECODER.decode(reply.data)
        except msgspec.DecodeError:
            continue
        if answer.preempted is not None:
            log.info("preempted a run", backend=offer.backend, by=request.id, run=answer.preempted)
            return True
    return False


async def _until_settled(
    arrived: asyncio.Event, offers: list[Offer], unbeatable: Callable[[], bool]
) -> None:
    """Wait while a better offer may still come: until one that cannot be
    beaten arrived, :data:`OFFER_SETTLE` after the first, or
    :data:`OFFER_WINDOW` after the ask if none came."""
    loop = asyncio.get_running_loop()
    until = loop.time() + OFFER_WINDOW
    settled = False
    while not unbeatable():
        if offers and not settled:
            settled = True
            until = min(until, loop.time() + OFFER_SETTLE)
        left = until - loop.time()
        if left <= 0:
            return
        arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrived.wait(), left)
