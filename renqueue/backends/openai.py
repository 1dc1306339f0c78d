"""The adapter for the OpenAI chat-completions wire format.

One format covers most of what Ren-Queue routes to: vLLM, Ollama (``/v1``),
llama.cpp, LM Studio, Groq, OpenRouter, Together, Cerebras and OpenAI itself
all answer ``POST {base_url}/chat/completions``. So this one adapter, given a
:class:`~renqueue.config.BackendConfig`, is most backends.

What it owns, and why:

- **One pooled** :class:`httpx.AsyncClient` per adapter (or one injected and
  shared between adapters): connection reuse is most of the per-request cost
  on a fast local backend.
- **Error mapping at the boundary, once.** Every HTTP status, transport error
  and broken stream leaves as a :class:`~renqueue.errors.BackendError`
  subclass the worker can act on: wait (``RateLimitedError.retry_after``),
  retry (``RetryableBackendError``), stop using this backend
  (``FatalBackendError``) or fail the request (``BadRequestError``).
- **Rate limits the provider reports** (headers of every response, and the
  error body of a 429, in the dialect ``config.limit_style`` names: see
  :mod:`._limits`) are read into :attr:`OpenAIBackend.last_rate_limit`, so the
  limiter can learn the provider's real limits instead of trusting the
  declared ones; a 429's :class:`~renqueue.errors.RateLimitedError` carries
  when to retry and whether the quota is exhausted.
- **The key stays secret.** It is sent only as ``Authorization: Bearer``, kept
  in an :class:`httpx.Headers` (whose repr masks it) and scrubbed from every
  error message, including provider bodies that echo it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Final, Self

import httpx
import msgspec
from msgspec import Struct

from ..config import BackendConfig, parse_duration
from ..errors import (
    BackendError,
    BadRequestError,
    ConfigError,
    FailureClass,
    FatalBackendError,
    RateLimitedError,
    RetryableBackendError,
)
from ..wire._messages import InferenceRequest, Usage
from ._limits import LearnedLimits, parse_limits
from ._sse import ServerSentEvent, SSEDecoder, SSEError
from .base import Delta, Generation

__all__ = ["OpenAIBackend"]

#: Longest provider error text carried into an exception message.
_DETAIL_LIMIT: Final = 300


# ----------------------------------------------------------------- wire types
# Only the fields we read; msgspec skips the rest. Loose types (``| None``)
# because "OpenAI-compatible" servers differ in what they leave out or null.


#: Concurrent calls per connection pool (see ``OpenAIBackend.__init__``).
_CALLS_PER_POOL: Final = 8


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
_ENCODER: Final = msgspec.json.Encoder()
_PARAM_FIELDS: Final = ("max_tokens", "temperature", "top_p", "stop", "seed")


def _error_detail(body: bytes) -> str:
    """The provider's error text: JSON ``error.message`` (or a close variant), else the body."""
    try:
        data: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        text = body.decode("utf-8", errors="replace").strip()
    else:
        text = ""
        if isinstance(data, dict):
            error = data.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                text = error["message"]
            elif isinstance(error, str):
                text = error  # Ollama: {"error": "model 'x' not found"}
            elif isinstance(data.get("message"), str):
                text = data["message"]  # vLLM: {"object": "error", "message": ...}
            elif isinstance(data.get("detail"), str):
                text = data["detail"]  # FastAPI-based servers
        if not text:
            text = body.decode("utf-8", errors="replace").strip()
    text = " ".join(text.split())
    if len(text) > _DETAIL_LIMIT:
        text = text[: _DETAIL_LIMIT - 3] + "..."
    return text or "(empty body)"


#: Error codes and message fragments (lower case) that say the prompt does
#: not fit the model's context: OpenAI and vLLM ("maximum context length"),
#: llama.cpp ("exceeds the available context size"), TGI ("must be <= ..."
#: tokens), Anthropic ("prompt is too long"), Gemini ("exceeds the maximum
#: number of tokens"), Ollama and others.
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


def _bad_request_class(body: bytes) -> FailureClass:
    """The class of a 4xx that blames the request: context length, content
    filter, or neither. Judged by the error's code and its message only, never
    by the rest of the body: servers echo the input in validation errors, and
    a prompt saying "context window" must not send a bad request down the route."""
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
    if code in _FILTER_CODES:
        return FailureClass.CONTENT_FILTER
    lowered = message[:2000].lower()
    if code in _CONTEXT_CODES or any(phrase in lowered for phrase in _CONTEXT_PHRASES):
        return FailureClass.CONTEXT_LENGTH
    return FailureClass.BAD_REQUEST


