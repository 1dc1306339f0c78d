"""A mock LLM server speaking the providers' APIs, for demos, tests and benchmarks.

It speaks the OpenAI chat-completions API and, at their own paths, Anthropic
Messages, Ollama's ``/api/chat``, TGI's ``/generate_stream`` and Gemini's
``streamGenerateContent`` (``dialects`` has each wire format; every
setting and fault below applies to each). It behaves like the providers
Ren-Queue routes to, in the ways routing cares about: time to first token and
token rate, declared rate limits enforced with real 429s and rate-limit
headers on every response in the dialect of the provider it stands in for
(``limit_style``: OpenAI's ``x-ratelimit-*`` by default, Groq, Cerebras,
OpenRouter, Anthropic, Gemini or the IETF fields; see ``_rate_limits``),
quota-exhausted 429s on demand, a concurrency cap, random failures, streaming
(SSE with the ``include_usage`` final chunk and ``data: [DONE]``) and
non-streaming answers. The generated text is deterministic (``"tok0 tok1 tok2
..."``) so tests can assert on content.

Tool calls: an OpenAI or Ollama request that offers tools gets a tool call
instead of (OpenAI) or after (Ollama) its text when it asks for one:
``tool_choice`` naming a tool calls that one, ``"required"`` the first
tool, and otherwise a last user message saying ``call <name>`` calls the
tool of that name (``tool_choice: "none"`` never calls one). The call's
arguments are ``{"text": "tok0 tok1 ..."}`` (the answer's tokens, streamed
in pieces, one per token: ``dialects.tool_arguments``) and its finish
reason ``tool_calls``. OpenAI requests with ``logprobs`` get log
probabilities (``top_logprobs`` alternatives each). The request's tools,
tool calls, tool results, images and response format are checked against
the provider's schema: a wrong shape gets the provider's 400.

Fault injection (``_fault_injection`` has the kinds and their exact wire format):
the ``faults`` setting scripts faults for chat requests in arrival order
and/or draws them at random (with ``seed``): ``500``, ``503`` (overloaded),
``529`` (Anthropic overloaded), ``reset``, ``hang``, ``drip``, ``429``,
``429_bare`` (no retry-after), ``quota``, ``malformed``, ``break``,
``no_done``, ``sse_error``, ``context_length``, ``content_filter`` and
``filtered``; ``down = true`` resets every connection until set back, and
``context_window = N`` refuses prompts over ``N`` tokens with OpenAI's
``context_length_exceeded`` 400. For example, at start-up::

    renqueue mock-backend --fault-script 500,ok,reset --fault 503=0.1 --context-window 4096

or at run time (``faults`` is replaced whole, and restarts its script)::

    POST /admin/settings {"faults": {"script": ["break", "ok"], "repeat": true}}
    POST /admin/settings {"faults": {"random": {"reset": 0.05, "429": 0.1}}, "seed": 1}
    POST /admin/settings {"down": true}

Endpoints (``MockBackend.url_for(adapter)`` is an adapter's ``base_url``)::

    POST /v1/chat/completions   the OpenAI API
    POST /v1/messages           Anthropic Messages (anthropic-ratelimit-* headers)
    POST /api/chat              Ollama's native chat (JSON lines)
    POST /generate_stream       TGI (and POST /generate, not streamed)
    POST /v1beta/models/<m>:streamGenerateContent?alt=sse
                                Gemini (and :generateContent; 429s as RESOURCE_EXHAUSTED)
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
import math
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Annotated, Any, Final, Literal, Self

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from ..logs import get_logger
from ._fault_injection import (
    STREAM_ONLY,
    FaultKind,
    FaultSchedule,
    FaultSpec,
    parse_fault_rates,
    parse_fault_script,
)
from ._rate_limits import (
    MockLimitStyle,
    Quota,
    format_reset,
    limit_headers,
    quota_exhausted,
    rate_limited,
)
from .dialects import (
    DIALECTS,
    Call,
    Dialect,
    ErrorKind,
    Frames,
    GeminiDialect,
    Reply,
    Target,
    token_text,
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
    - ``faults``: scripted and random faults (:class:`._mockfaults.FaultSpec`;
      the kinds and their wire formats are in :mod:`._mockfaults`). Setting
      it at run time replaces it whole and starts its script over.
    - ``down``: every connection to a chat path, ``/v1/models`` and ``/health`` is reset, as a
      backend that is down (``/stats`` and ``/admin/settings`` still answer).
    - ``context_window``: prompts estimated over this many tokens (characters
      / 4) get OpenAI's ``context_length_exceeded`` 400; 0 = no limit.
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
    faults: FaultSpec = msgspec.field(default_factory=FaultSpec)
    down: bool = False
    context_window: Limit = 0


class MockStats(Struct, frozen=True, kw_only=True):
    """Counters since start. ``rate_limited`` counts every 429 (rate or busy);
    ``busy`` counts concurrency rejections (429 or 503); ``failed`` counts
    injected failures; ``disconnects`` counts clients that went away before
    their answer was complete (while sending the request, waiting or
    streaming: a normal event, never logged as an error); ``last_request`` is
    the last chat request body, as sent; ``faults`` counts injected faults by
    kind (``down`` for connections reset while down), which are counted in
    none of the other counters but ``requests``, ``streamed`` and
    ``disconnects``.
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
    faults: dict[str, int] = {}


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


