"""Soak benchmark (issue #30 item 5): a steady mixed workload for an hour, watching for growth.

Run with ``make soak`` (``--minutes 60``) or ``python bench/soak.py --minutes 10``. The
deployment is the separate-process one ``bench/chaos.py`` runs (its ``Fleet``): one
nats-server (own temporary store), 2 ``renqueue router`` processes (each also runs the
projector) and 4 ``renqueue worker -b NAME`` processes, three mock LLM backends as
processes of their own, one route ``chat`` cascading over them: ``alpha`` and ``beta``
(8 slots each, one pool) and ``gamma`` (12 slots, 2 % injected failures, two workers).
``beta`` flaps: it is taken down (every connection reset) for ``--flap-down`` seconds
every ``--flap-every`` seconds, so its circuit opens and requests fall back to the
others. ``--deployment up`` runs one ``renqueue up`` joined to the server instead (the
same components in one process).

Load: ``--rate`` (50) requests a second, open loop, through one ``renqueue.Client``, over
the five levels; a quarter streamed to the end by a follower, 3 % cancelled 0.05-1.5 s
after the submit, 5 % with a 2-10 s deadline, 3 % resubmitted with the same id, and 2 %
sharing a ``dedupe_key`` with the request before. Every submit's handle waits for its
result (so the client's own maps are exercised too).

Every ``--sample-every`` seconds it samples each process (the services, nats-server, the
mocks, this harness): RSS, open file descriptors, CPU seconds; every stream's messages
and bytes (the KV buckets' streams give their key counts) against its limits; the load
average. The baseline is the first sample after ``--warmup`` seconds; the report gives
each process's RSS at the baseline and at the end, growth % (target: under 10 %) and
the least-squares slope after the warm-up (MB/hour), the fd counts, each stream's size and
bytes per request against its retention, KV keys at the baseline and the end, requests
lost (acked, no terminal event: must be 0), duplicated (two terminal events stored),
client handles that never resolved, service restarts, and the achieved request rate.

``--tracemalloc`` runs the services under :mod:`tracemalloc` (``bench/_traced.py``):
a snapshot of each at the baseline and at the end, and the report lists the lines whose
allocations grew most (slower: use it to find a growth, not to measure one).

JSON: ``bench/results/soak-<timestamp>.json`` and ``soak-latest.json``. Exit status 1 if
a request was lost or duplicated, or a service restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chaos import (
    FILE_STORE,
    Backend,
    Fleet,
    NatsNode,
    backends_toml,
    provision_with_retries,
    stored,
    until_jetstream_answers,
)
from common import (
    RESULTS,
    ROOT,
    machine_info,
    mock_process,
    mock_settings,
    mock_stats,
)

from renqueue import Client
from renqueue.broker import JetStreamApi, connect
from renqueue.config import load_config
from renqueue.errors import NatsNotFoundError, RequestFailedError
from renqueue.logs import configure_logging
from renqueue.schema import (
    DISPATCH_DECODER,
    DISPATCH_STREAM,
    EVENTS_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    TERMINAL_KINDS,
)

TENANT = "soak"
ROUTE = "chat"
LEVELS = ("critical", "high", "normal", "low", "batch")
LEVEL_WEIGHTS = (5, 15, 40, 20, 20)
BACKENDS = (
    Backend(name="alpha", slots=8, pool="local"),
    Backend(name="beta", slots=8, pool="local"),
    Backend(name="gamma", slots=12, failure_rate=0.02, workers=2),
)
FLAPPING = "beta"
MB = 1024 * 1024


def config_text(url: str, mocks: dict[str, str]) -> str:
    lines = [
        "# Written by bench/soak.py.",
        "[nats]",
        f'url = "{url}"',
        f'max_file_store = "{FILE_STORE}"',
        "",
        "[worker]",
        'retry_delay = "200ms"',
        'drain_timeout = "2s"',
    ]
    return "\n".join([*lines, *backends_toml(BACKENDS, mocks, ROUTE)])


# ------------------------------------------------------------------- processes


def proc_sample(pid: int) -> dict[str, float] | None:
    """RSS (MB), open fds and CPU seconds of process ``pid``; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rss = next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
    )
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss_mb": rss / 1024,
        "fds": fds,
        "cpu_s": (int(stat[11]) + int(stat[12])) / ticks,
    }


