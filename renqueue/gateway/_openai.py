"""The OpenAI chat-completions API, translated to and from Ren-Queue's wire.

The one place where a chat-completions body becomes a submission and a
request's outcome becomes a ``chat.completion`` (or its
``chat.completion.chunk`` stream). All of it is pure: bytes and headers in,
values or bytes out, so every rule here is unit-tested without a server.

What the wire carries (``renqueue.schema.ChatMessage``, ``GenerationParams``)
is translated: messages of every role (``developer`` is ``system``) with
string content or text and ``image_url`` parts, ``name``, an assistant's
``tool_calls`` (OpenAI's nested ``function`` flattened) and a tool result's
``tool_call_id``; ``max_tokens`` (or ``max_completion_tokens``),
``temperature``, ``top_p``, ``stop``, ``seed``, the penalties, ``logprobs``
and ``top_logprobs``, ``response_format``, ``tools`` (functions),
``tool_choice``, ``parallel_tool_calls`` and ``user``.

A top-level field the gateway does not know (vLLM's ``top_k``, ``min_p``,
``repetition_penalty``, a provider's own) is passed through as it is, in
``params.extra`` (at most :data:`MAX_EXTRA`; a ``null`` one asks for
nothing and is left out): an OpenAI-compatible backend gets it in its body.
Ren-Queue's own fields never go there: its controls (below) are read, and a
field that names something only Ren-Queue's Python client sets
(:data:`_RESERVED`: ``tenant``, ``complexity``, ...) is refused. Inside
messages, parts, tools and formats, unknown fields are refused, naming the
field (``forbid_unknown_fields``): their meaning would be dropped.

Known fields the wire does not carry (``n``, ``audio``, ``modalities``,
``prediction``, ``logit_bias``, ``functions``, ...) are answered 400 naming
the field, unless sent at their neutral value (``n: 1``,
``modalities: ["text"]``, ``functions: []``, ...), which asks for nothing:
the answer would not be what was asked for. ``functions`` and
``function_call`` (OpenAI's deprecated form of tools) stay refused: an
answer could only come back as ``tool_calls``, which a client using them
does not read.

Ren-Queue's own controls come from headers, or from body fields of the same
meaning (the SDKs' ``extra_body``); a header wins over the body:

==============================  ============================  ==========================
header                          body field                    meaning
==============================  ============================  ==========================
``X-Priority``                  ``priority``                  a level name, or an integer
``X-Deadline``                  ``deadline``                  Unix time, seconds
``X-Request-Timeout``           ``request_timeout``           seconds from now
``X-Max-Cost``                  ``max_cost``                  US dollars
``X-Keep-Alive-On-Disconnect``  ``keep_alive_on_disconnect``  ``true``: keep it running
``traceparent``                 (none)                        the W3C trace to carry it in
==============================  ============================  ==========================

A ``traceparent`` that is not a valid W3C one is dropped (the request starts
a trace of its own), never an error.

An integer priority is vLLM's: lower runs sooner and 0 is the default. It
counts levels from ``default_priority``: 0 is that level, -1 the next more
urgent one, 1 the next less urgent one, and so on, clamped to the levels there
are (with the default levels: -2 ``critical``, -1 ``high``, 0 ``normal``, 1
``low``, 2 and more ``batch``). A level name is taken as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeVar

import msgspec
from msgspec import Raw, Struct

from ..schema import (
    MAX_METADATA_BYTES,
    TRACEPARENT,
    ChatMessage,
    GenerationParams,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
    parse_traceparent,
)
from ._errors import ApiError, validation_code

__all__ = [
    "MAX_EXTRA",
    "Answer",
    "Chat",
    "ChatBody",
    "Submission",
    "ToolCallPieces",
    "answer_bytes",
    "chunk_bytes",
    "completion_bytes",
    "parse_chat",
    "translate",
]

_T = TypeVar("_T")

_ABSENT: Final = Raw()


class _Strict(Struct, kw_only=True, forbid_unknown_fields=True):
    """Unknown fields are errors: a field we do not carry is never dropped silently."""


class ImageUrlBody(_Strict, kw_only=True):
    url: str
    detail: str | None = None


class ContentPart(_Strict, kw_only=True):
    type: str
    text: str | None = None
    #: OpenAI's object; a bare URL string is taken too (as LiteLLM and vLLM take it).
    image_url: ImageUrlBody | str | None = None
    input_audio: Raw = _ABSENT
    file: Raw = _ABSENT
    refusal: Raw = _ABSENT
    cache_control: Raw = _ABSENT


class FunctionCallBody(_Strict, kw_only=True):
    name: str
    arguments: str


class ToolCallBody(_Strict, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCallBody | None = None
    custom: Raw = _ABSENT


class BodyMessage(_Strict, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None
    function_call: Raw = _ABSENT
    refusal: str | None = None
    audio: Raw = _ABSENT


class FunctionBody(_Strict, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(_Strict, kw_only=True):
    type: str
    function: FunctionBody | None = None
    custom: Raw = _ABSENT


class NameBody(_Strict, kw_only=True):
    name: str


class ToolChoiceBody(_Strict, kw_only=True):
    type: str
    function: NameBody | None = None
    custom: Raw = _ABSENT
    allowed_tools: Raw = _ABSENT


class JsonSchemaBody(_Strict, kw_only=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormatBody(_Strict, kw_only=True):
    type: str
    json_schema: JsonSchemaBody | None = None


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatBody(Struct, kw_only=True):
    """A ``POST /v1/chat/completions`` body, as far as the gateway reads it
    (its other top-level fields are :attr:`Chat.extra`)."""

    model: str
    messages: list[BodyMessage]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None
    tool_choice: str | ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatBody | None = None
    # Not carried: accepted at their neutral value only.
    n: int | None = None
    functions: Raw = _ABSENT
    function_call: Raw = _ABSENT
    logit_bias: Raw = _ABSENT
    store: bool | None = None
    modalities: Raw = _ABSENT
    audio: Raw = _ABSENT
    prediction: Raw = _ABSENT
    reasoning_effort: Raw = _ABSENT
    service_tier: Raw = _ABSENT
    web_search_options: Raw = _ABSENT
    verbosity: Raw = _ABSENT
    # Ren-Queue's controls (headers win); ``priority`` is vLLM's field too.
    priority: int | str | None = None
    deadline: float | None = None
    request_timeout: float | None = None
    max_cost: float | None = None
    keep_alive_on_disconnect: bool | None = None


class Chat(Struct, frozen=True, kw_only=True):
    """A parsed body: the fields the gateway knows, and the others, as sent."""

    body: ChatBody
    #: Top-level fields it does not know (``null`` ones left out), passed through.
    extra: dict[str, Any] = {}


_DECODER: Final = msgspec.json.Decoder(ChatBody)
_FIELDS: Final = msgspec.json.Decoder(dict[str, Raw])
_KNOWN: Final = frozenset(ChatBody.__struct_fields__)

#: Raw fields and the values that ask for nothing (JSON, as sent, spaces removed).
_NEUTRAL: Final[dict[str, frozenset[bytes]]] = {
    "functions": frozenset({b"[]"}),
    "function_call": frozenset({b'"none"', b'"auto"'}),
    "logit_bias": frozenset({b"{}"}),
    "modalities": frozenset({b'["text"]'}),
    "service_tier": frozenset({b'"auto"', b'"default"'}),
    "reasoning_effort": frozenset(),
    "audio": frozenset(),
    "prediction": frozenset(),
    "web_search_options": frozenset(),
    "verbosity": frozenset(),
}
_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
#: Fields only Ren-Queue's Python client sets: a body naming one expects an
#: effect the gateway does not give (the key alone names the tenant).
_RESERVED: Final = frozenset(
    {"tenant", "request_id", "complexity", "parent_id", "dedupe_key", "coalesce"}
)
MAX_STOP: Final = 16
#: Metadata entries a body may carry: the wire's 64, less the two the gateway
#: may add (``user``, and the body's fingerprint under an idempotency key).
MAX_METADATA: Final = 62
#: Unknown parameters passed through, at most (the wire's bound on ``extra``).
MAX_EXTRA: Final = 64
#: The wire's bounds on tools and messages.
MAX_TOOLS: Final = 128
MAX_MESSAGES: Final = 10_000
#: Nesting of a JSON schema or a passed-through value, at most: deeper, a
#: schema is no schema a model follows, and the Python that walks it
#: (adapters translating schemas) must not hit the recursion limit.
MAX_DEPTH: Final = 64
_MAX_KEY: Final = 256
#: The headers Ren-Queue's controls come from (read case-insensitively).
_CONTROLS: Final = frozenset(
    {
        "x-priority",
        "x-deadline",
        "x-request-timeout",
        "x-max-cost",
        "x-keep-alive-on-disconnect",
        TRACEPARENT,
    }
)


class Submission(Struct, frozen=True, kw_only=True):
    """What a chat-completions call asks Ren-Queue for (before a request id exists)."""

    route: str
    messages: list[ChatMessage]
    params: GenerationParams = GenerationParams()
    priority: str
    deadline: float | None = None
    max_cost: float | None = None
    metadata: dict[str, str] = {}
    stream: bool = False
    include_usage: bool = False
    #: ``None``: the gateway's default (keep it if it has an idempotency key).
    keep_alive_on_disconnect: bool | None = None
    #: The caller's W3C ``traceparent`` header, if it is a valid one (as
    #: :func:`~renqueue.schema.parse_traceparent` writes it); ``None``
    #: otherwise: a malformed one is dropped, never an error.
    traceparent: str | None = None


def parse_chat(body: bytes) -> Chat:
    """Decode a body; :class:`ApiError` 400 naming the field for anything malformed."""
    try:
        fields = _FIELDS.decode(body)
        chat = Chat(body=_DECODER.decode(body), extra=_extra(fields))
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None
    return chat


def _extra(fields: dict[str, Raw]) -> dict[str, Any]:
    """The top-level fields the gateway does not know, to pass through."""
    unknown = [name for name in fields if name not in _KNOWN]
    if not unknown:
        return {}
    for name in unknown:
        if name in _RESERVED:
            raise ApiError(
                400,
                f"{name!r} is set by Ren-Queue's Python client, not through the gateway"
                " (the API key alone names the tenant)",
                param=name,
                code="unsupported_parameter",
            )
        if not name or len(name) > _MAX_KEY:
            raise ApiError(
                400, f"a parameter name must be 1 to {_MAX_KEY} characters", code="invalid_value"
            )
    if len(unknown) > MAX_EXTRA:
        raise ApiError(
            400,
            f"at most {MAX_EXTRA} parameters the gateway does not know are passed"
            f" through; this body has {len(unknown)}",
            param=unknown[MAX_EXTRA],
            code="too_many_parameters",
        )
    extra: dict[str, Any] = {}
    for name in unknown:
        value = msgspec.json.decode(fields[name])
        if value is None:
            continue  # null asks for nothing, as the SDKs' NOT_GIVEN
        _bounded(value, name)
        extra[name] = value
    return extra


def _bounded(value: Any, param: str) -> None:
    """ApiError 400 if ``value`` nests deeper than :data:`MAX_DEPTH` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= MAX_DEPTH:
            raise ApiError(
                400,
                f"{param} is nested deeper than {MAX_DEPTH} levels",
                param=param,
                code="invalid_value",
            )
        stack.extend((child, depth + 1) for child in children)


