"""OpenAI's chat completions, ``POST /v1/chat/completions``.

The request's tools, tool calls, tool results, images and response formats
are checked as OpenAI checks them (a wrong shape is its 400), and the answer
is a tool call when the request asks for one (:func:`~.base.tool_to_call`):
its arguments are ``{"text": "tok0 tok1 ..."}``, the answer's tokens,
streamed in pieces one token each (``delta.tool_calls``). Log probabilities
come when asked (``logprobs``, ``top_logprobs``): every token ``-0.25``, its
alternatives the token itself, then ``alt1`` (``-1.5``), ``alt2``
(``-2.75``), .... Rate-limit headers and 429s are the mock's
``limit_style`` (OpenAI's by default).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
from msgspec import Meta, Struct

from .._fault_injection import ERROR_ANSWERS, context_length_body, stream_error_line
from .base import (
    Call,
    Dialect,
    ErrorKind,
    Frames,
    Reply,
    Target,
    answer_text,
    prompt_tokens_of,
    to_json,
    token_text,
    tool_arguments,
    tool_to_call,
)

__all__ = ["OpenAIDialect", "ToolIn"]


def _argument_pieces(count: int) -> list[str]:
    """:func:`tool_arguments` in pieces, one per token: the first opens the
    object, the closing ``"}`` is the dialect's to send last."""
    return [('{"text":"' if index == 0 else "") + token_text(index) for index in range(count)]


class _TextIn(Struct, tag_field="type", tag="text"):
    text: str


