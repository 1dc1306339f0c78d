"""What the benchmarks share: results folder, percentiles, machine info, the mock in a
process of its own (and its counters, its settings; a set of them), free loopback ports,
the event log read back, and the LiteLLM side's venv and subprocess
(``bench/_litellm_phase.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from renqueue.broker import AckPolicy, ConsumerConfig, DeliverPolicy, find_nats_server
from renqueue.schema import EVENT_DECODER, EVENTS_STREAM, facts

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
#: LiteLLM, pinned: the version the LiteLLM sides of the benchmarks were written and
#: measured against. It lives only in its own venv (``LITELLM_DIR / "venv"``).
LITELLM_SPEC = "litellm==1.110.2"
LITELLM_DIR = ROOT / ".renqueue" / "bench-litellm"
LITELLM_PHASE = Path(__file__).resolve().parent / "_litellm_phase.py"


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


@contextlib.asynccontextmanager
async def mock_fleet(settings: Mapping[str, dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    """One fresh mock process per name (fresh buckets and fault draws, counters at 0), each
    given its settings (:func:`mock_settings`): name -> base URL."""
    async with contextlib.AsyncExitStack() as stack:
        urls: dict[str, str] = {}
        for name, each in settings.items():
            url, _pid = await stack.enter_async_context(
                mock_process(
                    ttft=float(each.get("ttft", 0.0)),
                    output_tokens=int(each.get("output_tokens", 16)),
                )
            )
            urls[name] = url
        for name, each in settings.items():
            await mock_settings(urls[name], each)
        yield urls


async def all_mock_stats(urls: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each mock's counters (:func:`mock_stats`, without the last request's body): name ->
    counters."""
    out = {}
    for name, url in urls.items():
        stats = await mock_stats(url)
        stats.pop("last_request", None)
        out[name] = stats
    return out


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
    order, a stored event that stands for two (a ``submitted`` carrying its request's
    binding) read as that pair (``schema.facts``); messages that do not decode are
    skipped."""
    events: list[Any] = []
    for data in await read_stream(js, EVENTS_STREAM, subject):
        with contextlib.suppress(msgspec.DecodeError):
            events.extend(facts(EVENT_DECODER.decode(data)))
    return events


#: The parts of a ``routed`` reason that say what was chosen, not why another was passed
#: over (the first candidate router's ``bound to X``; the cheapest-in-time planner's head).
_CHOICE_PARTS = (
    "first candidate",
    "bound to",
    "cheapest in time",
    "no candidate predicted",
    "fell back",
)
_WINDOW = re.compile(r"\b(?:requests|tokens)/\S+")


def reason_notes(reason: str) -> list[tuple[str, str]]:
    """What a ``routed`` event's reason says of the candidates passed over, as (backend,
    kind): a window (``requests/6s``, ``tokens/min``, ``requests/day``), ``rate limited``,
    ``slots full``, ``predicted late`` or the note's first words. Reads both the first
    candidate router's reasons (``free-a quota:requests/6s 30/30, resets in 1 s; bound to
    paid``) and the cheapest-in-time planner's (``cheapest in time: paid ...; free-a
    requests/6s 30/30, resets in 1 s past the deadline; local predicted 9.1 s``)."""
    notes = []
    for raw in reason.split(";"):
        part = raw.strip()
        if not part or part.startswith(_CHOICE_PARTS) or " is the soonest" in part:
            continue
        backend, _, why = part.partition(" ")
        window = _WINDOW.search(why)
        if window:
            kind = window.group(0).rstrip(",")
        elif "rate limited" in why:
            kind = "rate limited"
        elif "predicted" in why:
            kind = "predicted late"
        elif "every slot taken" in why:
            kind = "slots full"
        else:
            kind = " ".join(why.split()[:3])
        notes.append((backend, kind))
    return notes


def free_port() -> int:
    """A TCP port free on loopback right now (for servers that must know theirs in advance,
    such as the routes of a NATS cluster; another process may take it meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --------------------------------------------------------------------- LiteLLM


def litellm_python(fresh: bool) -> tuple[Path | None, str]:
    """The Python of the benchmarks' LiteLLM venv, made (and ``LITELLM_SPEC`` installed)
    if missing; ``(None, why)`` if that fails."""
    venv = LITELLM_DIR / "venv"
    python = venv / "bin" / "python"
    stamp = venv / ".bench-installed"
    if not fresh and python.exists() and stamp.exists() and stamp.read_text() == LITELLM_SPEC:
        return python, f"{LITELLM_SPEC} (cached venv)"
    shown = venv.relative_to(ROOT) if venv.is_relative_to(ROOT) else venv
    print(f"  making {shown} with {LITELLM_SPEC} ...", flush=True)
    steps = (
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            LITELLM_SPEC,
        ],
    )
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{' '.join(step[:4])}: {type(exc).__name__}: {exc}"[:500]
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            tail = " | ".join([ln for ln in lines if not ln.startswith("WARNING")][-4:])
            return None, f"{' '.join(step[:4])} exited {done.returncode}: {tail}"[:800]
    stamp.write_text(LITELLM_SPEC)
    return python, f"{LITELLM_SPEC} (installed now)"


