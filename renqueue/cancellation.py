"""Following cancellation requests: which requests must not run, or must stop.

A client cancels by appending a ``cancel_requested`` event to the log. Routers
and workers learn of it through one :class:`CancelWatch` per process: an
ordered consumer on ``rq.evt.*.*.cancel_requested`` that starts ``horizon``
seconds back, so a process that starts (or restarts) later still knows every
recent cancellation. Each router and worker then acts where the request is:

- waiting in a router's hold, or read later from the priority subject: it is
  dropped with a ``cancelled`` event (stage ``queued``), never dispatched;
- dispatched but not started: the worker records ``cancelled`` instead of
  calling the backend;
- running: the worker stops the backend call (closing its HTTP stream) and
  records ``cancelled`` (stage ``running``).

The ``cancelled`` event is terminal and, like every terminal event, is written
only by whoever claims the request's outcome (:meth:`EventLog.finish`), so a
cancellation that races a completion leaves exactly one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from .logs import get_logger
from .messages import EVENT_DECODER, CancelRequested
from .subjects import EVENTS_STREAM

__all__ = ["CancelWatch"]

log = get_logger("cancellation")

#: Subject filter of every cancellation request.
CANCELS = "rq.evt.*.*.cancel_requested"


class CancelWatch:
    """The set of recently cancelled request ids, kept current from the log."""

    def __init__(self, js: Any, *, horizon: float = 86400.0) -> None:
        self._js = js
        self._horizon = horizon
        self._cancelled: dict[str, float] = {}
        self._listeners: list[Callable[[CancelRequested], None]] = []
        self._sub: Any = None
        self._caught_up = asyncio.Event()
        self._caught_up_to = 0

    async def start(self) -> None:
        """Subscribe, and return once every cancellation already logged is known,
        so no router or worker acts on a request before it could know."""
        try:
            last = (await self._js.get_last_msg(EVENTS_STREAM, CANCELS)).seq
        except NotFoundError:
            last = 0
        self._caught_up_to = last
        if last == 0:
            self._caught_up.set()
        since = datetime.datetime.fromtimestamp(time.time() - self._horizon, tz=datetime.UTC)
        self._sub = await self._js.subscribe(
            CANCELS,
            cb=self._on_cancel,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            config=ConsumerConfig(opt_start_time=since),
        )
        try:
            await asyncio.wait_for(self._caught_up.wait(), 10.0)
        except TimeoutError:
            log.warning("cancellations still loading after 10 s; continuing")

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def listen(self, callback: Callable[[CancelRequested], None]) -> None:
        """Call ``callback`` for each cancellation seen from now on."""
        self._listeners.append(callback)

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    async def _on_cancel(self, msg: Any) -> None:
        if msg.metadata.sequence.stream >= self._caught_up_to:
            self._caught_up.set()
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return
        if not isinstance(event, CancelRequested):
            return
        self._cancelled[event.request_id] = event.at
        self._prune(event.at)
        for callback in self._listeners:
            try:
                callback(event)
            except Exception:  # one listener must not starve the others
                log.exception("cancel listener failed", request_id=event.request_id)

    def _prune(self, now: float) -> None:
        if len(self._cancelled) > 10_000:
            horizon = now - self._horizon
            for request_id, at in list(self._cancelled.items()):
                if at < horizon:
                    del self._cancelled[request_id]
