"""The gateway's pure rules, without a server: body translation, controls from
headers, error mapping, API keys, retry memory, resume ids."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessageFunctionToolCall,
)

from renqueue import ConfigError, parse_config
from renqueue.errors import (
    MalformedRequestError,
    NatsTimeoutError,
    StoreFullError,
    TenantBacklogFullError,
    UnsupportedFeatureError,
)
from renqueue.gateway import ApiError, KeyStore, digest, new_key
from renqueue.gateway._answers import parse_last_event_id
from renqueue.gateway._errors import (
    CODES,
    STATUS_CODES,
    features_named,
    from_error,
    from_terminal,
    reason_of,
)
from renqueue.gateway._idempotency import RetryMemory, fingerprint, id_for_key
from renqueue.gateway._openai import (
    ToolCallPieces,
    chunk_bytes,
    completion_bytes,
    finish_reason,
    parse_chat,
    translate,
)
from renqueue.policy import needs
from renqueue.policy._budget import day_ends
from renqueue.schema import (
    REQUEST_DECODER,
    Cancelled,
    ChatMessage,
    Expired,
    Failed,
    GenerationParams,
    ImagePart,
    ImageURL,
    InferenceRequest,
    JsonSchema,
    NamedTool,
    Rejected,
    ResponseFormat,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    encode,
)

LEVELS = ["critical", "high", "normal", "low", "batch"]
NOW = 1_800_000_000.0


def submit(body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    base = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    chat = parse_chat(json.dumps({**base, **body}).encode())
    return translate(chat, headers or {}, levels=LEVELS, default_level="normal", now=NOW)


def refused(body: dict[str, Any], headers: dict[str, str] | None = None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        submit(body, headers)
    assert caught.value.status == 400
    assert caught.value.code, caught.value.message  # every 400 says which it is
    return caught.value


# ------------------------------------------------------------------- the body


def test_what_the_wire_carries_is_translated() -> None:
    sub = submit(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok"},
            ],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": "END",
            "seed": 3,
            "user": "u-1",
            "metadata": {"team": "x"},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert sub.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="a\nb"),
        ChatMessage(role="assistant", content="ok"),
    ]
    params = sub.params
    assert (params.max_tokens, params.temperature, params.top_p, params.stop, params.seed) == (
        7,
        0.5,
        0.9,
        ["END"],
        3,
    )
    # The user is the provider's (params) and stays in metadata (an A/B split may key on it).
    assert params.user == "u-1"
    assert sub.metadata == {"team": "x", "user": "u-1"}
    assert sub.stream
    assert sub.include_usage
    assert sub.priority == "normal"


TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


def assistant_calls(tool_calls: Any) -> dict[str, Any]:
    return {"messages": [{"role": "assistant", "content": None, "tool_calls": tool_calls}]}


IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # Tools: functions only, each whole, named as the wire allows.
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{**TOOL, "extra": 1}]}, "tools[0].extra"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
        ),
        ({"tools": [TOOL] * 129}, "tools"),
        ({"tools": [TOOL] * 10_000}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(80)}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        # Response formats.
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "deep", "schema": nested(80)},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "grammar"}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "other": 1}}, "response_format.other"),
        # Sampling, logprobs, user: the wire's bounds.
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"user": "u" * 300}, "user"),
        # Fields still not carried, and Ren-Queue's own.
        ({"n": 3}, "n"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"store": True}, "store"),
        ({"tenant": "other"}, "tenant"),
        ({"complexity": 50}, "complexity"),
        ({f"p{i}": i for i in range(65)}, "p64"),
        ({"vendor": nested(80)}, "vendor"),
        # Messages: roles and what each carries.
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "function", "content": "r", "name": "f"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "n" * 300}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
        (
            {"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]},
            "messages[0].refusal",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        # Hostile tool calls.
        (assistant_calls("call it"), "messages[0].tool_calls"),
        (assistant_calls([5]), "messages[0].tool_calls[0]"),
        (
            assistant_calls(
                [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]
            ),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            assistant_calls([{"id": "c", "type": "function", "function": {"name": "f"}}]),
            "messages[0].tool_calls[0].function",
        ),
        (assistant_calls([{"id": "c", "type": "function"}]), "messages[0].tool_calls[0].function"),
        (
            assistant_calls([{"id": "c", "type": "custom", "custom": {"name": "f", "input": ""}}]),
            "messages[0].tool_calls[0].type",
        ),
        (
            assistant_calls(
                [{"id": "c", "type": "function", "function": {"name": "f" * 300, "arguments": ""}}]
            ),
            "messages[0].tool_calls[0].function.name",
        ),
        # Content parts: text and images only, each whole.
        (
            user([{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]),
            "messages[0].content[0].type",
        ),
        (user([{"type": "file", "file": {"file_id": "f"}}]), "messages[0].content[0].type"),
        (user([{"type": "refusal", "refusal": "no"}]), "messages[0].content[0].type"),
        (user([{"type": "video_url"}]), "messages[0].content[0].type"),
        (user([{"type": "text"}]), "messages[0].content[0].text"),
        (user([{"type": "text", "text": "a", "foo": 1}]), "messages[0].content[0].foo"),
        (
            user([{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]),
            "messages[0].content[0].cache_control",
        ),
        (user([{"type": "image_url"}]), "messages[0].content[0].image_url"),
        (user([{"type": "image_url", "image_url": {}}]), "messages[0].content[0].image_url"),
        (
            user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
            "messages[0].content[0].image_url.url",
        ),
        (
            user([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]),
            "messages[0].content[0].image_url.url",
        ),
        (
            user([{"type": "image_url", "image_url": {"url": IMAGE, "detail": "ultra"}}]),
            "messages[0].content[0].image_url.detail",
        ),
        (
            user([{"type": "image_url", "image_url": {"url": IMAGE, "size": 3}}]),
            "messages[0].content[0].image_url.size",
        ),
        (user([5]), "messages[0].content[0]"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ],
)
def test_what_the_wire_cannot_carry_is_refused_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    assert refused(body).param == param


def test_every_chat_field_the_wire_carries_reaches_it() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    sub = submit(
        {
            "messages": [
                {"role": "system", "content": "be brief", "name": "rules"},
                {
                    "role": "user",
                    "name": "ana",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
                        {"type": "image_url", "image_url": "https://example.com/a.png"},
                    ],
                },
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "answer",
                    "schema": {"type": "object"},
                    "description": "d",
                    "strict": True,
                },
            },
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logprobs": True,
            "top_logprobs": 3,
            "user": "u-1",
        }
    )
    assert sub.messages == [
        ChatMessage(role="system", content="be brief", name="rules"),
        ChatMessage(
            role="user",
            name="ana",
            content=[
                TextPart(text="what is this?"),
                ImagePart(image_url=ImageURL(url=IMAGE, detail="low")),
                ImagePart(image_url=ImageURL(url="https://example.com/a.png")),
            ],
        ),
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=(ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}'),),
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ]
    assert sub.params == GenerationParams(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=True,
        top_logprobs=3,
        response_format=ResponseFormat(
            type="json_schema",
            json_schema=JsonSchema(
                name="answer", schema={"type": "object"}, description="d", strict=True
            ),
        ),
        tools=(
            Tool(
                name="get_weather",
                description="the weather in a city",
                parameters={"type": "object", "properties": {"city": {"type": "string"}}},
                strict=True,
            ),
        ),
        tool_choice=NamedTool(name="get_weather"),
        parallel_tool_calls=False,
        user="u-1",
    )
    # What the router reads of it: these features, so only backends with them.
    request = InferenceRequest(id="r", route="chat", messages=sub.messages, params=sub.params)
    assert needs(request) == {"tools", "vision", "image_urls", "json_schema", "logprobs"}
    # And it survives the wire: encoded and decoded, it is the same request.
    assert REQUEST_DECODER.decode(encode(request)) == request
    json_object = submit({"response_format": {"type": "json_object"}}).params.response_format
    assert json_object == ResponseFormat(type="json_object")
    assert submit({"tools": [TOOL], "tool_choice": "required"}).params.tool_choice == "required"


def test_unknown_top_level_parameters_pass_through_as_they_are() -> None:
    sub = submit(
        {
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "chat_template_kwargs": {"enable_thinking": False},
            "ignored": None,
            # Known fields and Ren-Queue's controls are read, never passed through.
            "temperature": 0.2,
            "priority": "high",
            "max_cost": 1.0,
            "request_timeout": 5,
            "keep_alive_on_disconnect": True,
            "metadata": {"a": "b"},
        }
    )
    assert sub.params.extra == {
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert sub.params.temperature == 0.2
    assert sub.priority == "high"
    # 64 pass, as the wire allows.
    assert len(submit({f"p{i}": i for i in range(64)}).params.extra) == 64
    assert submit({}).params.extra == {}


def test_neutral_values_ask_for_nothing_and_pass() -> None:
    sub = submit(
        {
            "n": 1,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": False,
            "top_logprobs": 0,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "logit_bias": {},
            "modalities": ["text"],
            "functions": [],
            "function_call": "auto",
            "store": False,
            "service_tier": "auto",
            "temperature": None,
        }
    )
    assert sub.route == "chat"
    # Carried as nothing: an adapter with no counterpart must not refuse them.
    assert sub.params == GenerationParams()
    assert submit({"tool_choice": "auto"}).params.tool_choice is None


def test_a_text_only_parts_list_is_one_string_as_vllm_joins_it() -> None:
    sub = submit(user([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))
    assert sub.messages[0].content == "a\nb"
    # A tool result's parts too; an assistant turn with text and calls keeps both.
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    sub = submit(
        {
            "messages": [
                {"role": "assistant", "content": "let me look", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "42"}]},
            ]
        }
    )
    assert sub.messages[0] == ChatMessage(
        role="assistant", content="let me look", tool_calls=(ToolCall(id="c", name="f"),)
    )
    assert sub.messages[1].content == "42"


def test_malformed_and_hostile_bodies_are_400s_not_crashes() -> None:
    for body in (b"", b"{", b"[]", b"\xff", b'{"model": "chat"}', b"[" * 50_000 + b"]" * 50_000):
        with pytest.raises(ApiError) as caught:
            parse_chat(body)
        assert caught.value.status == 400
    deep = b'{"model": "c", "messages": [], "tools": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(ApiError):
        parse_chat(deep)


# ----------------------------------------------------------------- controls


def test_priority_from_a_header_a_level_name_or_vllms_integer() -> None:
    assert submit({}, {"X-Priority": "high"}).priority == "high"
    assert submit({"priority": "low"}).priority == "low"
    # vLLM's integer: 0 is the default level, lower is more urgent, clamped.
    assert submit({"priority": 0}).priority == "normal"
    assert submit({"priority": -1}).priority == "high"
    assert submit({"priority": -10}).priority == "critical"
    assert submit({"priority": 2}).priority == "batch"
    assert submit({"priority": 99}).priority == "batch"
    assert submit({}, {"X-Priority": "-1"}).priority == "high"
    # The header wins over the body.
    assert submit({"priority": "batch"}, {"X-Priority": "critical"}).priority == "critical"
    assert refused({}, {"X-Priority": "asap"}).param == "X-Priority"
    assert refused({"priority": "asap"}).code == "unknown_priority"


def test_deadline_timeout_cost_and_keep_from_headers_or_body() -> None:
    sub = submit({}, {"X-Deadline": str(NOW + 100), "X-Max-Cost": "0.25"})
    assert (sub.deadline, sub.max_cost) == (NOW + 100, 0.25)
    assert submit({"request_timeout": 30}).deadline == NOW + 30
    # Both: the earlier one.
    assert submit({"deadline": NOW + 100}, {"X-Request-Timeout": "10"}).deadline == NOW + 10
    assert submit({"max_cost": 2}).max_cost == 2
    assert submit({}).keep_alive_on_disconnect is None
    assert submit({}, {"X-Keep-Alive-On-Disconnect": "true"}).keep_alive_on_disconnect
    assert submit({"keep_alive_on_disconnect": False}).keep_alive_on_disconnect is False
    for name, value in (
        ("X-Deadline", "soon"),
        ("X-Request-Timeout", "-3"),
        ("X-Max-Cost", "inf"),
        ("X-Keep-Alive-On-Disconnect", "perhaps"),
    ):
        assert refused({}, {name: value}).param == name


# ------------------------------------------------------------------ responses


def test_chunks_and_completions_have_openais_shape() -> None:
    plain = json.loads(chunk_bytes("r1", "chat", 5, content="hi"))
    assert plain == {
        "id": "r1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "chat",
        "system_fingerprint": None,
        "choices": [
            {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
        ],
    }
    with_usage = json.loads(chunk_bytes("r1", "chat", 5, finish="stop", with_usage=True))
    assert with_usage["usage"] is None
    assert with_usage["choices"][0]["delta"] == {}
    whole = json.loads(
        completion_bytes(
            "r1", "chat", 5, text="x", finish="weird", prompt_tokens=2, completion_tokens=3
        )
    )
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_streamed_tool_calls_have_openais_pieces() -> None:
    pieces = ToolCallPieces("chatcmpl-1")
    first = [ToolCallDelta(index=0, id="call_a", name="f", arguments='{"x"')]
    assert [msgspec.to_builtins(p) for p in pieces.pieces(first)] == [
        {
            "index": 0,
            "id": "call_a",
            "type": "function",
            "function": {"name": "f", "arguments": '{"x"'},
        }
    ]
    # Later pieces of the same call: arguments alone; a second call begins with its id.
    later = [
        ToolCallDelta(index=0, arguments=": 1}"),
        ToolCallDelta(index=1, name="g", arguments="{}"),
    ]
    assert [msgspec.to_builtins(p) for p in pieces.pieces(later)] == [
        {"index": 0, "function": {"arguments": ": 1}"}},
        # A backend that gives no id: one made from the request, the same every time.
        {
            "index": 1,
            "id": "call_chatcmpl-1_1",
            "type": "function",
            "function": {"name": "g", "arguments": "{}"},
        },
    ]
    # A resumed stream notes the pieces the client had; a new run begins anew.
    resumed = ToolCallPieces("chatcmpl-1")
    resumed.seen(first)
    assert msgspec.to_builtins(resumed.pieces(later)[0]) == {
        "index": 0,
        "function": {"arguments": ": 1}"},
    }
    resumed.restart()
    assert msgspec.to_builtins(resumed.pieces(first)[0])["id"] == "call_a"


def test_streamed_chunks_parse_with_the_sdks_types_and_accumulate() -> None:
    """The chunks of a tool call, read by the openai SDK's own stream state."""
    pieces = ToolCallPieces("r1")
    logprob = TokenLogprob(
        token="hi",
        logprob=-0.25,
        bytes=[104, 105],
        top_logprobs=(TopLogprob(token="hi", logprob=-0.25, bytes=[104, 105]),),
    )
    raw = [
        chunk_bytes("r1", "chat", 5, role="assistant", content=""),
        chunk_bytes("r1", "chat", 5, content="hi", logprobs=[logprob]),
        chunk_bytes(
            "r1",
            "chat",
            5,
            tool_calls=pieces.pieces([ToolCallDelta(index=0, id="c1", name="f", arguments="")]),
        ),
        chunk_bytes("r1", "chat", 5, tool_calls=pieces.pieces([ToolCallDelta(arguments='{"a"')])),
        chunk_bytes("r1", "chat", 5, tool_calls=pieces.pieces([ToolCallDelta(arguments=": 1}")])),
        chunk_bytes("r1", "chat", 5, finish=finish_reason("stop", tool_calls=True)),
    ]
    with_logprobs = json.loads(raw[1])["choices"][0]["logprobs"]
    assert with_logprobs == {
        "content": [
            {
                "token": "hi",
                "logprob": -0.25,
                "bytes": [104, 105],
                "top_logprobs": [{"token": "hi", "logprob": -0.25, "bytes": [104, 105]}],
            }
        ],
        "refusal": None,
    }
    state: ChatCompletionStreamState = ChatCompletionStreamState()
    for data in raw:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert message.content == "hi"
    assert message.tool_calls is not None
    call = message.tool_calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert (call.id, call.function.name, call.function.arguments) == ("c1", "f", '{"a": 1}')
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].logprobs is not None
    assert final.choices[0].logprobs.content is not None
    assert final.choices[0].logprobs.content[0].token == "hi"


