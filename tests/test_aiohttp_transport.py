"""The adapters' transport on aiohttp (renqueue/backends/_aiohttp.py): what it must keep
of httpx's own (connections reused, a stream stopped early hangs up, errors of the same
classes, timeouts), against real servers on loopback.

The wire formats' behaviour on it (odd and broken streams, statuses, rate-limit
headers, error bodies) is checked in tests/test_openai_adapter.py, whose scripted
servers run on both transports.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from _loopback import serve
from aiohttp import web

from renqueue.backends._aiohttp import AiohttpClient, AiohttpTransport
from renqueue.backends.openai import OpenAIBackend
from renqueue.config import BackendConfig
from renqueue.errors import BackendError, FailureClass, RetryableBackendError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import ChatMessage, InferenceRequest

REQUEST = InferenceRequest(
    id="req-1", route="chat", messages=[ChatMessage(role="user", content="hi")]
)


def test_adapters_move_their_bytes_on_aiohttp() -> None:
    adapter = OpenAIBackend("m", BackendConfig(base_url="http://127.0.0.1:1/v1", model="m"))
    assert adapter.transport == "aiohttp"
    assert len(adapter._pools) == 1
    assert isinstance(adapter._pools[0]._transport, AiohttpTransport)


class Peers:
    """A server that remembers which client connection (its port) each request came on."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.hung_up = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/once", self.once)
        app.router.add_post("/endless", self.endless)
        app.router.add_get("/gzip", self.gzipped)
        app.router.add_get("/long-header", self.long_header)
        return app

    def _note(self, request: web.Request) -> None:
        assert request.transport is not None
        self.ports.append(request.transport.get_extra_info("peername")[1])

    async def once(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        return web.Response(text="done", headers={"x-ratelimit-remaining-requests": "7"})

    async def long_header(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="done", headers={"x-long": "a" * 12_000})

    async def endless(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: x\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            self.hung_up.set()
            raise

    async def gzipped(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=gzip.compress(b'{"ok": true}'),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )


@pytest.fixture
async def peers() -> AsyncIterator[tuple[Peers, str]]:
    server = Peers()
    async with serve(server.app()) as origin:
        yield server, origin


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = AiohttpTransport(limits=httpx.Limits(max_connections=4))
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        yield http


async def test_a_finished_response_gives_its_connection_back(
    peers: tuple[Peers, str], client: httpx.AsyncClient
) -> None:
    server, origin = peers
    for _ in range(3):
        response = await client.post(f"{origin}/once", content=b"{}")
        assert response.text == "done"
        assert response.headers["x-ratelimit-remaining-requests"] == "7"
    assert len(set(server.ports)) == 1


async def test_a_stream_stopped_early_hangs_up(
    peers: tuple[Peers, str], client: httpx.AsyncClient
) -> None:
    """A cancelled read (a worker's call cancelled or preempted) closes the connection:
    the server sees the hang-up and stops, and the connection is never reused."""
    server, origin = peers
    started = asyncio.Event()

    async def read() -> None:
        async with client.stream("POST", f"{origin}/endless", content=b"{}") as response:
            async for _ in response.aiter_bytes():
                started.set()

    reader = asyncio.create_task(read())
    await started.wait()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await asyncio.wait_for(server.hung_up.wait(), 5.0)
    await client.post(f"{origin}/once", content=b"{}")
    assert len(set(server.ports)) == 2


async def test_a_cancelled_adapter_call_stops_the_backend() -> None:
    """The adapter on its own pools: cancelling the task that reads a stream ends the
    backend's generation (the mock counts the disconnect, no more tokens go out)."""
    async with MockBackend(MockSettings(output_tokens=500, tokens_per_second=100)) as mock:
        adapter = OpenAIBackend("mock", BackendConfig(base_url=mock.url, model="m"))
        first = asyncio.Event()

        async def call() -> None:
            async for _ in adapter.stream(REQUEST):
                first.set()

        task = asyncio.create_task(call())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(400):  # the mock's counter has no event to wait on
            if mock.stats().disconnects:
                break
            await asyncio.sleep(0.005)
        stats = mock.stats()
        await adapter.close()
    assert stats.disconnects == 1
    assert stats.tokens_out < 50


async def test_a_call_cancelled_before_its_first_token_hangs_up() -> None:
    """Preempted while the backend is still thinking (before any byte of the answer):
    the connection is closed, so the backend sees the client gone and answers no one."""
    async with MockBackend(MockSettings(ttft=0.5, output_tokens=5)) as mock:
        adapter = OpenAIBackend("mock", BackendConfig(base_url=mock.url, model="m"))
        task = asyncio.create_task(adapter.complete(REQUEST))
        for _ in range(400):  # the mock's counters have no event to wait on
            if mock.stats().in_flight:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(400):
            if mock.stats().disconnects:
                break
            await asyncio.sleep(0.005)
        stats = mock.stats()
        await adapter.close()
    assert stats.disconnects == 1
    assert stats.completed == 0


async def test_a_compressed_body_is_decoded_by_httpx(
    peers: tuple[Peers, str], client: httpx.AsyncClient
) -> None:
    _server, origin = peers
    response = await client.get(f"{origin}/gzip")
    assert response.json() == {"ok": True}


async def test_a_header_longer_than_8_kib_is_read(
    peers: tuple[Peers, str], client: httpx.AsyncClient
) -> None:
    """As on httpx's own transport (h11 reads a head of up to 16 KiB)."""
    _server, origin = peers
    response = await client.get(f"{origin}/long-header")
    assert len(response.headers["x-long"]) == 12_000


async def test_a_refused_connect_is_a_connect_error() -> None:
    """Not a connect *timeout* (what the httpx-aiohttp package reports): the adapter
    records a refused connect as ``connect``, a slow one as ``connect_timeout``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    adapter = OpenAIBackend(
        "gone", BackendConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m")
    )
    with pytest.raises(RetryableBackendError) as caught:
        await adapter.complete(REQUEST)
    await adapter.close()
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert caught.value.failure is FailureClass.CONNECT


async def test_a_full_pool_waits_at_most_the_pool_timeout(
    peers: tuple[Peers, str],
) -> None:
    _server, origin = peers
    transport = AiohttpTransport(limits=httpx.Limits(max_connections=1))
    timeout = httpx.Timeout(5.0, pool=0.2)
    async with (
        httpx.AsyncClient(transport=transport, timeout=timeout) as http,
        http.stream("POST", f"{origin}/endless", content=b"{}"),
    ):
        with pytest.raises(httpx.ConnectTimeout):
            await http.post(f"{origin}/once", content=b"{}")


async def test_a_silent_server_is_a_read_timeout() -> None:
    async def silent(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(10)
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", silent)
    async with serve(app) as origin:
        config = BackendConfig(base_url=f"{origin}/v1", model="m", timeout="100ms")
        adapter = OpenAIBackend("slow", config)
        with pytest.raises(RetryableBackendError) as caught:
            await adapter.complete(REQUEST)
        await adapter.close()
    assert isinstance(caught.value.__cause__, httpx.ReadTimeout)
    assert caught.value.failure is FailureClass.FIRST_TOKEN_TIMEOUT


async def test_a_proxy_from_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HTTP_PROXY`` routes the adapter's calls through that proxy, as on httpx's own
    transport (a client given ``transport=`` would ignore it)."""
    seen: list[str] = []

    async def proxy(request: web.Request) -> web.StreamResponse:
        seen.append(str(request.url))  # a forward proxy is asked for the absolute URL
        return web.Response(status=418, text="a proxy")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with serve(app) as origin:
        monkeypatch.setenv("HTTP_PROXY", origin)
        config = BackendConfig(base_url="http://backend.invalid/v1", model="m")
        adapter = OpenAIBackend("proxied", config)
        with pytest.raises(BackendError) as caught:
            await adapter.complete(REQUEST)
        await adapter.close()
    assert caught.value.status == 418
    assert seen == ["http://backend.invalid/v1/chat/completions"]


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (the system's openssl)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_tls_is_verified_against_the_environments_roots(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https backend: its certificate is checked (``SSL_CERT_FILE``, as httpx reads it,
    else certifi's roots), and one that does not check out is a connect error."""
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = Peers()
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    origin = f"https://127.0.0.1:{runner.addresses[0][1]}"
    try:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        untrusted = AiohttpClient(timeout=5.0)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.post(f"{origin}/once", content=b"{}")
        await untrusted.aclose()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        async with AiohttpClient(timeout=5.0) as trusted:
            response = await trusted.post(f"{origin}/once", content=b"{}")
        assert response.text == "done"
    finally:
        await runner.cleanup()


class Recorder:
    """An OpenAI-like server that records each call's headers; it sets a cookie on
    the first call (a load balancer's sticky session) and streams or answers whole."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.headers.append({name.lower(): value for name, value in request.headers.items()})
        cookie = {"Set-Cookie": "lb=node-3; Path=/"} if len(self.headers) == 1 else {}
        body = await request.json()
        if not body.get("stream"):
            answer = b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}'
            return web.Response(body=answer, content_type="application/json", headers=cookie)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **cookie})
        await response.prepare(request)
        await response.write(
            b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
            b"data: [DONE]\n\n"
        )
        return response


def _sent(headers: dict[str, str]) -> dict[str, str]:
    """What a call sent, less what differs between two calls of the same body anyway."""
    return {name: value for name, value in headers.items() if name not in {"host"}}


async def test_the_direct_path_sends_what_the_clients_own_send_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adapter's own pool sends straight to its transport (AiohttpClient.open): the
    same headers as through httpx's client (its defaults, the key, the trace header),
    streamed and whole."""
    monkeypatch.setenv("I33_KEY", "sk-test-0123456789")
    server = Recorder()
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with serve(server.app()) as origin:
        config = BackendConfig(base_url=f"{origin}/v1", model="m", api_key_env="I33_KEY")
        own = OpenAIBackend("own", config)
        assert own._prepared[0] is not None  # the direct path is the one taken
        async with httpx.AsyncClient(transport=AiohttpTransport(limits=httpx.Limits())) as http:
            injected = OpenAIBackend("injected", config, client=http)
            assert injected._prepared == [None]
            for adapter in (injected, own):  # the injected one first: it takes the cookie
                deltas = [d async for d in adapter.stream(REQUEST, traceparent=trace)]
                assert "".join(d.text for d in deltas) == "hi"
                assert (await adapter.complete(REQUEST, traceparent=trace)).text == "hi"
            await injected.close()
        await own.close()
    assert len(server.headers) == 4
    by_httpx_stream, by_httpx_whole, direct_stream, direct_whole = map(_sent, server.headers)
    by_httpx_whole.pop("cookie")  # the cookie the first call was given (next test)
    assert direct_stream == by_httpx_stream
    assert direct_whole == by_httpx_whole
    assert direct_stream["authorization"] == "Bearer sk-test-0123456789"
    assert direct_stream["accept"] == "text/event-stream"
    assert direct_stream["traceparent"] == trace
    assert direct_stream["user-agent"].startswith("python-httpx/")
    assert "gzip" in direct_stream["accept-encoding"]


async def test_a_cookie_the_backend_sets_is_sent_back() -> None:
    """As httpx's client keeps cookies (a load balancer's sticky session), so does the
    adapter's own pool on its direct path: the cookie of the first answer goes with
    every later call."""
    server = Recorder()
    async with serve(server.app()) as origin:
        adapter = OpenAIBackend("own", BackendConfig(base_url=f"{origin}/v1", model="m"))
        _ = [d async for d in adapter.stream(REQUEST)]
        await adapter.complete(REQUEST)
        _ = [d async for d in adapter.stream(REQUEST)]
        await adapter.close()
    assert [headers.get("cookie") for headers in server.headers] == [
        None,
        "lb=node-3",
        "lb=node-3",
    ]


async def test_the_direct_path_masks_the_key_and_refuses_a_closed_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("I33_KEY", "sk-test-0123456789")
    config = BackendConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="I33_KEY")
    adapter = OpenAIBackend("own", config)
    prepared = adapter._prepared[0]
    assert prepared is not None
    for call in prepared:
        assert "sk-test" not in repr(call.headers)
    pool = adapter._pools[0]
    assert isinstance(pool, AiohttpClient)
    await pool.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await pool.open(prepared[0], b"{}")
    await adapter.close()


async def test_an_encoded_answer_is_decoded_on_the_direct_path() -> None:
    """The adapter reads a body straight off the transport only when there is nothing
    to decode: a gzip-encoded stream or whole answer is decoded by httpx, as before."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            data = (
                b'data: {"choices":[{"delta":{"content":"zipped"},"finish_reason":"stop"}]}\n\n'
                b"data: [DONE]\n\n"
            )
            kind = "text/event-stream"
        else:
            data = b'{"choices":[{"message":{"content":"zipped"},"finish_reason":"stop"}]}'
            kind = "application/json"
        return web.Response(
            body=gzip.compress(data), headers={"Content-Encoding": "gzip", "Content-Type": kind}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serve(app) as origin:
        adapter = OpenAIBackend("zipped", BackendConfig(base_url=f"{origin}/v1", model="m"))
        deltas = [d async for d in adapter.stream(REQUEST)]
        whole = await adapter.complete(REQUEST)
        await adapter.close()
    assert "".join(d.text for d in deltas) == "zipped"
    assert deltas[-1].finish_reason == "stop"
    assert whole.text == "zipped"


@pytest.mark.parametrize("part", ["_transport_for_url", "_init_transport"])
def test_an_httpx_without_the_private_parts_relied_on_fails_at_start(
    monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """AiohttpClient relies on two private methods of httpx's client (pyproject.toml pins
    httpx's minor versions): an httpx that moved one fails when the adapter is built,
    naming it, not on every call with an AttributeError (nor by quietly dropping aiohttp)."""
    monkeypatch.delattr(httpx.AsyncClient, part)
    with pytest.raises(RuntimeError, match=rf"httpx.*{part}"):
        OpenAIBackend("m", BackendConfig(base_url="http://127.0.0.1:1/v1", model="m"))


def test_an_httpx_whose_init_transport_takes_other_arguments_fails_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpx 0.27's _init_transport also took ``app``: AiohttpClient's override would
    fail with a bare TypeError. It is named instead."""
    original = httpx.AsyncClient._init_transport

    def older(
        self: httpx.AsyncClient, *args: object, app: object = None, **kwargs: object
    ) -> object:
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx.AsyncClient, "_init_transport", older)
    with pytest.raises(RuntimeError, match=r"httpx.*_init_transport.*app"):
        OpenAIBackend("m", BackendConfig(base_url="http://127.0.0.1:1/v1", model="m"))


class Staller:
    """A backend (raw asyncio: it sees the client's hang-up as its end of input) that
    sends the head and part of its body, then goes silent."""

    def __init__(self, answers: int = 2) -> None:
        self.hung_up = 0
        self.both_hung_up = asyncio.Event()
        #: Set once ``answers`` partial answers have gone out.
        self.answered = asyncio.Event()
        self._answers = answers
        self._sent = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        streaming = b'"stream":true' in await reader.readexactly(length)
        kind = b"text/event-stream" if streaming else b"application/json"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: 10000\r\n\r\n"
        )
        writer.write(
            b'data: {"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}\n\ndata: {"ch'
            if streaming
            else b'{"choices":[{"message":{"content":"h'
        )
        await writer.drain()
        self._sent += 1
        if self._sent == self._answers:
            self.answered.set()
        assert await reader.read() == b""  # silent until the client hangs up
        self.hung_up += 1
        if self.hung_up == 2:
            self.both_hung_up.set()
        writer.close()


