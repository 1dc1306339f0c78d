"""Features (issue #11 item 1): a request that needs tools, images, a JSON
schema or logprobs goes only to a backend that has them, falls back only to
one, and is refused at admission when its route has none. Pure rules first,
then end to end on a real nats-server with mock backends."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from test_fallback import FAST, config_for, failing, routed
from test_quota_exhausted import describe, results
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import ConfigError, parse_config
from renqueue.errors import (
    FailureClass,
    RequestRejectedError,
    RetryableBackendError,
    UnsupportedFeatureError,
)
from renqueue.mock import MockBackend
from renqueue.policy import (
    ALL_FEATURES,
    BackendView,
    FailurePolicy,
    FallBack,
    after_failure,
    capable,
    needs,
    validate,
)
from renqueue.schema import (
    SCHEMA_VERSION,
    ChatMessage,
    GenerationParams,
    ImagePart,
    ImageURL,
    InferenceRequest,
    Rejected,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
)

TOOL = Tool(name="get_weather", parameters={"type": "object"})


def request(*messages: ChatMessage, **params: Any) -> InferenceRequest:
    return InferenceRequest(
        id="r",
        tenant=TENANT,
        route="chat",
        messages=list(messages) or [ChatMessage(role="user", content="hi")],
        params=GenerationParams(**params),
    )


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (request(), set()),
        (request(tools=(TOOL,)), {"tools"}),
        (
            request(
                ChatMessage(role="assistant", content="", tool_calls=(ToolCall(id="c", name="f"),)),
                ChatMessage(role="tool", tool_call_id="c", content="12"),
            ),
            {"tools"},
        ),
        (
            request(
                ChatMessage(
                    role="user",
                    content=[
                        TextPart(text="what is this?"),
                        ImagePart(image_url=ImageURL(url="https://x/y.png")),
                    ],
                )
            ),
            {"vision", "image_urls"},
        ),
        (request(ChatMessage(role="user", content=[TextPart(text="only text")])), set()),
        (request(response_format=ResponseFormat(type="text")), set()),
        (request(response_format=ResponseFormat(type="json_object")), {"json"}),
        (request(response_format=ResponseFormat(type="json_schema")), {"json_schema"}),
        (request(logprobs=True), {"logprobs"}),
        (request(logprobs=False, top_logprobs=0), set()),
        (request(top_logprobs=2), {"logprobs"}),
    ],
)
def test_what_a_request_needs(req: InferenceRequest, expected: set[str]) -> None:
    assert needs(req) == expected


def view(name: str, features: frozenset[str] = ALL_FEATURES) -> BackendView:
    return BackendView(name=name, capacity=1, in_flight=0, features=features)


def test_only_backends_with_every_needed_feature_are_capable() -> None:
    views = {
        "text": view("text", frozenset()),
        "tools": view("tools", frozenset({"tools"})),
        "all": view("all"),
    }
    names = ["text", "tools", "all"]
    assert [v.name for v in capable(request(), names, views)] == names
    assert [v.name for v in capable(request(tools=(TOOL,)), names, views)] == ["tools", "all"]
    both = request(tools=(TOOL,), logprobs=True)
    assert [v.name for v in capable(both, names, views)] == ["all"]


def test_a_backend_cannot_declare_what_its_adapter_cannot_send() -> None:
    raw: dict[str, Any] = {
        "backends": {
            "a": {
                "adapter": "anthropic",
                "model": "m",
                "api_key_env": "K",
                "features": ["tools", "json_schema"],
            }
        },
        "routes": {"chat": {"backends": ["a"]}},
    }
    with pytest.raises(ConfigError, match=r"anthropic adapter cannot send json_schema"):
        parse_config(raw)
    raw["backends"]["a"]["features"] = ["tools", "telepathy"]
    with pytest.raises(ConfigError, match=r"features"):
        parse_config(raw)
    raw["backends"]["a"].pop("features")
    config = parse_config(raw)
    assert config.backends["a"].supports == {"tools", "vision", "image_urls"}


def config_of(**backends: dict[str, Any]) -> Any:
    return parse_config(
        {
            "backends": {
                name: {"base_url": "http://127.0.0.1:1", "model": "m", **extra}
                for name, extra in backends.items()
            },
            "routes": {"chat": {"backends": list(backends)}},
        }
    )


def test_admission_refuses_what_no_backend_of_the_route_can_do() -> None:
    config = config_of(text={"features": []}, tools={"features": ["tools"]})
    validate(request(tools=(TOOL,)), level="normal", tenant=TENANT, config=config)
    images = request(
        ChatMessage(role="user", content=[ImagePart(image_url=ImageURL(url="https://x"))]),
        tools=(TOOL,),
    )
    with pytest.raises(UnsupportedFeatureError, match="supports vision") as raised:
        validate(images, level="normal", tenant=TENANT, config=config)
    assert raised.value.code == "unsupported_feature"
    # Each feature somewhere, never together: both are named.
    split = config_of(a={"features": ["tools"]}, b={"features": ["logprobs"]})
    with pytest.raises(UnsupportedFeatureError, match="supports tools, logprobs"):
        validate(request(tools=(TOOL,), logprobs=True), level="normal", tenant=TENANT, config=split)


def test_a_newer_schema_version_is_refused_not_half_read() -> None:
    config = config_of(a={})
    newer = msgspec.structs.replace(request(), v=SCHEMA_VERSION + 1)
    with pytest.raises(Exception, match=f"schema version {SCHEMA_VERSION + 1} is newer"):
        validate(newer, level="normal", tenant=TENANT, config=config)


def test_a_fallback_goes_only_to_a_backend_with_the_features() -> None:
    config = config_of(
        first={"features": ["tools"]}, text={"features": []}, other={"features": ["tools"]}
    )
    error = RetryableBackendError("down", backend="first", failure=FailureClass.OVERLOADED)
    facts = config.route_facts(request(tools=(TOOL,)), "first", probe=False, now=0.0)
    assert facts is not None
    decision = after_failure(
        error, failed_runs=0, policy=FailurePolicy(), random=lambda: 0.5, route=facts
    )
    assert isinstance(decision, FallBack), decision
    only_text = config_of(first={"features": ["tools"]}, text={"features": []})
    facts = only_text.route_facts(request(tools=(TOOL,)), "first", probe=False, now=0.0)
    assert facts is not None
    decision = after_failure(
        error, failed_runs=0, policy=FailurePolicy(), random=lambda: 0.5, route=facts
    )
    assert not isinstance(decision, FallBack), decision


async def test_requests_route_by_what_they_need_end_to_end(isolated_server: EmbeddedServer) -> None:
    """A text-only free model takes plain requests; one with tools goes past
    it to the paid model with tools; when that one fails, the fallback skips
    the text-only model for the other with tools; images are refused."""
    async with (
        MockBackend(FAST) as text,
        MockBackend(failing("503")) as broken,
        MockBackend(FAST) as tools,
    ):
        config = config_for(
            isolated_server.url,
            {"text": text, "broken": broken, "tools": tools},
            backends={
                "text": {"features": []},
                "broken": {"features": ["tools"]},
                "tools": {"features": ["tools"], "cost_input_per_mtok": 1.0},
            },
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            plain = await client.submit("hi", route="chat")
            tooled = await client.submit_request(
                msgspec.structs.replace(request(tools=(TOOL,)), id="with-tools")
            )
            image = await client.submit_request(
                msgspec.structs.replace(
                    request(
                        ChatMessage(
                            role="user", content=[ImagePart(image_url=ImageURL(url="https://x"))]
                        )
                    ),
                    id="with-image",
                )
            )
            await results(log, [plain, tooled], within=20)
            with pytest.raises(RequestRejectedError, match="supports vision"):
                await image.result(timeout=20)
            plain_events = await log.history(TENANT, plain.id)
            tool_events = await log.history(TENANT, tooled.id)
            image_events = await log.history(TENANT, image.id)
    assert routed(plain_events) == ["text"], describe(plain_events)
    assert "text" not in routed(tool_events), describe(tool_events)
    assert routed(tool_events)[-1] == "tools", describe(tool_events)
    [rejected] = [e for e in image_events if isinstance(e, Rejected)]
    assert rejected.error_type == "unsupported_feature"
    assert "vision" in rejected.reason