def test_an_answer_of_tool_calls_and_the_turn_that_sends_it_back() -> None:
    calls = (
        ToolCall(id="call_9", name="get_weather", arguments='{"city": "Oslo"}'),
        ToolCall(name="f"),
    )
    data = completion_bytes(
        "r1",
        "chat",
        5,
        text="",
        finish="stop",
        prompt_tokens=2,
        completion_tokens=3,
        tool_calls=calls,
    )
    completion = ChatCompletion.model_validate_json(data)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    # No text: content null, as OpenAI's.
    assert json.loads(data)["choices"][0]["message"]["content"] is None
    assert choice.message.tool_calls is not None
    assert [(c.id, c.type) for c in choice.message.tool_calls] == [
        ("call_9", "function"),
        ("call_r1_1", "function"),
    ]
    # The client appends the message as the SDK serialises it, then the tool's answer.
    turn = choice.message.model_dump(exclude_unset=True, mode="json")
    sub = submit(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                turn,
                {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_r1_1", "content": "ok"},
            ]
        }
    )
    assert sub.messages[1] == ChatMessage(
        role="assistant",
        content="",
        tool_calls=(calls[0], ToolCall(id="call_r1_1", name="f", arguments="{}")),
    )
    assert sub.messages[2].tool_call_id == "call_9"
    # A plain answer has no tool_calls key; logprobs when there are some.
    plain = json.loads(
        completion_bytes(
            "r1",
            "chat",
            5,
            text="x",
            finish="length",
            prompt_tokens=1,
            completion_tokens=1,
            logprobs=[TokenLogprob(token="x", logprob=-1.0)],
        )
    )
    assert "tool_calls" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["choices"][0]["logprobs"]["content"][0] == {
        "token": "x",
        "logprob": -1.0,
        "bytes": None,
        "top_logprobs": [],
    }


