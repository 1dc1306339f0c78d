"""Anthropic's Messages API, ``POST /v1/messages``.

A request is checked as the Messages API checks it (roles that alternate,
tool results against the calls they answer, base64 images, tool schemas; a
refusal is its 400, the message prefixed ``invalid request body:``), and the
answer calls a tool after its text when the request offers tools and forces
one (``tool_choice`` ``any`` or ``tool``) or its last user message says
``call <tool name>`` (never when the choice is none), with the arguments
:data:`~.base.MOCK_TOOL_ARGUMENTS`. Rate-limit headers and 429s are
Anthropic's own (``anthropic-ratelimit-*``), whatever the mock's
``limit_style``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
from msgspec import Meta, Struct

from .base import (
    MOCK_TOOL_ARGUMENTS,
    Call,
    Dialect,
    ErrorKind,
    Frames,
    Reply,
    Target,
    answer_text,
    base64_ok,
    prompt_tokens_of,
    to_json,
    tool_to_call,
)

__all__ = ["AnthropicDialect"]


def _text_chars(content: object) -> int:
    """Characters of text in a message's content: a string, or a list of parts with ``text``."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


class _AnthropicText(Struct, tag_field="type", tag="text"):
    text: str


class _AnthropicBase64(Struct, tag_field="type", tag="base64"):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class _AnthropicURL(Struct, tag_field="type", tag="url"):
    url: str


class _AnthropicImage(Struct, tag_field="type", tag="image"):
    source: _AnthropicBase64 | _AnthropicURL


class _AnthropicToolUse(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class _AnthropicToolResult(Struct, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[_AnthropicText | _AnthropicImage] = ""
    is_error: bool = False


_AnthropicBlock = _AnthropicText | _AnthropicImage | _AnthropicToolUse | _AnthropicToolResult


class _AnthropicMessage(Struct):
    role: Literal["user", "assistant"]
    content: str | list[_AnthropicBlock]


class _AnthropicTool(Struct):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}(?!\n)$")]
    input_schema: dict[str, Any]
    description: str | None = None


class _AnthropicToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _AnthropicBody(Struct):
    model: str
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[_AnthropicMessage], Meta(min_length=1)]
    system: str | list[Any] | None = None
    stream: bool = False
    tools: list[_AnthropicTool] = []
    tool_choice: _AnthropicToolChoice | None = None


_ANTHROPIC_DECODER: Final = msgspec.json.Decoder(_AnthropicBody)


def _anthropic_blocks(message: _AnthropicMessage) -> list[_AnthropicBlock]:
    content = message.content
    return [_AnthropicText(text=content)] if isinstance(content, str) else content


def _anthropic_check(body: _AnthropicBody) -> None:
    """What the Messages API refuses (``msgspec.ValidationError``, its words):
    roles that do not alternate, a ``tool_result`` without its ``tool_use`` in
    the message before, a ``tool_use`` unanswered in the message after, empty
    text, an image that is not base64, a tool schema that is not an object's."""
    previous_uses: set[str] = set()
    for index, message in enumerate(body.messages):
        if index and message.role == body.messages[index - 1].role:
            raise msgspec.ValidationError(
                'messages: roles must alternate between "user" and "assistant", '
                f'but found multiple "{message.role}" roles in a row'
            )
        last = index == len(body.messages) - 1
        if not message.content and not (last and message.role == "assistant"):
            raise msgspec.ValidationError(
                f"messages.{index}: all messages must have non-empty content except for the "
                "optional final assistant message"
            )
        blocks = _anthropic_blocks(message) if message.content else []
        results = {b.tool_use_id for b in blocks if isinstance(b, _AnthropicToolResult)}
        if index and (missing := previous_uses - results):
            raise msgspec.ValidationError(
                f"messages.{index}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(sorted(missing))}. Each `tool_use` block must "
                "have a corresponding `tool_result` block in the next message."
            )
        for number, block in enumerate(blocks):
            where = f"messages.{index}.content.{number}"
            _anthropic_check_block(block, where, previous_uses)
        previous_uses = {b.id for b in blocks if isinstance(b, _AnthropicToolUse)}
    for number, tool in enumerate(body.tools):
        if tool.input_schema.get("type") != "object":
            raise msgspec.ValidationError(
                f"tools.{number}.input_schema.type: Input should be 'object'"
            )
    choice = body.tool_choice
    if (
        choice is not None
        and choice.type == "tool"
        and choice.name not in {tool.name for tool in body.tools}
    ):
        raise msgspec.ValidationError(f"tool_choice.name: tool {choice.name!r} not found")


def _anthropic_check_block(block: _AnthropicBlock, where: str, uses: set[str]) -> None:
    if isinstance(block, _AnthropicToolResult):
        if block.tool_use_id not in uses:
            raise msgspec.ValidationError(
                f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: "
                f"{block.tool_use_id}. Each `tool_result` block must have a corresponding "
                "`tool_use` block in the previous message."
            )
        inner = [] if isinstance(block.content, str) else block.content
        for number, part in enumerate(inner):
            _anthropic_check_block(part, f"{where}.content.{number}", uses)
    elif isinstance(block, _AnthropicText) and not block.text:
        raise msgspec.ValidationError(f"{where}.text: text content blocks must be non-empty")
    elif (
        isinstance(block, _AnthropicImage)
        and isinstance(block.source, _AnthropicBase64)
        and not base64_ok(block.source.data)
    ):
        raise msgspec.ValidationError(f"{where}.image.source.base64: invalid base64 data")