async def _stream_text(adapter: OpenAIBackend, into: list[str]) -> None:
    async for delta in adapter.stream(REQUEST):
        into.append(delta.text)


async def test_a_body_that_stalls_midway_times_out_on_the_direct_path() -> None:
    """An adapter's own pool (the direct path, its body read straight off aiohttp)
    still bounds each read by ``timeout``: a body that stops midway is a stall after
    text, a first-token timeout before it, each from httpx's ReadTimeout, and the
    connection is hung up (not left in the pool)."""
    server = Staller()
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = BackendConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout="200ms")
    adapter = OpenAIBackend("stalls", config)
    assert adapter._prepared[0] is not None
    deltas: list[str] = []
    with pytest.raises(RetryableBackendError) as streamed:
        await _stream_text(adapter, deltas)
    with pytest.raises(RetryableBackendError) as whole:
        await adapter.complete(REQUEST)
    pool = adapter._pools[0]._transport
    assert isinstance(pool, AiohttpTransport)
    assert pool._session is not None
    assert not pool._session.connector._acquired  # type: ignore[union-attr]
    await asyncio.wait_for(server.both_hung_up.wait(), 5.0)
    await adapter.close()
    listener.close()
    await listener.wait_closed()
    assert deltas == ["hi"]
    assert streamed.value.failure is FailureClass.BROKEN_STREAM
    assert "stall" in str(streamed.value)
    assert isinstance(streamed.value.__cause__, httpx.ReadTimeout)
    assert whole.value.failure is FailureClass.FIRST_TOKEN_TIMEOUT
    assert isinstance(whole.value.__cause__, httpx.ReadTimeout)


