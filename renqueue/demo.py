"""``renqueue demo``: the whole pipeline, embedded, on a mixed workload.

Starts an embedded nats-server (in a temporary data dir), four mock backends
standing in for a small local model, a large local model with few slots, a
free API with a low request limit and a paid API, the router and the workers;
submits a mixed workload across priorities and routes (a few requests
streamed live to the terminal, each followed by what happened to it, and a
progress line for the rest) and prints what happened: per backend requests,
tokens, cost and the 429s the provider sent; per priority latency; failures.
Returns True only if every request reached a terminal state.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from . import metrics
from .client import Client, RequestHandle, Result
from .config import Config, parse_config
from .errors import RequestFailedError
from .llamacpp import DEFAULT_VENV, MODEL_NAME, LlamaServer, ensure_model
from .mock import FaultSpec, MockBackend, MockSettings
from .schema import (
    Cancelled,
    Coalesced,
    Completed,
    Event,
    Expired,
    Failed,
    FellBack,
    Preempted,
    Retrying,
    Started,
    kind_of,
)
from .services import Services

__all__ = ["demo_config", "real_demo_config", "run_demo", "run_real_demo"]

#: name -> (mock settings, backend config without base_url)
_BACKENDS: dict[str, tuple[MockSettings, dict[str, Any]]] = {
    "local-small": (
        # A flaky local server: about one answer in 30 is a 503, one in 30
        # breaks mid-stream; those requests fall back down their route.
        MockSettings(
            ttft=0.03,
            tokens_per_second=80,
            output_tokens=24,
            seed=7,
            faults=FaultSpec(random={"503": 0.03, "break": 0.03}, after_tokens=6),
        ),
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

#: name -> what it stands for, shown at the start.
_ROLES = {
    "local-small": "a small model on our own GPU, 8 slots (flaky: 3 % 503s, 3 % broken streams)",
    "local-large": "a large model on our own GPU, 2 slots",
    "free-api": "a free API tier, 4 slots, 30 requests/min declared (it allows 40)",
    "paid-api": "a paid API, 4 slots, $0.15 / $0.60 per million tokens in / out",
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
async def _mock_backends(names: list[str] | None = None) -> AsyncIterator[dict[str, MockBackend]]:
    """The mocks of ``_BACKENDS`` (those in ``names`` only, if given), started."""
    async with contextlib.AsyncExitStack() as stack:
        mocks = {
            name: await stack.enter_async_context(MockBackend(settings))
            for name, (settings, _backend) in _BACKENDS.items()
            if names is None or name in names
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


def _percentile(values: list[float], pct: int) -> float:
    """The ``pct``-th percentile (1..99), interpolated between the closest ranks.

    ``method="inclusive"`` takes the values as the whole population: the
    minimum is the 0th percentile and the maximum the 100th (numpy's default).
    """
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


_RESTART_LEGEND = (
    "  [restart] = a new run of the request began here: the run before it was preempted\n"
    "  by a more urgent request, failed and was retried, or lost its worker. The text\n"
    "  after the marker replaces the text before it (a client drops the older run's)."
)


async def _stream_live(
    handle: RequestHandle, label: str, *, legend: bool, patience: float = 30
) -> bool:
    """Print the request's tokens as they come, then what happened to it.

    Prints :data:`_RESTART_LEGEND` under the first stream with a restart unless
    ``legend`` is False (it was printed already); returns whether it was printed.
    ``patience``: the longest wait for the next chunk, in seconds.
    """
    print(f"\n  [{label}] ", end="", flush=True)
    restarted = False
    async for chunk in handle.stream(timeout=patience):
        if chunk.restart:
            restarted = True
            print(" [restart] ", end="")
        print(chunk.text, end="", flush=True)
    print()
    with contextlib.suppress(RequestFailedError):
        await handle.result(timeout=10)
    print(f"    {_history(await handle.events())}")
    if restarted and legend:
        print(_RESTART_LEGEND)
        return True
    return False


def _history(events: list[Event]) -> str:
    """A request's runs in a few words: where it ran, why a run ended, how it ended."""
    steps: list[str] = []
    for event in events:
        match event:
            case Started(backend=backend):
                steps.append(f"ran on {backend}")
            case Coalesced():
                steps.append("shared the call of an identical request")
            case Preempted():
                steps.append("preempted (its slot went to a more urgent request)")
            case Retrying(error_type=error_type):
                steps.append(f"call failed ({error_type}), retried")
            case FellBack(backend=backend, error_class=error_class):
                steps.append(f"{backend} failed it ({error_class}), fell back")
            case Completed():
                steps.append("completed")
            case Failed(error_type=error_type):
                steps.append(f"failed ({error_type})")
            case Expired() | Cancelled():
                steps.append(kind_of(event))
            case _:
                pass
    return " -> ".join(steps) or "no run recorded"


async def run_demo(*, requests: int = 200, seed: int = 7) -> bool:
    rng = random.Random(seed)
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="renqueue-demo-") as data_dir:
        async with _mock_backends() as mocks:
            config = demo_config({n: m.url for n, m in mocks.items()}, data_dir)
            print("Ren-Queue demo")
            print("  backends (mock servers speaking the OpenAI API):")
            for name, mock in mocks.items():
                print(f"    {name:<12} {mock.url:<28} {_ROLES[name]}")
            routes = "; ".join(f"{n} -> {', '.join(b)}" for n, b in _ROUTES.items())
            print(f"  routes (cheapest first): {routes}")
            async with Services(config) as services:
                print(f"  embedded NATS at {services.url}")
                async with await Client.connect(services.url, tenant="demo") as client:
                    return await _run(client, config, requests, rng, out, mocks=mocks)


