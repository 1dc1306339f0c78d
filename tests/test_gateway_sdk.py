"""The gateway through the official openai SDK, unchanged, and curl: real Services,
a real nats-server and a mock backend over loopback HTTP.

Each test runs its own stack (Services starts an embedded nats-server on a free
port) and a gateway on a free port, with two tenants' keys.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import prometheus_client
import pytest
from _waits import until
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ParsedFunctionToolCall

from renqueue import Client, RequestCancelledError, Services, parse_config
from renqueue.broker import EventLog, JetStream, KeyValue
from renqueue.config import Config
from renqueue.errors import NatsNotFoundError, NatsTimeoutError, StoreFullError
from renqueue.gateway import Gateway, _submissions, digest
from renqueue.gateway._idempotency import claim_key, fingerprint, id_for_key, shared_key
from renqueue.gateway._submissions import BODY_KEY
from renqueue.mock import FaultSpec, MockBackend, MockSettings
from renqueue.schema import (
    EVENT_DECODER,
    STATE_BUCKET,
    SYSTEM_TENANT,
    CircuitChanged,
    Completed,
    Submitted,
    Usage,
)

ACME = "rq-test-acme-key-0123456789abcdef"
GLOBEX = "rq-test-globex-key-0123456789abcdef"
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]


def make_config(tmp_path: Path, mock: MockBackend, **extra: Any) -> Config:
    raw: dict[str, Any] = {
        "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
        "backends": {"b1": {"base_url": mock.url, "model": "mock", "limits": {"concurrency": 8}}},
        "routes": {"chat": {"backends": ["b1"]}},
        "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
        "router": {"capacity_refresh": "20ms"},
        "gateway": {
            "port": 0,
            "keys": [
                {"tenant": "acme", "sha256": digest(ACME)},
                {"tenant": "globex", "sha256": digest(GLOBEX)},
            ],
        },
    }
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_config(raw)


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    settings = MockSettings(ttft=0.0, tokens_per_second=400, output_tokens=8)
    async with MockBackend(settings) as m:
        yield m


class Stack:
    def __init__(self, services: Services, gateway: Gateway) -> None:
        self.services = services
        self.gateway = gateway
        self._sdks: list[openai.AsyncOpenAI] = []

    def sdk(self, key: str = ACME, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("max_retries", 0)
        sdk = openai.AsyncOpenAI(base_url=self.gateway.url, api_key=key, **kwargs)
        self._sdks.append(sdk)
        return sdk

    async def close(self) -> None:
        for sdk in self._sdks:
            await sdk.close()

    def http(self, key: str = ACME) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.gateway.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )

    def client(self, tenant: str = "acme") -> Client:
        assert self.services.nc is not None
        return Client(self.services.nc, tenant=tenant)


async def start(tmp_path: Path, mock: MockBackend, **extra: Any) -> AsyncIterator[Stack]:
    config = make_config(tmp_path, mock, **extra)
    async with Services(config) as services, Gateway(config, url=services.url) as gateway:
        stack = Stack(services, gateway)
        try:
            yield stack
        finally:
            await stack.close()


@pytest.fixture
async def stack(tmp_path: Path, mock: MockBackend) -> AsyncIterator[Stack]:
    async for value in start(tmp_path, mock):
        yield value


async def submitted_count(stack: Stack, tenant: str, request_id: str) -> int:
    assert stack.services.js is not None
    events = await EventLog(stack.services.js).history(tenant, request_id, kind="submitted")
    return len(events)


# ------------------------------------------------------------------ the basics


async def test_sdk_non_streamed_completion_has_the_request_id_and_usage(
    stack: Stack, mock: MockBackend
) -> None:
    sdk = stack.sdk()
    raw = await sdk.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert raw.headers["x-request-id"] == completion.id
    assert completion.model == "chat"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == " ".join(f"tok{i}" for i in range(8))
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    # The id is the request's: the log has it, under the key's tenant.
    async with stack.client() as client:
        result = await client.handle(completion.id).result(timeout=10)
    assert result.text == completion.choices[0].message.content
    assert mock.stats().requests == 1


async def test_sdk_stream_yields_every_token_then_finish_and_usage(stack: Stack) -> None:
    sdk = stack.sdk()
    stream = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " ".join(f"tok{i}" for i in range(8))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


async def test_raw_sse_has_ids_on_every_chunk_and_ends_with_done(stack: Stack) -> None:
    body = {"model": "chat", "messages": MESSAGES, "stream": True}
    async with stack.http() as http:
        response = await http.post("/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    ids = [e.split("\n")[0] for e in events[:-1]]
    assert all(i.startswith("id: ") for i in ids)
    assert ids[0] == "id: 0"
    assert ids[-1] == "id: end"
    first = json.loads(events[1].split("data: ", 1)[1])
    assert first["id"] == response.headers["x-request-id"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_streams_and_completes(stack: Stack) -> None:
    async def curl(*args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "curl",
            "-sS",
            "-N",
            f"{stack.gateway.url}/chat/completions",
            "-H",
            f"Authorization: Bearer {ACME}",
            "-H",
            "Content-Type: application/json",
            *args,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        return out.decode()

    whole = json.loads(await curl("-d", json.dumps({"model": "chat", "messages": MESSAGES})))
    assert whole["choices"][0]["message"]["content"].startswith("tok0")
    streamed = await curl("-d", json.dumps({"model": "chat", "messages": MESSAGES, "stream": True}))
    assert streamed.rstrip().endswith("data: [DONE]")
    assert "tok7" in streamed


async def test_models_lists_the_routes_and_retrieve_finds_one(stack: Stack) -> None:
    sdk = stack.sdk()
    models = [m.id async for m in sdk.models.list()]
    assert models == ["chat"]
    assert (await sdk.models.retrieve("chat")).id == "chat"
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("nope")


async def test_health_and_metrics_answer_without_a_key(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway.url.removesuffix("/v1")) as http:
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        await stack.sdk().chat.completions.create(model="chat", messages=MESSAGES)
        metrics = await http.get("/metrics")
    assert metrics.status_code == 200
    assert 'renqueue_gateway_requests_total{endpoint="POST /v1/chat/completions"' in metrics.text


# ------------------------------------------------------- the full chat format
# The mock (its OpenAI dialect) calls a tool when the last user message says
# ``call <name>`` or tool_choice names one: arguments ``{"text": "tok0 ..."}``.

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK_TOOL: list[Any] = [{"role": "user", "content": "call get_weather for Oslo"}]
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n a picture").decode()


def tool_result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}


async def test_sdk_tool_calling_round_trip_not_streamed(stack: Stack, mock: MockBackend) -> None:
    sdk = stack.sdk()
    completion = await sdk.chat.completions.create(model="chat", messages=ASK_TOOL, tools=[WEATHER])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"text": " ".join(f"tok{i}" for i in range(8))}
    sent = mock.stats().last_request
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    # The SDK's own message goes back as it is, with the tool's result.
    answer = await sdk.chat.completions.create(
        model="chat",
        messages=[*ASK_TOOL, choice.message, tool_result(call.id)],  # type: ignore[list-item]
        tools=[WEATHER],
        tool_choice="none",
    )
    assert answer.choices[0].message.content == " ".join(f"tok{i}" for i in range(8))
    assert answer.choices[0].finish_reason == "stop"
    sent = mock.stats().last_request
    assert sent["messages"][1]["tool_calls"][0]["id"] == call.id
    assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent["messages"][2]["role"] == "tool"
    assert sent["messages"][2]["tool_call_id"] == call.id
    assert sent["tool_choice"] == "none"
    # The request's state has the tool calls too.
    async with stack.http() as http:
        state = (await http.get(f"/requests/{completion.id}")).json()
    message = state["result"]["choices"][0]["message"]
    assert message["tool_calls"][0]["id"] == call.id
    assert message["content"] is None


async def test_sdk_tool_calling_round_trip_streamed(stack: Stack, mock: MockBackend) -> None:
    sdk = stack.sdk()
    # The SDK's stream helper accumulates the tool call's pieces.
    async with sdk.chat.completions.stream(
        model="chat", messages=ASK_TOOL, tools=[WEATHER]
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert isinstance(call, ParsedFunctionToolCall)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["text"].startswith("tok0")
    # Raw chunks: the first piece of the call has id, type and name; later ones do not.
    stream_ = await sdk.chat.completions.create(
        model="chat", messages=ASK_TOOL, tools=[WEATHER], stream=True
    )
    pieces = [
        piece
        async for chunk in stream_
        if chunk.choices
        for piece in chunk.choices[0].delta.tool_calls or ()
    ]
    assert pieces[0].id
    assert pieces[0].type == "function"
    assert pieces[0].function is not None
    assert pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.type is None for p in pieces[1:])
    # The result goes back, streamed: text this time.
    text = []
    stream_ = await sdk.chat.completions.create(
        model="chat",
        messages=[
            *ASK_TOOL,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.function.arguments},
                    }
                ],
            },
            tool_result(call.id),
        ],
        tools=[WEATHER],
        tool_choice="none",
        stream=True,
    )
    async for chunk in stream_:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
    assert "".join(text).startswith("tok0")
    assert mock.stats().last_request["messages"][2]["tool_call_id"] == call.id


async def test_a_resumed_stream_carries_the_tool_calls(stack: Stack) -> None:
    body = {"model": "chat", "messages": ASK_TOOL, "tools": [WEATHER], "stream": True}
    async with stack.http() as http:
        first = await http.post("/chat/completions", json=body)
        rid = first.headers["x-request-id"]
        again = await http.get(f"/requests/{rid}/stream")
        # After the role chunk: everything but it, the first piece included.
        after_role = await http.get(f"/requests/{rid}/stream", headers={"Last-Event-ID": "0"})

    def data(text: str) -> list[dict[str, Any]]:
        return [
            json.loads(event.split("data: ", 1)[1])
            for event in text.split("\n\n")
            if "data: {" in event
        ]

    def calls(text: str) -> list[Any]:
        return [
            piece
            for chunk in data(text)
            for piece in chunk["choices"][0]["delta"].get("tool_calls", ())
        ]

    assert calls(again.text) == calls(first.text)
    assert calls(after_role.text) == calls(first.text)
    assert calls(first.text)[0]["function"]["name"] == "get_weather"
    assert data(again.text)[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_images_reach_the_backend(stack: Stack, mock: MockBackend) -> None:
    content: list[Any] = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
    ]
    done = await stack.sdk().chat.completions.create(
        model="chat", messages=[{"role": "user", "content": content}]
    )
    assert done.choices[0].message.content
    sent = mock.stats().last_request["messages"][0]
    assert sent["content"] == content


async def test_a_json_schema_and_unknown_params_reach_the_backend(
    stack: Stack, mock: MockBackend
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    format_: Any = {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema, "strict": True},
    }
    await stack.sdk().chat.completions.create(
        model="chat",
        messages=MESSAGES,
        response_format=format_,
        presence_penalty=0.5,
        user="end-user-7",
        extra_body={"top_k": 5, "repetition_penalty": 1.1, "min_p": None, "priority": "high"},
    )
    sent = mock.stats().last_request
    assert sent["response_format"] == format_
    assert sent["presence_penalty"] == 0.5
    assert sent["user"] == "end-user-7"
    assert (sent["top_k"], sent["repetition_penalty"]) == (5, 1.1)
    # Ren-Queue's controls and nulls are not the backend's.
    assert "priority" not in sent
    assert "min_p" not in sent


async def test_logprobs_come_back_streamed_and_not(stack: Stack) -> None:
    sdk = stack.sdk()
    done = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, logprobs=True, top_logprobs=2
    )
    logprobs = done.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert [item.token for item in logprobs.content] == [
        f"tok{i}" if i == 0 else f" tok{i}" for i in range(8)
    ]
    assert len(logprobs.content[0].top_logprobs) == 2
    stream = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, logprobs=True, top_logprobs=1, stream=True
    )
    tokens = [
        item.token
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content or ()
    ]
    assert "".join(tokens) == " ".join(f"tok{i}" for i in range(8))


async def test_a_feature_no_backend_of_the_route_has_is_a_400_naming_it(
    tmp_path: Path, mock: MockBackend
) -> None:
    text_only = {"base_url": mock.url, "model": "mock", "features": ["tools"]}
    async for stack in start(tmp_path, mock, backends={"b1": text_only}):
        image: list[Any] = [{"type": "image_url", "image_url": {"url": PNG}}]
        with pytest.raises(openai.BadRequestError) as caught:
            await stack.sdk().chat.completions.create(
                model="chat", messages=[{"role": "user", "content": image}]
            )
        body = caught.value.body
        assert isinstance(body, dict)
        assert (body["code"], body["param"]) == ("unsupported_feature", "messages")
        assert "vision" in body["message"]
        with pytest.raises(openai.BadRequestError) as streamed:
            await stack.sdk().chat.completions.create(
                model="chat", messages=MESSAGES, logprobs=True, stream=True
            )
        assert isinstance(streamed.value.body, dict)
        assert streamed.value.body["param"] == "logprobs"
        # What the backend has passes.
        done = await stack.sdk().chat.completions.create(
            model="chat", messages=ASK_TOOL, tools=[WEATHER]
        )
        assert done.choices[0].finish_reason == "tool_calls"
        assert mock.stats().requests == 1


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_gets_a_tool_call(stack: Stack) -> None:
    body = json.dumps({"model": "chat", "messages": ASK_TOOL, "tools": [WEATHER]})
    proc = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        f"{stack.gateway.url}/chat/completions",
        "-H",
        f"Authorization: Bearer {ACME}",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    message = json.loads(out)["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["type"] == "function"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


# --------------------------------------------------------------------- errors


async def test_a_wrong_or_missing_key_is_a_401_in_openai_shape(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        await stack.sdk("rq-not-a-key").chat.completions.create(model="chat", messages=MESSAGES)
    assert caught.value.status_code == 401
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "invalid_api_key"
    assert "rq-not-a-key" not in caught.value.message
    async with httpx.AsyncClient(base_url=stack.gateway.url) as http:
        response = await http.post("/chat/completions", json={"model": "chat"})
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert response.headers["x-request-id"]


async def test_an_unknown_model_is_a_404_naming_the_param(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await stack.sdk().chat.completions.create(model="gpt-9", messages=MESSAGES)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["param"] == "model"
    assert body["code"] == "model_not_found"


async def test_what_the_gateway_cannot_carry_is_a_400_naming_it(stack: Stack) -> None:
    sdk = stack.sdk()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"n": 2}, "n"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"extra_body": {"tenant": "globex"}}, "tenant"),
        ({"extra_body": {f"p{i}": i for i in range(65)}}, "p64"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
    ]
    for extra, param in cases:
        kwargs: dict[str, Any] = {"model": "chat", "messages": MESSAGES, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(**kwargs)
        body = caught.value.body
        assert isinstance(body, dict)
        assert body["param"] == param, (extra, body)
    # Neutral values ask for nothing and pass.
    done = await sdk.chat.completions.create(
        model="chat",
        messages=[{"role": "developer", "content": [{"type": "text", "text": "hi"}]}, *MESSAGES],
        n=1,
        presence_penalty=0,
        tool_choice="none",
        response_format={"type": "text"},
        max_completion_tokens=3,
    )
    assert done.usage is not None
    assert done.usage.completion_tokens == 3


async def test_hostile_bodies_get_400_or_413_and_the_gateway_keeps_serving(stack: Stack) -> None:
    deep = b'{"model": "chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    bodies: list[tuple[bytes, int]] = [
        (b"{not json", 400),
        (b"[]", 400),
        (b'{"model": 5, "messages": []}', 400),
        (b'{"model": "chat", "messages": "hello"}', 400),
        (b'{"model": "chat", "messages": [{"role": "user", "content": 5}]}', 400),
        (b'{"model": "chat", "messages": [], "stream": "yes"}', 400),
        (b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "tenant": "g"}', 400),
        (deep, 400),
        (
            b'{"model": "chat", "messages": [{"role": "user", "content": "'
            + b"x" * (5 << 20)
            + b'"}]}',
            413,
        ),
        (b"\xff\xfe\x00", 400),
    ]
    async with stack.http() as http:
        for body, status in bodies:
            response = await http.post(
                "/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == status, (body[:60], response.text[:200])
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "Traceback" not in error["message"]
            assert error["code"], error  # never null: a client can tell one refusal from another
        bad_headers = [
            {"X-Priority": "urgent!"},
            {"X-Deadline": "tomorrow"},
            {"X-Request-Timeout": "-1"},
            {"X-Max-Cost": "nan"},
            {"X-Keep-Alive-On-Disconnect": "maybe"},
            {"Idempotency-Key": "x" * 300},
        ]
        for headers in bad_headers:
            response = await http.post(
                "/chat/completions", json={"model": "chat", "messages": MESSAGES}, headers=headers
            )
            assert response.status_code == 400, (headers, response.text)
        ok = await http.post("/chat/completions", json={"model": "chat", "messages": MESSAGES})
    assert ok.status_code == 200


async def test_a_spent_hard_budget_is_a_429_with_retry_after(
    tmp_path: Path, mock: MockBackend
) -> None:
    async for stack in start(
        tmp_path, mock, tenants={"acme": {"daily_budget": 0, "budget": "hard"}}
    ):
        router = stack.services.routers[0]
        for _ in range(400):  # the router refuses only once it holds the projection
            if router.projection is not None:
                break
            await asyncio.sleep(0.025)
        with pytest.raises(openai.RateLimitError) as caught:
            await stack.sdk(max_retries=2).chat.completions.create(model="chat", messages=MESSAGES)
        response = caught.value.response
        assert response.headers["x-should-retry"] == "false"
        retry_after = int(response.headers["retry-after"])
        assert 0 < retry_after <= 86_400
        body = caught.value.body
        assert isinstance(body, dict)
        assert body["code"] == "budget_exhausted"
        # Refused once: the SDK did not retry it.
        rid = response.headers["x-request-id"]
        assert stack.services.js is not None
        log = EventLog(stack.services.js)
        assert len(await log.history("acme", rid, kind="rejected")) == 1
        # Streamed, the same: the status line waits for the first token, so a
        # request refused before any is a real 429, not a 200 with an error inside.
        with pytest.raises(openai.RateLimitError):
            await stack.sdk().chat.completions.create(model="chat", messages=MESSAGES, stream=True)
        # Another tenant is not refused.
        done = await stack.sdk(GLOBEX).chat.completions.create(model="chat", messages=MESSAGES)
        assert done.choices[0].message.content
    assert mock.stats().requests == 1


async def test_an_expired_deadline_is_a_504(stack: Stack, mock: MockBackend) -> None:
    mock.update(ttft=30.0)
    with pytest.raises(openai.InternalServerError) as caught:
        await stack.sdk(max_retries=2).chat.completions.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Request-Timeout": "0.3"}
        )
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "deadline_exceeded"
    # A deadline already past submits nothing.
    async with stack.http() as http:
        past = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "deadline": time.time() - 5},
        )
    assert past.status_code == 504


async def test_a_route_whose_backends_are_all_down_is_a_503_not_a_504(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Nothing could serve the route (its one backend's circuit open, from a
    failed health probe): the expiry is the route's fault, not slowness."""
    mock.update(down=True)
    probe = {"path": "/health", "interval": "100ms", "timeout": "500ms"}
    backend = {
        "b1": {
            "base_url": mock.url,
            "model": "mock",
            "probe": probe,
            "circuit": {"cooloff": "60s"},
        }
    }
    async for stack in start(tmp_path, mock, backends=backend):
        async with stack.client() as client:

            async def opened() -> bool:
                events = await EventLog(client.js).history(SYSTEM_TENANT, "b1")
                states = [e.state for e in events if isinstance(e, CircuitChanged)]
                return states[-1:] == ["open"]

            await until(opened, "the circuit of b1 opened")
        with pytest.raises(openai.InternalServerError) as caught:
            await stack.sdk().chat.completions.create(
                model="chat", messages=MESSAGES, extra_headers={"X-Request-Timeout": "0.5"}
            )
    assert caught.value.status_code == 503
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "no_backend_available"
    assert "every candidate is down" in body["message"]


