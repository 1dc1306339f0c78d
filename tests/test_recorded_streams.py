"""The native adapters on the providers' own recorded bytes, and on hostile ones.

Each recording is served as it was sent, by a small aiohttp server on
loopback (a scenario per path); the adapter under test reads it as it would
read the provider. Where each recording comes from is said beside it. The
hostile bodies (malformed lines, truncated streams, huge fields, prompts
echoed in error bodies) must each end in a typed error, never a crash.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from _loopback import serve
from aiohttp import web

from renqueue.backends import HTTPBackend, make_backend
from renqueue.backends._http import status_class
from renqueue.backends.base import Delta, ToolCall
from renqueue.config import parse_config
from renqueue.errors import BackendError, FailureClass, RateLimitedError
from renqueue.policy import estimate_input_tokens
from renqueue.schema import ChatMessage, InferenceRequest, Usage

REQUEST = InferenceRequest(
    id="req-1", route="chat", messages=[ChatMessage(role="user", content="Hello")]
)


@dataclass
class Recorded:
    """One response as a provider sent it."""

    body: bytes
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)


def sse(text: str) -> Recorded:
    return Recorded(text.encode())


def body(payload: Any, status: int = 200, **headers: str) -> Recorded:
    return Recorded(json.dumps(payload).encode(), status, "application/json", headers)


# ------------------------------------------------------------------ Anthropic

#: anthropic-sdk-python, tests/lib/streaming/fixtures/basic_response.txt.
ANTHROPIC_BASIC = """event: message_start
data: {"type":"message_start","message":{"id":"msg_4QpJur2dWWDjF6C758FbBw5vm12BaVipnK","type":"message","role":"assistant","content":[],"model":"claude-3-opus-latest","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":11,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" there"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"!"}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":6}}

event: message_stop
data: {"type":"message_stop"}"""  # noqa: E501 - recorded bytes, kept as they were

#: anthropic-sdk-python, tests/lib/streaming/fixtures/tool_use_response.txt.
ANTHROPIC_TOOL_USE = """event: message_start
data: {"type":"message_start","message":{"id":"msg_019Q1hrJbZG26Fb9BQhrkHEr","type":"message","role":"assistant","model":"claude-sonnet-4-20250514","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":377,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1,"service_tier":"standard"}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"I"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"'ll check the current weather in Paris for you."}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01NRLabsLyVHZPKxbKvkfSMn","name":"get_weather","caller":{"type":"direct"},"input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\\"locati"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"on\\": \\"P"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"ar"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"is\\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":65}}

event: message_stop
data: {"type":"message_stop"}"""  # noqa: E501 - recorded bytes, kept as they were

#: anthropic-sdk-python, tests/lib/streaming/fixtures/refusal_response.txt.
ANTHROPIC_REFUSAL = """event: message_start
data: {"type":"message_start","message":{"id":"msg_01RefusalTestMessage123456789","type":"message","role":"assistant","content":[],"model":"claude-opus-4-7","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":20,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"refusal","stop_sequence":null,"stop_details":{"type":"refusal","category":"cyber","explanation":"This request was refused due to policy."}},"usage":{"output_tokens":120,"output_tokens_details":{"thinking_tokens":67}}}

event: message_stop
data: {"type":"message_stop"}
"""  # noqa: E501 - recorded bytes, kept as they were

#: The mid-stream error of https://docs.anthropic.com/en/api/messages-streaming
#: ("Error events"), after the opening of ANTHROPIC_BASIC.
ANTHROPIC_OVERLOADED_MID_STREAM = (
    ANTHROPIC_BASIC.split("event: content_block_stop", maxsplit=1)[0]
    + 'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
    '"message": "Overloaded"}}\n\n'
)

#: The non-streaming Message of https://docs.anthropic.com/en/api/messages (response example).
ANTHROPIC_MESSAGE = {
    "content": [{"text": "Hi! My name is Claude.", "type": "text"}],
    "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF",
    "model": "claude-3-7-sonnet-20250219",
    "role": "assistant",
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "type": "message",
    "usage": {"input_tokens": 2095, "output_tokens": 503},
}


def anthropic_error(kind: str, message: str) -> dict[str, Any]:
    """The error shape of https://docs.anthropic.com/en/api/errors."""
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy",
    }


