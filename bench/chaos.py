"""Chaos benchmark (issue #6): kill -9 routers and workers under load, then audit the log.

Run with ``make chaos`` (every setting, about 7-15 minutes on a small shared machine) or
``python bench/chaos.py --setting single --quick`` (about 1.5 minutes). Each setting:

- NATS: ``single`` and ``harsh``: one nats-server; ``cluster``: three nodes on
  loopback (free ports, temporary stores) with R3 streams, and one node killed
  (``kill -9``) a third of the way through the arrivals, restarted two thirds through.
- Three mock LLM backends (``renqueue mock-backend`` processes; their concurrency cap is
  the backend's limit, so a 429 "busy" means Ren-Queue ran more calls than its limit),
  one route ``chat`` cascading over them: ``alpha`` and ``beta`` (4 slots each, one
  pool) and ``gamma`` (6 slots, 3 % injected failures).
- Services as separate OS processes, as an operator runs them: 2 ``renqueue router``
  processes (each also runs the projector) and 4 ``renqueue worker -b NAME`` processes
  (gamma has two). The harness is their supervisor: a process that exits on its own is
  restarted (and counted); one picked at random is ``kill -9``-ed every ~1 s (``harsh``:
  every ~0.5 s) and replaced at once.
- Load: ``--requests`` (1,000) at a steady rate through ``renqueue.Client``, over the
  five levels (critical 5 %, high 15 %, normal 40 %, low 20 %, batch 20 %); a quarter of
  them streamed by a follower (``handle.stream()``); groups of 2-4 identical requests
  coalesced (``coalesce=True`` or a shared ``dedupe_key``); 5 % resubmitted with the
  same id 0.2-4 s later; 3 % cancelled; 4 % with a 1-4 s deadline; 0.5 % for a route
  that does not exist (rejected).
- ``single`` and ``cluster`` use the defaults (router ack_wait 30 s, max_deliver 10;
  worker lease 5 s, retry budget 5). ``harsh``: ack_wait 2 s for routers and workers,
  router max_deliver 3, a worker retry budget of 1 run (a backend failure fails
  the request) and the worker consumer's delivery limit 2 (the broker's
  backstop: kills do not use up the retry budget, but they do use deliveries),
  slower backends (20 tokens/s) and a kill every ~0.5 s, so some requests use up
  their deliveries and must end ``failed`` (``undeliverable``).

After the arrivals the kills stop and the harness waits (bounded) for every request to
end, then reads ``RQ_EVENTS`` with the service connection (every request's events) and
prints: submitted, **lost** (no terminal event), **duplicated** (more than one terminal
event), outcomes by terminal kind and error type, backend calls against the calls the
outcomes needed, latency submit -> terminal (server timestamp of the terminal event),
the streamed followers' text against the completed text, client handles that never
resolved, what was left in the work queues, and examples (event histories) of every
kind of problem. JSON: ``bench/results/chaos-<setting>-latest.json`` (and a timestamped
copy). Exit status 1 if any setting lost or duplicated a request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from common import RESULTS, ROOT, free_port, machine_info, mock_process, mock_stats, percentile

from renqueue import Client
from renqueue.broker import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    connect,
    find_nats_server,
    provision,
)
from renqueue.config import load_config
from renqueue.errors import NatsNotFoundError, RequestFailedError
from renqueue.logs import configure_logging
from renqueue.schema import (
    ADVISORIES_STREAM,
    DISPATCH_DECODER,
    DISPATCH_STREAM,
    DLQ_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    TERMINAL_KINDS,
    TOKEN_DECODER,
    TOKENS_STREAM,
    Cancelled,
    Coalesced,
    Completed,
    Event,
    Expired,
    Failed,
    InferenceRequest,
    Preempted,
    Rejected,
    Retrying,
    Routed,
    Started,
    Stolen,
    Submitted,
    facts,
    kind_of,
    token_subject,
)

TENANT = "chaos"
ROUTE = "chat"
LEVELS = ("critical", "high", "normal", "low", "batch")
LEVEL_WEIGHTS = (5, 15, 40, 20, 20)


# --------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Backend:
    name: str
    slots: int
    pool: str | None = None
    failure_rate: float = 0.0
    workers: int = 1


BACKENDS = (
    Backend(name="alpha", slots=4, pool="local"),
    Backend(name="beta", slots=4, pool="local"),
    Backend(name="gamma", slots=6, failure_rate=0.03, workers=2),
)
ROUTERS = 2
#: The nats-server's ``max_file_store``; the config's ``nats.max_file_store`` says the
#: same, or the streams' ``max_bytes`` (shares of the config's) exceed it and NATS
#: refuses to create them ("insufficient storage resources").


@dataclass(frozen=True)
class Setting:
    name: str
    nodes: int
    router_ack_wait: float
    worker_ack_wait: float
    router_max_deliver: int
    worker_max_deliver: int
    kill_every: float
    tokens_per_second: float
    kill_node: bool = False
    #: The worker consumer's ``max_deliver`` (``worker.delivery_limit``); None: the default.
    worker_delivery_limit: int | None = None
    #: The whole NATS cluster lost mid-run: ``"stop"`` (SIGTERM every node) or ``"kill9"``
    #: (SIGKILL every node at once); started again on the same stores. None: no outage.
    nats_outage: str | None = None
    #: Restart every router and worker one at a time (SIGTERM, wait for the exit, start
    #: again, wait until ready, next) for as long as the arrivals last.
    rolling: bool = False
    #: How the rolling restart replaces a process: ``start-first`` (the new one ready
    #: before the old one gets SIGTERM, as a Kubernetes rolling update with maxSurge)
    #: or ``stop-first`` (SIGTERM, exit, then the new one).
    rolling_order: str = "start-first"
    #: ``router.require_worker``: bind nothing to a backend no worker asks for work.
    require_worker: bool = False
    #: A control run: the setting's load and config without its faults (``--control``);
    #: its deadlines are audited as ``rolling``'s are, for comparison.
    control: bool = False
    #: Share of plain requests given a deadline, and the range of their timeouts (seconds).
    deadline_share: float = 0.04
    deadline_range: tuple[float, float] = (1.0, 4.0)
    about: str = ""


SETTINGS = {
    "single": Setting(
        name="single",
        nodes=1,
        router_ack_wait=30.0,
        worker_ack_wait=5.0,
        router_max_deliver=10,
        worker_max_deliver=5,
        kill_every=1.0,
        tokens_per_second=40.0,
        about=(
            "one nats-server, the defaults: ack_wait 30 s / 5 s, max_deliver 10 / 5"
            " (router / worker)"
        ),
    ),
    "cluster": Setting(
        name="cluster",
        nodes=3,
        router_ack_wait=30.0,
        worker_ack_wait=5.0,
        router_max_deliver=10,
        worker_max_deliver=5,
        kill_every=1.0,
        tokens_per_second=40.0,
        kill_node=True,
        about="3-node cluster, R3 streams, one node killed mid-run and restarted",
    ),
    "harsh": Setting(
        name="harsh",
        nodes=1,
        router_ack_wait=2.0,
        worker_ack_wait=2.0,
        router_max_deliver=3,
        worker_max_deliver=1,
        kill_every=0.5,
        tokens_per_second=20.0,
        worker_delivery_limit=2,
        about=(
            "one nats-server, ack_wait 2 s, max_deliver 3 / 1 (router / worker), worker"
            " delivery_limit 2, a kill every ~0.5 s"
        ),
    ),
    "cluster-stop": Setting(
        name="cluster-stop",
        nodes=3,
        router_ack_wait=30.0,
        worker_ack_wait=5.0,
        router_max_deliver=10,
        worker_max_deliver=5,
        kill_every=0.0,
        tokens_per_second=40.0,
        nats_outage="stop",
        about=(
            "3-node cluster, R3 streams, every node stopped (SIGTERM) mid-run and started"
            " again on its store; no service is killed or restarted"
        ),
    ),
    "cluster-kill9": Setting(
        name="cluster-kill9",
        nodes=3,
        router_ack_wait=30.0,
        worker_ack_wait=5.0,
        router_max_deliver=10,
        worker_max_deliver=5,
        kill_every=0.0,
        tokens_per_second=40.0,
        nats_outage="kill9",
        about=(
            "3-node cluster, R3 streams, every node killed (kill -9) at once mid-run and"
            " started again on its store; no service is killed or restarted"
        ),
    ),
    "rolling": Setting(
        name="rolling",
        nodes=1,
        router_ack_wait=30.0,
        worker_ack_wait=5.0,
        router_max_deliver=10,
        worker_max_deliver=5,
        kill_every=0.0,
        tokens_per_second=40.0,
        rolling=True,
        deadline_share=0.25,
        deadline_range=(4.0, 12.0),
        about=(
            "one nats-server, every router and worker replaced one at a time while the"
            " arrivals last (start-first: a new process started and ready, then SIGTERM to"
            " the old one; stop-first: SIGTERM, exit, start, ready); a quarter of the requests"
            " carry a 4-12 s deadline"
        ),
    ),
}

#: Settings that must run without a single service restart (the services ride out a NATS
#: outage by themselves).
NO_RESTARTS = frozenset(name for name, s in SETTINGS.items() if s.nats_outage)


@dataclass(frozen=True)
class Plan:
    requests: int
    rate: float
    tail: float  # bound on the wait for the last requests, after the arrivals


def plan_for(setting: Setting, *, quick: bool, requests: int | None, rate: float | None) -> Plan:
    ack_wait = max(setting.router_ack_wait, setting.worker_ack_wait)
    if quick:
        # A rolling pass over six processes takes ~30-60 s here: enough arrivals to cover it.
        count = requests or (400 if setting.rolling else 150)
        return Plan(requests=count, rate=rate or 10.0, tail=max(30.0, ack_wait + 20.0))
    return Plan(requests=requests or 1000, rate=rate or 15.0, tail=max(60.0, 3 * ack_wait + 30.0))


#: Each nats-server's JetStream file store; the services' streams get their shares
#: of it (``[nats] max_file_store``), as they must on a server of one's own.
FILE_STORE = "4GB"


def backends_toml(backends: tuple[Backend, ...], mocks: dict[str, str], route: str) -> list[str]:
    """The config lines of ``backends`` (on their mocks' URLs) and of ``route``
    cascading over them in order."""
    lines: list[str] = []
    for backend in backends:
        lines += [
            "",
            f"[backends.{backend.name}]",
            f'base_url = "{mocks[backend.name]}"',
            'model = "mock"',
        ]
        if backend.pool is not None:
            lines.append(f'pool = "{backend.pool}"')
        if backend.failure_rate:
            lines += ["cost_input_per_mtok = 0.5", "cost_output_per_mtok = 1.5"]
        lines += [f"[backends.{backend.name}.limits]", f"concurrency = {backend.slots}"]
    names = ", ".join(f'"{b.name}"' for b in backends)
    return [*lines, "", f"[routes.{route}]", f"backends = [{names}]", ""]


def config_text(setting: Setting, url: str, mocks: dict[str, str]) -> str:
    lines = [
        "# Written by bench/chaos.py.",
        "[nats]",
        f'url = "{url}"',
        f"replicas = {3 if setting.nodes == 3 else 1}",
        f'max_file_store = "{FILE_STORE}"',
        "",
        "[router]",
        f'ack_wait = "{setting.router_ack_wait:g}s"',
        f"max_deliver = {setting.router_max_deliver}",
        *(["require_worker = true"] if setting.require_worker else []),
        "",
        "[worker]",
        f'ack_wait = "{setting.worker_ack_wait:g}s"',
        f"max_deliver = {setting.worker_max_deliver}",
        *(
            [f"delivery_limit = {setting.worker_delivery_limit}"]
            if setting.worker_delivery_limit is not None
            else []
        ),
        'retry_delay = "200ms"',
        'drain_timeout = "2s"',
    ]
    return "\n".join([*lines, *backends_toml(BACKENDS, mocks, ROUTE)])


# ------------------------------------------------------------------ nats-server


class NatsNode:
    """One nats-server process (of a single-node set-up or a cluster), log in a file."""

    def __init__(
        self, name: str, directory: Path, *, cluster: list[int] | None = None, index: int = 0
    ) -> None:
        self.name = name
        self.dir = directory
        self.port = free_port()
        self.cluster_port = cluster[index] if cluster else None
        self.log = directory / "nats-server.log"
        self.proc: asyncio.subprocess.Process | None = None
        directory.mkdir(parents=True, exist_ok=True)
        text = (
            f"server_name: {name}\nhost: 127.0.0.1\nport: {self.port}\n"
            'max_payload: 8MB\nmax_pending: 64MB\nwrite_deadline: "10s"\n'
            f'jetstream {{\n  store_dir: "{directory / "store"}"\n'
            f"  max_memory_store: 256MB\n  max_file_store: {FILE_STORE}\n}}\n"
        )
        if cluster:
            routes = "\n".join(f"    nats-route://127.0.0.1:{port}" for port in cluster)
            text += (
                f"cluster {{\n  name: chaos\n  listen: 127.0.0.1:{self.cluster_port}\n"
                f"  routes: [\n{routes}\n  ]\n}}\n"
            )
        self.config = directory / "nats-server.conf"
        self.config.write_text(text)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, *, within: float = 30.0) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                str(find_nats_server()), "-c", str(self.config),
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        deadline = time.monotonic() + within
        while True:
            with self.log.open("rb") as file:
                file.seek(offset)
                if b"Server is ready" in file.read():
                    return
            if self.proc.returncode is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server {self.name} did not start:\n{tail}")
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 10.0)
        except TimeoutError:
            await self.kill()


@contextlib.asynccontextmanager
async def nats_servers(setting: Setting, workdir: Path) -> AsyncIterator[list[NatsNode]]:
    cluster = [free_port() for _ in range(setting.nodes)] if setting.nodes > 1 else None
    nodes = [
        NatsNode(f"chaos-n{i + 1}", workdir / f"nats-{i + 1}", cluster=cluster, index=i)
        for i in range(setting.nodes)
    ]
    try:
        await asyncio.gather(*(node.start() for node in nodes))
        yield nodes
    finally:
        await asyncio.gather(*(node.stop() for node in nodes), return_exceptions=True)


async def until_jetstream_answers(nc: Any, *, within: float = 60.0) -> None:
    """A new cluster answers JetStream API calls once its meta leader is elected."""
    js = nc.jetstream()
    deadline = time.monotonic() + within
    while True:
        try:
            await js.context.account_info()  # nats-py's own: our handles lack it
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
        else:
            return


async def provision_with_retries(nc: Any, config: Any, *, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            await provision(nc, config)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
        else:
            return


# ------------------------------------------------------------- service processes


@dataclass
class Slot:
    """One router or worker place in the fleet; a process at a time fills it."""

    role: str
    backend: str | None
    index: int
    proc: asyncio.subprocess.Process | None = None
    log: Path | None = None
    generation: int = 0
    ready: bool = False

    @property
    def name(self) -> str:
        return (
            f"{self.role}-{self.backend}-{self.index}" if self.backend else f"router-{self.index}"
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def is_ready(self) -> bool:
        if not self.ready and self.log is not None and self.log.exists():
            self.ready = f'"{self.role} started"'.encode() in self.log.read_bytes()
        return self.ready


class Fleet:
    """Routers and workers as ``python -m renqueue`` processes, supervised: a process
    that exits by itself is restarted (and recorded); :meth:`kill` is ``kill -9`` and an
    immediate replacement."""

    def __init__(
        self,
        config_file: Path,
        url: str,
        logs: Path,
        *,
        routers: int = ROUTERS,
        backends: Sequence[Backend] = BACKENDS,
        config_for: Callable[[Slot], Awaitable[Path]] | None = None,
        launcher: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``routers`` router processes and ``backends``' workers. ``config_for``, if
        given, is awaited before each spawn (the slot's ``generation`` already counts
        it) and names the config file that process gets; else ``config_file``.
        ``launcher``: the command before the CLI's arguments (``python -m renqueue``);
        ``env``: variables added to each process's environment."""
        self.config_file = config_file
        self.url = url
        self.logs = logs
        self.config_for = config_for
        logs.mkdir(parents=True, exist_ok=True)
        self.slots = [Slot("router", None, i) for i in range(routers)]
        for backend in backends:
            self.slots += [Slot("worker", backend.name, i) for i in range(backend.workers)]
        self.launcher = list(launcher or [sys.executable, "-m", "renqueue"])
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")},
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.stopping = False
        self.killed_pids: set[int] = set()
        self.kills: list[dict[str, Any]] = []
        #: Graceful restarts (:meth:`restart`): SIGTERM, exit, a new process, ready.
        self.restarts: list[dict[str, Any]] = []
        self.self_exits: list[dict[str, Any]] = []
        self.spawned = 0
        #: Wall-clock time each process (by its log file) was spawned.
        self.spawned_at: dict[Path, float] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._t0 = time.monotonic()

    async def start(self, *, within: float = 120.0) -> None:
        for slot in self.slots:
            await self._spawn(slot)
        deadline = time.monotonic() + within
        while not all(slot.is_ready() for slot in self.slots):
            if time.monotonic() > deadline:
                late = [s.name for s in self.slots if not s.is_ready()]
                raise RuntimeError(f"services not started within {within:g}s: {late}")
            await asyncio.sleep(0.2)

    async def _spawn(self, slot: Slot) -> None:
        slot.generation += 1
        slot.ready = False
        slot.log = self.logs / f"{slot.name}-{slot.generation:03d}.log"
        config_file = self.config_file if self.config_for is None else await self.config_for(slot)
        argv = [
            *self.launcher, "-c", str(config_file), "--nats", self.url, "--log-json", slot.role,
        ]  # fmt: skip
        if slot.backend is not None:
            argv += ["-b", slot.backend]
        with slot.log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=self.env
            )
        slot.proc = proc
        self.spawned += 1
        self.spawned_at[slot.log] = time.time()
        task = asyncio.create_task(self._watch(slot, proc))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, slot: Slot, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self.stopping or proc.pid in self.killed_pids or slot.proc is not proc:
            return
        tail = []
        if slot.log is not None:
            tail = slot.log.read_text(errors="replace").splitlines()[-6:]
        self.self_exits.append(
            {
                "t": round(time.monotonic() - self._t0, 2),
                "slot": slot.name,
                "exit_code": code,
                "was_ready": slot.ready,
                "log": str(slot.log),
                "last_lines": [line[:400] for line in tail],
            }
        )
        await asyncio.sleep(0.5)  # a supervisor's restart delay
        if not self.stopping and slot.proc is proc:
            await self._spawn(slot)

    def pick(self, rng: random.Random) -> Slot | None:
        alive = [slot for slot in self.slots if slot.alive]
        ready = [slot for slot in alive if slot.is_ready()]
        choices = ready or alive
        return rng.choice(choices) if choices else None

    async def kill(self, slot: Slot) -> None:
        proc = slot.proc
        if proc is None or proc.returncode is not None:
            return
        self.killed_pids.add(proc.pid)
        was_ready = slot.is_ready()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        self.kills.append(
            {
                "t": round(time.monotonic() - self._t0, 2),
                "slot": slot.name,
                "role": slot.role,
                "was_ready": was_ready,
            }
        )
        await self._spawn(slot)

    async def restart(
        self, slot: Slot, *, order: str = "start-first", within: float = 60.0
    ) -> None:
        """Replace ``slot``'s process as an operator would.

        ``start-first`` (a Kubernetes rolling update with ``maxSurge``): start the new
        process, wait until it is ready, then SIGTERM the old one and wait for it to
        exit. ``stop-first``: SIGTERM the old one, wait for its exit, start the new
        one and wait until it is ready. An old process still running ``within``
        seconds after SIGTERM is ``kill -9``-ed (counted as forced); a new one not
        ready within it is counted as never ready.
        """
        proc = slot.proc
        if proc is None or proc.returncode is not None:
            return
        self.killed_pids.add(proc.pid)  # its exit is ours, not its own
        record: dict[str, Any] = {
            "slot": slot.name,
            "role": slot.role,
            "order": order,
            "old_log": str(slot.log),
            "t": round(time.monotonic() - self._t0, 2),
        }

        async def stop_old() -> None:
            record["term_at"] = time.time()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(proc.wait(), within)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                code = await proc.wait()
                record["forced"] = True
            record["exit_code"] = code
            record["exited_at"] = time.time()

        async def start_new() -> None:
            await self._spawn(slot)
            record["new_log"] = str(slot.log)
            record["spawned_at"] = self.spawned_at[slot.log] if slot.log else time.time()
            deadline = time.monotonic() + within
            while not slot.is_ready() and time.monotonic() < deadline:  # noqa: ASYNC110 - a log
                await asyncio.sleep(0.05)
            record["ready_at"] = time.time() if slot.is_ready() else None

        if order == "start-first":
            await start_new()
            await stop_old()
            record["began_at"], record["ended_at"] = record["spawned_at"], record["exited_at"]
        else:
            await stop_old()
            await start_new()
            record["began_at"], record["ended_at"] = record["term_at"], record["ready_at"]
        self.restarts.append(record)

    async def stop(self) -> None:
        self.stopping = True
        procs = [slot.proc for slot in self.slots if slot.alive]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # type: ignore[union-attr]

        async def reap(proc: Any) -> None:
            try:
                await asyncio.wait_for(proc.wait(), 8.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

        await asyncio.gather(*(reap(proc) for proc in procs))
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    def log_files(self) -> list[Path]:
        return sorted(self.logs.glob("*.log"))


async def kill_loop(fleet: Fleet, rng: random.Random, every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every * rng.uniform(0.5, 1.5))
        if stop.is_set():
            return
        slot = fleet.pick(rng)
        if slot is not None:
            await fleet.kill(slot)


async def node_chaos(
    nodes: list[NatsNode],
    rng: random.Random,
    *,
    kill_at: float,
    restart_at: float,
    t0: float,
    record: dict[str, Any],
) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + kill_at - loop.time()))
    node = rng.choice(nodes)
    await node.kill()
    record["killed"] = {"node": node.name, "t": round(loop.time() - t0, 2)}
    await asyncio.sleep(max(0.0, t0 + restart_at - loop.time()))
    await node.start()
    record["restarted"] = {"node": node.name, "t": round(loop.time() - t0, 2)}