async def test_a_tenants_in_flight_limit_is_a_429(tmp_path: Path, mock: MockBackend) -> None:
    mock.update(ttft=2.0)
    async for stack in start(tmp_path, mock, gateway={"max_in_flight": 1}):
        async with stack.http() as http:
            body = {"model": "chat", "messages": MESSAGES}
            first = asyncio.create_task(http.post("/chat/completions", json=body))
            for _ in range(400):
                if mock.stats().in_flight:
                    break
                await asyncio.sleep(0.025)
            second = await http.post("/chat/completions", json=body)
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            # Another tenant has its own count.
            other = asyncio.create_task(
                http.post(
                    "/chat/completions", json=body, headers={"Authorization": f"Bearer {GLOBEX}"}
                )
            )
            assert (await first).status_code == 200
            assert (await other).status_code == 200


# ----------------------------------------------------------- controls and tenants


async def test_priority_deadline_and_cost_come_from_headers_or_body(stack: Stack) -> None:
    sdk = stack.sdk()
    deadline = time.time() + 600
    by_header = await sdk.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        extra_headers={"X-Priority": "high", "X-Deadline": str(deadline), "X-Max-Cost": "0.5"},
    )
    by_vllm_field = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, extra_body={"priority": -2, "request_timeout": 60}
    )
    by_name = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, extra_body={"priority": "batch", "max_cost": 1}
    )
    assert stack.services.js is not None
    log = EventLog(stack.services.js)

    async def request_of(rid: str) -> Any:
        [event] = await log.history("acme", rid, kind="submitted")
        assert isinstance(event, Submitted)
        return event.request

    first = await request_of(by_header.id)
    assert (first.priority, first.deadline, first.max_cost) == ("high", deadline, 0.5)
    second = await request_of(by_vllm_field.id)
    assert second.priority == "critical"  # vLLM's -2: two levels above the default
    assert second.deadline is not None
    assert second.deadline == pytest.approx(time.time() + 60, abs=10)
    third = await request_of(by_name.id)
    assert (third.priority, third.max_cost) == ("batch", 1.0)