@pytest.mark.parametrize("no_proxy", [None, "127.0.0.1"])
async def test_the_direct_path_honours_proxy_and_no_proxy_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, no_proxy: str | None
) -> None:
    """An adapter's own pool sends a URL the environment proxies to httpx's proxy
    transport (never straight to the backend), and one ``NO_PROXY`` names straight."""
    via_proxy: list[str] = []

    async def proxy(request: web.Request) -> web.StreamResponse:
        via_proxy.append(str(request.url))
        answer = b'{"choices":[{"message":{"content":"proxied"},"finish_reason":"stop"}]}'
        return web.Response(body=answer, content_type="application/json")

    async def backend(request: web.Request) -> web.StreamResponse:
        answer = b'{"choices":[{"message":{"content":"straight"},"finish_reason":"stop"}]}'
        return web.Response(body=answer, content_type="application/json")

    proxy_app, backend_app = web.Application(), web.Application()
    proxy_app.router.add_route("*", "/{tail:.*}", proxy)
    backend_app.router.add_post("/v1/chat/completions", backend)
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with serve(proxy_app) as proxy_origin, serve(backend_app) as origin:
        monkeypatch.setenv("HTTP_PROXY", proxy_origin)
        if no_proxy is not None:
            monkeypatch.setenv("NO_PROXY", no_proxy)
        adapter = OpenAIBackend("maybe-proxied", BackendConfig(base_url=f"{origin}/v1", model="m"))
        answer = (await adapter.complete(REQUEST)).text
        await adapter.close()
    if no_proxy is None:
        assert (answer, via_proxy) == ("proxied", [f"{origin}/v1/chat/completions"])
    else:
        assert (answer, via_proxy) == ("straight", [])