def _invalid(exc: msgspec.ValidationError, where: str = "") -> ApiError:
    text = str(exc)
    message, sep, at = text.partition(" - at `$")
    param = where + at.rstrip("`") if sep else where
    param = param.lstrip(".")
    code = validation_code(message)
    field = message.split("`")[1] if "`" in message else "?"
    if code == "unknown_parameter":
        param = f"{param}.{field}" if param else field
        message = f"unsupported parameter: {param}"
    elif code == "missing_required_parameter" and not param:
        # A top-level field: the message names it, the path is the body's root.
        param = field
        message = f"{field} is required"
    else:
        message = f"{message} (at {param})" if param else message
    return ApiError(400, message, param=param or None, code=code)


#: Wire paths (flat tool calls and tools) as the chat API names them.
_API_PATHS: Final = (
    (".name", ".function.name"),
    (".arguments", ".function.arguments"),
    (".parameters", ".function.parameters"),
    (".description", ".function.description"),
    (".strict", ".function.strict"),
)


def _convert(raw: Any, type_: type[_T], where: str) -> _T:
    """``raw`` as the wire type, every constraint checked; ApiError 400 naming
    the field as the chat API names it."""
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        error = _invalid(exc, where)
        param = error.param or ""
        if "tool_calls[" in param or param.startswith(("tools[", "tool_choice")):
            for wire, api in _API_PATHS:
                if param.endswith(wire) and not param.endswith(api):
                    fixed = param[: -len(wire)] + api
                    error.message = error.message.replace(param, fixed)
                    error.param = fixed
                    break
        raise error from None


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(
        400,
        f"not supported by this gateway: {what} ({param})",
        param=param,
        code="unsupported_parameter",
    )


