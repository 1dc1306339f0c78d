"""Writing to and reading from the event log (the ``RQ_EVENTS`` stream).

Every event is published with a JetStream message id derived from the request
id, so publishing the same fact twice stores it once. All terminal events of a
request share one id (``<request_id>:terminal``): JetStream keeps the first and
reports the rest as duplicates, which is how a second completion (a worker that
was presumed dead but was not) is detected and dropped. Past the duplicate
window the same check is made by reading the request's events.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

import msgspec
from nats.js.errors import NotFoundError

from .messages import (
    EVENT_DECODER,
    Completed,
    Event,
    Retrying,
    Routed,
    Started,
    TokenChunk,
    encode,
    is_terminal,
    kind_of,
)
from .subjects import (
    EVENTS_STREAM,
    dlq_subject,
    event_subject,
    events_of_request,
    token_subject,
)

__all__ = ["EventLog", "msg_id_of"]

_MSG_ID: Final = "Nats-Msg-Id"


def msg_id_of(event: Event) -> str:
    """The JetStream message id that makes publishing ``event`` idempotent."""
    if is_terminal(event):
        return f"{event.request_id}:terminal"
    if isinstance(event, Started | Retrying):
        return f"{event.request_id}:{kind_of(event)}:{event.attempt}:{event.delivery}"
    if isinstance(event, Routed):
        return f"{event.request_id}:routed:{event.attempt}"
    return f"{event.request_id}:{kind_of(event)}"


class EventLog:
    """Appends events, terminal outcomes and dead letters; reads one request's history."""

    def __init__(self, js: Any, *, timeout: float = 5.0) -> None:
        self._js = js
        self._timeout = timeout

    def _subject(self, event: Event) -> str:
        return event_subject(event.tenant, event.request_id, kind_of(event))

    async def append(self, event: Event) -> bool:
        """Publish ``event`` and wait for the ack. False if it was a duplicate."""
        ack = await self._js.publish(
            self._subject(event),
            encode(event),
            timeout=self._timeout,
            headers={_MSG_ID: msg_id_of(event)},
        )
        return not ack.duplicate

    async def append_async(self, event: Event) -> asyncio.Future[Any]:
        """Publish ``event`` with a pipelined ack; await the returned future for it."""
        future: asyncio.Future[Any] = await self._js.publish_async(
            self._subject(event), encode(event), headers={_MSG_ID: msg_id_of(event)}
        )
        return future

    async def finish(self, event: Event, *, delivery: int = 1, seq: int = 0) -> bool:
        """Record a terminal ``event`` and close the request's token stream.

        Returns False when the request already had a terminal event: this one
        was dropped by JetStream's deduplication, and nothing else is published.
        """
        if not is_terminal(event):
            raise ValueError(f"{kind_of(event)} is not a terminal event")
        # Both at once (one round trip, not two). The final chunk has an id of
        # its own, so a duplicate terminal's final chunk is dropped as well.
        chunk = TokenChunk(request_id=event.request_id, delivery=delivery, seq=seq, final=True)
        terminal = await self.append_async(event)
        closed = await self._js.publish_async(
            token_subject(event.tenant, event.request_id),
            encode(chunk),
            headers={_MSG_ID: f"{event.request_id}:final"},
        )
        ack, _ = await asyncio.wait_for(asyncio.gather(terminal, closed), self._timeout)
        return not ack.duplicate

    async def dead_letter(
        self, stage: str, payload: bytes, *, reason: str, source_subject: str, request_id: str
    ) -> None:
        """Keep a copy of a message that cannot be processed, with why."""
        await self._js.publish(
            dlq_subject(stage),
            payload,
            timeout=self._timeout,
            headers={
                _MSG_ID: f"{request_id}:dlq:{stage}",
                "Rq-Reason": reason[:500],
                "Rq-Source-Subject": source_subject,
                "Rq-Request-Id": request_id,
            },
        )

    async def history(self, tenant: str, request_id: str) -> list[Event]:
        """All events of one request, in log order, reading only that request's subjects."""
        subject = events_of_request(tenant, request_id)
        events: list[Event] = []
        seq = 1
        while True:
            try:
                raw = await self._js.get_msg(EVENTS_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return events
            # A foreign or undecodable message on our subject is skipped.
            with contextlib.suppress(msgspec.DecodeError):
                events.append(EVENT_DECODER.decode(raw.data))
            seq = raw.seq + 1

    async def terminal_of(self, tenant: str, request_id: str) -> Event | None:
        """The request's terminal event, if it has one."""
        for event in await self.history(tenant, request_id):
            if is_terminal(event):
                return event
        return None

    @staticmethod
    def completed(events: list[Event]) -> Completed | None:
        return next((e for e in events if isinstance(e, Completed)), None)