class _ImageURLIn(Struct, forbid_unknown_fields=True):
    url: Annotated[str, Meta(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class _ImageIn(Struct, tag_field="type", tag="image_url"):
    image_url: _ImageURLIn


class _FunctionCallIn(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    arguments: str


class _ToolCallIn(Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: _FunctionCallIn


class _OpenAIMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[_TextIn | _ImageIn] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None


class _FunctionIn(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: _FunctionIn


class _NameIn(Struct, forbid_unknown_fields=True):
    name: str


class _NamedChoiceIn(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: _NameIn


class _JsonSchemaIn(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class _ResponseFormatIn(Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaIn | None = None


class _StreamOptions(Struct):
    include_usage: bool = False


class _ChatBody(Struct):
    model: str
    messages: Annotated[list[_OpenAIMessage], Meta(min_length=1)]
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: _ResponseFormatIn | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None


_CHAT_DECODER: Final = msgspec.json.Decoder(_ChatBody)


def _openai_checked(body: _ChatBody) -> None:
    """What OpenAI refuses that its schema alone does not say (a 400 each)."""
    if body.tool_choice is not None and not body.tools:
        raise msgspec.ValidationError("tool_choice is only allowed when tools are specified")
    if body.top_logprobs is not None and not body.logprobs:
        raise msgspec.ValidationError("logprobs must be true when top_logprobs is given")
    format_ = body.response_format
    if format_ is not None and (format_.type == "json_schema") != (format_.json_schema is not None):
        raise msgspec.ValidationError("response_format.json_schema goes with type json_schema")
    names = {tool.function.name for tool in body.tools or ()}
    choice = body.tool_choice
    if isinstance(choice, _NamedChoiceIn) and choice.function.name not in names:
        raise msgspec.ValidationError(f"tool_choice names no tool: {choice.function.name}")
    for message in body.messages:
        if message.tool_calls and message.role != "assistant":
            raise msgspec.ValidationError("only assistant messages carry tool_calls")
        if message.role == "tool" and not message.tool_call_id:
            raise msgspec.ValidationError("a tool message needs its tool_call_id")


def _openai_text(content: str | list[_TextIn | _ImageIn] | None) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content or () if isinstance(part, _TextIn))


class OpenAIDialect(Dialect):
    """``/v1/chat/completions``: chunks with ``choices[].delta``, a usage chunk, ``[DONE]``.

    A tool call streams as OpenAI streams one: a first piece with the call's
    ``id``, ``type`` and ``function.name`` (arguments empty), then pieces
    of ``function.arguments`` alone, by ``index``, then finish reason
    ``tool_calls``.
    """

    name = "openai"
    id_prefix = "chatcmpl-mock-"
    error_names: ClassVar[Mapping[str, str]] = {
        "bad_request": "invalid_request_error",
        "auth": "invalid_request_error",
        "not_found": "invalid_request_error",
        "server_error": "server_error",
    }
    _codes: ClassVar[Mapping[str, str]] = {
        "auth": "invalid_api_key",
        "not_found": "model_not_found",
        "server_error": "injected_failure",
        "busy": "concurrency_limit_exceeded",
    }

    def __init__(self) -> None:
        super().__init__()
        self._tool_pieces: list[bytes] = []
        self._logprob_pieces: dict[int, list[bytes]] = {}

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _CHAT_DECODER.decode(raw)
        _openai_checked(body)
        choice = body.tool_choice
        users = [m for m in body.messages if m.role == "user"]
        tool = tool_to_call(
            [tool.function.name for tool in body.tools or ()],
            choice.function.name if isinstance(choice, _NamedChoiceIn) else choice,
            _openai_last_text(users[-1].content) if users else "",
        )
        return Call(
            model=body.model,
            prompt_tokens=prompt_tokens_of(sum(_openai_text(m.content) for m in body.messages)),
            stream=body.stream,
            cap=body.max_completion_tokens or body.max_tokens,
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
            tool=tool,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        )

    def piece(self, text: str, index: int) -> bytes:
        return b'{"content":"' + text.encode() + b'"},"finish_reason":null}]}\n\n'

    def pieces_for(self, reply: Reply, count: int) -> list[bytes]:
        if reply.tool is not None:
            pieces = self._tool_pieces
            for text in _argument_pieces(count)[len(pieces) :]:
                pieces.append(
                    to_json(_tool_delta(arguments=text)) + b',"finish_reason":null}]}\n\n'
                )
            return pieces
        if reply.logprobs is not None:
            pieces = self._logprob_pieces.setdefault(reply.logprobs, [])
            for index in range(len(pieces), count):
                text = token_text(index)
                pieces.append(
                    b'{"content":'
                    + to_json(text)
                    + b'},"logprobs":'
                    + to_json({"content": [_logprob(text, reply.logprobs)]})
                    + b',"finish_reason":null}]}\n\n'
                )
            return pieces
        return self.pieces(count)

    def _prefix(self, reply: Reply) -> bytes:
        return (
            b'data: {"id":"' + reply.id.encode() + b'","object":"chat.completion.chunk",'
            b'"created":' + str(int(time.time())).encode() + b',"model":' + to_json(reply.model)
        )

    def frames(self, reply: Reply) -> Frames:
        prefix = self._prefix(reply)
        choice = prefix + b',"choices":[{"index":0,"delta":'
        closing = choice + b'{},"finish_reason":"' + reply.finish_reason.encode() + b'"}]}\n\n'
        opening = choice + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
        if reply.tool is not None:
            first = _tool_delta(call_id=_call_id(reply), name=reply.tool, arguments="")
            opening = (
                choice
                + b'{"role":"assistant","content":null},"finish_reason":null}]}\n\n'
                + choice
                + to_json(first)
                + b',"finish_reason":null}]}\n\n'
            )
            # The arguments' closing piece (an empty answer: all of them).
            last = '"}' if reply.completion_tokens else tool_arguments(0)
            closing = (
                choice
                + to_json(_tool_delta(arguments=last))
                + b',"finish_reason":null}]}\n\n'
                + closing
            )
        if reply.include_usage:
            closing += prefix + b',"choices":[],"usage":' + to_json(_openai_usage(reply)) + b"}\n\n"
        return Frames(
            head=choice,
            tail=b"",
            opening=opening,
            closing=closing,
            done=b"data: [DONE]\n\n",
        )

    def answer(self, reply: Reply) -> bytes:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": answer_text(reply.completion_tokens),
        }
        if reply.tool is not None:
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": _call_id(reply),
                    "type": "function",
                    "function": {
                        "name": reply.tool,
                        "arguments": tool_arguments(reply.completion_tokens),
                    },
                }
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": reply.finish_reason,
        }
        if reply.logprobs is not None and reply.tool is None:
            choice["logprobs"] = {
                "content": [
                    _logprob(token_text(index), reply.logprobs)
                    for index in range(reply.completion_tokens)
                ]
            }
        return to_json(
            {
                "id": reply.id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": reply.model,
                "choices": [choice],
                "usage": _openai_usage(reply),
            }
        )

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        type_ = self.error_names.get(kind) or ("requests" if status == 429 else "server_error")
        return to_json(
            {"error": {"message": message, "type": type_, "code": self._codes.get(kind)}}
        )

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "context_length":
            return 400, context_length_body(window, prompt_tokens)
        return ERROR_ANSWERS[kind]

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        return stream_error_line(reply.openrouter, self._prefix(reply))

    def not_found(self, model: str) -> tuple[int, bytes]:
        message = f"The model `{model}` does not exist or you do not have access to it."
        return 404, self.error(404, "not_found", message)


def _openai_last_text(content: str | list[_TextIn | _ImageIn] | None) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content or () if isinstance(part, _TextIn))


def _call_id(reply: Reply) -> str:
    return "call_" + reply.id.rpartition("-")[2]


def _tool_delta(*, call_id: str = "", name: str = "", arguments: str) -> dict[str, Any]:
    """A ``delta`` with one piece of tool call 0: the first (id, type, name) or a later one."""
    function: dict[str, str] = {"arguments": arguments}
    call: dict[str, Any] = {"index": 0, "function": function}
    if call_id:
        call.update(id=call_id, type="function")
        function["name"] = name
    return {"tool_calls": [call]}


def _logprob(token: str, top: int) -> dict[str, Any]:
    """A token's log probability as OpenAI writes it, with ``top`` alternatives."""
    encoded = list(token.encode())
    return {
        "token": token,
        "logprob": -0.25,
        "bytes": encoded,
        "top_logprobs": [
            {
                "token": token if rank == 0 else f"alt{rank}",
                "logprob": -0.25 - 1.25 * rank,
                "bytes": encoded if rank == 0 else list(f"alt{rank}".encode()),
            }
            for rank in range(top)
        ],
    }


def _openai_usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }
