"""A quota-exhausted 429 sends the request that got it down the cascade (issue #8).

A provider that answers "quota exhausted" (OpenAI ``insufficient_quota``, a
daily counter at 0, a Gemini per-day quota id) will not take a call before its
reset, hours away: the worker records why (a ``retrying`` event that says the
request was put back, with what the provider said of its quota) and puts the
request back to routing; the binder reads that event when it fetches the
request again, leaves the spent backend out until the time it names (its own
pause, whatever the projection says: none running, or one that lags), and
binds the request to the next candidate of its route, or holds it while none
has room. The exhausted backend is not called again until its reset.

Everything is real: a nats-server per test and mock backends on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import msgspec
import pytest
from _waits import until
from test_binder import held
from test_restarts import TENANT

from renqueue import Client, RequestHandle, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config
from renqueue.coordination import Projector
from renqueue.errors import RequestFailedError, RequestRejectedError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DISPATCH_STREAM,
    MAX_REQUEUES,
    REQUESTS_STREAM,
    ChatMessage,
    Completed,
    Event,
    Failed,
    InferenceRequest,
    Rejected,
    Retrying,
    Routed,
    encode,
    kind_of,
)
from renqueue.schema._subjects import msg_id, request_subject, worker_consumer

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


async def test_a_lagging_projection_never_sends_a_put_back_request_to_the_spent_backend(
    isolated_server: EmbeddedServer,
) -> None:
    """The projection lags the log (here by up to a second: a slow projector).
    A request put back for an exhausted quota is not bound to that backend
    again on a view that does not know yet: the binder read why it was put
    back. The free tier is called once."""
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


@pytest.mark.parametrize(
    "style",
    [
        pytest.param("groq", id="groq's daily counter at 0: out until its reset"),
        pytest.param("openai", id="openai insufficient_quota: out for worker.quota_hold"),
    ],
)
async def test_with_no_projection_a_put_back_request_goes_to_the_idle_fallback_at_once(
    isolated_server: EmbeddedServer, style: str
) -> None:
    """Reproduces the review: routers with no projector (nothing folds the
    log, so no view ever says the free tier is out). The request put back for
    the free tier's spent quota went back to it every 10 s and never reached
    the idle paid backend (4 calls to free, 0 to paid, then expired). The
    binder reads why the request was put back and leaves the free tier out
    until then: the request completes on paid at once, and so do later ones."""
    async with MockBackend(spent(style)) as free, MockBackend(FAST) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid})
        async with (
            Services(config, projector=False) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(client.js)
            first = await client.submit("first", route="chat")
            await results(log, [first], within=5)
            later = [await client.submit(f"later {n}", route="chat") for n in range(3)]
            await results(log, later, within=5)
            events = await log.history(TENANT, first.id)
    assert free.stats().requests == 1, describe(events)
    assert paid.stats().completed == 4
    assert [e.backend for e in events if isinstance(e, Routed)] == ["free", "paid"]
    routed = [e for e in events if isinstance(e, Routed)]
    assert routed[1].reason.startswith("free quota exhausted, resets in ")


def inversion_config(url: str, free: MockBackend, paid: MockBackend) -> Config:
    """``chat`` = [free, paid]; ``paid-only`` = [paid]; paid runs one at a time."""
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                "free": {"base_url": free.url, "model": "m", "limits": {"concurrency": 4}},
                "paid": {"base_url": paid.url, "model": "m", "limits": {"concurrency": 1}},
            },
            "routes": {"chat": {"backends": ["free", "paid"]}, "paid-only": {"backends": ["paid"]}},
            "router": {"capacity_refresh": "20ms"},
            "worker": {"retry_delay": "100ms", "max_retry_delay": "200ms"},
        }
    )


async def test_a_put_back_request_keeps_its_place_before_less_urgent_work(
    isolated_server: EmbeddedServer,
) -> None:
    """Reproduces the review: while the binder waited for its view to fold why
    a request was put back, the request was left out of the round planner's
    snapshot, so less urgent work took the fallback's slots first (a priority
    inversion). Here a ``high`` request is put back by the spent free tier
    while ``normal`` requests wait for the paid backend's one slot (no paid
    worker yet), and the projection lags (its projector wrote once, and not
    again until it stops): once paid runs, the ``high`` request is bound there
    before every ``normal`` request still waiting."""
    exhausted = MockSettings(ttft=0.01, quota_exhausted=True, limit_style="groq")
    async with MockBackend(exhausted) as free, MockBackend(FAST) as paid:
        config = inversion_config(isolated_server.url, free, paid)
        async with (
            Services(config, projector=False, backends=["free"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = client.js
            log = EventLog(js)
            # It writes at its first fold, then
            # not for an hour (or until it stops).
            lagging = Projector(js, flush_interval=3600.0)
            await lagging.start()
            try:
                normal = [await client.submit(f"normal {n}", route="paid-only") for n in range(3)]
                # One is dispatched to paid (its one slot), the others are held.
                await until(lambda: _held_is(js, 2), "two normal requests wait for paid")
                urgent = await client.submit("urgent", route="chat", priority="high")

                async def put_back_and_held() -> bool:
                    retrying = await log.history(TENANT, urgent.id, kind="retrying")
                    return bool(retrying) and await _held_is(js, 3)

                await until(put_back_and_held, "the urgent request is put back and held again")
                async with Services(config, routers=0, backends=["paid"], projector=False):
                    await results(log, normal, within=10)
                    await lagging.close()  # its last write: the projection knows now
                    await results(log, [urgent], within=10)
            finally:
                await lagging.close()
            histories = {h.id: await log.history(TENANT, h.id) for h in [urgent, *normal]}
    assert free.stats().requests == 1
    bound = {
        request: next(e.at for e in events if isinstance(e, Routed) and e.backend == "paid")
        for request, events in histories.items()
    }
    waited = sorted(bound[h.id] for h in normal)[1:]  # the two held before paid ran
    assert all(bound[urgent.id] < at for at in waited), describe(histories[urgent.id])


async def _held_is(js: Any, count: int) -> bool:
    return await held(js) == count


async def test_a_request_put_back_the_most_times_fails_with_its_reason(
    isolated_server: EmbeddedServer,
) -> None:
    """Reproduces the review: a request already put back 1000 times (the most
    ``requeues`` may say) whose backend's quota is spent was put back once
    more, as a copy admission rejects: it ended ``rejected`` as ``malformed``.
    It fails instead, saying why."""
    exhausted = MockSettings(ttft=0.01, quota_exhausted=True, limit_style="groq")
    async with MockBackend(exhausted) as free, MockBackend(FAST) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid})
        async with (
            Services(config) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            # As a worker puts a request back for the 1000th time.
            request = InferenceRequest(
                id="often",
                tenant=TENANT,
                route="chat",
                messages=[ChatMessage(role="user", content="again")],
                requeues=MAX_REQUEUES,
            )
            await services.js.publish(
                request_subject("normal", TENANT, requeue=True),
                encode(request),
                headers={"Nats-Msg-Id": msg_id(TENANT, "often", "requeue", MAX_REQUEUES)},
            )
            with pytest.raises(RequestFailedError) as failed:
                await client.handle("often").result(timeout=10)
            events = await EventLog(client.js).history(TENANT, "often")
    assert not isinstance(failed.value, RequestRejectedError), describe(events)
    assert failed.value.error_type == "quota_exhausted"
    (end,) = [e for e in events if isinstance(e, Failed)]
    assert f"put back {MAX_REQUEUES} times" in end.reason
    assert "quota exhausted" in end.reason
    assert end.backend == "free"
    assert end.quota_exhausted_until is not None
    assert not any(isinstance(e, Rejected) for e in events)
    assert free.stats().requests == 1
    assert paid.stats().requests == 0


async def test_a_failed_put_back_is_handed_back_not_counted_as_a_failed_run(
    isolated_server: EmbeddedServer,
) -> None:
    """Reproduces the review: when the copy of a request put back for a spent
    quota could not be published, the worker treated that as a failed run:
    a second ``retrying`` event for the same attempt (using its budget, and
    hiding the ``requeued`` one from the binder, which read only the last).
    Here the requests stream refuses the copy (its size limit lowered) until
    the dispatch was handed back at least once: the dispatch is redelivered
    and put back again, with one ``retrying`` event, and the request
    completes on the paid backend."""
    exhausted = MockSettings(ttft=0.01, quota_exhausted=True, limit_style="groq")
    async with MockBackend(exhausted) as free, MockBackend(FAST) as paid:
        config = config_for(isolated_server.url, {"free": free, "paid": paid})
        async with (
            Services(config, backends=["paid"]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            log = EventLog(js)
            info = await js.stream_info(REQUESTS_STREAM)
            handle = await client.submit("refused once", route="chat")

            async def bound_to_free() -> bool:
                return bool(await log.history(TENANT, handle.id, kind="routed"))

            # No worker of the free tier yet: its dispatch waits for one.
            await until(bound_to_free, "the request is bound to the free tier")
            # Nothing more fits the requests stream: the put-back copy is refused.
            await js.context.update_stream(dataclasses.replace(info.config, max_msg_size=16))
            # (Not provisioning: that would put the stream's size limit back.)
            async with Services(
                config, routers=0, backends=["free"], projector=False, provision_streams=False
            ):

                async def handed_back() -> bool:
                    consumer = await js.consumer_info(DISPATCH_STREAM, worker_consumer("free"))
                    return consumer.num_redelivered >= 1

                await until(handed_back, "the dispatch is handed back")
                await js.context.update_stream(info.config)
                await results(log, [handle], within=10)
            events = await log.history(TENANT, handle.id)
    retrying = [e for e in events if isinstance(e, Retrying)]
    assert len(retrying) == 1, describe(events)
    assert retrying[0].requeued
    assert [e.backend for e in events if isinstance(e, Routed)] == ["free", "paid"]
    assert free.stats().requests == 1