def _anthropic_chars(body: _AnthropicBody) -> int:
    """The characters of text a Messages request holds (tool results' text too)."""
    chars = _text_chars(body.system)
    for message in body.messages:
        for block in _anthropic_blocks(message):
            if isinstance(block, _AnthropicText):
                chars += len(block.text)
            elif isinstance(block, _AnthropicToolResult):
                content = block.content
                chars += (
                    len(content)
                    if isinstance(content, str)
                    else sum(len(p.text) for p in content if isinstance(p, _AnthropicText))
                )
    return chars


def _anthropic_tool(body: _AnthropicBody) -> str | None:
    """The tool the answer calls (:func:`tool_to_call`)."""
    choice = body.tool_choice
    if choice is not None and choice.type == "none":
        return None
    forced = None
    if choice is not None and choice.type in ("any", "tool"):
        forced = choice.name or "required"
    last_user = next((m for m in reversed(body.messages) if m.role == "user"), None)
    text = ""
    if last_user is not None:
        text = " ".join(
            b.text for b in _anthropic_blocks(last_user) if isinstance(b, _AnthropicText)
        )
    return tool_to_call([tool.name for tool in body.tools], forced, text)


class AnthropicDialect(Dialect):
    """``/v1/messages``: ``event:`` lines, ``message_start`` ... ``message_stop``.

    As recorded in anthropic-sdk-python's tests/lib/streaming/fixtures and
    https://docs.anthropic.com/en/api/messages-streaming.
    """

    name = "anthropic"
    limit_style = "anthropic"
    key_header = "x-api-key"
    id_prefix = "msg_mock"
    finish_names: ClassVar[Mapping[str, str]] = {
        "stop": "end_turn",
        "length": "max_tokens",
        "content_filter": "refusal",
        "tool_calls": "tool_use",
    }
    error_names: ClassVar[Mapping[str, str]] = {
        "bad_request": "invalid_request_error",
        "auth": "authentication_error",
        "not_found": "not_found_error",
        "server_error": "api_error",
    }

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _ANTHROPIC_DECODER.decode(raw)
        _anthropic_check(body)
        return Call(
            model=body.model,
            prompt_tokens=prompt_tokens_of(_anthropic_chars(body)),
            stream=body.stream,
            cap=body.max_tokens,
            tool=_anthropic_tool(body),
        )

    def piece(self, text: str, index: int) -> bytes:
        return (
            b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"'
            + text.encode()
            + b'"}}\n\n'
        )

    def frames(self, reply: Reply) -> Frames:
        start = {
            "type": "message_start",
            "message": {
                "id": reply.id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": reply.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 1},
            },
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop(reply), "stop_sequence": None},
            "usage": {"output_tokens": reply.completion_tokens},
        }
        return Frames(
            head=b"event: content_block_delta\ndata: ",
            tail=b"",
            opening=b"event: message_start\ndata: "
            + to_json(start)
            + b"\n\nevent: content_block_start\ndata: "
            b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
            b'\n\nevent: ping\ndata: {"type": "ping"}\n\n',
            closing=b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
            + self._tool_events(reply)
            + b"event: message_delta\ndata: "
            + to_json(delta)
            + b"\n\n",
            done=b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        )

    def _stop(self, reply: Reply) -> str:
        return "tool_use" if reply.tool is not None else self.finish(reply.finish_reason)

    def _tool_use(self, reply: Reply, arguments: Any) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": f"toolu_{reply.id}",
            "name": reply.tool,
            "input": arguments,
        }

    def _tool_events(self, reply: Reply) -> bytes:
        """A ``tool_use`` block after the text (block 1): its input in two JSON pieces."""
        if reply.tool is None:
            return b""
        start = {
            "type": "content_block_start",
            "index": 1,
            "content_block": self._tool_use(reply, {}),
        }
        arguments = to_json(MOCK_TOOL_ARGUMENTS).decode()
        half = len(arguments) // 2
        events = [b"event: content_block_start\ndata: " + to_json(start)]
        for piece in (arguments[:half], arguments[half:]):
            delta = {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": piece},
            }
            events.append(b"event: content_block_delta\ndata: " + to_json(delta))
        events.append(b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}')
        return b"\n\n".join(events) + b"\n\n"

    def answer(self, reply: Reply) -> bytes:
        return to_json(
            {
                "id": reply.id,
                "type": "message",
                "role": "assistant",
                "model": reply.model,
                "content": [
                    {"type": "text", "text": answer_text(reply.completion_tokens)},
                    *([] if reply.tool is None else [self._tool_use(reply, MOCK_TOOL_ARGUMENTS)]),
                ],
                "stop_reason": self._stop(reply),
                "stop_sequence": None,
                "usage": {
                    "input_tokens": reply.prompt_tokens,
                    "output_tokens": reply.completion_tokens,
                },
            }
        )

    def _body(self, type_: str, message: str) -> bytes:
        return to_json({"type": "error", "error": {"type": type_, "message": message}})

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        type_ = self.error_names.get(kind) or (
            "rate_limit_error" if status == 429 else "overloaded_error"
        )
        return self._body(type_, message)

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "500":
            return 500, self._body("api_error", "Internal server error")
        if kind == "503":
            return 503, self._body("overloaded_error", "Overloaded")
        if kind == "context_length":
            limit = window or 200_000
            used = max(prompt_tokens, limit + 1)
            return 400, self._body(
                "invalid_request_error", f"prompt is too long: {used} tokens > {limit} maximum"
            )
        if kind == "content_filter":
            return 400, self._body(
                "invalid_request_error", "Output blocked by content filtering policy"
            )
        return super().fault(kind, window, prompt_tokens)

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        return b"event: error\ndata: " + self._body("overloaded_error", "Overloaded") + b"\n\n"

    def not_found(self, model: str) -> tuple[int, bytes]:
        return 404, self._body("not_found_error", f"model: {model}")