# --------------------------------------------------------------------- errors


def test_terminal_events_map_to_statuses() -> None:
    base: dict[str, Any] = {"request_id": "r", "tenant": "t", "at": NOW}
    budget = from_terminal(
        Rejected(**base, error_type="budget_exhausted", reason="spent"), now=NOW + 60
    )
    assert (budget.status, budget.code) == (429, "budget_exhausted")
    assert budget.retry_after == day_ends(NOW) - (NOW + 60)
    assert budget.headers()["x-should-retry"] == "false"
    assert (
        from_terminal(Rejected(**base, error_type="unknown_route", reason=""), now=NOW).status
        == 404
    )
    assert (
        from_terminal(Rejected(**base, error_type="over_cost_cap", reason=""), now=NOW).param
        == "max_cost"
    )
    assert from_terminal(Expired(**base, stage="queued"), now=NOW).status == 504
    assert from_terminal(Cancelled(**base, stage="running"), now=NOW).status == 409
    failed = {
        "context_length": 400,
        "overloaded": 503,
        "quota_exhausted": 503,
        "server_error": 502,
        "broken_stream": 502,
    }
    for error_class, status in failed.items():
        event = Failed(**base, error_type="x", reason="y", error_class=error_class)
        assert from_terminal(event, now=NOW).status == status, error_class


