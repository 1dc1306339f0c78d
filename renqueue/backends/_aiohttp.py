"""An httpx transport on aiohttp's client: the adapters keep httpx's API, aiohttp moves the bytes.

Measured (``bench/http_clients.py``): on an instant local backend, httpx's own
transport (httpcore + h11 + anyio) costs most of an adapter call's CPU; aiohttp's
connection pool and C HTTP parser do the same work for a fraction of it. The
adapters still build, send and read :class:`httpx.Request` and
:class:`httpx.Response` (headers, status, timeouts, error classes), so nothing above
this module changes.

What the transport keeps of httpx's behaviour:

- **Timeouts**, from the request's ``timeout`` extension: ``connect`` bounds the TCP
  (and TLS) connect, ``read`` each wait for bytes, ``pool`` the wait for a free
  connection plus the connect. (``write`` has no aiohttp counterpart: a request body
  is small and written at once.)
- **Errors** as httpx's own classes, chosen as httpcore chooses them: a refused or
  unresolvable connect is :class:`httpx.ConnectError`, a connect or pool wait past
  its deadline :class:`httpx.ConnectTimeout`, a silence past ``read``
  :class:`httpx.ReadTimeout`, a server that hung up or broke the framing
  :class:`httpx.RemoteProtocolError`, a reset :class:`httpx.ReadError`, a URL
  aiohttp cannot reach :class:`httpx.UnsupportedProtocol`. (The httpx-aiohttp
  package's transport reports a refused connect as a connect *timeout*, which the
  adapters would record as the wrong failure class; hence this module.)
- **Closing a response early closes its connection**: a stream the caller stopped
  reading (cancelled, preempted) hangs up on the server, which then stops
  generating. A response read to its end gives its connection back to the pool.
  Closing the transport ends every body still being read with an error (not a
  wait that never ends: aiohttp's own session close leaves such a reader waiting).
- **Bodies are not decoded here** (``auto_decompress=False``): httpx decodes
  ``Content-Encoding`` itself, as with its own transport. No cookies are kept here
  (httpx's client keeps them), no redirects followed (httpx decides).
- **Proxies from the environment** (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``,
  ``NO_PROXY``) are honoured as httpx honours them: :class:`AiohttpClient` gives
  httpx's client this transport as its default one only, so httpx still routes a
  proxied URL to its own proxy transport. (An ``httpx.AsyncClient`` given a
  ``transport=`` would ignore the environment's proxies.)

**The direct path** (:meth:`AiohttpClient.open`). httpx's client spends, per call,
more CPU than the transport under it: building and merging the request's headers,
its chain of send steps, and walking its cookie jar for every response
(``bench/README.md``, *The adapters' HTTP client*). An adapter's own pool converts
each kind of call it makes once (:meth:`AiohttpClient.prepare`: the URL, the
client's headers merged under the adapter's, the timeouts as aiohttp's) and sends
it straight to this transport, still as an :class:`httpx.Request` answered by an
:class:`httpx.Response` with httpx's error classes; what it skips it skips only
where it does nothing (no proxy for the URL, no cookie kept, no auth, hooks,
params or redirects), and a cookie a response sets is kept as the client keeps it.
A body with no ``Content-Encoding`` is then read straight off
:class:`ResponseStream` (:meth:`ResponseStream.pieces`, :meth:`ResponseStream.read`),
not through httpx's stacked async generators; an encoded one through httpx, which
decodes it.
"""

from __future__ import annotations

import functools
import inspect
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final

import aiohttp
import httpx
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["AiohttpClient", "AiohttpTransport", "Prepared", "ResponseStream", "client_timeout"]

#: The longest response status line or header aiohttp reads (h11's bound on a whole head).
_MAX_HEAD: Final = 16 * 1024

