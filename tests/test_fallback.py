"""Cascading fallback, end to end (issue #9): each fault class leads to its
documented outcome, the cascade keeps its order, a stream broken after tokens
restarts on another backend, coalesced calls fall back as one, and every
request ends exactly once (or is in the dead-letter stream).

Everything is real: a nats-server per test (``isolated_server``) and mock
backends on loopback with injected faults (``MockSettings.faults``, ``down``,
``context_window``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_quota_exhausted import describe, results
from test_restarts import TENANT

from renqueue import Client, Services, metrics, parse_config
from renqueue.backends.base import Delta
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config
from renqueue.errors import RequestExpiredError, RequestFailedError
from renqueue.mock import FaultSpec, MockBackend, MockSettings
from renqueue.schema import DLQ_STREAM, Completed, Event, Failed, FellBack, Retrying, Routed, Usage
from renqueue.services.worker import Worker

FAST = MockSettings(ttft=0.01, output_tokens=3)


def failing(*script: str, **settings: Any) -> MockSettings:
    """A mock whose every answer is ``script``'s fault, repeated."""
    return MockSettings(
        ttft=0.01, output_tokens=3, faults=FaultSpec(script=script, repeat=True), **settings
    )


def config_for(
    url: str,
    route: dict[str, MockBackend],
    *,
    backends: dict[str, dict[str, Any]] | None = None,
    fallback: dict[str, Any] | None = None,
    **worker: Any,
) -> Config:
    """Route ``chat`` over ``route``'s backends in order; ``backends`` adds settings per backend."""
    extra = backends or {}
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                name: {
                    "base_url": mock.url,
                    "model": "m",
                    "limits": {"concurrency": 4},
                    **extra.get(name, {}),
                }
                for name, mock in route.items()
            },
            "routes": {"chat": {"backends": list(route), "fallback": fallback or {}}},
            "router": {"capacity_refresh": "20ms"},
            "worker": {"retry_delay": "50ms", "max_retry_delay": "100ms", **worker},
        }
    )


def routed(events: list[Event]) -> list[str]:
    return [e.backend for e in events if isinstance(e, Routed)]


def fell_back(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.backend, e.error_class) for e in events if isinstance(e, FellBack)]


async def dead_letters(client: Client) -> int:
    info = await client.js.stream_info(DLQ_STREAM)
    return info.state.messages


@pytest.mark.parametrize(
    ("fault", "error_class", "calls"),
    [
        # Transient: one retry on the same backend, then down the route.
        pytest.param("500", "server_error", 2, id="500: retried once, then falls back"),
        pytest.param("reset", "connect", 2, id="connection reset: retried once, then falls back"),
        pytest.param("malformed", "malformed", 2, id="malformed stream: retried, then falls back"),
        # The backend says it cannot take it now: straight down the route.
        pytest.param("503", "overloaded", 1, id="503 overloaded: falls back at once"),
        pytest.param("529", "overloaded", 1, id="529 overloaded: falls back at once"),
        pytest.param("429_bare", "rate_limited", 1, id="429: falls back at once"),
        pytest.param("break", "broken_stream", 1, id="stream cut after tokens: falls back at once"),
        # llama-cpp-python's server cutting a stream short: a bare [DONE], no finish_reason.
        pytest.param(
            "no_finish", "broken_stream", 1, id="[DONE] without a finish_reason: falls back"
        ),
        # Tokens reach the subscriber one by one here (a token rate), then the error.
        pytest.param(
            "sse_error", "broken_stream", 1, id="error in the stream after tokens: falls back"
        ),
        # All in one read, before any token was passed on: a server error.
        pytest.param("sse_error", "server_error", 2, id="error in the stream at once: retried"),
    ],
)
async def test_a_failure_the_route_falls_back_on_is_served_by_the_next_candidate(
    isolated_server: EmbeddedServer, fault: str, error_class: str, calls: int
) -> None:
    """Before, a failing request retried only where it was bound: a route
    ["down", "local"] with "local" idle failed after 5 tries."""
    rate = 50.0 if error_class == "broken_stream" and fault == "sse_error" else 0.0
    async with (
        MockBackend(failing(fault, tokens_per_second=rate)) as bad,
        MockBackend(FAST) as good,
    ):
        config = config_for(isolated_server.url, {"bad": bad, "good": good})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat")
            await results(log, [handle], within=15)
            result = await handle.result()
            events = await log.history(TENANT, handle.id)
    assert result.backend == "good", describe(events)
    assert routed(events) == ["bad", "good"], describe(events)
    assert fell_back(events) == [("bad", error_class)], describe(events)
    [decision] = [e for e in events if isinstance(e, Routed) and e.backend == "good"]
    assert "fell back (not to bad)" in decision.reason
    assert bad.stats().faults.get(fault, 0) == calls, bad.stats().faults
    assert good.stats().completed == 1


