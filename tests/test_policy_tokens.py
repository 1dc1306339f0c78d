"""The token estimator (renqueue.policy): no download, rounds up, errs high."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from renqueue.policy import (
    CHARS_PER_TOKEN,
    IMAGE_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_OVERHEAD_TOKENS,
    estimate_input_tokens,
    estimate_prompt_tokens,
    estimate_request_tokens,
    estimate_text_tokens,
)
from renqueue.schema import (
    ChatMessage,
    GenerationParams,
    ImagePart,
    ImageURL,
    InferenceRequest,
    TextPart,
    Tool,
    ToolCall,
)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),  # rounded up
        ("Hello, world!", 4),
        ("def f(x):\n    return x\n", 6),
        ("日本語", 3),  # one per CJK character
        ("naïve", 2),  # 4 ASCII characters (1) + one other (1)
        ("🙂🙂", 2),
    ],
)
def test_text_estimate(text: str, tokens: int) -> None:
    assert estimate_text_tokens(text) == tokens


def test_a_prompt_adds_per_message_and_reply_overheads() -> None:
    messages = [
        ChatMessage(role="system", content="You are terse."),  # 14 chars: 4 tokens
        ChatMessage(role="user", content="12345678"),  # 2 tokens
    ]
    assert MESSAGE_OVERHEAD_TOKENS == 4
    assert REPLY_OVERHEAD_TOKENS == 3
    assert estimate_prompt_tokens(messages) == (4 + 4) + (2 + 4) + 3
    assert estimate_prompt_tokens([]) == 0
    assert estimate_prompt_tokens(iter(messages)) == 17  # any iterable, read once


def test_a_request_reserves_its_prompt_plus_max_tokens() -> None:
    messages = [ChatMessage(role="user", content="12345678")]
    capped = InferenceRequest(
        id="r", route="chat", messages=messages, params=GenerationParams(max_tokens=256)
    )
    uncapped = InferenceRequest(id="r", route="chat", messages=messages)
    assert estimate_request_tokens(capped, default_max_tokens=1024) == 9 + 256
    assert estimate_request_tokens(uncapped, default_max_tokens=1024) == 9 + 1024
    assert estimate_request_tokens(uncapped, default_max_tokens=-5) == 9


@given(st.text(max_size=400), st.text(max_size=400))
def test_text_estimate_rounds_up_and_never_shrinks_as_text_grows(a: str, b: str) -> None:
    tokens = estimate_text_tokens(a)
    assert tokens * CHARS_PER_TOKEN >= len(a)  # at least chars / 4, rounded up
    assert tokens <= len(a)  # at most one per character
    assert estimate_text_tokens(a + b) >= tokens
    assert estimate_text_tokens(a + b) <= tokens + estimate_text_tokens(b)


@given(st.lists(st.text(max_size=100), max_size=8))
def test_prompt_estimate_is_the_sum_of_its_messages(texts: list[str]) -> None:
    messages = [ChatMessage(role="user", content=text) for text in texts]
    expected = sum(MESSAGE_OVERHEAD_TOKENS + estimate_text_tokens(t) for t in texts)
    assert estimate_prompt_tokens(messages) == (expected + REPLY_OVERHEAD_TOKENS if texts else 0)


def test_images_tool_calls_and_tools_count_in_a_prompt() -> None:
    plain = [ChatMessage(role="user", content="abcd")]
    base = estimate_prompt_tokens(plain)
    image = [
        ChatMessage(
            role="user",
            content=[TextPart(text="abcd"), ImagePart(image_url=ImageURL(url="https://x/a.png"))],
        )
    ]
    assert estimate_prompt_tokens(image) == base + IMAGE_TOKENS
    call = ChatMessage(
        role="assistant", content="", tool_calls=(ToolCall(id="c", name="abcd", arguments="{}"),)
    )
    assert estimate_prompt_tokens([*plain, call]) > estimate_prompt_tokens(
        [*plain, ChatMessage(role="assistant", content="")]
    )
    tools = (Tool(name="lookup", description="x" * 400),)
    request = InferenceRequest(
        id="r", route="chat", messages=plain, params=GenerationParams(tools=tools)
    )
    with_tools = estimate_input_tokens(request)
    assert with_tools >= base + 100  # the tools' JSON, 400+ characters
    assert estimate_input_tokens(request) == with_tools  # cached: the same count