def _required(param: str) -> ApiError:
    return ApiError(400, f"{param} is required", param=param, code="missing_required_parameter")


def _check_neutral(body: ChatBody) -> None:
    for field, allowed in _NEUTRAL.items():
        raw: Raw = getattr(body, field)
        value = bytes(raw)
        if not value or value == b"null":
            continue
        compact = msgspec.json.encode(msgspec.json.decode(value))
        if compact not in allowed:
            raise _unsupported(field, f"{field!r}")
    plain: tuple[tuple[str, Any, Any], ...] = (("n", body.n, 1), ("store", body.store, False))
    for field, value, neutral in plain:
        if value is not None and value != neutral:
            raise _unsupported(field, f"{field}={value!r}")


def _messages(messages: list[BodyMessage]) -> list[ChatMessage]:
    if not messages:
        raise ApiError(
            400, "messages must not be empty", param="messages", code="array_below_min_length"
        )
    if len(messages) > MAX_MESSAGES:
        raise ApiError(
            400, f"at most {MAX_MESSAGES} messages", param="messages", code="array_above_max_length"
        )
    return [_message(message, f"messages[{index}]") for index, message in enumerate(messages)]


def _message(message: BodyMessage, where: str) -> ChatMessage:
    role = _role(message, where)
    calls = [
        _tool_call(call, f"{where}.tool_calls[{index}]")
        for index, call in enumerate(message.tool_calls or ())
    ]
    content: Any = message.content
    if content is None:
        if not calls:
            raise _required(f"{where}.content")
        content = ""
    elif not isinstance(content, str):
        content = _parts(content, where)
    raw: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        raw["name"] = message.name
    if calls:
        raw["tool_calls"] = calls
    if message.tool_call_id is not None:
        raw["tool_call_id"] = message.tool_call_id
    return _convert(raw, ChatMessage, where)