async def cluster_outage(
    nodes: list[NatsNode],
    how: str,
    *,
    down_at: float,
    up_at: float,
    t0: float,
    record: dict[str, Any],
) -> None:
    """Lose every NATS node at ``down_at`` (``how``: ``stop`` = SIGTERM each, ``kill9`` =
    SIGKILL all at once) and start them all again, on their stores, at ``up_at``."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + down_at - loop.time()))
    record["down_at"] = time.time()
    if how == "kill9":
        await asyncio.gather(*(node.kill() for node in nodes))
    else:
        await asyncio.gather(*(node.stop() for node in nodes))
    record["down"] = {"how": how, "t": round(loop.time() - t0, 2), "nodes": len(nodes)}
    await asyncio.sleep(max(0.0, t0 + up_at - loop.time()))
    await asyncio.gather(*(node.start(within=60.0) for node in nodes))
    record["up_at"] = time.time()
    record["up"] = {"t": round(loop.time() - t0, 2)}


#: How a rolling restart replaces a process (``--rolling-order``).
ROLLING_ORDERS = ("start-first", "stop-first")


async def rolling_restarts(
    fleet: Fleet,
    stop: asyncio.Event,
    *,
    start_after: float,
    order: str = "start-first",
    pause: float = 1.0,
) -> None:
    """Restart every router and worker, one at a time (:meth:`Fleet.restart` in
    ``order``), in passes, until ``stop``."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), start_after)
    passes = 0
    while passes == 0 or not stop.is_set():
        for slot in list(fleet.slots):
            if stop.is_set() and passes > 0:
                return
            await fleet.restart(slot, order=order)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
        passes += 1