async def test_the_cascade_keeps_its_order_and_never_goes_back_to_a_backend_that_failed(
    isolated_server: EmbeddedServer,
) -> None:
    async with (
        MockBackend(failing("500")) as first,
        MockBackend(failing("503")) as second,
        MockBackend(FAST) as third,
    ):
        config = config_for(isolated_server.url, {"first": first, "second": second, "third": third})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat")
            await results(log, [handle], within=15)
            events = await log.history(TENANT, handle.id)
    assert routed(events) == ["first", "second", "third"], describe(events)
    assert fell_back(events) == [("first", "server_error"), ("second", "overloaded")]
    [last] = [e for e in events if isinstance(e, FellBack) and e.backend == "second"]
    assert last.fallback.excluded == ("first", "second")
    assert last.fallback.count == 2
    # Attempts are the dispatches: each fallback is a new one.
    assert [e.attempt for e in events if isinstance(e, Routed)] == [1, 2, 3]


async def test_a_content_filter_fails_fast_without_a_cascade(
    isolated_server: EmbeddedServer,
) -> None:
    """A refusal of the request itself (a content filter; any plain 400) is
    not asked of another backend: the request fails at once, dead-lettered."""
    async with MockBackend(failing("content_filter")) as first, MockBackend(FAST) as second:
        config = config_for(isolated_server.url, {"first": first, "second": second})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat")
            with pytest.raises(RequestFailedError):
                await handle.result(timeout=15)
            events = await log.history(TENANT, handle.id)
            dlq = await dead_letters(client)
    [failed] = [e for e in events if isinstance(e, Failed)]
    assert failed.error_class == "content_filter"
    assert failed.error_type == "backend_bad_request"
    assert routed(events) == ["first"], describe(events)
    assert first.stats().requests == 1
    assert second.stats().requests == 0
    assert dlq == 1