def _role(message: BodyMessage, where: str) -> str:
    """The wire's role of ``message``; ApiError 400 for what its role cannot carry."""
    role = _ROLES.get(message.role)
    if role is None:
        raise _unsupported(f"{where}.role", f"role {message.role[:32]!r}")
    for field in ("function_call", "audio"):
        value = bytes(getattr(message, field))
        if value and value != b"null":
            raise _unsupported(f"{where}.{field}", field)
    if message.refusal is not None:
        raise _unsupported(f"{where}.refusal", "refusals")
    if message.tool_calls and role != "assistant":
        raise ApiError(
            400,
            f"only assistant messages carry tool_calls ({where})",
            param=f"{where}.tool_calls",
            code="invalid_value",
        )
    if message.tool_call_id is not None and role != "tool":
        raise ApiError(
            400,
            f"only tool messages carry a tool_call_id ({where})",
            param=f"{where}.tool_call_id",
            code="invalid_value",
        )
    if role == "tool" and not message.tool_call_id:
        raise ApiError(
            400,
            f"a tool message needs the tool_call_id it answers ({where})",
            param=f"{where}.tool_call_id",
            code="missing_required_parameter",
        )
    return role


def _tool_call(call: ToolCallBody, at: str) -> dict[str, str]:
    if call.type != "function":
        raise _unsupported(f"{at}.type", f"tool calls of type {call.type[:32]!r}")
    if call.function is None:
        raise _required(f"{at}.function")
    return {"id": call.id or "", "name": call.function.name, "arguments": call.function.arguments}