async def test_the_key_decides_the_tenant_and_ids_are_scoped_by_it(stack: Stack) -> None:
    done = await stack.sdk().chat.completions.create(
        model="chat", messages=MESSAGES, extra_headers={"X-Tenant": "globex"}
    )
    assert await submitted_count(stack, "acme", done.id) == 1
    assert await submitted_count(stack, "globex", done.id) == 0
    async with stack.http(GLOBEX) as theirs:
        for method, path in (
            ("GET", f"/requests/{done.id}"),
            ("GET", f"/requests/{done.id}/stream"),
            ("DELETE", f"/requests/{done.id}"),
        ):
            response = await theirs.request(method, path)
            assert response.status_code == 404, (method, path)
            assert "tok0" not in response.text
    async with stack.http() as mine:
        state = (await mine.get(f"/requests/{done.id}")).json()
    assert state["status"] == "completed"
    assert state["result"]["choices"][0]["message"]["content"] == done.choices[0].message.content


# ---------------------------------------------------------------- idempotency


async def test_an_idempotency_key_makes_a_resend_join_the_same_request(
    stack: Stack, mock: MockBackend
) -> None:
    sdk = stack.sdk()
    headers = {"Idempotency-Key": "order-42"}
    first = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, extra_headers=headers
    )
    again = await sdk.chat.completions.create(
        model="chat", messages=MESSAGES, extra_headers=headers
    )
    assert again.id == first.id
    assert again.choices[0].message.content == first.choices[0].message.content
    assert mock.stats().requests == 1
    assert await submitted_count(stack, "acme", first.id) == 1
    # The key's claim: its body's fingerprint, confirmed (no longer pending) once stored.
    assert stack.services.js is not None
    state = await stack.services.js.key_value(STATE_BUCKET)

    async def confirmed() -> bool:
        entry = await state.latest(claim_key("acme", first.id))
        return entry is not None and len(entry.value) == 64 and entry.value.isalnum()

    await until(confirmed, "the key's claim is confirmed")
    # Scoped by tenant: the same key from another tenant is its own request.
    theirs = await stack.sdk(GLOBEX).chat.completions.create(
        model="chat", messages=MESSAGES, extra_headers=headers
    )
    assert await submitted_count(stack, "globex", theirs.id) == 1
    assert mock.stats().requests == 2
    # The same key with another body is refused, not answered with the first's text.
    with pytest.raises(openai.UnprocessableEntityError):
        await sdk.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "other"}], extra_headers=headers
        )


