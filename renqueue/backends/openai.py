"""The adapter for the OpenAI chat-completions wire format.

One format covers most of what Ren-Queue routes to: vLLM, Ollama (``/v1``),
llama.cpp, LM Studio, TGI's Messages API, Groq, OpenRouter, Together,
Cerebras, the Hugging Face router (``https://router.huggingface.co/v1``) and
OpenAI itself all answer ``POST {base_url}/chat/completions``. So this one
adapter, given a :class:`~renqueue.config.BackendConfig`, is most backends.

The format's own parts are here: the body (the request's messages in
OpenAI's shape: content parts, ``name``, an assistant's ``tool_calls`` as
``{"id", "type": "function", "function": {"name", "arguments"}}``, a tool
message's ``tool_call_id``; every parameter it has a field for; ``tools``
and ``tool_choice`` in their ``function`` wrapping; the request's ``extra``
parameters as they are, never over a field set here;
``stream_options.include_usage`` for usage in a stream, vLLM's ``priority``
on request), the SSE chunks (``choices[].delta.content``, tool calls in
pieces in ``delta.tool_calls``, ``logprobs.content``, ``finish_reason``, a
usage-only chunk, ``data: [DONE]``, in-band ``{"error": ...}``), the key as
``Authorization: Bearer`` and the rate-limit dialect ``config.limit_style``
names. The pools, the clock, the error mapping and the secret-keeping are
:mod:`._http`'s.

A stream is an answer only if a chunk carried a ``finish_reason``: a
``data: [DONE]`` without one (llama-cpp-python's server ends a running stream
so when a second call takes its one slot) is a stream cut short, a broken
stream (:meth:`~._http.StreamParser.unfinished`), never a short answer.

What a backend sends is bounded where it is read: tool calls and their
arguments (:class:`~._http.ToolCallPieces`), a log probability's token,
bytes and alternatives (past the wire's bounds: a malformed answer), and
the log probabilities kept of an answer (:data:`~._http.MAX_LOGPROBS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Meta, Struct

from ..config import BackendConfig, LimitStyle
from ..schema import (
    RESERVED_EXTRA,
    ChatMessage,
    GenerationParams,
    InferenceRequest,
    NamedTool,
    TokenLogprob,
    TopLogprob,
)
from ._http import HTTPBackend, InBandError, SSEParser, ToolCallPieces, error_detail, given_params
from ._sse import ServerSentEvent
from .base import Generation

__all__ = ["OpenAIBackend"]


# ----------------------------------------------------------------- wire types
# Only the fields we read; msgspec skips the rest. Loose types (``| None``)
# because "OpenAI-compatible" servers differ in what they leave out or null;
# bounds (``Meta``) where what is read is kept: past them, an answer is malformed.

_Short = Annotated[str, Meta(max_length=1024)]
_Bytes = Annotated[list[Annotated[int, Meta(ge=0, le=255)]], Meta(max_length=1024)]


class _WireUsage(Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _WireError(Struct):
    message: str = ""


class _WireFunction(Struct):
    name: str | None = None
    arguments: str | None = None


class _WireToolCall(Struct):
    index: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None
    id: str | None = None
    function: _WireFunction | None = None


class _WireTop(Struct):
    token: _Short = ""
    logprob: float = 0.0
    bytes: _Bytes | None = None


class _WireLogprob(Struct):
    token: _Short = ""
    logprob: float = 0.0
    bytes: _Bytes | None = None
    top_logprobs: Annotated[list[_WireTop], Meta(max_length=20)] | None = None


class _WireLogprobs(Struct):
    content: list[_WireLogprob] | None = None


_ToolCalls = Annotated[list[_WireToolCall], Meta(max_length=128)]


class _WireDelta(Struct):
    content: str | None = None
    tool_calls: _ToolCalls | None = None


class _WireChunkChoice(Struct):
    delta: _WireDelta | None = None
    finish_reason: str | None = None
    logprobs: _WireLogprobs | None = None


class _WireChunk(Struct):
    choices: list[_WireChunkChoice] | None = None
    usage: _WireUsage | None = None
    error: _WireError | str | None = None


class _WireMessage(Struct):
    content: str | None = None
    tool_calls: _ToolCalls | None = None


class _WireChoice(Struct):
    message: _WireMessage | None = None
    finish_reason: str | None = None
    logprobs: _WireLogprobs | None = None


class _WireCompletion(Struct):
    choices: list[_WireChoice] | None = None
    usage: _WireUsage | None = None


_CHUNK_DECODER: Final = msgspec.json.Decoder(_WireChunk)
_COMPLETION_DECODER: Final = msgspec.json.Decoder(_WireCompletion)
#: The request's parameters this format has a field for, as they are.
_PARAMS: Final = {
    name: name
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
        "parallel_tool_calls",
        "user",
    )
}
#: Body fields an ``extra`` parameter never replaces: the ones set here and
#: every parameter Ren-Queue knows (set or not: an unset one stays unset).
_RESERVED: Final = frozenset(
    {"model", "messages", "stream", "stream_options", "priority", "tools", "tool_choice"}
    | (set(GenerationParams.__struct_fields__) - {"extra"})
    | RESERVED_EXTRA  # refused at admission; never sent, whoever built the request
)


def _logprobs(wire: _WireLogprobs | None) -> list[TokenLogprob]:
    if wire is None or not wire.content:
        return []
    return [
        TokenLogprob(
            token=item.token,
            logprob=item.logprob,
            bytes=item.bytes,
            top_logprobs=tuple(
                TopLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes)
                for top in item.top_logprobs or ()
            ),
        )
        for item in wire.content
    ]


def _add_calls(pieces: ToolCallPieces, calls: Sequence[_WireToolCall]) -> None:
    for call in calls:
        function = call.function or _WireFunction()
        pieces.add(call.index, call.id or "", function.name or "", function.arguments or "")


class _ChunkParser(SSEParser):
    """Folds chat-completion chunks into text, finish reason, usage, tool
    calls (assembled from their pieces, whole when the stream ends) and log
    probabilities."""

    incomplete: ClassVar[str] = "stream ended before [DONE]"
    unreasoned: ClassVar[str | None] = "stream ended with [DONE] but no finish_reason"

    def event(self, event: ServerSentEvent) -> str:
        data = event.data
        if event.event == "error":
            raise InBandError(error_detail((data or "error event in stream").encode()))
        if data == "[DONE]":
            self.complete = True
            return ""
        chunk = _CHUNK_DECODER.decode(data)
        if chunk.error is not None:
            message = chunk.error if isinstance(chunk.error, str) else chunk.error.message
            # OpenAI, OpenRouter: ``data: {"error": ...}``, the server failed while answering.
            raise InBandError(error_detail((message or "error event in stream").encode()))
        if chunk.usage is not None:
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens
        text = ""
        for choice in chunk.choices or ():
            if choice.finish_reason:  # some servers send "" on every chunk: not a finish
                self.finish_reason = choice.finish_reason
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    text += delta.content
                if delta.tool_calls:
                    _add_calls(self.tool_pieces, delta.tool_calls)
            if choice.logprobs is not None:
                self.add_logprobs(_logprobs(choice.logprobs))
        if text:  # (self.counted, inlined: once per token on the hottest path)
            self.deltas += 1
        return text

    def unterminated(self, event: ServerSentEvent) -> None:
        # Servers that close right after a bare [DONE], without its blank line.
        if event.data == "[DONE]":
            self.complete = True


# -------------------------------------------------------------------- body


def _message(message: ChatMessage) -> dict[str, Any]:
    """One message in OpenAI's shape."""
    out: dict[str, Any] = {"role": message.role}
    content = message.content
    if isinstance(content, str):
        # An assistant turn that only calls tools has no content: null, as OpenAI writes it.
        out["content"] = None if not content and message.tool_calls else content
    else:
        out["content"] = msgspec.to_builtins(content)
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _tools_and_format(params: GenerationParams) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``response_format``, as OpenAI wraps them."""
    out: dict[str, Any] = {}
    if params.tools:
        out["tools"] = [
            {"type": "function", "function": msgspec.to_builtins(tool)} for tool in params.tools
        ]
    choice = params.tool_choice
    if isinstance(choice, NamedTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        out["tool_choice"] = choice
    if params.response_format is not None:
        out["response_format"] = msgspec.to_builtins(params.response_format)
    return out


class OpenAIBackend(HTTPBackend):
    """A backend that speaks the OpenAI chat-completions API.

    ``send_priority`` (default: the config's) adds the request's priority
    rank as the body's ``priority`` field, which vLLM's priority scheduler
    reads (lower = sooner) and most other servers reject or ignore, hence
    off by default. Usage a server does not report is estimated
    (:class:`~._http.HTTPBackend`).
    """

    parser = _ChunkParser
    paths = ("/chat/completions", "/chat/completions")

    def __init__(
        self,
        name: str,
        config: BackendConfig,
        *,
        client: httpx.AsyncClient | None = None,
        send_priority: bool | None = None,
    ) -> None:
        self._send_priority = config.send_priority if send_priority is None else send_priority
        self.limit_style: LimitStyle = config.limit_style
        self._extra_params = None if config.extra_params is None else frozenset(config.extra_params)
        super().__init__(name, config, client=client)

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        params = request.params
        allowed = self._extra_params
        body: dict[str, Any] = {
            name: value
            for name, value in params.extra.items()
            if name not in _RESERVED and (allowed is None or name in allowed)
        }
        body["model"] = self._config.model
        body["messages"] = [_message(message) for message in request.messages]
        body.update(given_params(request, _PARAMS))
        if params.top_logprobs and not params.logprobs:
            body["logprobs"] = True  # OpenAI and vLLM refuse top_logprobs without it
        body.update(_tools_and_format(params))
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self._send_priority and priority is not None:
            body["priority"] = priority
        return body

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        completion = _COMPLETION_DECODER.decode(body)
        if not completion.choices:
            raise msgspec.ValidationError("response has no choices")
        choice = completion.choices[0]
        parser = _ChunkParser()
        parser.finish_reason = choice.finish_reason
        if completion.usage is not None:
            parser.prompt_tokens = completion.usage.prompt_tokens
            parser.completion_tokens = completion.usage.completion_tokens
        message = choice.message or _WireMessage()
        if message.tool_calls:
            for position, call in enumerate(message.tool_calls):
                function = call.function or _WireFunction()
                parser.tool_pieces.add(
                    position, call.id or "", function.name or "", function.arguments or ""
                )
        parser.add_logprobs(_logprobs(choice.logprobs))
        return parser.whole(message.content or "", request)
