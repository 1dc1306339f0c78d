"""The OpenAI-compatible HTTP gateway: ``renqueue gateway`` (and ``renqueue up``).

A thin loop around pure decisions: an API key names a tenant
(:mod:`._keys`), a body becomes a submission (:mod:`._openai`), a retry
joins the request it repeats (:mod:`._idempotency`), a failure becomes an
OpenAI-shaped error (:mod:`._errors`). The HTTP and NATS work is here.

One NATS connection serves every tenant: it is a service connection (the
whole ``rq.*`` tree, as routers and workers have), and one
:class:`~renqueue.Client` per tenant on it submits and follows that tenant's
requests. The key alone decides the tenant; nothing in a body or header can
name another.

Endpoints (docs/gateway.md has the details):

- ``POST /v1/chat/completions``: streamed as OpenAI streams (SSE
  ``chat.completion.chunk`` events ending in ``data: [DONE]``, each with an
  ``id:`` line to resume from), or a whole ``chat.completion``;
- ``GET /v1/requests/{id}/stream``: join a request's stream from the start,
  or after ``Last-Event-ID``; ``GET /v1/requests/{id}``: its state and
  result; ``DELETE /v1/requests/{id}``: cancel it;
- ``GET /v1/models`` (the routes), ``GET /v1/models/{model}``, ``GET /health``,
  ``GET /metrics``.

A streamed answer's status line waits for the request's first token, so a
request refused or expired before it streamed anything gets its real status
(429, 504, ...) rather than a 200 with an error inside. A failure after text
was sent can only be said in the stream: an ``error`` event, as OpenAI sends.

A client that disconnects (aiohttp cancels its handler) cancels its request,
unless it asked to keep it (``X-Keep-Alive-On-Disconnect: true``) or sent an
``Idempotency-Key`` (it means to come back): the cancellation is a
supervised job, so a broker hiccup delays it and never loses it. A gateway
that shuts down cancels nothing: its requests go on and can be resumed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Final

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..broker import (
    Connection,
    ConnectionKeeper,
    EventLog,
    JetStream,
    KeyValue,
    connect,
    redact_url,
    submitted_of,
)
from ..client import Client, RequestHandle, Result
from ..config import Config, parse_duration
from ..errors import (
    ConfigError,
    InvalidRequestError,
    NatsApiError,
    NatsNotFoundError,
    NatsPayloadTooLargeError,
    NatsUnavailableError,
    RequestFailedError,
    ServiceFailedError,
    TokensExpiredError,
    UnknownPriorityError,
    WrongLastSequenceError,
)
from ..lifecycle import Lifecycle
from ..logs import bound_request, get_logger
from ..schema import (
    EVENT_DECODER,
    EVENTS_STREAM,
    STATE_BUCKET,
    CancelRequested,
    Completed,
    Event,
    Submitted,
    TokenChunk,
    event_subject,
    is_terminal,
    kind_of,
)
from ..tasks import Supervisor, cancel_and_wait
from . import _metrics as metrics
from ._errors import ApiError, from_error, from_terminal
from ._idempotency import MAX_KEY_LENGTH, RetryMemory, fingerprint, id_for_key, shared_key
from ._keys import KeyStore
from ._openai import (
    Submission,
    ToolCallPieces,
    answer_bytes,
    chunk_bytes,
    finish_reason,
    model_list,
    model_object,
    parse_chat,
    translate,
    usage,
)

__all__ = ["Gateway", "run_gateway"]

log = get_logger("gateway")

#: Why a request is cancelled when its client goes away (a retry after it
#: submits anew rather than join a request cancelled under it).
DISCONNECTED: Final = "client disconnected"
#: The request metadata entry holding the body's fingerprint, for requests
#: with an idempotency key: a key sent again with another body is refused.
BODY_KEY: Final = "rq_body_sha256"
#: Seconds in-flight answers get to finish when the gateway stops.
SHUTDOWN_GRACE: Final = 5.0
#: Requests this process submitted lately, by (tenant, id): their route, so
#: that they can be followed before a router has logged them.
_RECENT: Final = 10_000
_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
#: ``<run>.<seq>``, ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses).
_EVENT_ID_RE: Final = re.compile(r"[0-9]{1,11}\.[0-9]{1,11}")
_KEY_RE: Final = re.compile(rf"^[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}$")
_SSE_HEADERS: Final = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
_JSON: Final = "application/json"
#: The request id an answer names (``x-request-id``), once there is one.
_REQUEST_ID: Final = web.RequestKey("request_id", str)
_DONE: Final = b"data: [DONE]\n\n"


def _new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


class _After(msgspec.Struct, frozen=True):
    """Where a resumed stream starts (its ``Last-Event-ID``)."""

    #: ``start``: nothing seen; ``role``: the role chunk; ``text``: the chunk at
    #: (delivery, seq); ``end``: the finish chunk; ``usage``: the usage chunk.
    stage: str
    delivery: int = 0
    seq: int = -1


_STAGES: Final = ("start", "role", "text", "end", "usage")


def parse_last_event_id(text: str | None) -> _After:
    """``Last-Event-ID`` -> where to resume. Ids are ``0`` (the role chunk),
    ``<run>.<seq>`` (a text chunk), ``end`` (the finish chunk), ``usage``."""
    if text is None or not text.strip():
        return _After("start")
    value = text.strip()
    if value == "0":
        return _After("role")
    if value in ("end", "usage"):
        return _After(value)
    if _EVENT_ID_RE.fullmatch(value):
        run, _, seq = value.partition(".")
        return _After("text", int(run), int(seq))
    raise ApiError(
        400,
        "Last-Event-ID must be an id this gateway sent (0, <run>.<seq>, end or usage)",
        param="Last-Event-ID",
    )


def _key_reused() -> ApiError:
    return ApiError(
        422,
        "this Idempotency-Key was used with another body",
        param="Idempotency-Key",
        code="idempotency_key_reused",
    )


def _maybe_stored(exc: BaseException) -> bool:
    """Whether a submit that raised ``exc`` may still have stored its request
    (a lost ack, a dropped connection), rather than surely not (refused before
    the publish, no stream, a full queue)."""
    # Refused before the publish; or the server answered (no stream, full): not stored.
    return not isinstance(
        exc, InvalidRequestError | UnknownPriorityError | NatsApiError | NatsPayloadTooLargeError
    )


def _sse(data: bytes, event_id: str | None = None) -> bytes:
    if event_id is None:
        return b"data: " + data + b"\n\n"
    return b"id: " + event_id.encode() + b"\ndata: " + data + b"\n\n"


class _Tenant:
    """One tenant's client on the shared connection, and its requests in flight here."""

    __slots__ = ("client", "in_flight")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.in_flight = 0


