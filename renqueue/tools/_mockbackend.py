"""A mock LLM server speaking the OpenAI chat-completions API, for demos, tests and benchmarks.

It behaves like the providers Ren-Queue routes to, in the ways routing cares
about: time to first token and token rate, declared rate limits enforced with
real 429s and rate-limit headers on every response in the dialect of the
provider it stands in for (``limit_style``: OpenAI's ``x-ratelimit-*`` by
default, Groq, Cerebras, OpenRouter, Anthropic, Gemini or the IETF fields; see
``_mocklimits``), quota-exhausted 429s on demand, a concurrency cap, random
failures, streaming (SSE with the ``include_usage`` final chunk and
``data: [DONE]``) and non-streaming answers. The generated text
is deterministic (``"tok0 tok1 tok2 ..."``) so tests can assert on content.

Endpoints::

    POST /v1/chat/completions   the API
    GET  /v1/models             the accepted model names
    GET  /stats                 counters (MockStats as JSON), incl. the last request body
    GET  /admin/settings        current MockSettings
    POST /admin/settings        change settings at runtime (a partial JSON object)
    GET  /health                200 "ok"

Why aiohttp: its server is a mature asyncio HTTP/1.1 server whose
``StreamResponse`` writes SSE from a plain coroutine, with keep-alive and low
per-request overhead (a C HTTP parser), so one process outruns the pipeline it
feeds. It is the optional ``mock`` extra and imported only here; nothing else
in Ren-Queue depends on it.

Speed matters (a benchmark must measure the pipeline, not this server): the
SSE chunk bytes for each token are built once per process, a request only
glues a per-request prefix to them, and an instant (``tokens_per_second=0``)
stream goes out in a single write.

Rate limits are token buckets, as OpenAI describes its own: ``rpm = N`` means
a bucket of ``N`` requests refilled continuously at ``N / 60`` per second (the
same for ``tpm`` and tokens, and for ``rpd`` over a day); the reset reported
is the time until the bucket is full again. A request is charged, when admitted, one request and
``prompt_tokens + completion_tokens`` tokens (prompt tokens = prompt characters
/ 4, rounded up; completion tokens = the planned output length). Rejected
requests (429, 400, busy) are not charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import random
import time
from collections.abc import Callable
from types import TracebackType
from typing import Annotated, Any, Final, Literal, Self

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from ..logs import get_logger
from ._mocklimits import (
    MockLimitStyle,
    Quota,
    format_reset,
    limit_headers,
    quota_exhausted,
    rate_limited,
)

__all__ = ["MockBackend", "MockSettings", "MockStats", "format_reset", "run_mock_backend", "serve"]

_log = get_logger("mock-backend")

Seconds = Annotated[float, Meta(ge=0)]
Limit = Annotated[int, Meta(ge=0)]


class MockSettings(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the mock behaves. Zero means "off" / "unlimited" for limits and rates.

    - ``models``: names accepted (others get 404 ``model_not_found``); empty = any.
    - ``ttft``: seconds before the first token.
    - ``tokens_per_second``: generation speed; 0 = all tokens at once.
    - ``output_tokens``: answer length; a request's ``max_tokens`` (or
      ``max_completion_tokens``) caps it, and then ``finish_reason`` is ``"length"``.
    - ``failure_rate``: share of admitted requests answered ``failure_status``
      (500) with an OpenAI-style error body.
    - ``seed``: seeds the failure draws, for reproducible runs.
    - ``rpm`` / ``tpm``: declared requests and tokens per minute, enforced with
      429s (see the module docstring).
    - ``concurrency``: requests generating at once; beyond it,
      ``busy_status`` (429 like a provider, or 503 like an overloaded server).
    - ``require_api_key``: when set, requests without ``Authorization: Bearer
      <it>`` get 401, whose message echoes the key sent (as some providers
      do), so tests can prove clients scrub keys from errors.
    - ``rpd``: declared requests per day (a bucket refilled over 24 hours),
      enforced with 429s like ``rpm``.
    - ``limit_style``: the provider dialect of the rate-limit headers and 429
      bodies (``openai``, ``groq``, ``cerebras``, ``openrouter``,
      ``openrouter-body``, ``anthropic``, ``gemini``, ``ietf``: see
      :mod:`._mocklimits` and docs/rate-limits.md).
    - ``quota_exhausted``: every chat request is refused with the dialect's
      quota-exhausted 429 (OpenAI ``insufficient_quota``, a per-day Gemini
      quota id, daily counters at 0 until UTC midnight), and not charged.
    """

    models: tuple[str, ...] = ()
    ttft: Seconds = 0.0
    tokens_per_second: Seconds = 0.0
    output_tokens: Annotated[int, Meta(ge=0, le=1_000_000)] = 16
    failure_rate: Annotated[float, Meta(ge=0, le=1)] = 0.0
    failure_status: Annotated[int, Meta(ge=400, le=599)] = 500
    seed: int | None = None
    rpm: Limit = 0
    tpm: Limit = 0
    #: The window ``rpm`` and ``tpm`` count over, in seconds (60: per minute;
    #: shorter compresses the clock, as tests and benchmarks do).
    rate_window: Annotated[float, Meta(gt=0)] = 60.0
    concurrency: Limit = 0
    busy_status: Literal[429, 503] = 429
    require_api_key: str | None = None
    rpd: Limit = 0
    limit_style: MockLimitStyle = "openai"
    quota_exhausted: bool = False


