"""The adapter for Anthropic's Messages API (``adapter = "anthropic"``).

``POST {base_url}/messages`` with the key in ``x-api-key`` and the
``anthropic-version`` header. The chat maps onto the Messages body: system
messages become the top-level ``system`` text (joined by blank lines), the
rest user and assistant turns, alternating as Anthropic requires (messages of
one role in a row become one turn). Content parts become content blocks:
text, and images as ``base64`` sources (``data:`` URLs of JPEG, PNG, GIF or
WebP) or ``url`` sources (``https://``). An assistant's tool calls become
``tool_use`` blocks (``input``: the arguments, which must be a JSON object);
a ``tool`` message a ``tool_result`` block in a user turn, before any text
there. A message's ``name`` has no counterpart and is dropped.

Parameters: ``max_tokens`` is required there, so a request without one asks
for the config's ``max_tokens``; ``temperature`` is capped at 1 (Anthropic's
range is 0-1); ``stop`` is ``stop_sequences``; ``tools`` are ``{name,
description, input_schema}`` (an empty object schema for a tool without
parameters); ``tool_choice`` ``auto``, ``required``, a named tool and
``none`` are ``{"type": "auto"}``, ``{"type": "any"}``, ``{"type": "tool",
"name"}`` and ``{"type": "none"}``, with ``disable_parallel_tool_use`` when
``parallel_tool_calls`` is false; ``user`` is ``metadata.user_id``; of
``extra`` only ``top_k`` is sent. ``seed`` and the penalties have no
counterpart and are not sent. A JSON response format and log probabilities
Anthropic cannot give: asked for (the router sends no such request here),
they are a bad request, as are unparseable tool-call arguments, a malformed
image URL or a tool message without its ``tool_call_id``; none of these is
sent.

The stream is server-sent events with ``event:`` lines
(https://docs.anthropic.com/en/api/messages-streaming): ``message_start``
(input tokens, cache reads and writes included), ``content_block_start`` /
``content_block_delta`` / ``content_block_stop`` (``text_delta`` is answer
text; ``input_json_delta`` pieces assemble a ``tool_use`` block's input;
thinking is not answer text), ``message_delta`` (``stop_reason``, cumulative
output tokens), ``message_stop`` (the end), ``ping`` and ``error``.

Errors carry a ``type`` that says more than the status: ``overloaded_error``
(529) is overloaded, ``rate_limit_error`` (429, with
``anthropic-ratelimit-*`` headers and ``retry-after``) rate-limited,
``api_error`` a server error, ``invalid_request_error`` a bad request (a
context-length one when it says "prompt is too long", a filtered one when
"content filtering policy"), ``authentication_error``, ``permission_error``,
``not_found_error`` and ``billing_error`` this backend's configuration. An
``error`` event mid-stream is classified the same way.

Stop reasons: ``end_turn`` and ``stop_sequence`` are ``stop``,
``max_tokens`` and ``model_context_window_exceeded`` ``length``,
``tool_use`` ``tool_calls``, ``refusal`` ``content_filter`` (an answer, as
Azure's output filter is); others pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Struct

from ..config import AnthropicConfig, LimitStyle
from ..errors import BadRequestError, FailureClass
from ..schema import ChatMessage, GenerationParams, InferenceRequest, NamedTool, TextPart, Tool
from ._http import (
    HTTPBackend,
    InBandError,
    SSEParser,
    arguments_object,
    common_finish,
    decoded,
    error_detail,
    given_params,
    image_source,
    named_class,
    system_and_turns,
    tool_arguments,
)
from ._sse import ServerSentEvent
from .base import Generation

__all__ = ["AnthropicBackend"]


# ----------------------------------------------------------------- wire types


class _Usage(Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None

    def prompt(self) -> int | None:
        """Every prompt token: read from the cache, written to it, or neither."""
        if self.input_tokens is None:
            return None
        return (
            self.input_tokens
            + (self.cache_creation_input_tokens or 0)
            + (self.cache_read_input_tokens or 0)
        )


class _Error(Struct):
    type: str = ""
    message: str = ""


class _Block(Struct):
    type: str = ""
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None


class _Message(Struct):
    type: str = ""
    content: list[_Block] | None = None
    stop_reason: str | None = None
    usage: _Usage | None = None
    error: _Error | None = None


class _Delta(Struct):
    """A ``content_block_delta``'s delta or a ``message_delta``'s: only what we read."""

    type: str | None = None
    text: str | None = None
    partial_json: str | None = None
    stop_reason: str | None = None


class _Event(Struct):
    type: str = ""
    message: _Message | None = None
    index: int | None = None
    content_block: _Block | None = None
    delta: _Delta | None = None
    usage: _Usage | None = None
    error: _Error | None = None


class _ErrorBody(Struct):
    error: _Error | None = None


_EVENT_DECODER: Final = msgspec.json.Decoder(_Event)
_MESSAGE_DECODER: Final = msgspec.json.Decoder(_Message)
_ERROR_DECODER: Final = msgspec.json.Decoder(_ErrorBody)

#: The request's parameters Anthropic takes as they are, as it names them.
_PARAM_NAMES: Final = {"top_p": "top_p", "stop": "stop_sequences"}
#: The image types the Messages API takes inline.
_IMAGE_TYPES: Final = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
_STOP_REASONS: Final = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
#: The class of each error type (``invalid_request_error``: by its message).
_ERROR_CLASSES: Final[dict[str, FailureClass | None]] = {
    "invalid_request_error": None,
    "overloaded_error": FailureClass.OVERLOADED,
    "rate_limit_error": FailureClass.RATE_LIMITED,
    "api_error": FailureClass.SERVER_ERROR,
    "timeout_error": FailureClass.SERVER_ERROR,
    "request_too_large": FailureClass.BAD_REQUEST,
    "authentication_error": FailureClass.UNAVAILABLE,
    "permission_error": FailureClass.UNAVAILABLE,
    "not_found_error": FailureClass.UNAVAILABLE,
    "billing_error": FailureClass.UNAVAILABLE,
}


# --------------------------------------------------------- request translation


def _refuse_unsupported(params: GenerationParams) -> None:
    """Features the Messages API lacks (the router sends none here: a request
    asking for one is refused, not half done)."""
    fmt = params.response_format
    if fmt is not None and fmt.type != "text":
        raise ValueError(f"Anthropic has no response_format {fmt.type}")
    if params.logprobs or params.top_logprobs:
        raise ValueError("Anthropic returns no log probabilities")


def _turns(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The chat as Messages turns: user and assistant alternating (a ``tool``
    message is a ``tool_result`` in a user turn; turns of one role in a row
    become one), each turn's content a string when it is one text block."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        role = "assistant" if message.role == "assistant" else "user"
        blocks = _blocks(message)
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:
        blocks = [b for b in turn["content"] if b["type"] != "text" or b["text"]]
        # Anthropic wants a user turn's tool results before anything else in it.
        blocks.sort(key=lambda block: block["type"] != "tool_result")
        if not blocks or (len(blocks) == 1 and blocks[0]["type"] == "text"):
            turn["content"] = blocks[0]["text"] if blocks else ""
        else:
            turn["content"] = blocks
    return turns


def _blocks(message: ChatMessage) -> list[dict[str, Any]]:
    """One message's content blocks (its ``name`` has no counterpart: dropped)."""
    if message.role == "tool" and message.tool_call_id is None:
        return _content(message)  # version 1's tool turn: text in a user turn, as it was
    if message.role == "tool":
        if not message.tool_call_id:
            raise ValueError("a tool message must name the tool call it answers (tool_call_id)")
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id}
        content = _content(message)
        if content:
            result["content"] = (
                content[0]["text"]
                if len(content) == 1 and content[0]["type"] == "text"
                else content
            )
        return [result]
    if message.role == "assistant" and message.images:
        raise ValueError("an assistant message cannot hold images")
    blocks = _content(message)
    for call in message.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call)}
        )
    return blocks