async def test_past_the_duplicate_window_a_key_still_joins_through_the_log(
    stack: Stack, mock: MockBackend
) -> None:
    """Past ``nats.duplicate_window`` JetStream no longer drops a publish with the
    key's message id: the gateway finds the request's ``submitted`` event in the
    log and joins it, submitting nothing. Here the request is known to the log
    only (its events written as the services write them), never to the requests
    stream's dedupe: exactly what a key looks like once the window is past."""
    key = "long-ago-1"
    rid = id_for_key(key)
    assert stack.services.js is not None
    log = EventLog(stack.services.js)
    async with stack.client() as client:
        request = client.build_request("hello", route="chat", request_id=rid)
    now = time.time()
    await log.append(Submitted(request_id=rid, tenant="acme", at=now, request=request))
    await log.finish(
        Completed(
            request_id=rid,
            tenant="acme",
            at=now,
            backend="b1",
            attempt=1,
            delivery=1,
            text="answered long ago",
            usage=Usage(prompt_tokens=1, completion_tokens=3),
            cost=0.0,
            finish_reason="stop",
        )
    )
    joined = await stack.sdk().chat.completions.create(
        model="chat", messages=MESSAGES, extra_headers={"Idempotency-Key": key}
    )
    assert joined.id == rid
    assert joined.choices[0].message.content == "answered long ago"
    assert mock.stats().requests == 0
    assert await submitted_count(stack, "acme", rid) == 1


async def test_sdk_retries_after_a_timeout_join_the_request_they_repeat(
    stack: Stack, mock: MockBackend
) -> None:
    """The openai SDK resends the same body (``x-stainless-retry-count`` 1, 2, ...)
    and no idempotency key. A kept request is joined by its retries."""
    mock.update(ttft=2.0)
    sdk = stack.sdk(max_retries=6, timeout=0.7)
    done = await sdk.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        extra_headers={"X-Keep-Alive-On-Disconnect": "true"},
    )
    assert done.choices[0].message.content
    assert mock.stats().requests == 1
    assert await submitted_count(stack, "acme", done.id) == 1
    # With an idempotency key (kept on disconnect by default), the same.
    keyed = await sdk.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "again"}],
        extra_headers={"Idempotency-Key": "retry-me"},
    )
    assert keyed.choices[0].message.content
    assert mock.stats().requests == 2


async def test_an_sdk_retry_reaching_another_gateway_process_joins_the_request(
    stack: Stack, mock: MockBackend, tmp_path: Path
) -> None:
    """Gateways behind a load balancer: the first try went to one, its SDK
    retry (same body, ``x-stainless-retry-count`` 1, no key) to another. The
    retry joins the request the first try made: one request, one call."""
    mock.update(ttft=1.0)
    config = make_config(tmp_path, mock)
    body = {"model": "chat", "messages": [{"role": "user", "content": "one call only"}]}
    async with Gateway(config, url=stack.services.url) as other, stack.http() as first_http:
        first = asyncio.create_task(first_http.post("/chat/completions", json=body))

        async def shared() -> bool:
            assert stack.services.js is not None
            kv = await stack.services.js.key_value(STATE_BUCKET)
            return any(key.startswith("gw.acme.") for key in await kv.keys())

        await until(shared, "the first try's fingerprint was shared")
        async with httpx.AsyncClient(
            base_url=other.url,
            headers={"Authorization": f"Bearer {ACME}", "x-stainless-retry-count": "1"},
            timeout=30,
        ) as retry_http:
            retried = await retry_http.post("/chat/completions", json=body)
        answered = await first
    assert answered.status_code == retried.status_code == 200, retried.text
    assert answered.json()["id"] == retried.json()["id"]
    assert await submitted_count(stack, "acme", answered.json()["id"]) == 1
    assert mock.stats().requests == 1


async def test_a_fingerprint_the_bucket_refuses_is_written_again_and_a_retry_elsewhere_joins(
    stack: Stack, mock: MockBackend, tmp_path: Path
) -> None:
    """The fingerprint goes out with the request's publish; when the bucket
    refuses it (here: rq-state's largest message made smaller than the
    entry), a supervised job writes it again once the bucket takes it, and an
    SDK retry reaching another gateway process still joins the first try's
    request (the test's own stack: the bucket refuses every writer meanwhile)."""
    js = stack.services.js
    assert js is not None
    bucket = f"KV_{STATE_BUCKET}"
    kept = (await js.context.stream_info(bucket)).config
    await js.context.update_stream(dataclasses.replace(kept, max_msg_size=16))
    config = make_config(tmp_path, mock)
    body = {"model": "chat", "messages": [{"role": "user", "content": "refused at first"}]}
    async with Gateway(config, url=stack.services.url) as other, stack.http() as first_http:
        first = asyncio.create_task(first_http.post("/chat/completions", json=body))

        async def handed_to_a_job() -> bool:
            return bool(stack.gateway.supervisor.jobs("share-"))

        await until(handed_to_a_job, "the refused fingerprint was handed to a job")
        await js.context.update_stream(kept)

        async def shared() -> bool:
            kv = await js.key_value(STATE_BUCKET)
            return any(key.startswith("gw.acme.") for key in await kv.keys())

        await until(shared, "the job wrote the fingerprint")
        answered = await first
        async with httpx.AsyncClient(
            base_url=other.url,
            headers={"Authorization": f"Bearer {ACME}", "x-stainless-retry-count": "1"},
            timeout=30,
        ) as retry_http:
            retried = await retry_http.post("/chat/completions", json=body)
    assert answered.status_code == retried.status_code == 200, retried.text
    assert answered.json()["id"] == retried.json()["id"]
    assert await submitted_count(stack, "acme", answered.json()["id"]) == 1
    assert mock.stats().requests == 1


async def test_a_fingerprint_written_again_late_names_the_newest_request_of_its_body(
    stack: Stack, mock: MockBackend
) -> None:
    """Two first tries of one body while the bucket refuses writes: the job
    that writes the fingerprint once the bucket takes it shares the newer
    request, not the older one it was started for (an SDK retry of the newer
    one must join it, not the older one)."""
    js = stack.services.js
    assert js is not None
    bucket = f"KV_{STATE_BUCKET}"
    kept = (await js.context.stream_info(bucket)).config
    await js.context.update_stream(dataclasses.replace(kept, max_msg_size=16))
    body = {"model": "chat", "messages": [{"role": "user", "content": "said twice"}]}
    async with stack.http() as http:
        older = await http.post("/chat/completions", json=body)
        assert stack.gateway.supervisor.jobs("share-")
        newer = await http.post("/chat/completions", json=body)
    assert older.status_code == newer.status_code == 200, newer.text
    assert older.json()["id"] != newer.json()["id"]
    await js.context.update_stream(kept)
    kv = await js.key_value(STATE_BUCKET)

    async def written() -> bool:
        return not stack.gateway.supervisor.jobs("share-")

    await until(written, "the job wrote the fingerprint")
    (key,) = [key for key in await kv.keys() if key.startswith("gw.acme.")]
    assert (await kv.get(key)).value.decode() == newer.json()["id"]


async def test_a_fingerprint_whose_ack_does_not_come_in_time_is_written_again(
    stack: Stack,
    mock: MockBackend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The other fallback: the fingerprint's ack not read in time (the wait
    made nothing here, so it never is) hands the write to the job, and an SDK
    retry reaching another gateway process joins the first try's request."""
    monkeypatch.setattr(_submissions, "_SHARE_ACK_WAIT", 0.0)
    caplog.set_level(logging.INFO, logger="renqueue.gateway")
    js = stack.services.js
    assert js is not None
    config = make_config(tmp_path, mock)
    body = {"model": "chat", "messages": [{"role": "user", "content": "no ack in time"}]}
    async with Gateway(config, url=stack.services.url) as other, stack.http() as first_http:
        answered = await first_http.post("/chat/completions", json=body)

        async def written_again() -> bool:
            kv = await js.key_value(STATE_BUCKET)
            keys = [key for key in await kv.keys() if key.startswith("gw.acme.")]
            handed = any("no ack in time" in str(r.msg) for r in caplog.records)
            return handed and bool(keys) and not stack.gateway.supervisor.jobs("share-")

        await until(written_again, "the job wrote the fingerprint")
        async with httpx.AsyncClient(
            base_url=other.url,
            headers={"Authorization": f"Bearer {ACME}", "x-stainless-retry-count": "1"},
            timeout=30,
        ) as retry_http:
            retried = await retry_http.post("/chat/completions", json=body)
    assert answered.status_code == retried.status_code == 200, retried.text
    assert answered.json()["id"] == retried.json()["id"]
    assert mock.stats().requests == 1


