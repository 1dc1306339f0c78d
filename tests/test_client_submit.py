"""Client.submit takes typed keyword-only options: a wrong one fails at the call."""

from __future__ import annotations

import inspect
import re

import pytest

from renqueue import Client
from renqueue.broker import Connection
from renqueue.errors import MalformedRequestError
from renqueue.schema import (
    ChatMessage,
    GenerationParams,
    ImagePart,
    ImageURL,
    TextPart,
    Tool,
    ToolCall,
)


async def test_a_misspelt_option_is_a_type_error_at_the_call(nc: Connection) -> None:
    client = Client(nc)
    # Raised by the call itself, before there is a coroutine to await: nothing
    # is built or published, and mypy reports the same line.
    with pytest.raises(TypeError, match="max_token"):
        client.submit("hi", route="chat", max_token=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        client.submit("hi", "chat")  # type: ignore[misc]
    with pytest.raises(TypeError, match="route"):
        client.submit("hi")  # type: ignore[call-arg]


def test_submit_and_build_request_take_the_same_options() -> None:
    submit = list(inspect.signature(Client.submit).parameters.values())
    build = list(inspect.signature(Client.build_request).parameters.values())
    # Besides the request's options, submit takes what its publish carries: the trace.
    *submit, trace = submit
    assert trace.name == "traceparent"
    assert submit == build
    options = submit[2:]
    assert options
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in options)


def test_every_option_of_submit_is_documented() -> None:
    doc = inspect.getdoc(Client.submit) or ""
    for name in list(inspect.signature(Client.submit).parameters)[1:]:
        assert f"    {name}: " in doc, name


async def test_params_carry_the_whole_chat_format_and_arguments_replace_theirs(
    nc: Connection,
) -> None:
    client = Client(nc, tenant="acme")
    tool = Tool(name="get_weather", parameters={"type": "object"})
    params = GenerationParams(
        tools=(tool,), tool_choice="required", temperature=0.1, extra={"top_k": 5}
    )
    messages = [
        ChatMessage(
            role="user",
            content=[TextPart(text="see"), ImagePart(image_url=ImageURL(url="https://x/y.png"))],
        ),
        ChatMessage(
            role="assistant", content="", tool_calls=(ToolCall(id="c", name="get_weather"),)
        ),
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    request = client.build_request(messages, route="chat", params=params, temperature=0.7)
    assert request.params == GenerationParams(
        tools=(tool,), tool_choice="required", temperature=0.7, extra={"top_k": 5}
    )
    assert request.messages[1].tool_calls[0].name == "get_weather"
    assert request.messages[2] == ChatMessage(role="tool", tool_call_id="c", content="sunny")
    # The wire's bounds hold for params as for arguments.
    with pytest.raises(MalformedRequestError):
        client.build_request("hi", route="chat", params=GenerationParams(top_logprobs=99))


async def test_a_request_made_without_an_id_gets_32_random_hex_digits(nc: Connection) -> None:
    """docs/wire-format.md: ``Client.submit`` makes an unguessable id, 128
    random bits as 32 lowercase hex digits (the shape a uuid4's ``hex`` had),
    which the wire's id rule takes; each request its own."""
    client = Client(nc, tenant="acme")
    ids = {client.build_request("hi", route="chat").id for _ in range(200)}
    assert len(ids) == 200
    for made in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", made), made
    assert client.build_request("hi", route="chat", request_id="mine").id == "mine"
