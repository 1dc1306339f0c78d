"""The native adapters (Anthropic, Ollama, TGI, Gemini) against the mock backend on loopback.

Each adapter talks to the mock's endpoint for its provider (``MockBackend.url_for``),
which writes the provider's wire format: streams, whole answers, rate-limit
headers, error bodies and every injected fault. What is checked is what the
worker acts on: text, usage, the finish reason in the common names, the
failure class of every error, and the key kept out of every message.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from renqueue.backends import HTTPBackend, make_backend
from renqueue.backends.base import Delta
from renqueue.backends.tgi import render_prompt
from renqueue.config import parse_config
from renqueue.errors import BackendError, FailureClass, RateLimitedError
from renqueue.mock import FaultSpec, MockBackend, MockSettings
from renqueue.schema import ChatMessage, GenerationParams, InferenceRequest, Usage

KEY = "sk-native-SECRET456"
KEY_ENV = "RQ_TEST_NATIVE_KEY"
NATIVE = ["anthropic", "ollama", "tgi", "gemini"]
MESSAGES = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]


def make_request(**params: Any) -> InferenceRequest:
    return InferenceRequest(
        id="req-1", route="chat", messages=MESSAGES, params=GenerationParams(**params)
    )


def prompt_tokens(adapter: str) -> int:
    """What the mock counts for MESSAGES: characters / 4, of the prompt as sent."""
    if adapter == "tgi":  # one rendered prompt
        chars = len(render_prompt(MESSAGES, "chatml"))
    else:  # the system text and the turns' text
        chars = sum(len(m.content) for m in MESSAGES)
    return -(-chars // 4)


def adapter_for(mock: MockBackend, adapter: str, **fields: Any) -> HTTPBackend:
    raw = {"adapter": adapter, "base_url": mock.url_for(adapter), "model": "m", **fields}
    config = parse_config({"backends": {"b": raw}}).backends["b"]
    backend = make_backend("b", config)
    assert isinstance(backend, HTTPBackend)
    return backend


async def stream(backend: HTTPBackend, request: InferenceRequest | None = None) -> list[Delta]:
    return [delta async for delta in backend.stream(request or make_request())]


async def failed(
    backend: HTTPBackend, request: InferenceRequest | None = None
) -> tuple[list[Delta], BackendError]:
    """What a stream yielded before it failed, and its error."""
    deltas: list[Delta] = []

    async def consume() -> None:
        async for delta in backend.stream(request or make_request()):
            deltas.append(delta)

    with pytest.raises(BackendError) as caught:
        await consume()
    return deltas, caught.value


def assert_secret_free(exc: BaseException, backend: HTTPBackend) -> None:
    rendered = "".join(traceback.format_exception(exc))
    for text in (str(exc), repr(exc), rendered, repr(backend), repr(backend._stream_headers)):
        assert "SECRET456" not in text


def faults(*script: str, **spec: Any) -> dict[str, Any]:
    return {"faults": msgspec.to_builtins(FaultSpec(script=script, **spec))}  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(output_tokens=4)) as server:
        yield server


# ------------------------------------------------------------------ answers


@pytest.mark.parametrize("adapter", NATIVE)
async def test_stream_yields_text_then_usage_and_finish_reason(
    mock: MockBackend, adapter: str
) -> None:
    async with adapter_for(mock, adapter) as backend:
        deltas = await stream(backend)
    assert "".join(d.text for d in deltas) == "tok0 tok1 tok2 tok3"
    assert all(d.usage is None for d in deltas[:-1])
    assert deltas[-1] == Delta(
        usage=Usage(prompt_tokens=prompt_tokens(adapter), completion_tokens=4),
        finish_reason="stop",
        end=True,
    )
    assert mock.stats().completed == 1


@pytest.mark.parametrize("adapter", NATIVE)
async def test_complete_returns_the_whole_answer_cut_at_max_tokens(
    mock: MockBackend, adapter: str
) -> None:
    async with adapter_for(mock, adapter) as backend:
        generation = await backend.complete(make_request(max_tokens=2))
        streamed = await stream(backend, make_request(max_tokens=2))
    assert generation.text == "tok0 tok1"
    assert generation.usage == Usage(prompt_tokens=prompt_tokens(adapter), completion_tokens=2)
    assert generation.finish_reason == "length"
    assert streamed[-1].finish_reason == "length"
    assert mock.stats().requests == 2


async def test_tokens_arriving_apart_become_deltas_at_once(mock: MockBackend) -> None:
    # 50 ms apart: each read is passed on as it comes, not held for the end (a
    # loaded machine may read two at once, hence "most", not "all").
    mock.update(tokens_per_second=20, output_tokens=5)
    for adapter in NATIVE:
        async with adapter_for(mock, adapter) as backend:
            deltas = await stream(backend)
        assert len([d for d in deltas if d.text]) >= 3, adapter


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        ("anthropic", "content_filter"),  # refusal
        ("gemini", "content_filter"),  # SAFETY
        ("ollama", "stop"),  # no filter of its own
        ("tgi", "stop"),
    ],
)
async def test_a_filtered_answer_keeps_its_text_and_says_so_where_the_format_can(
    mock: MockBackend, adapter: str, expected: str
) -> None:
    mock.update(**faults("filtered", "filtered", after_tokens=2))
    async with adapter_for(mock, adapter) as backend:
        deltas = await stream(backend)
        whole = await backend.complete(make_request())
    assert "".join(d.text for d in deltas) == "tok0 tok1"
    assert deltas[-1].finish_reason == expected
    assert (whole.text, whole.finish_reason) == ("tok0 tok1", expected)


async def test_closing_the_stream_early_stops_the_backend(mock: MockBackend) -> None:
    mock.update(output_tokens=500, tokens_per_second=100)
    for adapter in NATIVE:
        before = mock.stats().disconnects
        async with adapter_for(mock, adapter) as backend:
            chunks = backend.stream(make_request())
            first = await anext(chunks)
            await chunks.aclose()  # type: ignore[attr-defined]
            for _ in range(400):  # the server notices the disconnect: no event to wait on
                if mock.stats().disconnects > before:
                    break
                await asyncio.sleep(0.005)
        assert first.text == "tok0", adapter
        assert mock.stats().disconnects == before + 1, adapter


# ------------------------------------------------------------ request bodies


async def test_anthropic_body_headers_and_defaults(mock: MockBackend) -> None:
    mock.update(require_api_key=KEY)
    fields = {"api_key_env": KEY_ENV, "max_tokens": 77, "beta": ["prompt-caching-2024-07-31"]}
    async with adapter_for(mock, "anthropic", **fields) as backend:
        await stream(backend, make_request(temperature=1.5, top_p=0.5, stop=["\n"], seed=3))
        sent = mock.stats().last_request
        assert sent == {
            "model": "m",
            "max_tokens": 77,  # the request named none: the config's
            "messages": [{"role": "user", "content": "hi"}],
            "system": "be brief",
            "temperature": 1.0,  # Anthropic's range ends at 1
            "top_p": 0.5,
            "stop_sequences": ["\n"],
            "stream": True,  # and no seed: Anthropic has none
        }
        headers = backend._stream_headers
        assert headers["x-api-key"] == KEY
        assert "authorization" not in headers
        assert headers["anthropic-version"] == "2023-06-01"
        assert headers["anthropic-beta"] == "prompt-caching-2024-07-31"
        assert_secret_free(RuntimeError(), backend)


async def test_ollama_body_merges_the_requests_parameters_over_the_configs_options(
    mock: MockBackend,
) -> None:
    fields = {"keep_alive": "10m", "options": {"num_ctx": 8192, "temperature": 0.1, "top_k": 5}}
    async with adapter_for(mock, "ollama", **fields) as backend:
        await backend.complete(make_request(max_tokens=3, temperature=0.7, seed=9))
    assert mock.stats().last_request == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
        "stream": False,
        "options": {"num_ctx": 8192, "temperature": 0.7, "top_k": 5, "num_predict": 3, "seed": 9},
        "keep_alive": "10m",
    }


async def test_a_tenants_extras_never_override_the_operators_ollama_and_tgi_settings(
    mock: MockBackend,
) -> None:
    """Before, a tenant's ``num_ctx`` or ``num_gpu`` won over the config's (a
    model reload, maybe out of memory, for every tenant), and ``adapter_id``
    picked another LoRA on TGI."""
    hostile = {"num_ctx": 131072, "num_gpu": 0, "top_k": 99, "min_p": 0.1, "adapter_id": "x"}
    fields = {"options": {"num_ctx": 4096, "top_k": 5}}
    async with adapter_for(mock, "ollama", **fields) as backend:
        await backend.complete(make_request(extra=hostile))
    assert mock.stats().last_request["options"] == {"num_ctx": 4096, "top_k": 5, "min_p": 0.1}
    async with adapter_for(mock, "tgi", parameters={"top_k": 10}) as backend:
        await backend.complete(make_request(extra={**hostile, "truncate": 5}))
    parameters = mock.stats().last_request["parameters"]
    assert parameters["top_k"] == 10
    assert "adapter_id" not in parameters
    assert "truncate" not in parameters


@pytest.mark.parametrize(
    ("prompt_format", "inputs"),
    [
        (
            "chatml",
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "llama3",
            "<|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("plain", "be brief\n\nhi"),
    ],
)
async def test_tgi_renders_one_prompt_and_sends_its_parameters(
    mock: MockBackend, prompt_format: str, inputs: str
) -> None:
    fields = {"prompt_format": prompt_format, "parameters": {"top_k": 10, "temperature": 0.5}}
    async with adapter_for(mock, "tgi", **fields) as backend:
        await stream(backend, make_request(max_tokens=3, temperature=0, top_p=1.0, stop=["x"]))
    assert mock.stats().last_request == {
        "inputs": inputs,
        "parameters": {
            "top_k": 10,
            "max_new_tokens": 3,
            "do_sample": False,  # temperature 0, which TGI refuses: greedy instead
            "stop": ["x"],  # and no top_p: TGI takes it below 1 only
            "details": True,
            "return_full_text": False,
        },
    }


async def test_gemini_body_and_the_key_in_its_header_never_in_the_url(mock: MockBackend) -> None:
    mock.update(require_api_key=KEY)
    safety = [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_ONLY_HIGH"}]
    fields = {"api_key_env": KEY_ENV, "top_k": 4, "safety_settings": safety}
    async with adapter_for(mock, "gemini", **fields) as backend:
        await stream(backend, make_request(max_tokens=3, temperature=0.2, stop=["."], seed=1))
        assert mock.stats().last_request == {
            "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "systemInstruction": {"parts": [{"text": "be brief"}]},
            "generationConfig": {
                "maxOutputTokens": 3,
                "temperature": 0.2,
                "stopSequences": ["."],
                "seed": 1,
                "topK": 4,
            },
            "safetySettings": safety,
        }
        stream_url, whole_url = backend._urls
        assert stream_url.endswith("/v1beta/models/m:streamGenerateContent?alt=sse")
        assert whole_url.endswith("/v1beta/models/m:generateContent")
        assert KEY not in stream_url + whole_url
        assert backend._stream_headers["x-goog-api-key"] == KEY
        assert_secret_free(RuntimeError(), backend)


@pytest.mark.parametrize("adapter", NATIVE)
async def test_a_wrong_key_is_unavailable_and_never_shows(mock: MockBackend, adapter: str) -> None:
    # The mock wants another key and echoes back the one it got, as some providers do.
    mock.update(require_api_key="sk-other")
    async with adapter_for(mock, adapter, api_key_env=KEY_ENV) as backend:
        _, error = await failed(backend)
        assert error.failure is FailureClass.UNAVAILABLE  # Gemini's 400 API_KEY_INVALID too
        assert_secret_free(error, backend)


@pytest.mark.parametrize("adapter", ["anthropic", "ollama", "gemini"])
async def test_an_unknown_model_is_unavailable(mock: MockBackend, adapter: str) -> None:
    mock.update(models=("other",))
    async with adapter_for(mock, adapter) as backend:
        _, error = await failed(backend)
    assert error.failure is FailureClass.UNAVAILABLE
    assert error.status == 404


# ------------------------------------------------------------ failure classes

# Each fault strikes before any token (after_tokens=0), as the mock writes it
# in the adapter's wire format.
CLASSES = {
    "500": FailureClass.SERVER_ERROR,
    "503": FailureClass.OVERLOADED,
    "529": FailureClass.OVERLOADED,
    "reset": FailureClass.CONNECT,
    "429": FailureClass.RATE_LIMITED,
    "429_bare": FailureClass.RATE_LIMITED,
    "context_length": FailureClass.CONTEXT_LENGTH,
    "content_filter": FailureClass.CONTENT_FILTER,
    "malformed": FailureClass.MALFORMED,
}


@pytest.mark.parametrize("adapter", NATIVE)
@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
async def test_each_fault_is_classified(
    mock: MockBackend, adapter: str, kind: str, streaming: bool
) -> None:
    mock.update(**faults(kind, after_tokens=0))
    async with adapter_for(mock, adapter) as backend:
        call = stream(backend) if streaming else backend.complete(make_request())
        with pytest.raises(BackendError) as caught:
            await call
    assert caught.value.failure is CLASSES[kind], caught.value
    assert mock.stats().requests == 1, "the adapter retried by itself"


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        # Anthropic has no daily quota: its ordinary 429 with every counter spent.
        ("anthropic", FailureClass.RATE_LIMITED),
        # A per-day quota id in the RESOURCE_EXHAUSTED body.
        ("gemini", FailureClass.QUOTA_EXHAUSTED),
        # No dialect of their own: the mock's limit_style (OpenAI's insufficient_quota).
        ("ollama", FailureClass.QUOTA_EXHAUSTED),
        ("tgi", FailureClass.QUOTA_EXHAUSTED),
    ],
)
async def test_a_spent_quota_is_read_in_the_providers_dialect(
    mock: MockBackend, adapter: str, expected: FailureClass
) -> None:
    mock.update(quota_exhausted=True, rpm=10)
    async with adapter_for(mock, adapter) as backend:
        _, error = await failed(backend)
    assert isinstance(error, RateLimitedError)
    assert error.failure is expected


async def test_anthropic_rate_limit_headers_are_read(mock: MockBackend) -> None:
    mock.update(rpm=10, tpm=1000)
    async with adapter_for(mock, "anthropic") as backend:
        await stream(backend)
        limits = backend.last_rate_limit
        assert limits is not None
        requests = limits.find("requests", 60)
        assert requests is not None
        assert (requests.limit, requests.remaining) == (10, 9)
        assert limits.sources == ("anthropic",)
        mock.update(**faults("429", retry_after=7))
        _, error = await failed(backend)
    assert isinstance(error, RateLimitedError)
    assert error.retry_after == 7.0  # retry-after
    assert "rate limit" in str(error)


async def test_gemini_resource_exhausted_says_when_to_retry(mock: MockBackend) -> None:
    mock.update(**faults("429", retry_after=12))
    async with adapter_for(mock, "gemini") as backend:
        _, error = await failed(backend)
        limits = backend.last_rate_limit
    assert isinstance(error, RateLimitedError)
    assert error.retry_after == 12.0  # RetryInfo.retryDelay
    assert not error.quota_exhausted  # a per-minute quota
    assert limits is not None
    assert "gemini" in limits.sources
    window = limits.find("requests", 60)
    assert window is not None
    assert window.remaining == 0


async def test_tgi_429_overloaded_is_an_overload_not_a_rate_limit(mock: MockBackend) -> None:
    # TGI answers 429 {"error_type": "overloaded"} past --max-concurrent-requests.
    mock.update(concurrency=1, busy_status=429, ttft=0.3)
    async with (
        adapter_for(mock, "tgi") as busy,
        adapter_for(mock, "tgi") as backend,
    ):
        slow = asyncio.create_task(busy.complete(make_request()))
        for _ in range(400):
            if mock.stats().in_flight:
                break
            await asyncio.sleep(0.005)
        _, error = await failed(backend)
        await slow
    assert error.status == 429
    assert error.failure is FailureClass.OVERLOADED
    assert not isinstance(error, RateLimitedError)


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        ("anthropic", FailureClass.OVERLOADED),  # event: error, overloaded_error
        ("ollama", FailureClass.SERVER_ERROR),
        ("tgi", FailureClass.SERVER_ERROR),  # error_type generation
        ("gemini", FailureClass.SERVER_ERROR),  # status INTERNAL
    ],
)
async def test_an_error_sent_in_band_is_classified(
    mock: MockBackend, adapter: str, expected: FailureClass
) -> None:
    mock.update(**faults("sse_error", after_tokens=0))
    async with adapter_for(mock, adapter) as backend:
        deltas, error = await failed(backend)
    assert not deltas
    assert error.failure is expected
    assert "error in stream" in str(error)


@pytest.mark.parametrize("adapter", NATIVE)
@pytest.mark.parametrize("kind", ["break", "sse_error", "malformed"])
async def test_a_failure_after_tokens_is_a_broken_stream(
    mock: MockBackend, adapter: str, kind: str
) -> None:
    mock.update(output_tokens=8, tokens_per_second=100, **faults(kind, after_tokens=3))
    async with adapter_for(mock, adapter) as backend:
        deltas, error = await failed(backend)
    assert "".join(d.text for d in deltas).startswith("tok0")
    assert error.failure is FailureClass.BROKEN_STREAM
    assert "stream broke after tokens were sent" in str(error)


@pytest.mark.parametrize("adapter", NATIVE)
async def test_a_stream_that_ends_without_its_finish_is_a_broken_stream(
    mock: MockBackend, adapter: str
) -> None:
    # no_finish: tokens, then the end marker without the finish before it
    # (Anthropic: message_stop, no message_delta), or a clean end without the
    # finish where the finish is the end marker (Ollama, TGI, Gemini).
    mock.update(output_tokens=8, tokens_per_second=100, **faults("no_finish", after_tokens=3))
    async with adapter_for(mock, adapter) as backend:
        deltas, error = await failed(backend)
    assert "".join(d.text for d in deltas) == "tok0 tok1 tok2"
    assert error.failure is FailureClass.BROKEN_STREAM
    assert error.retryable


@pytest.mark.parametrize("adapter", NATIVE)
async def test_a_stream_without_its_end_marker_but_with_a_finish_is_complete(
    mock: MockBackend, adapter: str
) -> None:
    # Anthropic: no message_stop after message_delta; the others have no marker
    # beyond their final chunk.
    mock.update(**faults("no_done"))
    async with adapter_for(mock, adapter) as backend:
        deltas = await stream(backend)
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == "tok0 tok1 tok2 tok3"


# ------------------------------------------------------------------ timeouts


@pytest.mark.parametrize("adapter", NATIVE)
async def test_no_first_token_in_time_is_a_first_token_timeout(
    mock: MockBackend, adapter: str
) -> None:
    mock.update(**faults("hang"))
    async with adapter_for(mock, adapter, first_token_timeout="200ms") as backend:
        deltas, error = await failed(backend)
    assert not deltas
    assert error.failure is FailureClass.FIRST_TOKEN_TIMEOUT


@pytest.mark.parametrize("adapter", NATIVE)
async def test_a_call_longer_than_total_timeout_is_a_total_timeout(
    mock: MockBackend, adapter: str
) -> None:
    mock.update(output_tokens=50, tokens_per_second=20)
    async with adapter_for(mock, adapter, total_timeout="300ms") as backend:
        deltas, error = await failed(backend)
    assert deltas, "tokens had come"
    assert error.failure is FailureClass.TOTAL_TIMEOUT


@pytest.mark.parametrize("adapter", NATIVE)
async def test_a_silence_between_tokens_is_a_stall(mock: MockBackend, adapter: str) -> None:
    mock.update(**faults("drip", drip_gap=2.0))
    async with adapter_for(mock, adapter, timeout="300ms") as backend:
        deltas, error = await failed(backend)
    if deltas:  # the first token came: a stall, after text, is a broken stream
        assert error.failure is FailureClass.BROKEN_STREAM
        assert "stall" in str(error)
    else:
        assert error.failure is FailureClass.FIRST_TOKEN_TIMEOUT
