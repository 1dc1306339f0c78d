"""The OpenAI chat-completions API, translated to and from Ren-Queue's wire.

The one place where a chat-completions body becomes a submission and a
request's outcome becomes a ``chat.completion`` (or its
``chat.completion.chunk`` stream). All of it is pure: bytes and headers in,
values or bytes out, so every rule here is unit-tested without a server.

What the wire carries today (``renqueue.wire.ChatMessage``,
``GenerationParams``): messages with a role and string content; ``max_tokens``
(or ``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``,
``seed``. A body that asks for more (tools, image parts, ``response_format``,
penalties, logprobs, ...) is answered 400 naming the field, never silently
stripped: the answer would not be what was asked for. Fields sent at their
neutral value (``n: 1``, ``presence_penalty: 0``, ``tool_choice: "none"``,
``response_format: {"type": "text"}``, ...) ask for nothing and are accepted.
Unknown fields are refused too (``forbid_unknown_fields``). To widen the
format, add the field to :class:`ChatBody` and carry it in :func:`translate`.

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
==============================  ============================  ==========================

An integer priority is vLLM's: lower runs sooner and 0 is the default. It
counts levels from ``default_priority``: 0 is that level, -1 the next more
urgent one, 1 the next less urgent one, and so on, clamped to the levels there
are (with the default levels: -2 ``critical``, -1 ``high``, 0 ``normal``, 1
``low``, 2 and more ``batch``). A level name is taken as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import msgspec
from msgspec import Raw, Struct

from ._errors import ApiError

__all__ = [
    "ChatBody",
    "Submission",
    "chunk_bytes",
    "completion_bytes",
    "parse_chat",
    "translate",
]

_T = TypeVar("_T")

_NULL: Final = Raw(b"null")
_ABSENT: Final = Raw()


class _Strict(Struct, kw_only=True, forbid_unknown_fields=True):
    """Unknown fields are errors: a field we do not carry is never dropped silently."""


class ContentPart(_Strict, kw_only=True):
    type: str
    text: str | None = None
    image_url: Raw = _ABSENT
    input_audio: Raw = _ABSENT
    file: Raw = _ABSENT
    refusal: Raw = _ABSENT
    cache_control: Raw = _ABSENT


class BodyMessage(_Strict, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Raw = _ABSENT
    tool_call_id: str | None = None
    function_call: Raw = _ABSENT
    refusal: str | None = None
    audio: Raw = _ABSENT


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatBody(_Strict, kw_only=True):
    """A ``POST /v1/chat/completions`` body, as far as the gateway reads it."""

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
    n: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Not carried yet: accepted at their neutral value only.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Raw = _ABSENT
    tool_choice: Raw = _ABSENT
    parallel_tool_calls: bool | None = None
    functions: Raw = _ABSENT
    function_call: Raw = _ABSENT
    response_format: Raw = _ABSENT
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


_DECODER: Final = msgspec.json.Decoder(ChatBody)

#: Raw fields and the values that ask for nothing (JSON, as sent, spaces removed).
_NEUTRAL: Final[dict[str, frozenset[bytes]]] = {
    "tools": frozenset({b"[]"}),
    "tool_choice": frozenset({b'"none"', b'"auto"'}),
    "functions": frozenset({b"[]"}),
    "function_call": frozenset({b'"none"', b'"auto"'}),
    "response_format": frozenset({b'{"type":"text"}'}),
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
}
MAX_STOP: Final = 16
#: The headers Ren-Queue's controls come from (read case-insensitively).
_CONTROLS: Final = frozenset(
    {"x-priority", "x-deadline", "x-request-timeout", "x-max-cost", "x-keep-alive-on-disconnect"}
)


class Submission(Struct, frozen=True, kw_only=True):
    """What a chat-completions call asks Ren-Queue for (before a request id exists)."""

    route: str
    messages: list[dict[str, str]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    priority: str
    deadline: float | None = None
    max_cost: float | None = None
    metadata: dict[str, str] = {}
    stream: bool = False
    include_usage: bool = False
    #: ``None``: the gateway's default (keep it if it has an idempotency key).
    keep_alive_on_disconnect: bool | None = None


def parse_chat(body: bytes) -> ChatBody:
    """Decode a body; :class:`ApiError` 400 naming the field for anything malformed."""
    try:
        return _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None


def _invalid(exc: msgspec.ValidationError) -> ApiError:
    text = str(exc)
    message, sep, where = text.partition(" - at `$")
    param = where.rstrip("`").lstrip(".") if sep else None
    if message.startswith("Object contains unknown field"):
        field = message.split("`")[1] if "`" in message else "?"
        param = f"{param}.{field}" if param else field
        message = f"unsupported parameter: {param}"
    else:
        message = f"{message} (at {param})" if param else message
    return ApiError(400, message, param=param or None)


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(
        400,
        f"{what} is not supported by this gateway yet ({param})",
        param=param,
        code="unsupported_parameter",
    )


def _check_neutral(body: ChatBody) -> None:
    for field, allowed in _NEUTRAL.items():
        raw: Raw = getattr(body, field)
        value = bytes(raw)
        if not value or value == b"null":
            continue
        compact = msgspec.json.encode(msgspec.json.decode(value))
        if compact not in allowed:
            raise _unsupported(field, f"{field!r}")
    plain: tuple[tuple[str, Any, Any], ...] = (
        ("n", body.n, 1),
        ("presence_penalty", body.presence_penalty, 0),
        ("frequency_penalty", body.frequency_penalty, 0),
        ("logprobs", body.logprobs, False),
        ("top_logprobs", body.top_logprobs, 0),
        ("store", body.store, False),
    )
    for field, value, neutral in plain:
        if value is not None and value != neutral:
            raise _unsupported(field, f"{field}={value!r}")


def _messages(body: ChatBody) -> list[dict[str, str]]:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    out: list[dict[str, str]] = []
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        role = _ROLES.get(message.role)
        if role is None:
            what = "tool results" if message.role == "tool" else f"role {message.role!r}"
            raise _unsupported(f"{where}.role", what)
        for field in ("tool_calls", "function_call", "audio"):
            value = bytes(getattr(message, field))
            if value and value != b"null":
                raise _unsupported(f"{where}.{field}", field)
        if message.name is not None:
            raise _unsupported(f"{where}.name", "message names")
        if message.tool_call_id is not None:
            raise _unsupported(f"{where}.tool_call_id", "tool results")
        if message.refusal is not None:
            raise _unsupported(f"{where}.refusal", "refusals")
        out.append({"role": role, "content": _content(message.content, where)})
    return out


def _content(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None:
        raise ApiError(400, f"{where}.content is required", param=f"{where}.content")
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if part.type != "text":
            raise _unsupported(f"{at}.type", f"content parts of type {part.type!r}")
        if part.text is None:
            raise ApiError(400, f"{at}.text is required", param=f"{at}.text")
        if bytes(part.cache_control):
            raise _unsupported(f"{at}.cache_control", "cache_control")
        texts.append(part.text)
    # Text parts are joined by newlines, as vLLM's chat templates join them.
    return "\n".join(texts)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return None if value is None else value.strip()


def _number(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ApiError(400, f"{name} must be a non-negative number, got {text[:40]!r}", param=name)
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
    raise ApiError(400, f"{name} must be true or false, got {text[:40]!r}", param=name)


def _controlled(
    headers: Mapping[str, str], header: str, value: _T, read: Callable[[str, str], _T]
) -> _T:
    """The body's ``value`` of a control, unless ``header`` gives one (headers win),
    read by ``read`` (which names the header in its error)."""
    text = _header(headers, header.lower())
    return value if text is None else read(text, header)


def translate(
    body: ChatBody,
    headers: Mapping[str, str],
    *,
    levels: Sequence[str],
    default_level: str,
    now: float,
) -> Submission:
    """What ``body`` (with Ren-Queue's ``headers``) asks for; ApiError 400 if it
    asks for what the wire cannot carry."""
    headers = {k.lower(): v for k, v in headers.items() if k.lower() in _CONTROLS}
    _check_neutral(body)
    messages = _messages(body)
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise ApiError(
            400,
            "max_tokens and max_completion_tokens disagree; give one",
            param="max_completion_tokens",
        )
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if stop is not None and len(stop) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop sequences", param="stop")

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
            raise ApiError(400, "request_timeout must be non-negative", param="request_timeout")
        deadline = now + timeout if deadline is None else min(deadline, now + timeout)
    if deadline is not None and not math.isfinite(deadline):
        raise ApiError(400, "deadline must be a finite Unix time", param="deadline")

    max_cost = _controlled(headers, "X-Max-Cost", body.max_cost, _number)
    keep = _controlled(headers, "X-Keep-Alive-On-Disconnect", body.keep_alive_on_disconnect, _flag)

    metadata = dict(body.metadata or {})
    if body.user is not None:
        metadata["user"] = body.user
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Submission(
        route=body.model,
        messages=messages,
        max_tokens=body.max_completion_tokens if body.max_tokens is None else body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=stop,
        seed=body.seed,
        priority=level,
        deadline=deadline,
        max_cost=max_cost,
        metadata=metadata,
        stream=bool(body.stream),
        include_usage=include_usage,
        keep_alive_on_disconnect=keep,
    )


# ------------------------------------------------------------------ responses


class _Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Delta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class _ChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: _Delta
    logprobs: None = None
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


class _Message(Struct, kw_only=True):
    role: str = "assistant"
    content: str
    refusal: None = None


class _Choice(Struct, kw_only=True):
    index: int = 0
    message: _Message
    logprobs: None = None
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


def finish_reason(reason: str | None) -> str:
    """A backend's finish reason as OpenAI names them (``stop`` when unknown)."""
    return reason if reason is not None and reason in _FINISH else "stop"


def usage(prompt: int, completion: int) -> _Usage:
    return _Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def chunk_bytes(
    request_id: str,
    model: str,
    created: int,
    *,
    role: str | None = None,
    content: str | None = None,
    finish: str | None = None,
    with_usage: bool = False,
    final_usage: _Usage | None = None,
) -> bytes:
    """One ``chat.completion.chunk`` as JSON. ``with_usage``: the stream asked for
    usage (``stream_options.include_usage``): every chunk has ``"usage": null``,
    and the last, with ``final_usage`` and no choices, carries the counts."""
    if final_usage is not None:
        return _ENCODER.encode(
            _Chunk(id=request_id, created=created, model=model, choices=[], usage=final_usage)
        )
    choice = _ChunkChoice(delta=_Delta(role=role, content=content), finish_reason=finish)
    if with_usage:
        return _ENCODER.encode(
            _Chunk(id=request_id, created=created, model=model, choices=[choice])
        )
    return _ENCODER.encode(
        _PlainChunk(id=request_id, created=created, model=model, choices=[choice])
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
) -> bytes:
    """A whole ``chat.completion`` as JSON."""
    return _ENCODER.encode(
        _Completion(
            id=request_id,
            created=created,
            model=model,
            choices=[_Choice(message=_Message(content=text), finish_reason=finish_reason(finish))],
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
