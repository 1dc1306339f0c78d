"""The wire formats the mock backend speaks: one :class:`Dialect` per provider API.

One mock serves them all, each at the path its provider uses (the URL an
adapter's ``base_url`` is: :meth:`MockBackend.url_for
<renqueue.mock.MockBackend.url_for>`):

==============  ================================================  ==================
dialect         endpoint                                          ``adapter``
==============  ================================================  ==================
``openai``      ``POST /v1/chat/completions``                     ``openai``
``anthropic``   ``POST /v1/messages``                             ``anthropic``
``ollama``      ``POST /api/chat``                                ``ollama``
``tgi``         ``POST /generate_stream``, ``POST /generate``     ``tgi``
``gemini``      ``POST /v1beta/models/<m>:streamGenerateContent``  ``gemini``
                (``?alt=sse`` only), ``:generateContent``
==============  ================================================  ==================

A dialect reads its request body into a :class:`Call` (model, prompt size,
streamed or not, the output cap) and writes every answer the mock gives in
its provider's form, written from the providers' documentation and recorded
streams (the adapters' tests hold the recordings, so a round trip checks
one against the other):

- a stream: an ``opening``, one piece per token (``head + piece + tail``:
  the piece is precomputed per token, the head and tail per request), a
  ``closing`` (finish reason, usage) and its end marker (``done``);
- a whole answer, and error bodies by kind (:data:`ErrorKind`), including
  each fault's (``500``, ``503``, ``529``, ``context_length``,
  ``content_filter``) and an in-band error mid-stream (``sse_error``);
- its finish reasons, and the header its key travels in.

Rate-limit headers and 429 bodies are :mod:`._mocklimits`': Anthropic's and
Gemini's dialects use their provider's; OpenAI's, Ollama's and TGI's the
mock's ``limit_style`` (Ollama and TGI send none of their own).

Simplifications, each harmless to what the adapters read: Ollama's
durations are fixed numbers; TGI's last event always carries an
end-of-sequence token (``special: true``), and ``generated_tokens`` does not
count it; Gemini streams only as ``alt=sse`` (not as a JSON array).

Tools: OpenAI's and Ollama's dialects check the tools, tool calls, tool
results, images and response formats a request sends, and answer with a
tool call when the request asks for one (:func:`tool_to_call`): its
arguments are ``{"text": "tok0 tok1 ..."}``, the answer's tokens, streamed
in pieces one token each (OpenAI's ``delta.tool_calls``; Ollama sends the
call whole after the text). OpenAI's returns log probabilities when asked
(``logprobs``, ``top_logprobs``): every token ``-0.25``, its alternatives
the token itself, then ``alt1`` (``-1.5``), ``alt2`` (``-2.75``), ....

Tool calls (Anthropic's and Gemini's dialects): a request is checked as its
provider checks it (roles, tool results against the calls they answer,
base64, schemas; a refusal is the provider's 400, its message prefixed
``invalid request body:``), and the answer calls a tool after its text when
the request offers tools and forces one (Anthropic ``tool_choice`` ``any``
or ``tool``, Gemini mode ``ANY``) or its last user message says ``call
<tool name>`` (never when the choice is none): :func:`tool_to_call`, with the
arguments :data:`MOCK_TOOL_ARGUMENTS`. Gemini's calls carry no id, as the
Gemini API's do not.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, ClassVar, Final, Literal, NamedTuple
from urllib.parse import unquote

import msgspec
from msgspec import Meta, Struct

from ._fault_injection import ERROR_ANSWERS, context_length_body, stream_error_line
from ._rate_limits import MockLimitStyle

__all__ = [
    "DIALECTS",
    "Call",
    "Dialect",
    "ErrorKind",
    "Frames",
    "GeminiDialect",
    "Reply",
    "Target",
    "answer_text",
    "token_text",
    "tool_arguments",
    "tool_to_call",
]

_ENCODER: Final = msgspec.json.Encoder()

#: What an error body says went wrong (each dialect names it its provider's way).
ErrorKind = Literal["bad_request", "auth", "not_found", "server_error", "busy"]


# ------------------------------------------------------------ generated text
# Token i is "tok<i>", separated by spaces: no JSON escaping, so every piece
# is precomputed per token, once per process.

_TOKENS: list[str] = []


def _ensure_tokens(count: int) -> None:
    for index in range(len(_TOKENS), count):
        _TOKENS.append(f"tok{index}" if index == 0 else f" tok{index}")


_ensure_tokens(4096)


def token_text(index: int) -> str:
    _ensure_tokens(index + 1)
    return _TOKENS[index]


def answer_text(count: int) -> str:
    """The first ``count`` tokens' text: ``"tok0 tok1 ..."``."""
    _ensure_tokens(count)
    return "".join(_TOKENS[:count])