# ------------------------------------------------------------------- Ollama
# ollama/ollama docs/api.md, "Chat Request (Streaming)" (the first and the final
# object; their text is the docs'), and "Chat request (with tools)".

OLLAMA_STREAM = (
    '{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00",'
    '"message":{"role":"assistant","content":"The","images":null},"done":false}\n'
    '{"model":"llama3.2","created_at":"2023-08-04T19:22:45.499127Z","done":true,'
    '"total_duration":4883583458,"load_duration":1334875,"prompt_eval_count":26,'
    '"prompt_eval_duration":342546000,"eval_count":282,"eval_duration":4535599000}\n'
)
OLLAMA_TOOLS = {
    "model": "llama3.2",
    "created_at": "2024-07-22T20:33:28.123648Z",
    "message": {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "function": {
                    "name": "get_current_weather",
                    "arguments": {"format": "celsius", "location": "Paris, FR"},
                }
            }
        ],
    },
    "done_reason": "stop",
    "done": True,
    "total_duration": 885095291,
    "load_duration": 3753500,
    "prompt_eval_count": 122,
    "prompt_eval_duration": 328493000,
    "eval_count": 33,
    "eval_duration": 552222000,
}

# ---------------------------------------------------------------------- TGI

#: A TGI session's last three events, logged by the qatai project
#: (pkg/models, 2023-07-26), framed as TGI's router sends them (``data:``, no space).
TGI_STREAM = (
    'data:{"token":{"id":4234,"text":" country","logprob":0.0,"special":false},'
    '"generated_text":null,"details":null}\n\n'
    'data:{"token":{"id":297,"text":" in","logprob":0.0,"special":false},'
    '"generated_text":null,"details":null}\n\n'
    'data:{"token":{"id":278,"text":" the","logprob":0.0,"special":false},'
    '"generated_text":"The biggest country in the","details":{"finish_reason":"length",'
    '"generated_tokens":5,"seed":1858748514924990677}}\n\n'
)
#: The first events of a TGI 1.4 stream, recorded in opea-project/GenAIInfra
#: manifests/DocSum/README.md: the README stops there, so the stream is truncated.
TGI_TRUNCATED = (
    'data:{"index":1,"token":{"id":89554,"text":" Deep","logprob":-0.9719473,"special":false},'
    '"generated_text":null,"details":null}\n\n'
    'data:{"index":2,"token":{"id":89950,"text":" Learning","logprob":-0.39028463,'
    '"special":false},"generated_text":null,"details":null}\n\n'
)
#: TGI's /generate answer (its OpenAPI example in docs/openapi.json, trimmed).
TGI_GENERATE = {
    "generated_text": "test",
    "details": {
        "finish_reason": "eos_token",
        "generated_tokens": 1,
        "prompt_tokens": 4,
        "seed": 42,
        "prefill": [],
        "tokens": [{"id": 0, "logprob": -0.34, "special": False, "text": "test"}],
    },
}

# ------------------------------------------------------------------- Gemini

