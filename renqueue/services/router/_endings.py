"""How a request ends at the router: expired or cancelled while it waits, or rejected.

:class:`Endings` records a request's terminal event (built by
:func:`renqueue.policy.expired_waiting`, :func:`~renqueue.policy.cancelled_waiting`
and :func:`~renqueue.policy.rejection`, which the what-if simulator calls too)
and then acks its message. A coalescing leader's followers get their outcome
first (:meth:`Endings.end`), so a crash in between cannot strand them; a
rejected request is also dead-lettered. An ending that cannot be recorded naks the message: the
request is delivered again, and ended then.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from ... import metrics
from ...broker import DLQ_HOSTILE_EXCERPT, EventLog, Message
from ...coordination import Coalescer, coalesce_key
from ...errors import MalformedRequestError, NatsError, OutOfRangeError
from ...logs import get_logger
from ...policy import DEADLINE_PASSED, cancelled_waiting, expired_waiting, rejection
from ...schema import Event, InferenceRequest

__all__ = ["Endings"]

log = get_logger("router")

#: Rejections for the request's own content: sending it again cannot help,
#: so its dead letter keeps an excerpt (``DLQ_HOSTILE_EXCERPT`` bytes), not the body.
_OWN_CONTENT: Final = frozenset({MalformedRequestError.code, OutOfRangeError.code})

#: Requests whose endings :class:`Endings` remembers (see :meth:`Endings.ended_since`).
_ENDED_KEPT: Final = 4096


class Endings:
    """Records how requests end at this router (see the module docstring)."""

    def __init__(
        self, events: EventLog, coalescer: Coalescer, *, clock: Callable[[], float]
    ) -> None:
        self._log = events
        self._coalescer = coalescer
        self._clock = clock
        #: Requests this router rejected.
        self.rejected = 0
        #: How many endings this router has begun to record (see :meth:`mark`).
        self._ends = 0
        #: The requests ended most recently, each with its ending's number.
        self._recent: OrderedDict[tuple[str, str], int] = OrderedDict()
        #: The number of the latest ending forgotten (``_recent`` is bounded).
        self._forgotten = 0

    def mark(self) -> int:
        """A mark of the endings so far, for :meth:`ended_since`."""
        return self._ends

    def ended_since(self, tenant: str, request_id: str, mark: int) -> bool:
        """Whether this router began to record an ending of ``(tenant,
        request_id)`` after :meth:`mark` returned ``mark`` (True also when it
        cannot tell: it forgot an ending made since). A terminal claim looked
        up before ``mark`` may then be there now."""
        ended = self._recent.get((tenant, request_id))
        return (ended is not None and ended > mark) or self._forgotten > mark

    def _ending(self, tenant: str, request_id: str) -> None:
        """Note that the ending of ``(tenant, request_id)`` is about to be recorded."""
        self._ends += 1
        self._recent[(tenant, request_id)] = self._ends
        self._recent.move_to_end((tenant, request_id))
        while len(self._recent) > _ENDED_KEPT:
            _, self._forgotten = self._recent.popitem(last=False)

    async def end(self, request: InferenceRequest, event: Event) -> None:
        """Record a request's terminal event; a coalescing leader's followers
        get their outcome first (so a crash in between cannot strand them)."""
        self._ending(request.tenant, request.id)
        key = coalesce_key(request)
        if key is not None:
            await self._coalescer.leader_ended(request.tenant, request.id, key, event)
        await self._log.finish(event, stream=request.stream is not False)

    async def cancel(self, msg: Message, request: InferenceRequest) -> None:
        """End a request cancelled before it was routed."""
        event = cancelled_waiting(request, self._clock())
        metrics.TERMINAL.labels("cancelled").inc()
        try:
            await self.end(request, event)
            await msg.ack()
        except Exception:
            log.exception("could not record cancellation", request_id=request.id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    async def reject(
        self,
        msg: Message,
        request_id: str,
        tenant: str,
        error: Exception,
        *,
        request: InferenceRequest | None = None,
        unseen: bool = False,
    ) -> bool:
        """Dead-letter ``msg`` and end its request ``rejected``; False when that
        could not be recorded (``msg`` is delivered again). Given the decoded
        ``request`` (one taken before, that may lead a coalescing group), its
        followers get their outcome first, as :meth:`end` does; if that
        raises for a reason other than the broker (the request's own bug), the
        request is ended all the same and the followers are left to their
        deadlines or the advisory reader. ``unseen``: a request never admitted
        (it never ran, so it has no chunks to look up: its final chunk is the
        first)."""
        code = getattr(error, "code", "malformed")
        self._ending(tenant, request_id)
        self.rejected += 1
        metrics.REJECTED.labels(code).inc()
        metrics.TERMINAL.labels("rejected").inc()
        log.warning("request rejected", request_id=request_id, error_type=code, reason=str(error))
        try:
            # First: a rejection in the log always has its dead letter.
            await self._log.dead_letter(
                "requests",
                msg.data,
                reason=f"{code}: {error}",
                source_subject=msg.subject,
                source_seq=msg.metadata.sequence.stream,
                tenant=tenant,
                request_id=request_id,
                keep=DLQ_HOSTILE_EXCERPT if code in _OWN_CONTENT else None,
            )
            event = rejection(request_id, tenant, self._clock(), error)
            if request is None:
                # A request never admitted never ran: no chunks to look up.
                first = 1 if unseen else None
                await self._log.finish(event, delivery=first, seq=0 if unseen else None)
            else:
                try:
                    await self.end(request, event)
                except NatsError:
                    raise
                except Exception:
                    log.exception(
                        "could not hand the rejection to followers", request_id=request_id
                    )
                    await self._log.finish(event)
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - logged with its traceback there
            await _not_recorded(msg, request_id, exc)
            return False
        return True

    async def reject_copy(
        self, msg: Message, request_id: str, tenant: str, error: Exception
    ) -> bool:
        """Dead-letter ``msg``, a copy of request ``request_id`` that would be
        rejected, while that request was admitted from another message: the
        copy ends nothing (no terminal claim, no event: the request's outcome
        is its own), and its dead letter is its own (``...:rejected-<seq>``).
        False when that could not be recorded (``msg`` is delivered again)."""
        code = getattr(error, "code", "malformed")
        seq = msg.metadata.sequence.stream
        metrics.REJECTED.labels(code).inc()
        log.warning(
            "a copy of an admitted request rejected; the request is not ended by it",
            request_id=request_id,
            error_type=code,
            reason=str(error),
        )
        try:
            await self._log.dead_letter(
                "requests",
                msg.data,
                reason=(
                    f"{code}: {error} (a copy of request {request_id}, which was admitted "
                    "from another message: this copy was not run and does not end it)"
                ),
                source_subject=msg.subject,
                source_seq=seq,
                tenant=tenant,
                request_id=request_id,
                copy=f"rejected-{seq}",
            )
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - logged with its traceback there
            await _not_recorded(msg, request_id, exc)
            return False
        return True

    async def expire(
        self,
        msg: Message,
        request: InferenceRequest,
        now: float,
        *,
        reason: str = DEADLINE_PASSED,
    ) -> None:
        """End a request whose deadline passed while it waited to be routed."""
        event = expired_waiting(request, now, reason)
        metrics.TERMINAL.labels("expired").inc()
        try:
            await self.end(request, event)
            await msg.ack()
        except Exception as exc:
            log.exception("could not record expiry", request_id=request.id, error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)


async def _not_recorded(msg: Message, request_id: str, exc: Exception) -> None:
    """A rejection that could not be recorded: logged, and ``msg`` delivered
    again a second later."""
    log.exception("could not record rejection", request_id=request_id, error=str(exc))
    with contextlib.suppress(Exception):
        await msg.nak(delay=1.0)
