"""The binder's ceiling (issue #31 item 4): binds a second of one elected binder.

Run with ``make bench-binder`` or ``python bench/binder.py --requests 20000``.

What runs, on one embedded nats-server (own temporary store):

1. The baseline, in the same run: raw JetStream ``publish_async`` (windows of 256,
   128-byte messages, acks awaited per window) into a scratch stream, nats-py's own
   context: the broker's publish rate on this machine at this moment.
2. ``--requests`` requests published to the level subjects before the binder starts
   (spread over the five levels, one route over ``--backends`` backends of ``--slots``
   slots each), so the binder always has enough to bind.
3. Instant backends with many workers: one drain per backend in this process, which
   fetches the backend's dispatches in batches, acks each at once and announces the
   freed slot on ``rq.capacity.<backend>``, as a worker does when a call ends. No HTTP:
   a real worker costs ~3 ms of Python per request, so on two cores workers would be
   the ceiling measured, not the binder.
4. The binder: one ``renqueue router`` process (the production shape: it also runs the
   projector), started once the requests wait. ``--groups N`` splits binding in N
   groups (N routes, each over its own share of the backends: docs/scaling.md) and
   ``--routers R`` runs R router processes, which share the groups' leases; requests
   go to their route's subject (``--old-subject``: to today's, each forwarded first).
   ``--binder-pythonpath`` runs it from another checkout's package (to measure a
   version before and after a change in the same conditions).

The rate is read in the steady part: from the 10th to the 90th percentile of the
dispatches drained (the lease, the consumers made again and the first fetches are
left out). Also: the binder process's CPU per bind, and the ratio binds / raw publishes.
Each bind stores 3 messages (``submitted``, the dispatch, ``routed``) and acks one;
the ratio says how close to the broker the binder runs.

JSON: ``bench/results/binder-<timestamp>.json`` and ``binder-latest.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT, machine_info
from nats.js.api import StorageType, StreamConfig

from renqueue.broker import EmbeddedServer, connect, provision
from renqueue.config import parse_config
from renqueue.coordination import read_lease
from renqueue.schema import (
    DISPATCH_STREAM,
    EVENTS_STREAM,
    REQUESTS_STREAM,
    ChatMessage,
    InferenceRequest,
    binder_lease,
    capacity_subject,
    encode,
    msg_id,
    request_subject,
    worker_consumer,
)

TENANT = "bench"
ROUTE = "chat"
LEVELS = ("critical", "high", "normal", "low", "batch")
PAYLOAD = b"x" * 128


def proc_cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def routes_of(groups: int) -> list[str]:
    """The routes: one per binding group (``chat`` alone when not split)."""
    return [ROUTE] if groups <= 1 else [f"{ROUTE}{g}" for g in range(groups)]


def config_text(url: str, backends: int, slots: int, groups: int = 1) -> str:
    lines = ["# Written by bench/binder.py.", "[nats]", f'url = "{url}"', ""]
    if groups > 1:
        lines += ["[router]", "split_binding = true", ""]
    names = [f"b{n}" for n in range(backends)]
    for name in names:
        lines += [
            f"[backends.{name}]",
            'base_url = "http://127.0.0.1:9"',  # never called: the drains stand in
            'model = "m"',
            f"[backends.{name}.limits]",
            f"concurrency = {slots}",
            "",
        ]
    routes = routes_of(groups)
    for index, route in enumerate(routes):
        # Route g takes every groups-th backend: the routes share none (a group each).
        mine = names[index :: len(routes)]
        lines += [f"[routes.{route}]", "backends = [" + ", ".join(f'"{n}"' for n in mine) + "]"]
    return "\n".join(lines) + "\n"


async def raw_publish_rate(nc: Any, seconds: float) -> float:
    """publish_async in windows of 256 (acks awaited per window): messages a second."""
    js = nc.client.jetstream()
    await js.add_stream(
        StreamConfig(name="BENCH", subjects=["bench.>"], storage=StorageType.FILE, num_replicas=1)
    )
    window, published = 256, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        futures = [await js.publish_async("bench.a", PAYLOAD) for _ in range(window)]
        await asyncio.gather(*futures)
        published += window
    rate = published / (time.perf_counter() - start)
    await js.delete_stream("BENCH")
    return rate


async def preload(nc: Any, count: int, routes: list[str], *, route_subjects: bool) -> None:
    """``count`` requests waiting at the five levels, published as a client does,
    round-robin over ``routes`` (to each route's subject with ``route_subjects``)."""
    js = nc.client.jetstream()
    window = 512
    for first in range(0, count, window):
        futures = []
        for n in range(first, min(count, first + window)):
            level = LEVELS[n % len(LEVELS)]
            route = routes[n % len(routes)]
            request = InferenceRequest(
                id=f"q{n}",
                tenant=TENANT,
                route=route,
                priority=level,
                messages=[ChatMessage(role="user", content="hi")],
            )
            futures.append(
                await js.publish_async(
                    request_subject(level, TENANT, route=route if route_subjects else None),
                    encode(request),
                    headers={"Nats-Msg-Id": msg_id(TENANT, request.id)},
                )
            )
        await asyncio.gather(*futures)


class Drains:
    """Instant backends: each dispatch acked at once and its slot announced freed."""

    def __init__(self, nc: Any, backends: list[str], batch: int) -> None:
        self._nc = nc
        self._backends = backends
        self._batch = batch
        #: (monotonic time, dispatches drained so far), one per fetched batch.
        self.marks: list[tuple[float, int]] = []
        self.drained = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        js = self._nc.client.jetstream()
        for name in self._backends:
            psub = await js.pull_subscribe_bind(
                durable=worker_consumer(name), stream=DISPATCH_STREAM
            )
            self._tasks.append(asyncio.create_task(self._drain(name, psub)))

    async def _drain(self, name: str, psub: Any) -> None:
        nc = self._nc.client
        while True:
            try:
                msgs = await psub.fetch(batch=self._batch, timeout=1.0)
            except TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
                await nc.publish(capacity_subject(name), b"")
            self.drained += len(msgs)
            self.marks.append((time.monotonic(), self.drained))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def steady_rate(marks: list[tuple[float, int]], total: int) -> tuple[float, float]:
    """Binds a second between 10 % and 90 % of ``total`` drained, and that window's seconds."""
    low = [(t, n) for t, n in marks if n >= total * 0.1]
    high = [(t, n) for t, n in marks if n >= total * 0.9]
    if not low or not high or high[0][0] <= low[0][0]:
        return 0.0, 0.0
    seconds = high[0][0] - low[0][0]
    return (high[0][1] - low[0][1]) / seconds, seconds


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [f"b{n}" for n in range(args.backends)]
    with tempfile.TemporaryDirectory(prefix="renqueue-bench-binder-") as tmp:
        async with EmbeddedServer(Path(tmp) / "nats", port=-1) as server:
            nc = await connect(server.url, name="bench-binder")
            binders: list[asyncio.subprocess.Process] = []
            routes = routes_of(args.groups)
            route_subjects = args.groups > 1 and not args.old_subject
            drains = Drains(nc, names, batch=args.drain_batch)
            try:
                raw = await raw_publish_rate(nc, args.baseline_seconds)
                print(f"   raw publish_async (windows of 256): {raw:,.0f} msgs/s", flush=True)
                path = Path(tmp) / "renqueue.toml"
                path.write_text(config_text(server.url, args.backends, args.slots, args.groups))
                config = parse_config(tomllib.loads(path.read_text()), source=str(path))
                await provision(nc, config)
                if args.takeover:
                    await preload(nc, args.requests, routes, route_subjects=route_subjects)
                    print(f"   {args.requests} requests waiting; starting the binder", flush=True)
                await drains.start()
                env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
                env["PYTHONPATH"] = args.binder_pythonpath or str(ROOT)
                log_path = Path(tmp) / "binder.log"
                log = log_path.open("w")
                started = time.monotonic()
                profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
                for _ in range(args.routers):
                    binders.append(
                        await asyncio.create_subprocess_exec(
                            sys.executable,
                            *profile,
                            "-m",
                            "renqueue",
                            "-c",
                            str(path),
                            "router",
                            stdin=asyncio.subprocess.DEVNULL,
                            stdout=log,
                            stderr=log,
                            env=env,
                        )
                    )
                if not args.takeover:
                    # Steady state: requests published once every group's term has
                    # begun and the terms are spread (those stored before may have
                    # been bound by an earlier binder: each costs a log lookup,
                    # measured with --takeover).
                    await until_spread(nc, args, binders, started, log_path)
                    print(f"   binders bound; publishing {args.requests} requests", flush=True)
                    started = time.monotonic()
                    await preload(nc, args.requests, routes, route_subjects=route_subjects)
                cpu_before = sum(proc_cpu_seconds(b.pid) for b in binders)
                deadline = started + args.timeout
                while drains.drained < args.requests and time.monotonic() < deadline:
                    if any(b.returncode is not None for b in binders):
                        raise RuntimeError("a binder exited: see its log")
                    await asyncio.sleep(0.2)
                ended = time.monotonic()
                cpu = sum(proc_cpu_seconds(b.pid) for b in binders) - cpu_before
                drained = drains.drained
                info = await nc.client.jetstream().stream_info(EVENTS_STREAM)
                left = (await nc.client.jetstream().stream_info(REQUESTS_STREAM)).state.messages
            finally:
                await drains.stop()
                with contextlib.suppress(OSError):
                    (args.out / "binder-last.log").write_bytes(
                        (Path(tmp) / "binder.log").read_bytes()
                    )
                for binder in binders:
                    if binder.returncode is None:
                        binder.terminate()
                for binder in binders:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(binder.wait(), 10)
                    if binder.returncode is None:
                        binder.kill()
                await nc.close()
    if drained < args.requests:
        print(f"   only {drained} of {args.requests} bound within {args.timeout:g} s")
    rate, window = steady_rate(drains.marks, drained)
    return {
        "requests": args.requests,
        "bound": drained,
        "left_waiting": left,
        "backends": args.backends,
        "slots_per_backend": args.slots,
        "binds_per_s": round(rate, 1),
        "steady_window_s": round(window, 2),
        "all_in_s": round(ended - started, 2),
        "raw_publish_async_per_s": round(raw, 1),
        "ratio_binds_to_raw_publishes": round(rate / raw, 4) if raw else None,
        "binder_cpu_s": round(cpu, 2),
        "binder_cpu_ms_per_bind": round(1000 * cpu / drained, 3) if drained else None,
        "events_stored": info.state.messages,
        "binder_pythonpath": args.binder_pythonpath or str(ROOT),
        "mode": "takeover" if args.takeover else "steady",
        "groups": args.groups,
        "routers": args.routers,
        "subjects": "route"
        if route_subjects
        else "level (forwarded)"
        if args.groups > 1
        else "level",
    }


async def until_spread(
    nc: Any, args: argparse.Namespace, binders: list[Any], started: float, log_path: Path
) -> None:
    """Until every group's lease is held, by at most ceil(groups / routers) terms a router."""
    js = nc.jetstream()
    groups = routes_of(args.groups) if args.groups > 1 else [None]
    most = -(-len(groups) // args.routers)
    while True:
        holders = [await read_lease(js, binder_lease(group)) for group in groups]
        names = [h.holder for h in holders if h is not None]
        if len(names) == len(groups) and all(names.count(n) <= most for n in names):
            text = await asyncio.to_thread(log_path.read_text)
            if text.count("router is binding") >= len(groups):
                return
        if any(b.returncode is not None for b in binders) or time.monotonic() > started + 60:
            text = await asyncio.to_thread(log_path.read_text)
            raise RuntimeError(f"the binders did not bind: {text[-3000:]}")
        await asyncio.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--backends", type=int, default=8)
    parser.add_argument("--slots", type=int, default=128, help="slots per backend")
    parser.add_argument("--drain-batch", type=int, default=100)
    parser.add_argument("--baseline-seconds", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--binder-pythonpath", default=None, help="run the binder from this package root"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--takeover",
        action="store_true",
        help="publish every request before the binder starts (a take-over with a backlog)",
    )
    parser.add_argument(
        "--profile", default=None, help="run the binder under cProfile, writing this file"
    )
    parser.add_argument(
        "--groups", type=int, default=1, help="binding groups (routes sharing no backend)"
    )
    parser.add_argument("--routers", type=int, default=1, help="router processes")
    parser.add_argument(
        "--old-subject",
        action="store_true",
        help="with --groups: publish to rq.req.<level>.<tenant> (each request forwarded)",
    )
    args = parser.parse_args()
    if args.backends < args.groups:
        parser.error("--backends must be at least --groups (a group has its own backends)")
    print(
        f"== binder ceiling: {args.requests} requests, {args.backends} backends x "
        f"{args.slots} slots, {args.groups} group(s), {args.routers} router(s), instant drains,"
        f" {'take-over' if args.takeover else 'steady'};"
        f" load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    result = asyncio.run(run(args))
    result["machine"] = machine_info(load_average=os.getloadavg()[0])
    print(
        f"   binds/s {result['binds_per_s']:,.0f} (steady window {result['steady_window_s']} s,"
        f" all {result['bound']} in {result['all_in_s']} s); raw publish_async"
        f" {result['raw_publish_async_per_s']:,.0f}/s; ratio"
        f" {result['ratio_binds_to_raw_publishes']}; binder CPU"
        f" {result['binder_cpu_ms_per_bind']} ms/bind",
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    for name in (f"binder-{stamp}.json", "binder-latest.json"):
        (args.out / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
