"""The adapter for the OpenAI chat-completions wire format.

One format covers most of what Ren-Queue routes to: vLLM, Ollama (``/v1``),
llama.cpp, LM Studio, TGI's Messages API, Groq, OpenRouter, Together,
Cerebras, the Hugging Face router (``https://router.huggingface.co/v1``) and
OpenAI itself all answer ``POST {base_url}/chat/completions``. So this one
adapter, given a :class:`~renqueue.config.BackendConfig`, is most backends.

The format's own parts are here: the body (``stream_options.include_usage``
for usage in a stream, vLLM's ``priority`` on request), the SSE chunks
(``choices[].delta.content``, ``finish_reason``, a usage-only chunk, ``data:
[DONE]``, in-band ``{"error": ...}``), the key as ``Authorization: Bearer``
and the rate-limit dialect ``config.limit_style`` names. The pools, the
clock, the error mapping and the secret-keeping are :mod:`._http`'s.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Struct

from ..config import BackendConfig, LimitStyle
from ..wire._messages import InferenceRequest
from ._http import (
    HTTPBackend,
    InBandError,
    SSEParser,
    error_detail,
    given_params,
)
from ._sse import ServerSentEvent
from .base import Generation

__all__ = ["OpenAIBackend"]


# ----------------------------------------------------------------- wire types
# Only the fields we read; msgspec skips the rest. Loose types (``| None``)
# because "OpenAI-compatible" servers differ in what they leave out or null.


class _WireUsage(Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _WireError(Struct):
    message: str = ""


class _WireDelta(Struct):
    content: str | None = None


class _WireChunkChoice(Struct):
    delta: _WireDelta | None = None
    finish_reason: str | None = None


class _WireChunk(Struct):
    choices: list[_WireChunkChoice] | None = None
    usage: _WireUsage | None = None
    error: _WireError | str | None = None


class _WireMessage(Struct):
    content: str | None = None


class _WireChoice(Struct):
    message: _WireMessage | None = None
    finish_reason: str | None = None


class _WireCompletion(Struct):
    choices: list[_WireChoice] | None = None
    usage: _WireUsage | None = None


_CHUNK_DECODER: Final = msgspec.json.Decoder(_WireChunk)
_COMPLETION_DECODER: Final = msgspec.json.Decoder(_WireCompletion)
#: The request's parameters, as this format names them: as they are.
_PARAMS: Final = {name: name for name in ("max_tokens", "temperature", "top_p", "stop", "seed")}


class _ChunkParser(SSEParser):
    """Folds chat-completion chunks into text, finish reason and usage."""

    incomplete: ClassVar[str] = "stream ended before [DONE]"

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
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            if choice.delta is not None and choice.delta.content:
                text += choice.delta.content
        if text:  # (self.counted, inlined: once per token on the hottest path)
            self.deltas += 1
        return text

    def unterminated(self, event: ServerSentEvent) -> None:
        # Servers that close right after a bare [DONE], without its blank line.
        if event.data == "[DONE]":
            self.complete = True


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
        super().__init__(name, config, client=client)

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._config.model,
            "messages": request.messages,
            **given_params(request, _PARAMS),
        }
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
        return parser.whole((choice.message.content if choice.message else None) or "", request)