async def _run(
    client: Client,
    config: Config,
    count: int,
    rng: random.Random,
    out: Any,
    *,
    mocks: dict[str, MockBackend],
) -> bool:
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
    legend = True
    for priority, route, _t, handle in live:
        if await _stream_live(handle, f"{priority} {route}", legend=legend):
            legend = False

    print("\nThe rest:")
    progress = _Progress(count, out)
    ticker = asyncio.create_task(progress.tick(results))
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.gather(*waiters), timeout=55)
    except TimeoutError:
        timed_out = True
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        progress.show(len(results), last=True)
    rejected = None
    try:
        await bad.result(timeout=10)
    except RequestFailedError as exc:
        rejected = exc
    _summary(
        config,
        throttled={name: mock.stats().rate_limited for name, mock in mocks.items()},
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


class _Progress:
    """How many requests ended: a bar redrawn in place on a terminal, else a
    line per tenth. The last call (``last=True``, once every wait is over)
    always shows the final count, so the display ends where the run did."""

    def __init__(self, total: int, out: Any) -> None:
        self._total = total
        self._out = out
        self._tty = bool(out.isatty())
        self._shown = -1

    async def tick(self, results: dict[str, Any]) -> None:
        while True:
            self.show(len(results))
            await asyncio.sleep(0.2)

    def show(self, done: int, *, last: bool = False) -> None:
        total = self._total
        if self._tty:
            bar = "#" * (30 * done // max(total, 1))
            end = "\n" if last else ""
            print(f"\r  progress [{bar:<30}] {done}/{total}", end=end, file=self._out, flush=True)
        elif done != self._shown and (last or done - self._shown >= total // 10):
            print(f"  progress {done}/{total}", file=self._out, flush=True)
            self._shown = done


def _fallbacks() -> Counter[str]:
    """Fallbacks this process's workers made, by ``backend: class`` (the metric)."""
    counts: Counter[str] = Counter()
    for family in metrics.FALLBACKS.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                labels = sample.labels
                counts[f"{labels['backend']} {labels['error_class']}"] += int(sample.value)
    return counts


def _summary(
    config: Config,
    *,
    throttled: dict[str, int],
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
    print(f"\nSummary ({total} requests in {elapsed:.1f}s)")
    print(
        f"  {'backend':<12} {'requests':>8} {'tokens in':>10} {'tokens out':>10} {'cost $':>10}"
        f" {'429s':>5}"
    )
    for name in config.backends:
        c = per_backend[name]
        print(
            f"  {name:<12} {c['requests']:>8} {c['tokens_in']:>10} {c['tokens_out']:>10}"
            f" {cost[name]:>10.6f} {throttled.get(name, 0):>5}"
        )
    print(
        "  429s = 'too many requests' answers the provider sent us. The binding router\n"
        "  sends each backend no more than its declared limits allow (for every process\n"
        "  at once), so a provider sends them only when it is stricter than declared;\n"
        "  the backend then pauses for the wait it asks for."
    )
    print("\n  Latency from submit to result, by priority:")
    print(f"  {'priority':<10} {'done':>5} {'p50 s':>7} {'p95 s':>7}")
    for level in config.priorities:
        values = latencies.get(level, [])
        print(
            f"  {level:<10} {len(values):>5} {_percentile(values, 50):>7.2f}"
            f" {_percentile(values, 95):>7.2f}"
        )
    fell = _fallbacks()
    print(
        f"\n  fallbacks: {sum(fell.values())} requests a backend failed went on down their"
        " route" + (f" ({', '.join(f'{k} {n}' for k, n in sorted(fell.items()))})" if fell else "")
    )
    listed = ", ".join(f"{kind} {n}" for kind, n in sorted(failures.items()))
    print(f"  failures: {listed or 'none'}")
    if rejected is not None:
        reason = str(rejected).removeprefix(f"request {rejected.request_id}: ")
        print(f"  +1 to an unknown route -> rejected [{rejected.error_type}]: {reason}")


# ------------------------------------------------------- a real model (issue #32)

#: The mock tiers next to the real model: the mock demo's free and paid APIs.
_REAL_MOCKS = ["free-api", "paid-api"]
_REAL_ROUTES = {
    # Cheapest first: the real model, then the free API, then the paid one.
    "chat": ["local", "free-api", "paid-api"],
    # The real model or nothing: these wait for its one slot.
    "local-only": ["local"],
}
_REAL_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "Give two synonyms for happy.",
    "What is a queue, in one sentence?",
]
#: The most tokens an answer may take (the model often stops sooner, at its end of turn).
_REAL_MAX_TOKENS = 48


def real_demo_config(local_url: str, urls: dict[str, str], data_dir: str) -> Config:
    """``renqueue demo --real``'s config: the llama.cpp server at ``local_url`` as
    ``local``, the free and paid mocks at ``urls``, and two routes."""
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "backends": {
                "local": {
                    "base_url": local_url,
                    "model": MODEL_NAME,
                    "tier": 1,
                    "tags": ["local"],
                    # The server generates one answer at a time; a second call
                    # cuts the running stream short (docs/backends.md).
                    "limits": {"concurrency": 1},
                },
                **{
                    name: {"base_url": urls[name], "model": f"mock-{name}", **_BACKENDS[name][1]}
                    for name in _REAL_MOCKS
                },
            },
            "routes": {name: {"backends": backends} for name, backends in _REAL_ROUTES.items()},
            "worker": {"retry_delay": "200ms", "drain_timeout": "5s"},
        },
        source="<demo --real>",
    )


async def run_real_demo(*, requests: int = 16, seed: int = 7, venv: Path = DEFAULT_VENV) -> bool:
    """The demo with a real model as ``local``: llama-cpp-python's server on SmolLM2-135M
    (its venv made on first use), the free and paid mocks, a small mixed workload.
    Returns True only if every request reached a terminal state."""
    rng = random.Random(seed)
    print("Ren-Queue demo, a real model on the local tier")
    model, made = await asyncio.to_thread(
        ensure_model, venv, say=lambda line: print(f"  {line}", flush=True)
    )
    how = "made now" if made else "cached"
    print(f"  venv {model.venv} ({how}; its build took {model.build_seconds:.0f} s)")
    with tempfile.TemporaryDirectory(prefix="renqueue-demo-real-") as data_dir:
        server = LlamaServer(model, log=Path(data_dir) / "llama-server.log")
        loading = time.monotonic()
        async with server, _mock_backends(_REAL_MOCKS) as mocks:
            took = time.monotonic() - loading
            urls = {n: m.url for n, m in mocks.items()}
            config = real_demo_config(server.base_url, urls, data_dir)
            print("  backends:")
            print(
                f"    {'local':<9} {server.base_url:<28} llama-cpp-python {model.version}"
                f" serving SmolLM2-135M-Instruct (Q4_1) on this CPU, 1 slot (up in {took:.1f} s)"
            )
            for name, mock in mocks.items():
                print(f"    {name:<9} {mock.url:<28} mock: {_ROLES[name]}")
            routes = "; ".join(f"{n} -> {', '.join(b)}" for n, b in _REAL_ROUTES.items())
            print(f"  routes (cheapest first): {routes}")
            services = Services(config)
            async with services, await Client.connect(services.url, tenant="demo") as client:
                return await _run_real(client, config, services, requests, rng)


async def _run_real(
    client: Client, config: Config, services: Services, count: int, rng: random.Random
) -> bool:
    levels = ["critical", "high", "normal", "low", "batch"]
    work = [
        (rng.choices(levels, [10, 15, 35, 20, 20])[0], "local-only" if n % 2 else "chat")
        for n in range(count)
    ]
    # One of each kind shown live: a critical and a batch request on the real model.
    work[1] = ("critical", "local-only")
    work[3] = ("batch", "local-only")
    started = time.monotonic()
    handles = [
        await client.submit(
            rng.choice(_REAL_PROMPTS),
            route=route,
            priority=priority,
            max_tokens=_REAL_MAX_TOKENS,
            timeout=120.0,
        )
        for priority, route in work
    ]
    print(f"  submitted {count} requests in {time.monotonic() - started:.2f}s, half local-only")
    results: dict[str, Result | RequestFailedError] = {}

    async def wait(handle: RequestHandle) -> None:
        try:
            results[handle.id] = await handle.result(timeout=150)
        except RequestFailedError as exc:
            results[handle.id] = exc

    waiters = [asyncio.create_task(wait(handle)) for handle in handles]
    print("\nTwo answers of the real model, streamed live (the critical one is served first):")
    for index in (1, 3):
        priority, route = work[index]
        # A batch request waits for every more urgent one on the one slot.
        await _stream_live(handles[index], f"{priority} {route}", legend=True, patience=150)
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.gather(*waiters), timeout=160)
    except TimeoutError:
        timed_out = True
    _real_summary(config, services, results, elapsed=time.monotonic() - started)
    complete = not timed_out and len(results) == count
    verdict = "OK" if complete else "INCOMPLETE"
    print(f"\n{verdict}: {len(results)}/{count} requests reached a terminal state")
    return complete


