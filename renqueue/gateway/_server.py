"""The OpenAI-compatible HTTP gateway: ``renqueue gateway`` (and ``renqueue up``).

A thin loop around pure decisions: an API key names a tenant
(:mod:`._keys`), a body becomes a submission (:mod:`._openai`), a retry
joins the request it repeats (:mod:`._idempotency`), a failure becomes an
OpenAI-shaped error (:mod:`._errors`). The HTTP and NATS work is in three
parts: :class:`Gateway` here (its lifecycle, the keys, the tenants' clients
and the endpoints), what a chat call submits and the retries that join it
(:mod:`._submissions`), and the answers, whole or streamed (:mod:`._answers`).
The connections under them have limits of their own (:mod:`._connections`:
header, body and idle time-outs, typed refusals of what is not HTTP); one
API key has at most ``max_in_flight_per_key`` calls in progress here.

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
  ``GET /metrics``;
- the web console, ``/console`` and ``/console/api/...``, behind an admin key
  (:mod:`._console`).

A streamed answer's status line waits for the request's first token, so a
request refused or expired before it streamed anything gets its real status
(429, 504, ...) rather than a 200 with an error inside (:mod:`._answers`).

A client that disconnects (aiohttp cancels its handler) cancels its request,
unless it asked to keep it (``X-Keep-Alive-On-Disconnect: true``) or sent an
``Idempotency-Key`` (it means to come back): the cancellation is a
supervised job, so a broker hiccup delays it and never loses it. A gateway
that shuts down cancels nothing: its requests go on and can be resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..broker import (
    Connection,
    ConnectionKeeper,
    EventLog,
    JetStream,
    connect,
    redact_url,
    submitted_of,
)
from ..client import Client
from ..config import Config, parse_duration
from ..errors import ConfigError, NatsUnavailableError, ServiceFailedError
from ..lifecycle import Lifecycle
from ..logs import bound_request, get_logger
from ..schema import kind_of
from ..tasks import Supervisor, cancel_and_wait
from . import _metrics as metrics
from ._answers import Answers, ClientGone, parse_last_event_id, request_state
from ._connections import UNROUTED, GatewayRunner, body_deadline, error_response, plain_body
from ._console import Console
from ._errors import ApiError, bearer_key, from_error, reason_of
from ._idempotency import fingerprint, id_for_key
from ._keys import KeyStore
from ._openai import model_list, model_object
from ._submissions import ID_RE, Origin, Submissions, new_id, no_model

__all__ = ["Gateway", "run_gateway"]

log = get_logger("gateway")

#: Seconds in-flight answers get to finish when the gateway stops.
SHUTDOWN_GRACE: Final = 5.0
_JSON: Final = "application/json"
#: The request id an answer names (``x-request-id``), once there is one.
_REQUEST_ID: Final = web.RequestKey("request_id", str)
#: The digest of the call's API key and its tenant, when it is a known key.
_KEY: Final = web.RequestKey("api_key", tuple[str, str])


class _Tenant:
    """One tenant's client on the shared connection, and its requests in flight here."""

    __slots__ = ("client", "in_flight")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.in_flight = 0


