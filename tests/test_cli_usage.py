"""The command line as a new user meets it (issue 28): global options anywhere on
the line, help for every command, the prompt from a file, stdin or a messages
file, a route or level refused before anything is sent, --wait bounding the
whole command, client commands that print no logs, `init` and `up --mocks`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import pytest
from test_cli import renqueue_up, run, until_logged, write_config

from renqueue import cli, load_config
from renqueue.broker import EmbeddedServer
from renqueue.cli import main
from renqueue.mock import MockBackend, MockSettings

ROOT = Path(__file__).parents[1]
COMMANDS = [
    ["up"], ["router"], ["worker"], ["gateway"], ["gateway", "keygen"], ["exporter"],
    ["provision"], ["submit"], ["cancel"], ["audit"], ["status"], ["replay"], ["dlq", "list"],
    ["dlq", "show"], ["dlq", "requeue"], ["dlq", "purge"], ["ab", "status"], ["ab", "promote"],
    ["ab", "rollback"], ["ab", "resume"], ["schema"], ["mock-backend"], ["demo"], ["init"],
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def help_of(command: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main([*command, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_a_description_an_example_and_help_for_each_option(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_of(command, capsys)
    usage, description = text.split("\n\n")[:2]
    assert usage.startswith(f"Usage: renqueue {' '.join(command)}")
    assert description.strip(), text
    assert "Example" in text, text
    options = text[text.index("Options:") :].split("\n\n")[0]
    # Every option line has a help text after the flag (two spaces, then words).
    for line in options.splitlines()[1:]:
        if line.startswith("  -"):
            assert re.search(r"\S {2,}\S", line.strip()) or line.rstrip().endswith(
                ("FILE", "URL", "]")
            ), line
    for option in ("--config", "--nats", "--log-level", "--json", "--verbose"):
        assert option in options, (command, option)


def test_router_and_worker_have_their_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    up, router, worker = (help_of([name], capsys) for name in ("up", "router", "worker"))
    assert len({up, router, worker}) == 3
    assert "--backend" not in router
    assert "--backend" in worker
    assert "--mocks" in up
    assert "--routers" in router
    # Defaults are shown.
    assert "[default: 1;" in " ".join(router.split())
    assert "[default: 8100;" in " ".join(help_of(["mock-backend"], capsys).split())


def test_the_top_help_describes_the_tool_and_version_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = help_of([], capsys)
    assert "priority queue and router for LLM requests" in text
    assert "Exit codes" in text
    assert main(["--version"]) == 0
    assert re.fullmatch(r"renqueue \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)


async def test_global_options_work_before_and_after_the_command(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    url = isolated_server.url
    # After the command, as the docs write them (issue 28 item 2).
    code, _out, err = await run("-m", "renqueue", "provision", "--nats", url, "-c", str(config))
    assert code == 0, err
    reports = []
    for line in (
        ["status", "-c", str(config), "--nats", url, "--json"],
        ["-c", str(config), "status", "--nats", url, "--json"],
        ["--json", "--nats", url, "-c", str(config), "status"],
    ):
        code, out, err = await run("-m", "renqueue", *line)
        assert code == 0, (line, err)
        # Only JSON, one document; no log lines either.
        reports.append(json.loads(out))
        assert err == "", err
    assert all("mock" in json.dumps(report) for report in reports)


async def test_unknown_route_or_level_is_refused_from_the_config_before_publishing(
    tmp_path: Path,
) -> None:
    """Issue 28 item 9: no connection is tried (NATS here is unreachable: that
    would be exit 4); the refusal names the valid ones; exit 2."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    base = ("-m", "renqueue", "-c", str(config), "--nats", "nats://127.0.0.1:1")
    code, _out, err = await run(*base, "submit", "hi", "--route", "chat-huge")
    assert code == 2, err
    assert err.strip() == "renqueue: no route 'chat-huge'; the config's routes: chat (at $.routes)"
    code, _out, err = await run(*base, "submit", "hi", "--route", "chat", "--priority", "urgent")
    assert code == 2, err
    assert "no priority level 'urgent'" in err
    assert "critical, high, normal, low, batch" in err
    assert len(err.strip().splitlines()) == 1
    # A route and a level it knows: now it connects, and NATS is not there: exit 4.
    code, _out, err = await run(*base, "submit", "hi", "--wait", "10")
    assert code == 4, err
    assert len(err.strip().splitlines()) == 1, err


