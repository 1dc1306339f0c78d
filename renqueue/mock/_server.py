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
``no_done``, ``no_finish``, ``sse_error``, ``context_length``, ``content_filter`` and
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
                                and the last requests' traceparent headers
    GET  /admin/settings        current MockSettings
    POST /admin/settings        change settings at runtime (a partial JSON object)
    GET  /health                200 "ok"

Why aiohttp: its server is a mature asyncio HTTP/1.1 server whose
``StreamResponse`` writes SSE from a plain coroutine, with keep-alive and low
per-request overhead (a C HTTP parser), so one process outruns the pipeline it
feeds. It is the optional ``mock`` extra and imported only by the mock;
nothing else in Ren-Queue depends on it.

The parts: :class:`MockBackend` here (the server's lifecycle, its settings and
admin endpoints, and each chat request's way in: its body, key and model, a
fault, the limits); :class:`~._settings.MockSettings` and ``MockStats``
(``_settings``); the declared limits' token buckets (``_buckets``); the
answers, written at the configured pace (``_answers``); each provider's wire
format (``dialects``).

Rate limits are token buckets, as OpenAI describes its own (``_buckets``). A
request is charged, when admitted, one request and ``prompt_tokens +
completion_tokens`` tokens (prompt tokens = prompt characters / 4, rounded
up; completion tokens = the planned output length). Rejected requests (429,
400, busy) are not charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import random
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec
from aiohttp import web

from ..lifecycle import Starting
from ..logs import get_logger
from ._answers import Answers, Plan, error_response, plan_answer, raw_error, reset
from ._buckets import DeclaredLimits
from ._fault_injection import (
    STREAM_ONLY,
    FaultKind,
    FaultSchedule,
    FaultSpec,
    parse_fault_rates,
    parse_fault_script,
)
from ._rate_limits import MockLimitStyle, format_reset
from ._settings import TRACEPARENTS_KEPT, Counters, MockSettings, MockStats
from .dialects import DIALECTS, Call, Dialect, GeminiDialect, Target

__all__ = ["MockBackend", "MockSettings", "MockStats", "format_reset", "run_mock_backend", "serve"]

_log = get_logger("mock-backend")

_ENCODER: Final = msgspec.json.Encoder()
_OPENAI: Final = DIALECTS["openai"]


class _State(enum.Enum):
    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSED = "closed"