#: A gemini-1.5-pro-002 stream recorded in discourse/discourse-ai,
#: spec/lib/completions/endpoints/gemini_spec.rb (its safetyRatings kept).
GEMINI_STREAM = """data: {"candidates": [{"content": {"parts": [{"text": "Certainly"}],"role": "model"}}],"usageMetadata": {"promptTokenCount": 399,"totalTokenCount": 399},"modelVersion": "gemini-1.5-pro-002"}

data: {"candidates": [{"content": {"parts": [{"text": "! I'll create a simple \\"Hello, World!\\" page where each letter"}],"role": "model"},"safetyRatings": [{"category": "HARM_CATEGORY_HATE_SPEECH","probability": "NEGLIGIBLE"},{"category": "HARM_CATEGORY_DANGEROUS_CONTENT","probability": "NEGLIGIBLE"},{"category": "HARM_CATEGORY_HARASSMENT","probability": "NEGLIGIBLE"},{"category": "HARM_CATEGORY_SEXUALLY_EXPLICIT","probability": "NEGLIGIBLE"}]}],"usageMetadata": {"promptTokenCount": 399,"totalTokenCount": 399},"modelVersion": "gemini-1.5-pro-002"}

data: {"candidates": [{"content": {"parts": [{"text": " has a different color using inline styles for simplicity.  Each letter will be wrapped"}],"role": "model"},"safetyRatings": [{"category": "HARM_CATEGORY_HATE_SPEECH","probability": "NEGLIGIBLE"},{"category": "HARM_CATEGORY_DANGEROUS_CONTENT","probability": "NEGLIGIBLE"},{"category": "HARM_CATEGORY_HARASSMENT","probability": "NEGLIGIBLE"},{"category": "HARM_CATEGORY_SEXUALLY_EXPLICIT","probability": "NEGLIGIBLE"}]}],"usageMetadata": {"promptTokenCount": 399,"totalTokenCount": 399},"modelVersion": "gemini-1.5-pro-002"}

data: {"candidates": [{"content": {"parts": [{"text": ""}],"role": "model"},"finishReason": "STOP"}],"usageMetadata": {"promptTokenCount": 399,"candidatesTokenCount": 191,"totalTokenCount": 590},"modelVersion": "gemini-1.5-pro-002"}

"""  # noqa: E501 - recorded bytes, kept as they were
GEMINI_TEXT = (
    'Certainly! I\'ll create a simple "Hello, World!" page where each letter has a '
    "different color using inline styles for simplicity.  Each letter will be wrapped"
)
#: A function call as https://ai.google.dev/gemini-api/docs/function-calling shows it.
GEMINI_FUNCTION_CALL = {
    "candidates": [
        {
            "content": {
                "parts": [
                    {
                        "functionCall": {
                            "name": "schedule_meeting",
                            "args": {
                                "attendees": ["Bob", "Alice"],
                                "date": "2025-03-27",
                                "time": "10:00",
                                "topic": "Q3 planning",
                            },
                        }
                    }
                ],
                "role": "model",
            },
            "finishReason": "STOP",
            "index": 0,
        }
    ],
    "usageMetadata": {"promptTokenCount": 111, "candidatesTokenCount": 28, "totalTokenCount": 139},
}
#: A free-tier 429 as recorded in a bug report (googleapis/python-genai#2044), trimmed
#: to its per-minute violation.
GEMINI_429 = {
    "error": {
        "code": 429,
        "message": "You exceeded your current quota, please check your plan and billing "
        "details. For more information on this error, head to: "
        "https://ai.google.dev/gemini-api/docs/rate-limits.",
        "status": "RESOURCE_EXHAUSTED",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [
                    {
                        "quotaMetric": "generativelanguage.googleapis.com/"
                        "generate_content_free_tier_requests",
                        "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                        "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"},
                        "quotaValue": "15",
                    }
                ],
            },
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "47s"},
        ],
    }
}
#: The 400 Gemini answers a bad key with, as users report it (google-gemini/cookbook issues).
GEMINI_BAD_KEY = {
    "error": {
        "code": 400,
        "message": "API key not valid. Please pass a valid API key.",
        "status": "INVALID_ARGUMENT",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "API_KEY_INVALID",
                "domain": "googleapis.com",
                "metadata": {"service": "generativelanguage.googleapis.com"},
            }
        ],
    }
}