async def test_submit_reads_stdin_a_file_a_messages_file_and_params_and_prints_only_json(
    tmp_path: Path,
) -> None:
    """Issue 28 items 6, 8 and 13's last."""
    async with MockBackend(MockSettings(output_tokens=5)) as mock:
        config = write_config(tmp_path, mock.url)
        async with renqueue_up(config) as (_proc, _url):
            base = ("-m", "renqueue", "-c", str(config))
            big = "word " * 180_000  # 900 kB: far too long for one argument (128 kB)
            (tmp_path / "prompt.txt").write_text(big)
            (tmp_path / "chat.json").write_text(
                json.dumps(
                    [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "again"},
                    ]
                )
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *base, "submit", "-", "--id", "from-stdin", "--json",
                "--system", "Be brief.", "--param", "temperature=0.2", "--param", "top_k=40",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, "RENQUEUE_CONFIG": ""},
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(b"from stdin"), 60)
            assert proc.returncode == 0, err
            assert err == b""  # no logs without -v
            result = json.loads(out)  # one document, nothing else
            assert result["backend"] == "mock"
            code, out, err = await run(
                *base, "submit", "-f", str(tmp_path / "prompt.txt"), "--id", "from-file", "--json"
            )
            assert code == 0, err
            json.loads(out)
            code, out, err = await run(
                *base, "submit", "--messages", str(tmp_path / "chat.json"), "--id", "from-chat"
            )
            assert code == 0, err
            # The requests as they were logged.
            requests = {}
            for rid in ("from-stdin", "from-file", "from-chat"):
                code, out, err = await run(*base, "audit", rid, "--json")
                assert code == 0, err
                requests[rid] = json.loads(out.splitlines()[0])["request"]
            stdin_request = requests["from-stdin"]
            assert [m["role"] for m in stdin_request["messages"]] == ["system", "user"]
            assert stdin_request["messages"][1]["content"] == "from stdin"
            assert stdin_request["params"]["temperature"] == 0.2
            assert stdin_request["params"]["extra"] == {"top_k": 40}
            assert requests["from-file"]["messages"][0]["content"] == big
            assert [m["content"] for m in requests["from-chat"]["messages"]] == [
                "hi",
                "hello",
                "again",
            ]
            # Cancelling a request that completed says so (exit 3), without --wait too.
            code, out, err = await run(*base, "cancel", "from-chat")
            assert code == 3, out + err
            assert "had already completed on mock" in err
            assert "cancellation requested" not in out + err
            # --stream --json: one JSON document per line, each a chunk, then the result.
            code, out, err = await run(*base, "submit", "hi", "--stream", "--json")
            assert code == 0, err
            lines = [json.loads(line) for line in out.splitlines()]
            assert lines[-1]["backend"] == "mock"
            assert all("text" in line for line in lines[:-1])
            # -v: the logs come back.
            code, out, err = await run(*base, "submit", "hi", "-v")
            assert code == 0, err
            assert "nats connected" in err