def test_a_request_rejected_over_its_tenants_backlog_is_a_429_as_its_refused_submit() -> None:
    """``tenant_backlog_full`` is the tenant's own limit whether the broker
    refused the submit (a 429) or the forwarder ended a request sent without
    its route (binding split in groups): the same 429, not a 400 "invalid
    request". Not to be retried as it is (the SDK's retry of the same body
    joins this ended request): submitted again under a new id."""
    event = Rejected(
        request_id="r", tenant="t", at=NOW, error_type="tenant_backlog_full", reason="full"
    )
    error = from_terminal(event, now=NOW)
    refused = from_error(
        TenantBacklogFullError("maximum messages per subject exceeded", status=503, err_code=10077)
    )
    assert (error.status, error.code, error.type) == (refused.status, refused.code, refused.type)
    assert error.headers()["x-should-retry"] == "false"
    assert "full" in error.message


def test_a_feature_no_backend_has_is_a_400_naming_it() -> None:
    reason = str(UnsupportedFeatureError("chat", ["vision", "logprobs"]))
    event = Rejected(
        request_id="r", tenant="t", at=NOW, error_type="unsupported_feature", reason=reason
    )
    error = from_terminal(event, now=NOW)
    assert (error.status, error.code, error.param) == (400, "unsupported_feature", "messages")
    assert "vision" in error.message
    assert error.headers()["x-should-retry"] == "false"
    assert features_named(reason) == ["vision", "logprobs"]
    for feature, param in (
        ("tools", "tools"),
        ("json", "response_format"),
        ("json_schema", "response_format"),
        ("logprobs", "logprobs"),
    ):
        raised = from_error(UnsupportedFeatureError("chat", [feature]))
        assert (raised.status, raised.param) == (400, param)