#: aiohttp's exceptions as httpx's, most specific first (the first that matches wins).
_ERRORS: Final[tuple[tuple[type[BaseException], type[httpx.TransportError]], ...]] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ClientProxyConnectionError, httpx.ProxyError),
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.InvalidUrlClientError, httpx.UnsupportedProtocol),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.RemoteProtocolError),
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),
    (aiohttp.ClientOSError, httpx.ReadError),
    (aiohttp.ClientError, httpx.TransportError),
)


#: What an aiohttp exception kept as a cause says of the request's headers: nothing.
_NO_HEADERS: Final = CIMultiDictProxy(CIMultiDict[str]())


def _translated(exc: aiohttp.ClientError, request: httpx.Request) -> httpx.TransportError:
    """aiohttp's exception as httpx's (the first row of :data:`_ERRORS` it is).

    ``exc`` stays the cause, less the request's headers it holds (a response
    error's ``request_info``: the key, in its repr)."""
    if isinstance(exc, aiohttp.ClientResponseError):
        exc.request_info = exc.request_info._replace(headers=_NO_HEADERS)
    for theirs, ours in _ERRORS:
        if isinstance(exc, theirs):
            return ours(str(exc) or type(exc).__name__, request=request)
    raise AssertionError("aiohttp.ClientError is the last row")  # pragma: no cover


def client_timeout(timeout: Mapping[str, float | None]) -> aiohttp.ClientTimeout:
    """httpx's timeout extension (``Timeout.as_dict()``) as aiohttp's (module docstring)."""
    return _client_timeout(timeout.get("pool"), timeout.get("connect"), timeout.get("read"))


@functools.lru_cache(maxsize=64)
def _client_timeout(
    pool: float | None, connect: float | None, read: float | None
) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, connect=pool, sock_connect=connect, sock_read=read)


class ResponseStream(httpx.AsyncByteStream):
    """A response body as it arrives: each chunk what one network read brought.

    Besides httpx's reading (through :class:`httpx.Response`), the adapters read
    it straight (:meth:`pieces`, :meth:`read`) when httpx has nothing to decode:
    one iterator object, no async generators stacked on each other.
    """

    __slots__ = ("_open", "_request", "_response", "encoded", "sets_cookie")

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        request: httpx.Request,
        open_responses: set[aiohttp.ClientResponse],
    ) -> None:
        self._response = response
        self._request = request
        self._open = open_responses
        headers = response.headers  # (a multidict in C: lookups cost next to nothing)
        #: The body has a ``Content-Encoding`` (httpx decodes it when it reads it).
        self.encoded = "Content-Encoding" in headers
        #: The response sets a cookie (the client keeps it).
        self.sets_cookie = "Set-Cookie" in headers

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Pieces(self._response.content, self._request)

    def pieces(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive, as httpx's errors."""
        return _Pieces(self._response.content, self._request)

    async def read(self) -> bytes:
        """The whole body (its bytes as they came: no content decoding)."""
        try:
            return await self._response.read()
        except aiohttp.ClientError as exc:
            raise _translated(exc, self._request) from exc

    def at_end(self) -> bool:
        """Whether the whole body has been read (its end too)."""
        return self._response.content.at_eof()

    async def aclose(self) -> None:
        self._open.discard(self._response)
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()  # stopped early: hang up, so the server stops too


class _Pieces:
    """What one network read brought, read after read, until the body's end
    (aiohttp's ``iter_any``, its errors as httpx's)."""

    __slots__ = ("_content", "_request")

    def __init__(self, content: aiohttp.StreamReader, request: httpx.Request) -> None:
        self._content = content
        self._request = request

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        try:
            piece = await self._content.readany()
        except aiohttp.ClientError as exc:
            raise _translated(exc, self._request) from exc
        if not piece:
            raise StopAsyncIteration
        return piece


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp connection pool of ``limits.max_connections`` (module docstring).

    Its session is made on the first request (aiohttp binds it to the running loop)
    and closed by :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        limits: httpx.Limits,
        verify: ssl.SSLContext | str | bool = True,
        trust_env: bool = True,
    ) -> None:
        self._limits = limits
        self._ssl = httpx.create_ssl_context(verify=verify, trust_env=trust_env)
        self._session: aiohttp.ClientSession | None = None
        #: The responses given out and not closed yet (:meth:`aclose` closes them).
        self._responses: set[aiohttp.ClientResponse] = set()

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._limits.max_connections or 0,
            keepalive_timeout=(
                self._limits.keepalive_expiry if self._limits.keepalive_expiry is not None else 5.0
            ),
            ssl=self._ssl,
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            # A response head as large as httpx's own transport read (h11: 16 KiB);
            # aiohttp's default refuses any header line over 8 KiB.
            max_line_size=_MAX_HEAD,
            max_field_size=_MAX_HEAD,
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        return await self.send(
            request,
            url=str(request.url),
            headers=request.headers.multi_items(),
            body=await request.aread() or None,
            limits=client_timeout(timeout),
        )

    async def send(
        self,
        request: httpx.Request,
        *,
        url: str,
        headers: Sequence[tuple[str, str]],
        body: bytes | None,
        limits: aiohttp.ClientTimeout,
    ) -> httpx.Response:
        """Send ``request`` as ``url``, ``headers`` and ``body`` say it, within
        ``limits`` (its parts, converted once by the caller: :meth:`AiohttpClient.open`)."""
        if self._session is None:
            self._session = self._new_session()
        try:
            response = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=body,
                allow_redirects=False,
                compress=None,
                timeout=limits,
            )
        except aiohttp.ClientError as exc:
            raise _translated(exc, request) from exc
        self._responses.add(response)
        extensions = {"http_version": b"HTTP/1.1"}
        if response.reason:
            extensions["reason_phrase"] = response.reason.encode("ascii", errors="replace")
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=ResponseStream(response, request, self._responses),
            extensions=extensions,
            request=request,
        )

    async def aclose(self) -> None:
        # A body still being read ends with an error (aiohttp's "Connection closed",
        # as httpx's TransportError) first: closing the session alone leaves its
        # reader waiting for good (its read timeout dropped with the connection)
        # or, between two reads, raising a bare RuntimeError.
        responses, self._responses = self._responses, set()
        for response in responses:
            response.close()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