# ---------------------------------------------------------- disconnect and resume


async def cancelled_events(stack: Stack, tenant: str) -> asyncio.Queue[Any]:
    """Every ``cancel_requested`` event of ``tenant`` from now on (core NATS sees
    JetStream publishes: those to ``RQ_CANCELS``, which the log sources)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    assert stack.services.nc is not None

    async def on(msg: Any) -> None:
        queue.put_nowait(EVENT_DECODER.decode(msg.data))

    await stack.services.nc.subscribe(f"rq.cancel.{tenant}.*", cb=on)
    return queue


async def test_a_client_timeout_disconnects_and_cancels_its_request(
    stack: Stack, mock: MockBackend
) -> None:
    mock.update(ttft=30.0)
    cancelled = await cancelled_events(stack, "acme")
    with pytest.raises(openai.APITimeoutError):
        await stack.sdk(timeout=0.5).chat.completions.create(model="chat", messages=MESSAGES)
    event = await asyncio.wait_for(cancelled.get(), 15)
    assert event.reason == "client disconnected"
    async with stack.client() as client:
        with pytest.raises(RequestCancelledError):
            await client.handle(event.request_id).result(timeout=10)


async def test_a_streaming_client_that_disconnects_cancels_unless_it_asked_to_keep(
    stack: Stack, mock: MockBackend
) -> None:
    mock.update(tokens_per_second=20, output_tokens=200)
    cancelled = await cancelled_events(stack, "acme")
    body = {"model": "chat", "messages": MESSAGES, "stream": True}
    async with (
        stack.http() as http,
        http.stream("POST", "/chat/completions", json=body) as response,
    ):
        rid = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if "tok1" in line:
                break
    event = await asyncio.wait_for(cancelled.get(), 15)
    assert event.request_id == rid
    async with stack.client() as client:
        with pytest.raises(RequestCancelledError):
            await client.handle(rid).result(timeout=10)
        # Kept: the same disconnect leaves it running to the end.
        async with stack.http() as http:
            headers = {"X-Keep-Alive-On-Disconnect": "true"}
            mock.update(tokens_per_second=200, output_tokens=40)
            async with http.stream(
                "POST", "/chat/completions", json=body, headers=headers
            ) as response:
                kept = response.headers["x-request-id"]
                async for line in response.aiter_lines():
                    if "tok1" in line:
                        break
        result = await client.handle(kept).result(timeout=15)
    assert result.usage.completion_tokens == 40


async def test_a_lost_stream_resumes_from_last_event_id_without_loss_or_repeat(
    stack: Stack, mock: MockBackend
) -> None:
    mock.update(tokens_per_second=50, output_tokens=30)
    body = {"model": "chat", "messages": MESSAGES, "stream": True}
    got: list[str] = []
    last_id = ""
    async with stack.http() as http:
        headers = {"X-Keep-Alive-On-Disconnect": "true"}
        async with http.stream("POST", "/chat/completions", json=body, headers=headers) as response:
            rid = response.headers["x-request-id"]
            async for event in _events(response):
                last_id = event["id"]
                got.append(event["content"])
                if len(got) == 6:
                    break  # the connection is lost here
        async with http.stream(
            "GET", f"/requests/{rid}/stream", headers={"Last-Event-ID": last_id}
        ) as resumed:
            assert resumed.status_code == 200
            rest = [event async for event in _events(resumed)]
        # From the start, after the request ended: the whole text again.
        whole = await http.get(f"/requests/{rid}/stream")
        state = (await http.get(f"/requests/{rid}")).json()
    text = "".join(got) + "".join(e["content"] for e in rest)
    assert text == " ".join(f"tok{i}" for i in range(30))
    assert rest[-1]["id"] == "end"
    assert state["status"] == "completed"
    assert state["result"]["choices"][0]["message"]["content"] == text
    assert whole.text.rstrip().endswith("data: [DONE]")
    assert mock.stats().requests == 1


def _created(text: str) -> set[int]:
    """The ``created`` of every chunk of an SSE answer."""
    return {
        json.loads(event.split("data: ", 1)[1])["created"]
        for event in text.split("\n\n")
        if "data: {" in event
    }


async def test_every_chunk_of_every_stream_of_a_request_has_its_creation_time(
    stack: Stack, mock: MockBackend
) -> None:
    mock.update(output_tokens=5)
    # Made an hour ago (by its submitted_at): a resume now still says then.
    async with stack.client() as client:
        built = client.build_request(MESSAGES, route="chat")
        made = built.submitted_at - 3600
        handle = await client.submit_request(msgspec.structs.replace(built, submitted_at=made))
        await handle.result(timeout=15)
    body = {"model": "chat", "messages": MESSAGES, "stream": True}
    async with stack.http() as http:
        whole = await http.get(f"/requests/{handle.id}/stream")
        resumed = await http.get(f"/requests/{handle.id}/stream", headers={"Last-Event-ID": "0"})
        state = (await http.get(f"/requests/{handle.id}")).json()
        # Through the gateway: the first stream, its resume, and the request agree.
        streamed = await http.post("/chat/completions", json=body)
        rid = streamed.headers["x-request-id"]
        again = await http.get(f"/requests/{rid}/stream", headers={"Last-Event-ID": "0"})
        submitted = (await http.get(f"/requests/{rid}")).json()
    assert _created(whole.text) == _created(resumed.text) == {int(made)} == {state["created"]}
    assert _created(streamed.text) == _created(again.text) == {submitted["created"]}


async def test_delete_cancels_a_running_request(stack: Stack, mock: MockBackend) -> None:
    mock.update(ttft=30.0)
    async with stack.http() as http:
        body = {"model": "chat", "messages": MESSAGES}
        call = asyncio.create_task(
            http.post("/chat/completions", json=body, headers={"Idempotency-Key": "to-delete"})
        )
        rid = id_for_key("to-delete")
        for _ in range(400):
            if mock.stats().in_flight:
                break
            await asyncio.sleep(0.025)
        deleted = await http.delete(f"/requests/{rid}")
        assert deleted.status_code == 202
        answer = await call
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "request_cancelled"
        again = await http.delete(f"/requests/{rid}")
        assert again.json()["status"] == "cancelled"
        missing = await http.delete("/requests/no-such-request")
        assert missing.status_code == 404


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, str]]:
    """The text chunks of an SSE answer: ``{"id", "content"}`` each (role chunk and
    [DONE] left out; the finish chunk has content "")."""
    event_id = ""
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            data = msgspec.json.decode(line[6:])
            assert "error" not in data, data
            if event_id == "0":
                continue
            choices = data["choices"]
            content = choices[0]["delta"].get("content") or "" if choices else ""
            yield {"id": event_id, "content": content}


async def test_a_run_restarted_after_text_was_streamed_ends_the_stream_with_an_error(
    stack: Stack, mock: MockBackend
) -> None:
    """OpenAI's stream cannot take text back: a request whose run broke after some
    tokens and ran again ends the stream with ``stream_restarted``; the request
    goes on, and a fresh resume streams the run that answered."""
    mock.update(faults=FaultSpec(script=("break",), after_tokens=3))
    stream = await stack.sdk().chat.completions.create(model="chat", messages=MESSAGES, stream=True)
    seen: list[str] = []

    async def read_all() -> None:
        async for chunk in stream:
            seen.append(chunk.id)

    with pytest.raises(openai.APIError) as caught:
        await read_all()
    assert caught.value.code == "stream_restarted"
    assert len(seen) >= 2  # the role chunk and text of the first run came first
    rid = seen[0]
    async with stack.client() as client:
        result = await client.handle(rid).result(timeout=15)
    async with stack.http() as http:
        resumed = await http.get(f"/requests/{rid}/stream")
    events = [e for e in resumed.text.split("\n\n") if e.startswith("id: ")]
    texts = [
        json.loads(e.split("data: ", 1)[1])["choices"][0]["delta"].get("content") or ""
        for e in events
        if not e.startswith("id: usage")
    ]
    assert "".join(texts) == result.text
    assert "stream_restarted" not in resumed.text
    assert resumed.text.rstrip().endswith("data: [DONE]")


# ------------------------------------------------------ review findings (issue #11)


async def test_a_retry_right_after_a_disconnect_runs_anew_not_into_the_cancel(
    stack: Stack, mock: MockBackend
) -> None:
    """The first try's client went away (its request is being cancelled); the
    SDK's retry comes at once. It must not join the request being cancelled
    and get a 409 it would not retry."""
    mock.update(ttft=3.0)
    body = {"model": "chat", "messages": [{"role": "user", "content": "retry-race"}]}
    async with stack.http() as http:
        first = asyncio.create_task(http.post("/chat/completions", json=body))

        async def running() -> bool:
            return mock.stats().in_flight > 0

        await until(running, "the first try reached the backend")
        first.cancel()  # the SDK's time-out: the connection closes
        with pytest.raises(asyncio.CancelledError):
            await first
        mock.update(ttft=0.0)
        retried = await http.post(
            "/chat/completions", json=body, headers={"x-stainless-retry-count": "1"}
        )
    assert retried.status_code == 200, retried.text


async def test_a_lost_publish_ack_and_the_sdks_retry_make_one_request(
    stack: Stack, mock: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish was stored but its ack was lost (a 503 the SDK retries):
    the retry joins the stored request instead of making (and paying for) a
    second one."""
    real = Client._publish
    published: list[str] = []

    async def ack_lost_once(self: Client, request: Any, trace: Any) -> bool:
        duplicate = await real(self, request, trace)
        published.append(request.id)
        if len(published) == 1:
            raise TimeoutError("ack lost")
        return duplicate

    monkeypatch.setattr(Client, "_publish", ack_lost_once)
    done = await stack.sdk(max_retries=2).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "stored once"}]
    )
    assert done.id == published[0], published
    assert await submitted_count(stack, "acme", published[0]) == 1


