"""What the benchmarks share: results folder, percentiles, machine info, the mock in a
process of its own (and its counters, its settings), free loopback ports, the event log
read back."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import platform
import socket
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from renqueue.ops import find_nats_server
from renqueue.wire import EVENT_DECODER, EVENTS_STREAM, AckPolicy, ConsumerConfig, DeliverPolicy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def percentile(values: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile (1..99) of ``values``; NaN for no values.

    ``statistics.quantiles(method="inclusive")``: linear interpolation between
    the two closest ranks, the minimum counting as the 0th percentile and the
    maximum as the 100th (numpy's default, "type 7"). So p50 is the median and
    a percentile never lies outside the values seen. (The hand-written version
    this replaces took the closest of those two ranks instead of interpolating.)
    """
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])  # quantiles() wants two points
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def nats_server_version() -> str:
    try:
        out = subprocess.run(
            [str(find_nats_server()), "--version"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def machine_info(**extra: Any) -> dict[str, Any]:
    """CPU, Python, nats-server, nats-py and git commit, plus ``extra``."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_server": nats_server_version(),
        "nats_py": package_version("nats-py"),
        **extra,
        "git_commit": git_commit(),
    }


@contextlib.asynccontextmanager
async def mock_process(
    *,
    ttft: float,
    output_tokens: int,
    tokens_per_second: float = 0.0,
    failure_rate: float = 0.0,
    concurrency: int = 0,
    seed: int | None = None,
) -> AsyncIterator[tuple[str, int]]:
    """`renqueue mock-backend` in a process of its own (an external server, as a real
    backend is): its base URL and pid. ``failure_rate``, ``concurrency`` and ``seed``
    are the mock's options of the same names (0 / None: off)."""
    extra = [f"--failure-rate={failure_rate}", f"--concurrency={concurrency}"]
    if seed is not None:
        extra.append(f"--seed={seed}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "renqueue",
        "--log-level",
        "WARNING",
        "mock-backend",
        "--port",
        "0",
        "--ttft",
        str(ttft),
        "--tps",
        str(tokens_per_second),
        "--output-tokens",
        str(output_tokens),
        *extra,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode().strip()
        url = line.rsplit(" ", 1)[-1]
        if not url.startswith("http"):
            raise RuntimeError(f"mock backend did not start: {line!r}")
        yield url, proc.pid
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def mock_stats(url: str) -> dict[str, Any]:
    """The counters of a mock started by :func:`mock_process` (``GET /stats``; ``url`` is
    its base URL, ending in ``/v1``)."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        response = await http.get(url.removesuffix("/v1") + "/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
    return stats


async def mock_settings(url: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Change settings of a mock started by :func:`mock_process` (``POST /admin/settings``:
    the fields given, validated by the mock); the settings it now has."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        response = await http.post(url.removesuffix("/v1") + "/admin/settings", json=settings)
        response.raise_for_status()
        now: dict[str, Any] = response.json()
    return now


async def read_stream(js: Any, stream: str, subject: str) -> list[bytes]:
    """Every message of ``stream`` on ``subject``, in order (one ephemeral pull consumer,
    no acks)."""
    return [data for data, _stored in await read_stream_stamped(js, stream, subject)]


async def read_stream_stamped(js: Any, stream: str, subject: str) -> list[tuple[bytes, float]]:
    """As :func:`read_stream`, each message with the server's time of storing it."""
    info = await js.stream_info(stream)
    if not info.state.messages:
        return []
    last = int(info.state.last_seq)
    psub = await js.pull_subscribe(
        subject,
        stream=stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    out: list[tuple[bytes, float]] = []
    try:
        while True:
            try:
                msgs = await psub.fetch(batch=1000, timeout=2.0)
            except TimeoutError:  # NatsTimeoutError is one
                break
            done = False
            for msg in msgs:
                out.append((msg.data, msg.metadata.timestamp.timestamp()))
                meta = msg.metadata
                if meta.num_pending == 0 or meta.sequence.stream >= last:
                    done = True
            if done:
                break
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
    return out


async def read_events(js: Any, subject: str) -> list[Any]:
    """Every event on ``subject`` (a filter such as ``rq.evt.bench.>``) in the log, in
    order; messages that do not decode are skipped."""
    events: list[Any] = []
    for data in await read_stream(js, EVENTS_STREAM, subject):
        with contextlib.suppress(msgspec.DecodeError):
            events.append(EVENT_DECODER.decode(data))
    return events


def free_port() -> int:
    """A TCP port free on loopback right now (for servers that must know theirs in advance,
    such as the routes of a NATS cluster; another process may take it meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