@dataclass
class UpSlot:
    name: str
    proc: asyncio.subprocess.Process | None = None


class UpFleet:
    """``--deployment up``: ``renqueue up`` joined to the server (routers, workers and the
    projector in one process), in place of chaos.py's :class:`Fleet`."""

    def __init__(
        self,
        config_file: Path,
        url: str,
        logs: Path,
        *,
        launcher: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config_file, self.url, self.log = config_file, url, logs / "up.log"
        logs.mkdir(parents=True, exist_ok=True)
        self.launcher = launcher or [sys.executable, "-m", "renqueue"]
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")},
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.slots = [UpSlot("renqueue-up")]
        self.self_exits: list[dict[str, Any]] = []
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    async def start(self, *, within: float = 120.0) -> None:
        with self.log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *self.launcher, "-c", str(self.config_file), "--nats", self.url,
                "--log-json", "up",
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=self.env,
            )  # fmt: skip
        self.slots[0].proc = proc
        deadline = time.monotonic() + within
        while b"running; Ctrl-C to stop" not in self.log.read_bytes():
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"renqueue up did not start: {self.log.read_text()[-2000:]}")
            await asyncio.sleep(0.2)
        self._watch = asyncio.create_task(self._watched(proc))

    async def _watched(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if not self._stopping:
            self.self_exits.append({"slot": "renqueue-up", "exit_code": code})

    async def stop(self) -> None:
        self._stopping = True
        proc = self.slots[0].proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._watch is not None:
            await self._watch


def processes(fleet: Any, node: NatsNode, mocks: dict[str, int]) -> dict[str, int]:
    """Name -> pid of every process of the deployment, and of this harness."""
    out = {slot.name: slot.proc.pid for slot in fleet.slots if slot.proc is not None}
    if node.proc is not None:
        out["nats-server"] = node.proc.pid
    out |= {f"mock-{name}": pid for name, pid in mocks.items()}
    out["harness (client)"] = os.getpid()
    return out


async def streams_now(nc: Any) -> dict[str, dict[str, Any]]:
    """Every stream's state and limits (one ``STREAM.LIST`` page holds them all)."""
    response = await JetStreamApi(nc).call("STREAM.LIST", {"offset": 0})
    out = {}
    for item in response.get("streams") or []:
        config, state = item["config"], item["state"]
        out[config["name"]] = {
            "messages": state.get("messages", 0),
            "bytes": state.get("bytes", 0),
            "subjects": state.get("num_subjects", 0),
            "first_seq": state.get("first_seq", 0),
            "last_seq": state.get("last_seq", 0),
            "retention": config.get("retention"),
            "max_age_s": (config.get("max_age") or 0) / 1e9,
            "max_bytes": config.get("max_bytes", -1),
            "max_msgs": config.get("max_msgs", -1),
            "max_msgs_per_subject": config.get("max_msgs_per_subject", -1),
        }
    return out


# ---------------------------------------------------------------------- workload


@dataclass(slots=True)
class Sent:
    submit_at: float
    acked: bool = False
    outcome: str | None = None


@dataclass
class Load:
    """The open-loop driver: submits at ``rate`` and follows every handle."""

    client: Client
    rate: float
    rng: random.Random
    tag: str
    sent: dict[str, Sent] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    submit_errors: Counter[str] = field(default_factory=Counter)
    behind_max: float = 0.0
    last_dedupe: str | None = None

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        index = 0
        while True:
            at = start + index / self.rate
            if at >= until:
                return
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.behind_max = max(self.behind_max, -delay)
            self.spawn(self.one(index))
            index += 1

    async def one(self, index: int) -> None:
        rng = self.rng
        rid = f"{self.tag}-{index:07d}"
        options: dict[str, Any] = {"route": ROUTE, "max_tokens": rng.randint(4, 16)}
        draw = rng.random()
        cancel_after = resubmit_after = None
        if draw < 0.05:
            options["timeout"] = rng.uniform(2.0, 10.0)
            self.counts["deadline"] += 1
        elif draw < 0.08:
            cancel_after = rng.uniform(0.05, 1.5)
        elif draw < 0.11:
            resubmit_after = rng.uniform(0.2, 3.0)
        elif draw < 0.13 and self.last_dedupe is not None:
            options["dedupe_key"] = self.last_dedupe
            self.counts["deduped"] += 1
        if draw >= 0.13 and rng.random() < 0.05:
            options["dedupe_key"] = self.last_dedupe = f"{self.tag}-dk-{index}"
        stream = rng.random() < 0.25
        level = rng.choices(LEVELS, LEVEL_WEIGHTS)[0]
        request = self.client.build_request(
            f"request {index}: say something", priority=level, request_id=rid, **options
        )
        sent = self.sent[rid] = Sent(submit_at=time.time())
        handle = await self.publish(request)
        if handle is None:
            return
        sent.acked = True
        self.counts["acked"] += 1
        if stream:
            self.counts["streamed"] += 1
            self.spawn(self.follow(handle))
        if cancel_after is not None:
            self.spawn(self.cancel(handle, cancel_after))
        if resubmit_after is not None:
            self.spawn(self.resubmit(request, resubmit_after))
        try:
            await asyncio.wait_for(handle.result(), 600.0)
            sent.outcome = "completed"
        except RequestFailedError as exc:
            sent.outcome = exc.error_type or exc.code
        except Exception as exc:  # noqa: BLE001 - recorded: what the client saw
            sent.outcome = f"error:{type(exc).__name__}"

    async def publish(self, request: Any) -> Any:
        for _ in range(5):
            try:
                return await self.client.submit_request(request)
            except Exception as exc:  # noqa: BLE001 - counted, retried under the same id
                self.submit_errors[type(exc).__name__] += 1
                await asyncio.sleep(0.5)
        return None

    async def follow(self, handle: Any) -> None:
        try:
            async for _chunk in handle.stream():
                pass
            self.counts["stream_ended"] += 1
        except Exception:  # noqa: BLE001 - counted
            self.counts["stream_error"] += 1

    async def cancel(self, handle: Any, after: float) -> None:
        await asyncio.sleep(after)
        with contextlib.suppress(Exception):
            await handle.cancel("soak")
            self.counts["cancels"] += 1

    async def resubmit(self, request: Any, after: float) -> None:
        await asyncio.sleep(after)
        handle = await self.publish(request)
        if handle is not None:
            self.counts["resubmits"] += 1
            self.counts["resubmit_duplicate"] += int(handle.duplicate)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(handle.result(), 600.0)


async def flapping(url: str, every: float, down_for: float, stop: asyncio.Event) -> list[float]:
    """Take the flapping backend down for ``down_for`` seconds every ``every`` seconds."""
    flaps = []
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every - down_for)
        if stop.is_set():
            break
        await _set_down(url, down=True)
        flaps.append(time.time())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), down_for)
        await _set_down(url, down=False)
    return flaps