async def test_wait_bounds_the_whole_command_when_nats_goes_away(tmp_path: Path) -> None:
    """Issue 28 item 1: a streamed submit waiting on a request no worker takes;
    NATS stops; --wait ends it with one line and exit 4."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
        base = ("-m", "renqueue", "-c", str(config), "--nats", server.url)
        code, _out, err = await run(*base, "provision")
        assert code == 0, err
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *base, "submit", "long", "--stream", "--wait", "4",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
        assert proc.stderr is not None
        first = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert first.startswith(b"request "), first
    # The server is gone: the command must end within its bound (and a margin
    # for closing), not wait for the request forever.
    _out, rest = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 4, rest
    lines = rest.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "lost NATS" in lines[0]
    assert "4 s" in lines[0]


async def test_wait_bounds_the_whole_command_when_nats_hangs(tmp_path: Path) -> None:
    """A server that stops answering (SIGSTOP: a hung process, a dropped link)
    rather than closing: --wait still bounds the command, its close included."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
        assert server.pid is not None
        base = ("-m", "renqueue", "-c", str(config), "--nats", server.url)
        code, _out, err = await run(*base, "provision")
        assert code == 0, err
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *base, "submit", "long", "--stream", "--wait", "4",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
        assert proc.stderr is not None
        first = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert first.startswith(b"request "), first
        loop = asyncio.get_running_loop()
        hung_at = loop.time()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            _out, rest = await asyncio.wait_for(proc.communicate(), 30)
            took = loop.time() - hung_at
        finally:
            os.kill(server.pid, signal.SIGCONT)
    assert proc.returncode == 4, rest
    # The 4 s bound began before the hang; closing may take at most 1.5 s more
    # (and a loaded machine some seconds): not the ~20 s a hung close took.
    assert took < 4 + 1.5 + 5, (took, rest)


