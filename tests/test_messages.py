"""Wire format: round trips, validation of hostile input, schema, idempotency ids."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from renqueue.broker import msg_id_of
from renqueue.schema import (
    EVENT_DECODER,
    REQUEST_DECODER,
    SCHEMA_VERSION,
    TOKEN_DECODER,
    ChatMessage,
    Coalesced,
    Completed,
    Failed,
    GenerationParams,
    NamedTool,
    Routed,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    encode,
    is_terminal,
)

VALID = {
    "id": "req-1",
    "route": "chat",
    "messages": [{"role": "user", "content": "hi"}],
}


def test_request_round_trips_with_schema_version() -> None:
    request = REQUEST_DECODER.decode(json.dumps(VALID))
    assert request.v == SCHEMA_VERSION
    assert REQUEST_DECODER.decode(encode(request)) == request


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        ({"id": "has.dot"}, "$.id"),
        ({"id": "x" * 200}, "$.id"),
        ({"tenant": "a b"}, "$.tenant"),
        ({"messages": []}, "$.messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "$.messages[0].role"),
        ({"params": {"temperature": 9}}, "$.params.temperature"),
        ({"deadline": -1}, "$.deadline"),
        ({"route": None}, "$.route"),
    ],
)
def test_hostile_requests_fail_validation_naming_the_field(
    patch: dict[str, object], words: str
) -> None:
    with pytest.raises(
        msgspec.ValidationError, match=words.replace("[", r"\[").replace("$", r"\$")
    ):
        REQUEST_DECODER.decode(json.dumps({**VALID, **patch}))


def test_events_decode_by_kind_and_terminal_ones_have_no_msg_id() -> None:
    completed = Completed(
        request_id="r",
        tenant="t",
        at=1.0,
        backend="b",
        attempt=1,
        delivery=2,
        text="x",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        cost=0.0,
    )
    failed = Failed(request_id="r", tenant="t", at=2.0, error_type="e", reason="why")
    routed = Routed(
        request_id="r", tenant="t", at=0.5, backend="b", attempt=1, priority="high", queue_wait=0.1
    )
    assert EVENT_DECODER.decode(encode(completed)) == completed
    assert json.loads(encode(failed))["kind"] == "failed"
    assert is_terminal(completed)
    assert is_terminal(failed)
    assert not is_terminal(routed)
    # Exactly one terminal event rests on the terminal claim, not on a message
    # id a tenant could pre-occupy: terminal events are published without one.
    for terminal in (completed, failed):
        with pytest.raises(ValueError, match=r"EventLog\.finish"):
            msg_id_of(terminal)
    assert msg_id_of(routed) == "t:r:routed:1"
    # A follower put back may join a second leader: each join has an id of its own.
    joins = [Coalesced(request_id="r", tenant="t", at=1.0, leader=lead) for lead in "ab"]
    assert [msg_id_of(join) for join in joins] == ["t:r:coalesced:a", "t:r:coalesced:b"]


def test_old_events_without_new_fields_still_decode() -> None:
    # Schema evolution: fields with defaults may be absent in older log entries.
    old = {
        "kind": "failed",
        "request_id": "r",
        "tenant": "t",
        "at": 1.0,
        "error_type": "e",
        "reason": "r",
    }
    event = EVENT_DECODER.decode(json.dumps(old))
    assert isinstance(event, Failed)
    assert event.backend is None


def test_schema_command_prints_json_schema_for_every_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "renqueue", "schema"], check=True, capture_output=True, text=True
    ).stdout
    defs = json.loads(out)["$defs"]
    for name in ("InferenceRequest", "Dispatch", "TokenChunk", "Completed", "Rejected"):
        assert name in defs
    assert defs["InferenceRequest"]["properties"]["id"]["pattern"]
    # Version 2's types, and the widened content of a message.
    for name in ("TextPart", "ImagePart", "ToolCall", "ToolCallDelta", "Tool", "TokenLogprob"):
        assert name in defs
    content = defs["ChatMessage"]["properties"]["content"]
    assert {"string", "array"} <= {option.get("type") for option in content["anyOf"]}
    assert "tool_calls" in defs["TokenChunk"]["properties"]


# ------------------------------------------------------------ schema version 2

#: As version 1 wrote them (the shapes a log from before schema 2 holds).
V1_REQUEST = (
    b'{"v":1,"id":"old","tenant":"acme","route":"chat","messages":[{"role":"system",'
    b'"content":"be brief"},{"role":"user","content":"hi"}],"params":{"max_tokens":16,'
    b'"temperature":0.5},"priority":"high","deadline":null,"max_cost":null,"complexity":null,'
    b'"metadata":{},"submitted_at":1.5,"parent_id":null,"requeues":0,"dedupe_key":null,'
    b'"coalesce":false,"fallback":null,"split":null}'
)
V1_CHUNK = (
    b'{"v":1,"request_id":"old","delivery":1,"seq":0,"text":"he","restart":false,"final":false}'
)
V1_COMPLETED = (
    b'{"kind":"completed","v":1,"request_id":"old","tenant":"acme","at":2.0,"backend":"b",'
    b'"attempt":1,"delivery":1,"text":"hello","usage":{"prompt_tokens":3,"completion_tokens":2},'
    b'"cost":0.0,"finish_reason":"stop","ttft":0.1,"duration":0.2,"shared_with":null,'
    b'"limits":[],"reserved_tokens":0}'
)


def test_version_1_messages_in_a_log_decode_under_version_2() -> None:
    request = REQUEST_DECODER.decode(V1_REQUEST)
    assert request.v == 1
    assert [m.text for m in request.messages] == ["be brief", "hi"]
    assert request.messages[1] == ChatMessage(role="user", content="hi")
    assert request.params == GenerationParams(max_tokens=16, temperature=0.5)
    # Re-encoded, a version-1 request keeps its messages' and params' bytes:
    # coalescing keys and audits of old logs do not move.
    assert (
        b'"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]'
        in encode(request)
    )
    assert b'"params":{"max_tokens":16,"temperature":0.5}' in encode(request)
    chunk = TOKEN_DECODER.decode(V1_CHUNK)
    assert (chunk.text, chunk.tool_calls, chunk.finish_reason, chunk.usage) == (
        "he",
        (),
        None,
        None,
    )
    completed = EVENT_DECODER.decode(V1_COMPLETED)
    assert isinstance(completed, Completed)
    assert (completed.text, completed.tool_calls, completed.logprobs) == ("hello", (), ())


def test_every_version_2_field_round_trips() -> None:
    full = {
        "id": "new",
        "route": "chat",
        "messages": [
            {"role": "system", "content": "you call tools"},
            {
                "role": "user",
                "name": "ada",
                "content": [
                    {"type": "text", "text": "what is in"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_1", "name": "look", "arguments": '{"at": "image"}'}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        ],
        "params": {
            "max_tokens": 64,
            "presence_penalty": -1.5,
            "frequency_penalty": 2,
            "logprobs": True,
            "top_logprobs": 3,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
            },
            "tools": [{"name": "look", "description": "look at", "parameters": {"type": "object"}}],
            "tool_choice": {"name": "look"},
            "parallel_tool_calls": False,
            "user": "u-1",
            "extra": {"top_k": 40, "repetition_penalty": 1.1, "nested": {"a": [1, 2]}},
        },
    }
    request = REQUEST_DECODER.decode(json.dumps(full))
    assert request.v == SCHEMA_VERSION == 2
    assert REQUEST_DECODER.decode(encode(request)) == request
    assert json.loads(encode(request))["messages"] == full["messages"]
    assert request.messages[1].text == "what is in"
    assert [i.url[:10] for i in request.messages[1].images] == ["data:image"]
    assert request.params.tool_choice == NamedTool(name="look")
    assert (
        REQUEST_DECODER.decode(
            json.dumps({**full, "params": {"tool_choice": "required"}})
        ).params.tool_choice
        == "required"
    )
    chunk = TokenChunk(
        request_id="new",
        tool_calls=(ToolCallDelta(index=0, id="call_1", name="look", arguments="{}"),),
        logprobs=(
            TokenLogprob(
                token="a", logprob=-0.1, top_logprobs=(TopLogprob(token="a", logprob=-0.1),)
            ),
        ),
        final=True,
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=1, completion_tokens=2),
    )
    assert TOKEN_DECODER.decode(encode(chunk)) == chunk


@pytest.mark.parametrize(
    ("messages", "params", "words"),
    [
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            {},
            "$.messages[0].content",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
            {},
            "$.messages[0].content[0].image_url.url",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://x", "detail": "ultra"}}
                    ],
                }
            ],
            {},
            "detail",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}],
            {},
            "$.messages[0].tool_calls[0]",
        ),
        ([{"role": "user", "content": 7}], {}, "$.messages[0].content"),
        (
            [{"role": "user", "content": "x"}],
            {"tools": [{"name": "has space"}]},
            "$.params.tools[0].name",
        ),
        ([{"role": "user", "content": "x"}], {"tools": [{"name": "f"}] * 129}, "$.params.tools"),
        ([{"role": "user", "content": "x"}], {"tool_choice": "always"}, "$.params.tool_choice"),
        (
            [{"role": "user", "content": "x"}],
            {"response_format": {"type": "yaml"}},
            "$.params.response_format.type",
        ),
        ([{"role": "user", "content": "x"}], {"presence_penalty": 3}, "$.params.presence_penalty"),
        ([{"role": "user", "content": "x"}], {"top_logprobs": 21}, "$.params.top_logprobs"),
        (
            [{"role": "user", "content": "x"}],
            {"extra": {str(i): i for i in range(65)}},
            "$.params.extra",
        ),
    ],
)
def test_hostile_version_2_fields_fail_validation_naming_the_field(
    messages: list[object], params: dict[str, object], words: str
) -> None:
    body = {**VALID, "messages": messages, "params": params}
    with pytest.raises(
        msgspec.ValidationError,
        match=words.replace("[", r"\[").replace("$", r"\$").replace(".", r"\."),
    ):
        REQUEST_DECODER.decode(json.dumps(body))
