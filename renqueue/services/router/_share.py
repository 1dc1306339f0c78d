"""A router's share of the binding groups, when binding is split in groups.

Each binding group has a lease of its own (``binder.<group>``, see
docs/scaling.md) and any router may hold several, one term each. So that the
terms spread over the processes, a router seeks a lease only while it holds
fewer than ``ceil(groups / routers)``, and gives one up (the newest term) while
it holds more. Routers are counted by a heartbeat key each in the leases'
bucket (``routers.<id>``, written every ``ttl / 5`` and expired by the server
``ttl`` after the last write, as a lease is): a router that died stops
counting within ``ttl``, and the others' share grows to take its groups; a
router stopped gracefully takes its heartbeat away first (:meth:`Share.leave`),
so the others' share grows at their next count (within ``ttl / 5``); so does
a router one of whose terms gave its lease up for failing, while it sits the
race out (a healthy router takes the group meanwhile, as unsplit).

A router that cannot count (the bucket does not answer) counts itself alone,
so it may seek every group: a group left without a binder is worse than two
groups in one process.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Final

from ...broker import JetStream, JetStreamApi, reply_error
from ...logs import get_logger
from ...schema import LEASE_BUCKET

__all__ = ["HEARTBEAT_PREFIX", "Share"]

log = get_logger("router")

#: The heartbeat keys' prefix in the leases' bucket: ``routers.<id>``.
HEARTBEAT_PREFIX: Final = "routers"


class Share:
    """How many groups' leases this router may hold (see the module docstring).

    ``held``: for each group's term, whether this router holds its lease and
    since which term (``None``: not held); ``give_up``: hand group ``index``'s
    lease back.
    """

    def __init__(
        self,
        js: JetStream,
        *,
        groups: int,
        ttl: float,
        held: Callable[[], Sequence[int | None]],
        failing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._js = js
        self._groups = groups
        self._ttl = ttl
        self._held = held
        self._failing = failing
        self.key = f"{HEARTBEAT_PREFIX}.{uuid.uuid4().hex}"
        #: The routers counted by their heartbeats (this one included).
        self.routers = 1

    @property
    def limit(self) -> int:
        """The most leases this router may hold now."""
        return math.ceil(self._groups / max(1, self.routers))

    def holding(self) -> int:
        return sum(term is not None for term in self._held())

    def may_seek(self) -> bool:
        """Whether this router may seek one more lease."""
        return self.holding() < self.limit

    def surplus(self) -> int | None:
        """The group whose lease to give up (the newest term), if it holds too many."""
        held = [(term, index) for index, term in enumerate(self._held()) if term is not None]
        if len(held) <= self.limit:
            return None
        return max(held)[1]

    async def beat(self) -> None:
        """Write this router's heartbeat, then count the routers. A router one
        of whose terms gave its lease up for failing (and sits the race out)
        takes its heartbeat away instead: counted, it would keep the others
        to their share, and its group without a binder until it is back."""
        if self._failing():
            await self.leave()
        else:
            kv = await self._js.key_value(LEASE_BUCKET)
            await kv.put(self.key, b"")
        api = JetStreamApi(self._js)
        reply = await api.call(
            f"STREAM.INFO.KV_{LEASE_BUCKET}",
            {"subjects_filter": f"$KV.{LEASE_BUCKET}.{HEARTBEAT_PREFIX}.>"},
        )
        error = reply_error(reply)
        if error is not None:
            log.warning("could not count the routers", error=error[1])
            self.routers = 1
            return
        subjects = (reply.get("state") or {}).get("subjects") or {}
        self.routers = max(1, len(subjects))

    async def leave(self) -> None:
        """Take this router's heartbeat away (a graceful stop): the others'
        share grows at their next count, not ``ttl`` later when it would have
        expired. Purged, not deleted: a delete marker is a message, and would
        still be counted."""
        reply = await JetStreamApi(self._js).call(
            f"STREAM.PURGE.KV_{LEASE_BUCKET}", {"filter": f"$KV.{LEASE_BUCKET}.{self.key}"}
        )
        error = reply_error(reply)
        if error is not None:
            log.warning("could not take the router's heartbeat away", error=error[1])

    async def loop(self, give_up: Callable[[int], object]) -> None:
        """Beat every ``ttl / 5``; give the newest term up while holding too many."""
        while True:
            await self.beat()
            surplus = self.surplus()
            if surplus is not None:
                result = give_up(surplus)
                if asyncio.iscoroutine(result):
                    await result
            await asyncio.sleep(self._ttl / 5)
