"""Hostile version-2 requests and answers (the review of issue #11 item 1):
nesting that overflows a decoder, pass-through parameters that act behind
the router, image URLs a backend would fetch inside the operator's network,
tool calls and log probabilities a backend sends past the wire's bounds, and
what version 1 wrote that must still mean what it meant. Pure rules first,
then end to end on a real nats-server with loopback backends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from _loopback import serve
from aiohttp import web
from test_fallback import FAST
from test_restarts import TENANT

from renqueue import Client, RequestFailedError, RequestRejectedError, Services, parse_config
from renqueue.backends._http import error_detail
from renqueue.broker import EmbeddedServer
from renqueue.errors import MalformedRequestError, RetryableBackendError
from renqueue.mock import MockBackend
from renqueue.policy import needs, validate
from renqueue.schema import (
    REQUEST_DECODER,
    REQUEST_HEADROOM,
    ChatMessage,
    GenerationParams,
    InferenceRequest,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    encode,
    msg_id,
    request_subject,
)
from renqueue.services.worker._call import LOGPROBS_BUDGET, Caller, _keep_logprobs


def config_of(backend: str = "http://127.0.0.1:1", nats_url: str | None = None, **nats: str) -> Any:
    """One backend ``b`` at ``backend``, route ``chat``; ``nats`` settings besides the URL."""
    return parse_config(
        {
            **({"nats": {"url": nats_url, **nats}} if nats_url else {}),
            "backends": {"b": {"base_url": backend, "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
        }
    )


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def raw_request(request_id: str, extra: bytes) -> bytes:
    return (
        b'{"id":"' + request_id.encode() + b'","tenant":"' + TENANT.encode() + b'",'
        b'"route":"chat","messages":[{"role":"user","content":"hi"}],'
        b'"params":{"extra":{"deep":' + extra + b"}}}"
    )


def test_json_nested_past_the_recursion_limit_is_a_decode_error_not_a_crash() -> None:
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        REQUEST_DECODER.decode(raw_request("r", nested(5000)))


def test_free_form_json_deeper_than_64_levels_is_refused_at_admission() -> None:
    request = REQUEST_DECODER.decode(raw_request("r", nested(100)))
    with pytest.raises(MalformedRequestError, match=r"params\.extra is nested deeper than 64"):
        validate(request, level="normal", tenant=TENANT, config=config_of())
    shallow = REQUEST_DECODER.decode(raw_request("r", nested(10)))
    validate(shallow, level="normal", tenant=TENANT, config=config_of())


@pytest.mark.parametrize(
    "key", ["n", "max_completion_tokens", "models", "provider", "store", "chat_template", "model"]
)
def test_pass_through_parameters_that_act_behind_the_router_are_refused(key: str) -> None:
    request = InferenceRequest(
        id="r",
        tenant=TENANT,
        route="chat",
        messages=[ChatMessage(role="user", content="hi")],
        params=GenerationParams(extra={key: 2, "top_k": 40}),
    )
    with pytest.raises(MalformedRequestError, match=f"may not set {key}"):
        validate(request, level="normal", tenant=TENANT, config=config_of())
    known = msgspec.structs.replace(request, params=GenerationParams(extra={"temperature": 1}))
    with pytest.raises(MalformedRequestError, match="as params fields"):
        validate(known, level="normal", tenant=TENANT, config=config_of())


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",
        "file:///etc/shadow",
        "ftp://x/y.png",
        "data:text/html,<b>",
    ],
)
def test_only_https_and_data_image_urls_reach_the_wire(url: str) -> None:
    body = {
        "id": "r",
        "route": "chat",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        ],
    }
    with pytest.raises(msgspec.ValidationError, match=r"image_url\.url"):
        REQUEST_DECODER.decode(json.dumps(body))


def test_a_version_1_tool_turn_is_text_and_needs_no_tools() -> None:
    """Version 1 wrote ``{"role": "tool", "content": ...}`` without an id: a
    TGI-only route took it; it must still."""
    request = REQUEST_DECODER.decode(
        b'{"v":1,"id":"r","route":"chat","messages":[{"role":"user","content":"q"},'
        b'{"role":"tool","content":"42"}]}'
    )
    assert needs(request) == frozenset()


def test_an_assistant_turn_of_tool_calls_keeps_its_empty_content_on_the_wire() -> None:
    raw = b'{"role":"assistant","content":""}'
    request = REQUEST_DECODER.decode(b'{"id":"r","route":"chat","messages":[' + raw + b"]}")
    assert raw in encode(request)
    with pytest.raises(msgspec.ValidationError, match="content"):
        REQUEST_DECODER.decode(b'{"id":"r","route":"chat","messages":[{"role":"user"}]}')


def test_the_completed_event_keeps_log_probabilities_within_its_budget() -> None:
    token = TokenLogprob(
        token="tok",
        logprob=-0.1,
        top_logprobs=tuple(TopLogprob(token=f"alt{i}", logprob=-1.0) for i in range(20)),
    )
    kept: list[TokenLogprob] = []
    size = 0
    for _ in range(8192):
        size = _keep_logprobs(kept, [token], size)
    assert 0 < len(kept) < 8192
    encoded = len(msgspec.json.encode(kept))
    assert encoded <= LOGPROBS_BUDGET * 1.1, encoded


@pytest.fixture
async def hostile_ollama() -> AsyncIterator[str]:
    """An Ollama-shaped server whose answer makes 200 tool calls."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        call = {"function": {"name": "lookup", "arguments": {}}}
        lines = [
            {
                "message": {"role": "assistant", "content": "", "tool_calls": [call] * 200},
                "done": False,
            },
            {"message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop"},
        ]
        body = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
        return web.Response(body=body, content_type="application/x-ndjson")

    app = web.Application()
    app.router.add_post("/api/chat", chat)
    async with serve(app) as origin:
        yield origin


