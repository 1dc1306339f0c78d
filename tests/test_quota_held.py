"""Declared rate limits held across every process (issue #8 items 4 and 5).

Quota is reserved at the one binder (:mod:`renqueue.services.router._ledger`
over the projection's folded quota), so however many routers and workers run,
the provider never sees more than a declared limit: the strict mock answers
429 to anything over its own token bucket of the same size, and counts 0.
"""

from __future__ import annotations

import asyncio
import time

from _waits import until
from test_restarts import TENANT

from renqueue import Client, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config
from renqueue.coordination import rebuild
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import Cost, Quota, check
from renqueue.schema import Routed

#: The free tier: 4 requests per 2 seconds (a minute's limit on a compressed clock).
FREE = MockSettings(ttft=0.01, output_tokens=2, concurrency=16, rpm=4, rate_window=2.0)


def config_for(url: str, free: MockBackend, paid: MockBackend | None) -> Config:
    backends = {
        "free": {
            "base_url": free.url,
            "model": "m",
            "limits": {"concurrency": 16, "requests": ["4/2s"]},
        }
    }
    route = ["free"]
    if paid is not None:
        backends["paid"] = {"base_url": paid.url, "model": "m", "limits": {"concurrency": 16}}
        route.append("paid")
    return parse_config(
        {
            "nats": {"url": url},
            "backends": backends,
            "routes": {"chat": {"backends": route}},
            "router": {"capacity_refresh": "20ms"},
        }
    )


async def test_a_burst_three_times_the_limit_waits_and_never_trips_it(
    isolated_server: EmbeddedServer,
) -> None:
    """12 requests against 4 per 2 s, through 3 routers and 3 worker sets:
    all complete, the excess waits for the window, the mock refuses none."""
    async with MockBackend(FREE) as free:
        config = config_for(isolated_server.url, free, None)
        async with (
            Services(config, routers=3, backends=[]) as services,
            Services(config, routers=0, backends=["free"], projector=False, name="w1"),
            Services(config, routers=0, backends=["free"], projector=False, name="w2"),
            Services(config, routers=0, backends=["free"], projector=False, name="w3"),
            Client(services.nc, tenant=TENANT) as client,
        ):
            handles = [await client.submit(f"q{n}", route="chat") for n in range(12)]
            results = await asyncio.gather(*(h.result(timeout=60) for h in handles))
        assert all(result.text for result in results)
        assert free.stats().rate_limited == 0
        assert free.stats().completed == 12


async def test_traffic_moves_to_the_next_candidate_near_the_limit_and_back(
    isolated_server: EmbeddedServer,
) -> None:
    """A burst beyond the free tier's window goes on to the paid backend,
    each such decision naming the quota; once the window frees, new requests
    go to the free tier again."""
    async with MockBackend(FREE) as free, MockBackend(MockSettings(ttft=0.01)) as paid:
        config = config_for(isolated_server.url, free, paid)
        async with (
            Services(config, routers=3, backends=["free", "paid"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            burst = [await client.submit(f"q{n}", route="chat") for n in range(10)]
            await asyncio.gather(*(h.result(timeout=30) for h in burst))
            log = EventLog(services.js)
            decisions = [
                next(e for e in await log.history(TENANT, h.id) if isinstance(e, Routed))
                for h in burst
            ]
            on_free = [d for d in decisions if d.backend == "free"]
            moved = [d for d in decisions if d.backend == "paid"]
            assert 1 <= len(on_free) <= 4
            assert moved
            assert all("free quota:requests/2s" in d.reason for d in moved)
            # Once the free tier's window has room again (as the log says),
            # a new request goes to it again.
            declared = config.backends["free"].limits.declared()

            async def free_has_room() -> bool:
                quota = (await rebuild(services.js)).backend("free").quota or Quota()
                return check(quota, declared, Cost(requests=1), time.time()).ok

            await until(free_has_room, "the free tier's window has room again")
            later = await client.submit("after the window", route="chat")
            await later.result(timeout=30)
            back = next(e for e in await log.history(TENANT, later.id) if isinstance(e, Routed))
            assert back.backend == "free"
        assert free.stats().rate_limited == 0
