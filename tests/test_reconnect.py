"""Given a URL, Ren-Queue uses that server and rides out its restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from renqueue import Client, Services, parse_config
from renqueue.ops import EmbeddedServer
from renqueue.tools import MockBackend, MockSettings


async def test_services_reconnect_after_the_server_restarts(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    port = server.port
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = parse_config(
            {
                "nats": {"url": server.url},
                "backends": {"b": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b"]}},
            }
        )
        try:
            async with Services(config) as services, Client(services.nc, tenant="t") as client:
                before = await (await client.submit("one", route="chat")).result(timeout=10)

                await server.stop()  # the broker goes away, store intact ...
                await asyncio.sleep(1.0)
                server = EmbeddedServer(store, port=port)
                await server.start()  # ... and comes back on the same address

                # The first publish may land while the client is still reconnecting.
                handle = None
                for _ in range(50):
                    try:
                        handle = await client.submit("two", route="chat", request_id="after-1")
                        break
                    except Exception:  # retry with the same id: submits are idempotent
                        await asyncio.sleep(0.2)
                assert handle is not None
                after = await handle.result(timeout=10)
        finally:
            await server.stop()
    assert before.backend == after.backend == "b"
    assert msgspec.structs.asdict(after.usage)["completion_tokens"] == 4
