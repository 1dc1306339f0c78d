"""Logging: the library is silent unless its user configures logging; the CLI configures it."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from renqueue import Services, parse_config
from renqueue.logs import configure_logging, get_logger
from renqueue.mock import MockBackend, MockSettings

PROGRAM = textwrap.dedent(
    """
    import asyncio, logging, sys
    from renqueue import Client

    async def main(url: str) -> None:
        async with await Client.connect(url, tenant="quiet") as client:
            handle = await client.submit("hi", route="chat")
            async for chunk in handle.stream(timeout=20):
                print(chunk.text, end="", flush=True)
            result = await handle.result(timeout=20)
        print()
        print("done", result.usage.completion_tokens)

    if sys.argv[2] == "configured":
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(main(sys.argv[1]))
    """
)


async def run_program(program: Path, url: str, mode: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(program),
        url,
        mode,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_program_using_the_client_prints_only_what_it_prints(tmp_path: Path) -> None:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    async with MockBackend(MockSettings(output_tokens=3)) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"mock": {"base_url": mock.url, "model": "mock"}},
                "routes": {"chat": {"backends": ["mock"]}},
            }
        )
        async with Services(config) as services:
            code, out, err = await run_program(program, services.url, "unconfigured")
            assert code == 0, err
            # Only what the program printed: no "nats connected" on stdout or stderr.
            assert out == "tok0 tok1 tok2\ndone 3\n"
            assert err == ""

            # A program that configures stdlib logging gets the library's lines there.
            code, out, err = await run_program(program, services.url, "configured")
            assert code == 0, err
            assert out == "tok0 tok1 tok2\ndone 3\n"
            assert "renqueue.connection: nats connected" in err


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("renqueue").level)
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("renqueue").setLevel(saved[2])
        structlog.reset_defaults()


@pytest.mark.usefixtures("restore_logging")
def test_the_cli_configuration_renders_json_lines_with_fields() -> None:
    out = io.StringIO()
    configure_logging(level="INFO", json=True, stream=out)
    get_logger("test-logs").info("hello", answer=42)
    get_logger("test-logs").debug("not shown")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 1
    assert lines[0]["event"] == "hello"
    assert lines[0]["answer"] == 42
    assert lines[0]["component"] == "test-logs"
    assert lines[0]["level"] == "info"
    assert "timestamp" in lines[0]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.usefixtures("restore_logging")
def test_log_lines_on_a_terminal_have_no_colour_under_no_color(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`NO_COLOR=1 renqueue -v submit ...` on a terminal still coloured its log
    lines (https://no-color.org: set and not empty means none)."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    coloured = Terminal()
    configure_logging(level="INFO", stream=coloured)
    get_logger("test-logs").info("hello", answer=42)
    assert "\x1b[" in coloured.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    plain = Terminal()
    configure_logging(level="INFO", stream=plain)
    get_logger("test-logs").info("hello", answer=42)
    assert "hello" in plain.getvalue()
    assert "answer=42" in plain.getvalue()
    assert "\x1b" not in plain.getvalue()


@pytest.mark.usefixtures("restore_logging")
def test_a_closed_log_stream_drops_lines_instead_of_raising() -> None:
    out = io.StringIO()
    configure_logging(level="INFO", json=True, stream=out)
    out.close()  # as stderr does when the reader of its pipe goes away
    get_logger("test-logs").warning("nobody reads this")  # must not raise
