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
from collections.abc import Callable

from ... import metrics
from ...broker import EventLog, Message
from ...coordination import Coalescer, coalesce_key
from ...errors import NatsError
from ...logs import get_logger
from ...policy import DEADLINE_PASSED, cancelled_waiting, expired_waiting, rejection
from ...schema import Event, InferenceRequest

__all__ = ["Endings"]

log = get_logger("router")


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

    async def end(self, request: InferenceRequest, event: Event) -> None:
        """Record a request's terminal event; a coalescing leader's followers
        get their outcome first (so a crash in between cannot strand them)."""
        key = coalesce_key(request)
        if key is not None:
            await self._coalescer.leader_ended(request.tenant, request.id, key, event)
        await self._log.finish(event)

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
        except Exception as exc:
            log.exception("could not record rejection", request_id=request_id, error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
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
        except Exception as exc:
            log.exception("could not record rejection", request_id=request_id, error=str(exc))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
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