def test_exceptions_map_to_statuses_without_details() -> None:
    assert from_error(NatsTimeoutError("slow")).status == 503
    full = from_error(StoreFullError("maximum bytes exceeded", err_code=10077))
    assert (full.status, full.code, full.type) == (503, "store_full", "server_error")
    assert full.retry_after is not None
    backlog = from_error(
        TenantBacklogFullError("maximum messages per subject exceeded", status=503, err_code=10077)
    )
    assert (backlog.status, backlog.code, backlog.type) == (
        429,
        "tenant_backlog_full",
        "invalid_request_error",
    )
    assert backlog.retry_after is not None
    assert (
        from_error(MalformedRequestError("Expected `float` - at `$.params.top_p`")).param == "top_p"
    )
    secret = from_error(RuntimeError("password=hunter2"))
    assert secret.status == 500
    assert "hunter2" not in secret.message
    assert json.loads(secret.body())["error"].keys() == {"message", "type", "param", "code"}


# ----------------------------------------------------------------------- keys


def test_keys_are_stored_hashed_and_map_to_tenants(tmp_path: Path) -> None:
    key = new_key()
    other = new_key()
    assert key.startswith("rq-")
    assert len(key) > 40
    file = tmp_path / "keys"
    file.write_text(f"# team keys\nsha256:{digest(other)} globex\n\n")
    config = parse_config(
        {"gateway": {"keys": [{"tenant": "acme", "sha256": digest(key)}], "keys_file": str(file)}}
    )
    store = KeyStore.from_config(config.gateway)
    assert store.tenant_of(key) == "acme"
    assert store.tenant_of(other) == "globex"
    assert store.tenant_of("rq-guess") is None
    assert store.tenant_of("") is None
    assert store.tenant_of("x" * 10_000) is None
    assert store.tenants == {"acme", "globex"}