def _speeds(outcomes: list[Result]) -> tuple[list[float], list[float]]:
    """Times to first token (s) and output tokens/s after it, as the worker measured them."""
    ttfts = [r.ttft for r in outcomes if r.ttft is not None]
    rates = [
        (r.usage.completion_tokens - 1) / (r.duration - r.ttft)
        for r in outcomes
        if r.ttft is not None and r.usage.completion_tokens > 1 and r.duration > r.ttft
    ]
    return ttfts, rates


def _real_summary(
    config: Config,
    services: Services,
    results: dict[str, Result | RequestFailedError],
    *,
    elapsed: float,
) -> None:
    done: dict[str, list[Result]] = defaultdict(list)
    failures: Counter[str] = Counter()
    for outcome in results.values():
        if isinstance(outcome, Result):
            done[outcome.backend].append(outcome)
        else:
            failures[outcome.error_type] += 1
    print(f"\nSummary ({len(results)} requests in {elapsed:.1f}s)")
    print(
        f"  {'backend':<9} {'requests':>8} {'tokens in':>9} {'tokens out':>10}"
        f" {'TTFT p50 ms':>11} {'tokens/s p50':>12} {'cost $':>9}"
    )
    for name in config.backends:
        outcomes = done.get(name, [])
        ttfts, rates = _speeds(outcomes)
        print(
            f"  {name:<9} {len(outcomes):>8} {sum(r.usage.prompt_tokens for r in outcomes):>9}"
            f" {sum(r.usage.completion_tokens for r in outcomes):>10}"
            f" {_percentile(ttfts, 50) * 1000:>11.0f} {_percentile(rates, 50):>12.1f}"
            f" {sum(r.cost for r in outcomes):>9.6f}"
        )
    print(
        "  TTFT and tokens/s as Ren-Queue's workers measured each call (tokens/s: output\n"
        "  tokens after the first over the time after it). The server sends no usage in a\n"
        "  stream: local's tokens out are its chunks (one token each), tokens in an estimate."
    )
    router = services.routers[0] if services.routers else None
    projection = None if router is None else router.projection
    perf = None if projection is None else projection.backend("local").perf
    if perf is not None and perf.samples:
        print(
            f"  learned from the log (what the router plans with): local {perf.ttft * 1000:.0f} ms"
            f" to the first token, {perf.rate:.1f} tokens/s, {perf.output:.0f} tokens per answer"
            f" ({perf.samples} calls)"
        )
    local = done.get("local", [])
    if local:
        print("\n  Some of the real model's answers:")
        for result in local[:3]:
            text = " ".join(result.text.split())
            print(f"    [{result.finish_reason}] {text[:110]}{'...' if len(text) > 110 else ''}")
    fell = _fallbacks()
    print(f"\n  fallbacks: {sum(fell.values())}")
    listed = ", ".join(f"{kind} {n}" for kind, n in sorted(failures.items()))
    print(f"  failures: {listed or 'none'}")