def _json(value: Any) -> bytes:
    return _ENCODER.encode(value)


def _prompt_tokens(chars: int) -> int:
    return -(-chars // 4)


def _chat_tokens(
    messages: Iterable[_InMessage] | Iterable[_AnthropicMessage], system: object = None
) -> int:
    """A chat's prompt tokens: its messages' text and its ``system`` (Anthropic's), / 4."""
    return _prompt_tokens(_text_chars(system) + sum(_text_chars(m.content) for m in messages))


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


# ------------------------------------------------------------ common shapes


class Call(Struct, frozen=True, kw_only=True):
    """A chat request as the mock needs it, whatever its format."""

    model: str
    prompt_tokens: int
    stream: bool
    #: The most output tokens the request allows (``max_tokens`` and kin).
    cap: int | None = None
    #: Usage in the stream (OpenAI's ``stream_options.include_usage``; others always).
    include_usage: bool = True
    #: The tool the answer calls (:func:`tool_to_call`); ``None``: it answers in text.
    tool: str | None = None
    #: Log probabilities asked for: the number of likeliest alternatives per
    #: token (OpenAI's ``top_logprobs``); ``None``: not asked.
    logprobs: int | None = None


class Reply(Struct, frozen=True, kw_only=True):
    """What one answer says: the facts every format writes its own way."""

    id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    #: ``stop``, ``length`` or ``content_filter`` (each dialect names its own).
    finish_reason: str
    include_usage: bool = True
    #: OpenAI's dialect: mid-stream errors in OpenRouter's form.
    openrouter: bool = False
    #: As in :class:`Call`: the tool called (with ``finish_reason``
    #: ``tool_calls``), and the alternatives per token of log probabilities.
    tool: str | None = None
    logprobs: int | None = None


class Frames(NamedTuple):
    """The bytes of one stream around its token pieces."""

    head: bytes
    tail: bytes
    opening: bytes
    closing: bytes
    done: bytes


class Target(NamedTuple):
    """What the path says: the model (Gemini's path names it) and whether it streams."""

    model: str | None = None
    stream: bool | None = None


class Dialect:
    """One provider's wire format (module docstring). Stateless but for its piece cache."""

    name: ClassVar[str]
    #: The content type of a stream.
    content_type: ClassVar[str] = "text/event-stream"
    #: What ends a line of the stream (an event, for SSE).
    terminator: ClassVar[bytes] = b"\n\n"
    #: The rate-limit dialect of its headers and 429s; ``None``: the mock's ``limit_style``.
    limit_style: ClassVar[MockLimitStyle | None] = None
    #: The header the key travels in (``authorization`` means ``Bearer <key>``).
    key_header: ClassVar[str] = "authorization"
    #: The status of a request with a wrong key.
    auth_status: ClassVar[int] = 401
    #: Whether a request names the model (TGI serves one, whatever is asked).
    names_model: ClassVar[bool] = True
    #: The prefix of answer ids.
    id_prefix: ClassVar[str] = "mock-"
    #: Its finish reasons for ``stop``, ``length`` and ``content_filter``.
    finish_names: ClassVar[Mapping[str, str]] = {}
    #: Its error names for each :data:`ErrorKind`.
    error_names: ClassVar[Mapping[str, str]] = {}

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    def decode(self, raw: bytes, target: Target) -> Call:
        """The request; ``msgspec.DecodeError`` if it is not this format's."""
        raise NotImplementedError

    def key(self, headers: Mapping[str, str]) -> str:
        """The key the request sent."""
        value = headers.get(self.key_header, "")
        return value.removeprefix("Bearer ") if self.key_header == "authorization" else value

    def pieces(self, count: int) -> list[bytes]:
        """The token pieces, at least ``count`` of them (a shared cache: do not change it)."""
        for index in range(len(self._pieces), count):
            self._pieces.append(self.piece(token_text(index), index))
        return self._pieces

    def piece(self, text: str, index: int) -> bytes:
        """One token's bytes between the stream's head and tail."""
        raise NotImplementedError

    def pieces_for(self, reply: Reply, count: int) -> list[bytes]:
        """The token pieces of ``reply``: :meth:`pieces`, unless the dialect
        streams a tool call's arguments or log probabilities its own way."""
        return self.pieces(count)

    def cut(self, piece: bytes, text: str) -> bytes:
        """``piece`` cut right after its token's text: not JSON any more."""
        encoded = text.encode()
        end = piece.index(encoded) + len(encoded) + 1
        return piece[:end] + self.terminator

    def frames(self, reply: Reply) -> Frames:
        raise NotImplementedError

    def answer(self, reply: Reply) -> bytes:
        """A whole (non-streamed) answer's body."""
        raise NotImplementedError

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        """An error body."""
        raise NotImplementedError

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        """Status and body of an error fault: ``500``, ``503``, ``529``,
        ``context_length`` (a prompt over ``window``) or ``content_filter``
        (the prompt refused; a 200 where the provider refuses in a 200)."""
        if kind == "503":
            return 503, self.error(503, "busy", "")  # the provider's own busy answer
        if kind in ("529", "content_filter"):
            # Anthropic's overload status; Azure's prompt filter (the formats
            # with a filter of their own override this).
            return ERROR_ANSWERS[kind]
        raise NotImplementedError

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        """An error sent in-band, mid-stream."""
        raise NotImplementedError

    def not_found(self, model: str) -> tuple[int, bytes]:
        """Status and body for a model it does not serve."""
        raise NotImplementedError

    def finish(self, reason: str) -> str:
        return self.finish_names.get(reason, reason)


# ------------------------------------------------------------------ OpenAI


class _InMessage(Struct):
    role: str
    content: str | list[Any] | None = None


def tool_to_call(tools: list[str], choice: object, last_user: str) -> str | None:
    """The tool a mock answer calls, of the request's ``tools`` (their names):
    the one ``choice`` (its ``tool_choice``) names; the first when it is
    ``required``; else one the last user message asks for by ``call <name>``;
    else none (and none when ``choice`` is ``none``)."""
    if not tools or choice == "none":
        return None
    if isinstance(choice, str) and choice in tools:  # a named tool, already unwrapped
        return choice
    if choice == "required":
        return tools[0]
    return next((name for name in tools if f"call {name}" in last_user), None)


def tool_arguments(count: int) -> str:
    """A mock tool call's arguments: the answer's ``count`` tokens, as JSON text."""
    return _json({"text": answer_text(count)}).decode()


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


class _ToolIn(Struct, forbid_unknown_fields=True):
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
    tools: list[_ToolIn] | None = None
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
            prompt_tokens=_prompt_tokens(sum(_openai_text(m.content) for m in body.messages)),
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
                pieces.append(_json(_tool_delta(arguments=text)) + b',"finish_reason":null}]}\n\n')
            return pieces
        if reply.logprobs is not None:
            pieces = self._logprob_pieces.setdefault(reply.logprobs, [])
            for index in range(len(pieces), count):
                text = token_text(index)
                pieces.append(
                    b'{"content":'
                    + _json(text)
                    + b'},"logprobs":'
                    + _json({"content": [_logprob(text, reply.logprobs)]})
                    + b',"finish_reason":null}]}\n\n'
                )
            return pieces
        return self.pieces(count)

    def _prefix(self, reply: Reply) -> bytes:
        return (
            b'data: {"id":"' + reply.id.encode() + b'","object":"chat.completion.chunk",'
            b'"created":' + str(int(time.time())).encode() + b',"model":' + _json(reply.model)
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
                + _json(first)
                + b',"finish_reason":null}]}\n\n'
            )
            # The arguments' closing piece (an empty answer: all of them).
            last = '"}' if reply.completion_tokens else tool_arguments(0)
            closing = (
                choice
                + _json(_tool_delta(arguments=last))
                + b',"finish_reason":null}]}\n\n'
                + closing
            )
        if reply.include_usage:
            closing += prefix + b',"choices":[],"usage":' + _json(_openai_usage(reply)) + b"}\n\n"
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
        return _json(
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
        return _json({"error": {"message": message, "type": type_, "code": self._codes.get(kind)}})

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


# --------------------------------------------------------------- Anthropic


#: The arguments of every tool call the mock makes.
MOCK_TOOL_ARGUMENTS: Final = {"query": "mock"}


def _base64_ok(data: str) -> bool:
    try:
        return bool(binascii.a2b_base64(data, strict_mode=True))
    except binascii.Error:
        return False


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
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
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
        and not _base64_ok(block.source.data)
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
            prompt_tokens=_prompt_tokens(_anthropic_chars(body)),
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
            + _json(start)
            + b"\n\nevent: content_block_start\ndata: "
            b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
            b'\n\nevent: ping\ndata: {"type": "ping"}\n\n',
            closing=b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
            + self._tool_events(reply)
            + b"event: message_delta\ndata: "
            + _json(delta)
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
        arguments = _json(MOCK_TOOL_ARGUMENTS).decode()
        half = len(arguments) // 2
        events = [b"event: content_block_start\ndata: " + _json(start)]
        for piece in (arguments[:half], arguments[half:]):
            delta = {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": piece},
            }
            events.append(b"event: content_block_delta\ndata: " + _json(delta))
        events.append(b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}')
        return b"\n\n".join(events) + b"\n\n"

    def answer(self, reply: Reply) -> bytes:
        return _json(
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
        return _json({"type": "error", "error": {"type": type_, "message": message}})

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


# ------------------------------------------------------------------ Ollama


class _OllamaOptions(Struct):
    num_predict: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None


class _OllamaFunctionIn(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1)]
    #: An object, not JSON text (unlike OpenAI's).
    arguments: dict[str, Any]


class _OllamaToolCallIn(Struct, forbid_unknown_fields=True):
    function: _OllamaFunctionIn


class _OllamaMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    #: Base64 image bytes (no URLs, no data: prefix).
    images: list[str] | None = None
    tool_calls: list[_OllamaToolCallIn] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _OllamaBody(Struct):
    model: str
    messages: Annotated[list[_OllamaMessage], Meta(min_length=1)]
    stream: bool = True  # Ollama streams unless told not to
    options: _OllamaOptions | None = None
    tools: list[_ToolIn] | None = None
    #: ``"json"`` or a JSON schema.
    format: Literal["json"] | dict[str, Any] | None = None


_OLLAMA_DECODER: Final = msgspec.json.Decoder(_OllamaBody)


def _ollama_checked(body: _OllamaBody) -> None:
    """Images must be bare base64 (Ollama reads no URLs)."""
    for message in body.messages:
        for image in message.images or ():
            try:
                base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                raise msgspec.ValidationError("an image is not base64 (no URLs here)") from None


#: The durations (ns) every answer reports.
_OLLAMA_TIMINGS: Final = {
    "total_duration": 4883583458,
    "load_duration": 1334875,
    "prompt_eval_duration": 342546000,
    "eval_duration": 4535599000,
}


class OllamaDialect(Dialect):
    """``/api/chat``: one JSON object per line, the last ``done: true`` with counts.

    As in Ollama's docs/api.md ("Chat Request (Streaming)").
    """

    name = "ollama"
    content_type = "application/x-ndjson"
    terminator = b"\n"
    finish_names: ClassVar[Mapping[str, str]] = {"content_filter": "stop", "tool_calls": "stop"}

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _OLLAMA_DECODER.decode(raw)
        _ollama_checked(body)
        predict = body.options.num_predict if body.options is not None else None
        users = [m for m in body.messages if m.role == "user"]
        return Call(
            model=body.model,
            prompt_tokens=_prompt_tokens(sum(len(m.content) for m in body.messages)),
            stream=body.stream,
            cap=predict if predict is not None and predict > 0 else None,
            # Ollama has no tool_choice: only a request for a tool calls one.
            tool=tool_to_call(
                [tool.function.name for tool in body.tools or ()],
                None,
                users[-1].content if users else "",
            ),
        )

    def piece(self, text: str, index: int) -> bytes:
        return b'"message":{"role":"assistant","content":"' + text.encode() + b'"},"done":false}\n'

    def _head(self, reply: Reply) -> bytes:
        created = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())
        return b'{"model":' + _json(reply.model) + b',"created_at":"' + created.encode() + b'",'

    def _final(self, reply: Reply, text: str) -> dict[str, Any]:
        return {
            "message": {"role": "assistant", "content": text},
            "done_reason": self.finish(reply.finish_reason),
            "done": True,
            **_OLLAMA_TIMINGS,
            "prompt_eval_count": reply.prompt_tokens,
            "eval_count": reply.completion_tokens,
        }

    def _tool_calls(self, reply: Reply) -> list[dict[str, Any]]:
        arguments = {"text": answer_text(reply.completion_tokens)}
        return [{"function": {"name": reply.tool, "arguments": arguments}}]

    def frames(self, reply: Reply) -> Frames:
        head = self._head(reply)
        final = _json(self._final(reply, ""))
        closing = head + final[1:] + b"\n"
        if reply.tool is not None:  # the call comes whole, in a line of its own, after the text
            message = {"role": "assistant", "content": "", "tool_calls": self._tool_calls(reply)}
            closing = head + _json({"message": message, "done": False})[1:] + b"\n" + closing
        return Frames(head=head, tail=b"", opening=b"", closing=closing, done=b"")

    def answer(self, reply: Reply) -> bytes:
        final = self._final(reply, answer_text(reply.completion_tokens))
        if reply.tool is not None:
            final["message"]["tool_calls"] = self._tool_calls(reply)
        return self._head(reply) + _json(final)[1:]

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        if kind == "busy" and status == 503:
            message = "server busy, please try again.  maximum pending requests exceeded"
        return _json({"error": message})

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "500":
            return 500, _json({"error": "llama runner process has terminated: exit status 2"})
        if kind == "context_length":
            return 400, _json({"error": "the input length exceeds the context length"})
        return super().fault(kind, window, prompt_tokens)

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        return (
            _json({"error": "an error was encountered while running the model: unexpected EOF"})
            + b"\n"
        )

    def not_found(self, model: str) -> tuple[int, bytes]:
        return 404, _json({"error": f'model "{model}" not found, try pulling it first'})


# --------------------------------------------------------------------- TGI


class _TGIGrammar(Struct, forbid_unknown_fields=True):
    type: Literal["json", "regex"]
    #: A JSON schema (``json``) or a regular expression (``regex``).
    value: dict[str, Any] | str


class _TGIParameters(Struct):
    max_new_tokens: Annotated[int, Meta(ge=1)] | None = None
    frequency_penalty: float | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    top_k: Annotated[int, Meta(gt=0)] | None = None
    typical_p: Annotated[float, Meta(gt=0, lt=1)] | None = None
    grammar: _TGIGrammar | None = None


class _TGIBody(Struct):
    inputs: str
    parameters: _TGIParameters | None = None
    stream: bool = False


_TGI_DECODER: Final = msgspec.json.Decoder(_TGIBody)


class TGIDialect(Dialect):
    """``/generate_stream``: ``data:{"index","token","generated_text","details"}`` events.

    As TGI's router writes them (``data:`` with no space; recorded in TGI's
    docs and users' transcripts), the last with ``details``.
    """

    name = "tgi"
    names_model = False
    finish_names: ClassVar[Mapping[str, str]] = {
        "stop": "eos_token",
        "length": "length",
        "content_filter": "eos_token",
    }
    error_names: ClassVar[Mapping[str, str]] = {
        "bad_request": "validation",
        "auth": "authentication",
        "not_found": "not_found",
        "server_error": "generation",
        "busy": "overloaded",
    }

    def decode(self, raw: bytes, target: Target) -> Call:
        body = _TGI_DECODER.decode(raw)
        return Call(
            model="tgi",
            prompt_tokens=_prompt_tokens(len(body.inputs)),
            stream=bool(target.stream),
            cap=body.parameters.max_new_tokens if body.parameters is not None else None,
        )

    def piece(self, text: str, index: int) -> bytes:
        return (
            b'{"index":%d,"token":{"id":%d,"text":"%s","logprob":-0.25,"special":false},'
            b'"generated_text":null,"details":null}\n\n' % (index + 1, index + 100, text.encode())
        )

    def _details(self, reply: Reply) -> dict[str, Any]:
        return {
            "finish_reason": self.finish(reply.finish_reason),
            "generated_tokens": reply.completion_tokens,
            "prompt_tokens": reply.prompt_tokens,
            "seed": None,
        }

    def frames(self, reply: Reply) -> Frames:
        final = {
            "index": reply.completion_tokens + 1,
            "token": {"id": 2, "text": "</s>", "logprob": -0.01, "special": True},
            "generated_text": answer_text(reply.completion_tokens),
            "details": self._details(reply),
        }
        return Frames(
            head=b"data:",
            tail=b"",
            opening=b"",
            closing=b"data:" + _json(final) + b"\n\n",
            done=b"",
        )

    def answer(self, reply: Reply) -> bytes:
        return _json(
            {
                "generated_text": answer_text(reply.completion_tokens),
                "details": {**self._details(reply), "prefill": [], "tokens": []},
            }
        )

    def error(self, status: int, kind: ErrorKind, message: str) -> bytes:
        if kind == "busy":
            message = "Model is overloaded"
        return _json({"error": message, "error_type": self.error_names.get(kind, "generation")})

    def fault(self, kind: str, window: int, prompt_tokens: int) -> tuple[int, bytes]:
        if kind == "500":
            return 500, _json(
                {"error": "Incomplete generation", "error_type": "incomplete_generation"}
            )
        if kind == "context_length":
            limit = window or 4096
            message = (
                f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {limit}. "
                f"Given: {max(prompt_tokens, limit)} `inputs` tokens and 20 `max_new_tokens`"
            )
            return 422, _json({"error": message, "error_type": "validation"})
        return super().fault(kind, window, prompt_tokens)

    def stream_error(self, reply: Reply, frames: Frames) -> bytes:
        error = {
            "error": "Request failed during generation: Server error: CUDA out of memory",
            "error_type": "generation",
        }
        return b"data:" + _json(error) + b"\n\n"

    def not_found(self, model: str) -> tuple[int, bytes]:  # pragma: no cover - names no model
        return 404, self.error(404, "not_found", f"model {model} not found")


# ------------------------------------------------------------------ Gemini


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
    if part.inline_data is not None and not _base64_ok(part.inline_data.data):
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
            prompt_tokens=_prompt_tokens(chars),
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
            + _json(self._usage(reply, final=False))
            + b',"modelVersion":'
            + _json(reply.model)
            + b"}\n\n"
        )
        return Frames(
            head=b"data: ",
            tail=tail,
            opening=b"",
            closing=b"data: " + _json(self._response(reply, "")) + b"\n\n",
            done=b"",
        )

    def answer(self, reply: Reply) -> bytes:
        return _json(self._response(reply, answer_text(reply.completion_tokens)))

    def _body(self, status: int, message: str, **extra: Any) -> bytes:
        code = _GEMINI_STATUSES.get(status, "UNKNOWN")
        return _json({"error": {"code": status, "message": message, "status": code, **extra}})

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
            return 200, _json(feedback)
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


#: Every dialect, by name: one instance each (they cache their token pieces).
DIALECTS: Final[dict[str, Dialect]] = {
    dialect.name: dialect
    for dialect in (
        OpenAIDialect(),
        AnthropicDialect(),
        OllamaDialect(),
        TGIDialect(),
        GeminiDialect(),
    )
}