def _content(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's text and images as content blocks, in their order."""
    content = message.content
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, TextPart):
            blocks.append({"type": "text", "text": part.text})
            continue
        source = image_source(part.image_url.url)
        if source.url is not None:
            blocks.append({"type": "image", "source": {"type": "url", "url": source.url}})
        else:
            if source.media_type not in _IMAGE_TYPES:
                raise ValueError(
                    f"Anthropic takes images as {', '.join(sorted(_IMAGE_TYPES))}, "
                    f"not {source.media_type}"
                )
            blocks.append(
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": source.media_type,
                        "data": source.data,
                    },
                }
            )
    return blocks


def _tool(tool: Tool) -> dict[str, Any]:
    """A tool as Anthropic declares one (its arguments' schema an object's, as required)."""
    declared: dict[str, Any] = {
        "name": tool.name,
        "input_schema": tool.parameters or {"type": "object", "properties": {}},
    }
    if tool.description:
        declared["description"] = tool.description
    return declared


def _tool_choice(params: GenerationParams) -> dict[str, Any] | None:
    """``tool_choice`` (with ``disable_parallel_tool_use``) in Anthropic's shape."""
    choice = params.tool_choice
    if not params.tools:
        if choice in ("required",) or isinstance(choice, NamedTool):
            raise ValueError("tool_choice asks for a tool call, but the request offers no tools")
        return None
    if isinstance(choice, NamedTool):
        if all(tool.name != choice.name for tool in params.tools):
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        shape: dict[str, Any] = {"type": "tool", "name": choice.name}
    elif choice == "none":
        return {"type": "none"}  # no calls: nothing to say about parallel ones
    elif choice == "required":
        shape = {"type": "any"}
    elif choice == "auto" or params.parallel_tool_calls is False:
        shape = {"type": "auto"}
    else:
        return None
    if params.parallel_tool_calls is False:
        shape["disable_parallel_tool_use"] = True
    return shape


class _EventParser(SSEParser):
    """Folds Messages stream events into text, stop reason, usage and tool calls."""

    incomplete: ClassVar[str] = "stream ended before message_stop"
    unreasoned: ClassVar[str | None] = "stream ended with message_stop but no stop_reason"

    def event(self, event: ServerSentEvent) -> str:
        data = _EVENT_DECODER.decode(event.data)
        kind = data.type or event.event
        if kind == "content_block_delta":  # the most frequent by far
            return self._block_delta(data)
        handler = self._handlers.get(kind)
        if handler is None:
            return ""  # ping, and event types added after this was written
        return handler(self, data, event.data)

    def _block_delta(self, data: _Event) -> str:
        delta = data.delta
        if delta is None:
            return ""
        if delta.type == "text_delta" and delta.text:
            return self.counted(delta.text)
        if (
            delta.type == "input_json_delta"
            and delta.partial_json
            and data.index is not None
            and data.index in self.tool_pieces
        ):
            self.tool_pieces.add(data.index, "", "", delta.partial_json)  # bounded as it streams
        return ""  # thinking, signatures, citations: not answer text

    def _message_start(self, data: _Event, raw: str) -> str:
        if data.message is not None and data.message.usage is not None:
            self.count_usage(data.message.usage)
        return ""

    def _block_start(self, data: _Event, raw: str) -> str:
        block = data.content_block
        if block is None:
            return ""
        if block.type == "tool_use" and data.index is not None:
            self.tool_pieces.add(data.index, block.id or "", block.name or "", "")
            return ""
        return self.counted(block.text or "") if block.type == "text" else ""

    def _message_delta(self, data: _Event, raw: str) -> str:
        if data.delta is not None and data.delta.stop_reason is not None:
            self.finish_reason = common_finish(data.delta.stop_reason, _STOP_REASONS)
        if data.usage is not None:
            self.count_usage(data.usage)
        return ""

    def _message_stop(self, data: _Event, raw: str) -> str:
        self.complete = True
        return ""

    def _error(self, data: _Event, raw: str) -> str:
        body = raw.encode()
        raise InBandError(error_detail(body), body=body)

    _handlers: ClassVar[dict[str, Callable[[_EventParser, _Event, str], str]]] = {
        "message_start": _message_start,
        "content_block_start": _block_start,
        "message_delta": _message_delta,
        "message_stop": _message_stop,
        "error": _error,
    }

    def count_usage(self, usage: _Usage) -> None:
        """Take the counts ``usage`` reports (output tokens are cumulative)."""
        prompt = usage.prompt()
        if prompt is not None:
            self.prompt_tokens = prompt
        if usage.output_tokens is not None:
            self.completion_tokens = usage.output_tokens


class AnthropicBackend(HTTPBackend):
    """A backend that speaks Anthropic's Messages API (module docstring)."""

    parser = _EventParser
    paths = ("/messages", "/messages")
    limit_style: LimitStyle = "anthropic"

    def __init__(
        self, name: str, config: AnthropicConfig, *, client: httpx.AsyncClient | None = None
    ) -> None:
        self._anthropic = config
        super().__init__(name, config, client=client)

    def _auth_headers(self, key: str) -> dict[str, str]:
        headers = {"anthropic-version": self._anthropic.anthropic_version}
        if key:
            headers["x-api-key"] = key
        if self._anthropic.beta:
            headers["anthropic-beta"] = ",".join(self._anthropic.beta)
        return headers

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        try:
            return self._body_of(request, stream=stream)
        except ValueError as exc:
            raise BadRequestError(
                f"cannot send this request to Anthropic: {exc}",
                backend=self.name,
                request_id=request.id,
            ) from None  # ours, and its cause may quote the request

    def _body_of(self, request: InferenceRequest, *, stream: bool) -> dict[str, Any]:
        """The Messages body; ``ValueError`` for what Anthropic cannot be asked."""
        params = request.params
        _refuse_unsupported(params)
        system, turns = system_and_turns(request.messages)
        if any(m.images for m in request.messages if m.role == "system"):
            raise ValueError("a system message cannot hold images")
        body: dict[str, Any] = {
            "model": self._anthropic.model,
            "max_tokens": params.max_tokens or self._anthropic.max_tokens,
            "messages": _turns(turns),
            **given_params(request, _PARAM_NAMES),
        }
        if system is not None:
            body["system"] = system
        if params.temperature is not None:
            body["temperature"] = min(params.temperature, 1.0)
        top_k = params.extra.get("top_k")
        if top_k is not None:
            if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
                raise ValueError("top_k must be a whole number of at least 0")
            body["top_k"] = top_k
        if params.tools:
            body["tools"] = [_tool(tool) for tool in params.tools]
        choice = _tool_choice(params)
        if choice is not None:
            body["tool_choice"] = choice
        if params.user is not None:
            body["metadata"] = {"user_id": params.user}
        if stream:
            body["stream"] = True
        return body

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        message = _MESSAGE_DECODER.decode(body)
        if message.type == "error":
            raise InBandError(error_detail(body), body=body)
        parser = _EventParser()
        text = ""
        for block in message.content or ():
            if block.type == "text" and block.text:
                text += block.text
            elif block.type == "tool_use":
                parser.add_tool_call(block.id or "", block.name or "", tool_arguments(block.input))
        if message.stop_reason is not None:
            parser.finish_reason = common_finish(message.stop_reason, _STOP_REASONS)
        if message.usage is not None:
            parser.count_usage(message.usage)
        return parser.whole(text, request)

    def _error_class(self, body: bytes) -> FailureClass | None:
        error = decoded(_ERROR_DECODER, body)
        kind = error.error.type if error is not None and error.error is not None else None
        return named_class(kind, _ERROR_CLASSES, body)