def _parts(parts: list[ContentPart], where: str) -> str | list[dict[str, Any]]:
    """Content parts as the wire's; text alone is joined by newlines, as
    vLLM's chat templates join it (the same answer, and one string)."""
    out: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        at = f"{where}.content[{index}]"
        if bytes(part.cache_control):
            raise _unsupported(f"{at}.cache_control", "cache_control")
        if part.type == "text":
            if part.text is None:
                raise _required(f"{at}.text")
            out.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            out.append({"type": "image_url", "image_url": _image(part.image_url, at)})
        else:
            raise _unsupported(f"{at}.type", f"content parts of type {part.type[:32]!r}")
    if all(part["type"] == "text" for part in out):
        return "\n".join(part["text"] for part in out)
    return out


def _image(image: ImageUrlBody | str | None, at: str) -> dict[str, Any]:
    if image is None:
        raise _required(f"{at}.image_url")
    url, detail = (image, None) if isinstance(image, str) else (image.url, image.detail)
    if not (url.startswith("https://") or (url.startswith("data:image/") and ";base64," in url)):
        raise ApiError(
            400,
            f"an image is an https:// URL or a data:image/...;base64, URL ({at}.image_url.url)",
            param=f"{at}.image_url.url",
            code="invalid_image_url",
        )
    return {"url": url} if detail is None else {"url": url, "detail": detail}


def _tools(tools: list[ToolBody] | None) -> list[dict[str, Any]]:
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise ApiError(
            400,
            f"at most {MAX_TOOLS} tools, got {len(tools)}",
            param="tools",
            code="array_above_max_length",
        )
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if tool.type != "function":
            raise _unsupported(f"{at}.type", f"tools of type {tool.type[:32]!r}")
        if tool.function is None:
            raise _required(f"{at}.function")
        function = tool.function
        raw: dict[str, Any] = {"name": function.name}
        if function.description:
            raw["description"] = function.description
        if function.parameters:
            _bounded(function.parameters, f"{at}.function.parameters")
            raw["parameters"] = function.parameters
        if function.strict is not None:
            raw["strict"] = function.strict
        out.append(raw)
    return out


def _tool_choice(
    choice: str | ToolChoiceBody | None, tools: list[dict[str, Any]]
) -> str | dict[str, str] | None:
    """The wire's ``tool_choice``; ``None`` without tools when it asks for nothing."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(
                400,
                f"tool_choice is none, auto, required or a function, not {choice[:32]!r}",
                param="tool_choice",
                code="invalid_value",
            )
        if not tools:
            if choice == "required":
                raise ApiError(
                    400,
                    "tool_choice 'required' needs tools",
                    param="tool_choice",
                    code="invalid_value",
                )
            return None  # none and auto ask for nothing without tools
        return choice
    if choice.type != "function":
        raise _unsupported("tool_choice.type", f"tool_choice of type {choice.type[:32]!r}")
    if choice.function is None:
        raise _required("tool_choice.function")
    name = choice.function.name
    if name not in {tool["name"] for tool in tools}:
        raise ApiError(
            400,
            f"tool_choice names {name[:64]!r}, which is not among tools",
            param="tool_choice.function.name",
            code="invalid_value",
        )
    return {"name": name}


def _response_format(format_: ResponseFormatBody | None) -> dict[str, Any] | None:
    if format_ is None or format_.type == "text":
        return None  # text asks for nothing
    if format_.type == "json_object":
        return {"type": "json_object"}
    if format_.type != "json_schema":
        raise _unsupported("response_format.type", f"response_format {format_.type[:32]!r}")
    schema = format_.json_schema
    if schema is None:
        raise _required("response_format.json_schema")
    raw: dict[str, Any] = {"name": schema.name}
    if schema.schema:
        _bounded(schema.schema, "response_format.json_schema.schema")
        raw["schema"] = schema.schema
    if schema.description:
        raw["description"] = schema.description
    if schema.strict is not None:
        raw["strict"] = schema.strict
    return {"type": "json_schema", "json_schema": raw}


def _params(body: ChatBody, extra: dict[str, Any]) -> GenerationParams:
    """The wire's parameters. Values that ask for nothing (a penalty of 0,
    ``logprobs: false``) are left out: an adapter that has no counterpart
    for them must not refuse a request for them."""
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens disagree; give one",
            param="max_completion_tokens",
            code="invalid_value",
        )
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if stop is not None and len(stop) > MAX_STOP:
        raise ApiError(
            400, f"at most {MAX_STOP} stop sequences", param="stop", code="array_above_max_length"
        )
    top = body.top_logprobs or None
    if top is not None and not body.logprobs:
        raise ApiError(
            400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    tools = _tools(body.tools)
    raw: dict[str, Any] = {
        "max_tokens": body.max_completion_tokens if body.max_tokens is None else body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": stop,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty or None,
        "frequency_penalty": body.frequency_penalty or None,
        "logprobs": True if body.logprobs else None,
        "top_logprobs": top,
        "response_format": _response_format(body.response_format),
        "tool_choice": _tool_choice(body.tool_choice, tools),
        "parallel_tool_calls": body.parallel_tool_calls if tools else None,
        "user": body.user,
    }
    raw = {name: value for name, value in raw.items() if value is not None}
    if tools:
        raw["tools"] = tools
    if extra:
        raw["extra"] = extra
    return _convert(raw, GenerationParams, "")


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return None if value is None else value.strip()


def _number(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ApiError(
            400,
            f"{name} must be a non-negative number, got {text[:40]!r}",
            param=name,
            code="invalid_value",
        )
    return value


def _level(value: int | str, levels: Sequence[str], default: str, where: str) -> str:
    """A level name, or vLLM's integer priority counted from the default level."""
    if isinstance(value, str):
        text = value.strip()
        if text in levels:
            return text
        try:
            value = int(text)
        except ValueError:
            raise ApiError(
                400,
                f"unknown priority {text[:64]!r}: a level ({', '.join(levels)}) or an integer",
                param=where,
                code="unknown_priority",
            ) from None
    rank = levels.index(default) + value
    return levels[min(max(rank, 0), len(levels) - 1)]


