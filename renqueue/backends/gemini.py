"""The adapter for the Gemini API (``adapter = "gemini"``).

``POST {base_url}/models/{model}:streamGenerateContent?alt=sse`` (streaming)
and ``:generateContent`` (not), with the key in ``x-goog-api-key`` (never in
the URL's ``?key=``, where it would reach logs), as
https://ai.google.dev/api/generate-content documents them.

The chat maps onto ``contents``: user (and ``tool``, which carries no
function name in the wire format yet) turns as ``user``, assistant turns as
``model``, system messages as ``systemInstruction`` (joined by blank
lines); the parameters onto ``generationConfig`` (``maxOutputTokens``,
``temperature``, ``topP``, ``stopSequences``, ``seed``, and the config's
``topK``), with the config's ``safetySettings``.

The stream is server-sent events, each a whole ``GenerateContentResponse``
(no end marker): ``candidates[0].content.parts[].text`` is answer text
(parts marked ``thought`` are not), ``functionCall`` parts are tool calls
(whole, ``args`` an object), ``finishReason`` ends it, ``usageMetadata``
(``promptTokenCount``, ``candidatesTokenCount`` plus ``thoughtsTokenCount``
as output) counts. A prompt the safety filters block comes back as a 200
with ``promptFeedback.blockReason`` and no candidates: a content-filter
failure. An in-band ``{"error": {...}}`` is classified by its ``status``.

Errors (``{"error": {"code", "message", "status", "details"}}``) are
classified by ``status``: ``RESOURCE_EXHAUSTED`` (429; ``RetryInfo`` and
``QuotaFailure`` in ``details`` say when to retry and whether a daily quota
is spent, read by :mod:`._limits`) is rate-limited, ``UNAVAILABLE`` (503,
"The model is overloaded") overloaded, ``INTERNAL`` and
``DEADLINE_EXCEEDED`` server errors, ``UNAUTHENTICATED``,
``PERMISSION_DENIED``, ``NOT_FOUND`` and ``FAILED_PRECONDITION`` (the free
tier unavailable in the caller's region) this backend's configuration, and
``INVALID_ARGUMENT`` a bad request (a context-length one when the input
"exceeds the maximum number of tokens"), except a bad key (``ErrorInfo``
reason ``API_KEY_INVALID``), which is configuration.

Finish reasons: ``STOP`` is ``stop`` (``tool_calls`` when the model called
functions), ``MAX_TOKENS`` ``length``; ``SAFETY``, ``RECITATION``,
``BLOCKLIST``, ``PROHIBITED_CONTENT``, ``SPII`` and ``IMAGE_SAFETY``
``content_filter``; others pass through in lower case.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import httpx
import msgspec
from msgspec import Struct, field

from ..config import GeminiConfig, LimitStyle
from ..errors import FailureClass
from ..wire._messages import InferenceRequest
from ._http import (
    HTTPBackend,
    InBandError,
    SSEParser,
    decoded,
    error_detail,
    given_params,
    named_class,
    system_and_turns,
    tool_arguments,
)
from ._sse import ServerSentEvent
from .base import Generation, ToolCall

__all__ = ["GeminiBackend"]


class _FunctionCall(Struct):
    name: str = ""
    args: Any = None
    id: str | None = None


class _Part(Struct, rename="camel"):
    text: str | None = None
    thought: bool = False
    function_call: _FunctionCall | None = None


class _Content(Struct):
    parts: list[_Part] | None = None


class _Candidate(Struct, rename="camel"):
    content: _Content | None = None
    finish_reason: str | None = None


class _UsageMetadata(Struct, rename="camel"):
    prompt_token_count: int | None = None
    candidates_token_count: int | None = None
    thoughts_token_count: int | None = None


class _PromptFeedback(Struct, rename="camel"):
    block_reason: str | None = None


class _ErrorDetail(Struct):
    type: str = field(default="", name="@type")
    reason: str | None = None


class _Error(Struct):
    message: str = ""
    status: str = ""
    details: list[_ErrorDetail] | None = None


class _Response(Struct, rename="camel"):
    candidates: list[_Candidate] | None = None
    usage_metadata: _UsageMetadata | None = None
    prompt_feedback: _PromptFeedback | None = None
    error: _Error | None = None


class _ErrorBody(Struct):
    error: _Error | None = None


_RESPONSE_DECODER: Final = msgspec.json.Decoder(_Response)
_ERROR_DECODER: Final = msgspec.json.Decoder(_ErrorBody)
#: The request's parameters, as ``generationConfig`` names them.
_CONFIG_NAMES: Final = {
    "max_tokens": "maxOutputTokens",
    "temperature": "temperature",
    "top_p": "topP",
    "stop": "stopSequences",
    "seed": "seed",
}
_FILTERED: Final = "content_filter"
_FINISH_REASONS: Final = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": _FILTERED,
    "RECITATION": _FILTERED,
    "BLOCKLIST": _FILTERED,
    "PROHIBITED_CONTENT": _FILTERED,
    "SPII": _FILTERED,
    "IMAGE_SAFETY": _FILTERED,
}
#: The class of each error ``status`` (``INVALID_ARGUMENT``: by its message, but a bad key).
_STATUS_CLASSES: Final[dict[str, FailureClass | None]] = {
    "INVALID_ARGUMENT": None,
    "RESOURCE_EXHAUSTED": FailureClass.RATE_LIMITED,
    "UNAVAILABLE": FailureClass.OVERLOADED,
    "INTERNAL": FailureClass.SERVER_ERROR,
    "DEADLINE_EXCEEDED": FailureClass.SERVER_ERROR,
    "UNAUTHENTICATED": FailureClass.UNAVAILABLE,
    "PERMISSION_DENIED": FailureClass.UNAVAILABLE,
    "NOT_FOUND": FailureClass.UNAVAILABLE,
    "FAILED_PRECONDITION": FailureClass.UNAVAILABLE,
}


class _ResponseParser(SSEParser):
    """Folds ``GenerateContentResponse`` chunks into text, finish reason, counts and calls."""

    incomplete: ClassVar[str] = "stream ended before a finishReason"

    def event(self, event: ServerSentEvent) -> str:
        return self.response(event.data.encode())

    def response(self, data: bytes) -> str:
        """Take one ``GenerateContentResponse`` (a stream's chunk, or a whole answer)."""
        chunk = _RESPONSE_DECODER.decode(data)
        if chunk.error is not None:
            raise InBandError(error_detail(data), body=data)
        if chunk.usage_metadata is not None:
            usage = chunk.usage_metadata
            if usage.prompt_token_count is not None:
                self.prompt_tokens = usage.prompt_token_count
            if usage.candidates_token_count is not None or usage.thoughts_token_count:
                self.completion_tokens = (usage.candidates_token_count or 0) + (
                    usage.thoughts_token_count or 0
                )
        if not chunk.candidates:
            feedback = chunk.prompt_feedback
            if feedback is not None and feedback.block_reason:
                raise InBandError(
                    f"prompt blocked: {feedback.block_reason}", FailureClass.CONTENT_FILTER
                )
            return ""
        candidate = chunk.candidates[0]
        text = ""
        parts = candidate.content.parts if candidate.content is not None else None
        for part in parts or ():
            if part.text and not part.thought:
                text += part.text
            if part.function_call is not None:
                call = part.function_call
                self.tool_calls.append(
                    ToolCall(id=call.id or "", name=call.name, arguments=tool_arguments(call.args))
                )
        if candidate.finish_reason is not None:
            self.complete = True
            self.finish_or_tools(candidate.finish_reason, _FINISH_REASONS)
        return self.counted(text)


class GeminiBackend(HTTPBackend):
    """A backend that speaks the Gemini API (module docstring)."""

    parser = _ResponseParser
    paths = (
        "/models/{model}:streamGenerateContent?alt=sse",
        "/models/{model}:generateContent",
    )
    limit_style: LimitStyle = "gemini"

    def __init__(
        self, name: str, config: GeminiConfig, *, client: httpx.AsyncClient | None = None
    ) -> None:
        # The model may be named as Google's resource ("models/gemini-2.0-flash").
        config = msgspec.structs.replace(config, model=config.model.removeprefix("models/"))
        self._gemini = config
        self._safety: list[dict[str, Any]] = msgspec.to_builtins(config.safety_settings)
        super().__init__(name, config, client=client)

    def _auth_headers(self, key: str) -> dict[str, str]:
        return {"x-goog-api-key": key} if key else {}

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        system, turns = system_and_turns(request.messages)
        body: dict[str, Any] = {
            "contents": [
                {
                    "role": "model" if m.role == "assistant" else "user",
                    "parts": [{"text": m.text}],
                }
                for m in turns
            ]
        }
        if system is not None:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        config = given_params(request, _CONFIG_NAMES)
        if self._gemini.top_k is not None:
            config["topK"] = self._gemini.top_k
        if config:
            body["generationConfig"] = config
        if self._safety:
            body["safetySettings"] = self._safety
        return body

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        parser = _ResponseParser()
        text = parser.response(body)
        return parser.whole(text, request)

    def _error_class(self, body: bytes) -> FailureClass | None:
        wrapper = decoded(_ERROR_DECODER, body)
        error = wrapper.error if wrapper is not None else None
        if error is None:
            return None
        if any(detail.reason == "API_KEY_INVALID" for detail in error.details or ()):
            return FailureClass.UNAVAILABLE  # a 400 INVALID_ARGUMENT, but the key's fault
        return named_class(error.status, _STATUS_CLASSES, body)
