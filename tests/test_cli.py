"""The CLI as a user runs it: `renqueue up` in a process of its own, then submit,
audit, the example script, and SIGTERM with requests in flight."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import msgspec
import pytest

from renqueue import Client, demo
from renqueue.broker import EmbeddedServer
from renqueue.demo import run_demo
from renqueue.mock import MockBackend, MockSettings

ROOT = Path(__file__).parents[1]


def write_config(tmp_path: Path, backend_url: str, *, slots: int = 4) -> Path:
    file = tmp_path / "renqueue.toml"
    file.write_text(
        f'[nats]\ndata_dir = "{tmp_path / "data"}"\nport = -1\n'
        # Router ack_wait far above the waits below: a request the stopping
        # router failed to hand back would sit it out and fail the test.
        f'[router]\nack_wait = "60s"\n'
        f'[worker]\ndrain_timeout = "500ms"\nack_wait = "2s"\n'
        f'[backends.mock]\nbase_url = "{backend_url}"\nmodel = "mock"\n'
        f"[backends.mock.limits]\nconcurrency = {slots}\n"
        f'[routes.chat]\nbackends = ["mock"]\n'
    )
    return file


#: The bound on one command of the CLI, for a run that is broken (a hang), not
#: a timing: a loaded machine stretches the interpreter's start-up and imports
#: alone to a minute or more (seen at load 12-19 with several suites at once).
#: Tests that run several commands raise their own timeout to match.
COMMAND_BOUND: Final = 240.0


async def run(*args: str, limit: float = COMMAND_BOUND) -> tuple[int, str, str]:
    """``python ARGS`` to its end: exit code, stdout, stderr. A command still
    running after ``limit`` seconds is killed, and the test fails saying so."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"python {' '.join(args)} still ran after {limit} s")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def read_log(path: Path) -> str:
    return path.read_text(errors="replace")


async def until_logged(
    log: Path, words: str, proc: asyncio.subprocess.Process, within: float = 60.0
) -> str:
    """Wait until ``proc`` wrote ``words`` to ``log``; the log so far."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while words not in (text := read_log(log)):
        if proc.returncode is not None or loop.time() > deadline:
            pytest.fail(f"no {words!r} in the log of renqueue:\n{text[-3000:]}")
        await asyncio.sleep(0.05)  # poll interval while it starts
    return text


@asynccontextmanager
async def renqueue_up(config: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``renqueue up`` in a process of its own, once its services run (its
    "running" line, written after provisioning and every service started)."""
    url_file = config.parent / "data" / "nats.url"
    log = config.parent / f"up-{os.urandom(4).hex()}.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "-c", str(config), "up",
            stdout=sink, stderr=sink, env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
    try:
        await until_logged(log, "running; Ctrl-C to stop", proc)
        yield proc, url_file.read_text().strip()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 30)


async def test_up_submit_audit_and_example_as_a_user_would(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(output_tokens=6)) as mock:
        config = write_config(tmp_path, mock.url)
        async with renqueue_up(config) as (_proc, url):
            code, out, err = await run(
                "-m", "renqueue", "-c", str(config), "submit", "hello", "--route", "chat",
                "--priority", "high", "--id", "cli-req-1", "--json",
            )  # fmt: skip
            assert code == 0, err
            result = json.loads(out.splitlines()[-1])
            assert result["backend"] == "mock"
            assert result["usage"]["completion_tokens"] == 6

            code, out, err = await run(
                "-m", "renqueue", "audit", "cli-req-1", "--json", "-c", str(config)
            )  # fmt: skip
            assert code == 0, err
            kinds = [json.loads(line)["kind"] for line in out.splitlines()]
            assert kinds == ["submitted", "routed", "started", "completed"]
            # For a person: a timeline table, one row per event, rounded
            # numbers, no Python reprs, no long lines, and no log lines.
            code, out, err = await run("-m", "renqueue", "-c", str(config), "audit", "cli-req-1")
            assert code == 0, err
            assert err == ""
            rows = [line.split() for line in out.splitlines()]
            assert [row[2] for row in rows if len(row) > 2 and row[2] in kinds] == kinds
            assert not re.search(r"\d\.\d{4,}", out), out
            assert "{'" not in out, out
            assert "('" not in out, out
            assert max(map(len, out.splitlines())) <= 120, out

            # A cost cap and a tier from the command line reach the request: a
            # tier no backend has is refused at admission, said in one line.
            code, out, err = await run(
                "-m", "renqueue", "-c", str(config), "submit", "hello", "--route", "chat",
                "--max-cost", "0.5", "--complexity", "7", "--wait", "10",
            )  # fmt: skip
            assert code != 0
            assert "no_capable_backend" in out + err or "complexity 7" in out + err, out + err
            assert "Traceback" not in err

            code, out, _ = await run("-m", "renqueue", "-c", str(config), "audit", "nope")
            assert code == 3
            code, out, err = await run_example(url)
            assert code == 0, err
            assert "-- mock:" in out
    assert mock.stats().requests == 2