def litellm_env() -> dict[str, str]:
    """A minimal environment: no provider keys or proxies reach LiteLLM; its model price
    map is its packaged copy (no fetch from the network)."""
    home = LITELLM_DIR / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "PYTHONWARNINGS": "ignore",
    }


@dataclass
class PhaseRun:
    """What a run of ``bench/_litellm_phase.py`` gave: its report, or why there is none;
    and what ``on_start`` returned."""

    report: dict[str, Any] | None
    error: str = ""
    started: Any = None


async def run_litellm_phase(
    python: Path,
    payload: dict[str, Any],
    *,
    limit: float,
    on_start: Callable[[float], Coroutine[Any, Any, Any]] | None = None,
    on_ready: Callable[[], Coroutine[Any, Any, Any]] | None = None,
) -> PhaseRun:
    """Run ``bench/_litellm_phase.py`` with LiteLLM's ``python`` on ``payload``.

    The phase builds its Router, says ``ready``, and starts the workload when told to;
    ``on_start(t0)`` (a fault schedule, say) runs beside it from then, on the same clock
    (``t0``: when it was told, within milliseconds of the phase's own); ``on_ready()`` (a
    snapshot of the mocks' counters after a warm-up, say) is awaited before it is told.
    ``limit``: seconds the workload may take before the phase is killed.
    """
    proc = await asyncio.create_subprocess_exec(
        str(python),
        str(LITELLM_PHASE),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=litellm_env(),
        limit=64 * 1024 * 1024,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    err_task = asyncio.create_task(proc.stderr.read())
    out = b""
    started: Any = None
    problem = ""
    try:
        proc.stdin.write(json.dumps(payload).encode() + b"\n")
        await proc.stdin.drain()
        ready = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
        if ready.strip() == b"ready":
            if on_ready is not None:
                await on_ready()
            t0 = time.time()
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            side = asyncio.create_task(on_start(t0)) if on_start is not None else None
            out = await asyncio.wait_for(proc.stdout.read(), timeout=limit)
            started = await side if side is not None else None
        else:
            problem = f"it did not start (said {ready[:300]!r})"
    except TimeoutError:
        problem = f"it did not finish within {limit:g} s"
    if problem:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
    err = await err_task
    tail = " | ".join(err.decode(errors="replace").strip().splitlines()[-6:])
    if problem or proc.returncode != 0:
        why = problem or f"it exited {proc.returncode}"
        return PhaseRun(None, f"the LiteLLM phase failed: {why}: {tail}"[:1500], started)
    return PhaseRun(json.loads(out), "", started)