def _estimate_prompt_tokens(request: InferenceRequest) -> int:
    """About four characters per token: the usual rule of thumb for English text."""
    chars = sum(len(message.content) for message in request.messages)
    return -(-chars // 4)


def _usage(wire: _WireUsage | None, request: InferenceRequest, completion_estimate: int) -> Usage:
    """The reported usage, each missing count filled in with an estimate."""
    prompt = wire.prompt_tokens if wire is not None else None
    completion = wire.completion_tokens if wire is not None else None
    return Usage(
        prompt_tokens=prompt if prompt is not None else _estimate_prompt_tokens(request),
        completion_tokens=completion if completion is not None else completion_estimate,
    )


class _StreamState:
    """Folds server-sent events into text, finish reason and usage."""

    __slots__ = ("deltas", "done", "finish_reason", "usage")

    def __init__(self) -> None:
        self.done = False
        self.deltas = 0
        self.finish_reason: str | None = None
        self.usage: _WireUsage | None = None

    def feed(self, event: ServerSentEvent) -> str:
        """Take one event; return the text it adds ("" for none).

        Raises ``msgspec.DecodeError`` for a chunk that is not valid JSON of
        the expected shape, ``LookupError`` for an in-band error: an
        ``error`` field in the data, or an event of type ``error``.
        """
        data = event.data
        if event.event == "error":
            raise LookupError(data or "error event in stream")
        if data == "[DONE]":
            self.done = True
            return ""
        chunk = _CHUNK_DECODER.decode(data)
        if chunk.error is not None:
            message = chunk.error if isinstance(chunk.error, str) else chunk.error.message
            raise LookupError(message or "error event in stream")
        if chunk.usage is not None:
            self.usage = chunk.usage
        text = ""
        for choice in chunk.choices or ():
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
            if choice.delta is not None and choice.delta.content:
                text += choice.delta.content
        if text:
            self.deltas += 1
        return text


class OpenAIBackend:
    """A backend that speaks the OpenAI chat-completions API.

    Safe to share between concurrent calls. ``client`` lets several adapters
    share one connection pool; an injected client is never closed here.
    ``send_priority`` adds the request's priority rank as the ``priority``
    body field, which vLLM's priority scheduler reads (lower = sooner) and
    most other servers reject or ignore, hence off by default.

    Usage: when the backend reports none (some servers ignore
    ``stream_options.include_usage``), it is estimated: prompt tokens as
    prompt characters / 4, completion tokens as the number of content deltas
    (streaming, about one token each) or output characters / 4 (not
    streaming). Estimates are good enough for quota accounting, not billing.
    """

    def __init__(
        self,
        name: str,
        config: BackendConfig,
        *,
        client: httpx.AsyncClient | None = None,
        send_priority: bool = False,
    ) -> None:
        self._name = name
        self._config = config
        self._send_priority = send_priority
        self._url = config.base_url.rstrip("/") + "/chat/completions"
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
        base_headers = {"Content-Type": "application/json"}
        if self._key:
            base_headers["Authorization"] = f"Bearer {self._key}"
        # httpx.Headers masks Authorization in its repr.
        self._stream_headers = httpx.Headers({**base_headers, "Accept": "text/event-stream"})
        self._json_headers = httpx.Headers({**base_headers, "Accept": "application/json"})
        self._owns_client = client is None
        if client is None:
            # Several small pools instead of one big one: httpcore rescans
            # every connection of a pool on each request start and close, so
            # its cost per call grows with the pool (encode/httpcore#1035; at
            # 64 concurrent calls, one pool spent ~5 ms of CPU per call, eight
            # pools ~2 ms: bench/README.md). Each pool has room for its share
            # of the declared concurrency; the broker, not the pool, bounds load.
            concurrency = config.limits.concurrency
            shards = max(1, min(16, -(-concurrency // _CALLS_PER_POOL)))
            per_pool = -(-concurrency // shards) + 4
            self._pools = [
                httpx.AsyncClient(
                    timeout=self._timeout,
                    limits=httpx.Limits(
                        max_connections=per_pool, max_keepalive_connections=per_pool
                    ),
                )
                for _ in range(shards)
            ]
        else:
            self._pools = [client]
        self._busy = [0] * len(self._pools)
        self._closed = False
        #: The latest rate-limit reading from this backend (any call,
        #: including 429s); ``None`` until a response says anything about limits.
        self.last_rate_limit: LearnedLimits | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> BackendConfig:
        return self._config

    def __repr__(self) -> str:
        return (
            f"OpenAIBackend(name={self._name!r}, model={self._config.model!r}, url={self._url!r})"
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool, unless it was injected. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            for pool in self._pools:
                await pool.aclose()

    @contextlib.contextmanager
    def _pool(self) -> Iterator[httpx.AsyncClient]:
        """The least busy connection pool, counted busy for the duration."""
        index = min(range(len(self._busy)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            yield self._pools[index]
        finally:
            self._busy[index] -= 1

    # ------------------------------------------------------------- calls

    async def stream(
        self, request: InferenceRequest, *, priority: int | None = None
    ) -> AsyncIterator[Delta]:
        """Yield text deltas as the backend generates them, then one ``Delta`` with usage.

        Closing the generator early closes the HTTP response, so the backend
        sees the disconnect and stops generating. A failure after text was
        yielded is :attr:`~renqueue.errors.FailureClass.BROKEN_STREAM`
        (its cause in the message); a stream that ends without ``[DONE]`` is
        complete only if it gave a finish reason.
        """
        body = self._body(request, priority, stream=True)
        state = _StreamState()
        clock = _Clock(self._first_token_timeout, self._total_timeout)
        try:
            with self._pool() as pool:
                async for delta in self._stream_from(pool, body, state, request, clock):
                    clock.first_token()
                    yield delta
            if not state.done and state.finish_reason is None:
                raise RetryableBackendError(
                    "stream ended before [DONE]",
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
        yield Delta(
            usage=_usage(state.usage, request, state.deltas), finish_reason=state.finish_reason
        )

    async def _stream_from(
        self,
        pool: httpx.AsyncClient,
        body: bytes,
        state: _StreamState,
        request: InferenceRequest,
        clock: _Clock,
    ) -> AsyncIterator[Delta]:
        """The SSE parse (:mod:`._sse`). Everything that arrived in one network
        read becomes one :class:`Delta`: a fast backend's burst of tokens costs
        one publish downstream, and a slow one's single token is not held back.

        Each wait on the network is bounded by the clock's next deadline (the
        first token's, else the whole call's): never across a ``yield``, so a
        slow consumer is not cut off by it."""
        call = pool.stream(
            "POST", self._url, content=body, headers=self._stream_headers, timeout=self._timeout
        )
        async with clock.bounded():
            response = await call.__aenter__()
        try:
            if not response.is_success:
                async with clock.bounded():
                    await response.aread()
                raise self._status_error(response, request)
            self._observe(response)
            if "text/event-stream" not in response.headers.get("content-type", ""):
                # A server that ignored "stream": true and sent one JSON body.
                async with clock.bounded():
                    raw = await response.aread()
                generation = self._generation(raw, request)
                if generation.text:
                    yield Delta(text=generation.text)
                state.done = True
                state.usage = _WireUsage(
                    prompt_tokens=generation.usage.prompt_tokens,
                    completion_tokens=generation.usage.completion_tokens,
                )
                state.finish_reason = generation.finish_reason
                return
            decoder = SSEDecoder()
            pieces = response.aiter_bytes().__aiter__()
            try:
                while True:
                    try:
                        async with clock.bounded():
                            piece = await anext(pieces)
                    except StopAsyncIteration:
                        break
                    text = ""
                    for event in decoder.feed(piece):
                        text += self._feed(state, event, request)
                    if text:
                        yield Delta(text=text)
                # The spec drops an event whose blank line never came; a bare
                # [DONE] there is taken (servers that close right after it).
                last = decoder.finish()
            except SSEError as exc:
                raise RetryableBackendError(
                    f"malformed stream: {exc}",
                    backend=self._name,
                    request_id=request.id,
                    failure=FailureClass.MALFORMED,
                ) from exc
            if last is not None and last.data == "[DONE]":
                state.done = True
        finally:
            await call.__aexit__(None, None, None)

    async def complete(
        self, request: InferenceRequest, *, priority: int | None = None
    ) -> Generation:
        """The whole answer from one non-streaming call (bounded by ``total_timeout``)."""
        body = self._body(request, priority, stream=False)
        clock = _Clock(None, self._total_timeout)
        try:
            with self._pool() as pool:
                async with clock.bounded():
                    response = await pool.post(
                        self._url, content=body, headers=self._json_headers, timeout=self._timeout
                    )
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, request, clock) from exc
        except TimeoutError as exc:
            raise clock.timed_out(self._name, request) from exc
        if not response.is_success:
            raise self._status_error(response, request)
        self._observe(response)
        return self._generation(response.content, request)

    # ------------------------------------------------------------- helpers

    def _body(self, request: InferenceRequest, priority: int | None, *, stream: bool) -> bytes:
        if self._closed:
            raise FatalBackendError("adapter is closed", backend=self._name, request_id=request.id)
        body: dict[str, Any] = {"model": self._config.model, "messages": request.messages}
        params = request.params
        for field in _PARAM_FIELDS:
            value = getattr(params, field)
            if value is not None:
                body[field] = value
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self._send_priority and priority is not None:
            body["priority"] = priority
        return _ENCODER.encode(body)

    def _observe(self, response: httpx.Response, body: bytes | None = None) -> LearnedLimits:
        """Read what ``response`` (and its error ``body``) says about our limits."""
        limits = parse_limits(
            response.headers,
            now=time.time(),
            status=response.status_code,
            body=body,
            style=self._config.limit_style,
        )
        if not limits.empty:
            self.last_rate_limit = limits
        return limits

    def _feed(self, state: _StreamState, event: ServerSentEvent, request: InferenceRequest) -> str:
        try:
            return state.feed(event)
        except msgspec.DecodeError as exc:
            raise RetryableBackendError(
                f"malformed stream chunk: {self._redact(str(exc))}",
                backend=self._name,
                request_id=request.id,
                failure=FailureClass.MALFORMED,
            ) from exc
        except LookupError as exc:
            # An error sent in-band (OpenAI, OpenRouter: ``data: {"error": ...}``):
            # the server failed while answering.
            raise RetryableBackendError(
                f"error in stream: {self._redact(_error_detail(str(exc).encode()))}",
                backend=self._name,
                request_id=request.id,
                failure=FailureClass.SERVER_ERROR,
            ) from None  # the LookupError is ours; it adds nothing

    def _generation(self, body: bytes, request: InferenceRequest) -> Generation:
        try:
            completion = _COMPLETION_DECODER.decode(body)
        except msgspec.DecodeError as exc:
            raise RetryableBackendError(
                f"malformed response body: {self._redact(str(exc))}",
                backend=self._name,
                request_id=request.id,
                failure=FailureClass.MALFORMED,
            ) from exc
        if not completion.choices:
            raise RetryableBackendError(
                "response has no choices",
                backend=self._name,
                request_id=request.id,
                failure=FailureClass.MALFORMED,
            )
        choice = completion.choices[0]
        text = (choice.message.content if choice.message else None) or ""
        return Generation(
            text=text,
            usage=_usage(completion.usage, request, -(-len(text) // 4)),
            finish_reason=choice.finish_reason,
        )

    def _redact(self, text: str) -> str:
        """Scrub the key from text that came from outside (bodies, foreign errors)."""
        return text.replace(self._key, "***") if self._key else text

    def _status_error(self, response: httpx.Response, request: InferenceRequest) -> BackendError:
        status = response.status_code
        message = f"HTTP {status}: {self._redact(_error_detail(response.content))}"
        fields: dict[str, Any] = {"backend": self._name, "request_id": request.id}
        limits = self._observe(response, response.content)
        if status == 429:
            return RateLimitedError(
                message,
                retry_after=limits.retry_after(),
                quota_exhausted=limits.quota_exhausted,
                quota_exhausted_until=limits.quota_exhausted_until,
                **fields,
            )
        if status in (503, 529):  # overloaded (529: Anthropic's) or not ready yet
            return RetryableBackendError(
                message, status=status, failure=FailureClass.OVERLOADED, **fields
            )
        if status in (408, 409) or status >= 500:
            return RetryableBackendError(
                message, status=status, failure=FailureClass.SERVER_ERROR, **fields
            )
        if status in (400, 413, 422):
            failure = _bad_request_class(response.content)
            return BadRequestError(message, status=status, failure=failure, **fields)
        # 401, 403, 404 and anything else unexpected (402 out of credits, 405,
        # a redirect): this backend's configuration is what's wrong.
        return FatalBackendError(message, status=status, failure=FailureClass.UNAVAILABLE, **fields)

    def _transport_error(
        self, exc: httpx.HTTPError, request: InferenceRequest, clock: _Clock
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

    def _after_tokens(self, error: BackendError, clock: _Clock) -> BackendError:
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


class _Clock:
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

    def bounded(self) -> asyncio.Timeout:
        """A scope for one wait on the network: it ends at the next deadline."""
        return asyncio.timeout_at(self.deadline())

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
