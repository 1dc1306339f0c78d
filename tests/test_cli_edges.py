"""The command line at its edges (issue 28, after the first pass): a closed
pipe, a narrow terminal, an unknown id, nothing listening at the NATS URL, a
prompt over the limit, an embedded server that dies under `up`, a file's last
newline, Ctrl-C while the server hangs. Each runs `renqueue` in a process of
its own, as a person or a script does."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from test_cli import renqueue_up, run, write_config

from renqueue import Client
from renqueue.broker import EmbeddedServer, EventLog, connect
from renqueue.broker._connection import _refused as refused
from renqueue.errors import ConnectionFailedError, RequestRejectedError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import MAX_TEXT

#: A route no config has, as long as a name may be: its rejection's reason is long.
NO_ROUTE = "no-such-route-" + "x" * 15 + "-with-a-long-name-that-goes-on"


async def run_into_closed_pipe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``renqueue ARGS`` with stdout a pipe whose reader has gone before the
    command writes a byte (``| head -c 0``, deterministic: no pipe buffer to
    absorb the output): (exit code, stderr)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", *args,
            stdout=write_end, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "RENQUEUE_CONFIG": "", **(env or {})},
        )  # fmt: skip
    finally:
        os.close(write_end)
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def column(lines: list[str], title: str, header: str) -> str:
    """The text of the column ``title`` (the last one) of a table whose header
    line is ``header``: every line's text from the column's start, joined."""
    start = header.index(title)
    return "".join(line[start:] for line in lines)


def up_logs(directory: Path) -> list[str]:
    """What each `renqueue up` the test ran (:func:`renqueue_up`) logged."""
    return [path.read_text() for path in directory.glob("up-*.log")]


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


async def test_a_closed_stdout_ends_a_command_quietly_with_exit_141(tmp_path: Path) -> None:
    """`renqueue status --json | head -c 100` once said "unexpected error":
    output into a closed pipe ends the command at once, saying nothing, with
    the exit status of a process SIGPIPE ended (128 + 13), as `cat` does."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    code, err = await run_into_closed_pipe("schema")
    assert (code, err) == (141, "")
    async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
        base = ("-c", str(config), "--nats", server.url)
        code, _out, err = await run("-m", "renqueue", *base, "provision")
        assert code == 0, err
        for command in (["status", "--json"], ["status"], ["dlq", "list"], ["replay"]):
            code, err = await run_into_closed_pipe(*base, *command)
            assert (code, err) == (141, ""), command


