"""Gemini's ``POST /v1beta/models/<m>:streamGenerateContent?alt=sse`` and
``:generateContent``.

The path names the model and whether it streams (:meth:`GeminiDialect.target`);
it streams only as ``alt=sse`` (not as a JSON array). A request is checked
as the Gemini API checks it (roles, one kind of data per part, base64,
function calls and responses, function names, schemas; a refusal is its
400), and the answer calls a function after its text when the request
forces one (mode ``ANY``) or its last user message says ``call <name>``
(never in mode ``NONE``), with the arguments
:data:`~.base.MOCK_TOOL_ARGUMENTS` and no id, as the Gemini API's calls
carry none. A bad key is a 400 (``API_KEY_INVALID``); rate limits show only
in 429 bodies (``RESOURCE_EXHAUSTED``), whatever the mock's ``limit_style``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal
from urllib.parse import unquote

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

__all__ = ["GeminiDialect"]


class _Blob(Struct, rename="camel"):
    mime_type: str
    data: str


class _FileData(Struct, rename="camel"):
    mime_type: str
    file_uri: str


class _FunctionCall(Struct):
    name: str
    args: dict[str, Any] = {}
    id: str | None = None


class _FunctionResponse(Struct):
    name: str
    response: dict[str, Any]
    id: str | None = None


class _Part(Struct, rename="camel"):
    text: str | None = None
    inline_data: _Blob | None = None
    file_data: _FileData | None = None
    function_call: _FunctionCall | None = None
    function_response: _FunctionResponse | None = None
    thought_signature: str | None = None


class _Content(Struct):
    parts: list[_Part] = []
    role: str | None = None


class _GenerationConfig(Struct, rename="camel"):
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    response_mime_type: Literal["text/plain", "application/json", "text/x.enum"] | None = None
    response_schema: dict[str, Any] | None = None
    response_json_schema: dict[str, Any] | None = None


class _FunctionDeclaration(Struct, rename="camel"):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | None = None


class _Tool(Struct, rename="camel"):
    function_declarations: list[_FunctionDeclaration] = []


class _CallingConfig(Struct, rename="camel"):
    mode: Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"] = "AUTO"
    allowed_function_names: list[str] = []


class _ToolConfig(Struct, rename="camel"):
    function_calling_config: _CallingConfig | None = None


class _GeminiBody(Struct, rename="camel"):
    contents: Annotated[list[_Content], Meta(min_length=1)]
    system_instruction: _Content | None = None
    generation_config: _GenerationConfig | None = None
    tools: list[_Tool] = []
    tool_config: _ToolConfig | None = None


#: A function's name as Gemini allows it.
_GEMINI_NAME: Final = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-"
)


def _gemini_check(body: _GeminiBody) -> None:
    """What the Gemini API refuses (``msgspec.ValidationError``, its words): a
    role other than user and model, a part with no data or two, bytes that
    are not base64, a function call turn after a model turn, function
    responses not as many as the calls they answer, a bad function name or
    both kinds of parameter schema, ``responseJsonSchema`` with
    ``responseSchema`` or without ``responseMimeType`` JSON."""
    calls = 0
    for index, content in enumerate(body.contents):
        if content.role not in ("user", "model"):
            raise msgspec.ValidationError("Please use a valid role: user, model.")
        for number, part in enumerate(content.parts):
            _gemini_check_part(part, f"contents[{index}].parts[{number}]")
        responses = sum(p.function_response is not None for p in content.parts)
        if calls and responses != calls:
            raise msgspec.ValidationError(
                "Please ensure that the number of function response parts is equal to the "
                "number of function call parts of the function call turn."
            )
        has_calls = any(p.function_call is not None for p in content.parts)
        if has_calls and index and body.contents[index - 1].role == "model":
            raise msgspec.ValidationError(
                "Please ensure that function call turn comes immediately after a user turn "
                "or after a function response turn."
            )
        calls = sum(p.function_call is not None for p in content.parts)
    for number, tool in enumerate(body.tools):
        for which, declared in enumerate(tool.function_declarations):
            where = f"tools[{number}].function_declarations[{which}]"
            name = declared.name
            if not name or len(name) > 64 or not set(name) <= _GEMINI_NAME or name[0].isdigit():
                raise msgspec.ValidationError(
                    f"* GenerateContentRequest.{where}.name: Invalid function name. Must start "
                    "with a letter or an underscore. Must be alphameric (a-z, A-Z, 0-9), "
                    "underscores (_), dots (.), colons (:), or dashes (-), with a maximum "
                    "length of 64."
                )
            if declared.parameters is not None and declared.parameters_json_schema is not None:
                raise msgspec.ValidationError(
                    f"{where}: parameters and parameters_json_schema are mutually exclusive"
                )
    config = body.generation_config
    if config is not None and config.response_json_schema is not None:
        if config.response_schema is not None:
            raise msgspec.ValidationError(
                "response_schema and response_json_schema are mutually exclusive"
            )
        if config.response_mime_type != "application/json":
            raise msgspec.ValidationError(
                "response_json_schema requires response_mime_type application/json"
            )


def _gemini_check_part(part: _Part, where: str) -> None:
    kinds = (
        part.text,
        part.inline_data,
        part.file_data,
        part.function_call,
        part.function_response,
    )
    if sum(kind is not None for kind in kinds) != 1:
        raise msgspec.ValidationError(
            f"Invalid value at '{where}' (oneof data): a part must hold exactly one kind of data"
        )
    if part.inline_data is not None and not base64_ok(part.inline_data.data):
        raise msgspec.ValidationError(
            f"Invalid value at '{where}.inline_data.data' (TYPE_BYTES), Base64 decoding failed"
        )


def _gemini_tool(body: _GeminiBody) -> str | None:
    """The tool the answer calls (:func:`tool_to_call`)."""
    declared = [d.name for tool in body.tools for d in tool.function_declarations]
    calling = body.tool_config.function_calling_config if body.tool_config else None
    mode = calling.mode if calling is not None else "AUTO"
    if mode == "NONE":
        return None
    forced = None
    if mode == "ANY" and calling is not None:
        names = calling.allowed_function_names
        forced = names[0] if names else "required"
    last_user = next((c for c in reversed(body.contents) if c.role == "user"), None)
    text = " ".join(p.text or "" for p in last_user.parts) if last_user is not None else ""
    return tool_to_call(declared, forced, text)


_GEMINI_DECODER: Final = msgspec.json.Decoder(_GeminiBody)
_GEMINI_STATUSES: Final = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


class GeminiDialect(Dialect):
    """``/v1beta/models/<m>:streamGenerateContent?alt=sse``: whole
    ``GenerateContentResponse`` objects, the last with ``finishReason`` and
    the full ``usageMetadata``; no end marker.

    As recorded in discourse/discourse-ai's spec/lib/completions/endpoints/gemini_spec.rb
    and https://ai.google.dev/api/generate-content.
    """

    name = "gemini"
    limit_style = "gemini"
    key_header = "x-goog-api-key"
    auth_status = 400  # with the reason API_KEY_INVALID in its details
    finish_names: ClassVar[Mapping[str, str]] = {
        "stop": "STOP",
        "length": "MAX_TOKENS",
        "content_filter": "SAFETY",
        "tool_calls": "STOP",  # Gemini says STOP after function calls too
    }

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _GEMINI_DECODER.decode(raw)
        _gemini_check(body)
        contents = list(body.contents)
        if body.system_instruction is not None:
            contents.append(body.system_instruction)
        chars = sum(len(part.text or "") for content in contents for part in content.parts)
        config = body.generation_config
        return Call(
            model=target.model or "",
            prompt_tokens=prompt_tokens_of(chars),
            stream=bool(target.stream),
            cap=config.max_output_tokens if config is not None else None,
            tool=_gemini_tool(body),
        )

    def piece(self, text: str, index: int) -> bytes:
        return (
            b'{"candidates":[{"content":{"parts":[{"text":"'
            + text.encode()
            + b'"}],"role":"model"},"index":0}]'
        )

    def cut(self, piece: bytes, text: str) -> bytes:
        # The tail (usage, model, the event's end) follows every piece.
        return super().cut(piece, text).removesuffix(self.terminator)

    def _usage(self, reply: Reply, *, final: bool) -> dict[str, int]:
        if not final:  # as Gemini streams them: the output counted only at the end
            return {"promptTokenCount": reply.prompt_tokens, "totalTokenCount": reply.prompt_tokens}
        return {
            "promptTokenCount": reply.prompt_tokens,
            "candidatesTokenCount": reply.completion_tokens,
            "totalTokenCount": reply.prompt_tokens + reply.completion_tokens,
        }

    def _response(self, reply: Reply, text: str) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{"text": text}]
        if reply.tool is not None:  # as the Gemini API sends them: no id
            parts.append({"functionCall": {"name": reply.tool, "args": MOCK_TOOL_ARGUMENTS}})
        return {
            "candidates": [
                {
                    "content": {"parts": parts, "role": "model"},
                    "finishReason": self.finish(reply.finish_reason),
                    "index": 0,
                }
            ],
            "usageMetadata": self._usage(reply, final=True),
            "modelVersion": reply.model,
        }

    def frames(self, reply: Reply) -> Frames:
        tail = (
            b',"usageMetadata":'
            + to_json(self._usage(reply, final=False))
            + b',"modelVersion":'
            + to_json(reply.model)
            + b"}\n\n"
        )
        return Frames(
            head=b"data: ",
            tail=tail,
            opening=b"",
            closing=b"data: " + to_json(self._response(reply, "")) + b"\n\n",
            done=b"",
        )

    def answer(self, reply: Reply) -> bytes:
        return to_json(self._response(reply, answer_text(reply.completion_tokens)))

    def _body(self, status: int, message: str, **extra: Any) -> bytes:
        code = _GEMINI_STATUSES.get(status, "UNKNOWN")
        return to_json({"error": {"code": status, "message": message, "status": code, **extra}})

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        if kind == "auth":  # Gemini answers a bad key with a 400, the reason in its details
            details = [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID",
                    "domain": "googleapis.com",
                    "metadata": {"service": "generativelanguage.googleapis.com"},
                }
            ]
            return self._body(
                400, "API key not valid. Please pass a valid API key.", details=details
            )
        if kind == "busy" and status == 503:
            message = "The model is overloaded. Please try again later."
        return self._body(status, message)

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "500":
            message = (
                "An internal error has occurred. Please retry or report in "
                "https://developers.generativeai.google/guide/troubleshooting"
            )
            return 500, self._body(500, message)
        if kind == "context_length":
            limit = window or 1_048_576
            message = (
                f"The input token count ({max(prompt_tokens, limit + 1)}) exceeds the maximum "
                f"number of tokens allowed ({limit})."
            )
            return 400, self._body(400, message)
        if kind == "content_filter":  # a blocked prompt is a 200 without candidates
            feedback = {
                "promptFeedback": {
                    "blockReason": "SAFETY",
                    "safetyRatings": [
                        {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH"}
                    ],
                },
                "usageMetadata": {
                    "promptTokenCount": prompt_tokens,
                    "totalTokenCount": prompt_tokens,
                },
            }
            return 200, to_json(feedback)
        return super().fault(kind, window, prompt_tokens)

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        return b"data: " + self.fault("500", 0, 0)[1] + b"\n\n"

    def not_found(self, model: str) -> tuple[int, bytes]:
        message = (
            f"models/{model} is not found for API version v1beta, or is not supported for "
            "generateContent. Call ListModels to see the list of available models and their "
            "supported methods."
        )
        return 404, self._body(404, message)

    @staticmethod
    def target(path: str, alt: str | None) -> Target | str:
        """Model and streaming from ``<model>:<method>``; an error text if it is neither method."""
        model, _, method = unquote(path).rpartition(":")
        if method == "generateContent":
            return Target(model=model, stream=False)
        if method == "streamGenerateContent":
            if alt != "sse":
                return "the mock streams only with ?alt=sse"
            return Target(model=model, stream=True)
        return f"unknown method {method!r}: generateContent or streamGenerateContent"