async def _set_down(url: str, *, down: bool) -> None:
    """The mock's ``down`` setting, tried until it answers (a loaded machine may be slow)."""
    for _ in range(30):
        try:
            await mock_settings(url, {"down": down})
        except Exception:  # noqa: BLE001 - tried again
            await asyncio.sleep(1.0)
        else:
            return


async def still_queued(js: Any) -> set[str]:
    """Ids of the requests the work queues still hold (waiting: a backlog, not lost)."""
    ids: set[str] = set()
    for msg in await stored(js, REQUESTS_STREAM, "rq.req.>", cap=1_000_000):
        with contextlib.suppress(Exception):
            ids.add(REQUEST_DECODER.decode(msg.data).id)
    for msg in await stored(js, DISPATCH_STREAM, "rq.dispatch.>", cap=1_000_000):
        with contextlib.suppress(Exception):
            ids.add(DISPATCH_DECODER.decode(msg.data).request.id)
    return ids


async def terminals_stored(js: Any, rid: str) -> int:
    """How many terminal events the log holds for request ``rid``."""
    found = 0
    for kind in TERMINAL_KINDS:
        seq = 1
        while True:
            try:
                msg = await js.get_msg(
                    EVENTS_STREAM, seq=seq, subject=f"rq.evt.{TENANT}.{rid}.{kind}", next=True
                )
            except NatsNotFoundError:
                break
            found += 1
            seq = msg.seq + 1
    return found


