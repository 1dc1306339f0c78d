"""A quota-exhausted 429 sends the request that got it down the cascade (issue #8).

A provider that answers "quota exhausted" (OpenAI ``insufficient_quota``, a
daily counter at 0, a Gemini per-day quota id) will not take a call before its
reset, hours away: the worker records why (a ``retrying`` event that says the
request was put back, with what the provider said of its quota) and puts the
request back to routing; the binder, once the projection has folded that
event, binds it to the next candidate of its route, or holds it while none has
room. The exhausted backend is not called again until its reset.

Everything is real: a nats-server per test and mock backends on loopback.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from test_binder import until
from test_restarts import TENANT

from renqueue import Client, RequestHandle, Services, parse_config
from renqueue.config import Config
from renqueue.ops import EmbeddedServer
from renqueue.state import Projector
from renqueue.tools import MockBackend, MockSettings
from renqueue.wire import Completed, Event, EventLog, Failed, Retrying, Routed, kind_of

FAST = MockSettings(ttft=0.01, output_tokens=2, concurrency=8)


def config_for(url: str, route: dict[str, MockBackend], **worker: Any) -> Config:
    """The route ``chat`` over ``route``'s backends, in order."""
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                name: {"base_url": mock.url, "model": "m", "limits": {"concurrency": 4}}
                for name, mock in route.items()
            },
            "routes": {"chat": {"backends": list(route)}},
            "router": {"capacity_refresh": "20ms"},
            "worker": {"retry_delay": "100ms", "max_retry_delay": "200ms", **worker},
        }
    )


def describe(events: list[Event]) -> str:
    return ", ".join(
        kind_of(e) + (f"({e.backend})" if isinstance(e, Routed | Retrying | Completed) else "")
        for e in events
    )


async def results(log: EventLog, handles: list[RequestHandle], within: float) -> None:
    """Every request completes within ``within`` seconds; else fail with its history."""
    outcomes = await asyncio.gather(
        *(h.result(timeout=within) for h in handles), return_exceptions=True
    )
    bad = [(h, o) for h, o in zip(handles, outcomes, strict=True) if isinstance(o, BaseException)]
    if bad:
        handle, error = bad[0]
        events = await log.history(TENANT, handle.id)
        pytest.fail(f"{len(bad)} requests did not complete ({error!r}); {describe(events)}")


def spent(style: str) -> MockSettings:
    """A free tier whose quota is spent, answering in ``style``'s dialect."""
    return msgspec.convert(
        {"ttft": 0.01, "quota_exhausted": True, "limit_style": style}, MockSettings
    )