# ---------------------------------------------------------------------- workload


@dataclass
class Track:
    """One request of the workload: what was planned, and what the client saw."""

    id: str
    level: str
    at: float
    prompt: str
    options: dict[str, Any]
    group: str | None = None
    stream: bool = False
    cancel_after: float | None = None
    resubmit_after: float | None = None
    request: InferenceRequest | None = None
    submit_at: float | None = None
    acked: bool = False
    submit_errors: list[str] = field(default_factory=list)
    first_duplicate: bool = False
    outcome: str | None = None
    resubmitted: bool = False
    resubmit_duplicate: bool | None = None
    resubmit_outcome: str | None = None
    cancel_sent: bool = False
    stream_text: str | None = None
    stream_ended: bool = False
    stream_restarts: int = 0
    stream_error: str | None = None


def make_workload(
    count: int,
    rate: float,
    rng: random.Random,
    run: str,
    *,
    deadline_share: float = 0.04,
    deadline_range: tuple[float, float] = (1.0, 4.0),
) -> list[Track]:
    tracks: list[Track] = []
    groups = 0
    while len(tracks) < count:
        at = len(tracks) / rate
        if rng.random() < 0.06 and count - len(tracks) >= 2:
            groups += 1
            size = min(rng.randint(2, 4), count - len(tracks))
            shared: dict[str, Any] = {"route": ROUTE, "max_tokens": rng.randint(4, 16)}
            if rng.random() < 0.5:
                shared["coalesce"] = True
                label = f"coalesce-{groups}"
            else:
                shared["dedupe_key"] = f"{run}-dk-{groups}"
                label = f"dedupe-{groups}"
            for member in range(size):
                tracks.append(
                    Track(
                        id=f"{run}-{len(tracks):05d}",
                        level=rng.choices(LEVELS, LEVEL_WEIGHTS)[0],
                        at=at + member * 0.05,
                        prompt=f"a question asked {size} times ({label})",
                        options=dict(shared),
                        group=label,
                        stream=rng.random() < 0.25,
                        resubmit_after=rng.uniform(0.2, 4.0) if rng.random() < 0.05 else None,
                    )
                )
            continue
        options: dict[str, Any] = {"route": ROUTE, "max_tokens": rng.randint(4, 16)}
        if rng.random() < 0.005:
            options["route"] = "no-such-route"
        if rng.random() < deadline_share:
            options["timeout"] = rng.uniform(*deadline_range)
        index = len(tracks)
        tracks.append(
            Track(
                id=f"{run}-{index:05d}",
                level=rng.choices(LEVELS, LEVEL_WEIGHTS)[0],
                at=at,
                prompt=f"request {index}: say something",
                options=options,
                stream=rng.random() < 0.25,
                cancel_after=rng.uniform(0.05, 2.5) if rng.random() < 0.03 else None,
                resubmit_after=rng.uniform(0.2, 4.0) if rng.random() < 0.05 else None,
            )
        )
    return tracks


class Driver:
    """Submits the workload through one ``renqueue.Client`` and follows what it sees."""

    def __init__(self, client: Client, tracks: list[Track]) -> None:
        self.client = client
        self.tracks = tracks
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, t0: float) -> None:
        """Play the schedule: submits, resubmits and cancels at their times."""
        loop = asyncio.get_running_loop()
        actions: list[tuple[float, int, str, Track]] = []
        for track in self.tracks:
            actions.append((track.at, 0, "submit", track))
            if track.resubmit_after is not None:
                actions.append((track.at + track.resubmit_after, 1, "resubmit", track))
            if track.cancel_after is not None:
                actions.append((track.at + track.cancel_after, 2, "cancel", track))
        actions.sort(key=lambda a: (a[0], a[1], a[3].id))
        for at, _, what, track in actions:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if what == "submit":
                self.spawn(self.submit(track))
            elif what == "resubmit":
                self.spawn(self.resubmit(track))
            else:
                self.spawn(self.cancel(track))

    async def _publish(self, track: Track, request: InferenceRequest) -> Any:
        """Submit until acked (the same id: idempotent), as a careful client would."""
        delay = 0.2
        deadline = time.monotonic() + 60.0
        while True:
            try:
                return await self.client.submit_request(request)
            except Exception as exc:  # noqa: BLE001 - any failure: retry, and count it
                track.submit_errors.append(type(exc).__name__)
                if time.monotonic() > deadline:
                    return None
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def submit(self, track: Track) -> None:
        track.request = self.client.build_request(
            track.prompt, priority=track.level, request_id=track.id, **track.options
        )
        track.submit_at = time.time()
        handle = await self._publish(track, track.request)
        if handle is None:
            return
        track.acked = True
        track.first_duplicate = handle.duplicate
        if track.stream:
            self.spawn(self.follow(track, handle))
        self.spawn(self.result(track, handle, resubmit=False))

    async def resubmit(self, track: Track) -> None:
        if track.request is None:
            return
        handle = await self._publish(track, track.request)
        if handle is None:
            return
        track.resubmitted = True
        track.resubmit_duplicate = handle.duplicate
        self.spawn(self.result(track, handle, resubmit=True))

    async def cancel(self, track: Track) -> None:
        for _ in range(5):
            try:
                await self.client.handle(track.id).cancel("chaos benchmark")
            except Exception:  # noqa: BLE001 - retried a few times
                await asyncio.sleep(0.5)
            else:
                track.cancel_sent = True
                return

    async def result(self, track: Track, handle: Any, *, resubmit: bool) -> None:
        try:
            await handle.result()
            outcome = "completed"
        except RequestFailedError as exc:
            outcome = exc.error_type or exc.code
        except Exception as exc:  # noqa: BLE001 - recorded: what the client saw
            outcome = f"error:{type(exc).__name__}"
        if resubmit:
            track.resubmit_outcome = outcome
        else:
            track.outcome = outcome

    async def follow(self, track: Track, handle: Any) -> None:
        parts: list[str] = []
        try:
            async for chunk in handle.stream():
                if chunk.restart:
                    parts.clear()
                    track.stream_restarts += 1
                parts.append(chunk.text)
            track.stream_ended = True
        except Exception as exc:  # noqa: BLE001 - recorded: what the follower saw
            track.stream_error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            track.stream_text = "".join(parts)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# ------------------------------------------------------------------------- audit


