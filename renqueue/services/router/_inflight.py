"""The router's decisions being published: each in a task of its own.

A round decides synchronously (binds, expiries, promotions, circuit and A/B
changes) and carries each decision's publishes out in a task of its own, so
a slow broker never stalls the round. :class:`Inflight` tracks those tasks
until they end: the router's stop waits for them (:meth:`Inflight.settle`),
and an error one did not handle itself is logged with its traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from ...logs import get_logger
from ...tasks import cancel_and_wait

__all__ = ["Inflight"]

log = get_logger("router")


class Inflight:
    """The tasks carrying out the router's decisions (see the module docstring)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Carry out one decision's publishes in a task of its own, tracked until it ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a decision's publish failed", exc_info=exc)

    async def settle(self, *, within: float) -> None:
        """Wait for the publishes under way, ``within`` seconds at most; cancel the rest.

        Each publish is bounded by its acks' timeout; this bounds the wait
        even if one is not. A publish cut short leaves its request unacked:
        redelivered, and its dispatch deduplicated by its message id.
        """
        if self._tasks:
            _done, pending = await asyncio.wait(self._tasks, timeout=within)
            await cancel_and_wait(pending)
