"""Backing up the streams: docs/operations.md#back-up-the-streams, its commands run here.

A server's JetStream store, copied while the server is stopped (``tar`` of its
``jetstream`` directory), and unpacked into an empty store directory, starts a server
with every stream as it was: the same messages at the same sequence numbers and server
timestamps, so every request's history reads the same and the projection kept in the
store still equals the fold of the restored log (``renqueue replay --verify``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import msgspec
from test_restarts import TENANT, child_env, client_of, write_config

from renqueue import Services
from renqueue.broker import EmbeddedServer, EventLog, connect
from renqueue.config import load_config
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import EVENTS_STREAM, REQUESTS_STREAM


def run(command: str, store: Path, backup: Path) -> None:
    """A command of docs/operations.md, with its placeholders filled in."""
    line = command.replace("STORE_DIR", str(store)).replace("BACKUP", str(backup))
    subprocess.run(["sh", "-c", line], check=True, timeout=60)


BACKUP = "tar -C STORE_DIR -czf BACKUP jetstream"
RESTORE = "mkdir -p STORE_DIR && tar -C STORE_DIR -xzf BACKUP"


def test_the_docs_show_these_commands() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    assert f"    {BACKUP}\n" in doc
    assert f"    {RESTORE}\n" in doc


async def test_a_copy_of_the_store_restores_every_stream_and_the_projection(
    tmp_path: Path,
) -> None:
    original, restored, backup = tmp_path / "a", tmp_path / "b", tmp_path / "rq.tgz"
    async with (
        MockBackend(MockSettings(ttft=0.0, output_tokens=4)) as mock,
        EmbeddedServer(original, port=-1) as server,
    ):
        file = write_config(
            tmp_path / "rq.toml", nats_url=server.url, backend_url=mock.url, slots=2
        )
        config = load_config(file, environ={})
        async with Services(config, backends=["b"]), client_of(server.url) as (client, nc):
            handles = [
                await client.submit(f"hello {i}", route="chat", request_id=f"bk-{i}")
                for i in range(5)
            ]
            await asyncio.gather(*(handle.result(timeout=30) for handle in handles))
            js = nc.jetstream()
            before = {h.id: await EventLog(js).history(TENANT, h.id) for h in handles}
            events = await js.stream_info(EVENTS_STREAM)
            requests = await js.stream_info(REQUESTS_STREAM)
    run(BACKUP, original, backup)  # the server is stopped: its store is still
    run(RESTORE, restored, backup)
    async with EmbeddedServer(restored, port=-1) as server:
        nc = await connect(server.url, name="test-restored")
        try:
            js = nc.jetstream()
            again = await js.stream_info(EVENTS_STREAM)
            assert (again.state.messages, again.state.last_seq) == (
                events.state.messages,
                events.state.last_seq,
            )
            assert (await js.stream_info(REQUESTS_STREAM)).state.last_seq == (
                requests.state.last_seq
            )
            for rid, history in before.items():
                after = await EventLog(js).history(TENANT, rid)
                assert msgspec.json.encode(after) == msgspec.json.encode(history)
        finally:
            await nc.close()
        verify = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "-c", str(file), "--nats", server.url,
            "replay", "--verify",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
        out, _ = await asyncio.wait_for(verify.communicate(), 60)
        assert verify.returncode == 0, out.decode()