class MockStats(Struct, frozen=True, kw_only=True):
    """Counters since start. ``rate_limited`` counts every 429 (rate or busy);
    ``busy`` counts concurrency rejections (429 or 503); ``failed`` counts
    injected failures; ``disconnects`` counts clients that went away before
    their answer was complete (while sending the request, waiting or
    streaming: a normal event, never logged as an error); ``last_request`` is
    the last chat request body, as sent.
    """

    requests: int = 0
    streamed: int = 0
    completed: int = 0
    failed: int = 0
    rate_limited: int = 0
    busy: int = 0
    bad_requests: int = 0
    tokens_out: int = 0
    in_flight: int = 0
    max_in_flight_seen: int = 0
    disconnects: int = 0
    last_request: Any = None


class _Counters:
    __slots__ = (
        "bad_requests",
        "busy",
        "completed",
        "disconnects",
        "failed",
        "in_flight",
        "max_in_flight_seen",
        "rate_limited",
        "requests",
        "streamed",
        "tokens_out",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    requests: int
    streamed: int
    completed: int
    failed: int
    rate_limited: int
    busy: int
    bad_requests: int
    tokens_out: int
    in_flight: int
    max_in_flight_seen: int
    disconnects: int


# ------------------------------------------------------------ request shape


class _InMessage(Struct):
    role: str
    content: str | list[Any] | None = None


class _StreamOptions(Struct):
    include_usage: bool = False


class _ChatBody(Struct):
    model: str
    messages: Annotated[list[_InMessage], Meta(min_length=1)]
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None


class _Plan(Struct, frozen=True, kw_only=True):
    """What one admitted request will get."""

    request_id: str
    model: str
    settings: MockSettings
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    include_usage: bool

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


_BODY_DECODER: Final = msgspec.json.Decoder(_ChatBody)
_ENCODER: Final = msgspec.json.Encoder()
#: The window rpd is counted over.
_DAY: Final = 86400.0


def _prompt_tokens(body: _ChatBody) -> int:
    chars = 0
    for message in body.messages:
        if isinstance(message.content, str):
            chars += len(message.content)
        elif isinstance(message.content, list):
            for part in message.content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
    return -(-chars // 4)


# ------------------------------------------------------------ generated text
# Token i is "tok<i>", separated by spaces. The SSE piece after the per-request
# prefix is precomputed per token (tokens need no JSON escaping).

_TOKENS: list[str] = []
_PIECES: list[bytes] = []


def _ensure_tokens(count: int) -> None:
    for index in range(len(_TOKENS), count):
        token = f"tok{index}" if index == 0 else f" tok{index}"
        _TOKENS.append(token)
        _PIECES.append(b'{"content":"' + token.encode() + b'"},"finish_reason":null}]}\n\n')


_ensure_tokens(4096)


def _text(count: int) -> str:
    _ensure_tokens(count)
    return "".join(_TOKENS[:count])


class _Bucket:
    """A token bucket: ``capacity`` per ``window`` seconds, refilled continuously."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, capacity: int, window: float, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / window
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait(self, need: int) -> float:
        """Seconds until ``need`` fits (0 if it fits now)."""
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def reset(self) -> float:
        return (self.capacity - self.level) / self.rate


def _error_body(message: str, type_: str, code: str | None) -> bytes:
    return _ENCODER.encode({"error": {"message": message, "type": type_, "code": code}})


class _State(enum.Enum):
    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSED = "closed"


class MockBackend:
    """The mock server, as an async context manager on ``host:port`` (0 = any free port).

    ``url`` is the OpenAI base URL (ending in ``/v1``); ``stats()`` and
    ``update()`` read counters and change settings in-process, the same as
    ``GET /stats`` and ``POST /admin/settings`` over HTTP.
    """

    def __init__(
        self,
        settings: MockSettings | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 1.0,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._port = 0
        self._shutdown_timeout = shutdown_timeout
        self._state = _State.UNOPENED
        self._runner: web.AppRunner | None = None
        self._counters = _Counters()
        self._last_request: bytes | None = None
        self._ids = itertools.count()
        self._settings = MockSettings()
        self._rng = random.Random()
        self._requests_bucket: _Bucket | None = None
        self._tokens_bucket: _Bucket | None = None
        self._daily_bucket: _Bucket | None = None
        self._apply(settings or MockSettings())

    # ----------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind and start serving."""
        if self._state is not _State.UNOPENED:
            raise RuntimeError(f"cannot start a mock backend that is {self._state.value}")
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/admin/settings", self._get_settings)
        app.router.add_post("/admin/settings", self._post_settings)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self._shutdown_timeout)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._requested_port, backlog=1024)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        self._state = _State.RUNNING

    async def aclose(self) -> None:
        """Stop serving (in-flight streams get ``shutdown_timeout`` to end). Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """The base URL clients use, ending in ``/v1``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}/v1"

    @property
    def settings(self) -> MockSettings:
        return self._settings

    def update(self, **changes: Any) -> MockSettings:
        """Change some settings now (validated; ``msgspec.ValidationError`` if invalid)."""
        merged = {**msgspec.structs.asdict(self._settings), **changes}
        settings = msgspec.convert(merged, MockSettings)
        self._apply(settings)
        return settings

    def stats(self) -> MockStats:
        c = self._counters
        last = msgspec.json.decode(self._last_request) if self._last_request else None
        return MockStats(
            requests=c.requests,
            streamed=c.streamed,
            completed=c.completed,
            failed=c.failed,
            rate_limited=c.rate_limited,
            busy=c.busy,
            bad_requests=c.bad_requests,
            tokens_out=c.tokens_out,
            in_flight=c.in_flight,
            max_in_flight_seen=c.max_in_flight_seen,
            disconnects=c.disconnects,
            last_request=last,
        )

    def _apply(self, settings: MockSettings) -> None:
        """Install settings; new limits start with full buckets, a new seed reseeds."""
        old = self._settings
        if settings.seed is not None and (
            settings.seed != old.seed or self._state is _State.UNOPENED
        ):
            self._rng.seed(settings.seed)
        now = time.monotonic()
        window_changed = settings.rate_window != old.rate_window
        if self._state is _State.UNOPENED or settings.rpm != old.rpm or window_changed:
            self._requests_bucket = (
                _Bucket(settings.rpm, settings.rate_window, now) if settings.rpm else None
            )
        if self._state is _State.UNOPENED or settings.tpm != old.tpm or window_changed:
            self._tokens_bucket = (
                _Bucket(settings.tpm, settings.rate_window, now) if settings.tpm else None
            )
        if self._state is _State.UNOPENED or settings.rpd != old.rpd:
            self._daily_bucket = _Bucket(settings.rpd, _DAY, now) if settings.rpd else None
        self._settings = settings

    # ----------------------------------------------------------- handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        names = self._settings.models or ("mock",)
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "renqueue"} for n in names]
        return _json({"object": "list", "data": data})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.Response(body=_ENCODER.encode(self.stats()), content_type="application/json")

    async def _get_settings(self, request: web.Request) -> web.Response:
        return web.Response(body=_ENCODER.encode(self._settings), content_type="application/json")

    async def _post_settings(self, request: web.Request) -> web.Response:
        try:
            changes = msgspec.json.decode(await request.read())
            if not isinstance(changes, dict):
                raise msgspec.ValidationError("expected a JSON object of settings")
            settings = self.update(**changes)
        except (msgspec.DecodeError, TypeError) as exc:
            return _error(400, f"invalid settings: {exc}", "invalid_request_error", None)
        _log.info("mock settings changed", changes=sorted(changes))
        return web.Response(body=_ENCODER.encode(settings), content_type="application/json")

    def _buckets(self) -> list[tuple[str, float, _Bucket]]:
        """The declared buckets, as (kind, window, bucket)."""
        return [
            (kind, window, bucket)
            for kind, window, bucket in (
                ("requests", self._settings.rate_window, self._requests_bucket),
                ("tokens", self._settings.rate_window, self._tokens_bucket),
                ("requests", _DAY, self._daily_bucket),
            )
            if bucket is not None
        ]

    def _quotas(self) -> list[Quota]:
        """Every declared bucket as of now (refilled), for the limit headers."""
        now = time.monotonic()
        quotas = []
        for kind, window, bucket in self._buckets():
            bucket.refill(now)
            quotas.append(_quota(kind, window, bucket))
        return quotas

    def _limit_headers(self) -> dict[str, str]:
        """The rate-limit headers of ``limit_style`` for the declared limits, as of now."""
        return limit_headers(self._settings.limit_style, self._quotas(), time.time())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        counters = self._counters
        counters.requests += 1
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        settings = self._settings
        if (refused := self._refuse(request, body, settings)) is not None:
            return refused
        cap = body.max_completion_tokens or body.max_tokens
        plan = _Plan(
            request_id=f"chatcmpl-mock-{next(self._ids)}",
            model=body.model,
            settings=settings,
            prompt_tokens=_prompt_tokens(body),
            completion_tokens=settings.output_tokens
            if cap is None
            else min(cap, settings.output_tokens),
            finish_reason="length" if cap is not None and cap < settings.output_tokens else "stop",
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
        )
        tokens = plan.prompt_tokens + plan.completion_tokens
        if (limited := self._take_quota(tokens, body.model)) is not None:
            counters.rate_limited += 1
            return limited
        headers = self._limit_headers()
        if settings.failure_rate and self._rng.random() < settings.failure_rate:
            counters.failed += 1
            return _error(
                settings.failure_status,
                "The server had an error while processing your request (injected failure).",
                "server_error",
                "injected_failure",
                headers,
            )
        counters.in_flight += 1
        counters.max_in_flight_seen = max(counters.max_in_flight_seen, counters.in_flight)
        try:
            if body.stream:
                counters.streamed += 1
                return await self._stream(request, headers, plan)
            return await self._complete(request, headers, plan)
        finally:
            counters.in_flight -= 1

    async def _read_body(self, request: web.Request) -> _ChatBody | web.Response:
        """The request body, or the answer when it cannot be had (400, or 499 if gone)."""
        try:
            raw = await request.read()
        except ConnectionError:
            # The client went away before its request was in: nothing to answer.
            return self._gone()
        try:
            body = _BODY_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            self._counters.bad_requests += 1
            return _error(400, f"invalid request body: {exc}", "invalid_request_error", None)
        self._last_request = raw
        return body

    def _refuse(
        self, request: web.Request, body: _ChatBody, settings: MockSettings
    ) -> web.Response | None:
        """The answer for a request that must not run (401, 404, quota exhausted,
        busy), else ``None``."""
        if settings.require_api_key is not None:
            sent = request.headers.get("Authorization", "")
            if sent != f"Bearer {settings.require_api_key}":
                given = sent.removeprefix("Bearer ")
                return _error(
                    401,
                    f"Incorrect API key provided: {given}.",
                    "invalid_request_error",
                    "invalid_api_key",
                )
        if settings.models and body.model not in settings.models:
            return _error(
                404,
                f"The model `{body.model}` does not exist or you do not have access to it.",
                "invalid_request_error",
                "model_not_found",
            )
        counters = self._counters
        if settings.quota_exhausted:
            counters.rate_limited += 1
            headers, payload = quota_exhausted(
                settings.limit_style,
                self._quotas(),
                daily=settings.rpd,
                model=body.model,
                now=time.time(),
            )
            return _raw_error(429, payload, headers)
        if settings.concurrency and counters.in_flight >= settings.concurrency:
            counters.busy += 1
            status = settings.busy_status
            if status == 429:
                counters.rate_limited += 1
            return _error(
                status,
                f"Too many concurrent requests (limit {settings.concurrency})",
                "requests" if status == 429 else "server_error",
                "concurrency_limit_exceeded",
                {"retry-after": "1", **self._limit_headers()},
            )
        return None

    def _take_quota(self, tokens: int, model: str) -> web.Response | None:
        """Charge one request and ``tokens``; a 429 response if any bucket lacks room."""
        now = time.monotonic()
        waits: list[tuple[float, str, float, _Bucket, int]] = []
        for kind, window, bucket in self._buckets():
            need = tokens if kind == "tokens" else 1
            bucket.refill(now)
            waits.append((bucket.wait(need), kind, window, bucket, need))
        blocked = [entry for entry in waits if entry[0] > 0]
        if not blocked:
            for *_, bucket, need in waits:
                bucket.level -= need
            return None
        wait, kind, window, bucket, need = max(blocked, key=lambda entry: entry[0])
        quotas = [_quota(k, w, b) for _, k, w, b, _ in waits]
        headers, payload = rate_limited(
            self._settings.limit_style,
            quotas,
            _quota(kind, window, bucket),
            wait=wait,
            need=need,
            model=model,
            now=time.time(),
        )
        return _raw_error(429, payload, headers)

    async def _stream(
        self, request: web.Request, headers: dict[str, str], plan: _Plan
    ) -> web.StreamResponse:
        """SSE: a role chunk, the tokens at the configured pace, finish, usage, [DONE]."""
        counters = self._counters
        count = plan.completion_tokens
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        prefix = (
            b'data: {"id":"' + plan.request_id.encode() + b'","object":"chat.completion.chunk",'
            b'"created":' + str(int(time.time())).encode() + b',"model":'
        ) + _ENCODER.encode(plan.model)
        choice = prefix + b',"choices":[{"index":0,"delta":'
        opening = choice + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
        closing = choice + b'{},"finish_reason":"' + plan.finish_reason.encode() + b'"}]}\n\n'
        if plan.include_usage:
            closing += prefix + b',"choices":[],"usage":' + _ENCODER.encode(plan.usage()) + b"}\n\n"
        closing += b"data: [DONE]\n\n"
        _ensure_tokens(count)
        pieces = _PIECES
        rate = plan.settings.tokens_per_second
        loop = asyncio.get_running_loop()
        try:
            # Sending the headers fails too if the client is already gone.
            await response.prepare(request)
            if plan.settings.ttft:
                await asyncio.sleep(plan.settings.ttft)
            start = loop.time()
            sent = 0
            batch = [opening]
            while True:
                # Everything due by now goes out in one write: token i is due
                # at start + i / rate (all at once when rate is 0).
                due = count if not rate else min(count, int((loop.time() - start) * rate) + 1)
                due = max(due, min(sent + 1, count))
                batch.extend(choice + pieces[index] for index in range(sent, due))
                if due == count:
                    batch.append(closing)
                await response.write(b"".join(batch))
                counters.tokens_out += due - sent
                sent = due
                if sent == count:
                    break
                batch = []
                await asyncio.sleep(max(0.0, start + sent / rate - loop.time()))
            await response.write_eof()
        except ConnectionError:
            # The client went away (a worker cancelled or preempted the call):
            # an ordinary event, counted, not an error to log. Stop generating.
            counters.disconnects += 1
            return response
        counters.completed += 1
        return response

    async def _complete(
        self, request: web.Request, headers: dict[str, str], plan: _Plan
    ) -> web.Response:
        """One JSON answer, after the time the whole generation would take."""
        settings = plan.settings
        count = plan.completion_tokens
        rate = settings.tokens_per_second
        if delay := settings.ttft + (count / rate if rate else 0.0):
            await asyncio.sleep(delay)
            transport = request.transport
            if transport is None or transport.is_closing():
                return self._gone()
        payload = {
            "id": plan.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": plan.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": _text(count)},
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": plan.usage(),
        }
        self._counters.tokens_out += count
        self._counters.completed += 1
        return web.Response(
            body=_ENCODER.encode(payload), headers=headers, content_type="application/json"
        )

    def _gone(self) -> web.Response:
        """The answer to a client that disconnected: counted; aiohttp drops it quietly."""
        self._counters.disconnects += 1
        return web.Response(status=499, reason="Client Closed Request")


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=_ENCODER.encode(payload), status=status, content_type="application/json"
    )


