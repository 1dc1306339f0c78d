"""The same tiny chat-completions endpoint on each candidate HTTP server, for
``bench/gateway_servers.py``. Run with the Python of ``.renqueue/bench-servers/venv``
(which has every candidate); imports nothing from ``renqueue`` or ``bench/``.

``POST /v1/chat/completions`` reads and decodes the JSON body, then answers a fixed
``chat.completion`` or, with ``"stream": true``, a role chunk, 16 content chunks, a
finish chunk and ``data: [DONE]``, each written on its own as the gateway writes them.

    python bench/_server_candidates.py aiohttp PORT
    python bench/_server_candidates.py h11 PORT
    uvicorn --app-dir bench _server_candidates:asgi_app --port PORT   (starlette)
    granian --interface asgi --app-dir bench _server_candidates:asgi_app --port PORT
"""

# Each candidate is imported only when it is the one served (the load side has none).
# ruff: noqa: PLC0415

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

COMPLETION = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "chat",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " ".join(f"tok{i}" for i in range(16))},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20},
    }
).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "chat",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def events() -> Iterator[bytes]:
    yield _chunk({"role": "assistant", "content": ""})
    for i in range(16):
        yield _chunk({"content": f" tok{i}"})
    yield _chunk({}, "stop")
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------------- aiohttp


def run_aiohttp(port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=COMPLETION, content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events():
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", lambda _r: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ------------------------------------------------------------- starlette (ASGI)


async def _asgi_chat(request: Any) -> Any:
    from starlette.responses import Response, StreamingResponse

    body = json.loads(await request.body())
    if not body.get("stream"):
        return Response(COMPLETION, media_type="application/json")

    async def gen() -> AsyncIterator[bytes]:
        for event in events():
            yield event

    return StreamingResponse(gen(), media_type="text/event-stream")


def _make_asgi() -> Any:
    try:
        from starlette.applications import Starlette
        from starlette.responses import PlainTextResponse
        from starlette.routing import Route
    except ImportError:  # imported by the load side, which has no starlette
        return None

    async def health(_request: Any) -> Any:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", _asgi_chat, methods=["POST"]),
            Route("/health", health),
        ]
    )


asgi_app = _make_asgi()


# ------------------------------------------------------------- raw asyncio + h11


def run_h11(port: int) -> None:
    import h11

    class Protocol(asyncio.Protocol):
        def __init__(self) -> None:
            self.conn = h11.Connection(h11.SERVER)
            self.transport: Any = None
            self.body = b""

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.conn.receive_data(data)
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    if event is h11.PAUSED and self.conn.our_state is h11.DONE:
                        self.conn.start_next_cycle()
                        continue
                    return
                if isinstance(event, h11.Request):
                    self.body = b""
                    self.path = event.target
                elif isinstance(event, h11.Data):
                    self.body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    self.answer()
                elif isinstance(event, h11.ConnectionClosed):
                    self.transport.close()
                    return

        def send(self, event: Any) -> None:
            self.transport.write(self.conn.send(event))

        def answer(self) -> None:
            if self.path == b"/health":
                self.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                self.send(h11.Data(data=b"ok"))
                self.send(h11.EndOfMessage())
                return
            body = json.loads(self.body)
            if not body.get("stream"):
                headers = [
                    ("content-type", "application/json"),
                    ("content-length", str(len(COMPLETION))),
                ]
                self.send(h11.Response(status_code=200, headers=headers))
                self.send(h11.Data(data=COMPLETION))
            else:
                headers = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
                self.send(h11.Response(status_code=200, headers=headers))
                for event in events():
                    self.send(h11.Data(data=event))
            self.send(h11.EndOfMessage())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Protocol, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    kind, port_text = sys.argv[1], sys.argv[2]
    {"aiohttp": run_aiohttp, "h11": run_h11}[kind](int(port_text))