#: httpx's own default pool limits.
_DEFAULT_LIMITS: Final = httpx.Limits(max_connections=100, max_keepalive_connections=20)

#: httpx's private methods :class:`AiohttpClient` relies on (``pyproject.toml`` pins
#: httpx's minor versions): ``_init_transport``, overridden (what httpx's client
#: calls for its default transport, with the arguments below) and
#: ``_transport_for_url`` (the transport a URL goes to: a proxy's, or the default one).
#: :func:`_require_httpx_parts` checks them when a client is made: an httpx that
#: moved one fails at start, saying which, instead of failing every call with an
#: ``AttributeError`` or quietly moving the bytes on its own transport.
_HTTPX_PARTS: Final = ("_init_transport", "_transport_for_url")
_INIT_TRANSPORT_ARGS: Final = frozenset(
    {"verify", "cert", "trust_env", "http1", "http2", "limits", "transport"}
)


def _require_httpx_parts() -> None:
    """Raise a ``RuntimeError`` naming what of httpx's private parts
    (:data:`_HTTPX_PARTS`) this module relies on and does not find."""
    missing = [
        f"AsyncClient.{name}"
        for name in _HTTPX_PARTS
        if not callable(getattr(httpx.AsyncClient, name, None))
    ]
    if not missing:
        init = inspect.signature(httpx.AsyncClient._init_transport).parameters
        other = sorted(set(init) - {"self"} - _INIT_TRANSPORT_ARGS)
        if other:
            missing.append(
                f"AsyncClient._init_transport as AiohttpClient overrides it (it takes "
                f"{', '.join(other)} too)"
            )
    if missing:
        raise RuntimeError(
            "this httpx is not the one renqueue.backends relies on (pyproject.toml pins "
            f"httpx 0.28-0.29: its private parts): missing {'; '.join(missing)}"
        )


