"""The adapter for the Gemini API (``adapter = "gemini"``).

``POST {base_url}/models/{model}:streamGenerateContent?alt=sse`` (streaming)
and ``:generateContent`` (not), with the key in ``x-goog-api-key`` (never in
the URL's ``?key=``, where it would reach logs), as
https://ai.google.dev/api/generate-content documents them.

The chat maps onto ``contents``: user turns as ``user``, assistant turns as
``model`` (turns of one role in a row merged), system messages as
``systemInstruction`` (joined by blank lines). Content parts become parts:
text, images as ``inlineData`` (``data:`` URLs) or ``fileData`` (``https://``
URLs, the MIME type guessed from the extension, JPEG if it says nothing). An
assistant's tool calls are ``functionCall`` parts (``args``: the arguments
as a JSON object; the first of a turn carries Google's documented stand-in
``thoughtSignature``, as the real one is not kept and Gemini 3 refuses a
replayed call without one); a ``tool`` message is a ``functionResponse``
part in a user turn, named after the earlier call whose id it answers, its
text under ``response.output`` (as JSON when it parses). A message's
``name`` has no counterpart and is dropped.

The parameters go in ``generationConfig`` (``maxOutputTokens``,
``temperature``, ``topP``, ``stopSequences``, ``seed``, ``presencePenalty``,
``frequencyPenalty``, ``topK`` from ``extra``'s ``top_k`` or the config;
the rest of ``extra`` is left out), a JSON response format as
``responseMimeType`` (and ``responseJsonSchema``), with the config's
``safetySettings``. ``tools`` are ``functionDeclarations`` whose
``parametersJsonSchema`` is the tool's JSON Schema as given; ``tool_choice``
is ``toolConfig.functionCallingConfig`` (``AUTO``, ``ANY``, ``NONE``; a
named tool ``ANY`` with ``allowedFunctionNames``). ``user`` and
``parallel_tool_calls`` have no counterpart and are not sent. Log
probabilities are not asked for (a bad request), nor is anything this
adapter cannot translate (unparseable tool-call arguments, a malformed image
URL, a tool message answering no earlier call).

The stream is server-sent events, each a whole ``GenerateContentResponse``
(no end marker): ``candidates[0].content.parts[].text`` is answer text
(parts marked ``thought`` are not), ``functionCall`` parts are tool calls
(whole, ``args`` an object; one without an ``id`` is named
``call_<request id>_<n>`` by the worker, ``n`` its place among the answer's
calls), ``finishReason`` ends it, ``usageMetadata``
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

from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any, ClassVar, Final
from urllib.parse import urlsplit

import httpx
import msgspec
from msgspec import Struct, field

from ..config import GeminiConfig, LimitStyle
from ..errors import BadRequestError, FailureClass
from ..schema import ChatMessage, GenerationParams, InferenceRequest, NamedTool, TextPart, Tool
from ._http import (
    HTTPBackend,
    InBandError,
    SSEParser,
    arguments_object,
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
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
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


# --------------------------------------------------------- request translation

#: What an image URL's extension says its type is (Gemini wants one for a
#: ``fileData`` URL; JPEG when the extension says nothing).
_IMAGE_TYPES: Final = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
    ".heic": "image/heic",
    ".heif": "image/heif",
    ".gif": "image/gif",
}
#: Google's documented stand-in for a function call's ``thoughtSignature``
#: when the real one was not kept (Gemini 3 refuses replayed calls without one).
_NO_SIGNATURE: Final = "skip_thought_signature_validator"


def _contents(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The chat as ``contents``: ``user`` and ``model`` turns, turns of one role
    in a row merged (all of a model turn's calls answered in one user turn, as
    Gemini counts them), a ``tool`` message a ``functionResponse`` part (one
    without a ``tool_call_id``, as version 1 wrote them, is user text)."""
    contents: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = "model" if message.role == "assistant" else "user"
        if message.role == "tool" and message.tool_call_id is not None:
            parts = [_function_response(message, messages[:index])]
        else:
            parts = _parts(message)
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        else:
            contents.append({"role": role, "parts": parts})
    for content in contents:
        parts = [p for p in content["parts"] if p.get("text") != ""]
        content["parts"] = parts or [{"text": ""}]
    return contents


def _parts(message: ChatMessage) -> list[dict[str, Any]]:
    """A user or model message's parts: text, images, function calls (its
    ``name`` has no counterpart: dropped)."""
    content = message.content
    parts: list[dict[str, Any]] = []
    for part in [TextPart(text=content)] if isinstance(content, str) else content:
        if isinstance(part, TextPart):
            parts.append({"text": part.text})
            continue
        source = image_source(part.image_url.url)
        if source.url is not None:
            mime = _IMAGE_TYPES.get(PurePosixPath(urlsplit(source.url).path).suffix.lower())
            parts.append({"fileData": {"mimeType": mime or "image/jpeg", "fileUri": source.url}})
        else:
            parts.append({"inlineData": {"mimeType": source.media_type, "data": source.data}})
    for index, call in enumerate(message.tool_calls):
        function_call: dict[str, Any] = {"name": call.name, "args": arguments_object(call)}
        if call.id:
            function_call["id"] = call.id
        call_part: dict[str, Any] = {"functionCall": function_call}
        if index == 0:  # Gemini signs a turn's first call
            call_part["thoughtSignature"] = _NO_SIGNATURE
        parts.append(call_part)
    return parts