def _quota(kind: str, window: float, bucket: _Bucket) -> Quota:
    return Quota(
        kind="tokens" if kind == "tokens" else "requests",
        window=window,
        capacity=bucket.capacity,
        remaining=int(bucket.level),
        reset=bucket.reset(),
    )


def _raw_error(status: int, body: bytes, headers: dict[str, str]) -> web.Response:
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def _error(
    status: int,
    message: str,
    type_: str,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=_error_body(message, type_, code),
        status=status,
        headers=headers,
        content_type="application/json",
    )


async def serve(
    settings: MockSettings | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run a mock backend until cancelled; log its URL and pass it to ``on_ready``."""
    async with MockBackend(settings, host=host, port=port) as mock:
        _log.info(
            "mock backend listening", url=mock.url, settings=msgspec.to_builtins(mock.settings)
        )
        if on_ready is not None:
            on_ready(mock.url)
        await asyncio.Event().wait()


def run_mock_backend(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ttft: float = 0.0,
    tps: float = 0.0,
    output_tokens: int = 16,
    failure_rate: float = 0.0,
    rpm: int = 0,
    tpm: int = 0,
    rpd: int = 0,
    limit_style: str = "openai",
    concurrency: int = 0,
    model: str | None = None,
    seed: int | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Blocking entry point for ``renqueue mock-backend``: one keyword per CLI flag.

    ``rpm``/``tpm`` are per-minute limits, ``rpd`` per day (0 = none);
    ``limit_style`` the header dialect; ``model`` restricts the
    accepted model name (``None`` = any). Returns on Ctrl-C.
    """
    try:
        settings = msgspec.convert(
            {
                "models": [model] if model else [],
                "ttft": ttft,
                "tokens_per_second": tps,
                "output_tokens": output_tokens,
                "failure_rate": failure_rate,
                "seed": seed,
                "rpm": rpm,
                "tpm": tpm,
                "rpd": rpd,
                "limit_style": limit_style,
                "concurrency": concurrency,
            },
            MockSettings,
        )
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid mock backend option: {exc}") from exc
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, host, port, on_ready=on_ready))