def test_a_bad_keys_file_fails_at_start_without_showing_the_line(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.write_text("rq-plaintext-key-pasted-here acme\n")
    config = parse_config({"gateway": {"keys_file": str(file)}})
    with pytest.raises(ConfigError) as caught:
        KeyStore.from_config(config.gateway)
    assert "line 1" in str(caught.value)
    assert "rq-plaintext" not in str(caught.value)
    assert caught.value.path == "$.gateway.keys_file"
    with pytest.raises(ConfigError):
        KeyStore.from_config(parse_config({"gateway": {"keys_file": str(tmp_path / "no")}}).gateway)
    with pytest.raises(ConfigError) as bad:
        parse_config({"gateway": {"keys": [{"tenant": "acme", "sha256": "not-hex"}]}})
    assert bad.value.path.startswith("$.gateway.keys")


def test_one_digest_for_two_tenants_is_refused() -> None:
    sha = digest("k")
    config = parse_config(
        {"gateway": {"keys": [{"tenant": "a", "sha256": sha}, {"tenant": "b", "sha256": sha}]}}
    )
    with pytest.raises(ConfigError):
        KeyStore.from_config(config.gateway)


# ---------------------------------------------------------------- idempotency


def test_a_key_names_the_same_request_id_everywhere() -> None:
    assert id_for_key("k1") == id_for_key("k1")
    assert id_for_key("k1") != id_for_key("k2")
    assert len(id_for_key("x" * 255)) <= 128
    assert fingerprint("a", b"{}") != fingerprint("b", b"{}")


def test_retry_memory_forgets_after_its_ttl_and_past_its_size() -> None:
    now = [0.0]
    memory = RetryMemory(10.0, size=2, clock=lambda: now[0])
    memory.remember("a", "r1")
    now[0] = 5.0
    memory.remember("b", "r2")
    assert memory.recall("a") == "r1"
    now[0] = 10.5
    assert memory.recall("a") is None
    assert memory.recall("b") == "r2"
    memory.remember("c", "r3")
    memory.remember("d", "r4")
    assert len(memory) == 2
    assert memory.recall("b") is None


# ------------------------------------------------------------------ resume ids


def test_last_event_ids_parse_or_are_refused() -> None:
    assert parse_last_event_id(None).stage == "start"
    assert parse_last_event_id("0").stage == "role"
    assert parse_last_event_id("2.17") == parse_last_event_id(" 2.17 ")
    assert (parse_last_event_id("2.17").delivery, parse_last_event_id("2.17").seq) == (2, 17)
    assert parse_last_event_id("end").stage == "end"
    # "\u00b2" is a digit to str.isdigit and not to int(): once a 500.
    for bad in ("x", "1.", ".1", "1.2.3", "9" * 30 + ".1", "\u00b2.1", "1.\u0663"):
        with pytest.raises(ApiError):
            parse_last_event_id(bad)


# ------------------------------------------------------------------ error codes

GATEWAY = Path(__file__).resolve().parents[1] / "renqueue" / "gateway"


def _codes_in_source() -> dict[str, str]:
    """Every ``code="..."`` the gateway's sources pass, with where."""
    found: dict[str, str] = {}
    for path in sorted(GATEWAY.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            literal = isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant)
            if literal and node.arg == "code" and isinstance(node.value.value, str):
                found[node.value.value] = f"{path.name}:{node.value.lineno}"
    return found


def test_every_code_the_gateway_answers_with_is_known_and_documented() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "gateway.md").read_text()
    in_source = _codes_in_source()
    assert "header_timeout" in in_source  # the walk finds them
    for code, where in in_source.items():
        assert code in CODES, f"{code} ({where}) is not in _errors.CODES: its metric label is other"
    for code in sorted(CODES):
        assert f"`{code}`" in docs, f"{code} is not in docs/gateway.md"