async def test_exit_codes_and_scaling_out_without_a_url(tmp_path: Path) -> None:
    """Issue #6 items 23, 27: --wait timeouts, unknown ids and cancel --wait exit
    with the documented codes, one line each; `renqueue router` without --nats
    joins the running server instead of starting a second one on its store."""
    # A minute per answer: "to-cancel" is still queued or running when the
    # cancel lands, however slowly a CLI process starts on a loaded machine.
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=10, output_tokens=600)) as mock:
        config = write_config(tmp_path, mock.url)
        async with renqueue_up(config) as (_proc, _url):
            base = ("-m", "renqueue", "-c", str(config))
            code, _out, err = await run(
                *base, "submit", "x", "--route", "chat", "--id", "slow-x", "--wait", "0.2"
            )
            assert code == 4, err
            assert "has not ended after 0.2 s" in err
            assert "Traceback" not in err
            code, _out, err = await run(*base, "cancel", "never-submitted")
            assert code == 3, err
            assert "no request never-submitted is known" in err
            code, out, err = await run(
                *base, "submit", "y", "--route", "chat", "--id", "to-cancel", "--wait", "0.1"
            )
            assert code == 4, err
            code, out, err = await run(*base, "cancel", "to-cancel", "--wait", "10")
            assert code == 0, err
            assert "cancelled" in out
            code, out, err = await run(*base, "cancel", "slow-x", "--wait", "10")
            assert code == 0, err
            # --json: one document, nothing else on stdout.
            code, out, err = await run(*base, "cancel", "slow-x", "--json")
            assert code == 0, err
            assert json.loads(out) == {"id": "slow-x", "state": "already_cancelled"}

            log = tmp_path / "router.log"
            with log.open("wb") as sink:
                router = await asyncio.create_subprocess_exec(
                    sys.executable, *base, "router", stdout=sink, stderr=sink,
                    env={**os.environ, "RENQUEUE_CONFIG": ""},
                )  # fmt: skip
            try:
                # A SIGTERM while it still starts stops the start-up (it may be
                # waiting for JetStream), so it must have started first.
                await until_logged(log, "router started", router)
            finally:
                router.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(router.wait(), 30)
            text = log.read_text()
            assert "router started" in text, text
            assert "embedded nats-server" not in text
            assert code == 0, text
    code, _out, err = await run(*base, "router", limit=30)
    assert code == 2
    assert "no NATS URL" in err