@pytest.mark.parametrize(
    ("exhausted", "until_known"),
    [
        pytest.param(
            spent("openai"), False, id="openai insufficient_quota: back when billing changes"
        ),
        pytest.param(spent("groq"), True, id="groq's daily counter at 0: back at its reset"),
        pytest.param(spent("gemini"), True, id="gemini per-day quota id: back at Pacific midnight"),
    ],
)
async def test_a_quota_exhausted_backend_sends_its_request_to_the_next_candidate(
    isolated_server: EmbeddedServer, exhausted: MockSettings, until_known: bool
) -> None:
    """The request that got the quota-exhausted 429 completes on the paid
    backend at once (not after the free tier's reset, hours away, nor failed
    after its retries); its history says why; later requests go straight to
    the paid one and the free tier is not called again."""
    async with MockBackend(exhausted) as free, MockBackend(FAST) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid})
        async with (
            Services(config) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(client.js)
            first = await client.submit("first", route="chat")
            await results(log, [first], within=10)
            later = [await client.submit(f"later {n}", route="chat") for n in range(3)]
            await results(log, later, within=10)
            events = await log.history(TENANT, first.id)
            histories = [await log.history(TENANT, h.id) for h in later]
    assert free.stats().requests == 1, "the exhausted backend was called again"
    assert paid.stats().completed == 4
    routed = [e for e in events if isinstance(e, Routed)]
    assert [(e.backend, e.attempt) for e in routed] == [("free", 1), ("paid", 2)], describe(events)
    (put_back,) = [e for e in events if isinstance(e, Retrying)]
    assert put_back.backend == "free"
    assert put_back.requeued
    assert put_back.error_type == "rate_limited"
    assert "quota exhausted" in put_back.reason
    if until_known:
        assert put_back.quota_exhausted_until is not None
        assert put_back.quota_exhausted_until > time.time() + 60
    # Until known or not, the free tier is left out for long (minutes at least).
    assert put_back.retry_after >= 60
    # The binder names what it passed over.
    assert routed[1].reason.startswith("free ")
    assert routed[1].reason.endswith("bound to paid")
    completed = [e for e in events if isinstance(e, Completed)]
    assert [e.backend for e in completed] == ["paid"]
    assert not any(isinstance(e, Failed) for e in events)
    for history in histories:
        assert [e.backend for e in history if isinstance(e, Routed)] == ["paid"], describe(history)


async def test_a_burst_on_an_exhausted_backend_moves_once_and_never_comes_back(
    isolated_server: EmbeddedServer,
) -> None:
    """A burst bound to the free tier before its first 429 was known: each of
    those requests is put back once, completes on the paid backend, and the
    free tier gets no call after the burst."""
    exhausted = MockSettings(ttft=0.05, quota_exhausted=True, limit_style="groq")
    async with MockBackend(exhausted) as free, MockBackend(FAST) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid})
        async with (
            Services(config) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(client.js)
            burst = await asyncio.gather(
                *(client.submit(f"burst {n}", route="chat") for n in range(8))
            )
            await results(log, list(burst), within=15)
            called = free.stats().requests
            after = [await client.submit(f"after {n}", route="chat") for n in range(3)]
            await results(log, after, within=10)
            histories = [await log.history(TENANT, h.id) for h in burst]
    # At most the free tier's slots were bound before its first answer came back.
    assert 1 <= called <= 4
    assert free.stats().requests == called
    for history in histories:
        backends = [e.backend for e in history if isinstance(e, Routed)]
        assert backends in (["paid"], ["free", "paid"]), describe(history)


async def test_the_binder_waits_for_the_projection_before_rebinding_a_put_back_request(
    isolated_server: EmbeddedServer,
) -> None:
    """The projection lags the log (here by up to a second: a slow projector).
    A request put back for an exhausted quota is not bound again until the
    binder's view has folded the event that says so: the free tier is called
    once, not again before the view knew."""
    exhausted = MockSettings(ttft=0.01, quota_exhausted=True, limit_style="groq")
    async with MockBackend(exhausted) as free, MockBackend(FAST) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid})
        async with (
            Services(config, projector=False) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(client.js)
            async with Projector(client.js, flush_interval=1.0):
                handle = await client.submit("once", route="chat")
                await results(log, [handle], within=10)
                events = await log.history(TENANT, handle.id)
    assert free.stats().requests == 1, describe(events)
    assert [e.backend for e in events if isinstance(e, Routed)] == ["free", "paid"]


async def test_a_request_no_candidate_has_quota_for_waits_without_looping(
    isolated_server: EmbeddedServer,
) -> None:
    """Both candidates out of credit (until unknown): the request is put back
    by each once, then waits, held; each backend is probed again only after
    ``worker.quota_hold``; once one has credit again the request completes there."""
    exhausted = MockSettings(ttft=0.01, quota_exhausted=True, limit_style="openai")
    async with MockBackend(exhausted) as free, MockBackend(exhausted) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid}, quota_hold="2s")
        async with (
            Services(config) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(client.js)
            began = time.monotonic()
            handle = await client.submit("waits", route="chat")

            async def put_back_by_both() -> bool:
                events = await log.history(TENANT, handle.id, kind="retrying")
                return {e.backend for e in events if isinstance(e, Retrying)} == {"free", "paid"}

            await until(put_back_by_both, "both backends put the request back", within=10)
            paid.update(quota_exhausted=False)
            await results(log, [handle], within=15)
            elapsed = time.monotonic() - began
            events = await log.history(TENANT, handle.id)
    calls = free.stats().requests + paid.stats().requests
    # Once per backend, then once per hold at most: no quick loop.
    assert calls <= 2 + 2 * (elapsed / 2.0 + 1), (calls, elapsed, describe(events))
    assert [e.backend for e in events if isinstance(e, Completed)] == ["paid"]
    attempts = [e.attempt for e in events if isinstance(e, Routed)]
    assert attempts == sorted(set(attempts)), describe(events)
    assert not any(isinstance(e, Failed) for e in events)