class Gateway(Lifecycle):
    """The HTTP server. ``url`` (or an open ``nc``) names the NATS server.

    ``supervisor``: the process's (``renqueue up``); a gateway on its own
    makes one. ``port`` overrides ``[gateway] port`` (0: any free port; the
    bound one is :attr:`port`).
    """

    def __init__(
        self,
        config: Config,
        *,
        url: str | None = None,
        nc: Connection | None = None,
        supervisor: Supervisor | None = None,
        host: str | None = None,
        port: int | None = None,
        name: str = "renqueue-gateway",
    ) -> None:
        if url is None and nc is None:
            raise ValueError("give the NATS url or an open connection")
        self._config = config
        self._gw = config.gateway
        self._url = url
        self._nc: Connection | None = nc
        self._owns_nc = nc is None
        self._supervisor = supervisor or Supervisor(
            name, broker_patience=config.nats.patience_seconds
        )
        self._owns_supervisor = supervisor is None
        self._name = name
        self.host = self._gw.host if host is None else host
        self.port = self._gw.port if port is None else port
        self._keys = KeyStore({})
        self._tenants: dict[str, _Tenant] = {}
        window = self._gw.retry_memory or config.nats.duplicate_window
        self._memory = RetryMemory(parse_duration(window))
        self._state: KeyValue | None = None
        #: Calls of this process following each request, by (tenant, id).
        self._following: collections.Counter[tuple[str, str]] = collections.Counter()
        self._recent: dict[tuple[str, str], str] = {}
        self._runner: web.AppRunner | None = None
        self._closing = False
        #: Keeps a connection of the gateway's own live (None on a given one).
        self.keeper: ConnectionKeeper | None = None
        self._keeper_loop = f"{name}-nats-connection"
        self._created = int(time.time())
        self._routes = sorted(config.routes)

    @property
    def supervisor(self) -> Supervisor:
        return self._supervisor

    @property
    def url(self) -> str:
        """The base URL an OpenAI SDK takes (``.../v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def js(self) -> JetStream:
        if self._nc is None:
            raise RuntimeError("the gateway is not running")
        return self._nc.jetstream()

    # ------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        self._keys = KeyStore.from_config(self._gw)
        if not len(self._keys):
            raise ConfigError(
                "the gateway has no API keys: add [[gateway.keys]] or [gateway] keys_file"
                " (`renqueue gateway keygen TENANT` makes one)",
                path="$.gateway.keys",
            )
        if self._nc is None:
            assert self._url is not None
            self._nc = await connect(self._url, name=self._name, config=self._config.nats)
            self.keeper = ConnectionKeeper(
                url=self._url,
                name=self._name,
                config=self._config.nats,
                current=lambda: self._nc,
                renew=self._renew,
            )
            self._supervisor.spawn(self._keeper_loop, self.keeper.run)
        app = web.Application(client_max_size=self._gw.max_body, middlewares=[self._answer])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_get("/v1/requests/{id}", self._request_state)
        app.router.add_get("/v1/requests/{id}/stream", self._resume)
        app.router.add_delete("/v1/requests/{id}", self._delete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"the gateway cannot listen on {self.host}:{self.port}: {exc.strerror or exc}",
                path="$.gateway.port",
            ) from exc
        self.port = int(self._runner.addresses[0][1])
        log.info("gateway listening", url=self.url, keys=len(self._keys))

    async def _renew(self, new: Connection) -> None:
        """The server closed the gateway's connection (see
        :class:`~renqueue.broker.ConnectionKeeper`): each tenant's client, bound to
        it, is closed, and the next call of each tenant makes one on ``new``.
        Calls under way on the old one end in an error (an SDK retries them:
        a retry under the same body or key joins the stored request)."""
        old = list(self._tenants.values())
        self._tenants.clear()
        self._state = None
        self._nc = new
        for tenant in old:
            with contextlib.suppress(Exception):
                await tenant.client.close()

    async def _stop(self) -> None:
        self._closing = True
        await self._supervisor.stop(self._keeper_loop)
        if self._runner is not None:
            await self._runner.cleanup()
        for tenant in list(self._tenants.values()):
            with contextlib.suppress(Exception):
                await tenant.client.close()
        self._tenants.clear()
        if self._owns_supervisor:
            # Cancellations still being recorded get a moment; none is lost
            # silently (a job that cannot finish is logged when cancelled).
            pending = self._supervisor.jobs("cancel-")
            if pending:
                log.warning("stopping with cancellations not yet recorded", count=len(pending))
            await self._supervisor.close()
        if self._owns_nc and self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), 5.0)

    # ------------------------------------------------------------ plumbing

    @web.middleware
    async def _answer(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Every answer: OpenAI-shaped errors, an ``x-request-id``, metrics."""
        start = time.perf_counter()
        endpoint = _endpoint(request)
        try:
            response = await handler(request)
        except ApiError as exc:
            response = _error_response(exc, request.get(_REQUEST_ID))
        except web.HTTPRequestEntityTooLarge:
            response = _error_response(
                ApiError(
                    413,
                    f"the body is larger than the gateway's limit of {self._gw.max_body} bytes",
                    code="request_too_large",
                ),
                request.get(_REQUEST_ID),
            )
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status)
            response = _error_response(
                ApiError(exc.status, exc.reason, code=code), request.get(_REQUEST_ID)
            )
        except asyncio.CancelledError:
            metrics.CALLS.labels(endpoint, "disconnected").inc()
            raise
        except (NatsUnavailableError, TimeoutError) as exc:
            # A lookup while NATS reconnects or a leader is elected: try again.
            log.warning("NATS not reachable for a gateway call", endpoint=endpoint, error=str(exc))
            response = _error_response(from_error(exc), request.get(_REQUEST_ID))
        except Exception:
            log.exception("gateway error", endpoint=endpoint)
            response = _error_response(
                ApiError(500, "internal error", type="server_error", code="internal_error"),
                request.get(_REQUEST_ID),
            )
        metrics.CALLS.labels(endpoint, str(response.status)).inc()
        metrics.LATENCY.labels(endpoint).observe(time.perf_counter() - start)
        return response

    def _tenant_of(self, request: web.Request) -> str:
        """The tenant of the request's API key; 401 without a known one."""
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401,
                "no API key given: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        tenant = self._keys.tenant_of(key.strip())
        if tenant is None:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            if self._nc is None:
                raise RuntimeError("the gateway is not running")
            tenant = self._tenants[name] = _Tenant(Client(self._nc, tenant=name))
        return tenant

    def _default_level(self, tenant: str) -> str:
        """The level of a call that names none: the config's default, or the
        tenant's ``max_priority`` when that is less urgent (a plain SDK call
        is never refused for a priority it did not ask for)."""
        config = self._config
        default = config.default_priority
        most = config.max_priority_of(tenant)
        if most is not None and config.priority_rank(most) > config.priority_rank(default):
            return most
        return default

    @contextlib.contextmanager
    def _slot(self, tenant: _Tenant) -> Iterator[None]:
        """One more call of ``tenant`` in flight for the block; 429 past
        ``max_in_flight``. Resumed streams count too: each holds a subscription."""
        limit = self._gw.max_in_flight
        if limit and tenant.in_flight >= limit:
            raise ApiError(
                429,
                f"too many requests in flight for this tenant on this gateway (limit {limit})",
                type="rate_limit_error",
                code="too_many_in_flight",
                retry_after=1.0,
            )
        tenant.in_flight += 1
        metrics.IN_FLIGHT.inc()
        try:
            yield
        finally:
            tenant.in_flight -= 1
            metrics.IN_FLIGHT.dec()

    def _remember_recent(self, tenant: str, request_id: str, route: str) -> None:
        self._recent[(tenant, request_id)] = route
        while len(self._recent) > _RECENT:
            del self._recent[next(iter(self._recent))]

    async def _route_of(self, tenant: str, request_id: str) -> str:
        """The route of one of the tenant's requests; 404 if the tenant has none by that id."""
        if not _ID_RE.match(request_id):
            raise _no_such(request_id)
        route = self._recent.get((tenant, request_id))
        if route is not None:
            return route
        submitted = await submitted_of(self.js, tenant, request_id)
        if submitted is None:
            raise _no_such(request_id)
        return submitted.request.route

    # ------------------------------------------------------------ endpoints

    async def _health(self, _request: web.Request) -> web.Response:
        nc = self._nc
        if nc is None or not nc.is_connected or self._closing:
            body = {"status": "unavailable", "nats": "disconnected"}
            return web.json_response(body, status=503)
        return web.json_response({"status": "ok", "nats": "connected"})

    async def _metrics(self, _request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest())
        response.headers["content-type"] = CONTENT_TYPE_LATEST
        return response

    async def _models(self, request: web.Request) -> web.Response:
        self._tenant_of(request)
        return web.Response(body=model_list(self._routes, self._created), content_type=_JSON)

    async def _model(self, request: web.Request) -> web.Response:
        self._tenant_of(request)
        name = request.match_info["model"]
        if name not in self._config.routes:
            raise _no_model(name)
        return web.json_response(model_object(name, self._created))

    def _read_chat(
        self, body: bytes, headers: Mapping[str, str], tenant: str
    ) -> tuple[Submission, str | None, bool]:
        """The submission a chat body asks for, its idempotency key, and whether
        to keep it when its client disconnects; ApiError if it cannot be asked."""
        chat = parse_chat(body)
        now = time.time()
        sub = translate(
            chat,
            headers,
            levels=self._config.priorities,
            default_level=self._default_level(tenant),
            now=now,
        )
        if sub.route not in self._config.routes:
            raise _no_model(sub.route)
        if sub.deadline is not None and sub.deadline <= now:
            raise ApiError(
                504,
                "the request's deadline has already passed; nothing was submitted",
                type="server_error",
                code="deadline_exceeded",
                retry=False,
            )
        key = headers.get("Idempotency-Key")
        if key is not None and not _KEY_RE.match(key):
            raise ApiError(
                400,
                f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
                param="Idempotency-Key",
            )
        keep = sub.keep_alive_on_disconnect
        return sub, key, key is not None if keep is None else keep

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        tenant_name = self._tenant_of(request)
        body = await request.read()
        sub, key, keep = self._read_chat(body, request.headers, tenant_name)
        tenant = self._tenant(tenant_name)
        with self._slot(tenant):
            print_ = fingerprint(tenant_name, body)
            following: tuple[str, str] | None = None
            try:
                retry = request.headers.get("x-stainless-retry-count", "0").strip() not in ("", "0")
                request_id = id_for_key(key) if key is not None else _new_id()
                try:
                    handle = await self._submit(
                        tenant.client, sub, print_, request_id, key=key, retry=retry
                    )
                except asyncio.CancelledError:
                    # Gone while submitting: the publish may have been stored.
                    if not keep and not self._closing:
                        self._cancel_later(tenant.client, request_id, print_, following=False)
                    raise
                following = (tenant_name, handle.id)
                self._following[following] += 1
                request[_REQUEST_ID] = handle.id
                with bound_request(handle.id, tenant=tenant_name):
                    try:
                        if sub.stream:
                            return await self._stream(request, handle, sub.route, sub.include_usage)
                        return await self._complete(handle, sub.route)
                    except asyncio.CancelledError:
                        if not keep and not self._closing:
                            self._cancel_later(tenant.client, handle.id, print_)
                        raise
                    except _ClientGone as gone:
                        if not keep and not self._closing:
                            self._cancel_later(tenant.client, handle.id, print_)
                        return gone.response
            finally:
                if following is not None:
                    self._following[following] -= 1
                    if self._following[following] <= 0:
                        del self._following[following]

    async def _submit(
        self,
        client: Client,
        sub: Submission,
        print_: str,
        request_id: str,
        *,
        key: str | None,
        retry: bool,
    ) -> RequestHandle:
        """Submit ``sub`` (its body's fingerprint ``print_``) as ``request_id``,
        or join the request a retry of it already made."""
        tenant = client.tenant
        metadata = sub.metadata
        if key is not None:
            existing = await submitted_of(self.js, tenant, request_id)
            if existing is not None:
                if existing.request.metadata.get(BODY_KEY, print_) != print_:
                    raise _key_reused()
                metrics.RETRIES_JOINED.labels("idempotency_key").inc()
                return client.handle(request_id)
            metadata = {**metadata, BODY_KEY: print_}
        elif retry and (joined := await self._joinable(tenant, print_)) is not None:
            # Published again under the id the first try used: a duplicate if
            # that one was stored (joined), stored now if its publish was lost.
            metrics.RETRIES_JOINED.labels("sdk_retry").inc()
            request_id = joined
        if key is None:
            # Before the publish: one whose ack is lost may still be stored,
            # and the SDK's retry of it must join it, not make a second.
            self._memory.remember(print_, request_id)
            self._share(tenant, print_, request_id)
        try:
            built = client.build_request(
                sub.messages,
                route=sub.route,
                priority=sub.priority,
                request_id=request_id,
                params=sub.params,
                deadline=sub.deadline,
                max_cost=sub.max_cost,
                metadata=metadata,
            )
            handle = await client.submit_request(built)
        except Exception as exc:
            answer = from_error(exc)
            if key is None and not _maybe_stored(exc):
                self._forget(tenant, print_, request_id)
            raise answer from exc
        if key is not None and (handle.duplicate or handle.found_on_retry):
            # A retry of the publish that found the request stored found, all
            # but surely, its own lost first try; but a resend of the key with
            # another body at the same moment looks the same: checked too.
            await self._same_body(tenant, request_id, print_)
            if handle.duplicate:
                metrics.RETRIES_JOINED.labels("idempotency_key").inc()
        self._remember_recent(tenant, handle.id, sub.route)
        return handle

    async def _same_body(self, tenant: str, request_id: str, print_: str) -> None:
        """A keyed submit that was a duplicate: 422 if the request under that
        key has another body (its ``submitted`` event may be a moment behind
        the first publish: waited for briefly, then the key is trusted)."""
        delay = 0.05
        for _ in range(6):
            existing = await submitted_of(self.js, tenant, request_id)
            if existing is not None:
                if existing.request.metadata.get(BODY_KEY, print_) != print_:
                    raise _key_reused()
                return
            await asyncio.sleep(delay)
            delay *= 2

    def _forget(self, tenant: str, print_: str, request_id: str) -> None:
        """Retries of this body no longer join ``request_id`` (it was never
        stored, or its client went away and it is being cancelled)."""
        if self._memory.recall(print_) != request_id:
            return  # a newer request of the same body: its own
        self._memory.forget(print_)
        name = shared_key(tenant, print_)

        async def delete() -> None:
            if self._state is None:
                self._state = await self.js.key_value(STATE_BUCKET)
            entry = await self._state.latest(name)
            # Only ours: another process may have shared the same body since.
            if entry is not None and entry.value == request_id.encode():
                with contextlib.suppress(WrongLastSequenceError):
                    await self._state.delete(name, last=entry.revision)

        self._supervisor.spawn_job(f"forget-{name}", delete)

    def _share(self, tenant: str, print_: str, request_id: str) -> None:
        """Tell every gateway process which request this body made (a
        supervised background job: the answer does not wait for it)."""
        name = shared_key(tenant, print_)
        headers = {"Nats-TTL": str(max(1, math.ceil(self._memory.ttl)))}

        async def put() -> None:
            await self.js.publish(
                f"$KV.{STATE_BUCKET}.{name}", request_id.encode(), headers=headers
            )

        self._supervisor.spawn_job(f"share-{name}", put)

    async def _shared(self, tenant: str, print_: str) -> str | None:
        """The request another gateway process made of this body, if it shared it."""
        if self._state is None:
            self._state = await self.js.key_value(STATE_BUCKET)
        try:
            entry = await self._state.get(shared_key(tenant, print_))
        except NatsNotFoundError:
            return None
        request_id = entry.value.decode("utf-8", "replace")
        return request_id if _ID_RE.match(request_id) else None

    async def _joinable(self, tenant: str, print_: str) -> str | None:
        """The request an SDK retry repeats, if this process remembers it and it
        was not cancelled because its client went away (that one is retried anew)."""
        request_id = self._memory.recall(print_) or await self._shared(tenant, print_)
        if request_id is None:
            return None
        if await self._cancelled_by_disconnect(tenant, request_id):
            return None  # being cancelled, or cancelled: this retry runs anew
        return request_id

    async def _cancelled_by_disconnect(self, tenant: str, request_id: str) -> bool:
        try:
            raw = await self.js.get_last_msg(
                EVENTS_STREAM, event_subject(tenant, request_id, "cancel_requested"), direct=True
            )
        except NatsNotFoundError:
            return False
        with contextlib.suppress(msgspec.DecodeError):
            event = EVENT_DECODER.decode(raw.data or b"")
            return isinstance(event, CancelRequested) and event.reason == DISCONNECTED
        return False

    def _cancel_later(
        self, client: Client, request_id: str, print_: str, *, following: bool = True
    ) -> None:
        """Record a cancellation for a client that went away (a supervised job:
        the handler that asks is itself being cancelled), unless another call
        in this process still follows the request (an SDK retry that joined
        it); retries of its body no longer join it."""
        others = self._following.get((client.tenant, request_id), 0) - (1 if following else 0)
        if others > 0:
            log.info(
                "client disconnected; a retry still follows its request", request_id=request_id
            )
            return
        tenant = client.tenant
        self._forget(tenant, print_, request_id)
        log.info("client disconnected; cancelling its request", request_id=request_id)

        async def cancel() -> None:
            # The tenant's client of the moment: the gateway may have moved
            # onto a new connection since (see _renew).
            await self._tenant(tenant).client.handle(request_id).cancel(DISCONNECTED)

        self._supervisor.spawn_job(f"cancel-{tenant}:{request_id}", cancel)

    async def _outcome(self, handle: RequestHandle) -> Result:
        """The request's result; its terminal event's error if it did not complete."""
        try:
            return await handle.result()
        except RequestFailedError as exc:
            event = await _terminal(self.js, handle)
            if event is None:
                raise ApiError(500, str(exc), type="server_error", code=exc.error_type) from None
            raise from_terminal(event, now=time.time()) from None

    async def _complete(self, handle: RequestHandle, route: str) -> web.Response:
        result = await self._outcome(handle)
        body = answer_bytes(handle.id, route, int(time.time()), result)
        response = web.Response(body=body, content_type=_JSON)
        response.headers["x-request-id"] = handle.id
        response.headers["x-renqueue-backend"] = result.backend
        return response

    async def _stream(
        self,
        request: web.Request,
        handle: RequestHandle,
        route: str,
        include_usage: bool,
        after: _After | None = None,
    ) -> web.StreamResponse:
        """Stream ``handle`` as chat.completion.chunks, from after ``after``."""
        sse = _Sse(handle.id, route, include_usage, after or _After("start"))
        chunks = _Chunks(handle)
        try:
            # The status line waits for the first chunk (or the end): a request
            # refused before it streamed anything gets its real status.
            first = await chunks.next()
            if first is None:
                await self._outcome(handle)  # raises the failure, before any byte is sent
            sse.response = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": handle.id})
            await sse.response.prepare(request)
            await sse.begin()
            current = first
            while current is not None:
                if not await sse.text(current):
                    return sse.response  # restarted after text was sent: said in the stream
                current = await chunks.next()
            try:
                result = await self._outcome(handle)
            except ApiError as exc:
                await sse.error(exc)
            else:
                await sse.end(result)
        except TokensExpiredError as exc:
            expired = ApiError(410, str(exc), code="stream_expired", retry=False)
            if sse.response is None:
                raise expired from None
            await sse.error(expired)
        except (ConnectionResetError, RuntimeError) as exc:  # aiohttp's "closing transport"
            if sse.response is None or not _closed_under(exc):
                raise
            # The client went away mid-write: the same as a disconnect.
            raise _ClientGone(sse.response) from exc
        finally:
            await chunks.close()
        return sse.response

    async def _resume(self, request: web.Request) -> web.StreamResponse:
        tenant_name = self._tenant_of(request)
        request_id = request.match_info["id"]
        request[_REQUEST_ID] = request_id
        after = parse_last_event_id(request.headers.get("Last-Event-ID"))
        include_usage = request.query.get("include_usage", "").lower() in ("1", "true")
        route = await self._route_of(tenant_name, request_id)
        tenant = self._tenant(tenant_name)
        handle = tenant.client.handle(request_id)
        with self._slot(tenant), bound_request(request_id, tenant=tenant_name):
            return await self._stream(request, handle, route, include_usage, after)

    async def _request_state(self, request: web.Request) -> web.Response:
        tenant_name = self._tenant_of(request)
        request_id = request.match_info["id"]
        request[_REQUEST_ID] = request_id
        route = await self._route_of(tenant_name, request_id)
        events = await EventLog(self.js).history(tenant_name, request_id)
        state = _state(request_id, route, events)
        response = web.Response(body=msgspec.json.encode(state), content_type=_JSON)
        response.headers["x-request-id"] = request_id
        return response

    async def _delete(self, request: web.Request) -> web.Response:
        tenant_name = self._tenant_of(request)
        request_id = request.match_info["id"]
        request[_REQUEST_ID] = request_id
        await self._route_of(tenant_name, request_id)
        handle = self._tenant(tenant_name).client.handle(request_id)
        ended = await EventLog(self.js).terminal_of(tenant_name, request_id)
        if ended is not None:
            status, code = kind_of(ended), 200
        else:
            await handle.cancel("cancelled through the gateway (DELETE)")
            status, code = "cancelling", 202
        body = {"id": request_id, "object": "renqueue.request", "status": status}
        response = web.json_response(body, status=code)
        response.headers["x-request-id"] = request_id
        return response