class AiohttpClient(httpx.AsyncClient):
    """An :class:`httpx.AsyncClient` whose default transport is :class:`AiohttpTransport`
    (of the client's ``limits``); a URL the environment proxies goes, as in httpx,
    through httpx's own proxy transport.

    Made only with an httpx whose private parts it relies on are as it expects
    (:data:`_HTTPX_PARTS`; else a ``RuntimeError`` naming them).
    """

    def __init__(self, **kwargs: Any) -> None:
        _require_httpx_parts()
        super().__init__(**kwargs)

    def _init_transport(  # noqa: PLR0917 - httpx's own signature
        self,
        verify: ssl.SSLContext | str | bool = True,
        cert: Any = None,  # not used: client certificates are not configurable here
        trust_env: bool = True,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits = _DEFAULT_LIMITS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> httpx.AsyncBaseTransport:
        if transport is not None:
            return transport
        return AiohttpTransport(limits=limits, verify=verify, trust_env=trust_env)

    def prepare(
        self, method: str, url: httpx.URL, *, headers: httpx.Headers, timeout: httpx.Timeout
    ) -> Prepared:
        """One kind of call (method, URL, headers, timeout), converted once for :meth:`open`.

        The client's own headers are merged under ``headers`` here, as its
        ``build_request`` would merge them on each call (``headers`` keeps its
        class: a repr that masks a key stays masked).
        """
        merged = type(headers)(self.headers)
        merged.update(headers)
        return Prepared(method, url, merged, timeout)

    async def open(
        self, call: Prepared, content: bytes, *, header: tuple[str, str] | None = None
    ) -> httpx.Response:
        """Send ``call`` with body ``content`` (and one more ``header``); the
        response is open, its body unread (the caller reads and closes it).

        What ``stream()`` and ``post()`` would do, at a fraction of their CPU:
        the request goes straight to the transport, its headers, URL and
        timeout converted once (:meth:`prepare`), when nothing of the client's
        own send applies to it: no proxy for its URL, no cookie kept, no auth,
        no event hooks, no params, no redirects to follow. Otherwise (and on a
        closed client) it goes through :meth:`send`, as any request. A
        response that sets a cookie has it kept, as the client keeps it (later
        calls then go through :meth:`send`, which sends it).
        """
        headers, items = call.headers, call.items
        if header is not None:
            headers = type(headers)(headers)
            headers[header[0]] = header[1]
            items = [*items, header]
        transport = self._transport_for_url(call.url)
        if (
            not isinstance(transport, AiohttpTransport)
            or self.is_closed
            or self.cookies
            or self.auth is not None
            or self.params
            or self.follow_redirects
            or any(self.event_hooks.values())
        ):
            request = self.build_request(
                call.method, call.url, content=content, headers=headers, timeout=call.timeout
            )
            return await self.send(request, stream=True)
        request = httpx.Request(
            call.method,
            call.url,
            headers=headers,
            stream=httpx.ByteStream(content),
            extensions=call.extensions,
        )
        response = await transport.send(
            request, url=call.text, headers=items, body=content or None, limits=call.aiohttp
        )
        stream = response.stream
        if isinstance(stream, ResponseStream) and stream.sets_cookie:
            self.cookies.extract_cookies(response)
        return response


class Prepared:
    """One kind of call, its parts in every form :meth:`AiohttpClient.open` needs them."""

    __slots__ = ("aiohttp", "extensions", "headers", "items", "method", "text", "timeout", "url")

    def __init__(
        self, method: str, url: httpx.URL, headers: httpx.Headers, timeout: httpx.Timeout
    ) -> None:
        self.method = method
        self.url = url
        self.text = str(url)
        self.headers = headers
        self.items = headers.multi_items()
        self.timeout = timeout
        self.extensions = {"timeout": timeout.as_dict()}
        self.aiohttp = client_timeout(self.extensions["timeout"])
