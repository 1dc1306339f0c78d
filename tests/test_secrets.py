"""Secrets never reach a log line, an event, a metric or an error message.

`renqueue up` runs in a process of its own as the ``renqueue`` user of
nats/auth.conf (its password in the Connection URL), with three backends whose keys
come from the environment and from a file; one key is wrong, and that mock
answers 401 with a message echoing the key, as some providers do. After
successful and failed requests, every place a secret could leak is read back
and searched, for every password of nats/auth.conf's users (the tenant's is in
the client's URL) and every API key: the service's stdout and stderr (at DEBUG), every message of
every stream (events, dead letters, tokens, the projection's KV), the
Prometheus page, the client's error, ``renqueue audit`` and a CLI error about
the same secret-bearing URL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import httpx

from renqueue import Client, RequestFailedError
from renqueue.broker import Connection, EmbeddedServer
from renqueue.errors import NatsError
from renqueue.mock import MockBackend, MockSettings

AUTH_CONF = Path(__file__).resolve().parent.parent / "nats" / "auth.conf"
NATS_PASSWORD = "natsPW4d1e0c6b5a"
TENANT_PASSWORD = "tenantPW9f8e7d6c"
GLOBEX_PASSWORD = "globexPW2b3c4d5e"
SYS_PASSWORD = "sysPW6f7a8b9c0d"
ENV_KEY = "sk-envKEY3b2a1908f7e6"
FILE_KEY = "sk-fileKEY5c4d3e2f1a0b"
WRONG_KEY = "sk-wrongKEY7a6b5c4d3e2f"
#: Every secret the setup uses: the passwords of every auth.conf user (the
#: tenant's is in the client's URL) and the API keys.
SECRETS = (
    NATS_PASSWORD,
    TENANT_PASSWORD,
    GLOBEX_PASSWORD,
    SYS_PASSWORD,
    ENV_KEY,
    FILE_KEY,
    WRONG_KEY,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def leaks(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


def read(path: Path) -> str:
    return path.read_text(errors="replace")


async def wait_for_line(log: Path, words: str, proc: asyncio.subprocess.Process) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while words not in read(log):
        if proc.returncode is not None or loop.time() > deadline:
            raise AssertionError(f"no {words!r} in the log:\n{read(log)[-3000:]}")
        await asyncio.sleep(0.02)  # poll interval while the process starts


async def stored_messages(url: str) -> str:
    """Every message (headers and data) of every stream, as one text."""
    nc = Connection()
    await nc.open(5, servers=url, inbox_prefix="_INBOX_renqueue")
    try:
        js = nc.jetstream()
        parts = []
        for info in await js.context.streams_info():
            state = info.state
            for seq in range(state.first_seq, state.last_seq + 1):
                try:
                    msg = await js.get_msg(info.config.name, seq)
                except NatsError:
                    continue  # deleted (work queues delete what was acked)
                parts.append(f"{msg.subject} {msg.headers} {(msg.data or b'').decode()}")
        return "\n".join(parts)
    finally:
        await nc.close()


async def run_cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_no_secret_reaches_logs_events_metrics_or_errors(
    tmp_path: Path, monkeypatch: object
) -> None:
    passwords = {
        "RQ_SERVICE_PASSWORD": NATS_PASSWORD,
        "RQ_TENANT_ACME_PASSWORD": TENANT_PASSWORD,
        "RQ_TENANT_GLOBEX_PASSWORD": GLOBEX_PASSWORD,
        "RQ_SYS_PASSWORD": SYS_PASSWORD,
    }
    server_env = {**os.environ, **passwords}
    key_file = tmp_path / "key"
    key_file.write_text(FILE_KEY + "\n")
    metrics_port = free_port()
    os.environ.update(passwords)  # the embedded server expands them from its environment
    try:
        server = EmbeddedServer(tmp_path / "nats", port=-1, config_file=AUTH_CONF)
        await server.start()
    finally:
        for name in passwords:
            os.environ.pop(name, None)
    service_url = server.url.replace("nats://", f"nats://renqueue:{NATS_PASSWORD}@")
    log = tmp_path / "up.log"
    try:
        async with (
            MockBackend(MockSettings(output_tokens=4, require_api_key=ENV_KEY)) as env_mock,
            MockBackend(MockSettings(output_tokens=4, require_api_key=FILE_KEY)) as file_mock,
            MockBackend(MockSettings(output_tokens=4, require_api_key="the-right-one")) as bad,
        ):
            config = tmp_path / "renqueue.toml"
            config.write_text(
                f'[nats]\ninbox_prefix = "_INBOX_renqueue"\n'
                f'[worker]\nretry_delay = "100ms"\nmax_deliver = 2\n'
                f'[backends.env-key]\nbase_url = "{env_mock.url}"\nmodel = "m"\n'
                f'api_key_env = "RQ_TEST_ENV_KEY"\n'
                f'[backends.file-key]\nbase_url = "{file_mock.url}"\nmodel = "m"\n'
                f'api_key_file = "{key_file}"\n'
                f'[backends.wrong-key]\nbase_url = "{bad.url}"\nmodel = "m"\n'
                f'api_key_env = "RQ_TEST_WRONG_KEY"\n'
                f'[routes.env]\nbackends = ["env-key"]\n'
                f'[routes.file]\nbackends = ["file-key"]\n'
                f'[routes.wrong]\nbackends = ["wrong-key"]\n'
            )
            env = {
                **{k: v for k, v in server_env.items() if not k.startswith("RENQUEUE_")},
                "RQ_TEST_ENV_KEY": ENV_KEY,
                "RQ_TEST_WRONG_KEY": WRONG_KEY,
                "PYTHONUNBUFFERED": "1",
            }
            with log.open("wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "renqueue", "-c", str(config),
                    "--nats", service_url, "--log-level", "DEBUG",
                    "up", "--metrics-port", str(metrics_port),
                    stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                )  # fmt: skip
            try:
                await wait_for_line(log, "running", proc)
                tenant_url = server.url.replace("nats://", f"nats://acme:{TENANT_PASSWORD}@")
                async with await Client.connect(
                    tenant_url, tenant="acme", inbox_prefix="_INBOX_acme"
                ) as client:
                    ok_env = await client.submit("hi", route="env")
                    ok_file = await client.submit("hi", route="file")
                    failing = await client.submit("hi", route="wrong")
                    assert (await ok_env.result(timeout=20)).backend == "env-key"
                    assert (await ok_file.result(timeout=20)).backend == "file-key"
                    try:
                        await failing.result(timeout=20)
                    except RequestFailedError as exc:
                        error = f"{exc!s} {exc!r} {exc.error_type}"
                    else:
                        raise AssertionError("a wrong key must fail the request")
                    assert "401" in error
                assert bad.stats().last_request is not None  # the wrong key was sent

                async with httpx.AsyncClient() as http:
                    metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
                assert "renqueue_worker_calls_total" in metrics
                code, audit = await run_cli(
                    "-c", str(config), "--nats", service_url, "audit", failing.id, env=env
                )
                assert code == 0, audit
                assert "failed" in audit
                stored = await stored_messages(service_url)
                assert "401" in stored  # the failure is recorded, its key is not
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.wait_for(proc.wait(), 30)
        dead_url = f"nats://renqueue:{NATS_PASSWORD}@127.0.0.1:{free_port()}"
        code, cli_error = await run_cli(
            "-c", str(config), "--nats", dead_url, "provision", env=env
        )  # fmt: skip
        assert code == 2
        assert "cannot connect" in cli_error
    finally:
        await server.close()

    service_log = read(log)
    assert "running" in service_log
    for where, text in {
        "service log": service_log,
        "streams": stored,
        "metrics": metrics,
        "client error": error,
        "audit": audit,
        "cli error": cli_error,
    }.items():
        assert leaks(text) == [], f"secret in {where}"