class MockBackend(Starting):
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
        self._counters = Counters()
        self._last_request: bytes | None = None
        #: The ``traceparent`` header of each of the last chat requests.
        self._traceparents: deque[str | None] = deque(maxlen=TRACEPARENTS_KEPT)
        self._ids = itertools.count()
        self._settings = MockSettings()
        self._rng = random.Random()
        self._limits = DeclaredLimits()
        self._schedule = FaultSchedule(FaultSpec())
        #: Whether any fault setting is on: the one check a request pays without.
        self._faulty = False
        self._fault_counts: dict[str, int] = {}
        #: Set on close: hung requests let go of their connections.
        self._closing = asyncio.Event()
        self._answers = Answers(self._counters, self._closing)
        self._apply(settings or MockSettings())

    # ----------------------------------------------------------- lifecycle

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

    async def close(self) -> None:
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
        last = msgspec.json.decode(self._last_request) if self._last_request else None
        return self._counters.stats(
            last_request=last,
            faults=dict(self._fault_counts),
            traceparents=list(self._traceparents),
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
        self._limits.apply(settings, old, fresh=self._state is _State.UNOPENED)
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
            return error_response(_OPENAI, 400, "bad_request", f"invalid settings: {exc}")
        _log.info("mock settings changed", changes=sorted(changes))
        return web.Response(body=_ENCODER.encode(settings), content_type="application/json")

    def _style(self, dialect: Dialect) -> MockLimitStyle:
        """The rate-limit dialect of ``dialect``'s answers: its provider's, else ``limit_style``."""
        return dialect.limit_style or self._settings.limit_style

    def _limit_headers(self, dialect: Dialect = _OPENAI) -> dict[str, str]:
        """The rate-limit headers of ``dialect`` for the declared limits, as of now."""
        return self._limits.headers(self._style(dialect))

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
            return error_response(dialect, 400, "bad_request", target)
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
        return await self._answers.run(request, body.stream, *admitted)

    def _admit(
        self, dialect: Dialect, body: Call, settings: MockSettings
    ) -> tuple[Plan, dict[str, str]] | web.Response:
        """Charge the request and plan its answer; or a 429 when a limit refuses
        it, or the ``failure_rate`` error."""
        counters = self._counters
        plan = plan_answer(f"{dialect.id_prefix}{next(self._ids)}", dialect, body, settings)
        tokens = plan.reply.prompt_tokens + plan.reply.completion_tokens
        if (limited := self._take_quota(dialect, tokens, body.model)) is not None:
            counters.rate_limited += 1
            return limited
        headers = self._limit_headers(dialect)
        if settings.failure_rate and self._rng.random() < settings.failure_rate:
            counters.failed += 1
            return error_response(
                dialect,
                settings.failure_status,
                "server_error",
                "The server had an error while processing your request (injected failure).",
                headers,
            )
        return plan, headers

    async def _read_body(
        self, request: web.Request, dialect: Dialect, target: Target
    ) -> Call | web.Response:
        """The request body, or the answer when it cannot be had (400, or 499 if gone)."""
        try:
            raw = await request.read()
        except ConnectionError:
            # The client went away before its request was in: nothing to answer.
            return self._answers.gone()
        try:
            body = dialect.decode(raw, target)
        except msgspec.DecodeError as exc:
            self._counters.bad_requests += 1
            return error_response(dialect, 400, "bad_request", f"invalid request body: {exc}")
        self._last_request = raw
        self._traceparents.append(request.headers.get("traceparent"))
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
                return error_response(dialect, dialect.auth_status, "auth", message)
        if dialect.names_model and settings.models and body.model not in settings.models:
            status, payload = dialect.not_found(body.model)
            return raw_error(status, payload, {})
        counters = self._counters
        if settings.quota_exhausted:
            counters.rate_limited += 1
            return self._quota_exhausted(dialect, settings, body.model)
        if settings.concurrency and counters.in_flight >= settings.concurrency:
            counters.busy += 1
            status = settings.busy_status
            if status == 429:
                counters.rate_limited += 1
            return error_response(
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
        headers, payload = self._limits.exhausted(
            self._style(dialect), daily=settings.rpd, model=model
        )
        return raw_error(429, payload, headers)

    def _take_quota(self, dialect: Dialect, tokens: int, model: str) -> web.Response | None:
        """Charge one request and ``tokens``; a 429 response if any bucket lacks room."""
        limited = self._limits.take(self._style(dialect), tokens, model)
        if limited is None:
            return None
        headers, payload = limited
        return raw_error(429, payload, headers)

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
        return reset(request)

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
        """Answer a chat request with ``fault`` (see :mod:`._fault_injection`)."""
        self._count_fault(fault)
        if fault == "hang":
            return await self._answers.hang(request)
        if fault not in _ANSWER_FAULTS:
            return self._fault_error(request, dialect, body, settings, fault)
        plan = plan_answer(f"{dialect.id_prefix}{next(self._ids)}", dialect, body, settings, fault)
        faults = settings.faults
        if fault == "drip":
            pace = msgspec.structs.replace(
                settings, ttft=faults.drip_gap, tokens_per_second=1 / faults.drip_gap
            )
            plan = msgspec.structs.replace(plan, settings=pace)
        elif fault == "filtered" or (body.stream and fault in ("break", "no_finish", "sse_error")):
            reply = plan.reply
            cut = msgspec.structs.replace(
                reply,
                completion_tokens=min(faults.after_tokens, reply.completion_tokens),
                finish_reason="content_filter" if fault == "filtered" else reply.finish_reason,
            )
            plan = msgspec.structs.replace(plan, reply=cut)
        return await self._answers.run(request, body.stream, plan, self._limit_headers(dialect))

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
            return reset(request)
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
        return raw_error(status, payload, self._limit_headers(dialect))

    def _rate_limited_fault(
        self, dialect: Dialect, settings: MockSettings, model: str, *, bare: bool
    ) -> web.Response:
        """The dialect's 429 for a per-minute request bucket empty for ``retry_after``
        seconds; with a ``retry-after`` header, or (``bare``) without any."""
        headers, payload = self._limits.refused_for(
            self._style(dialect),
            wait=settings.faults.retry_after,
            capacity=settings.rpm or 60,
            model=model,
            bare=bare,
        )
        return raw_error(429, payload, headers)


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
#: The faults that answer with tokens (the others are errors, a reset or a hang).
_ANSWER_FAULTS: Final = frozenset(
    {"drip", "malformed", "break", "no_done", "no_finish", "sse_error", "filtered"}
)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=_ENCODER.encode(payload), status=status, content_type="application/json"
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
    items (see :mod:`._fault_injection`). Returns on Ctrl-C; ``ValueError`` for a
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