async def test_an_idempotency_key_resent_at_once_with_another_body_is_a_422(
    stack: Stack, mock: MockBackend
) -> None:
    mock.update(ttft=1.0)
    headers = {"Idempotency-Key": "same-key"}
    async with stack.http() as http:
        one, other = await asyncio.gather(
            http.post(
                "/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "A"}]},
                headers=headers,
            ),
            http.post(
                "/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "B"}]},
                headers=headers,
            ),
        )
    assert sorted([one.status_code, other.status_code]) == [200, 422], (one.text, other.text)


async def test_a_keyed_submit_whose_retry_finds_another_body_under_its_key_is_a_422(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #29: the Client publishes a submit again when its ack is lost, and
    a retry that finds the request stored is no duplicate (it found its own
    first try, all but surely). A resend of the key with another body stored
    at that moment looks the same on the wire, so the gateway checks the body
    then as for a duplicate: here the other body won, and this call is a 422,
    not that body's answer."""
    real = JetStream.publish
    raced: list[str] = []

    async def another_body_first(
        self: JetStream, subject: str, payload: bytes = b"", **kwargs: Any
    ) -> Any:
        if subject.startswith("rq.req.") and not raced:
            raced.append(subject)
            other = msgspec.json.decode(payload)
            other["messages"] = [{"role": "user", "content": "B"}]
            other["metadata"]["rq_body_sha256"] = "0" * 64  # another body's fingerprint
            await real(self, subject, msgspec.json.encode(other), **kwargs)
            raise NatsTimeoutError("nats: timeout")  # and this try's own ack is lost
        return await real(self, subject, payload, **kwargs)

    monkeypatch.setattr(JetStream, "publish", another_body_first)
    with pytest.raises(openai.UnprocessableEntityError):
        await stack.sdk().chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "A"}],
            extra_headers={"Idempotency-Key": "raced"},
        )
    assert raced


def joined_by_key() -> float:
    return (
        prometheus_client.REGISTRY.get_sample_value(
            "renqueue_gateway_retries_joined_total", {"how": "idempotency_key"}
        )
        or 0.0
    )


@contextlib.asynccontextmanager
async def unread_stack(
    tmp_path: Path, mock: MockBackend, **extra: Any
) -> AsyncIterator[tuple[Stack, Config]]:
    """A stack whose requests no router reads (none runs): a request stays in
    the requests stream, and no ``submitted`` event is ever written for it."""
    config = make_config(tmp_path, mock, **extra)
    async with (
        Services(config, routers=0, backends=[]) as services,
        Gateway(config, url=services.url) as gateway,
    ):
        stack = Stack(services, gateway)
        try:
            nats = {**extra.get("nats", {}), "url": services.url}
            yield stack, make_config(tmp_path, mock, **{**extra, "nats": nats})
        finally:
            await stack.close()


