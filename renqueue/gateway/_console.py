"""The web console: a read-only live view of the whole cluster, behind an admin key.

Served by the gateway (docs/gateway.md, "The console") when ``[gateway]
admin_keys`` names at least one key:

- ``GET /console``: the page, and ``GET /console/static/{name}`` its script
  and style: plain files of the package (``renqueue/gateway/console/``), no
  build step, nothing fetched from elsewhere (the page's Content-Security-Policy
  allows only this origin);
- ``GET /console/api/status``: one snapshot of everything the page shows but
  the events, read as ``renqueue status``, ``renqueue ab status`` and
  ``renqueue dlq list`` read it (:func:`~renqueue.coordination.read_status`,
  :func:`~renqueue.coordination.read_splits`,
  :class:`~renqueue.broker.DeadLetters`). Built at most once a
  :data:`SNAPSHOT_TTL` for every console together (the dead letters read again
  only when ``RQ_DLQ`` changed), so consoles cost NATS the same whether one is
  open or fifty;
- ``GET /console/api/events``: the event log as server-sent events, from the
  one shared tail (:class:`~._console_feed.EventFeed`), each line under an id
  of its own (its event's stream sequence, ``<seq>.1`` for the second line of
  one stored event), resumable by ``Last-Event-ID`` after any line (an id not
  of that form is ignored); an ``event: gap``
  says some were missed (reload the snapshot), an ``event: error`` that the
  tail is down (it retries on its own);
- ``GET /console/api/requests/{id}`` (``?tenant=``): a request's timeline,
  every event the log holds of it (what ``renqueue audit`` prints);
- ``POST /console/login`` (the key, as a form field or JSON ``{"key": ...}``)
  and ``POST /console/logout``: a session for the page (an ``EventSource``
  cannot send a header): a random token (:class:`Sessions`, kept in this
  process for :data:`SESSION_AGE`, forgotten on logout), never the key, in an
  HttpOnly, ``SameSite=Strict`` cookie, ``Secure`` unless the page was asked
  for over plain HTTP on a loopback host (a gateway reached by any other
  name is meant to be behind TLS). Either refuses (403) a request whose
  ``Origin`` is another site's. The API also takes ``Authorization: Bearer
  <admin key>``.

An admin key is stored as its SHA-256 like a tenant's key (:mod:`._keys`),
and never logged or echoed. No key is a 401, a tenant's key a 403: it speaks
for a tenant, and the console shows every tenant.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from collections.abc import Callable
from importlib import resources
from typing import Final
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from ..broker import DeadLetterFilter, DeadLetters, EventLog, JetStream
from ..config import Config
from ..coordination import read_splits, read_status
from ..errors import NatsError
from ..schema import DLQ_STREAM, Event, kind_of
from ..tasks import Supervisor
from ._connections import body_deadline, plain_body
from ._console_feed import (
    NOTICE,
    RESTART,
    EventFeed,
    Position,
    Subscriber,
    frame,
    parse_event_id,
    shown,
)
from ._errors import ApiError, bearer_key
from ._keys import MAX_KEY_LENGTH, KeyStore, digest
from ._submissions import ID_RE

__all__ = ["SESSION_AGE", "SNAPSHOT_TTL", "Console", "Sessions", "timeline_entry"]

#: Seconds a status snapshot is reused for every console.
SNAPSHOT_TTL: Final = 1.0
#: Dead letters listed (the newest).
DLQ_SHOWN: Final = 50
#: Seconds between keep-alive comments on a quiet event stream.
KEEPALIVE: Final = 15.0
#: The cookie the page's session token is kept in, and how long a session lasts (seconds).
COOKIE: Final = "rq_console"
SESSION_AGE: Final = 12 * 3600
_STATIC: Final = {
    "console.js": "application/javascript",
    "console.css": "text/css",
}
_SECURITY: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
        " img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return (resources.files("renqueue.gateway") / "console" / name).read_bytes()


def timeline_entry(event: Event) -> dict[str, object]:
    """One event of a request's timeline: its time, kind and the fields a console
    may show of it (:func:`~._console_feed.shown`: never the prompt, the answer
    cut at 200 characters, its tool calls and log probabilities counted). Pure."""
    return {"at": event.at, **shown(event, live=False), "kind": kind_of(event)}


class Sessions:
    """The console's logged-in pages: a random token per login, valid in this
    process for ``age`` seconds by ``clock`` (injectable), until logout. Kept as
    their SHA-256 (like keys); a gateway that restarts forgets them (log in again)."""

    def __init__(
        self, *, age: float = SESSION_AGE, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._age = age
        self._clock = clock
        self._expiry: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def open(self) -> str:
        """A new session's token (the expired ones are forgotten meanwhile)."""
        now = self._clock()
        for stale in [d for d, until in self._expiry.items() if until <= now]:
            del self._expiry[stale]
        token = secrets.token_urlsafe(32)
        self._expiry[digest(token)] = now + self._age
        return token

    def valid(self, token: str) -> bool:
        if not token or len(token) > MAX_KEY_LENGTH:
            return False
        key = digest(token)
        until = self._expiry.get(key)
        if until is None:
            return False
        if until <= self._clock():
            del self._expiry[key]
            return False
        return True

    def close(self, token: str) -> None:
        """Forget ``token``'s session (logout): a copy of the cookie stops working."""
        if token and len(token) <= MAX_KEY_LENGTH:
            self._expiry.pop(digest(token), None)