async def run_example(url: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "submit_and_stream.py"),
        "hi",
        "chat",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_NATS_URL": url},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_sigterm_with_requests_in_flight_loses_nothing(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=20, output_tokens=20)) as mock:
        config = write_config(tmp_path, mock.url, slots=2)
        async with renqueue_up(config) as (proc, url):
            client = await Client.connect(url, tenant="t")
            ids = [(await client.submit("x", route="chat")).id for _ in range(6)]
            await client.close()
            # Two are running (the backend's two slots), four wait.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while mock.stats().in_flight < 2:
                assert loop.time() < deadline, "the first two requests never ran"
                await asyncio.sleep(0.02)  # poll interval, not a synchronisation
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        # Nothing was acked that did not finish: a restart completes every request.
        async with renqueue_up(config) as (_proc, url):
            client = await Client.connect(url, tenant="t")
            results = [await client.handle(rid).result(timeout=20) for rid in ids]
            await client.close()
    assert all(r.usage.completion_tokens == 20 for r in results)
    assert len({r.request_id for r in results}) == 6


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["submit", "x", "--route", "chat"], "no NATS URL"),
        (["mock-backend", "--failure-rate", "2"], "failure_rate"),
    ],
)
async def test_cli_errors_are_one_clear_line(tmp_path: Path, args: list[str], words: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[nats]\ndata_dir = "{tmp_path / "none"}"\n')
    code, _out, err = await run("-m", "renqueue", "-c", str(config), *args)
    assert code == 2
    assert words in err
    assert "Traceback" not in err


async def test_bad_config_file_names_the_field(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[backends.a]\nbase_url = "http://x"\nmodel = "m"\nlimits = { concurrency = 0 }\n'
    )
    code, _out, err = await run("-m", "renqueue", "-c", str(config), "up")
    assert code == 2
    assert "$.backends.a.limits.concurrency" in err


async def test_the_demo_brings_every_request_to_a_terminal_state(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # free-api's provider takes one call at a time, though it is declared with
    # four slots: it answers 429s, which the summary must count per backend.
    started: dict[str, MockBackend] = {}

    class Recorded(MockBackend):
        async def start(self) -> None:
            await super().start()
            started[self.url] = self

    monkeypatch.setattr(demo, "MockBackend", Recorded)
    settings, backend = demo._BACKENDS["free-api"]
    strict = msgspec.structs.replace(settings, concurrency=1)
    monkeypatch.setitem(demo._BACKENDS, "free-api", (strict, backend))

    assert await run_demo(requests=30)
    lines = capsys.readouterr().out.splitlines()
    verdict = lines.index("OK: 30/30 requests reached a terminal state")
    # The progress display ends at the final count, before the verdict.
    progress = [n for n, line in enumerate(lines) if line.startswith("  progress ")]
    assert lines[progress[-1]] == "  progress 30/30"
    assert progress[-1] < verdict
    rejected = "  +1 to an unknown route -> rejected [unknown_route]"
    assert any(line.startswith(rejected) for line in lines)
    # The backend table's last column is the 429s each mock provider sent.
    urls = {f[0]: f[1] for f in map(str.split, lines) if len(f) > 1 and f[1] in started}
    assert set(urls) == set(demo._BACKENDS)
    header = next(n for n, line in enumerate(lines) if line.split()[:2] == ["backend", "requests"])
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 5]}
    assert lines[header].split()[-1] == "429s"
    sent = {name: started[url].stats().rate_limited for name, url in urls.items()}
    assert {name: int(row[-1]) for name, row in rows.items()} == sent
    assert sent["free-api"] > 0
    assert sent["local-small"] == sent["local-large"] == sent["paid-api"] == 0


async def test_up_without_a_config_file_says_so(tmp_path: Path) -> None:
    """Issue #6 item 27: `up` with no config file names what it runs with."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "up",
        cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "RENQUEUE_CONFIG": "", "RENQUEUE_DATA_DIR": str(tmp_path / "data")},
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):
            while not any("no backends configured" in line for line in lines):
                line = (await proc.stdout.readline()).decode()
                assert line, "".join(lines)
                lines.append(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 30)
    text = "".join(lines)
    assert "no config file (./renqueue.toml not found" in text, text
    assert "no routes configured" in text, text


async def test_the_committed_config_runs_its_local_backends_when_cloud_keys_are_unset(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Issue #6 item 25: `renqueue up` with the committed renqueue.toml and no
    API key in the environment takes each keyless backend out with one warning
    naming its field, and runs the rest (the local backends)."""
    keyless = {"groq-llama-8b": "GROQ_API_KEY", "openrouter-free": "OPENROUTER_API_KEY",
               "openai-mini": "OPENAI_API_KEY"}  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in keyless.values() and not k.startswith("RENQUEUE_")
    }
    # The committed file as it is; only the server is the test's (its port is
    # the default 4222 in the file): the documented override.
    env["RENQUEUE_NATS_URL"] = isolated_server.url
    log = tmp_path / "up.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "-c", str(ROOT / "renqueue.toml"), "up",
            cwd=tmp_path, stdout=sink, stderr=sink, env=env,
        )  # fmt: skip
    try:
        text = await until_logged(log, "running; Ctrl-C to stop", proc)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    lines = text.splitlines()
    warnings = [line for line in lines if "backend taken out of service" in line]
    assert len(warnings) == len(keyless), text
    for name, variable in keyless.items():
        [line] = [w for w in warnings if f"$.backends.{name}.api_key_env" in w]
        assert f"{variable} is not set" in line
    started = {
        json.loads(line)["backend"]
        for line in lines
        if line.startswith("{") and json.loads(line).get("event") == "worker started"
    }
    assert started == {"local-llama-8b", "local-qwen-32b"}
    assert "Traceback" not in text
    assert code == 0, text