async def test_a_key_resent_with_another_body_while_no_router_has_read_it_is_a_422(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Review i33: a resend of a key whose request no router had read yet (no
    ``submitted`` event to compare bodies with) was checked for about 3 s, then
    the key was trusted: another body joined the first request and was answered
    with its text. The key's claim (its body's fingerprint, written before the
    first publish) refuses it at once, however long the first waits unread."""
    headers = {"Idempotency-Key": "unread-1"}
    rid = id_for_key("unread-1")
    async with unread_stack(tmp_path, mock) as (stack, routed), stack.http() as http:
        first = asyncio.create_task(
            http.post(
                "/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "A"}]},
                headers=headers,
            )
        )

        async def stored() -> bool:
            return stack.gateway._submissions.recent("acme", rid) is not None

        await until(stored, "the first request is stored")
        joined = joined_by_key()
        other = asyncio.create_task(
            http.post(
                "/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "B"}]},
                headers=headers,
            )
        )

        async def answered_or_joined() -> bool:
            return other.done() or joined_by_key() > joined

        await until(answered_or_joined, "the resend is answered, or joins the first")
        if not other.done():
            # It joined the first request (the bug): a router answers both, so
            # that this test ends with what the resend was answered.
            async with Services(routed, routers=1, provision_streams=False):
                answer = await other
        else:
            answer = await other
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "idempotency_key_reused"
    assert mock.stats().requests <= 1


async def test_past_a_keys_claim_a_resend_is_checked_against_the_log_never_joined_unchecked(
    tmp_path: Path, mock: MockBackend
) -> None:
    """The key's claim lives two duplicate windows (``nats.duplicate_window``).
    Past it (its entry gone: deleted here, as its expiry removes it) while
    JetStream still knows the id and no router has read the request, a resend's
    publish is a duplicate of a request whose body nothing on record tells: it
    is a 409 ``idempotency_key_unverified`` (retried by the SDKs), never joined.
    Once a router has read it, its ``submitted`` event tells: the same body
    joins it, another is a 422."""
    key = "claim-gone-1"
    rid = id_for_key(key)
    headers = {"Idempotency-Key": key}
    a = {"model": "chat", "messages": [{"role": "user", "content": "A"}]}
    b = {"model": "chat", "messages": [{"role": "user", "content": "B"}]}
    async with unread_stack(tmp_path, mock) as (stack, routed):
        assert stack.services.js is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        name = claim_key("acme", rid)
        async with stack.http() as http:
            first = asyncio.create_task(http.post("/chat/completions", json=a, headers=headers))

            async def stored() -> bool:
                return stack.gateway._submissions.recent("acme", rid) is not None

            await until(stored, "the first request is stored")
            await state.delete(name)  # past the claim's life
            unverified = await http.post("/chat/completions", json=b, headers=headers)

            async def unclaimed() -> bool:
                entry = await state.latest(name)
                return entry is not None and entry.operation is not None

            # The resend's own claim, of a body not known to be the stored one, is taken back.
            await until(unclaimed, "the resend's claim is taken back")
            async with Services(routed, routers=1, provision_streams=False):
                done = await first
                other = await http.post("/chat/completions", json=b, headers=headers)
                same = await http.post("/chat/completions", json=a, headers=headers)
    assert unverified.status_code == 409, unverified.text
    assert unverified.json()["error"]["code"] == "idempotency_key_unverified"
    assert unverified.headers["retry-after"] == "1"
    assert done.status_code == 200, done.text
    assert other.status_code == 422, other.text
    assert same.status_code == 200, same.text
    assert same.json()["id"] == done.json()["id"] == rid
    assert mock.stats().requests == 1


async def test_a_key_whose_request_was_stored_without_a_claim_is_never_joined_unchecked(
    tmp_path: Path, mock: MockBackend
) -> None:
    """A request stored under a key's id by a publisher that took no claim (a
    gateway of an earlier version; here a Client naming the id), and not read by
    a router: a call of the key claims it pending and finds the request stored,
    with no body to compare; so does a call of the same body that finds that
    pending claim. Both are a 409 ``idempotency_key_unverified``, neither joins."""
    key = "no-claim-1"
    rid = id_for_key(key)
    headers = {"Idempotency-Key": key}
    body = {"model": "chat", "messages": [{"role": "user", "content": "B"}]}
    async with unread_stack(tmp_path, mock) as (stack, _routed), stack.http() as http:
        async with stack.client() as client:
            await client.submit("A", route="chat", request_id=rid)
        answers = await asyncio.gather(
            http.post("/chat/completions", json=body, headers=headers),
            http.post("/chat/completions", json=body, headers=headers),
        )
    for answer in answers:
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "idempotency_key_unverified"


async def fill(state: KeyValue) -> None:
    """Fill a bucket up to its last few bytes: big entries, then the smallest."""
    for size, prefix in ((1024, "big"), (1, "f")):
        for n in range(100_000):
            try:
                await state.put(f"{prefix}.{n}", b"x" * size)
            except StoreFullError:
                break
        else:
            pytest.fail("the bucket never filled")


async def test_a_keyed_call_is_a_503_store_full_when_its_claim_cannot_be_written(
    tmp_path: Path, mock: MockBackend
) -> None:
    """The claim is written before the publish: with the ``rq-state`` bucket at
    its ``max_bytes`` (it refuses new entries) a keyed call stores nothing and is
    a 503 ``store_full``, as a full requests stream makes it, never a 500."""
    async for stack in start(tmp_path, mock, nats={"state": {"max_bytes": "64KB"}}):
        assert stack.services.js is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        await fill(state)
        async with stack.http() as http:
            answer = await http.post(
                "/chat/completions",
                json={"model": "chat", "messages": MESSAGES},
                headers={"Idempotency-Key": "no-room-1"},
            )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "store_full"
    assert mock.stats().requests == 0


async def test_a_keyed_call_that_stored_nothing_gives_its_claim_back(
    tmp_path: Path, mock: MockBackend
) -> None:
    """A keyed call the broker refuses (here the tenant's backlog is full:
    ``router.tenant_backlog``) stored nothing under its key: its claim is taken
    back, so the key may be sent again with another body (refused here for the
    backlog again, 429, not 422 for the body)."""
    key = "refused-1"
    name = claim_key("acme", id_for_key(key))
    headers = {"Idempotency-Key": key}
    async with (
        unread_stack(tmp_path, mock, router={"tenant_backlog": 1}) as (stack, _routed),
        stack.http() as http,
    ):
        assert stack.services.js is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        async with stack.client() as client:
            await client.submit("fills the backlog", route="chat")
        full = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "A"}]},
            headers=headers,
        )

        async def given_back() -> bool:
            entry = await state.latest(name)
            return entry is not None and entry.operation is not None

        await until(given_back, "the refused call's claim is given back")
        other = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "B"}]},
            headers=headers,
        )
    assert full.status_code == 429, full.text
    assert full.json()["error"]["code"] == "tenant_backlog_full"
    assert other.status_code == 429, other.text
    assert other.json()["error"]["code"] == "tenant_backlog_full"


async def test_a_refused_call_leaves_nothing_in_rq_state_past_its_entrys_life(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Review i33: a call the broker refuses gives back what it wrote in
    ``rq-state`` (a keyed call its key's claim, an unkeyed one its shared body
    fingerprint), a KV delete: a delete marker, which ``rq-state`` (no
    ``max_age``) kept for ever, one per key, however many calls were refused; a
    tenant could fill the bucket with them (cheap 429s or 400s, a new key each),
    and with it the projection's room. The marker expires as the entry would."""
    key = "refused-gone-1"
    extra: dict[str, Any] = {
        "router": {"tenant_backlog": 1},
        "nats": {"duplicate_window": "1s"},  # the claim: 2 s, the fingerprint: 1 s
    }
    async with (
        unread_stack(tmp_path, mock, **extra) as (stack, _routed),
        stack.http() as http,
    ):
        assert stack.services.js is not None
        js = stack.services.js
        async with stack.client() as client:
            await client.submit("fills the backlog", route="chat")
        keyed = {"model": "chat", "messages": [{"role": "user", "content": "A"}]}
        plain = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "B"}]})
        refused = [
            await http.post("/chat/completions", json=keyed, headers={"Idempotency-Key": key}),
            await http.post(
                "/chat/completions",
                content=plain.encode(),
                headers={"content-type": "application/json"},
            ),
        ]
        names = [
            claim_key("acme", id_for_key(key)),
            shared_key("acme", fingerprint("acme", plain.encode())),
        ]

        async def gone() -> bool:
            for name in names:
                with contextlib.suppress(NatsNotFoundError):
                    await js.get_last_msg(f"KV_{STATE_BUCKET}", f"$KV.{STATE_BUCKET}.{name}")
                    return False
            return True

        await until(gone, "rq-state keeps nothing of the refused calls")
    assert [r.status_code for r in refused] == [429, 429], [r.text for r in refused]


async def test_a_key_whose_claim_is_confirmed_is_joined_without_publishing_again(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Review i33: a call of a key whose claim is confirmed (the request under
    it is stored, with this body) published the request again, to be told it
    was a duplicate. Past the duplicate window (JetStream no longer knows the
    id) and before a router read it (no ``submitted`` event), that publish
    stored the request a second time under the same id, while the claim (two
    windows) said it was stored. It joins, publishing nothing."""
    key = "confirmed-1"
    name = claim_key("acme", id_for_key(key))
    headers = {"Idempotency-Key": key}
    body = {"model": "chat", "messages": [{"role": "user", "content": "A"}]}
    async with unread_stack(tmp_path, mock) as (stack, _routed), stack.http() as http:
        assert stack.services.js is not None
        assert stack.services.nc is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        first = asyncio.create_task(http.post("/chat/completions", json=body, headers=headers))

        async def confirmed() -> bool:
            entry = await state.latest(name)
            return entry is not None and entry.operation is None and len(entry.value) == 64

        await until(confirmed, "the key's claim is confirmed")
        published: list[bytes] = []

        async def on(msg: Any) -> None:
            published.append(msg.data)

        # Core NATS sees every publish to the requests stream, a duplicate too.
        await stack.services.nc.subscribe("rq.req.>", cb=on)
        await stack.services.nc.flush()
        joined = joined_by_key()
        again = asyncio.create_task(http.post("/chat/completions", json=body, headers=headers))

        async def has_joined() -> bool:
            return joined_by_key() > joined or again.done()

        await until(has_joined, "the second call joins the first's request")
        await stack.services.nc.flush()
        for call in (first, again):
            call.cancel()
        await asyncio.gather(first, again, return_exceptions=True)
    assert joined_by_key() == joined + 1
    assert published == []


async def test_a_claim_left_pending_by_a_gateway_gone_before_its_publish_is_taken_up(
    tmp_path: Path, mock: MockBackend
) -> None:
    """A gateway killed between a key's claim and its publish leaves the claim
    pending, nothing stored: the next call of the same body stores the request
    and confirms the claim (no 409, no wait). (One of another body takes the
    claim over after a grace: tests/test_gateway_idempotency.py.)"""
    key = "orphan-1"
    rid = id_for_key(key)
    name = claim_key("acme", rid)
    headers = {"Idempotency-Key": key}
    body = json.dumps({"model": "chat", "messages": MESSAGES}).encode()
    print_ = fingerprint("acme", body)
    async for stack in start(tmp_path, mock):
        assert stack.services.js is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        await state.create(name, b"?" + print_.encode(), msg_ttl=60)  # the dead gateway's
        async with stack.http() as http:
            answer = await http.post(
                "/chat/completions",
                content=body,
                headers={**headers, "content-type": "application/json"},
            )

        async def confirmed(state: KeyValue = state) -> bool:
            entry = await state.latest(name)
            return entry is not None and entry.value == print_.encode()

        await until(confirmed, "the claim is confirmed")
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == rid
    assert mock.stats().requests == 1


async def test_a_claim_left_pending_after_its_request_was_stored_is_joined_by_its_body(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Review rev-i33-gw (finding 3): a gateway killed, or a handler cancelled,
    after its keyed publish stored the request and before the claim was
    confirmed left the claim pending. The next call of the same body waited
    ~3 s, then got 409s until a router read the request (minutes behind a deep
    backlog), so the SDK gave up on a request that was queued. A pending claim
    of this very body, with the request stored, is joined (as before claims);
    another body is still a 422."""
    key = "stored-then-gone"
    rid = id_for_key(key)
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    body = json.dumps({"model": "chat", "messages": MESSAGES}).encode()
    print_ = fingerprint("acme", body)
    async with unread_stack(tmp_path, mock) as (stack, routed), stack.http() as http:
        assert stack.services.js is not None
        assert stack.services.nc is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        # What the gone gateway left: its claim, pending, and its request, stored.
        await state.create(claim_key("acme", rid), b"?" + print_.encode(), msg_ttl=60)
        async with Client(stack.services.nc, tenant="acme") as client:
            built = client.build_request(
                MESSAGES, route="chat", request_id=rid, metadata={BODY_KEY: print_}
            )
            await client.submit_request(built)
        joined = joined_by_key()
        call = asyncio.create_task(http.post("/chat/completions", content=body, headers=headers))

        async def answered_or_joined() -> bool:
            return call.done() or joined_by_key() > joined

        await until(answered_or_joined, "the call is answered, or joins the stored request")
        assert not call.done(), call.result().text  # joined, not a 409
        other = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "B"}]},
            headers={"Idempotency-Key": key},
        )
        assert other.status_code == 422, other.text
        async with Services(routed, routers=1, provision_streams=False):
            answer = await call
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == rid
    assert mock.stats().requests == 1


