"""The OpenAI chat-completions adapter, against real HTTP servers on loopback.

Well-behaved traffic goes to the project's MockBackend; broken servers (bad
streams, odd statuses) are tiny aiohttp apps below, one handler per scenario.
"""

from __future__ import annotations

import asyncio
import socket
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from _loopback import serve
from aiohttp import web

from renqueue.backends import LearnedLimits, make_backend
from renqueue.backends._aiohttp import AiohttpTransport
from renqueue.backends.base import Backend, Delta
from renqueue.backends.openai import OpenAIBackend
from renqueue.config import BackendConfig
from renqueue.errors import (
    BackendError,
    BadRequestError,
    ConfigError,
    FailureClass,
    FatalBackendError,
    RateLimitedError,
    RetryableBackendError,
)
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import MESSAGE_OVERHEAD_TOKENS, REPLY_OVERHEAD_TOKENS, estimate_input_tokens
from renqueue.schema import ChatMessage, GenerationParams, InferenceRequest, Usage

KEY = "sk-test-SECRET123"
KEY_ENV = "RQ_TEST_OPENAI_KEY"


def make_request(content: str = "12345678", **params: object) -> InferenceRequest:
    return InferenceRequest(
        id="req-1",
        route="chat",
        messages=[ChatMessage(role="user", content=content)],
        params=GenerationParams(**params),  # type: ignore[arg-type]
    )


def config_for(url: str, **fields: object) -> BackendConfig:
    return BackendConfig(base_url=url, model="m", api_key_env=KEY_ENV, **fields)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(output_tokens=4, require_api_key=KEY)) as server:
        yield server


@pytest.fixture
async def backend(mock: MockBackend) -> AsyncIterator[OpenAIBackend]:
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        yield adapter