def _flag(text: str, name: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ApiError(
        400, f"{name} must be true or false, got {text[:40]!r}", param=name, code="invalid_value"
    )


def _controlled(
    headers: Mapping[str, str], header: str, value: _T, read: Callable[[str, str], _T]
) -> _T:
    """The body's ``value`` of a control, unless ``header`` gives one (headers win),
    read by ``read`` (which names the header in its error)."""
    text = _header(headers, header.lower())
    return value if text is None else read(text, header)


def translate(
    chat: Chat,
    headers: Mapping[str, str],
    *,
    levels: Sequence[str],
    default_level: str,
    now: float,
) -> Submission:
    """What ``chat`` (with Ren-Queue's ``headers``) asks for; ApiError 400 if it
    asks for what the wire cannot carry."""
    body = chat.body
    headers = {k.lower(): v for k, v in headers.items() if k.lower() in _CONTROLS}
    _check_neutral(body)
    messages = _messages(body.messages)
    params = _params(body, chat.extra)

    priority_text = _header(headers, "x-priority")
    priority: int | str | None = priority_text if priority_text else body.priority
    level = default_level
    if priority is not None:
        level = _level(
            priority, levels, default_level, "X-Priority" if priority_text else "priority"
        )

    deadline = _controlled(headers, "X-Deadline", body.deadline, _number)
    timeout = _controlled(headers, "X-Request-Timeout", body.request_timeout, _number)
    if timeout is not None:
        if not math.isfinite(timeout) or timeout < 0:
            raise ApiError(
                400,
                "request_timeout must be non-negative",
                param="request_timeout",
                code="invalid_value",
            )
        deadline = now + timeout if deadline is None else min(deadline, now + timeout)
    if deadline is not None and not math.isfinite(deadline):
        raise ApiError(
            400, "deadline must be a finite Unix time", param="deadline", code="invalid_value"
        )

    max_cost = _controlled(headers, "X-Max-Cost", body.max_cost, _number)
    keep = _controlled(headers, "X-Keep-Alive-On-Disconnect", body.keep_alive_on_disconnect, _flag)
    trace = parse_traceparent(headers.get(TRACEPARENT))

    metadata = dict(body.metadata or {})
    if len(metadata) > MAX_METADATA:
        raise ApiError(
            400,
            f"at most {MAX_METADATA} metadata entries (the gateway adds user and the "
            "body's fingerprint to a request's 64)",
            param="metadata",
            code="object_above_max_size",
        )
    size = sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())
    if size > MAX_METADATA_BYTES:
        raise ApiError(
            400,
            f"metadata: {size} bytes of keys and values, over the {MAX_METADATA_BYTES} a "
            "request may carry",
            code="out_of_range",
            param="metadata",
        )
    reserved = sorted(name for name in metadata if name.startswith("rq_"))
    if reserved:
        raise ApiError(
            400,
            f"metadata key {reserved[0]!r} is the gateway's (keys starting rq_)",
            param=f"metadata.{reserved[0]}",
            code="invalid_value",
        )
    if body.user is not None:
        # Also in params.user; an A/B split may key on metadata.user.
        metadata["user"] = body.user
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Submission(
        route=body.model,
        messages=messages,
        params=params,
        priority=level,
        deadline=deadline,
        max_cost=max_cost,
        metadata=metadata,
        stream=bool(body.stream),
        include_usage=include_usage,
        keep_alive_on_disconnect=keep,
        traceparent=None if trace is None else trace.header,
    )


