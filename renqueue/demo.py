"""``renqueue demo``: the whole pipeline, embedded, on a mixed workload.

Starts an embedded nats-server (in a temporary data dir), four mock backends
standing in for a small local model, a large local model with few slots, a
free API with a low request limit and a paid API, the router and the workers;
submits a mixed workload across priorities and routes (a few requests
streamed live to the terminal, a progress line for the rest) and prints what
happened: per backend requests, tokens and cost; per priority latency; failures.
Returns True only if every request reached a terminal state.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from typing import Any

from .client import Client, RequestHandle, Result
from .config import Config, parse_config
from .errors import RequestFailedError
from .mockbackend import MockBackend, MockSettings
from .service import Services

__all__ = ["demo_config", "run_demo"]

#: name -> (mock settings, backend config without base_url)
_BACKENDS: dict[str, tuple[MockSettings, dict[str, Any]]] = {
    "local-small": (
        MockSettings(ttft=0.03, tokens_per_second=80, output_tokens=24),
        {"tier": 1, "tags": ["local"], "limits": {"concurrency": 8}},
    ),
    "local-large": (
        MockSettings(ttft=0.2, tokens_per_second=40, output_tokens=48),
        {"tier": 3, "tags": ["local"], "limits": {"concurrency": 2}},
    ),
    "free-api": (
        # The provider enforces 40/min with real 429s; we declare 30/min and
        # must never trip it.
        MockSettings(ttft=0.08, tokens_per_second=80, output_tokens=32, rpm=40),
        {
            "tier": 2,
            "tags": ["free"],
            "limits": {"concurrency": 4, "requests": ["30/min"]},
        },
    ),
    "paid-api": (
        MockSettings(ttft=0.05, tokens_per_second=100, output_tokens=32),
        {
            "tier": 3,
            "tags": ["paid"],
            "cost_input_per_mtok": 0.15,
            "cost_output_per_mtok": 0.60,
            "limits": {"concurrency": 4},
        },
    ),
}

_ROUTES = {
    "chat-small": ["local-small", "free-api", "paid-api"],
    "chat-large": ["local-large", "paid-api"],
}

_PROMPTS = [
    "Summarise the design of a priority queue in two sentences.",
    "Translate 'good morning' into French, German and Japanese.",
    "Write a haiku about rate limits.",
    "Explain event sourcing to a new engineer.",
    "List three risks of retrying non-idempotent requests.",
]


def demo_config(urls: dict[str, str], data_dir: str) -> Config:
    """The demo's config: the four mock backends at ``urls`` and two routes."""
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "backends": {
                name: {"base_url": urls[name], "model": f"mock-{name}", **backend}
                for name, (_mock, backend) in _BACKENDS.items()
            },
            "routes": {name: {"backends": backends} for name, backends in _ROUTES.items()},
            "worker": {"retry_delay": "200ms", "drain_timeout": "5s"},
        },
        source="<demo>",
    )


@contextlib.asynccontextmanager
async def _mock_backends() -> AsyncIterator[dict[str, MockBackend]]:
    async with contextlib.AsyncExitStack() as stack:
        mocks = {
            name: await stack.enter_async_context(MockBackend(settings))
            for name, (settings, _backend) in _BACKENDS.items()
        }
        yield mocks


def _workload(count: int, rng: random.Random) -> list[tuple[str, str]]:
    """(priority, route) pairs: mostly normal and batch, a few critical."""
    levels = ["critical", "high", "normal", "low", "batch"]
    weights = [5, 15, 40, 20, 20]
    return [
        (rng.choices(levels, weights)[0], "chat-large" if rng.random() < 0.25 else "chat-small")
        for _ in range(count)
    ]


def _percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


async def _stream_live(handle: RequestHandle, label: str) -> None:
    print(f"\n  [{label}] ", end="", flush=True)
    async for chunk in handle.stream(timeout=30):
        if chunk.restart:
            print(" [restart] ", end="")
        print(chunk.text, end="", flush=True)
    print()


async def run_demo(*, requests: int = 200, seed: int = 7) -> bool:
    rng = random.Random(seed)
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="renqueue-demo-") as data_dir:
        async with _mock_backends() as mocks:
            config = demo_config({n: m.url for n, m in mocks.items()}, data_dir)
            print("Ren-Queue demo")
            print(f"  backends: {', '.join(f'{n} ({m.url})' for n, m in mocks.items())}")
            async with Services(config) as services:
                print(f"  embedded NATS at {services.url}")
                async with await Client.connect(services.url, tenant="demo") as client:
                    ok = await _run(client, config, requests, rng, out)
            throttled = {name: mock.stats().rate_limited for name, mock in mocks.items()}
            print(f"  429s the providers sent us: {throttled}")
            return ok


