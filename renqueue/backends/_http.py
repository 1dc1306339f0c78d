"""What every HTTP adapter shares: pools, the call's clock, the stream loop, the error mapping.

Each wire format (:mod:`.openai`, :mod:`.anthropic`, :mod:`.ollama`,
:mod:`.tgi`, :mod:`.gemini`) is a subclass of :class:`HTTPBackend` that says
only what differs: where a call goes and with which headers
(:attr:`HTTPBackend.paths`, :meth:`HTTPBackend._auth_headers`), the body it
sends (:meth:`HTTPBackend._payload`), how its stream is read (a
:class:`StreamParser`), how a whole answer is read
(:meth:`HTTPBackend._generation`) and, where the status alone misleads, how
an error body names its class (:meth:`HTTPBackend._error_class`). Everything
else is here, once:

- **One pooled** :class:`httpx.AsyncClient` per adapter (or one injected and
  shared between adapters): connection reuse is most of the per-request cost
  on a fast local backend. Its bytes move on aiohttp's client
  (:mod:`._aiohttp`; :attr:`HTTPBackend.transport`), which costs a fraction
  of httpx's own transport per call (``bench/http_clients.py``); an adapter's
  own pool sends each call past httpx's client layer, its kinds of call
  prepared once (:meth:`._aiohttp.AiohttpClient.open`), an injected client
  through its ordinary ``send``.
- **The call's clock** (:class:`Clock`): a first-token deadline
  (``first_token_timeout``) and a whole-call deadline (``total_timeout``),
  each wait on the network bounded by the next one, never across a
  ``yield``. Everything that arrived in one network read becomes one
  :class:`~.base.Delta`.
- **Error mapping at the boundary, once.** Every HTTP status, transport
  error, broken or malformed stream and in-band error leaves as a
  :class:`~renqueue.errors.BackendError` whose class
  (:class:`~renqueue.errors.FailureClass`) the worker acts on
  (:func:`error_for` builds the exception a class calls for). A failure
  after text was yielded is a broken stream.
- **Rate limits the provider reports** (headers of every response, the body
  of an error) are read in the adapter's dialect (:mod:`._limits`) into
  :attr:`HTTPBackend.last_rate_limit`.
- **The key stays secret.** It goes only in the header the provider wants,
  is scrubbed from every error message (provider bodies may echo it), and
  the headers' repr masks it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Final, Literal, NamedTuple, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from ..config import BaseBackendConfig, LimitStyle, parse_duration
from ..errors import (
    BackendError,
    BadRequestError,
    ConfigError,
    FailureClass,
    FatalBackendError,
    RateLimitedError,
    RetryableBackendError,
)
from ..lifecycle import Closing
from ..logs import get_logger
from ..policy import estimate_input_tokens
from ..schema import (
    TRACEPARENT,
    ChatMessage,
    InferenceRequest,
    TokenLogprob,
    Usage,
    parse_traceparent,
)
from ._aiohttp import AiohttpClient, Prepared, ResponseStream
from ._limits import LearnedLimits, names_limits, parse_limits
from ._sse import MAX_EVENT_BYTES, ServerSentEvent, SSEDecoder, SSEError
from .base import Delta, Generation, ToolCall

__all__ = [
    "Clock",
    "FramingError",
    "HTTPBackend",
    "ImageSource",
    "InBandError",
    "LineParser",
    "SSEParser",
    "StreamParser",
    "ToolCallPieces",
    "Transport",
    "arguments_object",
    "bad_request_class",
    "common_finish",
    "decoded",
    "error_detail",
    "error_for",
    "given_params",
    "image_source",
    "named_class",
    "status_class",
    "system_and_turns",
    "tool_arguments",
]

_T = TypeVar("_T")

log = get_logger("backend")

#: Longest a body read past its end marker is read on for its end (in the
#: background: the answer is whole) before the connection is hung up.
DRAIN_WAIT: Final = 5.0
#: Longest provider error text carried into an exception message.
_DETAIL_LIMIT: Final = 300
#: Concurrent calls per connection pool (see ``HTTPBackend.__init__``).
_CALLS_PER_POOL: Final = 8
_ENCODER: Final = msgspec.json.Encoder()


# ------------------------------------------------------------ error bodies


def error_detail(body: bytes) -> str:
    """The provider's error text: JSON ``error.message`` (or a close variant), else the body.

    Reads OpenAI's, Anthropic's and Gemini's ``{"error": {"message": ...}}``,
    Ollama's and TGI's ``{"error": "..."}``, vLLM's ``{"message": ...}`` and
    FastAPI's ``{"detail": ...}``; whitespace is collapsed and the text cut
    to 300 characters.
    """
    try:
        data: Any = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        text = body.decode("utf-8", errors="replace").strip()
    else:
        text = ""
        if isinstance(data, dict):
            error = data.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                text = error["message"]
            elif isinstance(error, str):
                text = error  # Ollama, TGI: {"error": "model 'x' not found"}
            elif isinstance(data.get("message"), str):
                text = data["message"]  # vLLM: {"object": "error", "message": ...}
            elif isinstance(data.get("detail"), str):
                text = data["detail"]  # FastAPI-based servers
        if not text:
            text = body.decode("utf-8", errors="replace").strip()
    text = _KEYLIKE.sub("[redacted]", " ".join(text.split()))
    if len(text) > _DETAIL_LIMIT:
        text = text[: _DETAIL_LIMIT - 3] + "..."
    return text or "(empty body)"


#: What looks like an API key, whole or masked (OpenAI's "Incorrect API key
#: provided: sk-proj-****abcd"): a provider's error text goes into events
#: tenants read and into the gateway's answers, and must not carry even the
#: tail of the operator's key.
_KEYLIKE: Final = re.compile(
    r"\b(?:sk-|sk_|gsk_|hf_|xai-|pplx-|csk-|AIza|ya29\.|Bearer\s+)[A-Za-z0-9_\-*.…]{4,}"
)


#: Error codes and message fragments (lower case) that say the prompt does
#: not fit the model's context: OpenAI and vLLM ("maximum context length"),
#: llama.cpp ("exceeds the available context size"), TGI ("must be <= ..."
#: tokens), Anthropic ("prompt is too long"), Gemini ("exceeds the maximum
#: number of tokens"), Ollama ("exceeds the context length") and others.
_CONTEXT_CODES: Final = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_CONTEXT_PHRASES: Final = (
    "context length",
    "context_length",
    "context window",
    "context size",
    "prompt is too long",
    "maximum number of tokens",
    "too many tokens",
    "tokens + `max_new_tokens` must be",
)
#: Error codes that say a content filter refused the prompt (OpenAI, Azure OpenAI).
_FILTER_CODES: Final = frozenset({"content_filter", "content_policy_violation"})
#: Message fragments (lower case) that say a content filter refused:
#: Anthropic's "Output blocked by content filtering policy".
_FILTER_PHRASES: Final = ("content filtering policy",)


def _error_fields(body: bytes) -> tuple[str, str]:
    """The error's code (or type) and message, and nothing else of the body."""
    code, message = "", ""
    with contextlib.suppress(msgspec.DecodeError):
        data: Any = msgspec.json.decode(body)
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict):
            code = str(error.get("code") or error.get("type") or "")
            message = str(error.get("message") or "")
        elif isinstance(error, str):  # Ollama, TGI: {"error": "..."}
            message = error
        elif isinstance(data, dict) and isinstance(data.get("message"), str):
            message = data["message"]  # vLLM: {"object": "error", "message": ...}
    return code, message[:2000].lower()


