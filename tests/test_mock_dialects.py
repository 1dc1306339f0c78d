"""The mock backend's provider wire formats, read raw over HTTP on loopback.

The adapters' tests (test_native_adapters.py) read these through the adapters;
here the bytes themselves: framing, content types, error shapes, limit headers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from renqueue.mock import MockBackend, MockSettings

ANTHROPIC = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
OLLAMA = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TGI = {"inputs": "hi", "parameters": {"max_new_tokens": 3}}
GEMINI = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(output_tokens=3)) as server:
        yield server


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5) as http:
        yield http


def origin(mock: MockBackend) -> str:
    return mock.url.removesuffix("/v1")


async def test_url_for_gives_each_adapter_its_base_url(mock: MockBackend) -> None:
    base = origin(mock)
    assert mock.url_for("openai") == mock.url_for("anthropic") == f"{base}/v1"
    assert mock.url_for("ollama") == mock.url_for("tgi") == base
    assert mock.url_for("gemini") == f"{base}/v1beta"


async def test_anthropic_stream_is_named_events_in_order(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    response = await client.post(f"{origin(mock)}/v1/messages", json={**ANTHROPIC, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data:")]
    assert all(event["type"] == name for event, name in zip(data, names, strict=True))
    assert data[-2]["delta"]["stop_reason"] == "end_turn"
    assert data[-2]["usage"] == {"output_tokens": 3}


async def test_ollama_streams_json_lines_unless_told_not_to(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    streamed = await client.post(f"{origin(mock)}/api/chat", json=OLLAMA)
    assert streamed.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in streamed.text.splitlines()]
    assert [line["done"] for line in lines] == [False, False, False, True]
    assert lines[-1]["eval_count"] == 3
    assert lines[-1]["done_reason"] == "stop"
    whole = await client.post(f"{origin(mock)}/api/chat", json={**OLLAMA, "stream": False})
    assert whole.json()["message"]["content"] == "tok0 tok1 tok2"


async def test_tgi_events_have_no_space_after_data_and_end_with_details(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    response = await client.post(f"{origin(mock)}/generate_stream", json=TGI)
    events = [e for e in response.text.split("\n\n") if e]
    assert all(event.startswith("data:{") for event in events)
    last = json.loads(events[-1][5:])
    assert last["generated_text"] == "tok0 tok1 tok2"
    assert last["details"]["finish_reason"] == "eos_token"
    whole = (await client.post(f"{origin(mock)}/generate", json=TGI)).json()
    assert whole["generated_text"] == "tok0 tok1 tok2"


async def test_gemini_streams_with_alt_sse_only(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    url = f"{origin(mock)}/v1beta/models/gemini-2.0-flash"
    streamed = await client.post(f"{url}:streamGenerateContent?alt=sse", json=GEMINI)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line]
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert chunks[-1]["usageMetadata"]["candidatesTokenCount"] == 3
    assert chunks[-1]["modelVersion"] == "gemini-2.0-flash"
    no_alt = await client.post(f"{url}:streamGenerateContent", json=GEMINI)
    assert no_alt.status_code == 400
    assert no_alt.json()["error"]["status"] == "INVALID_ARGUMENT"
    unknown = await client.post(f"{url}:countTokens", json=GEMINI)
    assert unknown.status_code == 400
    assert "unknown method" in unknown.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "payload", "check"),
    [
        ("/v1/messages", {"model": "m"}, lambda b: b["error"]["type"] == "invalid_request_error"),
        ("/api/chat", {"messages": []}, lambda b: isinstance(b["error"], str)),
        ("/generate_stream", {"input": "x"}, lambda b: b["error_type"] == "validation"),
        (
            "/v1beta/models/m:generateContent",
            {"contents": "x"},
            lambda b: b["error"]["status"] == "INVALID_ARGUMENT",
        ),
    ],
)
async def test_a_bad_body_is_a_400_in_the_providers_shape(
    mock: MockBackend, client: httpx.AsyncClient, path: str, payload: Any, check: Any
) -> None:
    response = await client.post(origin(mock) + path, json=payload)
    assert response.status_code == 400
    assert check(response.json())
    assert mock.stats().bad_requests == 1


async def test_rate_limits_speak_the_providers_dialect(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    mock.update(rpm=1)
    first = await client.post(f"{origin(mock)}/v1/messages", json=ANTHROPIC)
    assert first.headers["anthropic-ratelimit-requests-limit"] == "1"
    refused = await client.post(f"{origin(mock)}/v1/messages", json=ANTHROPIC)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in refused.headers
    gemini = await client.post(f"{origin(mock)}/v1beta/models/m:generateContent", json=GEMINI)
    assert gemini.status_code == 429
    error = gemini.json()["error"]
    assert error["status"] == "RESOURCE_EXHAUSTED"
    assert any(d["@type"].endswith("RetryInfo") for d in error["details"])


@pytest.mark.parametrize(
    ("path", "payload", "header", "refused"),
    [
        ("/v1/messages", ANTHROPIC, "x-api-key", 401),
        # Gemini answers a bad key with a 400 (reason API_KEY_INVALID).
        ("/v1beta/models/m:generateContent", GEMINI, "x-goog-api-key", 400),
        ("/api/chat", {**OLLAMA, "stream": False}, "authorization", 401),
    ],
)
async def test_each_dialect_takes_the_key_in_its_providers_header_only(
    mock: MockBackend,
    client: httpx.AsyncClient,
    path: str,
    payload: dict[str, Any],
    header: str,
    refused: int,
) -> None:
    mock.update(require_api_key="k1")
    url = origin(mock) + path
    right = {header: "Bearer k1" if header == "authorization" else "k1"}
    elsewhere = {"x-api-key": "k1"} if header == "authorization" else {"authorization": "Bearer k1"}
    assert (await client.post(url, json=payload, headers=right)).status_code == 200
    assert (await client.post(url, json=payload, headers=elsewhere)).status_code == refused