def _function_response(message: ChatMessage, earlier: Sequence[ChatMessage]) -> dict[str, Any]:
    """A tool message as a ``functionResponse`` part: the name of the call it
    answers (the latest with its id), the result under ``output`` (its JSON
    value when the text is JSON, else the text), as Gemini documents it."""
    call_id = message.tool_call_id
    if not call_id:
        raise ValueError("a tool message must name the tool call it answers (tool_call_id)")
    name = next((c.name for m in reversed(earlier) for c in m.tool_calls if c.id == call_id), None)
    if name is None:
        raise ValueError(f"tool message answers {call_id!r}, which no earlier tool call is")
    if message.images:
        raise ValueError("Gemini takes a function's response as JSON, without images")
    text = message.text
    try:
        output: Any = msgspec.json.decode(text)
    except msgspec.DecodeError:
        output = text
    return {"functionResponse": {"id": call_id, "name": name, "response": {"output": output}}}


def _declaration(tool: Tool) -> dict[str, Any]:
    """A function declaration, its parameters' schema as JSON Schema (what
    OpenAI clients write), not Gemini's OpenAPI subset."""
    declared: dict[str, Any] = {"name": tool.name}
    if tool.description:
        declared["description"] = tool.description
    if tool.parameters:
        declared["parametersJsonSchema"] = tool.parameters
    return declared


def _tool_config(params: GenerationParams) -> dict[str, Any] | None:
    """``functionCallingConfig`` for the request's ``tool_choice`` (``parallel_tool_calls``
    has no counterpart)."""
    choice = params.tool_choice
    if not params.tools:
        if choice == "required" or isinstance(choice, NamedTool):
            raise ValueError("tool_choice asks for a tool call, but the request offers no tools")
        return None
    if isinstance(choice, NamedTool):
        if all(tool.name != choice.name for tool in params.tools):
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return {"mode": "ANY", "allowedFunctionNames": [choice.name]}
    modes = {"auto": "AUTO", "required": "ANY", "none": "NONE"}
    return None if choice is None else {"mode": modes[choice]}


def _response_format(params: GenerationParams) -> dict[str, Any]:
    """The ``generationConfig`` fields of the response format."""
    fmt = params.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"responseMimeType": "application/json"}
    if fmt.json_schema is None:
        raise ValueError("response_format json_schema needs its json_schema")
    return {"responseMimeType": "application/json", "responseJsonSchema": fmt.json_schema.schema}


class _ResponseParser(SSEParser):
    """Folds ``GenerateContentResponse`` chunks into text, finish reason, counts and calls."""

    incomplete: ClassVar[str] = "stream ended before a finishReason"
    #: A chunk with usage only may follow the one with the finishReason.
    ends_at_marker: ClassVar[bool] = False

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
                # Gemini may give no id: the worker names it
                # call_<request id>_<index>, unique across a conversation,
                # and a later tool message answers it by that id.
                self.add_tool_call(call.id or "", call.name, tool_arguments(call.args))
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
        try:
            return self._body_of(request)
        except ValueError as exc:
            raise BadRequestError(
                f"cannot send this request to Gemini: {exc}",
                backend=self.name,
                request_id=request.id,
            ) from None  # ours, and its cause may quote the request

    def _body_of(self, request: InferenceRequest) -> dict[str, Any]:
        """The ``GenerateContentRequest``; ``ValueError`` for what Gemini cannot be asked."""
        params = request.params
        if params.logprobs or params.top_logprobs:
            raise ValueError("this adapter does not ask Gemini for log probabilities")
        system, turns = system_and_turns(request.messages)
        if any(m.images for m in request.messages if m.role == "system"):
            raise ValueError("a system message cannot hold images")
        body: dict[str, Any] = {"contents": _contents(turns)}
        if system is not None:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        if params.tools:
            body["tools"] = [{"functionDeclarations": [_declaration(t) for t in params.tools]}]
        tool_config = _tool_config(params)
        if tool_config is not None:
            body["toolConfig"] = {"functionCallingConfig": tool_config}
        config = given_params(request, _CONFIG_NAMES)
        top_k = params.extra.get("top_k", self._gemini.top_k)
        if top_k is not None:
            if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
                raise ValueError("top_k must be a whole number of at least 1")
            config["topK"] = top_k
        config.update(_response_format(params))
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