async def _run(client: Client, config: Config, count: int, rng: random.Random, out: Any) -> bool:
    work = _workload(count, rng)
    started = time.monotonic()
    prompts = [rng.choice(_PROMPTS) for _ in work]

    async def submit(index: int) -> tuple[str, str, float, RequestHandle]:
        priority, route = work[index]
        handle = await client.submit(prompts[index], route=route, priority=priority, timeout=45.0)
        return priority, route, started, handle

    # One burst, as a real traffic spike: everything waits in the priority
    # subjects and the routers hand out slots most urgent first.
    submitted = list(await asyncio.gather(*(submit(i) for i in range(count))))
    bad = await client.submit("This route does not exist.", route="chat-huge", priority="normal")
    took = time.monotonic() - started
    print(f"  submitted {count} requests (+1 to an unknown route) in {took:.2f}s")

    results: dict[str, Result | RequestFailedError] = {}
    latencies: dict[str, list[float]] = defaultdict(list)

    async def wait(priority: str, submit_time: float, handle: RequestHandle) -> None:
        try:
            results[handle.id] = await handle.result(timeout=50)
            latencies[priority].append(time.monotonic() - submit_time)
        except RequestFailedError as exc:
            results[handle.id] = exc

    # Follow every result from now on, so latencies are measured as they end,
    # also while three of them stream to the terminal.
    waiters = [asyncio.create_task(wait(p, t, h)) for p, _r, t, h in submitted]

    print("\nStreaming three requests live (critical first, batch waits its turn):")
    live = [next(s for s in submitted if s[0] == level) for level in ("critical", "high", "batch")]
    for priority, route, _t, handle in live:
        await _stream_live(handle, f"{priority} {route}")

    progress = asyncio.create_task(_progress(results, count, out))
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.gather(*waiters), timeout=55)
    except TimeoutError:
        timed_out = True
    finally:
        progress.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress
    rejected = None
    try:
        await bad.result(timeout=10)
    except RequestFailedError as exc:
        rejected = exc
    _summary(
        config,
        results=results,
        latencies=latencies,
        total=count,
        elapsed=time.monotonic() - started,
        rejected=rejected,
    )
    complete = not timed_out and len(results) == count and rejected is not None
    verdict = "OK" if complete else "INCOMPLETE"
    print(f"\n{verdict}: {len(results)}/{count} requests reached a terminal state")
    return complete


async def _progress(results: dict[str, Any], total: int, out: Any) -> None:
    tty = out.isatty()
    last = -1
    while True:
        done = len(results)
        if tty:
            bar = "#" * (30 * done // total)
            print(f"\r  progress [{bar:<30}] {done}/{total}", end="", flush=True)
        elif done != last and (done - last >= total // 10 or done == total):
            print(f"  progress {done}/{total}", flush=True)
            last = done
        await asyncio.sleep(0.2)


def _summary(
    config: Config,
    *,
    results: dict[str, Result | RequestFailedError],
    latencies: dict[str, list[float]],
    total: int,
    elapsed: float,
    rejected: RequestFailedError | None,
) -> None:
    per_backend: dict[str, Counter[str]] = defaultdict(Counter)
    cost: dict[str, float] = defaultdict(float)
    failures: Counter[str] = Counter()
    for outcome in results.values():
        if isinstance(outcome, Result):
            counts = per_backend[outcome.backend]
            counts["requests"] += 1
            counts["tokens_in"] += outcome.usage.prompt_tokens
            counts["tokens_out"] += outcome.usage.completion_tokens
            cost[outcome.backend] += outcome.cost
        else:
            failures[outcome.error_type] += 1
    print(f"\n\nSummary ({total} requests in {elapsed:.1f}s)")
    print(f"  {'backend':<12} {'requests':>8} {'tokens in':>10} {'tokens out':>10} {'cost $':>10}")
    for name in config.backends:
        c = per_backend[name]
        print(
            f"  {name:<12} {c['requests']:>8} {c['tokens_in']:>10} {c['tokens_out']:>10}"
            f" {cost[name]:>10.6f}"
        )
    print(f"\n  {'priority':<10} {'done':>5} {'p50 s':>7} {'p95 s':>7}")
    for level in config.priorities:
        values = latencies.get(level, [])
        print(
            f"  {level:<10} {len(values):>5} {_percentile(values, 50):>7.2f}"
            f" {_percentile(values, 95):>7.2f}"
        )
    print(f"\n  failures: {dict(failures) or 'none'}")
    if rejected is not None:
        print(f"  unknown route -> {rejected.error_type}: {rejected}")