class _Sse:
    """One streamed answer: what was sent, and what comes next (see
    :func:`parse_last_event_id` for the event ids)."""

    def __init__(self, request_id: str, route: str, include_usage: bool, after: _After) -> None:
        self.request_id = request_id
        self.route = route
        self.include_usage = include_usage
        self.after = after
        self.created = int(time.time())
        self.response: web.StreamResponse | None = None
        self.text_sent = after.stage not in {"start", "role"}
        self.tool_calls = ToolCallPieces(request_id)

    def _chunk(self, **fields: Any) -> bytes:
        return chunk_bytes(
            self.request_id, self.route, self.created, with_usage=self.include_usage, **fields
        )

    async def _write(self, data: bytes, event_id: str | None = None) -> None:
        assert self.response is not None
        await self.response.write(_sse(data, event_id))

    async def begin(self) -> None:
        if self.after.stage == "start":
            await self._write(self._chunk(role="assistant", content=""), "0")

    async def text(self, chunk: TokenChunk) -> bool:
        """Send ``chunk`` unless the client has it; False if it voids text already sent."""
        after = self.after
        if after.stage in {"end", "usage"}:
            return True
        if after.stage == "text" and chunk.delivery == after.delivery and chunk.seq <= after.seq:
            if chunk.restart:
                self.tool_calls.restart()
            self.tool_calls.seen(chunk.tool_calls)  # the client has their first pieces
            return True
        if chunk.restart:
            if self.text_sent:
                await self._write(_restarted(self.request_id))
                return False
            self.tool_calls.restart()
        pieces = self.tool_calls.pieces(chunk.tool_calls)
        data = self._chunk(
            # A piece of tool calls alone has no content, as OpenAI's.
            content=chunk.text if chunk.text or not pieces else None,
            tool_calls=pieces,
            logprobs=chunk.logprobs,
        )
        await self._write(data, f"{chunk.delivery}.{chunk.seq}")
        self.text_sent = True
        return True

    async def end(self, result: Result) -> None:
        if self.after.stage not in {"end", "usage"}:
            finish = finish_reason(result.finish_reason, tool_calls=bool(result.tool_calls))
            await self._write(self._chunk(finish=finish), "end")
        if self.include_usage and self.after.stage != "usage":
            counts = usage(result.usage.prompt_tokens, result.usage.completion_tokens)
            await self._write(self._chunk(final_usage=counts), "usage")
        assert self.response is not None
        await self.response.write(_DONE)
        await self.response.write_eof()

    async def error(self, exc: ApiError) -> None:
        """A failure after the status line: an ``error`` event, as OpenAI sends."""
        await self._write(exc.body())


