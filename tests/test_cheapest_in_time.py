"""Cheapest in time, end to end (issue #10): the router learns each backend's
speed from the log and binds the cheapest candidate predicted to finish before
the deadline; it pays only when the free ones would miss it, and says why in
the ``routed`` event.

Everything is real: a nats-server per test and mock backends on loopback with
their own speeds.
"""

from __future__ import annotations

import asyncio
import time

from test_fallback import config_for
from test_quota_exhausted import describe, results
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import MIN_SAMPLES
from renqueue.schema import Routed

#: A free local model: first token after 0.2 s, then 20 tokens per second.
SLOW = MockSettings(ttft=0.2, tokens_per_second=20.0, output_tokens=12)
#: A paid API: instant.
FAST = MockSettings(ttft=0.01, output_tokens=12)
PAID = {"cost_input_per_mtok": 2.5, "cost_output_per_mtok": 10.0}


async def learned(services: Services, backend: str, within: float = 20.0) -> None:
    """Until the router's view of the projection has a model of ``backend``."""
    router = services.routers[0]
    give_up = time.monotonic() + within
    while True:
        projection = router.projection
        perf = None if projection is None else projection.backend(backend).perf
        if perf is not None and perf.samples >= MIN_SAMPLES:
            return
        assert time.monotonic() < give_up, f"no model of {backend} after {within} s"
        await asyncio.sleep(0.05)


async def test_a_free_slow_first_candidate_serves_what_it_can_finish_and_a_paid_one_the_rest(
    isolated_server: EmbeddedServer,
) -> None:
    """Before: a request was bound to the first candidate with room (the slow
    free one) whatever its deadline, and expired or ran late there."""
    async with MockBackend(SLOW) as slow, MockBackend(FAST) as fast:
        config = config_for(
            isolated_server.url, {"slow": slow, "fast": fast}, backends={"fast": PAID}
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            # No deadline: the cheapest with room, the free one, which learns its speed.
            for _ in range(MIN_SAMPLES):
                handle = await client.submit("hello", route="chat", max_tokens=12)
                assert (await handle.result(timeout=15)).backend == "slow"
            await learned(services, "slow")
            # ~0.75 s there: a 10 s deadline stays free, a 0.5 s one pays.
            roomy = await client.submit("hello", route="chat", max_tokens=12, timeout=10.0)
            tight = await client.submit("hello", route="chat", max_tokens=12, timeout=0.5)
            await results(log, [roomy, tight], within=15)
            roomy_events = await log.history(TENANT, roomy.id)
            tight_events = await log.history(TENANT, tight.id)
    [roomy_routed] = [e for e in roomy_events if isinstance(e, Routed)]
    [tight_routed] = [e for e in tight_events if isinstance(e, Routed)]
    assert roomy_routed.backend == "slow", describe(roomy_events)
    assert roomy_routed.reason.startswith("cheapest in time: slow predicted "), roomy_routed.reason
    assert tight_routed.backend == "fast", describe(tight_events)
    assert tight_routed.reason.startswith("cheapest in time: fast $"), tight_routed.reason
    assert "slow predicted" in tight_routed.reason
    # The numbers are in the event too, for audits of the predictions.
    assert roomy_routed.predicted is not None
    assert 0 < roomy_routed.predicted < 10
    assert roomy_routed.estimated_cost == 0
    assert tight_routed.predicted is None  # fast had no model yet
    assert tight_routed.estimated_cost > 0
    assert fast.stats().completed == 1