async def collect(backend: Backend, request: InferenceRequest) -> list[Delta]:
    return [delta async for delta in backend.stream(request)]


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` for up to 2 s (server-side counters have no event to wait on)."""
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


def assert_secret_free(exc: BaseException, backend: OpenAIBackend) -> None:
    rendered = "".join(traceback.format_exception(exc))
    for text in (str(exc), repr(exc), rendered, repr(backend)):
        assert "SECRET123" not in text


# ------------------------------------------------------------------ happy paths


async def test_stream_yields_text_deltas_then_usage_and_finish_reason(
    backend: OpenAIBackend,
) -> None:
    deltas = await collect(backend, make_request())
    assert "".join(d.text for d in deltas) == "tok0 tok1 tok2 tok3"
    assert [d.usage for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1] == Delta(
        usage=Usage(prompt_tokens=2, completion_tokens=4), finish_reason="stop", end=True
    )


async def test_complete_returns_whole_answer(backend: OpenAIBackend) -> None:
    generation = await backend.complete(make_request(max_tokens=2))
    assert generation.text == "tok0 tok1"
    assert generation.usage == Usage(prompt_tokens=2, completion_tokens=2)
    assert generation.finish_reason == "length"


async def test_params_model_and_stream_options_reach_the_backend(
    mock: MockBackend, backend: OpenAIBackend
) -> None:
    request = make_request(max_tokens=3, temperature=0.2, top_p=0.9, stop=["\n"], seed=11)
    await collect(backend, request)
    sent = mock.stats().last_request
    assert sent["model"] == "m"
    assert sent["messages"] == [{"role": "user", "content": "12345678"}]
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"]) == (3, 0.2, 0.9)
    assert (sent["stop"], sent["seed"]) == (["\n"], 11)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert "priority" not in sent
    await backend.complete(make_request(), priority=0)
    sent = mock.stats().last_request
    assert "stream" not in sent
    assert "max_tokens" not in sent  # unset params are left to the backend
    assert "priority" not in sent  # not sent unless asked for


async def test_priority_sent_only_with_send_priority(mock: MockBackend) -> None:
    async with OpenAIBackend("vllm", config_for(mock.url), send_priority=True) as adapter:
        await adapter.complete(make_request(), priority=3)
        assert mock.stats().last_request["priority"] == 3
        await adapter.complete(make_request())
        assert "priority" not in mock.stats().last_request


async def test_rate_limit_headers_are_exposed(mock: MockBackend) -> None:
    mock.update(rpm=10, tpm=1000)
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        assert adapter.last_rate_limit is None
        await collect(adapter, make_request())
        info = adapter.last_rate_limit
    assert isinstance(info, LearnedLimits)
    requests, tokens = info.find("requests"), info.find("tokens")
    assert requests is not None
    assert tokens is not None
    assert (requests.window, requests.limit, requests.remaining) == (60, 10, 9)
    assert (tokens.window, tokens.limit, tokens.remaining) == (60, 1000, 994)
    assert requests.reset_at is not None
    assert 0 < requests.reset_at - info.at <= 6.1


# --------------------------------------------------------------- error mapping


async def test_429_maps_to_rate_limited_with_retry_after(mock: MockBackend) -> None:
    mock.update(rpm=1)
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        await adapter.complete(make_request())
        with pytest.raises(RateLimitedError) as caught:
            await collect(adapter, make_request())
        info = adapter.last_rate_limit
    error = caught.value
    assert error.retry_after is not None
    assert 59 < error.retry_after <= 60  # from retry-after-ms
    assert error.status == 429
    assert error.backend == "mock"
    assert error.request_id == "req-1"
    assert "Rate limit reached" in str(error)
    assert info is not None
    requests = info.find("requests")
    assert requests is not None
    assert requests.remaining == 0  # the 429's headers are recorded too
    assert not error.quota_exhausted


async def test_injected_500_is_retryable_with_provider_message(mock: MockBackend) -> None:
    mock.update(failure_rate=1.0)
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        with pytest.raises(RetryableBackendError) as caught:
            await adapter.complete(make_request())
    assert caught.value.status == 500
    assert "injected failure" in str(caught.value)


async def test_unknown_model_is_fatal(mock: MockBackend) -> None:
    mock.update(models=("other",))
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        with pytest.raises(FatalBackendError) as caught:
            await collect(adapter, make_request())
    assert caught.value.status == 404
    assert "does not exist" in str(caught.value)


async def test_busy_503_is_retryable(mock: MockBackend) -> None:
    mock.update(concurrency=1, busy_status=503, ttft=0.3)
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        slow = asyncio.create_task(adapter.complete(make_request()))
        await until(lambda: mock.stats().in_flight > 0)
        with pytest.raises(RetryableBackendError) as caught:
            await adapter.complete(make_request())
        await slow
    assert caught.value.status == 503


async def test_wrong_key_is_fatal_and_the_key_never_shows(mock: MockBackend) -> None:
    # The mock wants another key and echoes back the one it got, as some
    # providers do: the adapter must scrub it from the error.
    mock.update(require_api_key="sk-other")
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        with pytest.raises(FatalBackendError) as caught:
            await adapter.complete(make_request())
        assert caught.value.status == 401
        assert "Incorrect API key provided: [redacted]" in str(caught.value)
        assert_secret_free(caught.value, adapter)
        assert "SECRET123" not in repr(adapter._stream_headers)


async def test_connection_refused_is_retryable_and_secret_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with OpenAIBackend("gone", config_for(f"http://127.0.0.1:{port}/v1")) as adapter:
        with pytest.raises(RetryableBackendError) as caught:
            await collect(adapter, make_request())
        assert isinstance(caught.value.__cause__, httpx.ConnectError)
        assert_secret_free(caught.value, adapter)


async def test_read_timeout_is_retryable(mock: MockBackend) -> None:
    mock.update(ttft=0.3)
    async with OpenAIBackend("mock", config_for(mock.url, timeout="100ms")) as adapter:
        with pytest.raises(RetryableBackendError) as caught:
            await adapter.complete(make_request())
    assert "ReadTimeout" in str(caught.value)


async def test_closing_the_stream_early_stops_the_backend(mock: MockBackend) -> None:
    mock.update(output_tokens=500, tokens_per_second=100)
    async with OpenAIBackend("mock", config_for(mock.url)) as adapter:
        stream = adapter.stream(make_request())
        first = await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        await until(lambda: mock.stats().disconnects > 0)
    stats = mock.stats()
    assert first.text == "tok0"
    assert stats.disconnects == 1
    assert stats.tokens_out < 50


# ------------------------------------------------------ broken/odd servers

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CHUNK = 'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n'
#: The last chunk every OpenAI-compatible server sends before ``[DONE]`` when an answer is whole.
FINISH = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'


async def sse(request: web.Request, body: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(body.encode())
    return response


async def odd_stream(request: web.Request) -> web.StreamResponse:
    """Comments, event/id lines, \\r\\n endings, a usage-only chunk with empty choices."""
    return await sse(
        request,
        ": keep-alive\n\n"
        "event: message\r\nid: 1\r\n"
        + CHUNK.replace("\n\n", "\r\n\r\n") % "Hel"
        + "\n\n"
        + CHUNK % "lo"
        + 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
        + 'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
        + "data: [DONE]",  # no trailing blank line
    )


async def cr_only(request: web.Request) -> web.StreamResponse:
    """Old-Mac line endings (CR alone), which a split on LF would never end."""
    body = CHUNK % "Hel" + CHUNK % "lo" + FINISH + "data: [DONE]\n\n"
    return await sse(request, body.replace("\n", "\r"))


async def error_type_event(request: web.Request) -> web.StreamResponse:
    body = CHUNK % "x" + 'event: error\ndata: {"error": {"message": "overloaded"}}\n\n'
    return await sse(request, body)


async def huge_line(request: web.Request) -> web.StreamResponse:
    # One line over the parser's 4 MiB bound, in many writes, never ended.
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write((CHUNK % "x").encode() + b"data: ")
    for _ in range(65):
        await response.write(b"y" * 65536)
    return response


async def unterminated_chunk(request: web.Request) -> web.StreamResponse:
    # The last event has no blank line and there is no [DONE]: dropped (spec).
    return await sse(request, CHUNK % "a" + CHUNK.rstrip("\n") % "b")


async def burst(request: web.Request) -> web.StreamResponse:
    """Five token events, in one write: one network read on the other side."""
    return await sse(request, "".join(CHUNK % t for t in "abcde") + FINISH + "data: [DONE]\n\n")


async def no_usage(request: web.Request) -> web.StreamResponse:
    body = CHUNK % "a" + CHUNK % "b" + CHUNK % "c" + FINISH + "data: [DONE]\n\n"
    return await sse(request, body)


async def done_without_finish(request: web.Request) -> web.StreamResponse:
    """llama-cpp-python's server cutting a stream short (a second call took its one
    slot): tokens, then a bare ``[DONE]``; no chunk carries a ``finish_reason``."""
    return await sse(request, CHUNK % "Once" + CHUNK % " upon" + "data: [DONE]\n\n")


async def empty_done(request: web.Request) -> web.StreamResponse:
    """The same, cut before its first token: the role chunk, then ``[DONE]``."""
    role = 'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n'
    return await sse(request, role + "data: [DONE]\n\n")


async def truncated(request: web.Request) -> web.StreamResponse:
    return await sse(request, CHUNK % "partial")


async def garbage(request: web.Request) -> web.StreamResponse:
    return await sse(request, CHUNK % "x" + "data: {not json\n\n" + "data: [DONE]\n\n")


async def error_event(request: web.Request) -> web.StreamResponse:
    body = CHUNK % "x" + 'data: {"error": {"message": "model crashed"}}\n\n'
    return await sse(request, body)


async def dropped(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write((CHUNK % "x").encode())
    assert request.transport is not None
    request.transport.abort()  # mid chunked body: the client sees a protocol error
    return response


async def json_to_stream(request: web.Request) -> web.StreamResponse:
    return web.json_response(
        {
            "choices": [{"message": {"content": "whole"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        }
    )


def status(code: int, body: str | dict[str, object], **headers: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        if isinstance(body, dict):
            return web.json_response(body, status=code, headers=headers)
        return web.Response(text=body, status=code, headers=headers)

    return handler


def openai_error(message: str) -> dict[str, object]:
    return {"error": {"message": message, "type": "x", "code": None}}


# Computed at import: an hour ahead, so the wait it implies stays far above the
# lower bound below however long the suite takes to reach the test.
HTTP_DATE = format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)


async def empty_finish_done(request: web.Request) -> web.StreamResponse:
    """Tokens whose ``finish_reason`` is ``""`` (not ``null``), then a bare ``[DONE]``:
    an empty finish reason is none."""
    chunk = 'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":""}]}\n\n'
    return await sse(request, chunk % "Once" + chunk % " upon" + "data: [DONE]\n\n")


SCENARIOS: dict[str, Handler] = {
    "odd": odd_stream,
    "cr-only": cr_only,
    "burst": burst,
    "error-type": error_type_event,
    "huge-line": huge_line,
    "unterminated": unterminated_chunk,
    "no-usage": no_usage,
    "done-without-finish": done_without_finish,
    "empty-done": empty_done,
    "empty-finish-done": empty_finish_done,
    "truncated": truncated,
    "garbage": garbage,
    "error-event": error_event,
    "dropped": dropped,
    "json": json_to_stream,
    "401": status(401, openai_error("bad key")),
    "403": status(403, openai_error("forbidden region")),
    "404": status(404, {"error": "model 'm' not found"}),  # Ollama's shape
    "400": status(400, openai_error("max_tokens too large")),
    "413": status(413, "payload too large"),
    "422": status(422, {"object": "error", "message": "bad field"}),  # vLLM's shape
    "408": status(408, "timeout"),
    "409": status(409, "conflict"),
    "502": status(502, "<html>bad gateway</html>"),
    "503": status(503, openai_error("overloaded " * 100)),
    "402": status(402, openai_error("insufficient credits")),
    "429-date": status(429, openai_error("slow down"), **{"Retry-After": HTTP_DATE}),
    "429-tokens": status(
        429,
        openai_error("tokens"),
        **{
            "x-ratelimit-remaining-requests": "5",
            "x-ratelimit-reset-requests": "2s",
            "x-ratelimit-remaining-tokens": "0",
            "x-ratelimit-reset-tokens": "6m0s",
        },
    ),
    "429-bare": status(429, openai_error("no hint")),
}


@pytest.fixture
async def scripted() -> AsyncIterator[str]:
    """Base URL of a server whose scenario is the first path segment."""

    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await SCENARIOS[request.match_info["scenario"]](request)

    app = web.Application()
    app.router.add_post("/{scenario}/v1/chat/completions", dispatch)
    async with serve(app) as origin:
        yield origin


@pytest.fixture(params=["aiohttp", "httpcore", "own"])
async def scripted_backend(
    scripted: str, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[[str], OpenAIBackend]]:
    """Adapters on one injected client, on each transport, and adapters on their own
    pools (``own``: the direct path past httpx's client, AiohttpClient.open): every
    broken or odd server must read the same whichever moves the bytes."""
    client: httpx.AsyncClient | None = None
    if request.param == "aiohttp":
        client = httpx.AsyncClient(transport=AiohttpTransport(limits=httpx.Limits()))
    elif request.param == "httpcore":
        client = httpx.AsyncClient()
    adapters: list[OpenAIBackend] = []

    def build(scenario: str) -> OpenAIBackend:
        adapter = OpenAIBackend(scenario, config_for(f"{scripted}/{scenario}/v1"), client=client)
        assert (adapter._prepared[0] is not None) == (client is None)
        adapters.append(adapter)
        return adapter

    yield build
    for adapter in adapters:
        await adapter.close()
    if client is not None:
        await client.aclose()


async def test_sse_comments_crlf_and_usage_only_chunk(
    scripted_backend: Callable[[str], OpenAIBackend],
) -> None:
    deltas = await collect(scripted_backend("odd"), make_request())
    # Both events arrive in one network read: one delta carries them both.
    assert "".join(d.text for d in deltas[:-1]) == "Hello"
    assert deltas[-1].usage == Usage(prompt_tokens=7, completion_tokens=2)
    assert deltas[-1].finish_reason == "stop"


async def test_events_that_arrive_in_one_read_become_one_delta(
    scripted_backend: Callable[[str], OpenAIBackend],
) -> None:
    # The worker publishes one chunk per delta: a burst costs one publish.
    request = make_request()
    deltas = await collect(scripted_backend("burst"), request)
    assert [d.text for d in deltas if d.text] == ["abcde"]
    # Each event still counts as a token where the backend reports no usage.
    assert deltas[-1].usage == Usage(
        prompt_tokens=estimate_input_tokens(request), completion_tokens=5
    )


async def test_cr_only_line_endings_stream(
    scripted_backend: Callable[[str], OpenAIBackend],
) -> None:
    deltas = await collect(scripted_backend("cr-only"), make_request())
    assert "".join(d.text for d in deltas) == "Hello"
    assert deltas[-1].usage is not None


async def test_missing_usage_is_estimated(scripted_backend: Callable[[str], OpenAIBackend]) -> None:
    deltas = await collect(scripted_backend("no-usage"), make_request(content="x" * 40))
    # 40 prompt chars / 4 plus the chat's overheads (the router's own
    # estimate); one completion token per content delta.
    assert deltas[-1].usage == Usage(
        prompt_tokens=10 + MESSAGE_OVERHEAD_TOKENS + REPLY_OVERHEAD_TOKENS, completion_tokens=3
    )
    assert deltas[-1].finish_reason == "stop"


async def test_json_answer_to_a_stream_request_is_accepted(
    scripted_backend: Callable[[str], OpenAIBackend],
) -> None:
    deltas = await collect(scripted_backend("json"), make_request())
    assert deltas == [
        # A whole body read at once: its text came with the end.
        Delta(text="whole", end=True),
        Delta(usage=Usage(prompt_tokens=1, completion_tokens=1), finish_reason="stop", end=True),
    ]


@pytest.mark.parametrize(
    ("scenario", "fragment"),
    [
        ("truncated", "before [DONE]"),
        ("garbage", "malformed stream chunk"),
        ("error-event", "model crashed"),
        ("dropped", "RemoteProtocolError"),
        ("error-type", "overloaded"),
        ("huge-line", "line longer than 4194304 bytes"),
        ("unterminated", "before [DONE]"),
    ],
)
async def test_broken_streams_are_retryable(
    scripted_backend: Callable[[str], OpenAIBackend], scenario: str, fragment: str
) -> None:
    adapter = scripted_backend(scenario)
    texts: list[str] = []

    async def consume() -> None:
        async for delta in adapter.stream(make_request()):
            texts.append(delta.text)

    with pytest.raises(RetryableBackendError) as caught:
        await consume()
    assert fragment in str(caught.value)
    # What came before the break was passed on; an unterminated event was not.
    assert texts in ([], ["x"], ["partial"], ["a"])
    assert_secret_free(caught.value, adapter)


@pytest.mark.parametrize(
    ("scenario", "texts", "failure"),
    [
        # Tokens were passed on before the bare [DONE]: the stream broke mid-way.
        ("done-without-finish", ["Once upon"], FailureClass.BROKEN_STREAM),
        ("empty-finish-done", ["Once upon"], FailureClass.BROKEN_STREAM),
        # Nothing was passed on: a malformed answer, retried like one.
        ("empty-done", [], FailureClass.MALFORMED),
    ],
)
async def test_done_without_a_finish_reason_is_a_broken_stream_not_an_answer(
    scripted_backend: Callable[[str], OpenAIBackend],
    scenario: str,
    texts: list[str],
    failure: FailureClass,
) -> None:
    """llama-cpp-python's server ends a stream it cuts short (its one slot taken by
    another call) with a bare ``[DONE]``: no chunk carries a ``finish_reason``. That
    is a truncated answer, never a whole one: a retryable error of the class the
    worker retries or falls back on, as for a stream broken mid-way."""
    adapter = scripted_backend(scenario)
    seen: list[str] = []

    async def consume() -> None:
        async for delta in adapter.stream(make_request()):
            seen.append(delta.text)

    with pytest.raises(RetryableBackendError) as caught:
        await consume()
    assert "stream ended with [DONE] but no finish_reason" in str(caught.value)
    assert caught.value.failure is failure
    assert [text for text in seen if text] == texts


@pytest.mark.parametrize(
    ("scenario", "error_type", "fragment"),
    [
        ("401", FatalBackendError, "bad key"),
        ("403", FatalBackendError, "forbidden region"),
        ("404", FatalBackendError, "model 'm' not found"),
        ("402", FatalBackendError, "insufficient credits"),
        ("400", BadRequestError, "max_tokens too large"),
        ("413", BadRequestError, "payload too large"),
        ("422", BadRequestError, "bad field"),
        ("408", RetryableBackendError, "timeout"),
        ("409", RetryableBackendError, "conflict"),
        ("502", RetryableBackendError, "bad gateway"),
        ("503", RetryableBackendError, "overloaded"),
    ],
)
@pytest.mark.parametrize("streaming", [True, False])
async def test_status_codes_map_to_error_classes(
    scripted_backend: Callable[[str], OpenAIBackend],
    scenario: str,
    error_type: type[BackendError],
    fragment: str,
    streaming: bool,
) -> None:
    adapter = scripted_backend(scenario)
    call = collect(adapter, make_request()) if streaming else adapter.complete(make_request())
    with pytest.raises(BackendError) as caught:
        await call
    assert type(caught.value) is error_type
    assert caught.value.status == int(scenario)
    assert fragment in str(caught.value)
    assert len(str(caught.value)) < 360  # provider text is truncated
    assert_secret_free(caught.value, adapter)


@pytest.mark.parametrize(
    ("scenario", "low", "high"),
    [("429-date", 3000, 3600.5), ("429-tokens", 360, 360), ("429-bare", None, None)],
)
async def test_retry_after_from_date_or_ratelimit_reset(
    scripted_backend: Callable[[str], OpenAIBackend],
    scenario: str,
    low: float | None,
    high: float | None,
) -> None:
    with pytest.raises(RateLimitedError) as caught:
        await scripted_backend(scenario).complete(make_request())
    retry_after = caught.value.retry_after
    if low is None or high is None:
        assert retry_after is None
    else:
        assert retry_after is not None
        assert low <= retry_after <= high


# ----------------------------------------------------------- lifecycle


async def test_make_backend_builds_an_openai_adapter(mock: MockBackend) -> None:
    backend = make_backend("mock", config_for(mock.url), send_priority=True)
    assert isinstance(backend, OpenAIBackend)
    assert isinstance(backend, Backend)
    assert backend.name == "mock"
    await backend.complete(make_request(), priority=1)
    assert mock.stats().last_request["priority"] == 1
    await backend.close()


async def test_aclose_is_idempotent_and_spares_an_injected_client(mock: MockBackend) -> None:
    async with httpx.AsyncClient() as client:
        adapter = OpenAIBackend("mock", config_for(mock.url), client=client)
        await adapter.close()
        await adapter.close()
        assert not client.is_closed
        with pytest.raises(FatalBackendError):
            await adapter.complete(make_request())
    own = OpenAIBackend("mock", config_for(mock.url))
    await own.close()
    await own.close()
    assert all(pool.is_closed for pool in own._pools)


def test_key_with_illegal_characters_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-test-SECRET123\nX-Evil: 1")
    with pytest.raises(ConfigError) as caught:
        OpenAIBackend("bad", config_for("http://127.0.0.1:1/v1"))
    assert "SECRET123" not in str(caught.value)


async def test_tokens_arriving_apart_are_not_held_back() -> None:
    """Tokens that arrive in separate reads each become their own delta at once.
    The server sends the next token only once the adapter has yielded the last
    one as a delta: an adapter that held a token back, waiting for more, would
    never get the next one (the call would hang and time out). (Before, tokens
    50 ms apart from the mock: on a loaded machine two could land in one read.)"""
    sent = 5
    yielded: asyncio.Queue[str] = asyncio.Queue()

    async def paced(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(sent):
            await response.write((CHUNK % f"tok{index} ").encode())
            assert await yielded.get() == f"tok{index} "  # not before it was a delta
        await response.write((FINISH + "data: [DONE]\n\n").encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", paced)
    texts = []
    async with serve(app) as origin, OpenAIBackend("paced", config_for(f"{origin}/v1")) as adapter:
        async with asyncio.timeout(30):  # a bound for a held-back token, not a timing
            async for delta in adapter.stream(make_request()):
                if delta.text:
                    texts.append(delta.text)
                    yielded.put_nowait(delta.text)
    assert texts == [f"tok{index} " for index in range(sent)]


async def test_a_body_ended_after_its_end_marker_keeps_its_connection() -> None:
    # The adapter stops waiting at [DONE] (the answer is whole: nothing is
    # held back), but the body's end, sent a moment later, is still read:
    # the connection goes back to the pool, not hung up (a TLS handshake
    # saved on the next call to a remote API).
    peers: list[object] = []
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write((CHUNK % "Hi" + FINISH + "data: [DONE]\n\n").encode())
        await release.wait()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with serve(app) as origin:
        adapter = OpenAIBackend("late", config_for(f"{origin}/v1"))
        try:
            deltas = await collect(adapter, make_request())  # returns before the body ends
            assert "".join(d.text for d in deltas) == "Hi"
            assert deltas[-1].finish_reason == "stop"
            release.set()
            await asyncio.gather(*adapter._draining)  # the body's end, read
            await collect(adapter, make_request())
        finally:
            release.set()
            await adapter.close()
    assert len(peers) == 2
    assert peers[0] == peers[1]  # the same connection