def test_no_4xx_has_a_null_code() -> None:
    for status in (400, 401, 403, 404, 405, 408, 409, 410, 413, 422, 429, 431):
        assert ApiError(status, "x").code == STATUS_CODES[status]
        assert msgspec.json.decode(ApiError(status, "x").body())["error"]["code"]
    assert reason_of("header_timeout") == "header_timeout"
    assert reason_of("no such code, from an event") == "other"
    assert reason_of(None) == "other"


def _parse_and_translate(body: dict[str, Any]) -> Any:
    chat = parse_chat(json.dumps(body).encode())
    return translate(chat, {}, levels=LEVELS, default_level="normal", now=NOW)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "chat"}, "missing_required_parameter", "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "missing_required_parameter", "model"),
        (
            {"model": "chat", "messages": [{"role": "user", "content": "x" * 1_000_001}]},
            "string_above_max_length",
            "messages[0].content",
        ),
        ({"model": "chat", "messages": "hello"}, "invalid_type", "messages"),
        ({"model": "chat", "messages": []}, "array_below_min_length", "messages"),
        (
            {"model": "chat", "messages": [{"role": "user", "content": "x", "foo": 1}]},
            "unknown_parameter",
            "messages[0].foo",
        ),
        (
            {"model": "chat", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17},
            "array_above_max_length",
            "stop",
        ),
    ],
)
def test_validation_errors_have_openais_codes(body: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _parse_and_translate(body)
    error = caught.value
    assert (error.status, error.code, error.param) == (400, code, param), error.message
