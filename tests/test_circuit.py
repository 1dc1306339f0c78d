"""Circuit breakers and waiting out outages, end to end (issue #9 items 4 and 6).

A backend's circuit opens on backend faults (a streak, or an error rate),
the binder then skips it; after the cool-off one call, the probe, decides;
an active health probe opens and closes it for a local server. When every
candidate is down, requests wait within their deadline and are routed as
soon as one recovers; one that cannot make its deadline ends ``expired``.

Everything is real: a nats-server per test and mock backends on loopback.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _loopback import serve
from _waits import until
from aiohttp import web
from test_fallback import FAST, config_for, failing, routed
from test_quota_exhausted import describe, results
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import parse_config
from renqueue.errors import RequestExpiredError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import SYSTEM_TENANT, CircuitChanged, FellBack, Probed, Routed, is_terminal


async def circuit_events(log: EventLog, backend: str) -> list[CircuitChanged]:
    return [e for e in await log.history(SYSTEM_TENANT, backend) if isinstance(e, CircuitChanged)]


def states(events: list[CircuitChanged]) -> list[str]:
    return [e.state for e in events]


async def test_a_circuit_opens_skips_the_backend_then_one_probe_call_closes_it(
    isolated_server: EmbeddedServer,
) -> None:
    circuit: dict[str, Any] = {"failures": 3, "cooloff": "1s"}
    async with MockBackend(failing("500")) as flaky, MockBackend(FAST) as steady:
        config = config_for(
            isolated_server.url,
            {"flaky": flaky, "steady": steady},
            backends={"flaky": {"circuit": circuit}},
            fallback={"retries": 0},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            # Each request fails once on flaky and falls back: three faults open it.
            for n in range(3):
                await results(log, [await client.submit(f"first {n}", route="chat")], within=15)

            async def opened() -> bool:
                return "open" in states(await circuit_events(log, "flaky"))

            await until(opened, "the circuit of flaky opened")
            calls = flaky.stats().requests
            skipped = [await client.submit(f"while open {n}", route="chat") for n in range(3)]
            await results(log, skipped, within=15)
            assert flaky.stats().requests == calls, "an open circuit's backend was called"
            for handle in skipped:
                assert routed(await log.history(TENANT, handle.id)) == ["steady"]
            # It recovers; after the cool-off the next request is its probe.
            flaky.update(faults={})

            async def closed() -> bool:
                handle = await client.submit("probe?", route="chat")
                await results(log, [handle], within=15)
                return states(await circuit_events(log, "flaky"))[-1:] == ["closed"]

            await until(closed, "the circuit of flaky closed again", within=20)
            events = await circuit_events(log, "flaky")
    assert states(events) == ["open", "half_open", "closed"], [e.reason for e in events]
    assert "3 backend faults in a row" in events[0].reason
    assert events[2].reason == "the probe call completed"


async def test_a_failed_probe_call_opens_it_again_and_costs_its_request_no_attempt(
    isolated_server: EmbeddedServer,
) -> None:
    circuit: dict[str, Any] = {"failures": 1, "cooloff": "300ms"}
    async with MockBackend(failing("500")) as flaky, MockBackend(FAST) as steady:
        config = config_for(
            isolated_server.url,
            {"flaky": flaky, "steady": steady},
            backends={"flaky": {"circuit": circuit}},
            fallback={"retries": 0, "attempts": 2},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handles = []

            async def reopened() -> bool:
                handle = await client.submit("go", route="chat")
                handles.append(handle)
                await results(log, [handle], within=15)
                return states(await circuit_events(log, "flaky")).count("open") >= 2

            await until(reopened, "the circuit opened, went half-open and opened again")
            events = await circuit_events(log, "flaky")
            histories = [await log.history(TENANT, h.id) for h in handles]
    assert states(events)[:3] == ["open", "half_open", "open"]
    assert events[2].reason == "the probe call failed"
    probes = [
        history
        for history in histories
        if any(isinstance(e, FellBack) and e.probe for e in history)
    ]
    assert probes, "a request was the half-open circuit's probe"
    for history in probes:
        [probe] = [e for e in history if isinstance(e, FellBack) and e.probe]
        assert probe.fallback.count == 0, "the probe's failure used one of its attempts"
        [decision] = [e for e in history if isinstance(e, Routed) and e.backend == "flaky"]
        assert "probe of flaky's half-open circuit" in decision.reason
        # With attempts = 2 it could still fall back once more: it completed.
        assert routed(history)[-1] == "steady", describe(history)


async def test_requests_wait_through_a_full_outage_and_complete_after_recovery(
    isolated_server: EmbeddedServer,
) -> None:
    """The only backend goes down: requests neither fail nor use up their
    attempts while its circuit is open; they are routed once it is back."""
    circuit: dict[str, Any] = {"failures": 2, "cooloff": "500ms"}
    async with MockBackend(MockSettings(ttft=0.01, output_tokens=2, down=True)) as only:
        config = config_for(
            isolated_server.url,
            {"only": only},
            backends={"only": {"circuit": circuit}},
            fallback={"attempts": 3, "retries": 0},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handles = [
                await client.submit(f"during the outage {n}", route="chat", timeout=60)
                for n in range(5)
            ]

            async def opened() -> bool:
                return "open" in states(await circuit_events(log, "only"))

            await until(opened, "the circuit opened")

            async def probed_twice() -> bool:
                return states(await circuit_events(log, "only")).count("half_open") >= 2

            # Through two cool-offs and probe calls that fail: still waiting.
            await until(probed_twice, "two probes failed")
            for handle in handles:
                assert not any(is_terminal(e) for e in await log.history(TENANT, handle.id))
            only.update(down=False)
            await results(log, handles, within=30)
            half_opens = states(await circuit_events(log, "only")).count("half_open")
    assert half_opens >= 2
    assert only.stats().completed == 5


async def test_a_request_that_cannot_make_its_deadline_while_every_candidate_is_open_expires(
    isolated_server: EmbeddedServer,
) -> None:
    circuit: dict[str, Any] = {"failures": 1, "cooloff": "60s"}
    async with MockBackend(MockSettings(ttft=0.01, down=True)) as only:
        config = config_for(
            isolated_server.url,
            {"only": only},
            backends={"only": {"circuit": circuit}},
            fallback={"retries": 0},
            retry_delay="500ms",
            max_retry_delay="1s",
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("soon", route="chat", timeout=3)
            with pytest.raises(RequestExpiredError) as info:
                await handle.result(timeout=15)
            events = await log.history(TENANT, handle.id)
    assert "every candidate is down (circuit open: only)" in str(info.value), describe(events)
    assert len([e for e in events if isinstance(e, Routed)]) == 1


async def test_an_active_probe_opens_the_circuit_before_any_request_fails_and_closes_it(
    isolated_server: EmbeddedServer,
) -> None:
    """A local server with a health probe: it goes down, the probe says so
    (a ``probed`` event), the circuit opens, and requests go elsewhere
    without one failing there; it comes back, the probe says so, and it is
    used again at once (no cool-off, no probe call)."""
    probe: dict[str, Any] = {"path": "/health", "interval": "100ms", "timeout": "500ms"}
    async with MockBackend(FAST) as local, MockBackend(FAST) as cloud:
        config = config_for(
            isolated_server.url,
            {"local": local, "cloud": cloud},
            backends={"local": {"probe": probe, "circuit": {"cooloff": "60s"}}},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)

            async def probe_says(ok: bool) -> bool:
                events = await log.history(SYSTEM_TENANT, "local")
                answers = [e.ok for e in events if isinstance(e, Probed)]
                return bool(answers) and answers[-1] is ok

            await until(lambda: probe_says(True), "the probe found local up")
            local.update(down=True)
            await until(lambda: probe_says(False), "the probe found local down")

            async def opened() -> bool:
                return states(await circuit_events(log, "local"))[-1:] == ["open"]

            # The binder judges circuits every round, and at least every second.
            await until(opened, "the circuit of local opened")
            handle = await client.submit("while local is down", route="chat")
            await results(log, [handle], within=15)
            while_down = await log.history(TENANT, handle.id)
            local.update(down=False)
            await until(lambda: probe_says(True), "the probe found local up again")

            async def back() -> bool:
                handle = await client.submit("again", route="chat")
                await results(log, [handle], within=15)
                return routed(await log.history(TENANT, handle.id)) == ["local"]

            await until(back, "a request went to local again")
            events = await circuit_events(log, "local")
    assert routed(while_down) == ["cloud"], describe(while_down)
    assert local.stats().faults.get("down", 0) >= 1
    assert states(events)[-2:] == ["open", "closed"], [e.reason for e in events]
    assert events[-2].reason == "the health probe failed"
    assert events[-1].reason == "the health probe succeeded"


async def test_a_health_probe_carries_the_key_as_its_backends_format_does(
    isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Anthropic backend's probe sends ``x-api-key`` (and its version
    header), never a Bearer token the server would not read."""
    monkeypatch.setenv("PROBE_TEST_KEY", "sk-ant-probe-secret")
    seen: asyncio.Queue[dict[str, str]] = asyncio.Queue()

    async def health(request: web.Request) -> web.Response:
        seen.put_nowait(dict(request.headers))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    async with serve(app) as origin:
        config = parse_config(
            {
                "nats": {"url": isolated_server.url},
                "backends": {
                    "claude": {
                        "adapter": "anthropic",
                        "base_url": f"{origin}/v1",
                        "model": "m",
                        "api_key_env": "PROBE_TEST_KEY",
                        "probe": {"path": "/health", "interval": "100ms"},
                    }
                },
                "routes": {"chat": {"backends": ["claude"]}},
            }
        )
        async with Services(config):
            headers = await asyncio.wait_for(seen.get(), timeout=15)
    lowered = {k.lower(): v for k, v in headers.items()}
    assert lowered.get("x-api-key") == "sk-ant-probe-secret"
    assert "authorization" not in lowered
    assert lowered.get("anthropic-version")