class _ClientGone(Exception):
    """A write failed: the client's connection is gone (its answer is ``response``)."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client gone")
        self.response = response


class _Chunks:
    """A handle's chunks one at a time (``None`` at the end); closes its follower."""

    def __init__(self, handle: RequestHandle) -> None:
        self._iter: AsyncIterator[TokenChunk] = handle.stream()

    async def next(self) -> TokenChunk | None:
        try:
            return await anext(self._iter)
        except StopAsyncIteration:
            return None

    async def close(self) -> None:
        aclose = getattr(self._iter, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def _terminal(js: JetStream, handle: RequestHandle) -> Event | None:
    return await EventLog(js).terminal_of(handle.tenant, handle.id)


def _closed_under(exc: BaseException) -> bool:
    """A write failed because the client's connection is gone."""
    return isinstance(exc, ConnectionResetError) or "closing transport" in str(exc).lower()


def _restarted(request_id: str) -> bytes:
    return ApiError(
        500,
        f"request {request_id} was restarted on another run after part of its answer was"
        " streamed (a preemption or a retry): the text sent is void. GET"
        f" /v1/requests/{request_id}/stream (no Last-Event-ID) streams the new run",
        type="server_error",
        code="stream_restarted",
    ).body()


def _no_such(request_id: str) -> ApiError:
    return ApiError(
        404, f"no request {request_id[:128]!r} for this API key", code="request_not_found"
    )


def _no_model(route: str) -> ApiError:
    return ApiError(
        404,
        f"the model {route[:64]!r} does not exist: it must name a route (GET /v1/models)",
        code="model_not_found",
        param="model",
    )


def _error_response(exc: ApiError, request_id: str | None) -> web.Response:
    response = web.Response(status=exc.status, body=exc.body(), content_type=_JSON)
    response.headers.update(exc.headers())
    response.headers["x-request-id"] = request_id or ("req-" + uuid.uuid4().hex)
    return response


def _endpoint(request: web.Request) -> str:
    """The endpoint's route pattern (bounded label values), not the raw path."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    canonical = getattr(resource, "canonical", None)
    return f"{request.method} {canonical}" if canonical else "unmatched"


_RUNNING: Final = frozenset({"started", "coalesced"})
_WAITING: Final = frozenset({"submitted", "routed", "retrying", "fell_back", "preempted", "stolen"})


def _state(request_id: str, route: str, events: list[Event]) -> dict[str, Any]:
    """``GET /v1/requests/{id}``: where the request is, and its outcome once it has one."""
    status = "queued"
    out: dict[str, Any] = {"id": request_id, "object": "renqueue.request", "model": route}
    for event in events:
        kind = kind_of(event)
        if isinstance(event, Submitted):
            out["created"] = int(event.request.submitted_at)
            out["priority"] = event.request.priority
            out["deadline"] = event.request.deadline
        if is_terminal(event):
            status = kind
            if isinstance(event, Completed):
                out["backend"] = event.backend
                out["cost"] = event.cost
                out["result"] = msgspec.json.decode(
                    answer_bytes(request_id, route, int(event.at), event)
                )
            else:
                error = from_terminal(event, now=time.time())
                out["error"] = msgspec.json.decode(error.body())["error"]
            break
        if kind in _RUNNING:
            status = "running"
        elif kind in _WAITING:
            status = "queued" if kind != "routed" else "routed"
    out["status"] = status
    return out


async def run_gateway(config: Config, url: str) -> None:
    """``renqueue gateway``: serve until SIGINT or SIGTERM, or until a job of
    the gateway cannot go on (then :class:`ServiceFailedError`, after stopping)."""
    gateway = Gateway(config, url=url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await gateway.start()
        log.info("gateway running; Ctrl-C to stop", nats=redact_url(url))
        signalled = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(gateway.supervisor.failed.wait())
        try:
            await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait([signalled, failed])
    finally:
        await gateway.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if gateway.supervisor.failed.is_set():
        raise ServiceFailedError(gateway.supervisor.reason or "a gateway job failed")
