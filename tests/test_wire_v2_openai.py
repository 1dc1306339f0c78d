"""Wire v2 through the OpenAI, Ollama and TGI adapters: the body each sends
(as the mock received it), tool calls and log probabilities read back, what
a format cannot carry refused, and hostile answers bounded; then one request
with tools end to end through the real services.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from _loopback import serve
from aiohttp import web

from renqueue import Client, Services, parse_config
from renqueue.backends import HTTPBackend, make_backend
from renqueue.backends._http import MAX_TOOL_ARGUMENTS
from renqueue.backends.base import Delta
from renqueue.broker import EventLog
from renqueue.errors import BackendError, BadRequestError, FailureClass
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import ChatMessage, Completed, GenerationParams, InferenceRequest, TokenChunk
from renqueue.schema._messages import (
    ImagePart,
    ImageURL,
    JsonSchema,
    NamedTool,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
)

KEY_ENV = "RQ_TEST_WIRE_V2_KEY"
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
WEATHER = Tool(
    name="get_weather",
    description="The weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
CHAT = [
    ChatMessage(role="system", content="be brief"),
    ChatMessage(
        role="user",
        name="ann",
        content=[
            TextPart(text="what is in it?"),
            ImagePart(image_url=ImageURL(url=PNG, detail="low")),
        ],
    ),
    ChatMessage(role="assistant", content="", tool_calls=(CALL,)),
    ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
]


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wire-v2")


def request_of(messages: list[ChatMessage] | None = None, **params: Any) -> InferenceRequest:
    return InferenceRequest(
        id="req-1",
        route="chat",
        messages=messages or [ChatMessage(role="user", content="hi")],
        params=GenerationParams(**params),
    )


def adapter_for(url: str, adapter: str, **fields: Any) -> HTTPBackend:
    raw = {"adapter": adapter, "base_url": url, "model": "m", "api_key_env": KEY_ENV, **fields}
    backend = make_backend("b", parse_config({"backends": {"b": raw}}).backends["b"])
    assert isinstance(backend, HTTPBackend)
    return backend


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(output_tokens=4)) as server:
        yield server


async def collect(backend: HTTPBackend, request: InferenceRequest) -> list[Delta]:
    return [delta async for delta in backend.stream(request)]


async def stream_error(backend: HTTPBackend, request: InferenceRequest) -> BackendError:
    with pytest.raises(BackendError) as caught:
        await collect(backend, request)
    return caught.value


# ------------------------------------------------------------------ OpenAI


async def test_openai_body_is_openais_wire_shape(mock: MockBackend) -> None:
    request = request_of(
        CHAT,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=2,
        response_format=ResponseFormat(
            type="json_schema",
            json_schema=JsonSchema(name="w", schema={"type": "object"}, strict=True),
        ),
        tools=(WEATHER,),
        tool_choice=NamedTool(name="get_weather"),
        parallel_tool_calls=False,
        user="u-1",
    )
    async with adapter_for(mock.url_for("openai"), "openai") as backend:
        await collect(backend, request)
    body = mock.stats().last_request
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is in it?"},
                {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}},
            ],
            "name": "ann",
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER.parameters,
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    expected = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logprobs": True,
        "top_logprobs": 2,
        "parallel_tool_calls": False,
        "user": "u-1",
    }
    assert {name: body[name] for name in expected} == expected


async def test_openai_extras_pass_through_but_never_over_the_adapters_fields(
    mock: MockBackend,
) -> None:
    extra = {
        "top_k": 40,
        "repetition_penalty": 1.1,
        "model": "other",
        "messages": [],
        "stream": False,
        "stream_options": {},
        "priority": -5,
        "temperature": 1.9,  # a known field, unset: stays unset
        "tools": [],
    }
    async with adapter_for(mock.url_for("openai"), "openai", send_priority=True) as backend:
        [_ async for _ in backend.stream(request_of(extra=extra), priority=2)]
    body = mock.stats().last_request
    assert body["top_k"] == 40
    assert body["repetition_penalty"] == 1.1
    assert body["model"] == "m"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["priority"] == 2  # the rank the adapter was given, not the extra's
    assert "temperature" not in body
    assert "tools" not in body


async def test_openai_streamed_tool_call_is_assembled_from_its_pieces(mock: MockBackend) -> None:
    request = request_of(tools=(WEATHER,), tool_choice="required")
    async with adapter_for(mock.url_for("openai"), "openai") as backend:
        deltas = await collect(backend, request)
    assert "".join(d.text for d in deltas) == ""
    last = deltas[-1]
    assert last.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in last.tool_calls] == [
        ("get_weather", {"text": "tok0 tok1 tok2 tok3"})
    ]
    assert last.tool_calls[0].id.startswith("call_")
    assert all(not d.tool_calls for d in deltas[:-1])


async def test_mock_streams_a_tool_call_in_pieces_as_openai_does(mock: MockBackend) -> None:
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "please call get_weather"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(mock.url_for("openai") + "/chat/completions", json=body)
    pieces = [
        call
        for line in response.text.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
        for call in (choice["delta"].get("tool_calls") or ())
    ]
    assert pieces[0]["function"]["name"] == "get_weather"
    assert pieces[0]["type"] == "function"
    assert pieces[0]["id"]
    assert all("name" not in p["function"] and "id" not in p for p in pieces[1:])
    assert len(pieces) == 6  # the head, one per token, the closing '"}'
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {
        "text": "tok0 tok1 tok2 tok3"
    }


async def test_openai_whole_answer_carries_tool_calls_and_logprobs(mock: MockBackend) -> None:
    async with adapter_for(mock.url_for("openai"), "openai") as backend:
        called = await backend.complete(
            request_of([ChatMessage(role="user", content="call get_weather")], tools=(WEATHER,))
        )
        logged = await backend.complete(request_of(logprobs=True, top_logprobs=3))
    assert called.finish_reason == "tool_calls"
    assert [c.name for c in called.tool_calls] == ["get_weather"]
    assert [lp.token for lp in logged.logprobs] == ["tok0", " tok1", " tok2", " tok3"]
    assert [len(lp.top_logprobs) for lp in logged.logprobs] == [3, 3, 3, 3]
    assert logged.logprobs[1].bytes == list(b" tok1")


async def test_openai_streamed_logprobs_ride_on_their_deltas(mock: MockBackend) -> None:
    async with adapter_for(mock.url_for("openai"), "openai") as backend:
        deltas = await collect(backend, request_of(logprobs=True, top_logprobs=2))
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert "".join(d.text for d in deltas) == "".join(lp.token for lp in logprobs)
    assert [lp.logprob for lp in logprobs] == [-0.25] * 4
    assert [t.token for t in logprobs[0].top_logprobs] == ["tok0", "alt1"]


async def test_mock_refuses_a_wrong_openai_shape(mock: MockBackend) -> None:
    wrong = [
        {"tool_choice": "auto"},  # without tools
        {"top_logprobs": 2},  # without logprobs
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"id": "x", "name": "f", "arguments": "{}"}]}
            ]
        },
    ]
    async with httpx.AsyncClient() as client:
        for fields in wrong:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
            response = await client.post(mock.url_for("openai") + "/chat/completions", json=body)
            assert response.status_code == 400, fields


# ---------------------------------------------------- hostile OpenAI servers

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> str:
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **choice}]}
    return f"data: {json.dumps(body)}\n\n"


def calls(*pieces: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": list(pieces)}


def sse(body: str | Callable[[], str]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write((body() if callable(body) else body).encode())
        return response

    return handler


def huge_arguments() -> str:
    piece = "x" * 500_000
    pieces = [calls({"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}})]
    pieces += [calls({"index": 0, "function": {"arguments": piece}})] * 3
    return "".join(chunk(p) for p in pieces) + "data: [DONE]\n\n"


SCENARIOS: dict[str, Handler] = {
    "no-index": sse(
        chunk(calls({"id": "a", "function": {"name": "f", "arguments": '{"x"'}}))
        + chunk(calls({"function": {"arguments": ": 1}"}}))
        + chunk(calls({"id": "b", "function": {"name": "g", "arguments": "{}"}}))
        + chunk({}, "tool_calls")
        + "data: [DONE]\n\n"
    ),
    "repeated-id": sse(
        chunk(calls({"index": 0, "id": "a", "function": {"name": "f", "arguments": "{"}}))
        + chunk(calls({"index": 0, "id": "a", "function": {"name": "f", "arguments": "}"}}))
        + chunk({}, "tool_calls")
        + "data: [DONE]\n\n"
    ),
    "nameless": sse(
        chunk(calls({"index": 0, "function": {"arguments": "{}"}})) + "data: [DONE]\n\n"
    ),
    "negative-index": sse(
        chunk(calls({"index": -1, "function": {"name": "f"}})) + "data: [DONE]\n\n"
    ),
    "not-a-list": sse(chunk({"tool_calls": {"index": 0}}) + "data: [DONE]\n\n"),
    "huge-arguments": sse(huge_arguments),
    "many-calls": sse(
        "".join(
            chunk(calls({"index": i, "id": f"c{i}", "function": {"name": "f"}})) for i in range(200)
        )
        + "data: [DONE]\n\n"
    ),
    "too-many-alternatives": sse(
        chunk(
            {"content": "a"},
            logprobs={
                "content": [
                    {
                        "token": "a",
                        "logprob": -1,
                        "top_logprobs": [{"token": "a", "logprob": -1}] * 25,
                    }
                ]
            },
        )
        + "data: [DONE]\n\n"
    ),
    "bad-bytes": sse(
        chunk(
            {"content": "a"},
            logprobs={"content": [{"token": "a", "logprob": -1, "bytes": [9999]}]},
        )
        + "data: [DONE]\n\n"
    ),
}


@pytest.fixture
async def scripted() -> AsyncIterator[str]:
    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await SCENARIOS[request.match_info["scenario"]](request)

    app = web.Application()
    app.router.add_post("/{scenario}/chat/completions", dispatch)
    async with serve(app) as origin:
        yield origin


async def test_tool_call_pieces_without_index_start_a_call_by_a_new_id(scripted: str) -> None:
    async with adapter_for(f"{scripted}/no-index", "openai") as backend:
        deltas = await collect(backend, request_of())
    assert [(c.id, c.name, c.arguments) for c in deltas[-1].tool_calls] == [
        ("a", "f", '{"x": 1}'),
        ("b", "g", "{}"),
    ]


async def test_an_id_and_name_repeated_in_every_piece_are_kept_once(scripted: str) -> None:
    async with adapter_for(f"{scripted}/repeated-id", "openai") as backend:
        deltas = await collect(backend, request_of())
    assert deltas[-1].tool_calls == (ToolCall(id="a", name="f", arguments="{}"),)


@pytest.mark.parametrize(
    "scenario",
    [
        "nameless",
        "negative-index",
        "not-a-list",
        "huge-arguments",
        "many-calls",
        "too-many-alternatives",
        "bad-bytes",
    ],
)
async def test_hostile_tool_calls_and_logprobs_are_a_malformed_answer(
    scripted: str, scenario: str
) -> None:
    assert MAX_TOOL_ARGUMENTS < 1_500_000  # what huge-arguments sends
    async with adapter_for(f"{scripted}/{scenario}", "openai") as backend:
        error = await stream_error(backend, request_of())
    assert error.failure in (FailureClass.MALFORMED, FailureClass.BROKEN_STREAM)
    assert error.retryable


def anthropic_events(*events: dict[str, Any]) -> str:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def anthropic_tools(count: int, pieces: int, piece: str) -> str:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 1}}}
    events: list[dict[str, Any]] = [start]
    for index in range(count):
        events.append(
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "tool_use", "id": f"t{index}", "name": "f", "input": {}},
            }
        )
        events += [
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": piece},
            }
        ] * pieces
        events.append({"type": "content_block_stop", "index": index})
    events.append({"type": "message_stop"})
    return anthropic_events(*events)


def ollama_lines(*lines: dict[str, Any]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = "".join(json.dumps(line) + "\n" for line in lines)
        return web.Response(text=body, content_type="application/x-ndjson")

    return handler


NATIVE: dict[str, tuple[str, Handler]] = {
    # 200 calls, each small: past the count.
    "anthropic-many-calls": ("anthropic", sse(lambda: anthropic_tools(200, 1, "{}"))),
    # One call whose input streams in 3 x 500 kB pieces: past the size while it streams.
    "anthropic-huge-input": ("anthropic", sse(lambda: anthropic_tools(1, 3, "x" * 500_000))),
    "ollama-many-calls": (
        "ollama",
        ollama_lines(
            {
                "message": {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {}}}] * 200,
                },
                "done": False,
            },
            {"message": {"role": "assistant", "content": ""}, "done": True},
        ),
    ),
}


@pytest.fixture
async def native_scripted() -> AsyncIterator[str]:
    async def dispatch(request: web.Request) -> web.StreamResponse:
        return await NATIVE[request.match_info["scenario"]][1](request)

    app = web.Application()
    app.router.add_post("/{scenario}/v1/messages", dispatch)
    app.router.add_post("/{scenario}/api/chat", dispatch)
    async with serve(app) as origin:
        yield origin


@pytest.mark.parametrize("scenario", sorted(NATIVE))
async def test_native_adapters_bound_the_tool_calls_a_backend_sends(
    native_scripted: str, scenario: str
) -> None:
    """Before, Anthropic's, Gemini's and Ollama's parsers kept any number of
    calls and any amount of arguments: a hostile server filled the worker."""
    kind = NATIVE[scenario][0]
    path = "/v1" if kind == "anthropic" else ""
    async with adapter_for(f"{native_scripted}/{scenario}{path}", kind) as backend:
        error = await stream_error(backend, request_of())
    assert error.failure is FailureClass.MALFORMED, error
    assert error.retryable


# ------------------------------------------------------------------ Ollama


async def test_ollama_body_in_ollamas_shape(mock: MockBackend) -> None:
    request = request_of(
        CHAT,
        tools=(WEATHER,),
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=7,
        response_format=ResponseFormat(type="json_object"),
        extra={"top_k": 20, "min_p": 0.05, "logit_bias": {"1": 2}},
    )
    async with adapter_for(mock.url_for("ollama"), "ollama") as backend:
        await collect(backend, request)
    body = mock.stats().last_request
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is in it?", "images": [PNG.split(",")[1]]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER.parameters,
            },
        }
    ]
    assert body["format"] == "json"
    assert body["options"] == {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "seed": 7,
        "top_k": 20,
        "min_p": 0.05,
    }


async def test_ollama_json_schema_is_its_format(mock: MockBackend) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = ResponseFormat(
        type="json_schema", json_schema=JsonSchema(name="s", schema=schema)
    )
    async with adapter_for(mock.url_for("ollama"), "ollama") as backend:
        await collect(backend, request_of(response_format=response_format))
    assert mock.stats().last_request["format"] == schema


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (
            ChatMessage(
                role="user",
                content=[ImagePart(image_url=ImageURL(url="https://example.com/cat.png"))],
            ),
            "not a data: URL",
        ),
        (
            ChatMessage(
                role="user", content=[ImagePart(image_url=ImageURL(url="data:image/png;base64,%%"))]
            ),
            "not valid base64",
        ),
        (
            ChatMessage(
                role="user", content=[ImagePart(image_url=ImageURL(url="data:text/plain,hi"))]
            ),
            "data:image/<type>;base64",
        ),
        (
            ChatMessage(
                role="assistant",
                content="",
                tool_calls=(ToolCall(name="f", arguments="{not json"),),
            ),
            "not JSON",
        ),
    ],
)
async def test_ollama_refuses_what_it_cannot_send(
    mock: MockBackend, message: ChatMessage, says: str
) -> None:
    async with adapter_for(mock.url_for("ollama"), "ollama") as backend:
        with pytest.raises(BadRequestError, match=says):
            await collect(backend, request_of([message]))
    assert mock.stats().requests == 0


async def test_ollama_reads_the_tool_call_the_mock_makes(mock: MockBackend) -> None:
    request = request_of([ChatMessage(role="user", content="call get_weather")], tools=(WEATHER,))
    async with adapter_for(mock.url_for("ollama"), "ollama") as backend:
        deltas = await collect(backend, request)
        whole = await backend.complete(request)
    for calls_, reason in (
        (deltas[-1].tool_calls, deltas[-1].finish_reason),
        (whole.tool_calls, whole.finish_reason),
    ):
        assert reason == "tool_calls"
        assert [(c.name, json.loads(c.arguments)) for c in calls_] == [
            ("get_weather", {"text": "tok0 tok1 tok2 tok3"})
        ]


# --------------------------------------------------------------------- TGI


@pytest.mark.parametrize(
    ("response_format", "grammar"),
    [
        (ResponseFormat(type="json_object"), {"type": "json", "value": {"type": "object"}}),
        (
            ResponseFormat(
                type="json_schema",
                json_schema=JsonSchema(name="s", schema={"type": "array"}),
            ),
            {"type": "json", "value": {"type": "array"}},
        ),
    ],
)
async def test_tgi_response_format_is_a_grammar(
    mock: MockBackend, response_format: ResponseFormat, grammar: dict[str, Any]
) -> None:
    request = request_of(
        response_format=response_format,
        frequency_penalty=0.5,
        extra={"top_k": 10, "repetition_penalty": 1.2, "logit_bias": {}, "details": False},
    )
    async with adapter_for(mock.url_for("tgi"), "tgi") as backend:
        await collect(backend, request)
    parameters = mock.stats().last_request["parameters"]
    assert parameters["grammar"] == grammar
    assert parameters["frequency_penalty"] == 0.5
    assert parameters["top_k"] == 10
    assert parameters["repetition_penalty"] == 1.2
    assert "logit_bias" not in parameters
    assert parameters["details"] is True


@pytest.mark.parametrize(
    "request_",
    [
        request_of(tools=(WEATHER,)),
        request_of(logprobs=True),
        request_of([CHAT[1]]),
        request_of([ChatMessage(role="user", content="hi"), CHAT[2]]),
        request_of([CHAT[3]]),
    ],
    ids=["tools", "logprobs", "image", "tool-call", "tool-result"],
)
async def test_tgi_refuses_what_a_prompt_cannot_hold(
    mock: MockBackend, request_: InferenceRequest
) -> None:
    async with adapter_for(mock.url_for("tgi"), "tgi") as backend:
        with pytest.raises(BadRequestError):
            await collect(backend, request_)
    assert mock.stats().requests == 0


# ------------------------------------------------------------- end to end


async def test_a_request_with_tools_completes_with_its_tool_call_end_to_end(
    tmp_path: Path,
) -> None:
    settings = MockSettings(output_tokens=3, tokens_per_second=200)
    async with MockBackend(settings) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    "oai": {
                        "adapter": "openai",
                        "base_url": mock.url_for("openai"),
                        "model": "mock",
                        "api_key_env": KEY_ENV,
                    }
                },
                "routes": {"chat": {"backends": ["oai"]}},
                "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
                "router": {"capacity_refresh": "20ms"},
            }
        )
        request = InferenceRequest(
            id="tools-1",
            tenant="t1",
            route="chat",
            messages=[ChatMessage(role="user", content="weather?")],
            params=GenerationParams(tools=(WEATHER,), tool_choice="required"),
            stream=True,  # a reader of final chunks' text (not saying it: the older shape)
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            handle = await client.submit_request(request)
            chunks: list[TokenChunk] = [c async for c in handle.stream(timeout=10)]
            await handle.result(timeout=10)
            events = await EventLog(client.js).history("t1", "tools-1")
    completed = [e for e in events if isinstance(e, Completed)]
    assert len(completed) == 1
    event = completed[0]
    assert event.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in event.tool_calls] == [
        ("get_weather", {"text": "tok0 tok1 tok2"})
    ]
    deltas = [d for c in chunks for d in c.tool_calls]
    assert [(d.index, d.id, d.name) for d in deltas] == [(0, event.tool_calls[0].id, "get_weather")]
    assert deltas[0].arguments == event.tool_calls[0].arguments
    assert "".join(c.text for c in chunks) == event.text == ""
    # The adapter hands the calls over once the answer is read: in the final chunk.
    assert [c.final for c in chunks if c.tool_calls] == [True]