async def test_reasons_and_details_wrap_whole_in_an_80_column_terminal(tmp_path: Path) -> None:
    """audit and dlq show once cut details at 120 columns (the reason lost),
    dlq list wrote 198-character lines: at COLUMNS=80 every line fits, and the
    rejection's reason is there in full, wrapped in its column."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(tmp_path, mock.url)
        async with renqueue_up(config) as (_proc, url):
            async with await Client.connect(url) as client:
                handle = await client.submit("to nowhere", route=NO_ROUTE, request_id="lost-1")
                with pytest.raises(RequestRejectedError) as info:
                    await handle.result(timeout=30)
            reason = str(info.value).removeprefix("request lost-1: ")
            assert NO_ROUTE in reason
            base = ("-m", "renqueue", "-c", str(config))
            env = {"COLUMNS": "80"}

            code, out, err = await run_with(env, *base, "audit", "lost-1")
            assert code == 0, err
            lines = out.splitlines()
            assert max(map(len, lines)) <= 80, out
            header = next(line for line in lines if line.startswith("time"))
            rejected = lines[next(n for n, line in enumerate(lines) if " rejected " in line) :]
            assert squeezed(reason) in squeezed(column(rejected, "details", header)), out

            # 40 columns: the details column was 10 wide, every word folded
            # (error_type / =unknown...); each event's details go under it instead.
            code, out, err = await run_with({"COLUMNS": "40"}, *base, "audit", "lost-1")
            assert code == 0, err
            _title, *lines = out.splitlines()
            assert max(map(len, lines)) <= 40, out
            words = {word for line in lines for word in line.split()}
            assert "error_type=unknown_route" in words, out
            missing = {w for w in reason.split() if len(w) <= 30 and not any(w in x for x in lines)}
            assert not missing, (missing, out)
            assert squeezed(reason) in squeezed(out), out

            code, out, err = await run_with(env, *base, "dlq", "list")
            assert code == 0, err
            lines = out.splitlines()
            assert max(map(len, lines)) <= 80, out
            entry = lines[1:-1]  # the header, then the one entry, then the count
            assert squeezed(reason) in squeezed(column(entry, "reason", lines[0])), out
            assert lines[-1] == "1 of 1 dead letters match"
            seq = lines[1].split()[0]

            code, out, err = await run_with(env, *base, "dlq", "show", seq)
            assert code == 0, err
            lines = out.splitlines()
            assert max(map(len, lines)) <= 80, out
            first = next(n for n, line in enumerate(lines) if line.startswith("  reason "))
            end = next(n for n, line in enumerate(lines) if line.startswith("  from "))
            value_at = len(lines[first]) - len(lines[first][len("  reason") :].lstrip())
            shown = "".join(line[value_at:] for line in lines[first:end])
            assert squeezed(reason) in squeezed(shown), out


async def run_with(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": "", **env},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_says_ok_for_a_healthy_backend_in_a_table_that_fits(tmp_path: Path) -> None:
    """The health column once said `closed` (the circuit's state) for a
    healthy backend; it says `ok`, and --json keeps the circuit's fields. In a
    terminal 40 columns wide, the backends table folded its numbers a digit a
    line (32 slots read `3` over `2`): each backend is a record there instead."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(tmp_path, mock.url, slots=32)
        async with renqueue_up(config) as (_proc, _url):
            base = ("-m", "renqueue", "-c", str(config))
            code, out, err = await run_with({"COLUMNS": "80"}, *base, "status")
            assert code == 0, err
            assert max(map(len, out.splitlines())) <= 80, out
            backends = out.split("\nBackends\n")[1].split("\n\n")[0].splitlines()
            assert backends[0].split()[:2] == ["backend", "health"]
            assert backends[1].split()[:2] == ["mock", "ok"], out
            code, out, err = await run_with({"COLUMNS": "40"}, *base, "status")
            assert code == 0, err
            assert max(map(len, out.splitlines())) <= 40, out
            backends = out.split("\nBackends\n")[1].split("\n\n")[0]
            assert backends.startswith("  mock: health ok; in flight 0;"), out
            assert re.search(r"\bslots\s+32;", backends), out
            code, out, err = await run(*base, "status", "--json")
            assert code == 0, err
            [mock_json] = json.loads(out)["backends"]
            assert (mock_json["circuit"], mock_json["healthy"], mock_json["out"]) == (
                "closed",
                True,
                "",
            )


async def test_cancel_of_an_unknown_id_is_refused_and_records_nothing(tmp_path: Path) -> None:
    """`cancel` of an id never submitted once recorded a cancel_requested
    event anyway, and `audit` of it then exited 0: both exit 3 (the request
    is not there to act on), and the log holds nothing for the id."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
        base = ("-m", "renqueue", "-c", str(config), "--nats", server.url)
        code, _out, err = await run(*base, "provision")
        assert code == 0, err
        code, out, err = await run(*base, "cancel", "never-submitted")
        assert code == 3, err
        assert out == ""
        [line] = err.splitlines()
        assert "no request never-submitted is known for tenant 'default'" in line
        code, out, err = await run(*base, "cancel", "never-submitted", "--json")
        assert code == 3, err
        code, out, err = await run(*base, "audit", "never-submitted")
        assert code == 3, err
        [line] = err.splitlines()
        assert "no request never-submitted is known" in line
        nc = await connect(server.url, name="test")
        try:
            assert await EventLog(nc.jetstream()).history("*", "never-submitted") == []
        finally:
            await nc.close()


async def test_a_prompt_over_the_limit_is_refused_before_connecting(tmp_path: Path) -> None:
    """A 2 MB prompt once got the schema validator's raw words: one line with
    the size and the limit, exit 2, and nothing sent (no NATS is listening:
    the command never tries)."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    big = tmp_path / "big.txt"
    big.write_text("a" * 2_000_000)
    code, out, err = await run(
        "-m", "renqueue", "-c", str(config), "--nats", "nats://127.0.0.1:1",
        "submit", "-f", str(big), "--wait", "10",
    )  # fmt: skip
    assert code == 2, err
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith("renqueue: the prompt is 2,000,000 characters, over the ")
    assert f"{MAX_TEXT:,}" in line
    assert "max_payload" in line


async def test_up_stops_when_its_embedded_nats_server_dies(tmp_path: Path) -> None:
    """`up` once reconnected for ever to its own embedded server after it died:
    it stops, saying why, and exits non-zero (a process supervisor restarts it)."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(tmp_path, mock.url)
        async with renqueue_up(config) as (proc, _url):
            pid = int((tmp_path / "data" / "nats-server.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            code = await asyncio.wait_for(proc.wait(), 60)
    assert code == 2
    [text] = up_logs(tmp_path)
    assert f"the embedded nats-server (pid {pid}) was killed by signal 9" in text
    assert "Traceback" not in text


async def test_a_file_or_stdin_prompt_loses_its_last_newline(tmp_path: Path) -> None:
    """`submit -f FILE` and `submit -` kept the file's last newline in the
    prompt; one is stripped (as the shell's $(...) does), the rest kept."""
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(tmp_path, mock.url)
        async with renqueue_up(config) as (_proc, _url):
            base = ("-m", "renqueue", "-c", str(config))
            prompt = tmp_path / "prompt.txt"
            prompt.write_text("say hi\n")
            code, _out, err = await run(
                *base, "submit", "-f", str(prompt), "--id", "from-file", "--wait", "30"
            )
            assert code == 0, err
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *base, "submit", "-", "--id", "from-stdin", "--wait", "30",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, "RENQUEUE_CONFIG": ""},
            )  # fmt: skip
            _out, errb = await asyncio.wait_for(proc.communicate(b"line one\nline two\n\n"), 60)
            assert proc.returncode == 0, errb
            for request_id, expected in (
                ("from-file", "say hi"),
                ("from-stdin", "line one\nline two\n"),
            ):
                code, out, err = await run(*base, "audit", request_id, "--json")
                assert code == 0, err
                submitted = json.loads(out.splitlines()[0])
                assert submitted["kind"] == "submitted"
                assert submitted["request"]["messages"][-1]["content"] == expected