def bad_request_class(body: bytes) -> FailureClass:
    """The class of a 4xx that blames the request: context length, content
    filter, or neither. Judged by the error's code and its message only, never
    by the rest of the body: servers echo the input in validation errors, and
    a prompt saying "context window" must not send a bad request down the route."""
    code, message = _error_fields(body)
    if code in _FILTER_CODES or any(phrase in message for phrase in _FILTER_PHRASES):
        return FailureClass.CONTENT_FILTER
    if code in _CONTEXT_CODES or any(phrase in message for phrase in _CONTEXT_PHRASES):
        return FailureClass.CONTEXT_LENGTH
    return FailureClass.BAD_REQUEST


def named_class(
    name: str | None, table: Mapping[str, FailureClass | None], body: bytes
) -> FailureClass | None:
    """The class an error's own type (or status) ``name`` has in ``table``;
    one mapped to ``None`` blames the request, its message saying how
    (:func:`bad_request_class`). ``None`` for a name the table lacks."""
    if not name or name not in table:
        return None
    failure = table[name]
    return bad_request_class(body) if failure is None else failure


def decoded(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T | None:
    """``body`` decoded, or ``None`` when it is not of that shape (an error body
    read for its type: anything may come back with an error status)."""
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None


def status_class(status: int, body: bytes) -> FailureClass:
    """The class of an error response by its status (and, for a 4xx that
    blames the request, its error code and message)."""
    if status == 429:
        return FailureClass.RATE_LIMITED
    if status in (503, 529):  # overloaded (529: Anthropic's) or not ready yet
        return FailureClass.OVERLOADED
    if status in (408, 409) or status >= 500:
        return FailureClass.SERVER_ERROR
    if status in (400, 413, 422):
        return bad_request_class(body)
    # 401, 403, 404 and anything else unexpected (402 out of credits, 405,
    # a redirect): this backend's configuration is what's wrong.
    return FailureClass.UNAVAILABLE


_BAD_REQUEST_CLASSES: Final = frozenset(
    {FailureClass.BAD_REQUEST, FailureClass.CONTEXT_LENGTH, FailureClass.CONTENT_FILTER}
)


def error_for(
    failure: FailureClass,
    message: str,
    *,
    backend: str,
    request_id: str | None,
    status: int | None = None,
    limits: LearnedLimits | None = None,
) -> BackendError:
    """The exception a failure class calls for: wait (rate limited), retry,
    fail the request (it is what is wrong), or stop using this backend."""
    fields: dict[str, Any] = {"backend": backend, "request_id": request_id, "status": status}
    if failure in (FailureClass.RATE_LIMITED, FailureClass.QUOTA_EXHAUSTED):
        if limits is None:
            return RateLimitedError(message, **fields)
        return RateLimitedError(
            message,
            retry_after=limits.retry_after(),
            quota_exhausted=limits.quota_exhausted,
            quota_exhausted_until=limits.quota_exhausted_until,
            **fields,
        )
    if failure in _BAD_REQUEST_CLASSES:
        return BadRequestError(message, failure=failure, **fields)
    if failure is FailureClass.UNAVAILABLE:
        return FatalBackendError(message, failure=failure, **fields)
    return RetryableBackendError(message, failure=failure, **fields)


def given_params(request: InferenceRequest, names: Mapping[str, str]) -> dict[str, Any]:
    """The request's parameters that are set, each under the name ``names``
    gives its field (``{"max_tokens": "num_predict", ...}``)."""
    params = request.params
    given = {}
    for field, name in names.items():
        value = getattr(params, field)
        if value is not None:
            given[name] = value
    return given


def system_and_turns(
    messages: Sequence[ChatMessage],
) -> tuple[str | None, list[ChatMessage]]:
    """For formats that take the system prompt apart: the system messages'
    text (joined by blank lines; ``None`` without any) and the other messages."""
    system = [m.text for m in messages if m.role == "system"]
    return ("\n\n".join(system) if system else None), [m for m in messages if m.role != "system"]


#: The longest finish reason passed on (real ones are a word: ``stop``, ``end_turn``).
_MAX_REASON: Final = 32
#: The largest token count believed: past it (or below 0) a count is a broken or
#: hostile server's, and is estimated instead (it would not fit an event's ``usage``).
_MAX_COUNT: Final = 2**53


def _believable(count: int | None) -> int | None:
    return count if count is not None and 0 <= count <= _MAX_COUNT else None


def usage_of(
    prompt: int | None, completion: int | None, request: InferenceRequest, completion_estimate: int
) -> Usage:
    """The usage a provider reported, each count it did not report (or reported
    as nonsense) estimated: the prompt as its characters / 4, the completion as
    ``completion_estimate``."""
    prompt = _believable(prompt)
    completion = _believable(completion)
    return Usage(
        prompt_tokens=prompt if prompt is not None else estimate_input_tokens(request),
        completion_tokens=completion if completion is not None else completion_estimate,
    )


def tool_arguments(value: Any) -> str:
    """A tool call's arguments, decoded from a provider's JSON, as JSON text (``{}``: none)."""
    return "{}" if value is None else _ENCODER.encode(value).decode()


def common_finish(reason: str, table: Mapping[str, str]) -> str:
    """A provider's finish reason as one of :data:`~.base.FINISH_REASONS`, by
    ``table``; one with no counterpart passes through in lower case."""
    return table.get(reason) or reason.lower()


# ------------------------------------------------------------ stream parsers


class FramingError(ValueError):
    """A stream broke its framing's bound (a line longer than allowed), or
    what it assembles broke one (:class:`ToolCallPieces`)."""


#: The most tool calls one answer may make, and the most characters their
#: arguments may hold together: past them, a backend is broken or hostile
#: (the calls travel in the ``completed`` event).
MAX_TOOL_CALLS: Final = 128
MAX_TOOL_ARGUMENTS: Final = 1_000_000
#: The longest tool-call id and name kept (the wire's bound).
_MAX_TOOL_NAME: Final = 256
#: The most token log probabilities kept of one answer: the rest are dropped
#: (they travel in chunks and in the ``completed`` event, whose size is bounded).
MAX_LOGPROBS: Final = 8192


class ToolCallPieces:
    """Tool calls streamed in pieces (OpenAI's ``delta.tool_calls``), assembled.

    Each piece names its call by ``index``: the first piece of a call brings
    its ``id`` and ``name``, every piece a piece of its ``arguments`` text.
    A piece without an index (servers that leave it out) starts a new call
    when it brings an id not seen yet, else continues the last one. An id or
    name given again is kept as first given (some servers repeat them in
    every piece). Bounded: :data:`MAX_TOOL_CALLS` calls, and
    :data:`MAX_TOOL_ARGUMENTS` characters of arguments in all; past either,
    :class:`FramingError`.
    """

    __slots__ = ("_calls", "_chars", "_last")

    def __init__(self) -> None:
        self._calls: dict[int, _PendingCall] = {}
        self._chars = 0
        self._last = -1

    def __bool__(self) -> bool:
        return bool(self._calls)

    def __contains__(self, index: object) -> bool:
        return index in self._calls

    def append(self, call_id: str, name: str, arguments: str) -> None:
        """Take one whole call (formats that send calls whole), after the others."""
        self.add(max(self._calls, default=-1) + 1, call_id, name, arguments)

    def add(self, index: int | None, call_id: str, name: str, arguments: str) -> None:
        """Take one piece."""
        if index is None:
            known = any(call.id == call_id for call in self._calls.values())
            index = len(self._calls) if (call_id and not known) or self._last < 0 else self._last
        call = self._calls.get(index)
        if call is None:
            if len(self._calls) >= MAX_TOOL_CALLS:
                raise FramingError(f"more than {MAX_TOOL_CALLS} tool calls")
            call = self._calls[index] = _PendingCall()
        self._last = index
        if call_id and not call.id:
            call.id = call_id[:_MAX_TOOL_NAME]
        if name and not call.name:
            call.name = name[:_MAX_TOOL_NAME]
        if arguments:
            self._chars += len(arguments)
            if self._chars > MAX_TOOL_ARGUMENTS:
                raise FramingError(f"tool call arguments longer than {MAX_TOOL_ARGUMENTS}")
            call.arguments.append(arguments)

    def whole(self) -> list[ToolCall]:
        """The calls, in index order; :class:`FramingError` for one that never got a name."""
        calls = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if not call.name:
                raise FramingError(f"tool call {index} has no name")
            calls.append(
                ToolCall(id=call.id, name=call.name, arguments="".join(call.arguments) or "{}")
            )
        return calls


class _PendingCall:
    """A tool call being assembled (:class:`ToolCallPieces`)."""

    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []


class InBandError(Exception):
    """The backend reported an error inside a stream (or a 200 body): its
    text, and its class if the parser knows it; else the class its ``body``
    names (:meth:`HTTPBackend._error_class`), else a server error. Raised by
    parsers; never leaves an adapter."""

    def __init__(
        self, detail: str, failure: FailureClass | None = None, *, body: bytes = b""
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.failure = failure
        self.body = body


class StreamParser:
    """Folds one streamed body into text, finish reason, usage and tool calls.

    :meth:`feed` takes the bytes of one network read and returns the text
    they complete; :meth:`end` is called when the body ended. Either raises
    ``msgspec.DecodeError`` for a chunk that does not parse,
    :class:`FramingError` / :class:`~._sse.SSEError` for a framing bound
    broken, :class:`InBandError` for an error the backend sent in-band.

    ``complete`` says the stream reached its end marker (or, where the format
    has none, a finish reason); ``deltas`` counts chunks with text (about a
    token each, the completion estimate when no usage is reported).
    :meth:`unfinished` says whether what was read is a whole answer.
    """

    #: The stream's content type: a response with another is a whole JSON answer.
    content_type: ClassVar[str] = "text/event-stream"
    #: What a stream that ended without its end marker is called in the error.
    incomplete: ClassVar[str] = "stream ended before its end"
    #: What a stream that reached its end marker without a finish reason is
    #: called in the error, in a format whose end marker is not its finish
    #: (OpenAI's ``[DONE]``, Anthropic's ``message_stop``: llama-cpp-python's
    #: server ends a stream it cuts short with a bare ``[DONE]``); ``None``
    #: where the end marker is the finish (Ollama's ``done``, TGI's final event,
    #: Gemini's ``finishReason``).
    unreasoned: ClassVar[str | None] = None
    #: Nothing of the answer follows its end marker (OpenAI's ``[DONE]``,
    #: Anthropic's ``message_stop``, Ollama's done line, TGI's final event):
    #: once it is read, as a whole answer, the body is not read further. False
    #: where the end is a finish reason something may follow (Gemini's usage).
    ends_at_marker: ClassVar[bool] = True

    def __init__(self) -> None:
        self.complete = False
        #: A whole JSON answer came instead of a stream (:meth:`adopt`).
        self.adopted = False
        self.deltas = 0
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        #: The tool calls read, whole or in pieces (bounded), and, once the
        #: answer is read (:meth:`assemble_tools`), as whole calls.
        self.tool_pieces = ToolCallPieces()
        self.tool_calls: list[ToolCall] = []
        #: Log probabilities read and not yet handed over (:meth:`take_logprobs`).
        self.logprobs: list[TokenLogprob] = []
        self._logprobs_kept = 0

    def feed(self, piece: bytes) -> str:
        raise NotImplementedError

    def add_tool_call(self, call_id: str, name: str, arguments: str) -> None:
        """Keep one whole tool call, within :class:`ToolCallPieces`' bounds."""
        self.tool_pieces.append(call_id, name, arguments)

    def assemble_tools(self) -> None:
        """The answer is read: its tool calls, whole (:class:`FramingError`
        for one without a name)."""
        if self.tool_pieces:
            self.tool_calls = self.tool_pieces.whole()

    def add_logprobs(self, logprobs: Sequence[TokenLogprob]) -> None:
        """Keep ``logprobs``, up to :data:`MAX_LOGPROBS` for the whole answer."""
        room = MAX_LOGPROBS - self._logprobs_kept
        if room > 0 and logprobs:
            kept = logprobs[:room]
            self.logprobs.extend(kept)
            self._logprobs_kept += len(kept)

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The log probabilities read since the last call (they go with its delta)."""
        if not self.logprobs:
            return ()
        taken = tuple(self.logprobs)
        self.logprobs = []
        return taken

    def end(self) -> None:
        """The body ended (a last, unterminated piece may still be read)."""

    def adopt(self, generation: Generation) -> None:
        """Take a whole answer (a server that ignored the stream flag)."""
        self.complete = True
        self.adopted = True
        self.finish_reason = generation.finish_reason
        self.prompt_tokens = generation.usage.prompt_tokens
        self.completion_tokens = generation.usage.completion_tokens
        self.tool_calls = list(generation.tool_calls)

    def finish_or_tools(self, reason: str, table: Mapping[str, str]) -> None:
        """Take the finish ``reason`` of a format whose reason does not say the
        model called tools (Gemini's ``STOP``, Ollama's ``stop``): read by
        ``table`` (:func:`common_finish`), and ``tool_calls`` when it did."""
        common = common_finish(reason, table)
        called = bool(self.tool_pieces or self.tool_calls)
        self.finish_reason = "tool_calls" if common == "stop" and called else common

    def unfinished(self) -> str | None:
        """Why the stream read is not a whole answer (the error's message), or
        ``None`` when it is: a stream is whole when it gave a finish reason,
        with or without its end marker after it (some servers close right
        after the last chunk), or when it reached an end marker that is the
        format's finish (:attr:`unreasoned` ``None``). An end marker with no
        finish reason before it is a stream cut short, not an answer: the
        failure of a stream broken mid-way. A whole JSON answer taken instead
        of a stream is judged as :meth:`HTTPBackend.complete` judges it."""
        if self.finish_reason is not None or self.adopted:
            return None
        if not self.complete:
            return self.incomplete
        return self.unreasoned

    def counted(self, text: str) -> str:
        """``text``, counted as one delta if there is any."""
        if text:
            self.deltas += 1
        return text

    def usage(self, request: InferenceRequest) -> Usage:
        """The reported usage (:func:`usage_of`), the completion estimated as the
        number of text deltas."""
        return usage_of(self.prompt_tokens, self.completion_tokens, request, self.deltas)

    def whole(self, text: str, request: InferenceRequest) -> Generation:
        """The answer this parser read from one whole body (``text`` its text)."""
        self.assemble_tools()
        return Generation(
            text=text,
            # Not reported: the completion as the answer's characters / 4.
            usage=usage_of(self.prompt_tokens, self.completion_tokens, request, -(-len(text) // 4)),
            finish_reason=self._reason(),
            tool_calls=tuple(self.tool_calls),
            logprobs=self.take_logprobs(),
        )

    def last(self) -> Delta:
        """The final delta: usage is filled in by the caller."""
        return Delta(finish_reason=self._reason(), tool_calls=tuple(self.tool_calls))

    def _reason(self) -> str | None:
        """The finish reason, a short word: a longer one (a broken or hostile
        server's) is cut, as it travels in the ``completed`` event."""
        reason = self.finish_reason
        return reason if reason is None or len(reason) <= _MAX_REASON else reason[:_MAX_REASON]


class SSEParser(StreamParser):
    """A stream of server-sent events (:mod:`._sse`); subclasses read each event."""

    def __init__(self) -> None:
        super().__init__()
        self._decoder = SSEDecoder()

    def feed(self, piece: bytes) -> str:
        read = self.event
        return "".join([read(event) for event in self._decoder.feed(piece)])

    def end(self) -> None:
        last = self._decoder.finish()
        if last is not None:
            self.unterminated(last)

    def event(self, event: ServerSentEvent) -> str:
        """Take one event; return the text it adds."""
        raise NotImplementedError

    def unterminated(self, event: ServerSentEvent) -> None:
        """An event whose blank line never came: dropped, as the spec says."""


class LineParser(StreamParser):
    """A stream of JSON lines (NDJSON, as Ollama sends); subclasses read each line.

    A line may not exceed 4 MiB (:class:`FramingError`); a last line without
    its newline is still read (JSON is self-delimiting: a cut one fails to parse).
    """

    content_type: ClassVar[str] = "application/x-ndjson"

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def feed(self, piece: bytes) -> str:
        if b"\n" not in piece:
            self._pending.append(piece)
            self._pending_bytes += len(piece)
            if self._pending_bytes > MAX_EVENT_BYTES:
                raise FramingError(f"JSON line longer than {MAX_EVENT_BYTES} bytes")
            return ""
        if self._pending:
            self._pending.append(piece)
            piece = b"".join(self._pending)
        lines = piece.split(b"\n")
        rest = lines.pop()
        self._pending = [rest] if rest else []
        self._pending_bytes = len(rest)
        text = ""
        for line in lines:
            if len(line) > MAX_EVENT_BYTES:
                raise FramingError(f"JSON line longer than {MAX_EVENT_BYTES} bytes")
            if line.strip():
                text += self.line(line)
        return text

    def end(self) -> None:
        rest = b"".join(self._pending)
        self._pending = []
        if rest.strip():
            self.line(rest)

    def line(self, line: bytes) -> str:
        """Take one JSON line; return the text it adds."""
        raise NotImplementedError


# ------------------------------------------------------------------ headers


class _SecretHeaders(httpx.Headers):
    """Headers whose repr masks the key, whichever header carries it
    (httpx masks only ``Authorization``)."""

    secret_names: ClassVar[frozenset[str]] = frozenset(
        {"authorization", "x-api-key", "x-goog-api-key"}
    )

    def __repr__(self) -> str:
        shown = [
            (name, "[secure]" if name.lower() in self.secret_names else value)
            for name, value in self.items()
        ]
        return f"Headers({shown!r})"


def _trace_header(traceparent: str | None) -> tuple[str, str] | None:
    """The ``traceparent`` header to send, when ``traceparent`` is a valid one
    (written anew from its parts); else ``None``."""
    trace = parse_traceparent(traceparent)
    return None if trace is None else (TRACEPARENT, trace.header)


# ------------------------------------------------------------------ adapter

#: What an adapter's pools send through (:attr:`HTTPBackend.transport`).
Transport = Literal["aiohttp", "httpcore"]


def _pools(
    transport: Transport, concurrency: int, timeout: httpx.Timeout
) -> list[httpx.AsyncClient]:
    """An adapter's own connection pools, for ``concurrency`` calls at once.

    On aiohttp, one pool: its cost per call does not grow with its size. On
    httpcore, several small pools instead of one big one: httpcore rescans every
    connection of a pool on each request start and close, so its cost per call
    grows with the pool (encode/httpcore#1035; at 64 concurrent calls, one pool
    spent ~5 ms of CPU per call, eight pools ~2 ms: bench/README.md). Each pool
    has room for its share of the declared concurrency; the broker, not the
    pool, bounds load.
    """
    if transport == "aiohttp":
        room = concurrency + 4
        limits = httpx.Limits(max_connections=room, max_keepalive_connections=room)
        return [AiohttpClient(timeout=timeout, limits=limits)]
    shards = max(1, min(16, -(-concurrency // _CALLS_PER_POOL)))
    per_pool = -(-concurrency // shards) + 4
    limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
    return [httpx.AsyncClient(timeout=timeout, limits=limits) for _ in range(shards)]


def _straight(response: httpx.Response) -> ResponseStream | None:
    """``response``'s body as the aiohttp transport gives it, when httpx has
    nothing to do to read it (the response came from :meth:`AiohttpClient.open`,
    no ``Content-Encoding`` to decode); else ``None``."""
    stream = response.stream
    return stream if isinstance(stream, ResponseStream) and not stream.encoded else None


def _pieces(response: httpx.Response) -> AsyncIterator[bytes]:
    """``response``'s body as it arrives, each piece what one network read
    brought (decoded, if it is encoded): read straight off the aiohttp
    transport where it can be (:func:`_straight`), else as httpx reads it."""
    stream = _straight(response)
    return response.aiter_bytes().__aiter__() if stream is None else stream.pieces()


async def _read(response: httpx.Response) -> bytes:
    """``response``'s whole body (decoded, if it is encoded), as :func:`_pieces` reads it."""
    stream = _straight(response)
    return await response.aread() if stream is None else await stream.read()


def _read_to_end(response: httpx.Response) -> bool:
    """Whether ``response``'s body is known to be read to its end (its end
    came with its last read, as a rule: nothing is left to drain)."""
    # httpx's client wraps the transport's stream (BoundAsyncStream._stream);
    # a later httpx that does not only costs a drain task.
    stream = getattr(response.stream, "_stream", response.stream)
    return isinstance(stream, ResponseStream) and stream.at_end()


class HTTPBackend(Closing):
    """A backend reached over HTTP: the base of every adapter (module docstring).

    Safe to share between concurrent calls. ``client`` lets several adapters
    share one connection pool; an injected client is never closed here.

    Usage: when the backend reports none, it is estimated: prompt tokens as
    prompt characters / 4, completion tokens as the number of text deltas
    (streaming, about one token each) or output characters / 4 (not
    streaming). Estimates are good enough for quota accounting, not billing.
    """

    #: The rate-limit dialect its responses are read in (:mod:`._limits`).
    limit_style: LimitStyle = "auto"
    #: The parser of this format's stream.
    parser: ClassVar[type[StreamParser]] = StreamParser
    #: What moves the bytes under its :class:`httpx.AsyncClient` (unless one is
    #: injected): ``"aiohttp"`` (:class:`._aiohttp.AiohttpTransport`) or
    #: ``"httpcore"`` (httpx's own); see :func:`_pools`.
    transport: ClassVar[Transport] = "aiohttp"
    #: Where a call goes, after ``base_url``: (streaming, not streaming);
    #: ``{model}`` stands for the model's name, URL-quoted.
    paths: ClassVar[tuple[str, str]]

    def __init__(
        self, name: str, config: BaseBackendConfig, *, client: httpx.AsyncClient | None = None
    ) -> None:
        self._name = name
        self._config = config
        base, model = config.base_url.rstrip("/"), quote(config.model, safe="")
        self._urls = tuple(base + path.format(model=model) for path in self.paths)
        # Parsed once: httpx parses a URL given as text on every call.
        self._targets = tuple(httpx.URL(url) for url in self._urls)
        self._timeout = httpx.Timeout(
            parse_duration(config.timeout), connect=parse_duration(config.connect_timeout)
        )
        self._first_token_timeout = (
            None
            if config.first_token_timeout is None
            else parse_duration(config.first_token_timeout)
        )
        self._total_timeout = (
            None if config.total_timeout is None else parse_duration(config.total_timeout)
        )
        key = config.api_key(path=f"$.backends.{name}")
        self._key = key.reveal() if key else ""
        if self._key and not (self._key.isascii() and self._key.isprintable()):
            # Checked here because httpx/h11 put an illegal header value,
            # key included, into their exception messages.
            raise ConfigError(
                "API key contains characters not allowed in an HTTP header",
                path=f"$.backends.{name}.{'api_key_env' if config.api_key_env else 'api_key_file'}",
            )
        base_headers = {"Content-Type": "application/json", **self._auth_headers(self._key)}
        self._stream_headers = _SecretHeaders({**base_headers, "Accept": self.parser.content_type})
        self._json_headers = _SecretHeaders({**base_headers, "Accept": "application/json"})
        self._owns_client = client is None
        if client is None:
            self._pools = _pools(self.transport, config.limits.concurrency, self._timeout)
        else:
            self._pools = [client]
        self._busy = [0] * len(self._pools)
        #: Per pool, its (streaming, not streaming) call prepared once, where
        #: the pool is an own :class:`AiohttpClient` (:meth:`AiohttpClient.open`).
        self._prepared: list[tuple[Prepared, Prepared] | None] = [
            (
                pool.prepare(
                    "POST", self._targets[0], headers=self._stream_headers, timeout=self._timeout
                ),
                pool.prepare(
                    "POST", self._targets[1], headers=self._json_headers, timeout=self._timeout
                ),
            )
            if self._owns_client and isinstance(pool, AiohttpClient)
            else None
            for pool in self._pools
        ]
        self._closed = False
        #: Bodies read past their end marker to their end, in the background
        #: (:meth:`_drain`), so that their connections go back to the pool.
        self._draining: set[asyncio.Task[None]] = set()
        #: The latest rate-limit reading from this backend (any call,
        #: including 429s); ``None`` until a response says anything about limits.
        self.last_rate_limit: LearnedLimits | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> BaseBackendConfig:
        return self._config

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, model={self._config.model!r}, "
            f"url={self._urls[0]!r})"
        )

    async def close(self) -> None:
        """Close the connection pool, unless it was injected. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        if self._owns_client:
            for pool in self._pools:
                await pool.aclose()

    def _pool(self) -> contextlib.AbstractContextManager[int]:
        """The least busy connection pool's index, counted busy for the duration
        (one pool, as on aiohttp: nothing to count)."""
        return _ONLY_POOL if len(self._busy) == 1 else self._least_busy()

    @contextlib.contextmanager
    def _least_busy(self) -> Iterator[int]:
        busy = self._busy
        index = min(range(len(busy)), key=busy.__getitem__)
        busy[index] += 1
        try:
            yield index
        finally:
            busy[index] -= 1

    def _open(
        self, pool: int, streaming: bool, body: bytes, trace: tuple[str, str] | None
    ) -> Awaitable[httpx.Response]:
        """Send one call on pool ``pool`` (``streaming``: to the streaming
        path); the response open, its body unread (the caller closes it).
        What to await for it: the client's own send (no frame of its own here)."""
        prepared = self._prepared[pool]
        client = self._pools[pool]
        if prepared is not None:
            assert isinstance(client, AiohttpClient)
            return client.open(prepared[0 if streaming else 1], body, header=trace)
        headers = self._stream_headers if streaming else self._json_headers
        if trace is not None:
            headers = _SecretHeaders(headers)
            headers[trace[0]] = trace[1]
        request = client.build_request(
            "POST",
            self._targets[0 if streaming else 1],
            content=body,
            headers=headers,
            timeout=self._timeout,
        )
        return client.send(request, stream=True)

    def auth_headers(self) -> httpx.Headers:
        """The headers that carry its key, in its format (what a health probe
        of the same server sends); their repr masks the key."""
        return _SecretHeaders(self._auth_headers(self._key))

    # ------------------------------------------------- what a format says

    def _untranslatable(self, request: InferenceRequest, what: str) -> BadRequestError:
        """The error for a request this format cannot carry (never sent, never dropped)."""
        return BadRequestError(
            f"{what} (adapter {type(self).__name__})", backend=self._name, request_id=request.id
        )

    def _auth_headers(self, key: str) -> dict[str, str]:
        """The headers that carry the key (and the format's own): ``Authorization: Bearer``."""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _payload(
        self, request: InferenceRequest, priority: int | None, *, stream: bool
    ) -> dict[str, Any]:
        """The request body, as JSON-ready builtins."""
        raise NotImplementedError

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        """A whole answer from its body; raises ``msgspec.DecodeError`` (malformed)
        or :class:`InBandError`."""
        raise NotImplementedError

    def _error_class(self, body: bytes) -> FailureClass | None:
        """The class an error body's own type names (Anthropic's ``error.type``,
        Gemini's ``error.status``, TGI's ``error_type``), where the status alone
        misleads; ``None``: it names none (the status decides)."""
        return None

    # ------------------------------------------------------------- calls

    async def stream(
        self,
        request: InferenceRequest,
        *,
        priority: int | None = None,
        traceparent: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Yield text deltas as the backend generates them, then one ``Delta`` with
        usage, finish reason and tool calls.

        Closing the generator early closes the HTTP response, so the backend
        sees the disconnect and stops generating. A failure after text was
        yielded is :attr:`~renqueue.errors.FailureClass.BROKEN_STREAM`
        (its cause in the message). A stream is a whole answer only if it
        gave a finish reason (:meth:`StreamParser.unfinished`): one that ends
        without it, at its end marker (a bare ``[DONE]``) or as the connection
        closes, is a broken stream, never a short answer. ``traceparent`` goes
        out as that header if it is a valid W3C one (never as given).
        """
        body = self._body(request, priority, stream=True)
        parser = self.parser()
        clock = Clock(self._first_token_timeout, self._total_timeout)
        trace = _trace_header(traceparent)
        try:
            with self._pool() as pool:
                async for delta in self._stream_from(
                    pool, body, parser, request, clock, trace=trace
                ):
                    clock.first_token()
                    yield delta
            unfinished = parser.unfinished()
            if unfinished is not None:
                raise RetryableBackendError(
                    unfinished,
                    backend=self._name,
                    request_id=request.id,
                    failure=FailureClass.MALFORMED,
                )
        except httpx.HTTPError as exc:
            error = self._transport_error(exc, request, clock)
            raise self._after_tokens(error, clock) from exc
        except TimeoutError as exc:
            raise self._after_tokens(clock.timed_out(self._name, request), clock) from exc
        except BackendError as exc:
            after = self._after_tokens(exc, clock)
            if after is exc:
                raise
            raise after from exc
        last = parser.last()
        yield Delta(
            usage=parser.usage(request),
            finish_reason=last.finish_reason,
            tool_calls=last.tool_calls,
            end=True,
        )

    async def _stream_from(
        self,
        pool: int,
        body: bytes,
        parser: StreamParser,
        request: InferenceRequest,
        clock: Clock,
        *,
        trace: tuple[str, str] | None,
    ) -> AsyncIterator[Delta]:
        """Read the stream. Everything that arrived in one network read becomes
        one :class:`Delta`: a fast backend's burst of tokens costs one publish
        downstream, and a slow one's single token is not held back. The read
        that also brought the stream's end marker gives its delta ``end``:
        the worker sends that text with the final chunk, one publish fewer
        (only when it ended as a whole answer: see :meth:`StreamParser.unfinished`).

        Each wait on the network is bounded by the clock's next deadline (the
        first token's, else the whole call's): never across a ``yield``, so a
        slow consumer is not cut off by it."""
        async with clock.bounded():
            response = await self._open(pool, True, body, trace)
        ended = False
        try:
            if not response.is_success:
                async with clock.bounded():
                    error = await _read(response)
                raise self._status_error(response, error, request)
            self._observe_success(response)
            if parser.content_type not in response.headers.get("content-type", ""):
                # A server that ignored the stream flag and sent one JSON body.
                async with clock.bounded():
                    raw = await _read(response)
                generation = self._whole(raw, request)
                if generation.text or generation.logprobs:
                    yield Delta(text=generation.text, logprobs=generation.logprobs, end=True)
                parser.adopt(generation)
                return
            pieces = _pieces(response)
            while True:
                try:
                    async with clock.bounded():
                        piece = await anext(pieces)
                except StopAsyncIteration:
                    break
                text = self._feed(parser, piece, request)
                # Ended here, as a whole answer (a stream cut short at its end
                # marker streams what came, as any broken stream).
                end = parser.ends_at_marker and parser.complete and parser.unfinished() is None
                if parser.logprobs:
                    yield Delta(text=text, logprobs=parser.take_logprobs(), end=end)
                elif text:
                    yield Delta(text=text, end=end)
                if end:
                    # The answer is whole: not waiting here for the body's end
                    # (a server or proxy may hold it open while the worker
                    # holds this read's text until the stream ends); it is
                    # read in the background, the connection then reused.
                    ended = True
                    break
            self._feed(parser, None, request)
        finally:
            if ended and not _read_to_end(response):
                self._drain(response, pieces)
            else:
                await response.aclose()

    def _drain(self, response: httpx.Response, pieces: AsyncIterator[bytes]) -> None:
        """Read what is left of a body past its end marker (its end, as a
        rule: what a server sends after it is no part of the answer), within
        :data:`DRAIN_WAIT`, then close the response: back to the pool when
        its end came, else hung up."""

        async def drain() -> None:
            try:
                async with asyncio.timeout(DRAIN_WAIT):
                    async for _ in pieces:
                        pass
            except (TimeoutError, httpx.HTTPError):
                pass  # hung up below; the answer was whole already
            finally:
                await response.aclose()

        task = asyncio.get_running_loop().create_task(drain(), name=f"{self._name}-drain")
        self._draining.add(task)
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        self._draining.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("closing a response read past its end failed", error=repr(task.exception()))

    async def complete(
        self,
        request: InferenceRequest,
        *,
        priority: int | None = None,
        traceparent: str | None = None,
    ) -> Generation:
        """The whole answer from one non-streaming call (bounded by ``total_timeout``;
        ``traceparent`` as for :meth:`stream`)."""
        body = self._body(request, priority, stream=False)
        clock = Clock(None, self._total_timeout)
        try:
            with self._pool() as pool:
                async with clock.bounded():
                    response = await self._open(pool, False, body, _trace_header(traceparent))
                    try:
                        answer = await _read(response)
                    finally:
                        await response.aclose()
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, request, clock) from exc
        except TimeoutError as exc:
            raise clock.timed_out(self._name, request) from exc
        if not response.is_success:
            raise self._status_error(response, answer, request)
        self._observe_success(response)
        return self._whole(answer, request)

    # ------------------------------------------------------------- helpers

    def _body(self, request: InferenceRequest, priority: int | None, *, stream: bool) -> bytes:
        if self._closed:
            raise FatalBackendError("adapter is closed", backend=self._name, request_id=request.id)
        return _ENCODER.encode(self._payload(request, priority, stream=stream))

    def _observe_success(self, response: httpx.Response) -> None:
        """Read what a success says about our limits: only when a header may
        say something of them (:func:`names_limits`; most backends send none)."""
        if names_limits(response.headers.raw):
            self._observe(response)

    def _observe(self, response: httpx.Response, body: bytes | None = None) -> LearnedLimits:
        """Read what ``response`` (and its error ``body``) says about our limits."""
        limits = parse_limits(
            response.headers,
            now=time.time(),
            status=response.status_code,
            body=body,
            style=self.limit_style,
        )
        if not limits.empty:
            self.last_rate_limit = limits
        return limits

    def _feed(self, parser: StreamParser, piece: bytes | None, request: InferenceRequest) -> str:
        """One read into the parser (``None``: the body ended), its failures translated."""
        try:
            if piece is None:
                parser.end()
                parser.assemble_tools()
                return ""
            return parser.feed(piece)
        except (msgspec.DecodeError, RecursionError) as exc:  # deep JSON: RecursionError
            raise self._malformed("malformed stream chunk", exc, request) from exc
        except (SSEError, FramingError) as exc:
            raise self._malformed("malformed stream", exc, request) from exc
        except InBandError as exc:
            # The server failed while answering (or refused in a 200 body).
            raise self._in_band(exc, request) from None  # ours: it adds nothing

    def _whole(self, body: bytes, request: InferenceRequest) -> Generation:
        """A whole answer, its failures translated."""
        try:
            return self._generation(body, request)
        except (msgspec.DecodeError, RecursionError, FramingError) as exc:
            raise self._malformed("malformed response body", exc, request) from exc
        except InBandError as exc:
            raise self._in_band(exc, request) from None

    def _malformed(
        self, what: str, exc: Exception, request: InferenceRequest
    ) -> RetryableBackendError:
        return RetryableBackendError(
            f"{what}: {self._redact(str(exc))}",
            backend=self._name,
            request_id=request.id,
            failure=FailureClass.MALFORMED,
        )

    def _in_band(self, exc: InBandError, request: InferenceRequest) -> BackendError:
        failure = exc.failure or self._error_class(exc.body) or FailureClass.SERVER_ERROR
        return error_for(
            failure,
            f"error in stream: {self._redact(exc.detail)}",
            backend=self._name,
            request_id=request.id,
        )

    def _redact(self, text: str) -> str:
        """Scrub the key from text that came from outside (bodies, foreign errors)."""
        return text.replace(self._key, "***") if self._key else text

    def _status_error(
        self, response: httpx.Response, body: bytes, request: InferenceRequest
    ) -> BackendError:
        status = response.status_code
        limits = self._observe(response, body)
        return error_for(
            self._error_class(body) or status_class(status, body),
            f"HTTP {status}: {self._redact(error_detail(body))}",
            backend=self._name,
            request_id=request.id,
            status=status,
            limits=limits,
        )

    def _transport_error(
        self, exc: httpx.HTTPError, request: InferenceRequest, clock: Clock
    ) -> BackendError:
        detail = self._redact(str(exc))
        message = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError):
            return FatalBackendError(
                message, backend=self._name, request_id=request.id, failure=FailureClass.UNAVAILABLE
            )
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            failure = FailureClass.CONNECT_TIMEOUT
        elif isinstance(exc, httpx.TimeoutException):  # a silence longer than ``timeout``
            failure = FailureClass.STALL if clock.began else FailureClass.FIRST_TOKEN_TIMEOUT
        else:  # refused, reset, dropped (ConnectError, ReadError, RemoteProtocolError, ...)
            failure = FailureClass.CONNECT
        return RetryableBackendError(
            message, backend=self._name, request_id=request.id, failure=failure
        )

    def _after_tokens(self, error: BackendError, clock: Clock) -> BackendError:
        """``error`` as a broken stream when text had already been yielded."""
        if (
            not clock.began
            or not error.retryable
            or isinstance(error, RateLimitedError)
            or error.failure is FailureClass.TOTAL_TIMEOUT  # its length, not a break
        ):
            return error
        return RetryableBackendError(
            f"stream broke after tokens were sent ({error.failure}): "
            f"{str(error).removeprefix(self._name + ': ')}",
            backend=self._name,
            request_id=error.request_id,
            status=error.status,
            failure=FailureClass.BROKEN_STREAM,
        )


#: The one pool of an adapter that has one (:meth:`HTTPBackend._pool`).
_ONLY_POOL: Final = contextlib.nullcontext(0)
#: The scope of a wait with no deadline (:meth:`Clock.bounded`).
_UNBOUNDED: Final = contextlib.nullcontext()


class Clock:
    """The deadlines of one call: the first token's (``first_token_timeout``
    from the start) and the whole call's (``total_timeout``)."""

    __slots__ = ("_first", "_total", "began")

    def __init__(self, first_token: float | None, total: float | None) -> None:
        now = asyncio.get_running_loop().time()
        self._first = None if first_token is None else now + first_token
        self._total = None if total is None else now + total
        #: Text was yielded: the first-token deadline no longer applies.
        self.began = False

    def first_token(self) -> None:
        self.began = True

    def deadline(self) -> float | None:
        first = None if self.began else self._first
        if first is None or self._total is None:
            return first if self._total is None else self._total
        return min(first, self._total)

    def bounded(self) -> contextlib.AbstractAsyncContextManager[object]:
        """A scope for one wait on the network: it ends at the next deadline
        (none: nothing to arm, the same empty scope every time)."""
        deadline = self.deadline()
        return _UNBOUNDED if deadline is None else asyncio.timeout_at(deadline)

    def timed_out(self, backend: str, request: InferenceRequest) -> RetryableBackendError:
        """The error of a wait cut by :meth:`bounded`."""
        # Before the first token, the backend said nothing at all in time: a
        # fault of the backend's, whichever deadline cut the wait. After it,
        # only the whole call's length (which the request's size may explain).
        total = self.began
        failure = FailureClass.TOTAL_TIMEOUT if total else FailureClass.FIRST_TOKEN_TIMEOUT
        what = (
            "the call took longer than total_timeout"
            if total
            else "no first token in time (first_token_timeout or total_timeout)"
        )
        return RetryableBackendError(what, backend=backend, request_id=request.id, failure=failure)


# ------------------------------------------------ native request translation
# What the native adapters (Anthropic, Gemini, ...) share when they turn a
# request's images and tool calls into their provider's shapes.

#: ``data:<image type>;base64,<data>``: the only data URL an image may be.
_DATA_IMAGE = re.compile(r"data:(image/[A-Za-z0-9][A-Za-z0-9.+-]{0,126});base64,", re.ASCII)


class ImageSource(NamedTuple):
    """An image part's URL, read: inline bytes (``media_type`` and the base64
    ``data``) or a remote ``url``."""

    media_type: str | None = None
    data: str | None = None
    url: str | None = None


def image_source(url: str) -> ImageSource:
    """What an image part's URL is: a base64 ``data:image/...`` URL (its media
    type in lower case, its data checked to be base64) or an ``https://``
    URL; ``ValueError`` (saying why, never quoting the data) for anything else."""
    if url.startswith("https://"):
        return ImageSource(url=url)
    match = _DATA_IMAGE.match(url)
    if match is None:
        if url.startswith("data:"):
            raise ValueError("an image data URL must be data:image/<type>;base64,<data>")
        raise ValueError("an image URL must be https:// or a data:image/...;base64 URL")
    data = url[match.end() :]
    try:
        if not data or not base64.b64decode(data, validate=True):
            raise ValueError("an image data URL holds no data")
    except binascii.Error as exc:
        raise ValueError("an image data URL's data is not valid base64") from exc
    return ImageSource(media_type=match.group(1).lower(), data=data)


def arguments_object(call: ToolCall) -> dict[str, Any]:
    """A tool call's arguments as the JSON object providers with native tool
    calls take (``{}`` for none); ``ValueError`` when they are not one (a
    model's broken JSON handed back in a later turn)."""
    if not call.arguments.strip():
        return {}
    try:
        value = msgspec.json.decode(call.arguments)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(f"the arguments of tool call {call.name!r} are not valid JSON") from exc
    if not isinstance(value, dict):
        # ValueError, as for bad JSON: the caller treats both as a bad request.
        raise ValueError(f"the arguments of tool call {call.name!r} are not a JSON object")  # noqa: TRY004
    return value
