"""The gateway as a user runs it: ``renqueue gateway keygen``, ``renqueue up`` with
keys (it serves the gateway too), ``renqueue gateway`` alone in front of a running
Ren-Queue, and a port it cannot have."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest

from renqueue import Services, parse_config
from renqueue.cli import main
from renqueue.gateway import digest
from renqueue.mock import MockBackend, MockSettings

KEY = "rq-cli-test-key-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def write_config(tmp_path: Path, mock_url: str, port: int) -> Path:
    config = tmp_path / "renqueue.toml"
    config.write_text(
        f"""
[nats]
data_dir = "{tmp_path / "data"}"
port = -1

[backends.mock]
base_url = "{mock_url}"
model = "mock"

[routes.chat]
backends = ["mock"]

[gateway]
port = {port}
keys = [{{ tenant = "acme", sha256 = "{digest(KEY)}" }}]
"""
    )
    return config


def whole(log: Path) -> str:
    return log.read_text()


def tail(log: Path) -> str:
    return whole(log)[-3000:]


async def until_healthy(url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(600):  # up to 30 s while it starts
            if proc.returncode is not None:
                pytest.fail(f"it exited {proc.returncode}:\n{tail(log)}")
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    pytest.fail(f"no healthy gateway at {url}:\n{tail(log)}")


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode is not None
    return proc.returncode


async def completion(base: str) -> dict[str, object]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(
            base + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


def test_keygen_prints_a_key_and_an_entry_that_accepts_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["gateway", "keygen", "acme"]) == 0
    out = capsys.readouterr().out
    key = re.search(r"^\s+(rq-\S+)$", out, re.MULTILINE)
    sha = re.search(r'sha256 = "([0-9a-f]{64})"', out)
    assert key is not None
    assert sha is not None
    assert digest(key.group(1)) == sha.group(1)
    assert f"sha256:{sha.group(1)} acme" in out
    # A bad tenant name is a usage error: exit 2, main() returns it (no SystemExit).
    assert main(["gateway", "keygen", "not a tenant"]) == 2
    assert "a tenant name is 1 to 64 letters" in capsys.readouterr().err


async def test_up_with_keys_serves_the_gateway(tmp_path: Path) -> None:
    port = free_port()
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(tmp_path, mock.url, port)
        log = tmp_path / "up.log"
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(config), "up",
                stdout=sink, stderr=sink, env={**os.environ, "RENQUEUE_CONFIG": ""},
            )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            await until_healthy(base, proc, log)
            body = await completion(base)
            assert str(body["id"]).startswith("chatcmpl-")
        finally:
            code = await stop(proc)
    assert code == 0, tail(log)
    assert KEY not in whole(log)


async def test_gateway_alone_joins_a_running_renqueue(tmp_path: Path) -> None:
    port = free_port()
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config_file = write_config(tmp_path, mock.url, port)
        config = parse_config({"nats": {"data_dir": str(tmp_path / "data"), "port": -1},
                               "backends": {"mock": {"base_url": mock.url, "model": "mock"}},
                               "routes": {"chat": {"backends": ["mock"]}}})  # fmt: skip
        async with Services(config) as services:
            log = tmp_path / "gateway.log"
            with log.open("wb") as sink:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "renqueue", "-c", str(config_file),
                    "--nats", services.url, "gateway",
                    stdout=sink, stderr=sink, env={**os.environ, "RENQUEUE_CONFIG": ""},
                )  # fmt: skip
            try:
                base = f"http://127.0.0.1:{port}"
                await until_healthy(base, proc, log)
                await completion(base)
                # A second gateway cannot have the same port: one line, exit 2.
                busy = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "renqueue", "-c", str(config_file),
                    "--nats", services.url, "gateway",
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    env={**os.environ, "RENQUEUE_CONFIG": ""},
                )  # fmt: skip
                _out, err = await asyncio.wait_for(busy.communicate(), 60)
                assert busy.returncode == 2
                assert b"cannot listen" in err
                assert b"Traceback" not in err
            finally:
                code = await stop(proc)
    assert code == 0, tail(log)