class _Plan(Struct, frozen=True, kw_only=True):
    """What one admitted request will get: what its answer says, in which format."""

    reply: Reply
    dialect: Dialect
    settings: MockSettings
    #: The fault that shapes this answer (``drip``, ``break``, ...), if any.
    fault: FaultKind | None = None


_ENCODER: Final = msgspec.json.Encoder()
#: The window rpd is counted over.
_DAY: Final = 86400.0
_OPENAI: Final = DIALECTS["openai"]


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
        self._schedule = FaultSchedule(FaultSpec())
        #: Whether any fault setting is on: the one check a request pays without.
        self._faulty = False
        self._fault_counts: dict[str, int] = {}
        #: Set on close: hung requests let go of their connections.
        self._closing = asyncio.Event()
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
        for path, dialect, stream in _ROUTES:
            app.router.add_post(path, self._route(DIALECTS[dialect], Target(stream=stream)))
        app.router.add_post("/v1beta/models/{target}", self._gemini)
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
        self._closing.set()
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

    def url_for(self, adapter: str) -> str:
        """The ``base_url`` an adapter of this kind uses to reach this mock
        (``openai``, ``anthropic``, ``ollama``, ``tgi``, ``gemini``)."""
        origin = self.url.removesuffix("/v1")
        return origin + _BASE_PATHS[adapter]

    @property
    def settings(self) -> MockSettings:
        return self._settings

    def update(self, **changes: Any) -> MockSettings:
        """Change some settings now (validated; ``msgspec.ValidationError`` if invalid)."""
        merged = {**msgspec.structs.asdict(self._settings), **changes}
        settings = msgspec.convert(merged, MockSettings)
        self._apply(settings, restart_faults="faults" in changes)
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
            faults=dict(self._fault_counts),
        )

    def _apply(self, settings: MockSettings, *, restart_faults: bool = False) -> None:
        """Install settings; new limits start with full buckets, a new seed reseeds,
        new faults start their script over."""
        old = self._settings
        if restart_faults or settings.faults != old.faults:
            self._schedule = FaultSchedule(settings.faults)
        self._faulty = bool(settings.down or settings.context_window or settings.faults.active)
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
        if self._settings.down:
            return self._down(request)
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        if self._settings.down:
            return self._down(request)
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
            return _error(_OPENAI, 400, "bad_request", f"invalid settings: {exc}")
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

    def _style(self, dialect: Dialect) -> MockLimitStyle:
        """The rate-limit dialect of ``dialect``'s answers: its provider's, else ``limit_style``."""
        return dialect.limit_style or self._settings.limit_style

    def _limit_headers(self, dialect: Dialect = _OPENAI) -> dict[str, str]:
        """The rate-limit headers of ``dialect`` for the declared limits, as of now."""
        return limit_headers(self._style(dialect), self._quotas(), time.time())

    def _route(
        self, dialect: Dialect, target: Target
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._chat(request, dialect, target)

        return handle

    async def _gemini(self, request: web.Request) -> web.StreamResponse:
        """``/v1beta/models/<model>:<method>``: the model and the method from the path."""
        dialect = DIALECTS["gemini"]
        target = GeminiDialect.target(request.match_info["target"], request.query.get("alt"))
        if isinstance(target, str):
            self._counters.requests += 1
            self._counters.bad_requests += 1
            return _error(dialect, 400, "bad_request", target)
        return await self._chat(request, dialect, target)

    async def _chat(
        self, request: web.Request, dialect: Dialect, target: Target
    ) -> web.StreamResponse:
        counters = self._counters
        counters.requests += 1
        if self._faulty and self._settings.down:
            return self._down(request)
        body = await self._read_body(request, dialect, target)
        if isinstance(body, web.Response):
            return body
        settings = self._settings
        if self._faulty and (fault := self._pick_fault(body, settings)) is not None:
            return await self._inject(request, dialect, body, settings, fault)
        admitted = self._refuse(request, dialect, body, settings) or self._admit(
            dialect, body, settings
        )
        if isinstance(admitted, web.Response):
            return admitted
        return await self._run(request, body.stream, *admitted)

    def _admit(
        self, dialect: Dialect, body: Call, settings: MockSettings
    ) -> tuple[_Plan, dict[str, str]] | web.Response:
        """Charge the request and plan its answer; or a 429 when a limit refuses
        it, or the ``failure_rate`` error."""
        counters = self._counters
        plan = _plan(f"{dialect.id_prefix}{next(self._ids)}", dialect, body, settings)
        tokens = plan.reply.prompt_tokens + plan.reply.completion_tokens
        if (limited := self._take_quota(dialect, tokens, body.model)) is not None:
            counters.rate_limited += 1
            return limited
        headers = self._limit_headers(dialect)
        if settings.failure_rate and self._rng.random() < settings.failure_rate:
            counters.failed += 1
            return _error(
                dialect,
                settings.failure_status,
                "server_error",
                "The server had an error while processing your request (injected failure).",
                headers,
            )
        return plan, headers

    async def _run(
        self, request: web.Request, stream: bool, plan: _Plan, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Generate the answer, streamed or not (a faulted non-stream answer its way)."""
        counters = self._counters
        counters.in_flight += 1
        counters.max_in_flight_seen = max(counters.max_in_flight_seen, counters.in_flight)
        try:
            if stream:
                counters.streamed += 1
                return await self._stream(request, headers, plan)
            if plan.fault is None or plan.fault == "filtered":
                return await self._complete(request, headers, plan)
            return await self._complete_fault(request, headers, plan)
        finally:
            counters.in_flight -= 1

    async def _read_body(
        self, request: web.Request, dialect: Dialect, target: Target
    ) -> Call | web.Response:
        """The request body, or the answer when it cannot be had (400, or 499 if gone)."""
        try:
            raw = await request.read()
        except ConnectionError:
            # The client went away before its request was in: nothing to answer.
            return self._gone()
        try:
            body = dialect.decode(raw, target)
        except msgspec.DecodeError as exc:
            self._counters.bad_requests += 1
            return _error(dialect, 400, "bad_request", f"invalid request body: {exc}")
        self._last_request = raw
        return body

    def _refuse(
        self, request: web.Request, dialect: Dialect, body: Call, settings: MockSettings
    ) -> web.Response | None:
        """The answer for a request that must not run (401, 404, quota exhausted,
        busy), else ``None``."""
        if settings.require_api_key is not None:
            given = dialect.key(request.headers)
            if given != settings.require_api_key:
                # The message echoes the key sent, as some providers do.
                message = f"Incorrect API key provided: {given}."
                return _error(dialect, dialect.auth_status, "auth", message)
        if dialect.names_model and settings.models and body.model not in settings.models:
            status, payload = dialect.not_found(body.model)
            return _raw_error(status, payload, {})
        counters = self._counters
        if settings.quota_exhausted:
            counters.rate_limited += 1
            return self._quota_exhausted(dialect, settings, body.model)
        if settings.concurrency and counters.in_flight >= settings.concurrency:
            counters.busy += 1
            status = settings.busy_status
            if status == 429:
                counters.rate_limited += 1
            return _error(
                dialect,
                status,
                "busy",
                f"Too many concurrent requests (limit {settings.concurrency})",
                {"retry-after": "1", **self._limit_headers(dialect)},
            )
        return None

    def _quota_exhausted(
        self, dialect: Dialect, settings: MockSettings, model: str
    ) -> web.Response:
        """The dialect's quota-exhausted 429."""
        headers, payload = quota_exhausted(
            self._style(dialect), self._quotas(), daily=settings.rpd, model=model, now=time.time()
        )
        return _raw_error(429, payload, headers)

    def _take_quota(self, dialect: Dialect, tokens: int, model: str) -> web.Response | None:
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
            self._style(dialect),
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
        """The dialect's stream: its opening, the tokens at the configured pace,
        its closing (finish, usage) and end marker (OpenAI: a role chunk, the
        tokens, finish, usage, ``[DONE]``)."""
        counters = self._counters
        count = plan.reply.completion_tokens
        dialect = plan.dialect
        content_type = dialect.content_type
        response = web.StreamResponse(
            headers={**headers, "Content-Type": content_type, "Cache-Control": "no-cache"}
        )
        frames = dialect.frames(plan.reply)
        head, tail, opening = frames.head, frames.tail, frames.opening
        pieces = dialect.pieces_for(plan.reply, count)
        cut = False
        if plan.fault is None:
            closing = frames.closing + frames.done
        else:
            closing, pieces, cut = _faulty_stream(plan, frames)
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
                if tail:
                    batch.extend(head + pieces[index] + tail for index in range(sent, due))
                else:
                    batch.extend(head + pieces[index] for index in range(sent, due))
                if due == count:
                    batch.append(closing)
                await response.write(b"".join(batch))
                counters.tokens_out += due - sent
                sent = due
                if sent == count:
                    break
                batch = []
                await asyncio.sleep(max(0.0, start + sent / rate - loop.time()))
            if cut:
                _close(request)
                return response
            await response.write_eof()
        except ConnectionError:
            # The client went away (a worker cancelled or preempted the call):
            # an ordinary event, counted, not an error to log. Stop generating.
            counters.disconnects += 1
            return response
        if plan.fault is None:
            counters.completed += 1
        return response

    async def _complete(
        self, request: web.Request, headers: dict[str, str], plan: _Plan
    ) -> web.Response:
        """One JSON answer, after the time the whole generation would take."""
        settings = plan.settings
        count = plan.reply.completion_tokens
        rate = settings.tokens_per_second
        if delay := settings.ttft + (count / rate if rate else 0.0):
            await asyncio.sleep(delay)
            transport = request.transport
            if transport is None or transport.is_closing():
                return self._gone()
        self._counters.tokens_out += count
        if plan.fault is None:
            self._counters.completed += 1
        body = plan.dialect.answer(plan.reply)
        return web.Response(body=body, headers=headers, content_type="application/json")

    def _gone(self) -> web.Response:
        """The answer to a client that disconnected: counted; aiohttp drops it quietly."""
        self._counters.disconnects += 1
        return _dropped()

    # ----------------------------------------------------------- faults

    def _pick_fault(self, body: Call, settings: MockSettings) -> FaultKind | None:
        """The fault this chat request gets (the script's next step, a random draw,
        or a prompt over ``context_window``), else ``None``."""
        kind = self._schedule.next(self._rng)
        if kind == "ok":
            window = settings.context_window
            if window and body.prompt_tokens > window:
                return "context_length"
            return None
        if kind in STREAM_ONLY and not body.stream:
            return None
        return kind

    def _down(self, request: web.Request) -> web.Response:
        """Reset the connection of a request to a mock that is down."""
        self._count_fault("down")
        return _reset(request)

    def _count_fault(self, kind: str) -> None:
        self._fault_counts[kind] = self._fault_counts.get(kind, 0) + 1

    async def _inject(
        self,
        request: web.Request,
        dialect: Dialect,
        body: Call,
        settings: MockSettings,
        fault: FaultKind,
    ) -> web.StreamResponse:
        """Answer a chat request with ``fault`` (see :mod:`._mockfaults`)."""
        self._count_fault(fault)
        if fault == "hang":
            return await self._hang(request)
        if fault not in _ANSWER_FAULTS:
            return self._fault_error(request, dialect, body, settings, fault)
        plan = _plan(f"{dialect.id_prefix}{next(self._ids)}", dialect, body, settings, fault)
        faults = settings.faults
        if fault == "drip":
            pace = msgspec.structs.replace(
                settings, ttft=faults.drip_gap, tokens_per_second=1 / faults.drip_gap
            )
            plan = msgspec.structs.replace(plan, settings=pace)
        elif fault == "filtered" or (body.stream and fault in ("break", "sse_error")):
            reply = plan.reply
            cut = msgspec.structs.replace(
                reply,
                completion_tokens=min(faults.after_tokens, reply.completion_tokens),
                finish_reason="content_filter" if fault == "filtered" else reply.finish_reason,
            )
            plan = msgspec.structs.replace(plan, reply=cut)
        return await self._run(request, body.stream, plan, self._limit_headers(dialect))

    def _fault_error(
        self,
        request: web.Request,
        dialect: Dialect,
        body: Call,
        settings: MockSettings,
        fault: FaultKind,
    ) -> web.Response:
        """The answer of a fault that sends no tokens: an error, or a reset."""
        if fault == "reset":
            return _reset(request)
        if fault == "quota":
            return self._quota_exhausted(dialect, settings, body.model)
        if fault in ("429", "429_bare"):
            return self._rate_limited_fault(dialect, settings, body.model, bare=fault == "429_bare")
        status, payload = dialect.fault(fault, settings.context_window, body.prompt_tokens)
        if status == 200 and body.stream:  # a refusal in a 200 (Gemini's): one event
            return web.Response(
                body=b"data: " + payload + b"\n\n",
                headers=self._limit_headers(dialect),
                content_type="text/event-stream",
            )
        return _raw_error(status, payload, self._limit_headers(dialect))

    def _rate_limited_fault(
        self, dialect: Dialect, settings: MockSettings, model: str, *, bare: bool
    ) -> web.Response:
        """The dialect's 429 for a per-minute request bucket empty for ``retry_after``
        seconds; with a ``retry-after`` header, or (``bare``) without any."""
        wait = settings.faults.retry_after
        blocked = Quota(
            kind="requests", window=60.0, capacity=settings.rpm or 60, remaining=0, reset=wait
        )
        style = self._style(dialect)
        headers, payload = rate_limited(
            style,
            self._quotas(),
            blocked,
            wait=wait,
            need=1,
            model=model,
            now=time.time(),
        )
        retry = {"retry-after", "retry-after-ms"}
        headers = {k: v for k, v in headers.items() if k.lower() not in retry}
        if not bare:
            headers["retry-after"] = str(math.ceil(wait))
            if style == "openai":
                headers["retry-after-ms"] = str(math.ceil(wait * 1000))
        return _raw_error(429, payload, headers)

    async def _hang(self, request: web.Request) -> web.Response:
        """Send nothing until the client goes away, or the mock closes (then drop
        the connection unanswered)."""
        closing = self._closing
        while not closing.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return self._gone()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), _HANG_POLL)
        _close(request)
        return _dropped()

    async def _complete_fault(
        self, request: web.Request, headers: dict[str, str], plan: _Plan
    ) -> web.StreamResponse:
        """A non-streaming ``malformed``, ``break`` or ``drip`` answer."""
        payload = plan.dialect.answer(plan.reply)
        half = payload[: len(payload) // 2]
        if plan.fault == "malformed":
            return web.Response(body=half, headers=headers, content_type="application/json")
        response = web.StreamResponse(headers={**headers, "Content-Type": "application/json"})
        response.content_length = len(payload)
        try:
            await response.prepare(request)
            if plan.fault == "break":
                await response.write(half)
                _close(request)
                return response
            gap = plan.settings.faults.drip_gap
            step = -(-len(payload) // max(1, plan.reply.completion_tokens))
            for offset in range(0, len(payload), step):
                await asyncio.sleep(gap)
                await response.write(payload[offset : offset + step])
            await response.write_eof()
        except ConnectionError:
            self._counters.disconnects += 1
        return response


#: The chat endpoints but Gemini's (whose path names the model): path, dialect,
#: whether it streams (``None``: the body says).
_ROUTES: Final = (
    ("/v1/chat/completions", "openai", None),
    ("/v1/messages", "anthropic", None),
    ("/api/chat", "ollama", None),
    ("/generate_stream", "tgi", True),
    ("/generate", "tgi", False),
)
#: What an adapter's ``base_url`` is, after the mock's origin.
_BASE_PATHS: Final = {
    "openai": "/v1",
    "anthropic": "/v1",
    "ollama": "",
    "tgi": "",
    "gemini": "/v1beta",
}
#: How often a hung request looks whether its client is gone, in seconds.
_HANG_POLL: Final = 0.05
#: The faults that answer with tokens (the others are errors, a reset or a hang).
_ANSWER_FAULTS: Final = frozenset(
    {"drip", "malformed", "break", "no_done", "sse_error", "filtered"}
)


def _plan(
    request_id: str,
    dialect: Dialect,
    body: Call,
    settings: MockSettings,
    fault: FaultKind | None = None,
) -> _Plan:
    cap = body.cap
    cut = cap is not None and cap < settings.output_tokens
    return _Plan(
        reply=Reply(
            id=request_id,
            model=body.model,
            prompt_tokens=body.prompt_tokens,
            completion_tokens=settings.output_tokens
            if cap is None
            else min(cap, settings.output_tokens),
            finish_reason="length" if cut else "stop" if body.tool is None else "tool_calls",
            include_usage=body.include_usage,
            openrouter=settings.limit_style in ("openrouter", "openrouter-body"),
            tool=body.tool,
            logprobs=body.logprobs,
        ),
        dialect=dialect,
        settings=settings,
        fault=fault,
    )


def _faulty_stream(plan: _Plan, frames: Frames) -> tuple[bytes, list[bytes], bool]:
    """How a faulted stream differs: its ending (after the tokens), its token
    pieces, and whether the connection is cut instead of ended."""
    fault = plan.fault
    dialect = plan.dialect
    count = plan.reply.completion_tokens
    pieces = dialect.pieces_for(plan.reply, count)
    closing = frames.closing
    if fault == "break":
        return b"", pieces, True
    if fault == "no_done":
        return closing, pieces, False
    if fault == "sse_error":
        return dialect.stream_error(plan.reply, frames), pieces, False
    if fault == "malformed":
        # Token ``after_tokens``'s line is cut after its text: not JSON.
        index = plan.settings.faults.after_tokens
        if index < count:
            pieces = pieces[:count]
            pieces[index] = dialect.cut(pieces[index], token_text(index))
        else:
            closing = frames.head + b'{"' + dialect.terminator + closing
    return closing + frames.done, pieces, False


def _dropped() -> web.Response:
    """The answer to a connection already closed: aiohttp drops it quietly."""
    return web.Response(status=499, reason="Client Closed Request")


def _close(request: web.Request) -> None:
    """Close the connection (what was written is flushed, then FIN)."""
    if (transport := request.transport) is not None:
        transport.close()


def _reset(request: web.Request) -> web.Response:
    """Reset the connection (RST, nothing flushed) and answer nothing."""
    if (transport := request.transport) is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return _dropped()


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
    dialect: Dialect,
    status: int,
    kind: ErrorKind,
    message: str,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=dialect.error(status, kind, message),
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
    """Run a mock backend until cancelled; log its URLs and pass the OpenAI one to ``on_ready``."""
    async with MockBackend(settings, host=host, port=port) as mock:
        _log.info(
            "mock backend listening",
            url=mock.url,
            base_urls={adapter: mock.url_for(adapter) for adapter in _BASE_PATHS},
            settings=msgspec.to_builtins(mock.settings),
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
    fault_script: str = "",
    fault_repeat: bool = False,
    fault_rates: Sequence[str] = (),
    context_window: int = 0,
    drip_gap: float | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Blocking entry point for ``renqueue mock-backend``: one keyword per CLI flag.

    ``rpm``/``tpm`` are per-minute limits, ``rpd`` per day (0 = none);
    ``limit_style`` the header dialect; ``model`` restricts the
    accepted model name (``None`` = any); ``fault_script`` is comma-separated
    fault kinds (``"500,ok,reset"``), ``fault_rates`` ``KIND=PROBABILITY``
    items (see :mod:`._mockfaults`). Returns on Ctrl-C; ``ValueError`` for a
    bad option.
    """
    faults: dict[str, Any] = {
        "script": parse_fault_script(fault_script),
        "repeat": fault_repeat,
        "random": parse_fault_rates(fault_rates),
    }
    if drip_gap is not None:
        faults["drip_gap"] = drip_gap
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
                "faults": faults,
                "context_window": context_window,
            },
            MockSettings,
        )
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid mock backend option: {exc}") from exc
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, host, port, on_ready=on_ready))