async def test_calls_in_flight_when_the_adapter_closes_fail_typed_and_promptly() -> None:
    """Closing an adapter (its pool) while calls are still reading their bodies ends
    them with a typed, retryable error: one waiting for bytes was never woken (aiohttp
    drops the read timeout of a connection its pool closes: the call hung for good),
    one between two reads got aiohttp's bare RuntimeError("Connection closed.")."""
    server = Staller(answers=3)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = BackendConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m", timeout="60s")
    adapter = OpenAIBackend("closing", config)
    between_reads = adapter.stream(REQUEST)
    assert (await anext(between_reads)).text == "hi"
    first = asyncio.Event()

    async def waiting() -> None:
        async for _ in adapter.stream(REQUEST):
            first.set()

    waiting_stream = asyncio.create_task(waiting())
    waiting_whole = asyncio.create_task(adapter.complete(REQUEST))
    await first.wait()  # its first token read: now waiting for more
    await server.answered.wait()  # the whole answer's head and first bytes sent
    await adapter.close()
    errors: list[BackendError] = []
    for call in (anext(between_reads), waiting_stream, waiting_whole):
        with pytest.raises(BackendError) as caught:
            await asyncio.wait_for(call, 10.0)  # a bound on a hang, not a timing check
        errors.append(caught.value)
    listener.close()
    await listener.wait_closed()
    assert all(error.retryable for error in errors), errors


async def test_no_exception_a_failed_call_chains_holds_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken response head (aiohttp's ClientResponseError, kept as the cause of
    httpx's error, itself the cause of the adapter's) carried the request's headers,
    key included, in its repr (its request_info): nothing of the chain may."""

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTQ/9 what\r\n\r\n")
        await writer.drain()
        writer.close()

    monkeypatch.setenv("I33_KEY", "sk-test-0123456789")
    listener = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = BackendConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m", api_key_env="I33_KEY")
    adapter = OpenAIBackend("garbage", config)
    with pytest.raises(BackendError) as caught:
        await adapter.complete(REQUEST)
    await adapter.close()
    listener.close()
    await listener.wait_closed()
    chain: list[BaseException] = []
    error: BaseException | None = caught.value
    while error is not None and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert len(chain) > 2  # the adapter's, httpx's, aiohttp's (and its own causes)
    for error in chain:
        assert "sk-test" not in repr(error), type(error)
        assert "sk-test" not in str(error), type(error)