async def test_mock_backend_on_a_busy_port_says_so_in_one_line() -> None:
    """Issue 28 item 7."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code, _out, err = await run("-m", "renqueue", "mock-backend", "--port", str(port))
    assert code == 2
    assert err.strip().splitlines() == [
        f"renqueue: cannot listen on 127.0.0.1:{port}: the port is in use (another mock "
        "backend, or the model server itself?); pick another with --port"
    ]


def test_init_writes_a_starter_config_and_will_not_overwrite_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "renqueue.toml"
    assert main(["init", str(path)]) == 0
    text = path.read_text()
    config = load_config(str(path))
    tags = {tag for backend in config.backends.values() for tag in backend.tags}
    assert {"local", "free", "paid"} <= tags
    assert next(iter(config.routes)) == "chat-small"
    assert text.count("#") > 20  # commented
    path.write_text("mine")
    assert main(["init", str(path)]) == 2
    assert "exists; give --force" in capsys.readouterr().err
    assert path.read_text() == "mine"
    assert main(["init", str(path), "--force"]) == 0
    assert path.read_text() == text


async def test_init_then_up_mocks_then_submit_and_status(tmp_path: Path) -> None:
    """Issue 28 item 4: the starter config runs on mocks: `up --mocks` serves
    one on each loopback port it names and leaves the cloud backends alone."""
    code, _out, err = await run("-m", "renqueue", "init", str(tmp_path / "renqueue.toml"))
    assert code == 0, err
    config = tmp_path / "renqueue.toml"
    text = config.read_text()
    # The test's own ports and store (the file's are 8000, 11434 and 4222).
    for port in ("8000", "11434"):
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    text = text.replace("port = 4222", "port = -1").replace(
        'data_dir = ".renqueue"', f'data_dir = "{tmp_path / "data"}"'
    )
    config.write_text(text)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RENQUEUE_") and k not in ("GROQ_API_KEY", "OPENAI_API_KEY")
    }
    log = tmp_path / "up.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "-c", str(config), "up", "--mocks",
            stdout=sink, stderr=sink, env=env, cwd=tmp_path,
        )  # fmt: skip
    try:
        logged = await until_logged(log, "running; Ctrl-C to stop", proc)
        assert logged.count("mock backend serving") == 2, logged
        assert "--mocks: no mock for backend" in logged
        url = (tmp_path / "data" / "nats.url").read_text().strip()
        base = ("-m", "renqueue", "-c", str(config), "--nats", url)
        code, out, err = await run(*base, "submit", "hello", "--wait", "30")
        assert code == 0, err
        assert "-- backend=local-small" in out
        code, out, err = await run(*base, "submit", "hi", "--route", "chat-large", "--wait", "30")
        assert code == 0, err
        assert "-- backend=local-large" in out
        code, out, err = await run(*base, "status")
        assert code == 0, err
        assert "local-small" in out
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0, log.read_text()[-3000:]


CLI_DOC = ROOT / "docs" / "cli.md"


def test_the_documented_exit_codes_are_the_codes() -> None:
    table = dict(re.findall(r"^\| (\d) \| (.+) \|$", CLI_DOC.read_text(), re.MULTILINE))
    assert set(table) == {"0", "2", "3", "4"}
    assert cli.EXIT_OK == 0
    assert cli.EXIT_ERROR == 2
    assert "usage or config" in table["2"]
    assert cli.EXIT_UNSUCCESSFUL == 3
    assert "failed" in table["3"]
    assert "no such request" in table["3"]
    assert cli.EXIT_UNREACHABLE == cli.EXIT_WAIT_TIMEOUT == 4
    assert "NATS could not be reached" in table["4"]
    assert "--wait" in table["4"]
    besides = CLI_DOC.read_text().split("Besides these:")[1]
    assert cli.EXIT_INTERRUPTED == 130
    assert "Ctrl-C exits 130" in besides
    assert cli.EXIT_PIPE_CLOSED == 141
    assert "closed pipe" in besides
    assert "with 141" in besides


def test_the_commands_docs_cli_shows_are_the_ones_the_quickstart_test_runs() -> None:
    """docs/cli.md's first-run commands, each run by
    test_init_then_up_mocks_then_submit_and_status (with the test's -c and --nats)."""
    block = CLI_DOC.read_text().split("```sh\n")[1].split("```")[0]
    assert block.splitlines() == [
        "renqueue init",
        "renqueue up --mocks",
        'renqueue submit "hello" --wait 30',
        "renqueue status",
    ]


async def test_up_mocks_on_a_busy_port_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        config = write_config(tmp_path, f"http://127.0.0.1:{port}/v1")
        code, _out, err = await run("-m", "renqueue", "-c", str(config), "up", "--mocks")
    assert code == 2, err
    [line] = [line for line in err.splitlines() if line.startswith("renqueue: ")]
    assert line.startswith(f"renqueue: --mocks: cannot serve a mock for mock on 127.0.0.1:{port}")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [
        *(["status"], ["audit", "x"], ["cancel", "x"], ["dlq", "list"], ["replay"]),
        *(["ab", "status"], ["submit", "hi", "--route", "chat"]),
    ],
    ids=" ".join,
)
async def test_a_client_command_that_cannot_reach_nats_exits_4_in_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    code, out, err = await run(
        "-m", "renqueue", *command, "-c", str(config), "--nats", "nats://127.0.0.1:1"
    )  # fmt: skip
    assert code == 4, err
    assert out == ""
    [line] = err.strip().splitlines()
    # Refused is an answer: said at once (not after the 5 s connect bound), with what to do.
    assert line == (
        "renqueue: cannot reach NATS at nats://127.0.0.1:1 (connection refused): "
        "is `renqueue up` running?"
    )


async def test_init_into_a_missing_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    code, _out, err = await run("-m", "renqueue", "init", str(tmp_path / "nowhere" / "x.toml"))
    assert code == 2, err
    assert "cannot write" in err
    assert "Traceback" not in err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["submit", "hi", "--id", "*"],
        ["submit", "hi", "--tenant", ">"],
        ["cancel", "a.b"],
        ["cancel", "ok", "--tenant", "*"],
        ["audit", "\x1b[2J"],
        ["audit", "x" * 129],
    ],
)
def test_a_tenant_or_request_id_the_schema_refuses_is_a_usage_error_before_connecting(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A wildcard (``*``, ``>``), a dot or an escape sequence in an id or a
    tenant would name other requests' subjects, or echo control bytes back: the
    command line refuses it as the schema would, exit 2, before connecting
    (``--nats`` names a port nothing listens on: a connection attempt would
    exit 4)."""
    assert main(["--nats", "nats://127.0.0.1:1", *args]) == 2
    err = capsys.readouterr().err
    assert "letters, digits, - and _" in err
    assert "\x1b" not in err