async def test_ctrl_c_ends_a_waiting_submit_promptly_while_nats_hangs(tmp_path: Path) -> None:
    """SIGINT to `submit --wait` while its nats-server is stopped (SIGSTOP: a
    hung server, not a closed one): it ends with exit 130 and one line, no
    traceback, well before its --wait bound."""
    config = write_config(tmp_path, "http://127.0.0.1:1/v1")
    async with EmbeddedServer(tmp_path / "nats", port=-1) as server:
        assert server.pid is not None
        base = ("-m", "renqueue", "-c", str(config), "--nats", server.url)
        code, _out, err = await run(*base, "provision")
        assert code == 0, err
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *base, "submit", "long", "--stream", "--wait", "600",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
        assert proc.stderr is not None
        first = await asyncio.wait_for(proc.stderr.readline(), 30)
        assert first.startswith(b"request "), first
        os.kill(server.pid, signal.SIGSTOP)
        try:
            proc.send_signal(signal.SIGINT)
            # Far below the 600 s bound: Ctrl-C ends it, its close bounded.
            _out, rest = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            os.kill(server.pid, signal.SIGCONT)
    assert proc.returncode == 130, rest
    lines = rest.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in rest.decode()
    assert "interrupted" in lines[0]


async def test_a_refused_connection_is_final_for_a_command_not_for_a_service() -> None:
    """Nothing listens: a command (refused_is_final) says so at once, naming
    the refusal; a service keeps trying for its connect bound (NATS may be
    starting beside it), then names the last error."""
    with pytest.raises(ConnectionFailedError, match=r"\(connection refused\): is `renqueue up`"):
        await connect("nats://127.0.0.1:1", name="test", refused_is_final=True)
    with pytest.raises(ConnectionFailedError, match=r"within 0\.5s: ConnectionRefusedError"):
        await connect("nats://127.0.0.1:1", name="test", timeout=0.5)
    # A name with an IPv6 and an IPv4 address fails with asyncio's "Multiple
    # exceptions": refused only when every one of them was.
    both = "[Errno 111] Connect call failed ('::1', 1, 0, 0), [Errno 111] Connect call failed"
    assert refused(OSError(f"Multiple exceptions: {both} ('127.0.0.1', 1)"))
    assert not refused(OSError("Multiple exceptions: [Errno 111] a, [Errno 101] b"))
    assert not refused(TimeoutError())
