"""The README's quickstart runs as written.

Its commands are read from README.md (the fenced blocks under ``## Quickstart``), never
copied here, and run one by one in a fresh directory, as a user in a shell would: the
directory and the environment carry from one command to the next. ``renqueue up
--mocks`` runs in the background (the README's "one terminal") until the gateway
answers; the openai SDK block runs in Python, curl with the system's curl; Ctrl-C is a
SIGINT, after which ``up`` must exit 0. Before that, the Python client example of "Use
it from an app" runs against the same Ren-Queue.

The one step the README gives in words, not as a command, is done the way it says: the
``[[gateway.keys]]`` entry ``renqueue gateway keygen`` prints goes at the end of
renqueue.toml, and its key into ``RENQUEUE_KEY``.

The quickstart uses the ports the starter config names (the embedded NATS server's,
the gateway's, the mocks'), as a user's machine would: the test says which is taken if
one is, rather than failing somewhere later.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from renqueue.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: How long ``up --mocks`` may take to serve the gateway, and a command to finish.
START_LIMIT = 60.0
COMMAND_LIMIT = 60.0


def fenced_blocks(text: str, heading: str) -> list[tuple[str, str]]:
    """The fenced blocks (language, body) of the section under ``heading`` (a ``## ``
    line), in order, up to the next heading of that level."""
    lines = text.splitlines()
    start = lines.index(heading) + 1
    blocks: list[tuple[str, str]] = []
    language: str | None = None
    body: list[str] = []
    for line in lines[start:]:
        if language is None and line.startswith("## "):
            break
        if line.startswith("```"):
            if language is None:
                language = line[3:].strip()
                body = []
            else:
                blocks.append((language, "\n".join(body)))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def commands(body: str) -> list[str]:
    """A shell block's commands: its lines without comments or blanks, a line ending in
    a backslash joined to the next, as the shell joins them."""
    joined = body.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_the_quickstart_is_in_fenced_blocks() -> None:
    """The quickstart has the steps a new user needs, each in a block of its own kind."""
    blocks = fenced_blocks(README.read_text(), "## Quickstart")
    shell = [line for language, body in blocks if language == "bash" for line in commands(body)]
    assert {language for language, _ in blocks} == {"bash", "python"}
    assert any("pip install -e '.[mock]'" in line for line in shell)
    for step in ("renqueue init", "renqueue up --mocks", "renqueue status", "curl "):
        assert any(line.startswith(step) or f" {step}" in line for line in shell), step
    assert any(line.startswith("renqueue submit ") and "--wait 30" in line for line in shell)
    assert any(
        "from openai import OpenAI" in body for language, body in blocks if language == "python"
    )


class Session:
    """A user's shell: a working directory and an environment that carry over."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        bin_dir = str(Path(sys.executable).parent)
        env = {
            name: value
            for name, value in os.environ.items()
            # A real key in the test's environment would send the quickstart's requests to
            # a real provider; a config or NATS URL from outside would point it elsewhere.
            if not name.endswith("_API_KEY") and not name.startswith("RENQUEUE_")
        }
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        self.env = env
        self.transcript: list[str] = []

    def run(self, line: str) -> subprocess.CompletedProcess[str]:
        """Run one command line in bash, then keep the directory it ended in."""
        where = self.cwd / ".quickstart-cwd"
        script = f'{line}\nstatus=$?\npwd -P > "{where}"\nexit $status'
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_LIMIT,
            check=False,
        )
        if where.exists():
            self.cwd = Path(where.read_text().strip())
            where.unlink()
        self.transcript.append(f"$ {line}\n[{done.returncode}]\n{done.stdout}{done.stderr}")
        assert done.returncode == 0, "\n".join(self.transcript)
        return done

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_LIMIT,
            check=False,
        )
        self.transcript.append(
            f">>> (python block)\n[{done.returncode}]\n{done.stdout}{done.stderr}"
        )
        assert done.returncode == 0, "\n".join(self.transcript)
        return done

    @contextlib.contextmanager
    def background(self, line: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
        """``line`` running in "another terminal"; killed if the test leaves it running."""
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {line}"],  # exec: the SIGINT reaches renqueue itself
                cwd=self.cwd,
                env=self.env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def adopt_key(session: Session, output: str) -> None:
    """What the README says to do with ``gateway keygen``'s output: the entry at the end
    of renqueue.toml, the key in ``RENQUEUE_KEY``."""
    lines = output.splitlines()
    shown = next(i for i, line in enumerate(lines) if "shown once" in line)
    key = lines[shown + 1].strip()
    first = next(i for i, line in enumerate(lines) if line.strip() == "[[gateway.keys]]")
    entry = [line.strip() for line in lines[first : first + 3]]
    assert entry[1].startswith("tenant ="), output
    assert entry[2].startswith("sha256 ="), output
    config = session.cwd / "renqueue.toml"
    config.write_text(config.read_text().rstrip("\n") + "\n\n" + "\n".join(entry) + "\n")
    session.env["RENQUEUE_KEY"] = key


def ports_used(config_path: Path) -> dict[int, str]:
    """The loopback ports the quickstart's processes will listen on, by what uses them."""
    config = load_config(str(config_path), environ={})
    ports = {config.nats.port: "the embedded NATS server", config.gateway.port: "the gateway"}
    for name, backend in config.backends.items():
        url = urlsplit(backend.base_url)
        if url.hostname in {"127.0.0.1", "localhost", "::1"} and url.port:
            ports.setdefault(url.port, f"the mock for backend {name}")
    return ports


def taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_until_serving(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll the gateway's port until it accepts a connection (``up`` has started)."""
    deadline = time.monotonic() + START_LIMIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"renqueue up exited {proc.returncode} before serving:\n{log.read_text()}")
        if taken(port):
            return
        time.sleep(0.1)  # polling the port, not waiting for it to be ready by luck
    pytest.fail(f"the gateway did not listen on {port} within {START_LIMIT} s:\n{log.read_text()}")


@pytest.mark.timeout(300)
def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    """Every command of the quickstart, then the client example, exits 0 and says something;
    Ctrl-C stops ``up`` with 0."""
    if shutil.which("curl") is None:
        pytest.fail(
            "the quickstart calls the gateway with curl: install curl (apt-get install curl)"
        )
    blocks = fenced_blocks(README.read_text(), "## Quickstart")
    session = Session(tmp_path)
    log = tmp_path / "up.log"
    up: subprocess.Popen[bytes] | None = None
    with contextlib.ExitStack() as stack:
        for language, body in blocks:
            if language == "python":
                assert up is not None, "the python block comes after `renqueue up`"
                done = session.python(body)
                assert done.stdout.strip(), "the openai SDK call printed no answer"
                continue
            for line in commands(body):
                if "pip install" in line or "venv" in line:
                    # The install step: this test runs in the project's environment, which
                    # has it (the package, aiohttp for the mocks, the openai SDK).
                    continue
                if line.startswith("renqueue up"):
                    config = session.cwd / "renqueue.toml"
                    busy = {p: what for p, what in ports_used(config).items() if taken(p)}
                    assert not busy, f"ports the quickstart needs are taken: {busy}"
                    gateway_port = load_config(str(config), environ={}).gateway.port
                    up = stack.enter_context(session.background(line, log))
                    wait_until_serving(gateway_port, up, log)
                    continue
                done = session.run(line)
                if line.startswith("renqueue gateway keygen"):
                    adopt_key(session, done.stdout)
                elif line.startswith("renqueue submit"):
                    assert done.stdout.strip(), "submit printed no answer"
                elif line.startswith("curl"):
                    answer = json.loads(done.stdout)
                    assert answer["choices"][0]["message"]["content"], answer
                elif line.startswith("renqueue status"):
                    assert re.search(r"\w", done.stdout), "status printed nothing"
        assert up is not None, "the quickstart never starts `renqueue up`"
        # The README's Python client example, against the same running Ren-Queue.
        for language, body in fenced_blocks(README.read_text(), "## Use it from an app"):
            if language == "python":
                done = session.python(body)
                assert "tokens, $" in done.stdout, done.stdout
        # Ctrl-C in its terminal.
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
        assert code == 0, log.read_text()
