"""What each backend has room for, as the binder counts it.

Free slots are known from the broker: a backend's in-flight count is its
worker consumer's ``num_pending + num_ack_pending``, refreshed at most every
``router.capacity_refresh``, plus what the binder dispatched since. Workers
announce freed slots on ``rq.capacity.<backend>`` (core NATS) so the binder
wakes without polling. The worker consumer's ``max_ack_pending`` caps
concurrency at the broker in any case.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...config import Config
from ...policy import BackendView
from ...wire._nats import JetStream
from ...wire._subjects import DISPATCH_STREAM, worker_consumer

__all__ = ["Capacity"]


class Capacity:
    """Per-backend in-flight estimate: broker truth plus local dispatches since.

    The broker's word is a worker consumer's ``num_pending + num_ack_pending``,
    read at most every ``refresh`` seconds; between reads the binder adds what
    it dispatched and subtracts what workers announce as freed.
    """

    def __init__(
        self,
        js: JetStream,
        config: Config,
        refresh: float,
        *,
        health: Callable[[str], bool] = lambda _name: True,
    ) -> None:
        self._js = js
        self._health = health
        self._config = config
        self._refresh = refresh
        self._known: dict[str, int] = dict.fromkeys(config.backends, 0)
        self._since: dict[str, int] = dict.fromkeys(config.backends, 0)
        self._at: dict[str, float] = dict.fromkeys(config.backends, 0.0)

    def views(self) -> dict[str, BackendView]:
        return {
            name: BackendView(
                name=name,
                capacity=backend.limits.concurrency,
                in_flight=self._known[name] + self._since[name],
                tier=backend.tier,
                healthy=self._health(name),
            )
            for name, backend in self._config.backends.items()
        }

    def dispatched(self, backend: str) -> None:
        self._since[backend] += 1

    def freed(self, backend: str) -> None:
        """A worker announced a freed slot: believe it until the next refresh."""
        if backend in self._known:
            self._known[backend] = max(0, self._known[backend] - 1)

    async def refresh(self, backends: list[str], *, force: bool = False) -> None:
        now = time.monotonic()
        for name in backends:
            if not force and now - self._at[name] < self._refresh:
                continue
            info = await self._js.consumer_info(DISPATCH_STREAM, worker_consumer(name))
            self._known[name] = (info.num_pending or 0) + (info.num_ack_pending or 0)
            self._since[name] = 0
            self._at[name] = now
