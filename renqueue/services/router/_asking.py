"""The router's side of the preemption protocol (:mod:`renqueue.schema._offers`).

One ask frees at most one slot: every worker of the candidate backends is
asked for an offer, and only the best offer is confirmed; a confirm that gets
no answer ends the ask (the worker may have acted).
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
) -> bool:
    """Free one slot for ``request`` (at ``rank``) on one of ``backends``.

    ``waiting`` says whether the request still needs the slot (it may be
    bound, expired, cancelled or handed back meanwhile: then nothing is
    preempted for it). True when a run was preempted for it, or a confirm went
    unanswered (the worker may have acted): it must then never ask again.
    """
    order = {name: index for index, name in enumerate(backends)}
    offers: list[Offer] = []

    async def collect(msg: Message) -> None:
        if msg.subject != inbox:
            misdirected("offers", msg.subject)
            return
        with contextlib.suppress(msgspec.DecodeError):
            offer = OFFER_DECODER.decode(msg.data)
            if offer.backend in order:
                offers.append(offer)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    try:
        ask = encode(Ask(by=request.id, tenant=request.tenant, rank=rank))
        for backend in backends:
            await nc.publish(preempt_subject(backend), ask, reply=inbox)
        await asyncio.sleep(OFFER_WINDOW)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if not waiting():
        return False
    # Cascade order first (where the request would be routed), then the
    # least urgent run, then the most recently started (least work lost).
    offers.sort(key=lambda offer: (order[offer.backend], -offer.rank, offer.running))
    confirm = encode(Confirm(by=request.id, tenant=request.tenant, rank=rank))
    for offer in offers:
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