def gemini_error(code: int, status: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


# ------------------------------------------------------------------ hostile

ECHOED_PROMPT = "please mind the context window and the content filter"
HUGE = "x" * (5 * 1024 * 1024)

SCENARIOS: dict[str, Recorded] = {
    "anthropic-basic": sse(ANTHROPIC_BASIC),
    "anthropic-tool-use": sse(ANTHROPIC_TOOL_USE),
    "anthropic-refusal": sse(ANTHROPIC_REFUSAL),
    "anthropic-overloaded-mid-stream": sse(ANTHROPIC_OVERLOADED_MID_STREAM),
    "anthropic-message": body(ANTHROPIC_MESSAGE),
    "anthropic-529": body(anthropic_error("overloaded_error", "Overloaded"), 529),
    "anthropic-429": body(
        anthropic_error("rate_limit_error", "Number of request tokens has exceeded your limit"),
        429,
        **{"retry-after": "9", "anthropic-ratelimit-requests-remaining": "0"},
    ),
    "anthropic-prompt-too-long": body(
        anthropic_error("invalid_request_error", "prompt is too long: 208491 tokens > 200000"), 400
    ),
    "anthropic-auth": body(anthropic_error("authentication_error", "invalid x-api-key"), 401),
    "anthropic-500-overloaded": body(anthropic_error("overloaded_error", "Overloaded"), 500),
    "anthropic-echo": body(anthropic_error("invalid_request_error", "messages: bad role"), 400),
    "anthropic-cut": sse(ANTHROPIC_BASIC.split("event: message_delta", maxsplit=1)[0]),
    # Its end marker, but the message_delta with its stop_reason left out: cut short.
    "anthropic-stop-without-reason": sse(
        ANTHROPIC_BASIC.split("event: message_delta", maxsplit=1)[0]
        + 'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    ),
    "anthropic-bad-json": sse(
        ANTHROPIC_BASIC.replace('"text":"!"}}', '"text":"!"')  # one event cut short
    ),
    "anthropic-huge": sse(
        ANTHROPIC_BASIC.split("event: content_block_stop", maxsplit=1)[0]
        + 'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"' + HUGE + '"}}\n\n'
    ),
    "ollama-stream": Recorded(OLLAMA_STREAM.encode(), content_type="application/x-ndjson"),
    "ollama-tools": body(OLLAMA_TOOLS),
    "ollama-404": body({"error": 'model "llama3.2" not found, try pulling it first'}, 404),
    "ollama-error-line": Recorded(
        (
            OLLAMA_STREAM.split("\n", maxsplit=1)[0]
            + '\n{"error":"llama runner process has terminated"}\n'
        ).encode(),
        content_type="application/x-ndjson",
    ),
    "ollama-cut": Recorded(
        (OLLAMA_STREAM.split("\n", maxsplit=1)[0] + "\n").encode(),
        content_type="application/x-ndjson",
    ),
    "ollama-bad-line": Recorded(
        b'{"message":{"content":"The"},"done":false}\n{"message":{"content":\n',
        content_type="application/x-ndjson",
    ),
    "ollama-huge-line": Recorded(
        b'{"message":{"content":"' + HUGE.encode() + b'"},"done":false}\n',
        content_type="application/x-ndjson",
    ),
    "ollama-not-an-object": Recorded(b"[1, 2, 3]\n", content_type="application/x-ndjson"),
    "tgi-stream": sse(TGI_STREAM),
    "tgi-truncated": sse(TGI_TRUNCATED),
    "tgi-generate": body(TGI_GENERATE),
    "tgi-overloaded": body({"error": "Model is overloaded", "error_type": "overloaded"}, 429),
    "tgi-validation": body(
        {
            "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
            "4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
            "error_type": "validation",
        },
        422,
    ),
    "tgi-generation-error": body(
        {
            "error": "Request failed during generation: Server error: OOM",
            "error_type": "generation",
        },
        424,
    ),
    "tgi-error-event": sse(
        TGI_TRUNCATED + 'data:{"error":"Request failed during generation: Server error: '
        'CUDA out of memory","error_type":"generation"}\n\n'
    ),
    "tgi-echo": body(
        {
            "error": "Input validation error: `temperature` must be strictly positive",
            "error_type": "validation",
            "inputs": ECHOED_PROMPT,
        },
        422,
    ),
    "gemini-stream": sse(GEMINI_STREAM),
    "gemini-function-call": sse(f"data: {json.dumps(GEMINI_FUNCTION_CALL)}\n\n"),
    "gemini-429": body(GEMINI_429, 429),
    "gemini-503": body(
        gemini_error(503, "UNAVAILABLE", "The model is overloaded. Please try again later."), 503
    ),
    "gemini-bad-key": body(GEMINI_BAD_KEY, 400),
    "gemini-too-long": body(
        gemini_error(
            400,
            "INVALID_ARGUMENT",
            "The input token count (1050000) exceeds the maximum number of tokens allowed "
            "(1048576).",
        ),
        400,
    ),
    "gemini-region": body(
        gemini_error(400, "FAILED_PRECONDITION", "User location is not supported for the API use."),
        400,
    ),
    "gemini-blocked": sse(
        'data: {"promptFeedback": {"blockReason": "SAFETY"},'
        '"usageMetadata": {"promptTokenCount": 8,"totalTokenCount": 8}}\n\n'
    ),
    "gemini-max-tokens": sse(
        GEMINI_STREAM.replace('"finishReason": "STOP"', '"finishReason": "MAX_TOKENS"')
    ),
    "gemini-no-finish": sse(GEMINI_STREAM.rsplit("data:", 1)[0]),
    "gemini-html": Recorded(b"<html>502 Bad Gateway</html>", 502, "text/html"),
    "gemini-echo": body(
        {
            "error": {
                **gemini_error(400, "INVALID_ARGUMENT", "Invalid value at 'contents[0]'")["error"],
                "details": [
                    {
                        "@type": "type.googleapis.com/google.rpc.BadRequest",
                        "fieldViolations": [{"field": "contents[0]", "description": ECHOED_PROMPT}],
                    }
                ],
            }
        },
        400,
    ),
}


@pytest.fixture
async def served() -> AsyncIterator[str]:
    """The origin of a server answering ``/<scenario>/...`` with that recording."""

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        recorded = SCENARIOS[request.match_info["scenario"]]
        response = web.StreamResponse(
            status=recorded.status,
            headers={**recorded.headers, "Content-Type": recorded.content_type},
        )
        await response.prepare(request)
        await response.write(recorded.body)
        return response

    app = web.Application()
    app.router.add_post("/{scenario}/{rest:.*}", answer)
    async with serve(app) as origin:
        yield origin


BASE_PATHS = {"anthropic": "/v1", "ollama": "", "tgi": "", "gemini": "/v1beta"}


@pytest.fixture
async def adapter(served: str) -> AsyncIterator[Callable[[str], HTTPBackend]]:
    """Builds the adapter the scenario's name starts with, pointed at the scenario."""
    built: list[HTTPBackend] = []

    def build(scenario: str) -> HTTPBackend:
        kind = scenario.split("-", 1)[0]
        raw = {"adapter": kind, "base_url": f"{served}/{scenario}{BASE_PATHS[kind]}", "model": "m"}
        backend = make_backend("b", parse_config({"backends": {"b": raw}}).backends["b"])
        assert isinstance(backend, HTTPBackend)
        built.append(backend)
        return backend

    yield build
    for backend in built:
        await backend.close()


async def collect(backend: HTTPBackend) -> list[Delta]:
    return [delta async for delta in backend.stream(REQUEST)]


async def failure(backend: HTTPBackend, *, streaming: bool = True) -> BackendError:
    call = collect(backend) if streaming else backend.complete(REQUEST)
    with pytest.raises(BackendError) as caught:
        await call
    return caught.value


def text(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


# ---------------------------------------------------------- recorded answers


async def test_anthropic_basic_stream(adapter: Callable[[str], HTTPBackend]) -> None:
    deltas = await collect(adapter("anthropic-basic"))
    assert text(deltas) == "Hello there!"
    assert deltas[-1] == Delta(
        usage=Usage(prompt_tokens=11, completion_tokens=6), finish_reason="stop", end=True
    )


async def test_anthropic_tool_use_is_assembled_from_its_json_pieces(
    adapter: Callable[[str], HTTPBackend],
) -> None:
    deltas = await collect(adapter("anthropic-tool-use"))
    assert text(deltas) == "I'll check the current weather in Paris for you."
    last = deltas[-1]
    assert last.finish_reason == "tool_calls"
    assert last.usage == Usage(prompt_tokens=377, completion_tokens=65)
    assert last.tool_calls == (
        ToolCall(
            id="toolu_01NRLabsLyVHZPKxbKvkfSMn",
            name="get_weather",
            arguments='{"location": "Paris"}',
        ),
    )


async def test_anthropic_refusal_is_an_answer_with_finish_reason_content_filter(
    adapter: Callable[[str], HTTPBackend],
) -> None:
    deltas = await collect(adapter("anthropic-refusal"))
    assert text(deltas) == ""
    assert deltas[-1].finish_reason == "content_filter"
    assert deltas[-1].usage == Usage(prompt_tokens=20, completion_tokens=120)


async def test_anthropic_message_not_streamed(adapter: Callable[[str], HTTPBackend]) -> None:
    generation = await adapter("anthropic-message").complete(REQUEST)
    assert generation.text == "Hi! My name is Claude."
    assert generation.usage == Usage(prompt_tokens=2095, completion_tokens=503)
    assert generation.finish_reason == "stop"


async def test_ollama_stream_and_its_final_counts(adapter: Callable[[str], HTTPBackend]) -> None:
    deltas = await collect(adapter("ollama-stream"))
    assert text(deltas) == "The"
    # The docs' final object has no done_reason: a done line is a stop.
    assert deltas[-1] == Delta(
        usage=Usage(prompt_tokens=26, completion_tokens=282), finish_reason="stop", end=True
    )


async def test_ollama_tool_calls_come_whole(adapter: Callable[[str], HTTPBackend]) -> None:
    generation = await adapter("ollama-tools").complete(REQUEST)
    assert generation.text == ""
    assert generation.finish_reason == "tool_calls"
    assert generation.usage == Usage(prompt_tokens=122, completion_tokens=33)
    (call,) = generation.tool_calls
    assert call.name == "get_current_weather"
    assert json.loads(call.arguments) == {"format": "celsius", "location": "Paris, FR"}
    # A server that answers a stream request with one JSON body: the same answer.
    deltas = await collect(adapter("ollama-tools"))
    assert deltas[-1].tool_calls == generation.tool_calls


async def test_tgi_stream_takes_the_last_tokens_text_and_its_details(
    adapter: Callable[[str], HTTPBackend],
) -> None:
    deltas = await collect(adapter("tgi-stream"))
    assert text(deltas) == " country in the"
    assert deltas[-1].finish_reason == "length"
    # generated_tokens; no prompt count in this version's details: estimated.
    assert deltas[-1].usage == Usage(
        prompt_tokens=estimate_input_tokens(REQUEST), completion_tokens=5
    )


async def test_tgi_generate_answer(adapter: Callable[[str], HTTPBackend]) -> None:
    generation = await adapter("tgi-generate").complete(REQUEST)
    assert generation.text == "test"
    assert generation.finish_reason == "stop"  # eos_token
    assert generation.usage == Usage(prompt_tokens=4, completion_tokens=1)


async def test_gemini_stream(adapter: Callable[[str], HTTPBackend]) -> None:
    deltas = await collect(adapter("gemini-stream"))
    assert text(deltas) == GEMINI_TEXT
    assert deltas[-1] == Delta(
        usage=Usage(prompt_tokens=399, completion_tokens=191), finish_reason="stop", end=True
    )
    deltas = await collect(adapter("gemini-max-tokens"))
    assert deltas[-1].finish_reason == "length"


async def test_gemini_function_call(adapter: Callable[[str], HTTPBackend]) -> None:
    deltas = await collect(adapter("gemini-function-call"))
    assert text(deltas) == ""
    last = deltas[-1]
    assert last.finish_reason == "tool_calls"
    assert last.usage == Usage(prompt_tokens=111, completion_tokens=28)
    (call,) = last.tool_calls
    assert call.name == "schedule_meeting"
    assert json.loads(call.arguments)["attendees"] == ["Bob", "Alice"]


# ------------------------------------------------------------ recorded errors


@pytest.mark.parametrize(
    ("scenario", "expected", "fragment"),
    [
        ("anthropic-529", FailureClass.OVERLOADED, "Overloaded"),
        ("anthropic-429", FailureClass.RATE_LIMITED, "exceeded your limit"),
        ("anthropic-prompt-too-long", FailureClass.CONTEXT_LENGTH, "prompt is too long"),
        ("anthropic-auth", FailureClass.UNAVAILABLE, "invalid x-api-key"),
        # The type says more than the status: an overload, not a server fault.
        ("anthropic-500-overloaded", FailureClass.OVERLOADED, "Overloaded"),
        ("ollama-404", FailureClass.UNAVAILABLE, "try pulling it first"),
        # TGI's 429 is its concurrency cap: an overload (no rate to learn).
        ("tgi-overloaded", FailureClass.OVERLOADED, "Model is overloaded"),
        ("tgi-validation", FailureClass.CONTEXT_LENGTH, "must be <= 4096"),
        # 424, which the status table would call a configuration fault.
        ("tgi-generation-error", FailureClass.SERVER_ERROR, "OOM"),
        ("gemini-429", FailureClass.RATE_LIMITED, "exceeded your current quota"),
        ("gemini-503", FailureClass.OVERLOADED, "overloaded"),
        # A 400 that is not the request's fault: the key, or the caller's region.
        ("gemini-bad-key", FailureClass.UNAVAILABLE, "API key not valid"),
        ("gemini-region", FailureClass.UNAVAILABLE, "User location"),
        ("gemini-too-long", FailureClass.CONTEXT_LENGTH, "exceeds the maximum number"),
        ("gemini-html", FailureClass.SERVER_ERROR, "502 Bad Gateway"),
    ],
)
@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
async def test_recorded_errors_are_classified(
    adapter: Callable[[str], HTTPBackend],
    scenario: str,
    expected: FailureClass,
    fragment: str,
    streaming: bool,
) -> None:
    error = await failure(adapter(scenario), streaming=streaming)
    assert error.failure is expected, error
    assert fragment in str(error)
    assert error.status == SCENARIOS[scenario].status


async def test_anthropic_429_says_when_to_retry(adapter: Callable[[str], HTTPBackend]) -> None:
    backend = adapter("anthropic-429")
    error = await failure(backend)
    assert isinstance(error, RateLimitedError)
    assert error.retry_after == 9.0
    assert backend.last_rate_limit is not None
    window = backend.last_rate_limit.find("requests", 60)
    assert window is not None
    assert window.remaining == 0


async def test_gemini_429_retry_info_is_the_retry_after(
    adapter: Callable[[str], HTTPBackend],
) -> None:
    error = await failure(adapter("gemini-429"))
    assert isinstance(error, RateLimitedError)
    assert error.retry_after == 47.0
    assert not error.quota_exhausted


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("anthropic-overloaded-mid-stream", FailureClass.OVERLOADED),  # overloaded_error
        ("tgi-error-event", FailureClass.SERVER_ERROR),  # error_type generation
        ("ollama-error-line", FailureClass.SERVER_ERROR),
        # A blocked prompt is a 200 without candidates: the content filter.
        ("gemini-blocked", FailureClass.CONTENT_FILTER),
    ],
)
async def test_errors_sent_in_band(
    adapter: Callable[[str], HTTPBackend], scenario: str, expected: FailureClass
) -> None:
    # The whole recording arrives in one network read: the text before the error
    # never left the adapter, so this is the error's own class, not a broken stream
    # (a stream broken after text was passed on: tests/test_native_adapters.py).
    seen: list[str] = []

    async def consume() -> None:
        async for delta in adapter(scenario).stream(REQUEST):
            seen.append(delta.text)

    with pytest.raises(BackendError) as caught:
        await consume()
    assert caught.value.failure is expected, caught.value
    assert "error in stream" in str(caught.value)
    assert seen == []


# ------------------------------------------------------------ hostile bodies


@pytest.mark.parametrize(
    ("scenario", "fragment"),
    [
        ("anthropic-cut", "before message_stop"),  # no message_delta, no message_stop
        ("anthropic-stop-without-reason", "message_stop but no stop_reason"),
        ("anthropic-bad-json", "malformed stream chunk"),
        ("anthropic-huge", "line longer than"),
        ("ollama-cut", "before its done line"),
        ("ollama-bad-line", "malformed stream chunk"),
        ("ollama-huge-line", "JSON line longer than"),
        ("ollama-not-an-object", "malformed stream chunk"),
        ("tgi-truncated", "before its final event"),
        ("gemini-no-finish", "before a finishReason"),
    ],
)
async def test_hostile_streams_are_typed_errors(
    adapter: Callable[[str], HTTPBackend], scenario: str, fragment: str
) -> None:
    error = await failure(adapter(scenario))
    assert error.retryable
    assert error.failure in (FailureClass.MALFORMED, FailureClass.BROKEN_STREAM)
    assert fragment in str(error)
    assert len(str(error)) < 1000  # a huge field is not copied into the message


@pytest.mark.parametrize("scenario", ["anthropic-echo", "tgi-echo", "gemini-echo"])
async def test_a_prompt_echoed_in_an_error_body_does_not_decide_its_class(
    adapter: Callable[[str], HTTPBackend], scenario: str
) -> None:
    # The echo says "context window" and "content filter"; the code and message do not.
    error = await failure(adapter(scenario))
    assert error.failure is FailureClass.BAD_REQUEST


def test_the_status_table_is_what_a_format_without_error_types_gets() -> None:
    assert status_class(529, b"") is FailureClass.OVERLOADED
    assert status_class(424, b"") is FailureClass.UNAVAILABLE
    assert status_class(400, b'{"error": "the input length exceeds the context length"}') is (
        FailureClass.CONTEXT_LENGTH
    )


async def test_nonsense_token_counts_are_estimated_not_carried_into_events(
    served: str,
) -> None:
    # A negative or absurd count would make the completed event fail validation
    # wherever it is read (usage counts are >= 0): estimated instead.
    SCENARIOS["ollama-nonsense-usage"] = Recorded(
        b'{"message":{"content":"abcd"},"done":false}\n'
        b'{"done":true,"prompt_eval_count":-5,"eval_count":100000000000000000000000}\n',
        content_type="application/x-ndjson",
    )
    raw = {"adapter": "ollama", "base_url": f"{served}/ollama-nonsense-usage", "model": "m"}
    backend = make_backend("b", parse_config({"backends": {"b": raw}}).backends["b"])
    try:
        deltas = [delta async for delta in backend.stream(REQUEST)]
    finally:
        await backend.close()
        del SCENARIOS["ollama-nonsense-usage"]
    # The prompt as the router estimates it; one text delta: 1 completion token.
    assert deltas[-1].usage == Usage(
        prompt_tokens=estimate_input_tokens(REQUEST), completion_tokens=1
    )


async def test_a_huge_finish_reason_is_cut_before_it_travels_in_an_event(
    adapter: Callable[[str], HTTPBackend],
) -> None:
    SCENARIOS["gemini-huge-reason"] = sse(
        GEMINI_STREAM.replace('"finishReason": "STOP"', f'"finishReason": "{"Z" * 100_000}"')
    )
    try:
        deltas = await collect(adapter("gemini-huge-reason"))
    finally:
        del SCENARIOS["gemini-huge-reason"]
    assert deltas[-1].finish_reason == "z" * 32  # unknown: passed through, lower case, cut
