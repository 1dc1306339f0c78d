"""Wire format v2 through the Anthropic and Gemini adapters: images, tools,
tool calls and their results, response formats, and what each refuses.

The mock backend on loopback checks each body as its provider would (roles
that alternate, tool results that answer a call, base64 that decodes) and
answers with a tool call when the request forces one or the user asks
``call <tool>``; what it received is read back from its stats.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_native_adapters import KEY, KEY_ENV, adapter_for
from test_native_pipeline import KEY_ENV as PIPELINE_KEY_ENV
from test_native_pipeline import config_for

from renqueue import Client, Services
from renqueue.backends import HTTPBackend
from renqueue.backends.base import Delta, ToolCall
from renqueue.broker import EventLog
from renqueue.errors import BadRequestError, FailureClass
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
)

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
WEATHER = Tool(
    name="get_weather",
    description="The weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
)
CALL = ToolCall(id="toolu_1", name="get_weather", arguments='{"city": "Paris"}')


def request(*messages: ChatMessage, **params: Any) -> InferenceRequest:
    return InferenceRequest(
        id="req-1", route="chat", messages=list(messages), params=GenerationParams(**params)
    )


def user(content: str | list[Any] = "hi") -> ChatMessage:
    return ChatMessage(role="user", content=content)


def image(url: str) -> ImagePart:
    return ImagePart(image_url=ImageURL(url=url))


#: A tool round trip: the user asks, the model calls, the tool answers.
ROUND_TRIP = (
    user("weather in Paris?"),
    ChatMessage(role="assistant", content="", tool_calls=(CALL,)),
    ChatMessage(role="tool", tool_call_id="toolu_1", content='{"temp": 21}'),
)


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(output_tokens=3)) as server:
        yield server


async def streamed(backend: HTTPBackend, req: InferenceRequest) -> list[Delta]:
    return [delta async for delta in backend.stream(req)]


# ------------------------------------------------------------------ Anthropic


async def test_anthropic_body_carries_images_tools_choice_and_user(mock: MockBackend) -> None:
    req = request(
        ChatMessage(role="system", content="be brief"),
        user([TextPart(text="what is this?"), image(f"data:image/PNG;base64,{PNG}")]),
        ChatMessage(role="user", name="bob", content=[image("https://x.test/cat.jpg")]),
        tools=(WEATHER,),
        tool_choice="auto",
        parallel_tool_calls=False,
        user="u-42",
        seed=7,
        presence_penalty=0.5,
        extra={"top_k": 5, "repetition_penalty": 1.1},
    )
    async with adapter_for(mock, "anthropic") as backend:
        await backend.complete(req)
    assert mock.stats().last_request == {
        "model": "m",
        "max_tokens": 4096,
        "messages": [
            {
                "role": "user",  # two user messages in a row: one turn; the name dropped
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/cat.jpg"}},
                ],
            }
        ],
        "system": "be brief",
        "top_k": 5,  # of extra, only top_k; no seed, no penalties: Anthropic has none
        "tools": [
            {
                "name": "get_weather",
                "input_schema": WEATHER.parameters,
                "description": "The weather in a city",
            }
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u-42"},
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("required", {"type": "any"}),
        (NamedTool(name="get_weather"), {"type": "tool", "name": "get_weather"}),
        ("none", {"type": "none"}),
    ],
)
async def test_anthropic_tool_choice_shapes(
    mock: MockBackend, choice: Any, expected: dict[str, Any]
) -> None:
    async with adapter_for(mock, "anthropic") as backend:
        await backend.complete(request(user(), tools=(WEATHER,), tool_choice=choice))
    sent = mock.stats().last_request
    assert sent["tool_choice"] == expected


async def test_anthropic_tool_round_trip_sends_tool_use_then_tool_result(
    mock: MockBackend,
) -> None:
    follow_up = ChatMessage(role="tool", tool_call_id="toolu_2", content="sunny")
    second = ToolCall(id="toolu_2", name="get_weather", arguments="{}")
    messages = (
        ROUND_TRIP[0],
        ChatMessage(role="assistant", content="Let me look.", tool_calls=(CALL, second)),
        ROUND_TRIP[2],
        follow_up,
        user("and tomorrow?"),
    )
    async with adapter_for(mock, "anthropic") as backend:
        generation = await backend.complete(request(*messages, tools=(WEATHER,)))
    assert generation.text == "tok0 tok1 tok2"  # the tool results answered: text
    assert generation.finish_reason == "stop"
    assert mock.stats().last_request["messages"][1:] == [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {}},
            ],
        },
        {
            "role": "user",  # both results and the next question: one user turn, results first
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp": 21}'},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"},
                {"type": "text", "text": "and tomorrow?"},
            ],
        },
    ]


@pytest.mark.parametrize("stream", [True, False])
async def test_anthropic_answers_with_a_tool_call_when_forced(
    mock: MockBackend, stream: bool
) -> None:
    req = request(user("weather?"), tools=(WEATHER,), tool_choice="required")
    async with adapter_for(mock, "anthropic") as backend:
        if stream:
            deltas = await streamed(backend, req)
            text = "".join(d.text for d in deltas)
            last = deltas[-1]
            calls, finish = last.tool_calls, last.finish_reason
        else:
            generation = await backend.complete(req)
            text, calls, finish = generation.text, generation.tool_calls, generation.finish_reason
    assert text == "tok0 tok1 tok2"
    assert finish == "tool_calls"
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert calls[0].id.startswith("toolu_")
    assert calls[0].arguments.replace(" ", "") == '{"query":"mock"}'


async def test_anthropic_answers_with_a_tool_call_when_the_user_asks_for_it(
    mock: MockBackend,
) -> None:
    async with adapter_for(mock, "anthropic") as backend:
        asked = await backend.complete(request(user("please call get_weather"), tools=(WEATHER,)))
        refused = await backend.complete(
            request(user("please call get_weather"), tools=(WEATHER,), tool_choice="none")
        )
    assert [c.name for c in asked.tool_calls] == ["get_weather"]
    assert refused.tool_calls == ()
    assert refused.finish_reason == "stop"


@pytest.mark.parametrize(
    ("req", "says"),
    [
        (request(user(), response_format=ResponseFormat(type="json_object")), "json_object"),
        (request(user(), logprobs=True), "log probabilities"),
        (
            request(
                user("x"),
                ChatMessage(
                    role="assistant",
                    content="",
                    tool_calls=(ToolCall(id="t", name="f", arguments='{"a": '),),
                ),
            ),
            "not valid JSON",
        ),
        (
            request(
                user("x"),
                ChatMessage(
                    role="assistant",
                    content="",
                    tool_calls=(ToolCall(id="t", name="f", arguments="[1]"),),
                ),
            ),
            "not a JSON object",
        ),
        (request(user([image("data:image/png;base64,%%%not-base64")])), "not valid base64"),
        (request(user([image("data:text/plain;base64,aGk=")])), "data:image/"),
        (request(user([image("file:///etc/passwd")])), "https://"),
        (request(user([image(f"data:image/tiff;base64,{PNG}")])), "image/tiff"),
        (request(user(), tool_choice="required"), "offers no tools"),
        (
            request(user(), tools=(WEATHER,), tool_choice=NamedTool(name="other")),
            "not among the tools",
        ),
        (request(user(), extra={"top_k": "many"}), "top_k"),
        (
            request(ChatMessage(role="system", content=[image(f"data:image/png;base64,{PNG}")])),
            "system message",
        ),
    ],
)
async def test_anthropic_refuses_what_it_cannot_send(
    mock: MockBackend, req: InferenceRequest, says: str
) -> None:
    async with adapter_for(mock, "anthropic") as backend:
        with pytest.raises(BadRequestError) as caught:
            await streamed(backend, req)
    assert says in str(caught.value)
    assert caught.value.failure is FailureClass.BAD_REQUEST
    assert "%%%" not in str(caught.value) or says == "not valid base64"
    assert mock.stats().requests == 0  # refused before any call


async def test_the_anthropic_mock_refuses_what_anthropic_refuses(mock: MockBackend) -> None:
    # A tool result that answers no tool use: Anthropic's own 400 and words.
    orphan = request(user("x"), ChatMessage(role="tool", tool_call_id="toolu_9", content="r"))
    async with adapter_for(mock, "anthropic") as backend:
        with pytest.raises(BadRequestError) as caught:
            await backend.complete(orphan)
    assert caught.value.status == 400
    assert "unexpected `tool_use_id` found in `tool_result` blocks: toolu_9" in str(caught.value)


async def test_a_huge_schema_travels_whole(mock: MockBackend) -> None:
    properties = {f"field_{i}": {"type": "string", "description": "x" * 50} for i in range(2000)}
    big = Tool(name="big", parameters={"type": "object", "properties": properties})
    async with adapter_for(mock, "anthropic") as backend:
        await backend.complete(request(user(), tools=(big,)))
    assert len(mock.stats().last_request["tools"][0]["input_schema"]["properties"]) == 2000


async def test_a_tool_without_parameters_gets_an_empty_object_schema(mock: MockBackend) -> None:
    async with adapter_for(mock, "anthropic") as backend:
        await backend.complete(request(user(), tools=(Tool(name="now"),)))
    assert mock.stats().last_request["tools"] == [
        {"name": "now", "input_schema": {"type": "object", "properties": {}}}
    ]


# --------------------------------------------------------------------- Gemini


async def test_gemini_body_carries_images_tools_and_generation_config(mock: MockBackend) -> None:
    req = request(
        ChatMessage(role="system", content="be brief"),
        user(
            [
                TextPart(text="compare"),
                image(f"data:image/png;base64,{PNG}"),
                image("https://x.test/a/cat.WEBP?size=2"),
                image("https://x.test/photo"),
            ]
        ),
        tools=(WEATHER,),
        tool_choice=NamedTool(name="get_weather"),
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=3,
        stop=["END"],
        user="u-1",
        extra={"top_k": 7, "unknown": 1},
        response_format=ResponseFormat(
            type="json_schema",
            json_schema=JsonSchema(name="w", schema={"type": "object"}),
        ),
    )
    async with adapter_for(mock, "gemini") as backend:
        await backend.complete(req)
    sent = mock.stats().last_request
    config = sent.pop("generationConfig")
    assert sent == {
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"text": "compare"},
                    {"inlineData": {"mimeType": "image/png", "data": PNG}},
                    {
                        "fileData": {
                            "mimeType": "image/webp",  # by its extension
                            "fileUri": "https://x.test/a/cat.WEBP?size=2",
                        }
                    },
                    {"fileData": {"mimeType": "image/jpeg", "fileUri": "https://x.test/photo"}},
                ],
            }
        ],
        "systemInstruction": {"parts": [{"text": "be brief"}]},
        "tools": [
            {
                "functionDeclarations": [
                    {
                        "name": "get_weather",
                        "description": "The weather in a city",
                        "parametersJsonSchema": WEATHER.parameters,
                    }
                ]
            }
        ],
        "toolConfig": {
            "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["get_weather"]}
        },
    }  # and no user: Gemini has no such field
    assert config == {
        "stopSequences": ["END"],
        "seed": 3,
        "presencePenalty": 0.5,
        "frequencyPenalty": -0.5,
        "topK": 7,  # of extra, only top_k
        "responseMimeType": "application/json",
        "responseJsonSchema": {"type": "object"},
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("auto", {"mode": "AUTO"}), ("required", {"mode": "ANY"}), ("none", {"mode": "NONE"})],
)
async def test_gemini_tool_choice_modes(
    mock: MockBackend, choice: Any, expected: dict[str, Any]
) -> None:
    async with adapter_for(mock, "gemini") as backend:
        await backend.complete(request(user(), tools=(WEATHER,), tool_choice=choice))
    assert mock.stats().last_request["toolConfig"] == {"functionCallingConfig": expected}


async def test_gemini_json_object_asks_for_json(mock: MockBackend) -> None:
    async with adapter_for(mock, "gemini") as backend:
        await backend.complete(request(user(), response_format=ResponseFormat(type="json_object")))
    assert mock.stats().last_request["generationConfig"] == {"responseMimeType": "application/json"}


@pytest.mark.parametrize("stream", [True, False])
async def test_gemini_tool_round_trip(mock: MockBackend, stream: bool) -> None:
    # The first turn: the mock calls the tool; Gemini gives the call no id.
    first = request(user("call get_weather please"), tools=(WEATHER,))
    async with adapter_for(mock, "gemini") as backend:
        if stream:
            deltas = await streamed(backend, first)
            calls, finish = deltas[-1].tool_calls, deltas[-1].finish_reason
        else:
            generation = await backend.complete(first)
            calls, finish = generation.tool_calls, generation.finish_reason
        assert finish == "tool_calls"
        # Gemini gives no id: the adapter hands the call over without one, and
        # the worker names it (call_<request id>_<index>).
        assert calls == (ToolCall(id="", name="get_weather", arguments='{"query":"mock"}'),)
        calls = (msgspec.structs.replace(calls[0], id="call_r_0"),)
        # The second: the call and its result go back; the answer is text.
        second = request(
            *first.messages,
            ChatMessage(role="assistant", content="", tool_calls=calls),
            ChatMessage(role="tool", tool_call_id="call_r_0", content='{"temp": 21}'),
            tools=(WEATHER,),
        )
        answer = await backend.complete(second)
    assert answer.text == "tok0 tok1 tok2"
    assert answer.tool_calls == ()
    assert mock.stats().last_request["contents"][1:] == [
        {
            "role": "model",
            "parts": [
                {
                    "functionCall": {
                        "name": "get_weather",
                        "args": {"query": "mock"},
                        "id": "call_r_0",
                    },
                    "thoughtSignature": "skip_thought_signature_validator",
                }
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "id": "call_r_0",
                        "name": "get_weather",
                        "response": {"output": {"temp": 21}},
                    }
                }
            ],
        },
    ]


async def test_gemini_answers_each_parallel_call_in_one_turn(mock: MockBackend) -> None:
    calls = (
        ToolCall(id="a", name="get_weather", arguments='{"city": "Oslo"}'),
        ToolCall(id="b", name="now", arguments=""),
    )
    req = request(
        user("two things"),
        ChatMessage(role="assistant", content="", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="b", content="noon"),
        ChatMessage(role="tool", tool_call_id="a", content="rain"),
    )
    async with adapter_for(mock, "gemini") as backend:
        await backend.complete(req)
    turn = mock.stats().last_request["contents"][2]
    assert turn == {
        "role": "user",
        "parts": [
            {"functionResponse": {"id": "b", "name": "now", "response": {"output": "noon"}}},
            {
                "functionResponse": {
                    "id": "a",
                    "name": "get_weather",
                    "response": {"output": "rain"},
                }
            },
        ],
    }


@pytest.mark.parametrize(
    ("req", "says"),
    [
        (request(user(), logprobs=True), "log probabilities"),
        (request(user(), ChatMessage(role="tool", tool_call_id="zz", content="x")), "'zz'"),
        (
            request(
                user(),
                ChatMessage(
                    role="assistant",
                    content="",
                    tool_calls=(ToolCall(id="t", name="f", arguments="{"),),
                ),
            ),
            "not valid JSON",
        ),
        (request(user([image("data:image/png;base64,@@")])), "not valid base64"),
        (request(user([image("data:image/png,rawbytes")])), "data:image/"),
        (request(user(), tool_choice=NamedTool(name="f")), "offers no tools"),
        (request(user(), extra={"top_k": 0}), "top_k"),
        (request(user(), response_format=ResponseFormat(type="json_schema")), "json_schema"),
    ],
)
async def test_gemini_refuses_what_it_cannot_send(
    mock: MockBackend, req: InferenceRequest, says: str
) -> None:
    async with adapter_for(mock, "gemini") as backend:
        with pytest.raises(BadRequestError) as caught:
            await backend.complete(req)
    assert says in str(caught.value)
    assert mock.stats().requests == 0


async def test_the_gemini_mock_counts_function_responses(mock: MockBackend) -> None:
    # Two calls answered by one response: Gemini's own 400.
    calls = (ToolCall(id="a", name="f", arguments="{}"), ToolCall(id="b", name="f", arguments="{}"))
    req = request(
        user(),
        ChatMessage(role="assistant", content="", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="a", content="1"),
    )
    async with adapter_for(mock, "gemini") as backend:
        with pytest.raises(BadRequestError) as caught:
            await backend.complete(req)
    assert caught.value.status == 400
    assert "number of function response parts is equal" in str(caught.value)


# ------------------------------------------------------------- end to end


async def test_an_anthropic_tool_call_reaches_the_client_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PIPELINE_KEY_ENV, KEY)
    settings = MockSettings(output_tokens=2, tokens_per_second=200)
    async with MockBackend(settings) as mock:
        config = config_for(
            tmp_path, {"claude": {"adapter": "anthropic", "base_url": mock.url_for("anthropic")}}
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            req = InferenceRequest(
                id="tool-e2e",
                tenant="t1",
                route="chat",
                messages=[user("weather in Paris?")],
                params=GenerationParams(tools=(WEATHER,), tool_choice="required"),
            )
            handle = await client.submit_request(req)
            chunks: list[TokenChunk] = [c async for c in handle.stream(timeout=10)]
            result = await handle.result(timeout=10)
            events = await EventLog(client.js).history(client.tenant, handle.id)
    completed = [e for e in events if isinstance(e, Completed)]
    assert len(completed) == 1
    (call,) = completed[0].tool_calls
    assert call.name == "get_weather"
    assert call.id.startswith("toolu_")
    assert call.arguments == '{"query":"mock"}'
    assert result.finish_reason == "tool_calls"
    deltas = [d for c in chunks for d in c.tool_calls]
    assert [(d.index, d.id, d.name) for d in deltas] == [(0, call.id, "get_weather")]
    assert "".join(d.arguments for d in deltas) == call.arguments


@pytest.mark.parametrize("kind", ["anthropic", "gemini"])
async def test_a_version_1_tool_turn_is_sent_as_user_text(mock: MockBackend, kind: str) -> None:
    """Version 1 wrote tool turns without a tool_call_id: plain text, sent
    as a user turn before schema 2, and still (not refused as a bad request)."""
    old = request(user("what is 6 x 7?"), ChatMessage(role="tool", content="42"))
    async with adapter_for(mock, kind) as backend:
        answer = await backend.complete(old)
    assert answer.text
    sent = mock.stats().last_request
    turns = sent["messages"] if kind == "anthropic" else sent["contents"]
    assert len(turns) == 1  # one user turn: the question, then the tool's text
    assert "42" in json.dumps(turns[0])