# ------------------------------------------------------------------ responses


class _Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _FunctionPiece(Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str


class _ToolCallPiece(Struct, kw_only=True, omit_defaults=True):
    """One piece of ``delta.tool_calls``: ``id``, ``type`` and the name only
    on the first piece of its ``index``, as OpenAI streams them."""

    index: int
    id: str | None = None
    type: str | None = None
    function: _FunctionPiece


class _Delta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[_ToolCallPiece] | None = None


class _Logprobs(Struct, kw_only=True):
    """``choices[0].logprobs``: the wire's token log probabilities are OpenAI's shape."""

    content: list[TokenLogprob]
    refusal: None = None


class _ChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: _Delta
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None


class _PlainChunk(Struct, kw_only=True):
    """A chunk of a stream that did not ask for usage: no ``usage`` key at all."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[_ChunkChoice]


class _Chunk(_PlainChunk, kw_only=True):
    """A chunk of a stream that asked for usage: ``usage`` always there (``null`` but last)."""

    usage: _Usage | None = None


class _Function(Struct, kw_only=True):
    name: str
    arguments: str


class _ToolCall(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: _Function


class _Message(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None


class _ToolMessage(_Message, kw_only=True):
    """An answer with tool calls (a plain answer has no ``tool_calls`` key, as OpenAI's)."""

    tool_calls: list[_ToolCall]


class _Choice(Struct, kw_only=True):
    index: int = 0
    message: _Message
    logprobs: _Logprobs | None = None
    finish_reason: str


class _Completion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[_Choice]
    usage: _Usage


_ENCODER: Final = msgspec.json.Encoder()
_FINISH: Final = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


def finish_reason(reason: str | None, *, tool_calls: bool = False) -> str:
    """A backend's finish reason as OpenAI names them (``stop`` when unknown;
    ``tool_calls`` for an answer that called tools and stopped)."""
    if tool_calls and reason in (None, "stop"):
        return "tool_calls"
    return reason if reason is not None and reason in _FINISH else "stop"


def usage(prompt: int, completion: int) -> _Usage:
    return _Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def call_id(request_id: str, index: int, given: str) -> str:
    """A tool call's id: the backend's, else one made from the request and the
    call's place (some providers give none; a ``tool`` message must name it),
    the same whenever the answer is read again."""
    return given or f"call_{request_id}_{index}"


class ToolCallPieces:
    """A stream's ``delta.tool_calls`` in OpenAI's shape: the first piece of
    each call carries its ``id``, ``type`` and name, later pieces only
    ``arguments``. Remembers which calls have begun (a resumed stream notes
    the pieces it skips)."""

    __slots__ = ("_begun", "_request_id")

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._begun: set[int] = set()

    def seen(self, deltas: Sequence[ToolCallDelta]) -> None:
        self._begun.update(delta.index for delta in deltas)

    def restart(self) -> None:
        """A new run: its calls begin anew."""
        self._begun.clear()

    def pieces(self, deltas: Sequence[ToolCallDelta]) -> list[_ToolCallPiece]:
        out = []
        for delta in deltas:
            if delta.index in self._begun:
                out.append(
                    _ToolCallPiece(
                        index=delta.index, function=_FunctionPiece(arguments=delta.arguments)
                    )
                )
                continue
            self._begun.add(delta.index)
            out.append(
                _ToolCallPiece(
                    index=delta.index,
                    id=call_id(self._request_id, delta.index, delta.id),
                    type="function",
                    function=_FunctionPiece(name=delta.name, arguments=delta.arguments),
                )
            )
        return out


def chunk_bytes(
    request_id: str,
    model: str,
    created: int,
    *,
    role: str | None = None,
    content: str | None = None,
    tool_calls: list[_ToolCallPiece] | None = None,
    logprobs: Sequence[TokenLogprob] = (),
    finish: str | None = None,
    with_usage: bool = False,
    final_usage: _Usage | None = None,
) -> bytes:
    """One ``chat.completion.chunk`` as JSON. ``with_usage``: the stream asked for
    usage (``stream_options.include_usage``): every chunk has ``"usage": null``,
    and the last, with ``final_usage`` and no choices, carries the counts.
    ``tool_calls``: pieces from :class:`ToolCallPieces`."""
    if final_usage is not None:
        return _ENCODER.encode(
            _Chunk(id=request_id, created=created, model=model, choices=[], usage=final_usage)
        )
    choice = _ChunkChoice(
        delta=_Delta(role=role, content=content, tool_calls=tool_calls or None),
        logprobs=_Logprobs(content=list(logprobs)) if logprobs else None,
        finish_reason=finish,
    )
    if with_usage:
        return _ENCODER.encode(
            _Chunk(id=request_id, created=created, model=model, choices=[choice])
        )
    return _ENCODER.encode(
        _PlainChunk(id=request_id, created=created, model=model, choices=[choice])
    )


class Answer(Protocol):
    """What a whole answer is read from: a :class:`~renqueue.Result` or a
    ``completed`` event."""

    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def usage(self) -> Usage: ...
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]: ...
    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]: ...