# --------------------------------------------------------------------------- run


def slope_mb_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return float("nan")
    xs = [p[0] / 3600 for p in points]
    ys = [p[1] for p in points]
    if len(set(xs)) < 2:
        return float("nan")
    return statistics.linear_regression(xs, ys).slope


def snapshot_all(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        if name.startswith(("router", "worker", "renqueue-up")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)


def tracemalloc_growth(directory: Path, pids: dict[str, int], top: int) -> dict[str, list[str]]:
    """Per service: the lines whose traced allocations grew most between its first and
    its last snapshot."""
    out: dict[str, list[str]] = {}
    for name, pid in pids.items():
        snaps = sorted(directory.glob(f"{pid}-*.snap"), key=lambda p: int(p.stem.split("-")[1]))
        if len(snaps) < 2:
            continue
        first = tracemalloc.Snapshot.load(str(snaps[0]))
        last = tracemalloc.Snapshot.load(str(snaps[-1]))
        diff = last.compare_to(first, "traceback")
        lines = []
        for stat in diff[:top]:
            frames = [
                f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in stat.traceback
            ]
            lines.append(
                f"{stat.size_diff / 1024:+.0f} KiB ({stat.count_diff:+d} blocks) "
                + " <- ".join(frames[:4])
            )
        total = sum(s.size_diff for s in diff)
        out[name] = [f"traced total {total / 1024:+.0f} KiB", *lines]
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path(tempfile.mkdtemp(prefix="rq-soak-"))
    duration = args.minutes * 60.0
    warmup = args.warmup if args.warmup is not None else min(300.0, max(60.0, duration / 10))
    report: dict[str, Any] = {
        "benchmark": "soak",
        "timestamp": stamp,
        "minutes": args.minutes,
        "rate": args.rate,
        "warmup_s": warmup,
        "sample_every_s": args.sample_every,
        "flap": {"backend": FLAPPING, "every_s": args.flap_every, "down_s": args.flap_down},
        "seed": args.seed,
        "tracemalloc": args.tracemalloc,
        "deployment": args.deployment,
        "machine": machine_info(),
        "loadavg_start": os.getloadavg(),
        "workdir": str(workdir) if args.keep else None,
    }
    print(
        f"== soak: {args.rate:g} req/s for {args.minutes:g} min (warm-up {warmup:g}s), sample"
        f" every {args.sample_every:g}s, {FLAPPING} down {args.flap_down:g}s every"
        f" {args.flap_every:g}s; work dir {workdir}; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    samples: list[dict[str, Any]] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            node = NatsNode("soak-n1", workdir / "nats")
            await node.start()
            stack.push_async_callback(node.stop)
            mock_urls: dict[str, str] = {}
            mock_pids: dict[str, int] = {}
            for index, backend in enumerate(BACKENDS):
                url, pid = await stack.enter_async_context(
                    mock_process(
                        ttft=0.05,
                        output_tokens=16,
                        tokens_per_second=100.0,
                        failure_rate=backend.failure_rate,
                        concurrency=backend.slots,
                        seed=args.seed + index,
                    )
                )
                mock_urls[backend.name], mock_pids[backend.name] = url, pid
            config_file = workdir / "renqueue.toml"
            config_file.write_text(config_text(node.url, mock_urls))
            report["config_toml"] = config_file.read_text()
            config = load_config(config_file, environ={})
            nc = await connect(node.url, name="soak-harness", config=config.nats)
            stack.push_async_callback(nc.close)
            await until_jetstream_answers(nc)
            await provision_with_retries(nc, config)
            js = nc.jetstream()

            snaps = workdir / "tracemalloc"
            launcher = None
            env = None
            if args.tracemalloc:
                snaps.mkdir()
                launcher = [sys.executable, str(Path(__file__).with_name("_traced.py"))]
                env = {"SOAK_TRACEMALLOC_DIR": str(snaps)}
            fleet: Fleet | UpFleet
            if args.deployment == "up":
                fleet = UpFleet(config_file, node.url, workdir / "logs", launcher=launcher, env=env)
            else:
                fleet = Fleet(
                    config_file,
                    node.url,
                    workdir / "logs",
                    backends=BACKENDS,
                    launcher=launcher,
                    env=env,
                )
            stack.push_async_callback(fleet.stop)
            await fleet.start()

            seen_terminal: Counter[str] = Counter()

            async def on_event(msg: Any) -> None:
                parts = msg.subject.split(".")
                if len(parts) == 5 and parts[4] in TERMINAL_KINDS:
                    seen_terminal[parts[3]] += 1

            await nc.subscribe(f"rq.evt.{TENANT}.*.*", cb=on_event)

            client_nc = await connect(node.url, name="soak-client", config=config.nats)
            stack.push_async_callback(client_nc.close)
            client = Client(client_nc, tenant=TENANT)
            load = Load(client, args.rate, rng, f"s{stamp[-7:-1]}")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            wall0 = time.time()
            stop = asyncio.Event()
            flapper = asyncio.create_task(
                flapping(mock_urls[FLAPPING], args.flap_every, args.flap_down, stop)
            )
            driver = asyncio.create_task(load.run(t0 + duration))
            print(f"   up: {len(fleet.slots)} services; load running", flush=True)

            baseline_at = t0 + warmup
            baseline_taken = False
            next_sample = t0
            pids = processes(fleet, node, mock_pids)
            while not driver.done():
                now = loop.time()
                if now >= next_sample:
                    pids = processes(fleet, node, mock_pids)
                    sample = {
                        "t": round(now - t0, 1),
                        "submitted": len(load.sent),
                        "acked": load.counts["acked"],
                        "ended": len(seen_terminal),
                        "in_flight": len(load.tasks),
                        "loadavg": os.getloadavg()[0],
                        "procs": {name: proc_sample(pid) for name, pid in pids.items()},
                    }
                    with contextlib.suppress(Exception):
                        sample["streams"] = await streams_now(nc)
                    samples.append(sample)
                    rates = f"{len(load.sent) / max(1e-9, now - t0):.1f}"
                    if len(samples) >= 2:
                        before = samples[-2]
                        sample["ended_per_s"] = round(
                            (sample["ended"] - before["ended"])
                            / max(1e-9, sample["t"] - before["t"]),
                            1,
                        )
                    rss = sum(
                        p["rss_mb"]
                        for n, p in sample["procs"].items()
                        if p and n.startswith(("router", "worker", "renqueue-up"))
                    )
                    print(
                        f"   t={sample['t']:>6.0f}s submitted {sample['submitted']} ({rates}/s)"
                        f" ended {sample['ended']} ({sample.get('ended_per_s', '-')}/s lately)"
                        f" in flight {sample['in_flight']} services RSS"
                        f" {rss:.0f} MB load {sample['loadavg']:.2f}",
                        flush=True,
                    )
                    if args.tracemalloc and not baseline_taken and now >= baseline_at:
                        snapshot_all(pids)
                    baseline_taken = baseline_taken or now >= baseline_at
                    next_sample += args.sample_every
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.shield(driver), max(0.1, next_sample - loop.time())
                    )
            await driver
            arrivals = loop.time() - t0
            # The last sample, at the end of the arrivals (before the tail drains).
            pids = processes(fleet, node, mock_pids)
            final = {
                "t": round(arrivals, 1),
                "submitted": len(load.sent),
                "acked": load.counts["acked"],
                "ended": len(seen_terminal),
                "in_flight": len(load.tasks),
                "loadavg": os.getloadavg()[0],
                "procs": {name: proc_sample(pid) for name, pid in pids.items()},
            }
            with contextlib.suppress(Exception):
                final["streams"] = await streams_now(nc)
            samples.append(final)
            if args.tracemalloc:
                snapshot_all(pids)
            stop.set()
            flaps = await flapper
            print(f"   arrivals done in {arrivals:.0f}s; waiting for the tail", flush=True)

            # The tail: every acked request ends, every handle resolves.
            tail_deadline = loop.time() + args.tail
            while loop.time() < tail_deadline:
                waiting = [
                    rid for rid, s in load.sent.items() if s.acked and rid not in seen_terminal
                ]
                if not waiting and not load.tasks:
                    break
                await asyncio.sleep(1.0)
            tail = loop.time() - t0 - arrivals
            unresolved_tasks = len(load.tasks)
            for task in list(load.tasks):
                task.cancel()
            await asyncio.gather(*load.tasks, return_exceptions=True)
            await client.close()

            acked = [rid for rid, s in load.sent.items() if s.acked]
            missing = [rid for rid in acked if rid not in seen_terminal]
            unended = [rid for rid in missing if await terminals_stored(js, rid) == 0]
            queued = await still_queued(js) if unended else set()
            lost = [rid for rid in unended if rid not in queued]
            twice = [rid for rid, n in seen_terminal.items() if n > 1]
            duplicated = [rid for rid in twice if await terminals_stored(js, rid) > 1]
            stats = {name: await mock_stats(url) for name, url in mock_urls.items()}
            end_streams: dict[str, Any] = {}
            with contextlib.suppress(Exception):
                end_streams = await streams_now(nc)
            tracemalloc_report = (
                tracemalloc_growth(snaps, pids, args.top) if args.tracemalloc else {}
            )
            report.update(
                {
                    "arrival_seconds": round(arrivals, 1),
                    "tail_seconds": round(tail, 1),
                    "planned": int(duration * args.rate),
                    "submitted": len(load.sent),
                    "acked": len(acked),
                    "achieved_rate": round(len(load.sent) / arrivals, 2),
                    "ended_during_arrivals_per_s": round(final["ended"] / arrivals, 2),
                    "backlog_at_end_of_arrivals": final["acked"] - final["ended"],
                    "behind_max_s": round(load.behind_max, 2),
                    "counts": dict(load.counts),
                    "submit_errors": dict(load.submit_errors),
                    "outcomes": dict(
                        Counter(s.outcome or "unresolved" for s in load.sent.values())
                    ),
                    "not_ended_still_queued": len(unended) - len(lost),
                    "lost": len(lost),
                    "lost_examples": lost[:5],
                    "duplicated": len(duplicated),
                    "duplicated_examples": duplicated[:5],
                    "unresolved_handles": unresolved_tasks,
                    "service_restarts": len(fleet.self_exits),
                    "self_exits": fleet.self_exits[:5],
                    "flaps": [round(t - wall0, 1) for t in flaps],
                    "backend_stats": {
                        name: {k: s[k] for k in ("requests", "completed", "failed", "busy")}
                        for name, s in stats.items()
                    },
                    "streams_end": end_streams,
                    "tracemalloc_growth": tracemalloc_report,
                    "loadavg_end": os.getloadavg(),
                }
            )
            report["summary"] = summarise(samples, baseline_at - t0, len(acked), args.rate)
    finally:
        report["samples"] = samples
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    write_json(report, args.out, f"soak-{stamp}.json", "soak-latest.json")
    return report


def write_json(report: dict[str, Any], out: Path, *names: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=str) + "\n"
    for name in names:
        (out / name).write_text(text)


def summarise(
    samples: list[dict[str, Any]], warmup: float, acked: int, rate: float
) -> dict[str, Any]:
    """Per process: RSS and fds at the baseline (the first sample after the warm-up) and
    at the end, growth and slope; per stream: size at the baseline and the end, bytes
    per request, and the size its retention would hold at this rate."""
    after = [s for s in samples if s["t"] >= warmup] or samples[-1:]
    base, end = after[0], samples[-1]
    procs: dict[str, Any] = {}
    for name in end["procs"]:
        b, e = base["procs"].get(name), end["procs"].get(name)
        if not b or not e:
            procs[name] = {"note": "restarted or gone"}
            continue
        points = [
            (s["t"], s["procs"][name]["rss_mb"]) for s in after if s["procs"].get(name) is not None
        ]
        procs[name] = {
            "rss_start_mb": round(b["rss_mb"], 1),
            "rss_end_mb": round(e["rss_mb"], 1),
            "rss_max_mb": round(max(p[1] for p in points), 1),
            "growth_pct": round(100 * (e["rss_mb"] - b["rss_mb"]) / b["rss_mb"], 1),
            "slope_mb_per_hour": round(slope_mb_per_hour(points), 2),
            "fds_start": b["fds"],
            "fds_end": e["fds"],
            "fds_max": max(s["procs"][name]["fds"] for s in after if s["procs"].get(name)),
            "cpu_s": round(e["cpu_s"] - b["cpu_s"], 1),
        }
    streams: dict[str, Any] = {}
    requests_between = max(1, end["acked"] - base["acked"])
    for name, e in (end.get("streams") or {}).items():
        b = (base.get("streams") or {}).get(name, {"bytes": 0, "messages": 0, "subjects": 0})
        per_request = (e["bytes"] - b["bytes"]) / requests_between
        held = per_request * rate * e["max_age_s"] if e["max_age_s"] and per_request > 0 else None
        streams[name] = {
            "messages_start": b["messages"],
            "messages_end": e["messages"],
            "bytes_start": b["bytes"],
            "bytes_end": e["bytes"],
            "keys_start": b.get("subjects", 0),
            "keys_end": e["subjects"],
            "bytes_per_request": round(per_request, 1),
            "retention": e["retention"],
            "max_age_s": e["max_age_s"],
            "max_bytes": e["max_bytes"],
            "max_msgs": e["max_msgs"],
            "max_msgs_per_subject": e["max_msgs_per_subject"],
            "at_this_rate_over_max_age_bytes": None if held is None else round(held),
        }
    return {"baseline_t": base["t"], "end_t": end["t"], "processes": procs, "streams": streams}


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def print_report(report: dict[str, Any]) -> None:
    if "summary" not in report:
        print("soak: did not complete (see above)")
        return
    s = report["summary"]
    print(
        f"\nsoak ({report['deployment']}): {report['minutes']:g} min at {report['rate']:g} req/s"
        " planned; achieved"
        f" {report['achieved_rate']} req/s ({report['submitted']} submitted, {report['acked']}"
        f" acked, most behind schedule {report['behind_max_s']}s); load average"
        f" {report['loadavg_start'][0]:.2f} at the start, {report['loadavg_end'][0]:.2f} at"
        " the end"
    )
    print(
        f"  ended while arriving {report['ended_during_arrivals_per_s']} req/s; backlog at the"
        f" end of the arrivals {report['backlog_at_end_of_arrivals']}; not ended after the tail"
        f" but still queued {report['not_ended_still_queued']}"
    )
    print(
        f"  LOST {report['lost']}  DUPLICATED {report['duplicated']}  unresolved handles"
        f" {report['unresolved_handles']}  service restarts {report['service_restarts']}"
        f"  tail {report['tail_seconds']}s"
    )
    print(f"  outcomes: {report['outcomes']}")
    print(f"  counts: {report['counts']}; submit errors {report['submit_errors']}")
    print(f"  {FLAPPING} taken down at {report['flaps']} s; backends {report['backend_stats']}")
    print(
        f"  RSS from the baseline (t={s['baseline_t']:.0f}s, after the warm-up) to the end"
        f" (t={s['end_t']:.0f}s):"
    )
    print(
        f"    {'process':<20} {'start MB':>9} {'end MB':>8} {'max MB':>8} {'growth':>8}"
        f" {'MB/hour':>8} {'fds':>11} {'cpu s':>7}"
    )
    for name, p in s["processes"].items():
        if "note" in p:
            print(f"    {name:<20} {p['note']}")
            continue
        print(
            f"    {name:<20} {p['rss_start_mb']:>9.1f} {p['rss_end_mb']:>8.1f}"
            f" {p['rss_max_mb']:>8.1f} {p['growth_pct']:>7.1f}% {p['slope_mb_per_hour']:>8.2f}"
            f" {p['fds_start']:>5}->{p['fds_end']:<5} {p['cpu_s']:>7.1f}"
        )
    print("  streams (baseline -> end; bytes per request; what the retention holds at this rate):")
    for name, st in s["streams"].items():
        limit = "no byte limit" if st["max_bytes"] in (-1, 0, None) else _bytes(st["max_bytes"])
        age = f"{st['max_age_s'] / 86400:g} d" if st["max_age_s"] else "no age limit"
        keys = f", keys {st['keys_start']} -> {st['keys_end']}" if name.startswith("KV_") else ""
        held = st["at_this_rate_over_max_age_bytes"]
        print(
            f"    {name:<22} {st['retention']:<9} msgs {st['messages_start']} -> "
            f"{st['messages_end']}, {_bytes(st['bytes_start'])} -> {_bytes(st['bytes_end'])}"
            f" ({st['bytes_per_request']:g} B/request){keys}; {age}, {limit}"
            + (f"; over max_age at this rate: {_bytes(held)}" if held else "")
        )
    for name, lines in report.get("tracemalloc_growth", {}).items():
        print(f"  tracemalloc {name}:")
        for line in lines:
            print(f"      {line}")


async def stoppable(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run`, cancelled (its clean-up run: no service or server left behind) on
    SIGTERM or SIGINT, even where the shell started it with SIGINT ignored."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, task.cancel)
    return await run(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=60.0, help="arrival time (60)")
    parser.add_argument("--rate", type=float, default=50.0, help="requests a second (50)")
    parser.add_argument(
        "--warmup", type=float, help="seconds before the baseline (a tenth, 60-300 s)"
    )
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds (30)")
    parser.add_argument("--flap-every", type=float, default=180.0, help="seconds (180)")
    parser.add_argument("--flap-down", type=float, default=30.0, help="seconds (30)")
    parser.add_argument("--tail", type=float, default=300.0, help="bound on the tail (300 s)")
    parser.add_argument("--tracemalloc", action="store_true", help="trace the services")
    parser.add_argument(
        "--deployment",
        choices=["processes", "up"],
        default="processes",
        help="routers and workers as separate processes (chaos.py's Fleet), or one"
        " `renqueue up` joined to the server",
    )
    parser.add_argument("--top", type=int, default=8, help="tracemalloc lines per process")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, store)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    configure_logging(level="ERROR")
    try:
        report = asyncio.run(stoppable(args))
    except asyncio.CancelledError:
        print("soak: stopped by a signal (the JSON holds the samples taken)")
        sys.exit(1)
    except Exception:  # noqa: BLE001 - printed; the exit status says it
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        sys.exit(1)
    print_report(report)
    path = args.out / "soak-latest.json"
    print(f"JSON: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    ok = report["lost"] == 0 and report["duplicated"] == 0 and report["service_restarts"] == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