@dataclass(frozen=True)
class Logged:
    seq: int
    at: float  # server timestamp (stored)
    event: Event


async def read_events(js: Any) -> dict[str, list[Logged]]:
    """Every event of the benchmark's tenant, in log order, grouped by request id."""
    for attempt in range(5):
        try:
            return await _read_events_once(js)
        except Exception:
            if attempt == 4:
                raise
            await asyncio.sleep(2.0)
    raise AssertionError("unreachable")


async def _read_events_once(js: Any) -> dict[str, list[Logged]]:
    by_id: dict[str, list[Logged]] = {}
    sub = await js.pull_subscribe(
        f"rq.evt.{TENANT}.>",
        stream=EVENTS_STREAM,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    try:
        info = await sub.consumer_info()
        pending = info.num_pending
        while pending > 0:
            msgs = await sub.fetch(batch=1000, timeout=5.0)
            for msg in msgs:
                meta = msg.metadata
                pending = meta.num_pending
                with contextlib.suppress(msgspec.DecodeError):
                    stored = EVENT_DECODER.decode(msg.data)
                    rid = msg.subject.split(".")[3]
                    # A `submitted` carrying its binding: the pair, under its one sequence.
                    by_id.setdefault(rid, []).extend(
                        Logged(seq=meta.sequence.stream, at=meta.timestamp.timestamp(), event=event)
                        for event in facts(stored)
                    )
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return by_id


async def stored(js: Any, stream: str, subject: str = ">", cap: int = 20000) -> list[Any]:
    """The messages a stream still holds (by direct reads, so no consumer is made:
    a work-queue stream refuses one that overlaps its own)."""
    out = []
    seq = 1
    while len(out) < cap:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NatsNotFoundError:
            break
        out.append(msg)
        seq = msg.seq + 1
    return out


def terminals(history: list[Logged]) -> list[Logged]:
    return [item for item in history if kind_of(item.event) in TERMINAL_KINDS]


def outcome_of(event: Event) -> str:
    """The client's word for a terminal event: ``completed`` or its error type."""
    if isinstance(event, Completed):
        return "completed"
    if isinstance(event, Rejected | Failed):
        return event.error_type
    return kind_of(event)


def describe(history: list[Logged], t0: float | None) -> list[str]:
    """A request's events, one short line each (time from the submit)."""
    start = t0 if t0 is not None else (history[0].at if history else 0.0)
    lines = []
    for item in history:
        e = item.event
        details: list[str] = []
        if isinstance(e, Routed):
            details.append(f"backend={e.backend} attempt={e.attempt}")
        if isinstance(e, Started):
            details.append(f"backend={e.backend} attempt={e.attempt} run={e.delivery} {e.worker}")
        if isinstance(e, Completed):
            details.append(f"backend={e.backend} run={e.delivery}")
            if e.shared_with:
                details.append(f"shared_with={e.shared_with}")
        if isinstance(e, Retrying):
            details.append(f"backend={e.backend} run={e.delivery} {e.error_type}")
        if isinstance(e, Preempted):
            details.append(f"backend={e.backend} run={e.delivery} by={e.by}")
        if isinstance(e, Stolen):
            details.append(f"{e.from_backend}->{e.to_backend}")
        if isinstance(e, Coalesced):
            details.append(f"leader={e.leader}")
        if isinstance(e, Failed | Rejected):
            details.append(f"{e.error_type}: {e.reason[:80]}")
        if isinstance(e, Expired | Cancelled):
            details.append(f"stage={e.stage}")
        lines.append(
            f"{item.at - start:+8.2f}s  #{item.seq:<6} {kind_of(e):<16} {' '.join(details)}"
        )
    return lines


async def audit(
    js: Any,
    tracks: list[Track],
    mocks: dict[str, str],
    fleet: Fleet,
) -> dict[str, Any]:
    events = await read_events(js)
    by_id = {track.id: track for track in tracks}
    acked = [track for track in tracks if track.acked]
    # A request the client never saw acked but that was stored (a router logged
    # it) counts too: it must end like any other.
    counted = [t for t in tracks if t.acked or events.get(t.id)]
    lost = [t for t in counted if not terminals(events.get(t.id, []))]
    duplicated = [t for t in counted if len(terminals(events.get(t.id, []))) > 1]
    unacked = [t for t in tracks if not t.acked]
    unacked_stored = [t.id for t in unacked if events.get(t.id)]
    foreign = sorted(rid for rid in events if rid not in by_id)

    kinds: Counter[str] = Counter()
    error_types: Counter[str] = Counter()
    latencies: list[float] = []
    completed_latency: dict[str, list[float]] = {level: [] for level in LEVELS}
    own_completed = shared_completed = stopped_running = 0
    first_terminal: dict[str, Event] = {}
    for track in acked:
        ends = terminals(events.get(track.id, []))
        if not ends:
            continue
        end = ends[0]
        first_terminal[track.id] = end.event
        kind = kind_of(end.event)
        kinds[kind] += 1
        if isinstance(end.event, Failed | Rejected):
            error_types[f"{kind}:{end.event.error_type}"] += 1
        if isinstance(end.event, Expired | Cancelled):
            error_types[f"{kind}:{end.event.stage}"] += 1
            if end.event.stage == "running":
                stopped_running += 1
        if isinstance(end.event, Completed):
            if end.event.shared_with:
                shared_completed += 1
            else:
                own_completed += 1
        if track.submit_at is not None:
            latency = end.at - track.submit_at
            latencies.append(latency)
            if isinstance(end.event, Completed):
                completed_latency[track.level].append(latency)

    phases = latency_phases(acked, events)

    every = [item.event for history in events.values() for item in history]
    count_of: Counter[str] = Counter(kind_of(e) for e in every)
    runs_per_request = Counter(
        sum(1 for item in events.get(t.id, []) if isinstance(item.event, Started)) for t in acked
    )

    # Backend calls against the calls the outcomes needed.
    stats = {name: await mock_stats(url) for name, url in mocks.items()}
    calls = sum(s["requests"] for s in stats.values())
    full = sum(s["completed"] for s in stats.values())
    injected = sum(s["failed"] for s in stats.values())
    busy = sum(s["busy"] for s in stats.values())
    needed = own_completed + injected + count_of["preempted"] + stopped_running
    backend = {
        "calls": calls,
        "full_generations": full,
        "cut_off": sum(s["disconnects"] for s in stats.values()),
        "injected_failures": injected,
        "busy_429_over_limit": busy,
        "needed": needed,
        "needed_detail": {
            "own_completions": own_completed,
            "injected_failures": injected,
            "preempted_runs": count_of["preempted"],
            "stopped_running_by_cancel_or_deadline": stopped_running,
        },
        "extra_calls": calls - needed,
        "repeated_full_generations": full - own_completed,
        "coalesced_followers_completed": shared_completed,
        "per_backend": {
            name: {k: s[k] for k in ("requests", "completed", "failed", "busy", "disconnects")}
            | {"max_in_flight_seen": s["max_in_flight_seen"]}
            for name, s in stats.items()
        },
    }

    # Streamed followers: their text against the completed text.
    streamed = [t for t in acked if t.stream]
    stream_report: Counter[str] = Counter()
    stream_examples: dict[str, list[dict[str, Any]]] = {"mismatched": [], "hung": []}
    for track in streamed:
        end_event = first_terminal.get(track.id)
        if track.stream_error is not None:
            stream_report["error"] += 1
            if len(stream_examples["hung"]) < 3:
                stream_examples["hung"].append({"id": track.id, "error": track.stream_error})
        elif not track.stream_ended and end_event is None:
            stream_report["hung, request lost"] += 1
        elif not track.stream_ended:
            final_stored = await final_chunk_stored(js, track.id)
            stream_report[
                "hung, final chunk stored" if final_stored else "hung, no final chunk stored"
            ] += 1
            if len(stream_examples["hung"]) < 3:
                stream_examples["hung"].append(
                    {
                        "id": track.id,
                        "final_chunk_stored": final_stored,
                        "terminal": None if end_event is None else kind_of(end_event),
                        "text_so_far": (track.stream_text or "")[:120],
                    }
                )
        elif isinstance(end_event, Completed):
            if track.stream_text == end_event.text:
                stream_report["matched"] += 1
            else:
                stream_report["mismatched"] += 1
                if len(stream_examples["mismatched"]) < 3:
                    stream_examples["mismatched"].append(
                        {
                            "id": track.id,
                            "streamed": (track.stream_text or "")[:200],
                            "completed": end_event.text[:200],
                            "restarts": track.stream_restarts,
                        }
                    )
        else:
            stream_report["ended_not_completed"] += 1

    # What the client saw against the log.
    stranded_first = [t for t in acked if t.outcome is None and t.id in first_terminal]
    stranded_resubmit = [
        t for t in acked if t.resubmitted and t.resubmit_outcome is None and t.id in first_terminal
    ]
    disagree = [
        t
        for t in acked
        if t.id in first_terminal
        and any(
            seen is not None and seen != outcome_of(first_terminal[t.id])
            for seen in (t.outcome, t.resubmit_outcome)
        )
    ]

    # Work left in the queues, and where the lost requests are.
    left_requests = await stored(js, REQUESTS_STREAM, "rq.req.>")
    left_dispatch = await stored(js, DISPATCH_STREAM, "rq.dispatch.>")
    advisories = await stored(js, ADVISORIES_STREAM)
    exhausted: set[tuple[str, int]] = set()
    for msg in advisories:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            body = json.loads(msg.data)
            exhausted.add((body["stream"], int(body["stream_seq"])))
    where: dict[str, list[str]] = {}
    for msg in left_requests:
        with contextlib.suppress(msgspec.DecodeError):
            rid = REQUEST_DECODER.decode(msg.data).id
            note = f"in {REQUESTS_STREAM} #{msg.seq}"
            if (REQUESTS_STREAM, msg.seq) in exhausted:
                note += " (max_deliver used up: advisory)"
            where.setdefault(rid, []).append(note)
    for msg in left_dispatch:
        with contextlib.suppress(msgspec.DecodeError):
            dispatch = DISPATCH_DECODER.decode(msg.data)
            note = f"in {DISPATCH_STREAM} #{msg.seq} ({dispatch.backend})"
            if (DISPATCH_STREAM, msg.seq) in exhausted:
                note += " (max_deliver used up: advisory)"
            where.setdefault(dispatch.request.id, []).append(note)
    dlq = (await js.stream_info(DLQ_STREAM)).state.messages

    lost_ids = {t.id for t in lost}
    lost_where: Counter[str] = Counter()
    for track in lost:
        notes = where.get(track.id, [])
        leaders = [
            i.event.leader for i in events.get(track.id, []) if isinstance(i.event, Coalesced)
        ]
        if not notes and leaders:
            leader = leaders[-1]
            ended = first_terminal.get(leader)
            fate = "lost" if leader in lost_ids else ("ended " + kind_of(ended) if ended else "?")
            lost_where[f"coalesced follower, leader {fate}"] += 1
        elif not notes:
            lost_where["in no work queue"] += 1
        for note in notes:
            stream = note.split()[1]
            lost_where[
                f"{stream}, deliveries used up" if "advisory" in note else f"{stream}, waiting"
            ] += 1

    def example(track: Track) -> dict[str, Any]:
        history = events.get(track.id, [])
        return {
            "id": track.id,
            "level": track.level,
            "group": track.group,
            "resubmitted": track.resubmitted,
            "cancel_sent": track.cancel_sent,
            "client_outcome": track.outcome,
            "client_resubmit_outcome": track.resubmit_outcome,
            "where": where.get(track.id, []),
            "events": describe(history, track.submit_at),
        }

    return {
        "submitted": len(acked),
        "planned": len(tracks),
        "unacked": len(unacked),
        "unacked_but_stored": unacked_stored,
        "submit_retries": sum(len(t.submit_errors) for t in tracks),
        "submit_errors": dict(Counter(e for t in tracks for e in t.submit_errors)),
        "resubmits": sum(1 for t in acked if t.resubmitted),
        "coalesce_groups": len({t.group for t in acked if t.group}),
        "in_groups": sum(1 for t in acked if t.group),
        "streamed": len(streamed),
        "cancels_sent": sum(1 for t in acked if t.cancel_sent),
        "lost": len(lost),
        "lost_where": dict(lost_where),
        "duplicated": len(duplicated),
        "terminal_kinds": dict(kinds),
        "error_types": dict(error_types),
        "events_by_kind": dict(count_of),
        "runs_per_request": {str(k): v for k, v in sorted(runs_per_request.items())},
        "foreign_ids_in_log": foreign[:20],
        "backend": backend,
        "latency": {
            "count": len(latencies),
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "p99": percentile(latencies, 99),
            "max": max(latencies, default=float("nan")),
            "phases": phases,
            "completed_by_level": {
                level: {
                    "n": len(values),
                    "p50": percentile(values, 50),
                    "p95": percentile(values, 95),
                }
                for level, values in completed_latency.items()
            },
        },
        "streams": dict(stream_report),
        "client": {
            "stranded_handles": len(stranded_first),
            "stranded_resubmit_handles": len(stranded_resubmit),
            "stranded_first_handles_of_resubmitted": sum(
                1 for t in stranded_first if t.resubmitted
            ),
            "disagree_with_log": len(disagree),
        },
        "left": {
            REQUESTS_STREAM: len(left_requests),
            DISPATCH_STREAM: len(left_dispatch),
            DLQ_STREAM: dlq,
            "max_deliveries_advisories": len(advisories),
        },
        "processes": {
            "spawned": fleet.spawned,
            "kills": len(fleet.kills),
            "kills_by_role": dict(Counter(k["role"] for k in fleet.kills)),
            "kills_while_starting": sum(1 for k in fleet.kills if not k["was_ready"]),
            "self_exits": fleet.self_exits,
            "log_problems": log_problems(fleet.log_files()),
            "startup": startup_times(fleet),
        },
        "lost_ids": [t.id for t in lost],
        "duplicated_ids": [t.id for t in duplicated],
        "stranded_ids": [t.id for t in stranded_first],
        "examples": {
            "lost": [example(t) for t in lost[:3]],
            "duplicated": [example(t) for t in duplicated[:3]],
            "stranded_handle": [example(t) for t in stranded_first[:2]],
            "client_disagrees": [example(t) for t in disagree[:2]],
            "stream_hung": stream_examples["hung"],
            "stream_mismatched": stream_examples["mismatched"],
        },
    }


def latency_phases(tracks: list[Track], events: dict[str, list[Logged]]) -> dict[str, Any]:
    """Where the time went, per request that ended (p50/p95/max seconds): the
    client's submit -> the first ``submitted`` event (a router read it) ->
    the first ``routed`` -> the first ``started`` (a worker began) and the last
    ``started`` -> the terminal event."""
    spans: dict[str, list[float]] = {
        "submit_to_read": [],
        "read_to_routed": [],
        "routed_to_started": [],
        "last_started_to_end": [],
    }
    for track in tracks:
        history = events.get(track.id, [])
        ends = terminals(history)
        if not ends or track.submit_at is None:
            continue
        read = next((item for item in history if isinstance(item.event, Submitted)), None)
        routed = next((item for item in history if isinstance(item.event, Routed)), None)
        runs = [item for item in history if isinstance(item.event, Started)]
        if read is not None:
            spans["submit_to_read"].append(read.at - track.submit_at)
            if routed is not None:
                spans["read_to_routed"].append(routed.at - read.at)
        if routed is not None and runs:
            spans["routed_to_started"].append(runs[0].at - routed.at)
        if runs:
            spans["last_started_to_end"].append(ends[0].at - runs[-1].at)
    return {
        name: {
            "n": len(values),
            "p50": percentile(values, 50),
            "p95": percentile(values, 95),
            "max": max(values, default=float("nan")),
        }
        for name, values in spans.items()
    }


def _pid_of(name: str) -> int | None:
    """The pid in a worker's name (``host-PID-backend``) or a router's holder
    (``name@host:PID:nonce``)."""
    for part in name.replace(":", "-").split("-"):
        if part.isdigit():
            return int(part)
    return None


def _log_has(path: Path | None, words: str, after: float) -> bool:
    """Whether the JSON log at ``path`` has ``words`` in an entry stamped after ``after``."""
    if path is None or not path.exists():
        return False
    for line in path.read_text(errors="replace").splitlines():
        if words not in line:
            continue
        try:
            stamp = json.loads(line).get("timestamp", "")
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except (ValueError, AttributeError):
            continue
        if at >= after:
            return True
    return False


async def outage_report(
    js: Any, tracks: list[Track], fleet: Fleet, outage: dict[str, Any]
) -> dict[str, Any]:
    """What the loss of the whole cluster did: service restarts (must be 0), which
    processes logged the reconnect, which ran or routed requests afterwards, and the
    requests submitted while it was down."""
    events = await read_events(js)
    down_at = outage.get("down_at", float("inf"))
    up_at = outage.get("up_at", float("inf"))
    after_pids: set[int] = set()
    first_end_after_up = float("inf")
    for history in events.values():
        for item in history:
            if item.at < up_at:
                continue
            event = item.event
            pid = None
            if isinstance(event, Started):
                pid = _pid_of(event.worker)
            elif isinstance(event, Routed):
                pid = _pid_of(event.router)
            if pid is not None:
                after_pids.add(pid)
            if kind_of(event) in TERMINAL_KINDS and item.at < first_end_after_up:
                first_end_after_up = item.at
    processes = []
    for slot in fleet.slots:
        pid = slot.proc.pid if slot.proc is not None else None
        processes.append(
            {
                "slot": slot.name,
                "generation": slot.generation,
                "alive": slot.alive,
                "logged_disconnect": _log_has(slot.log, "nats disconnected", down_at - 1.0),
                "logged_reconnect": _log_has(slot.log, "nats reconnected", down_at),
                "moved_to_new_connection": _log_has(
                    slot.log, "running on a new NATS connection", down_at
                ),
                "worked_after": pid in after_pids,
            }
        )
    during = [
        t
        for t in tracks
        if t.acked and t.submit_at is not None and down_at - 1.0 <= t.submit_at <= up_at
    ]
    return {
        "down": outage.get("down"),
        "up": outage.get("up"),
        "down_seconds": round(up_at - down_at, 2) if up_at < float("inf") else None,
        "service_restarts": len(fleet.self_exits) + len(fleet.kills),
        "processes": processes,
        "reconnected": sum(1 for p in processes if p["logged_reconnect"]),
        "worked_after": sum(1 for p in processes if p["worked_after"]),
        "first_terminal_after_up_s": round(first_end_after_up - up_at, 2)
        if first_end_after_up < float("inf")
        else None,
        "submitted_around_outage": len(during),
        "submitted_around_outage_ended": sum(1 for t in during if terminals(events.get(t.id, []))),
    }


async def rolling_report(js: Any, tracks: list[Track], fleet: Fleet) -> dict[str, Any]:
    """The rolling restart: each restart's stop and start times, and every request with
    a deadline against it (ended later than its deadline; expired while a restart was
    under way, by the role restarting)."""
    events = await read_events(js)
    restarts = fleet.restarts
    # A request is judged against every restart under way while it waited: from the
    # restart's first step (SIGTERM, or the new process's start) to its last.
    windows = [
        (r["began_at"], r["ended_at"] if r["ended_at"] is not None else float("inf"), r["role"])
        for r in restarts
    ]
    deadlined = [t for t in tracks if t.acked and t.request is not None and t.request.deadline]
    overshoot: list[float] = []
    late: list[dict[str, Any]] = []
    expired_in_window: Counter[str] = Counter()
    expired_during = expired_outside = 0
    expired_examples: list[dict[str, Any]] = []
    completed_in_time = 0
    for track in deadlined:
        deadline = track.request.deadline if track.request is not None else None
        if deadline is None:
            continue
        ends = terminals(events.get(track.id, []))
        if not ends:
            continue
        end = ends[0]
        over = end.at - deadline
        overshoot.append(over)
        if over > 1.0:
            late.append(
                {
                    "id": track.id,
                    "kind": kind_of(end.event),
                    "over_s": round(over, 2),
                    "events": describe(events.get(track.id, []), track.submit_at),
                }
            )
        if isinstance(end.event, Completed) and over <= 0:
            completed_in_time += 1
        if isinstance(end.event, Expired):
            if len(expired_examples) < 4:
                expired_examples.append(
                    {
                        "id": track.id,
                        "level": track.level,
                        "timeout_s": round(deadline - (track.submit_at or deadline), 2),
                        "events": describe(events.get(track.id, []), track.submit_at),
                    }
                )
            start = track.submit_at or deadline
            roles = {role for lo, hi, role in windows if lo <= deadline and hi >= start}
            if roles:
                expired_during += 1
                for role in roles:
                    expired_in_window[role] += 1
            else:
                expired_outside += 1
    stop_s = [r["exited_at"] - r["term_at"] for r in restarts]
    ready_s = [r["ready_at"] - r["spawned_at"] for r in restarts if r["ready_at"] is not None]
    # How long the slot had no process taking work: stop-first, SIGTERM -> the new
    # one ready; start-first none (the old one works until the new one is ready).
    gap_s = [
        max(0.0, (r["ready_at"] or r["term_at"]) - r["term_at"])
        if r["order"] == "stop-first"
        else 0.0
        for r in restarts
    ]
    phases = restart_phases(restarts, fleet, events)
    return {
        "order": restarts[0]["order"] if restarts else None,
        "restarts": len(restarts),
        "restarts_by_role": dict(Counter(r["role"] for r in restarts)),
        "passes": len(restarts) / max(1, len(fleet.slots)),
        "exit_codes": dict(Counter(str(r["exit_code"]) for r in restarts)),
        "forced": sum(1 for r in restarts if r.get("forced")),
        "never_ready": sum(1 for r in restarts if r["ready_at"] is None),
        "term_to_exit": {"p50": percentile(stop_s, 50), "max": max(stop_s, default=float("nan"))},
        "start_to_ready": {
            "p50": percentile(ready_s, 50),
            "max": max(ready_s, default=float("nan")),
        },
        "without_process": {"p50": percentile(gap_s, 50), "max": max(gap_s, default=float("nan"))},
        "phases": phases,
        "self_exits": len(fleet.self_exits),
        "with_deadline": len(deadlined),
        "completed_by_deadline": completed_in_time,
        "expired": expired_during + expired_outside,
        "expired_while_restarting": expired_during,
        "expired_while_restarting_by_role": dict(expired_in_window),
        "expired_outside_restarts": expired_outside,
        "ended_over_deadline_by_1s": len(late),
        "overshoot_max_s": max(overshoot, default=float("nan")),
        "late_examples": late[:3],
        "expired_examples": expired_examples,
        "timeline": [
            {
                "slot": r["slot"],
                "t": r["t"],
                "term_to_exit_s": round(r["exited_at"] - r["term_at"], 2),
                "start_to_ready_s": None
                if r["ready_at"] is None
                else round(r["ready_at"] - r["spawned_at"], 2),
                "exit_code": r["exit_code"],
                **r.get("phases", {}),
            }
            for r in restarts
        ],
    }


def _log_lines(path: str | Path | None) -> list[tuple[float, dict[str, Any]]]:
    """A service log's JSON lines: (timestamp, entry), in order."""
    found: list[tuple[float, dict[str, Any]]] = []
    if path is None:
        return found
    with contextlib.suppress(OSError):
        for line in Path(path).read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                entry = json.loads(line)
                found.append((datetime.fromisoformat(entry["timestamp"]).timestamp(), entry))
    return found


def _first(lines: list[tuple[float, dict[str, Any]]], event: str) -> float | None:
    return next((at for at, entry in lines if entry.get("event") == event), None)


def restart_phases(
    restarts: list[dict[str, Any]], fleet: Fleet, events: dict[str, list[Logged]]
) -> dict[str, Any]:
    """Where a restart's time goes, from the processes' own logs (each record gets a
    ``phases`` entry; the figures over all restarts are returned).

    A new process: spawn -> ``nats connected`` (the interpreter, imports, config),
    -> ``provisioned`` (the streams and consumers checked), -> ``... started`` (the
    rest: a worker's consumer, a router's state and lease). The old one: SIGTERM ->
    ``... stopped`` (a worker's drain) -> exit (the rest of the shutdown). A binder
    stopped: SIGTERM -> the next ``router is binding`` in any router's log
    (``handover``) and -> the first ``routed`` event of that new term.
    """
    router_logs = [path for path in fleet.log_files() if path.name.startswith("router-")]
    bindings: list[tuple[float, int]] = []
    for path in router_logs:
        for at, entry in _log_lines(path):
            if entry.get("event") == "router is binding":
                bindings.append((at, int(entry.get("term") or 0)))
    bindings.sort()
    first_routed: dict[int, float] = {}
    for history in events.values():
        for logged in history:
            if isinstance(logged.event, Routed):
                term = logged.event.term
                first_routed[term] = min(first_routed.get(term, logged.at), logged.at)
    sums: dict[str, list[float]] = {}

    def note(record: dict[str, Any], name: str, value: float | None) -> None:
        if value is None:
            return
        record.setdefault("phases", {})[name] = round(value, 2)
        sums.setdefault(name, []).append(value)

    workers_of = Counter(slot.backend for slot in fleet.slots if slot.role == "worker")
    bound: list[tuple[str, float, float]] = []  # (backend, routed at, next step at)
    for history in events.values():
        for index, logged in enumerate(history):
            if isinstance(logged.event, Routed):
                after = next(
                    (
                        later.at
                        for later in history[index + 1 :]
                        if isinstance(later.event, Started | Stolen)
                        or kind_of(later.event) in TERMINAL_KINDS
                    ),
                    None,
                )
                if after is not None:
                    bound.append((logged.event.backend, logged.at, after))
    for r in restarts:
        backend = r["slot"].split("-")[1] if r["role"] == "worker" else None
        if backend is not None and workers_of[backend] == 1:
            # Requests bound to the backend while its only worker was being replaced:
            # how long each waited for a worker (its run started, or it was stolen).
            until = r["ready_at"] if r["order"] == "stop-first" else r["exited_at"]
            waits = [
                step - at
                for name, at, step in bound
                if name == backend and r["term_at"] <= at <= (until or at)
            ]
            note(r, "bound_while_restarting", float(len(waits)))
            if waits:
                note(r, "bound_while_restarting_wait_max", max(waits))
                sums.setdefault("bound_while_restarting_wait", []).extend(waits)
        new = _log_lines(r.get("new_log"))
        connected = _first(new, "nats connected")
        provisioned = _first(new, "provisioned")
        ready = _first(new, f"{r['role']} started")
        spawned = r.get("spawned_at")
        if spawned is not None and connected is not None:
            note(r, "spawn_to_connected", connected - spawned)
        if connected is not None and provisioned is not None:
            note(r, "connected_to_provisioned", provisioned - connected)
        if provisioned is not None and ready is not None:
            note(r, "provisioned_to_ready", ready - provisioned)
        old = _log_lines(r.get("old_log"))
        stopped = _first(old, f"{r['role']} stopped")
        if stopped is not None:
            note(r, "term_to_stopped", stopped - r["term_at"])
            note(r, "stopped_to_exit", r["exited_at"] - stopped)
        if r["role"] != "router":
            continue
        # Was it the binder when it got SIGTERM? Its last term began before, and it
        # did not stand by since.
        began = [
            at for at, e in old if e.get("event") == "router is binding" and at <= r["term_at"]
        ]
        stood = [at for at, e in old if e.get("event") == "router stands by" and at <= r["term_at"]]
        if not began or (stood and stood[-1] > began[-1]):
            continue
        nxt = next(((at, term) for at, term in bindings if at > r["term_at"]), None)
        if nxt is None:
            continue
        note(r, "binder_handover", nxt[0] - r["term_at"])
        if nxt[1] in first_routed:
            note(r, "binder_term_to_first_routed", first_routed[nxt[1]] - r["term_at"])
    return {
        name: {"p50": percentile(values, 50), "max": max(values), "n": len(values)}
        for name, values in sums.items()
    }


async def final_chunk_stored(js: Any, request_id: str) -> bool:
    try:
        last = await js.get_last_msg(TOKENS_STREAM, token_subject(TENANT, request_id))
    except Exception:  # noqa: BLE001 - none stored, or unreadable: not stored
        return False
    try:
        return bool(TOKEN_DECODER.decode(last.data).final)
    except msgspec.DecodeError:
        return False


def startup_times(fleet: Fleet) -> dict[str, Any]:
    """Seconds from spawning a service process to its ``router started`` /
    ``worker started`` log line; how many were killed before they got there.
    On a loaded machine a start takes seconds: a kill rate close to the restart
    rate leaves the fleet mostly starting, which is what latency then shows."""
    took: list[float] = []
    never = 0
    for path, spawned in fleet.spawned_at.items():
        ready_at = None
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    entry = json.loads(line)
                    if entry["event"] in ("router started", "worker started"):
                        ready_at = datetime.fromisoformat(entry["timestamp"]).timestamp()
                        break
        if ready_at is None:
            never += 1
        else:
            took.append(ready_at - spawned)
    return {
        "ready": len(took),
        "never_ready": never,
        "p50": percentile(took, 50),
        "p95": percentile(took, 95),
        "max": max(took, default=float("nan")),
    }


def log_problems(files: list[Path]) -> dict[str, int]:
    """Warnings and errors the service processes logged, by message; non-JSON lines
    (tracebacks) counted apart."""
    found: Counter[str] = Counter()
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                if line.strip():
                    found["(non-JSON line: traceback or crash output)"] += 1
                continue
            if not isinstance(entry, dict):
                continue
            level = entry.get("level", "")
            if level in {"warning", "error", "critical", "exception"}:
                text = str(entry.get("event", ""))
                if entry.get("error"):
                    text += f" [{str(entry['error'])[:70]}]"
                found[f"{level}: {text}"] += 1
    return dict(found.most_common(15))


# --------------------------------------------------------------------------- run


async def wait_for_tail(
    js: Any, tracks: list[Track], live: set[str], driver: Driver, bound: float
) -> float:
    """Wait until every acked request has a terminal event and the client has seen it,
    at most ``bound`` seconds; the time waited."""
    started = time.monotonic()
    deadline = started + bound
    next_audit = started + 10.0
    ended: set[str] = set()
    while time.monotonic() < deadline:
        ended |= live
        acked = [t for t in tracks if t.acked]
        waiting = [t for t in acked if t.id not in ended]
        if not waiting:
            break
        if time.monotonic() >= next_audit:
            with contextlib.suppress(Exception):
                events = await read_events(js)
                ended |= {rid for rid, history in events.items() if terminals(history)}
            next_audit = time.monotonic() + 10.0
        await asyncio.sleep(0.5)
    # The log is done (or the bound is reached): give the client's handles and
    # streams a moment to see it.
    grace = min(10.0, max(2.0, deadline - time.monotonic()))
    if driver.tasks:
        await asyncio.wait(set(driver.tasks), timeout=grace)
    return time.monotonic() - started


async def run_setting(
    setting: Setting, plan: Plan, *, seed: int, keep: bool, out: Path
) -> dict[str, Any]:
    rng = random.Random(seed)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path(tempfile.mkdtemp(prefix=f"rq-chaos-{setting.name}-"))
    report: dict[str, Any] = {
        "benchmark": "chaos",
        "setting": setting.name,
        "about": setting.about,
        "timestamp": stamp,
        "plan": plan.__dict__,
        "seed": seed,
        "settings": setting.__dict__,
        "machine": machine_info(),
        "workdir": str(workdir) if keep else None,
    }
    print(f"\n== chaos {setting.name}: {setting.about}", flush=True)
    print(
        f"   {plan.requests} requests at {plan.rate:g}/s, a kill -9 every ~{setting.kill_every:g}s"
        f", tail bound {plan.tail:g}s, work dir {workdir}",
        flush=True,
    )
    started = time.monotonic()
    try:
        async with contextlib.AsyncExitStack() as stack:
            nodes = await stack.enter_async_context(nats_servers(setting, workdir))
            url = ",".join(node.url for node in nodes)
            mocks: dict[str, str] = {}
            for index, backend in enumerate(BACKENDS):
                mock_url, _pid = await stack.enter_async_context(
                    mock_process(
                        ttft=0.05,
                        output_tokens=24,
                        tokens_per_second=setting.tokens_per_second,
                        failure_rate=backend.failure_rate,
                        concurrency=backend.slots,
                        seed=seed + index,
                    )
                )
                mocks[backend.name] = mock_url
            config_file = workdir / "renqueue.toml"
            config_file.write_text(config_text(setting, url, mocks))
            report["config_toml"] = config_file.read_text()
            config = load_config(config_file, environ={})

            nc = await connect(url, name="chaos-harness", config=config.nats)
            stack.push_async_callback(nc.close)
            await until_jetstream_answers(nc)
            await provision_with_retries(nc, config)
            js = nc.jetstream()

            fleet = Fleet(config_file, url, workdir / "logs")
            stack.push_async_callback(fleet.stop)
            await fleet.start()
            print(f"   up: {len(nodes)} nats node(s), {len(fleet.slots)} services", flush=True)

            live: set[str] = set()

            async def on_event(msg: Any) -> None:
                parts = msg.subject.split(".")
                if len(parts) == 5 and parts[4] in TERMINAL_KINDS:
                    live.add(parts[3])

            await nc.subscribe(f"rq.evt.{TENANT}.*.*", cb=on_event)

            run_tag = f"{setting.name[:1]}{stamp[-7:-1]}"
            tracks = make_workload(
                plan.requests,
                plan.rate,
                rng,
                run_tag,
                deadline_share=setting.deadline_share,
                deadline_range=setting.deadline_range,
            )
            client_nc = await connect(url, name="chaos-client", config=config.nats)
            stack.push_async_callback(client_nc.close)
            client = Client(client_nc, tenant=TENANT)
            driver = Driver(client, tracks)
            loop = asyncio.get_running_loop()
            stop_kills = asyncio.Event()
            node_record: dict[str, Any] = {}
            t0 = loop.time() + 0.5
            window = tracks[-1].at
            killer = asyncio.create_task(
                kill_loop(fleet, random.Random(seed + 100), setting.kill_every, stop_kills)
                if setting.kill_every > 0
                else stop_kills.wait()
            )
            node_task: asyncio.Task[None] | None = None
            outage: dict[str, Any] = {}
            if setting.nats_outage is not None:
                down_at = window / 3
                node_task = asyncio.create_task(
                    cluster_outage(
                        nodes,
                        setting.nats_outage,
                        down_at=down_at,
                        up_at=down_at + min(20.0, window / 3),
                        t0=t0,
                        record=outage,
                    )
                )
            roller: asyncio.Task[None] | None = None
            if setting.rolling:
                roller = asyncio.create_task(
                    rolling_restarts(
                        fleet,
                        stop_kills,
                        start_after=0.5 + window / 10,
                        order=setting.rolling_order,
                    )
                )
            if setting.kill_node:
                node_task = asyncio.create_task(
                    node_chaos(
                        nodes,
                        random.Random(seed + 200),
                        kill_at=window / 3,
                        restart_at=2 * window / 3,
                        t0=t0,
                        record=node_record,
                    )
                )
            try:
                await driver.run(t0)
                arrivals = loop.time() - t0
                print(
                    f"   arrivals done in {arrivals:.1f}s, {len(fleet.kills)} kills; waiting for"
                    " the tail",
                    flush=True,
                )
            finally:
                stop_kills.set()
                await killer
                if node_task is not None:
                    await node_task
                if roller is not None:
                    await roller
            tail = await wait_for_tail(js, tracks, live, driver, plan.tail)
            await driver.close()
            await client.close()
            result = await audit(js, tracks, mocks, fleet)
            result["arrival_seconds"] = round(arrivals, 2)
            result["tail_seconds"] = round(tail, 2)
            result["node_chaos"] = node_record
            if setting.nats_outage is not None:
                result["outage"] = await outage_report(js, tracks, fleet, outage)
            if setting.rolling or setting.control:
                result["rolling"] = await rolling_report(js, tracks, fleet)
            report.update(result)
    finally:
        report["total_seconds"] = round(time.monotonic() - started, 1)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    write_json(
        report, out, f"chaos-{setting.name}-{stamp}.json", f"chaos-{setting.name}-latest.json"
    )
    return report


def write_json(report: dict[str, Any], out: Path, *names: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=str) + "\n"
    for name in names:
        (out / name).write_text(text)


# ------------------------------------------------------------------------ report


def _seconds(value: float) -> str:
    return "-" if value != value else f"{value:.2f}s"  # NaN: no values


def print_report(report: dict[str, Any]) -> None:
    name = report["setting"]
    if "submitted" not in report:
        print(f"chaos {name}: did not complete (see above)")
        return
    p = report["processes"]
    node = report.get("node_chaos") or {}
    print(f"\nchaos {name}: {report['about']}")
    print(
        f"  submitted {report['submitted']} in {report['arrival_seconds']}s "
        f"(resubmits {report['resubmits']}, {report['in_groups']} in {report['coalesce_groups']}"
        f" coalescing groups, streamed {report['streamed']}, cancels {report['cancels_sent']}); "
        f"unacked {report['unacked']}, submit retries {report['submit_retries']} "
        f"{report['submit_errors'] or ''}"
    )
    print(
        f"  kills {p['kills']} {p['kills_by_role']} ({p['kills_while_starting']} while starting), "
        f"self-exits {len(p['self_exits'])}; start to ready p50 {_seconds(p['startup']['p50'])} "
        f"p95 {_seconds(p['startup']['p95'])} ({p['startup']['never_ready']} of "
        f"{p['spawned']} never ready)"
        + (
            f"; nats node {node['killed']['node']} killed at {node['killed']['t']}s"
            + (f", restarted at {node['restarted']['t']}s" if "restarted" in node else "")
            if "killed" in node
            else ""
        )
        + f"; tail {report['tail_seconds']}s"
    )
    print(f"  LOST {report['lost']}  DUPLICATED {report['duplicated']}", end="")
    print(f"  (lost: {report['lost_where']})" if report["lost"] else "")
    print(f"  terminal: {report['terminal_kinds']}")
    print(f"  error types: {report['error_types']}")
    b = report["backend"]
    print(
        f"  backend calls {b['calls']}, needed {b['needed']} {b['needed_detail']}; "
        f"extra {b['extra_calls']} (repeated full generations {b['repeated_full_generations']}, "
        f"cut off {b['cut_off']}, over-limit 429s {b['busy_429_over_limit']}); coalesced "
        f"followers served without a call {b['coalesced_followers_completed']}"
    )
    lat = report["latency"]
    by_level = " ".join(
        f"{level} {_seconds(v['p95'])}" for level, v in lat["completed_by_level"].items() if v["n"]
    )
    print(
        f"  latency submit->terminal p50 {_seconds(lat['p50'])} p95 {_seconds(lat['p95'])} "
        f"p99 {_seconds(lat['p99'])} max {_seconds(lat['max'])}; completed p95 by level: "
        f"{by_level}"
    )
    print(
        "  where the time went (p50/p95/max): "
        + "; ".join(
            f"{name.replace('_', ' ')} {_seconds(v['p50'])}/{_seconds(v['p95'])}/"
            f"{_seconds(v['max'])}"
            for name, v in lat["phases"].items()
        )
    )
    print(f"  streams ({report['streamed']}): {report['streams']}")
    c = report["client"]
    print(
        f"  client handles never resolved although the log has a terminal: {c['stranded_handles']}"
        f" first handles ({c['stranded_first_handles_of_resubmitted']} of them resubmitted), "
        f"{c['stranded_resubmit_handles']} resubmit handles; outcome differs from the log: "
        f"{c['disagree_with_log']}"
    )
    print(f"  left: {report['left']}; runs per request {report['runs_per_request']}")
    if "outage" in report:
        o = report["outage"]
        print(
            f"  nats outage: {o['down']} -> up {o['up']} ({o['down_seconds']}s down); service"
            f" restarts {o['service_restarts']}; reconnected (logged) {o['reconnected']}/"
            f"{len(o['processes'])}; ran or routed requests afterwards {o['worked_after']}/"
            f"{len(o['processes'])}; first terminal {o['first_terminal_after_up_s']}s after up;"
            f" submitted around the outage {o['submitted_around_outage']}, ended"
            f" {o['submitted_around_outage_ended']}"
        )
    if "rolling" in report:
        r = report["rolling"]
        print(
            f"  rolling ({r['order'] or 'none'}): {r['restarts']} restarts {r['restarts_by_role']}"
            f" ({r['passes']:.1f} passes), exit codes {r['exit_codes']}, forced {r['forced']},"
            f" never ready {r['never_ready']}, SIGTERM->exit p50"
            f" {_seconds(r['term_to_exit']['p50'])} max {_seconds(r['term_to_exit']['max'])},"
            f" start->ready p50 {_seconds(r['start_to_ready']['p50'])} max"
            f" {_seconds(r['start_to_ready']['max'])}, slot without a process p50"
            f" {_seconds(r['without_process']['p50'])} max"
            f" {_seconds(r['without_process']['max'])}"
        )
        if r["phases"]:
            print(
                "  phases (p50/max, n): "
                + "; ".join(
                    (
                        f"{name} {v['p50']:g}/{v['max']:g} ({v['n']} restarts)"
                        if name == "bound_while_restarting"
                        else f"{name} {_seconds(v['p50'])}/{_seconds(v['max'])} ({v['n']})"
                    )
                    for name, v in r["phases"].items()
                )
            )
        print(
            f"  deadlines: {r['with_deadline']} requests with one; completed in time"
            f" {r['completed_by_deadline']}, expired {r['expired']} (while a restart was under"
            f" way {r['expired_while_restarting']} {r['expired_while_restarting_by_role']},"
            f" outside {r['expired_outside_restarts']}); ended >1 s after the deadline"
            f" {r['ended_over_deadline_by_1s']} (max overshoot {r['overshoot_max_s']:.2f}s)"
        )
        print(
            "  restarts: "
            + "; ".join(
                f"{x['slot']} at {x['t']}s stop {x['term_to_exit_s']}s ready"
                f" {x['start_to_ready_s']}s"
                + (f" handover {x['binder_handover']}s" if "binder_handover" in x else "")
                for x in r["timeline"]
            )
        )
        for example in r["expired_examples"][:3]:
            print(f"  expired: {example['id']} {example['level']} timeout {example['timeout_s']}s")
            for line in example["events"]:
                print(f"      {line}")
        for example in r["late_examples"][:2]:
            print(f"  late: {example['id']} {example['kind']} +{example['over_s']}s")
            for line in example["events"]:
                print(f"      {line}")
    if p["log_problems"]:
        top = list(p["log_problems"].items())[:6]
        print("  service logs: " + "; ".join(f"{n}x {text}" for text, n in top))
    for exit_ in p["self_exits"][:3]:
        last = exit_["last_lines"][-1] if exit_["last_lines"] else ""
        print(f"  self-exit {exit_['slot']} code {exit_['exit_code']} at {exit_['t']}s: {last}")
    for kind, examples in report["examples"].items():
        for example in examples[:2]:
            brief = {k: v for k, v in example.items() if k != "events"}
            print(f"  example ({kind}): {json.dumps(brief)}")
            for line in example.get("events", []):
                print(f"      {line}")


def summary_line(report: dict[str, Any]) -> str:
    """One line per setting: what the issue asks a chaos run to report."""
    name = report["setting"]
    if "submitted" not in report:
        return f"chaos {name}: did not complete"
    p = report["processes"]
    roles = p["kills_by_role"]
    node = report.get("node_chaos") or {}
    lat = report["latency"]
    extra = ""
    if "outage" in report:
        o = report["outage"]
        down = o["down"] or {"nodes": 0, "how": "-"}
        extra = (
            f", nats nodes lost {down['nodes']} ({down['how']},"
            f" {o['down_seconds']}s), service restarts {o['service_restarts']}, reconnected"
            f" {o['reconnected']}/{len(o['processes'])}, stranded handles"
            f" {report['client']['stranded_handles']}"
        )
    if "rolling" in report:
        r = report["rolling"]
        extra = (
            f", rolling restarts {r['restarts']} ({r['order'] or 'none'}, forced {r['forced']}),"
            " deadline requests"
            f" {r['with_deadline']}: expired {r['expired']} ({r['expired_while_restarting']}"
            f" during a restart), ended >1 s past deadline {r['ended_over_deadline_by_1s']}"
        )
    return (
        f"chaos {name}: requests {report['submitted']}, kills {p['kills']} "
        f"(router {roles.get('router', 0)}, worker {roles.get('worker', 0)}, "
        f"nats node {1 if 'killed' in node else 0}), lost {report['lost']}, "
        f"duplicated {report['duplicated']}, outcomes {report['terminal_kinds']}, "
        f"extra backend calls {report['backend']['extra_calls']}, latency p50/p95/p99 "
        f"{_seconds(lat['p50'])}/{_seconds(lat['p95'])}/{_seconds(lat['p99'])}" + extra
    )


def passed(report: dict[str, Any]) -> bool:
    """0 lost and 0 duplicated; after a NATS outage also no service restart and every
    client handle resolved; in a rolling restart no request ended >1 s past its deadline."""
    ok = report.get("lost") == 0 and report.get("duplicated") == 0
    if ok and "outage" in report:
        ok = (
            report["outage"]["service_restarts"] == 0
            and report["client"]["stranded_handles"] == 0
            and report["client"]["stranded_resubmit_handles"] == 0
        )
    if ok and "rolling" in report:
        ok = report["rolling"]["ended_over_deadline_by_1s"] == 0
    return bool(ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--setting", choices=[*SETTINGS, "all"], default="all")
    parser.add_argument("--requests", type=int, help="requests per setting (1000; quick 150)")
    parser.add_argument("--rate", type=float, help="arrivals per second (15; quick 10)")
    parser.add_argument("--quick", action="store_true", help="a ~1-minute smoke run per setting")
    parser.add_argument(
        "--kill-every",
        type=float,
        help="seconds between kills (the setting's: 1, harsh 0.5); on a machine where a"
        " service takes longer than ~6 kill intervals to start, the fleet is mostly down",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="the same load and config without the setting's faults (no kills, no NATS"
        " outage, no rolling restart): what the faults add, e.g. to the deadline misses",
    )
    parser.add_argument(
        "--rolling-order",
        choices=ROLLING_ORDERS,
        default="start-first",
        help="how `rolling` replaces each process: start-first (the new one started and"
        " ready before the old one gets SIGTERM, as a Kubernetes rolling update with"
        " maxSurge; the default) or stop-first (SIGTERM, exit, then the new one)",
    )
    parser.add_argument(
        "--require-worker",
        action="store_true",
        help="set router.require_worker: the binder binds nothing to a backend no worker"
        " asks for work (one whose only worker is being replaced, stop-first)",
    )
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, stores)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    # The harness's own warnings (a client reconnecting while a node is down) are
    # expected here; the services' logs are summarised in the report.
    configure_logging(level="ERROR")
    names = list(SETTINGS) if args.setting == "all" else [args.setting]
    reports = []
    for name in names:
        setting = SETTINGS[name]
        if args.kill_every is not None:
            setting = dataclasses.replace(setting, kill_every=args.kill_every)
        if args.require_worker:
            setting = dataclasses.replace(
                setting, require_worker=True, about=f"{setting.about}; router.require_worker"
            )
        if setting.rolling:
            setting = dataclasses.replace(
                setting,
                rolling_order=args.rolling_order,
                about=f"{setting.about}; order: {args.rolling_order}",
            )
        if args.control:
            setting = dataclasses.replace(
                setting,
                name=f"{setting.name}-control",
                kill_every=0.0,
                kill_node=False,
                nats_outage=None,
                rolling=False,
                control=True,
                about=f"control for {setting.name}: its load and config, no faults",
            )
        plan = plan_for(setting, quick=args.quick, requests=args.requests, rate=args.rate)
        try:
            report = asyncio.run(
                run_setting(setting, plan, seed=args.seed, keep=args.keep, out=args.out)
            )
        except Exception:  # noqa: BLE001 - the other settings still run
            traceback.print_exc()
            report = {"setting": name}
        print_report(report)
        reports.append(report)
    print()
    failed = False
    for report in reports:
        ok = passed(report)
        failed |= not ok
        print(summary_line(report) + f" -> {'OK' if ok else 'FAIL'}")
    path = args.out / f"chaos-{reports[-1].get('setting', names[-1])}-latest.json"
    print(f"JSON: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
