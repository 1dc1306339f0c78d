"""What every dialect shares: the request and reply as the mock sees them, the
:class:`Dialect` each provider's format fills in, the generated text, and
which tool an answer calls.

A dialect reads its request body into a :class:`Call` (model, prompt size,
streamed or not, the output cap) and writes every answer the mock gives in
its provider's form:

- a stream: an ``opening``, one piece per token (``head + piece + tail``:
  the piece is precomputed per token, the head and tail per request), a
  ``closing`` (finish reason, usage) and its end marker (``done``);
- a whole answer, and error bodies by kind (:data:`ErrorKind`), including
  each fault's (``500``, ``503``, ``529``, ``context_length``,
  ``content_filter``) and an in-band error mid-stream (``sse_error``);
- its finish reasons, and the header its key travels in.

The text is deterministic: token ``i`` is ``tok<i>``, separated by spaces
(:func:`token_text`, :func:`answer_text`). An answer calls a tool when the
request offers tools and forces one, or its last user message says ``call
<tool name>`` (:func:`tool_to_call`); the call's arguments are the answer's
text (:func:`tool_arguments`: OpenAI's and Ollama's) or
:data:`MOCK_TOOL_ARGUMENTS` (Anthropic's and Gemini's).
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Literal, NamedTuple

import msgspec
from msgspec import Struct

from .._fault_injection import ERROR_ANSWERS
from .._rate_limits import MockLimitStyle

__all__ = [
    "MOCK_TOOL_ARGUMENTS",
    "Call",
    "Dialect",
    "ErrorKind",
    "Frames",
    "Reply",
    "Target",
    "answer_text",
    "base64_ok",
    "prompt_tokens_of",
    "to_json",
    "token_text",
    "tool_arguments",
    "tool_to_call",
]

_ENCODER: Final = msgspec.json.Encoder()

#: What an error body says went wrong (each dialect names it its provider's way).
ErrorKind = Literal["bad_request", "auth", "not_found", "server_error", "busy"]

#: The arguments of every tool call Anthropic's and Gemini's dialects make.
MOCK_TOOL_ARGUMENTS: Final = {"query": "mock"}

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


def to_json(value: Any) -> bytes:
    return _ENCODER.encode(value)


def prompt_tokens_of(chars: int) -> int:
    """A prompt's tokens, as the mock counts them: its characters / 4, rounded up."""
    return -(-chars // 4)


def base64_ok(data: str) -> bool:
    """Whether ``data`` is strict base64 (what Anthropic and Gemini take for bytes)."""
    try:
        return bool(binascii.a2b_base64(data, strict_mode=True))
    except binascii.Error:
        return False


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
    return to_json({"text": answer_text(count)}).decode()