async def test_a_tool_call_past_the_wires_bounds_fails_the_call_not_the_reader(
    isolated_server: EmbeddedServer, hostile_ollama: str
) -> None:
    """Before, the worker wrote a ``completed`` event no reader could decode
    (over 1024 calls, or a name over 256 characters), and the client waited
    for ever; now the call fails as malformed, and the request with it."""
    config = parse_config(
        {
            "nats": {"url": isolated_server.url},
            "backends": {"b": {"adapter": "ollama", "base_url": hostile_ollama, "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"retry_delay": "10ms", "max_retry_delay": "20ms"},
        }
    )
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit("call something", route="chat")
        with pytest.raises(RequestFailedError, match="more than 128 tool calls"):
            await handle.result(timeout=20)


async def test_a_request_nested_too_deeply_is_rejected_and_its_level_keeps_flowing(
    isolated_server: EmbeddedServer,
) -> None:
    """Before, the decoder's RecursionError crashed the level's fetch loop over
    and over: every tenant's requests at that level waited."""
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            for index in range(5):
                request_id = f"deep-{index}"
                await client.js.publish(
                    request_subject("normal", TENANT),
                    raw_request(request_id, nested(5000)),
                    headers={"Nats-Msg-Id": msg_id(TENANT, request_id)},
                )
            normal = await client.submit("after them", route="chat")
            result = await normal.result(timeout=20)
            with pytest.raises(RequestRejectedError, match="nested too deeply"):
                await client.handle("deep-0").result(timeout=20)
    assert result.text


@pytest.mark.parametrize(
    ("body", "secret"),
    [
        (
            b'{"error":{"message":"Incorrect API key provided: sk-proj-****abcd. See docs."}}',
            "abcd",
        ),
        (b'{"error":{"message":"API key not valid: AIzaSyD-abcdef12345"}}', "AIzaSy"),
        (b'{"detail":"Authorization: Bearer hf_abcdefghijk refused"}', "hf_abc"),
    ],
)
def test_a_providers_error_text_loses_anything_key_like(body: bytes, secret: str) -> None:
    """Error text reaches events tenants read and the gateway's answers: not
    even the masked tail of the operator's key goes with it."""
    text = error_detail(body)
    assert secret not in text
    assert "[redacted]" in text


def test_the_worker_names_id_less_tool_calls_and_refuses_what_the_wire_cannot_carry() -> None:
    """The last guard, whatever an adapter hands over: an event every reader
    can decode, and ids unique across a conversation."""
    caller = Caller(
        None,  # type: ignore[arg-type]  # no publish in this check
        "b",
        config_of().backends["b"],
        None,  # type: ignore[arg-type]
    )
    request = InferenceRequest(
        id="req-7", route="chat", messages=[ChatMessage(role="user", content="hi")]
    )
    named = caller._checked_calls(
        request, [ToolCall(name="f"), ToolCall(id="given", name="g")], before=2
    )
    assert [c.id for c in named] == ["call_req-7_2", "given"]
    for bad in (ToolCall(name="f" * 300), ToolCall(id="i" * 300, name="f"), ToolCall(name="")):
        with pytest.raises(RetryableBackendError, match="malformed answer"):
            caller._checked_calls(request, [bad], before=0)
    with pytest.raises(RetryableBackendError, match="more than 128 tool calls"):
        caller._checked_calls(request, [ToolCall(name="f")] * 2, before=127)


async def test_the_router_rejects_a_request_too_big_for_its_own_messages(
    isolated_server: EmbeddedServer,
) -> None:
    """Published around the client, a request within the headroom of the
    broker's limit is rejected, not carried into messages nats-server would
    refuse (closing the services' connection)."""
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            size = client.nc.max_payload - REQUEST_HEADROOM // 2
            data = raw_request("too-big", b'"' + b"x" * size + b'"')
            await client.js.publish(
                request_subject("normal", TENANT),
                data[: client.nc.max_payload - 512],
                headers={"Nats-Msg-Id": msg_id(TENANT, "too-big")},
            )
            with pytest.raises(RequestRejectedError, match="largest message"):
                await client.handle("too-big").result(timeout=20)
            after = await client.submit("still served", route="chat")
            assert (await after.result(timeout=20)).text


def test_an_id_or_name_ending_in_a_newline_is_not_one() -> None:
    """msgspec's patterns search: ``^...$`` let ``abc\\n`` through (``$`` matches
    before a final newline), an id that makes no subject and a tenant or route no
    subject of its own can name. (The patterns stay ECMA-262 ones for ``renqueue schema``.)"""
    for field, value in (("id", "abc"), ("tenant", TENANT), ("route", "chat")):
        body = json.loads(raw_request("r", b"1"))
        REQUEST_DECODER.decode(json.dumps(body).encode())
        body[field] = value + "\n"
        with pytest.raises(msgspec.ValidationError):
            REQUEST_DECODER.decode(json.dumps(body).encode())


async def test_a_request_whose_id_ends_in_a_newline_is_dead_lettered_and_its_level_flows(
    isolated_server: EmbeddedServer,
) -> None:
    async with MockBackend(FAST) as mock:
        config = config_of(mock.url, nats_url=isolated_server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            body = json.loads(raw_request("x", b"1"))
            body["id"] = "nl\n"
            await client.js.publish(
                request_subject("normal", TENANT),
                json.dumps(body).encode(),
                headers={"Nats-Msg-Id": msg_id(TENANT, "nl")},
            )
            normal = await client.submit("after it", route="chat")
            result = await normal.result(timeout=20)
    assert result.text