def answer_bytes(request_id: str, model: str, created: int, answer: Answer) -> bytes:
    """:func:`completion_bytes` of a result or a ``completed`` event."""
    return completion_bytes(
        request_id,
        model,
        created,
        text=answer.text,
        finish=answer.finish_reason,
        prompt_tokens=answer.usage.prompt_tokens,
        completion_tokens=answer.usage.completion_tokens,
        tool_calls=answer.tool_calls,
        logprobs=answer.logprobs,
    )


def completion_bytes(
    request_id: str,
    model: str,
    created: int,
    *,
    text: str,
    finish: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    tool_calls: Sequence[ToolCall] = (),
    logprobs: Sequence[TokenLogprob] = (),
) -> bytes:
    """A whole ``chat.completion`` as JSON (``content`` null for an answer of
    tool calls alone, as OpenAI's)."""
    message: _Message
    if tool_calls:
        calls = [
            _ToolCall(
                id=call_id(request_id, index, call.id),
                function=_Function(name=call.name, arguments=call.arguments),
            )
            for index, call in enumerate(tool_calls)
        ]
        message = _ToolMessage(content=text or None, tool_calls=calls)
    else:
        message = _Message(content=text)
    choice = _Choice(
        message=message,
        logprobs=_Logprobs(content=list(logprobs)) if logprobs else None,
        finish_reason=finish_reason(finish, tool_calls=bool(tool_calls)),
    )
    return _ENCODER.encode(
        _Completion(
            id=request_id,
            created=created,
            model=model,
            choices=[choice],
            usage=usage(prompt_tokens, completion_tokens),
        )
    )


def model_list(routes: Sequence[str], created: int) -> bytes:
    """``GET /v1/models``: each route as an OpenAI model object."""
    return _ENCODER.encode(
        {"object": "list", "data": [model_object(route, created) for route in routes]}
    )


def model_object(route: str, created: int) -> dict[str, Any]:
    return {"id": route, "object": "model", "created": created, "owned_by": "renqueue"}