class _Slot:
    """A call of a tenant in flight, for a ``with`` block (:meth:`Gateway._slot`;
    a class, not a generator: it is entered on every call)."""

    __slots__ = ("_tenant",)

    def __init__(self, tenant: _Tenant) -> None:
        self._tenant = tenant

    def __enter__(self) -> None:
        self._tenant.in_flight += 1
        metrics.IN_FLIGHT.inc()

    def __exit__(self, *_exc: object) -> None:
        self._tenant.in_flight -= 1
        metrics.IN_FLIGHT.dec()


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
        self._submissions = Submissions(
            config,
            js=lambda: self.js,
            client_of=lambda tenant: self._tenant(tenant).client,
            supervisor=self._supervisor,
        )
        self._answers = Answers(lambda: self.js)
        #: The web console (``/console``), on when ``[gateway] admin_keys`` has a key.
        self.console = Console(
            config,
            js=lambda: self.js,
            keys=lambda: self._keys,
            supervisor=self._supervisor,
            name=name,
        )
        self._runner: web.AppRunner | None = None
        self._closing = False
        #: Calls in progress by API key digest (``max_in_flight_per_key``); no zeros kept.
        self._key_calls: dict[str, int] = {}
        #: Keeps a connection of the gateway's own live (None on a given one).
        self.keeper: ConnectionKeeper | None = None
        self._keeper_loop = f"{name}-nats-connection"
        self._created = int(time.time())
        self._routes = sorted(config.routes)
        self._body_timeout = self._gw.timeouts[1]
        #: Binding split in groups: requests go to their route's subject (no forward).
        self._sharded = config.sharded()

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
        self.console.mount(app)
        header_timeout, _, idle_timeout = self._gw.timeouts
        self._runner = GatewayRunner(
            app,
            header_timeout=header_timeout,
            idle_timeout=idle_timeout,
            send_timeout=parse_duration(self._gw.send_timeout),
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
        log.info(
            "gateway listening", url=self.url, keys=len(self._keys), console=self.console.enabled
        )

    async def _renew(self, new: Connection) -> None:
        """The server closed the gateway's connection (see
        :class:`~renqueue.broker.ConnectionKeeper`): each tenant's client, bound to
        it, is closed, and the next call of each tenant makes one on ``new``.
        Calls under way on the old one end in an error (an SDK retries them:
        a retry under the same body or key joins the stored request)."""
        old = list(self._tenants.values())
        self._tenants.clear()
        self._submissions.renew()
        self._nc = new
        for tenant in old:
            with contextlib.suppress(Exception):
                await tenant.client.close()

    async def _close(self) -> None:
        self._closing = True
        await self._supervisor.cancel(self._keeper_loop)
        self.console.close()
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
        """Every answer: OpenAI-shaped errors, an ``x-request-id``, metrics, and
        the cap on one key's calls in progress."""
        start = time.perf_counter()
        endpoint = _endpoint(request)
        error: ApiError | None = None
        try:
            sha = self._take_place(request)
            try:
                response = await handler(request)
            finally:
                if sha is not None:
                    self._give_place(sha)
        except ApiError as exc:
            error = exc
        except web.HTTPRequestEntityTooLarge:
            error = self._too_large()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status)
            error = ApiError(exc.status, exc.reason, code=code)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away (or the gateway is stopping): cancelled, or
            # met while its body was read or its answer written.
            metrics.CALLS.labels(endpoint, "disconnected").inc()
            stalled = getattr(request.protocol, "stalled", False)
            metrics.DROPPED.labels("slow_reader" if stalled else "disconnected").inc()
            raise
        except (NatsUnavailableError, TimeoutError) as exc:
            # A lookup while NATS reconnects or a leader is elected: try again.
            log.warning("NATS not reachable for a gateway call", endpoint=endpoint, error=str(exc))
            error = from_error(exc)
        except Exception:
            log.exception("gateway error", endpoint=endpoint)
            error = ApiError(500, "internal error", type="server_error", code="internal_error")
        if error is not None:
            response = error_response(error, request.get(_REQUEST_ID))
            if error.status == 408:
                response.force_close()
        if 400 <= response.status < 500:
            metrics.REJECTED.labels(reason_of(error.code if error else None)).inc()
        calls, latency = metrics.of_call(endpoint, response.status)
        calls.inc()
        latency.observe(time.perf_counter() - start)
        return response

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the body is larger than the gateway's limit of {self._gw.max_body} bytes",
            code="request_too_large",
            retry=False,
        )

    def _take_place(self, request: web.Request) -> str | None:
        """The call's API key, looked up once (``_tenant_of`` reads it), takes
        one of its ``max_in_flight_per_key`` places (429 past them); its digest,
        for :meth:`_give_place` when the call ends. A call without a known key
        takes none (it is a 401 at once)."""
        key = bearer_key(request.headers.getall("Authorization", []))
        found = None if key is None else self._keys.lookup(key)
        if found is None:
            return None
        request[_KEY] = found
        sha = found[0]
        limit = self._gw.max_in_flight_per_key
        held = self._key_calls.get(sha, 0)
        if limit and held >= limit:
            raise ApiError(
                429,
                f"too many calls in progress with this API key on this gateway (limit {limit})",
                type="rate_limit_error",
                code="key_in_flight_limit",
                retry_after=1.0,
            )
        self._key_calls[sha] = held + 1
        return sha

    def _give_place(self, sha: str) -> None:
        left = self._key_calls[sha] - 1
        if left:
            self._key_calls[sha] = left
        else:
            del self._key_calls[sha]

    async def _read_body(self, request: web.Request) -> bytes:
        """The request's body, whole: 415 when compressed, 413 over
        ``max_body`` (at once when its ``Content-Length`` says so), 408 when it
        does not arrive within ``body_timeout`` of its headers, 400 when its
        framing is broken."""
        plain_body(request)
        length = request.content_length
        if length is not None and length > self._gw.max_body:
            raise self._too_large()
        async with body_deadline(self._body_timeout):
            return await request.read()

    def _tenant_of(self, request: web.Request) -> str:
        """The tenant of the request's API key; 401 without a known one."""
        if bearer_key(request.headers.getall("Authorization", [])) is None:
            raise ApiError(
                401,
                "no API key given: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        found: tuple[str, str] | None = request.get(_KEY)
        if found is None:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        return found[1]

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            if self._nc is None:
                raise RuntimeError("the gateway is not running")
            client = Client(self._nc, tenant=name, route_subjects=self._sharded)
            tenant = self._tenants[name] = _Tenant(client)
        return tenant

    def _slot(self, tenant: _Tenant) -> _Slot:
        """One more call of ``tenant`` in flight for a ``with`` block; 429 past
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
        return _Slot(tenant)

    async def _route_of(self, tenant: str, request_id: str) -> str:
        """The route of one of the tenant's requests; 404 if the tenant has none by that id."""
        return (await self._origin_of(tenant, request_id)).route

    async def _origin_of(self, tenant: str, request_id: str) -> Origin:
        """The route and creation of one of the tenant's requests; 404 if the
        tenant has none by that id."""
        if not ID_RE.fullmatch(request_id):
            raise _no_such(request_id)
        origin = self._submissions.recent(tenant, request_id)
        if origin is not None:
            return origin
        submitted = await submitted_of(self.js, tenant, request_id)
        if submitted is None:
            raise _no_such(request_id)
        request = submitted.request
        return Origin(request.route, int(request.submitted_at))

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
            raise no_model(name)
        return web.json_response(model_object(name, self._created))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        tenant_name = self._tenant_of(request)
        body = await self._read_body(request)
        sub, key, keep = self._submissions.read(body, request.headers, tenant_name)
        tenant = self._tenant(tenant_name)
        with self._slot(tenant):
            print_ = fingerprint(tenant_name, body)
            retry = request.headers.get("x-stainless-retry-count", "0").strip() not in ("", "0")
            request_id = id_for_key(key) if key is not None else new_id()
            try:
                handle = await self._submissions.submit(
                    tenant.client, sub, print_, request_id, key=key, retry=retry
                )
            except asyncio.CancelledError:
                # Gone while submitting: the publish may have been stored.
                if not keep and not self._closing:
                    self._submissions.cancel_later(
                        tenant.client, request_id, print_, following=False
                    )
                raise
            request[_REQUEST_ID] = handle.id
            origin = self._submissions.recent(tenant_name, handle.id)
            created = int(time.time()) if origin is None else origin.created
            with (
                self._submissions.following(tenant_name, handle.id),
                bound_request(handle.id, tenant=tenant_name),
            ):
                try:
                    if sub.stream:
                        return await self._answers.stream(
                            request,
                            handle,
                            sub.route,
                            created=created,
                            include_usage=sub.include_usage,
                        )
                    return await self._answers.complete(handle, sub.route, created)
                except asyncio.CancelledError:
                    if not keep and not self._closing:
                        self._submissions.cancel_later(tenant.client, handle.id, print_)
                    raise
                except ClientGone as gone:
                    if not keep and not self._closing:
                        self._submissions.cancel_later(tenant.client, handle.id, print_)
                    return gone.response

    async def _resume(self, request: web.Request) -> web.StreamResponse:
        tenant_name = self._tenant_of(request)
        request_id = request.match_info["id"]
        request[_REQUEST_ID] = request_id
        after = parse_last_event_id(request.headers.get("Last-Event-ID"))
        include_usage = request.query.get("include_usage", "").lower() in ("1", "true")
        route, created = await self._origin_of(tenant_name, request_id)
        tenant = self._tenant(tenant_name)
        handle = tenant.client.handle(request_id)
        with self._slot(tenant), bound_request(request_id, tenant=tenant_name):
            return await self._answers.stream(
                request, handle, route, created=created, include_usage=include_usage, after=after
            )

    async def _request_state(self, request: web.Request) -> web.Response:
        tenant_name = self._tenant_of(request)
        request_id = request.match_info["id"]
        request[_REQUEST_ID] = request_id
        route = await self._route_of(tenant_name, request_id)
        events = await EventLog(self.js).history(tenant_name, request_id)
        state = request_state(request_id, route, events)
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


def _no_such(request_id: str) -> ApiError:
    return ApiError(
        404, f"no request {request_id[:128]!r} for this API key", code="request_not_found"
    )


def _endpoint(request: web.Request) -> str:
    """The endpoint's route pattern (bounded label values), not the raw path."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    canonical = getattr(resource, "canonical", None)
    return f"{request.method} {canonical}" if canonical else UNROUTED


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
        await gateway.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if gateway.supervisor.failed.is_set():
        raise ServiceFailedError(gateway.supervisor.reason or "a gateway job failed")