async def test_calls_of_one_key_and_body_at_once_join_one_request_while_none_is_read(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Two calls of one key and one body at the same moment, no router reading:
    one stores the request and confirms the key's claim, the other joins it
    (having found the claim confirmed, or pending and then confirmed), never a
    409 for a body that is its own."""
    key = "twice-at-once"
    headers = {"Idempotency-Key": key}
    body = {"model": "chat", "messages": [{"role": "user", "content": "A"}]}
    async with unread_stack(tmp_path, mock) as (stack, _routed), stack.http() as http:
        joined = joined_by_key()
        calls = [
            asyncio.create_task(http.post("/chat/completions", json=body, headers=headers))
            for _ in range(2)
        ]

        async def one_joined_or_answered() -> bool:
            return joined_by_key() > joined or any(call.done() for call in calls)

        await until(one_joined_or_answered, "a call joins the other's request, or is answered")
        answered = [call.result().text for call in calls if call.done()]
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    assert answered == []
    assert joined_by_key() == joined + 1


async def test_resumed_streams_count_against_the_in_flight_limit(
    tmp_path: Path, mock: MockBackend
) -> None:
    mock.update(ttft=5.0)
    async for stack in start(tmp_path, mock, gateway={"max_in_flight": 1}):
        async with stack.http() as http:
            body = {"model": "chat", "messages": MESSAGES}
            first = asyncio.create_task(
                http.post(
                    "/chat/completions", json=body, headers={"X-Keep-Alive-On-Disconnect": "true"}
                )
            )

            async def running() -> bool:
                return mock.stats().in_flight > 0

            await until(running, "the request reached the backend")
            [(_tenant, request_id)] = list(stack.gateway._submissions._recent)
            resumed = await http.get(f"/requests/{request_id}/stream")
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
    assert resumed.status_code == 429
    assert resumed.json()["error"]["code"] == "too_many_in_flight"


async def test_a_body_over_the_brokers_largest_message_is_a_413_not_retried(
    tmp_path: Path, mock: MockBackend
) -> None:
    image = "data:image/png;base64," + base64.b64encode(b"\0" * (7 << 20)).decode()
    body = {
        "model": "chat",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}
        ],
    }
    async for stack in start(tmp_path, mock, gateway={"max_body": 16 << 20}):
        async with stack.http() as http:
            answer = await http.post("/chat/completions", json=body)
    assert answer.status_code == 413, answer.text
    assert answer.headers["x-should-retry"] == "false"
    assert mock.stats().requests == 0


async def test_metadata_leaves_room_for_the_gateways_own_entries(stack: Stack) -> None:
    many = {f"k{i}": "v" for i in range(62)}
    async with stack.http() as http:
        keyed = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "metadata": many, "user": "u1"},
            headers={"Idempotency-Key": "md-1"},
        )
        over = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "metadata": {**many, "a": "1"}},
        )
        ours = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": MESSAGES, "metadata": {"rq_body_sha256": "x"}},
        )
    assert keyed.status_code == 200, keyed.text
    assert over.status_code == 400
    assert over.json()["error"]["param"] == "metadata"
    assert ours.status_code == 400


async def test_a_tenant_cannot_submit_above_its_max_priority(
    tmp_path: Path, mock: MockBackend
) -> None:
    async for stack in start(tmp_path, mock, tenants={"acme": {"max_priority": "normal"}}):
        sdk = stack.sdk()
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await sdk.chat.completions.create(
                model="chat", messages=MESSAGES, extra_headers={"X-Priority": "critical"}
            )
        allowed = await sdk.chat.completions.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Priority": "low"}
        )
        other = await stack.sdk(GLOBEX).chat.completions.create(
            model="chat", messages=MESSAGES, extra_headers={"X-Priority": "critical"}
        )
    assert caught.value.status_code == 403
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert allowed.choices[0].message.content
    assert other.choices[0].message.content


async def test_a_body_just_under_the_brokers_limit_is_a_413_and_the_gateway_keeps_serving(
    tmp_path: Path, mock: MockBackend
) -> None:
    """nats-server closes a connection that sends a message over its
    max_payload (headers counted), and the services' own messages carrying a
    request are bigger than it: one tenant's request just under the limit
    once cut every tenant off the queue."""
    padding = "A" * (8 * 1024 * 1024 - 3000)  # the embedded broker's 8 MiB, less a little
    image = f"data:image/png;base64,{padding}"
    body = {
        "model": "chat",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}
        ],
    }
    async for stack in start(tmp_path, mock, gateway={"max_body": 16 << 20}):
        async with stack.http() as http:
            answer = await http.post("/chat/completions", json=body)
            after = await http.post(
                "/chat/completions", json={"model": "chat", "messages": MESSAGES}
            )
    assert answer.status_code == 413, answer.text
    assert after.status_code == 200, after.text


async def test_a_retry_after_a_publish_that_never_stored_runs_under_the_same_id(
    stack: Stack, mock: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first publish failed before anything was stored; the SDK's retry
    finds its fingerprint and publishes again under that id, rather than
    joining a request that does not exist and waiting for ever."""
    real = Client._publish
    tried: list[str] = []

    async def lost_once(self: Client, request: Any, trace: Any) -> bool:
        tried.append(request.id)
        if len(tried) == 1:
            raise TimeoutError("no ack, and nothing stored")
        return await real(self, request, trace)

    monkeypatch.setattr(Client, "_publish", lost_once)
    done = await stack.sdk(max_retries=2, timeout=15).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "never stored"}]
    )
    assert tried[0] == tried[1] == done.id
    assert await submitted_count(stack, "acme", done.id) == 1


async def test_a_plain_call_of_a_tenant_capped_below_the_default_level_runs_at_its_cap(
    tmp_path: Path, mock: MockBackend
) -> None:
    async for stack in start(tmp_path, mock, tenants={"acme": {"max_priority": "low"}}):
        done = await stack.sdk().chat.completions.create(model="chat", messages=MESSAGES)
        submitted = await EventLog(stack.services.js).history("acme", done.id, kind="submitted")  # type: ignore[arg-type]
    assert done.choices[0].message.content
    assert isinstance(submitted[0], Submitted)
    assert submitted[0].request.priority == "low"


async def test_the_gateway_carries_on_when_the_server_closes_its_connection(stack: Stack) -> None:
    """nats-server closes a connection after a protocol error and nats-py does
    not reconnect after that (issue #29): the gateway moves onto a new
    connection, and an SDK call made after it completes."""
    sdk = stack.sdk()
    first = await sdk.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "a"}]
    )
    assert first.choices[0].message.content
    closed = stack.gateway.js.connection
    assert closed is not None
    await closed.publish("x" * 5000)  # -ERR 'Maximum Control Line Exceeded'

    async def renewed() -> bool:
        return stack.gateway.keeper is not None and stack.gateway.keeper.renewals == 1

    await until(renewed, "the gateway runs on a new connection")
    assert closed.is_closed
    after = await sdk.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "b"}]
    )
    assert after.choices[0].message.content
    assert stack.gateway.supervisor.reason is None