async def test_a_context_too_long_goes_only_to_a_larger_window(
    isolated_server: EmbeddedServer,
) -> None:
    """A context-length 400 on a small model skips a candidate whose declared
    window is no larger and lands on one that is."""
    async with (
        MockBackend(MockSettings(ttft=0.01, output_tokens=3, context_window=20)) as small,
        MockBackend(MockSettings(ttft=0.01, output_tokens=3, context_window=20)) as same,
        MockBackend(FAST) as large,
    ):
        config = config_for(
            isolated_server.url,
            {"small": small, "same": same, "large": large},
            backends={
                "small": {"context_window": 20},
                "same": {"context_window": 20},
                "large": {"context_window": 100_000},
            },
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("word " * 200, route="chat")
            await results(log, [handle], within=15)
            events = await log.history(TENANT, handle.id)
    assert routed(events) == ["small", "large"], describe(events)
    assert fell_back(events) == [("small", "context_length")]
    [event] = [e for e in events if isinstance(e, FellBack)]
    assert event.fallback.min_context == 21
    assert same.stats().requests == 0
    assert small.stats().requests == 1  # never retried where it cannot fit


async def test_a_context_too_long_with_no_larger_window_fails_with_the_reason(
    isolated_server: EmbeddedServer,
) -> None:
    async with (
        MockBackend(MockSettings(ttft=0.01, context_window=20)) as small,
        MockBackend(MockSettings(ttft=0.01, context_window=20)) as same,
    ):
        config = config_for(
            isolated_server.url,
            {"small": small, "same": same},
            backends={"small": {"context_window": 20}, "same": {"context_window": 20}},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("word " * 200, route="chat")
            with pytest.raises(RequestFailedError) as info:
                await handle.result(timeout=15)
    assert "larger context window" in str(info.value)
    assert same.stats().requests == 0


async def test_a_stream_broken_after_tokens_restarts_on_the_next_backend_never_spliced(
    isolated_server: EmbeddedServer,
) -> None:
    """Subscribers see the first backend's tokens, then a chunk marked
    ``restart`` from the second run: the text they should keep is the second
    backend's answer alone, which is the result."""
    broken = MockSettings(
        ttft=0.01, output_tokens=8, faults=FaultSpec(script=("break",), after_tokens=3)
    )
    async with MockBackend(broken) as first, MockBackend(FAST) as second:
        config = config_for(isolated_server.url, {"first": first, "second": second})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("hello", route="chat")
            chunks = [chunk async for chunk in handle.stream(timeout=15)]
            result = await handle.result(timeout=15)
    restarts = [index for index, chunk in enumerate(chunks) if chunk.restart]
    assert len(restarts) == 1, chunks
    before, after = chunks[: restarts[0]], chunks[restarts[0] :]
    assert "".join(c.text for c in before), "the first backend's tokens reached the subscriber"
    assert "".join(c.text for c in after) == result.text
    assert result.backend == "second"
    assert {c.delivery for c in before}.isdisjoint({c.delivery for c in after})


async def test_a_stream_cut_short_with_a_bare_done_is_never_a_completed_answer(
    isolated_server: EmbeddedServer,
) -> None:
    """llama-cpp-python's server ends a running stream with a bare ``[DONE]`` and no
    ``finish_reason`` when a second call takes its one slot (docs/backends.md, "Tried
    with a real server"); the mock's ``no_finish`` does the same. Before, that was
    taken for a whole answer: ``completed`` with the three tokens that came. Now it is
    a broken stream: the request falls back, subscribers get a ``restart`` chunk, and
    it completes with the healthy backend's whole answer."""
    cut = MockSettings(
        ttft=0.01, output_tokens=8, faults=FaultSpec(script=("no_finish",), after_tokens=3)
    )
    whole = MockSettings(ttft=0.01, output_tokens=8)
    async with MockBackend(cut) as first, MockBackend(whole) as second:
        config = config_for(isolated_server.url, {"first": first, "second": second})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat")
            chunks = [chunk async for chunk in handle.stream(timeout=15)]
            result = await handle.result(timeout=15)
            events = await log.history(TENANT, handle.id)
    assert fell_back(events) == [("first", "broken_stream")], describe(events)
    [completed] = [e for e in events if isinstance(e, Completed)]
    assert completed.backend == result.backend == "second"
    assert completed.text == result.text == " ".join(f"tok{i}" for i in range(8))
    assert completed.finish_reason == "stop"
    restarts = [index for index, chunk in enumerate(chunks) if chunk.restart]
    assert len(restarts) == 1, chunks
    assert "".join(c.text for c in chunks[: restarts[0]]) == "tok0 tok1 tok2"
    assert "".join(c.text for c in chunks[restarts[0] :]) == result.text
    assert first.stats().faults == {"no_finish": 1}


async def test_a_backend_that_always_cuts_its_streams_short_fails_the_request_typed(
    isolated_server: EmbeddedServer,
) -> None:
    """With no healthy backend, a request whose every stream ends in a bare ``[DONE]``
    fails (``broken_stream``, dead-lettered): never completed with the truncated text."""
    async with MockBackend(failing("no_finish")) as only:
        config = config_for(
            isolated_server.url, {"only": only}, fallback={"attempts": 2, "retries": 0}
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat")
            with pytest.raises(RequestFailedError):
                await handle.result(timeout=15)
            events = await log.history(TENANT, handle.id)
    assert not [e for e in events if isinstance(e, Completed)], describe(events)
    [failed] = [e for e in events if isinstance(e, Failed)]
    assert failed.error_class == "broken_stream", describe(events)
    assert "stream ended with [DONE] but no finish_reason" in failed.reason
    assert only.stats().faults == {"no_finish": 2}


async def test_attempts_are_bounded_then_the_request_is_dead_lettered(
    isolated_server: EmbeddedServer,
) -> None:
    async with MockBackend(failing("500")) as first, MockBackend(failing("500")) as second:
        config = config_for(
            isolated_server.url,
            {"first": first, "second": second},
            fallback={"attempts": 2, "retries": 0},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat")
            with pytest.raises(RequestFailedError) as info:
                await handle.result(timeout=15)
            events = await log.history(TENANT, handle.id)
            dlq = await dead_letters(client)
    assert "2 attempts, the route's fallback.attempts, used on 2 backends: first, second" in str(
        info.value
    ), describe(events)
    assert routed(events) == ["first", "second"]
    assert first.stats().requests == 1
    assert second.stats().requests == 1
    assert not [e for e in events if isinstance(e, Retrying)]
    assert sum(isinstance(e, Failed) for e in events) == 1
    assert dlq == 1


async def test_a_route_with_fallback_off_retries_where_it_was_bound(
    isolated_server: EmbeddedServer,
) -> None:
    async with MockBackend(failing("500")) as first, MockBackend(FAST) as second:
        config = config_for(
            isolated_server.url,
            {"first": first, "second": second},
            fallback={"on": []},
            max_deliver=3,
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("hello", route="chat")
            with pytest.raises(RequestFailedError):
                await handle.result(timeout=15)
    assert first.stats().requests == 3
    assert second.stats().requests == 0


async def test_coalesced_requests_fall_back_as_one(isolated_server: EmbeddedServer) -> None:
    """The leader's fallback carries its followers: one call on the next
    backend answers them all, and each ends once."""
    slow_failure = MockSettings(
        ttft=0.3, output_tokens=3, faults=FaultSpec(script=("503",), repeat=True)
    )
    async with MockBackend(slow_failure) as first, MockBackend(FAST) as second:
        config = config_for(isolated_server.url, {"first": first, "second": second})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handles = [
                await client.submit("same question", route="chat", coalesce=True) for _ in range(3)
            ]
            await results(log, handles, within=15)
            texts = {(await h.result()).text for h in handles}
            histories = [await log.history(TENANT, h.id) for h in handles]
    assert len(texts) == 1
    assert second.stats().completed == 1, "one call answered every coalesced request"
    for events in histories:
        assert sum(isinstance(e, Completed) for e in events) == 1, describe(events)


async def test_a_429_without_retry_after_cools_the_backend_down_for_everyone(
    isolated_server: EmbeddedServer,
) -> None:
    """A bare 429 still says "not now": the backend is left out for a backoff
    step, so the requests right after it go straight to the next candidate."""
    async with MockBackend(failing("429_bare")) as limited, MockBackend(FAST) as good:
        config = config_for(
            isolated_server.url,
            {"limited": limited, "good": good},
            # A backoff step far longer than the five requests take, even on a
            # starved machine (2 s was outlived at load 15 on 2 cores).
            retry_delay="60s",
            max_retry_delay="120s",
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            for n in range(5):
                await results(log, [await client.submit(f"q{n}", route="chat")], within=15)
    assert limited.stats().requests == 1
    assert good.stats().completed == 5


async def test_a_request_no_other_candidate_can_take_goes_back_to_the_one_that_failed_it(
    isolated_server: EmbeddedServer,
) -> None:
    """The other candidate is below the request's complexity: after its
    backoff the request goes back to the backend that failed it once (a stream
    cut mid-way; now answering), instead of waiting forever on one that can
    never take it."""
    once = MockSettings(
        ttft=0.01,
        output_tokens=6,
        tokens_per_second=100,
        faults=FaultSpec(script=("break",), after_tokens=2),
    )
    async with MockBackend(once) as big, MockBackend(FAST) as small:
        config = config_for(
            isolated_server.url,
            {"big": big, "small": small},
            backends={"big": {"tier": 2}, "small": {"tier": 1}},
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            handle = await client.submit("hard", route="chat", complexity=2)
            await results(log, [handle], within=15)
            events = await log.history(TENANT, handle.id)
    assert routed(events) == ["big", "big"], describe(events)
    [back] = [e for e in events if isinstance(e, Routed) and e.attempt == 2]
    assert "back to big: no other candidate could take it" in back.reason
    assert small.stats().requests == 0


class CountsMore:
    """A backend whose reported usage is far above the estimate the binder used
    (a prompt of many tokens in few characters)."""

    name = "pricey"

    async def stream(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> AsyncIterator[Delta]:
        yield Delta(text="ok")
        yield Delta(usage=Usage(prompt_tokens=50_000, completion_tokens=2), finish_reason="stop")

    async def complete(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        return None


async def test_a_call_that_costs_more_than_its_cap_is_said_and_counted(
    isolated_server: EmbeddedServer,
) -> None:
    """Bound within its max_cost by the estimate, the real usage says more:
    the request completes (the call was made), the overrun is counted."""
    async with MockBackend(FAST) as unused:
        config = config_for(
            isolated_server.url,
            {"pricey": unused},
            backends={"pricey": {"cost_input_per_mtok": 1.0, "cost_output_per_mtok": 1.0}},
        )
        before = _overruns("pricey")
        async with Services(config, backends=[]) as services:
            worker = Worker(services.nc, services.js, config, "pricey", CountsMore())
            await worker.start()
            try:
                async with Client(services.nc, tenant=TENANT) as client:
                    handle = await client.submit("hi", route="chat", max_cost=0.01, max_tokens=2)
                    result = await handle.result(timeout=15)
            finally:
                await worker.close()
    assert result.cost == pytest.approx(0.050002)
    assert _overruns("pricey") == before + 1


def _overruns(backend: str) -> float:
    value = metrics.COST_CAP_OVERRUNS.labels(backend)._value.get()  # type: ignore[attr-defined]
    return float(value)


async def test_a_429_asking_for_a_year_on_a_route_of_one_expires_on_time(
    isolated_server: EmbeddedServer,
) -> None:
    """Its retry is never delayed past its deadline: it ends expired on time
    (it stayed without a terminal event long past it)."""
    settings = MockSettings(
        ttft=0.01, faults=FaultSpec(script=("429",), repeat=True, retry_after=3e7)
    )
    async with MockBackend(settings) as only:
        config = config_for(isolated_server.url, {"only": only})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("hi", route="chat", timeout=2.0)
            with pytest.raises(RequestExpiredError):
                await handle.result(timeout=15)