class Console:
    """The console's endpoints, mounted on the gateway's app by :meth:`mount`."""

    def __init__(
        self,
        config: Config,
        *,
        js: Callable[[], JetStream],
        keys: Callable[[], KeyStore],
        supervisor: Supervisor,
        name: str = "renqueue-gateway",
    ) -> None:
        self._config = config
        self._js = js
        self._keys = keys
        self._admins = frozenset(config.gateway.admin_keys)
        self._body_timeout = config.gateway.timeouts[1]
        self.feed = EventFeed(js, supervisor, name=f"{name}-console-feed")
        self._snapshot: tuple[float, bytes] | None = None
        #: The dead letters as last read, and the stream's (last seq, count) then.
        self._dlq: tuple[tuple[int, int], dict[str, object]] | None = None
        self._snapshot_lock = asyncio.Lock()
        #: Snapshots built (one per SNAPSHOT_TTL at most, whatever the consoles).
        self.snapshots_built = 0
        self._closing = False
        self._streams: set[Subscriber] = set()
        self._pages = {name: _asset(name) for name in ("index.html", *_STATIC)}
        #: The pages logged in (their cookies' tokens).
        self.sessions = Sessions()

    @property
    def enabled(self) -> bool:
        return bool(self._admins)

    def mount(self, app: web.Application) -> None:
        app.router.add_get("/console", self._page)
        app.router.add_get("/console/", self._page)
        app.router.add_get("/console/static/{name}", self._static)
        app.router.add_post("/console/login", self._login)
        app.router.add_post("/console/logout", self._logout)
        app.router.add_get("/console/api/status", self._status)
        app.router.add_get("/console/api/events", self._events)
        app.router.add_get("/console/api/requests/{id}", self._timeline)

    def close(self) -> None:
        """Ends every open event stream (the gateway is stopping)."""
        self._closing = True
        for subscriber in list(self._streams):
            subscriber.end()

    # --------------------------------------------------------------- the key

    def _check(self, key: str) -> None:
        """Nothing if ``key`` is an admin key; else the 401 or 403 it gets."""
        if not key or len(key) > MAX_KEY_LENGTH:
            raise _no_key()
        if digest(key) in self._admins:
            return
        if self._keys().tenant_of(key) is not None:
            raise ApiError(
                403,
                "this is a tenant's API key: the console needs an admin key ([gateway] admin_keys)",
                type="permission_error",
                code="admin_key_required",
            )
        raise ApiError(401, "incorrect admin key provided", code="invalid_api_key")

    def _admin(self, request: web.Request) -> None:
        """The request's admin key (``Authorization: Bearer``) or the page's
        session (its cookie) is checked; 404 while the console is off."""
        if not self.enabled:
            raise _off()
        key = bearer_key(request.headers.getall("Authorization", []))
        if key is not None:
            self._check(key)
            return
        token = request.cookies.get(COOKIE, "")
        if not token:
            raise _no_key()
        if not self.sessions.valid(token):
            raise ApiError(
                401,
                "the console's session has ended (logged out or expired): log in again",
                code="invalid_api_key",
            )

    # ------------------------------------------------------------ the page

    async def _page(self, _request: web.Request) -> web.Response:
        if not self.enabled:
            raise _off()
        return self._file("index.html", "text/html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not self.enabled or name not in _STATIC:
            raise ApiError(404, "no such file", code="not_found")
        return self._file(name, _STATIC[name])

    def _file(self, name: str, content_type: str) -> web.Response:
        response = web.Response(body=self._pages[name], content_type=content_type)
        response.headers.update(_SECURITY)
        return response

    async def _login(self, request: web.Request) -> web.Response:
        if not self.enabled:
            raise _off()
        _same_origin(request)
        key = ""
        plain_body(request)
        if request.content_type == "application/json":
            async with body_deadline(self._body_timeout):
                raw = await request.read()
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError as exc:
                raise ApiError(400, "the body is not JSON", code="invalid_json") from exc
            if isinstance(body, dict) and isinstance(body.get("key"), str):
                key = body["key"].strip()
        else:
            async with body_deadline(self._body_timeout):
                form = await request.post()
            value = form.get("key")
            key = value.strip() if isinstance(value, str) else ""
        self._check(key)
        response = web.Response(status=204)
        response.set_cookie(
            COOKIE,
            self.sessions.open(),
            max_age=SESSION_AGE,
            path="/console",
            httponly=True,
            samesite="Strict",
            secure=request.secure or not _loopback(request.url.host),
        )
        return response

    async def _logout(self, request: web.Request) -> web.Response:
        _same_origin(request)
        self.sessions.close(request.cookies.get(COOKIE, ""))
        response = web.Response(status=204)
        response.del_cookie(COOKIE, path="/console")
        return response

    # ------------------------------------------------------------ the data

    async def _status(self, request: web.Request) -> web.Response:
        self._admin(request)
        return web.Response(body=await self.snapshot(), content_type="application/json")

    async def snapshot(self) -> bytes:
        """The status snapshot, built at most once a :data:`SNAPSHOT_TTL` for all."""
        async with self._snapshot_lock:
            now = time.monotonic()
            if self._snapshot is not None and now - self._snapshot[0] < SNAPSHOT_TTL:
                return self._snapshot[1]
            body = msgspec.json.encode(await self._build())
            self._snapshot = (time.monotonic(), body)
            self.snapshots_built += 1
            return body

    async def _build(self) -> dict[str, object]:
        js = self._js()
        at = time.time()
        status, splits, dlq = await asyncio.gather(
            read_status(js, self._config, now=at),
            read_splits(js, self._config, now=at),
            self._dead_letters(js),
        )
        aging = {level.name: level.age_after for level in self._config.level_policies()}
        return {
            "at": at,
            "status": status,
            "aging": aging,
            "splits": splits,
            "dlq": dlq,
            "feed": {"last_seq": self.feed.last_seq, "consoles": self.feed.subscribers},
        }

    async def _dead_letters(self, js: JetStream) -> dict[str, object]:
        """The newest dead letters; read again only when ``RQ_DLQ`` changed (a
        listing scans the stream)."""
        try:
            info = await js.stream_info(DLQ_STREAM)
            mark = (int(info.state.last_seq), int(info.state.messages))
            if self._dlq is not None and self._dlq[0] == mark:
                return self._dlq[1]
            listing = await DeadLetters(js).find(DeadLetterFilter(), limit=DLQ_SHOWN)
        except NatsError as exc:
            return {"error": str(exc), "count": None, "entries": []}
        out: dict[str, object] = {
            "count": listing.matched,
            "unreadable": listing.unreadable,
            "entries": [
                {
                    "seq": e.seq,
                    "time": e.time,
                    "stage": e.stage,
                    "tenant": e.tenant,
                    "request_id": e.request_id,
                    "error_type": e.error_type,
                    "reason": e.reason[:300],
                    "requeued_as": None if e.requeued is None else e.requeued.new_id,
                }
                for e in reversed(listing.entries)
            ],
        }
        self._dlq = (mark, out)
        return out

    async def _timeline(self, request: web.Request) -> web.Response:
        self._admin(request)
        request_id = request.match_info["id"]
        tenant = request.query.get("tenant", "") or "*"
        if not ID_RE.fullmatch(request_id):
            raise ApiError(400, "a request id is 1-128 of A-Z a-z 0-9 _ -", code="invalid_id")
        if tenant != "*" and not ID_RE.fullmatch(tenant):
            raise ApiError(400, "a tenant is 1-64 of A-Z a-z 0-9 _ -", code="invalid_tenant")
        events = await EventLog(self._js()).history(tenant, request_id)
        if not events:
            raise ApiError(
                404, f"no events logged for request {request_id!r}", code="request_not_found"
            )
        body = {
            "request_id": request_id,
            "tenant": events[0].tenant,
            "events": [timeline_entry(event) for event in events],
        }
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        self._admin(request)
        if self._closing:
            raise ApiError(503, "the gateway is stopping", type="server_error", code="unavailable")
        last = parse_event_id(request.headers.get("Last-Event-ID"))
        subscriber = await self.feed.subscribe()
        self._streams.add(subscriber)
        try:
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            await response.prepare(request)
            kept = self.feed.recent() if last is None else self.feed.since(last)
            head = b"retry: 2000\n\n"
            sent = last or (0, 0)
            if kept is None:  # some events after ``last`` are no longer kept
                head += b"event: gap\ndata: {}\n\n"
                kept = self.feed.recent()
                sent = (0, 0)
            if self.feed.down is not None:
                head += b"event: error\ndata: %s\n\n" % msgspec.json.encode(
                    {"reason": self.feed.down}
                )
            chunks = [head]
            written = _Written(sent)
            for position, data in kept:
                if written.fresh(position):
                    chunks.append(frame(position, data))
            await response.write(b"".join(chunks))
            await self._pump(response, subscriber.queue, written)
            return response
        finally:
            self._streams.discard(subscriber)
            await self.feed.unsubscribe(subscriber)

    async def _pump(
        self,
        response: web.StreamResponse,
        queue: asyncio.Queue[tuple[Position, bytes] | None],
        written: _Written,
    ) -> None:
        """Write what the feed hands over, as many at a time as are waiting."""
        while True:
            try:
                first = await asyncio.wait_for(queue.get(), KEEPALIVE)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            batch = [first]
            while not queue.empty():
                batch.append(queue.get_nowait())
            chunks = []
            ended = False
            for item in batch:
                if item is None:
                    ended = True
                    break
                position, chunk = item
                if position[0] <= NOTICE:  # a notice; after RESTART, the log starts over
                    chunks.append(chunk)
                    written = _Written((0, 0)) if position[0] == RESTART else written
                elif written.fresh(position):
                    chunks.append(chunk)
            if chunks:
                await response.write(b"".join(chunks))
            if ended:
                return


class _Written:
    """What an event stream has written: the position of its last line. Lines
    come in position order; one the feed hands over again (kept, then queued)
    is written once."""

    def __init__(self, position: Position) -> None:
        self.position = position

    def fresh(self, position: Position) -> bool:
        """Whether the line at ``position`` is still to be written; then it counts as written."""
        if position <= self.position:
            return False
        self.position = position
        return True


def _same_origin(request: web.Request) -> None:
    """A 403 for a request another site's page sent (its ``Origin`` names
    another host than the one asked); none without an ``Origin`` (a script)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return
    if urlsplit(origin.strip()).netloc.lower() != request.host.lower():
        raise ApiError(
            403,
            "a login or logout from another site's page is refused",
            type="permission_error",
            code="cross_origin",
        )


def _loopback(host: str | None) -> bool:
    """Whether ``host`` (the name the page was asked for by) is this machine."""
    if not host:
        return False
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _no_key() -> ApiError:
    return ApiError(
        401,
        "no admin key given: send it as 'Authorization: Bearer <key>', or log in on /console",
        code="invalid_api_key",
    )


def _off() -> ApiError:
    return ApiError(
        404,
        "the console is off: give [gateway] admin_keys (`renqueue gateway keygen --admin`)",
        code="console_disabled",
    )
