"""Faults benchmark (issue #9): a workload while backends fail, through Ren-Queue and through
LiteLLM's Router, on the same mocks.

Run with ``make bench-faults`` (about 4 minutes; the first run also spends about 30 s
making LiteLLM's venv, shared with ``make bench-ratelimits``). Everything is on loopback:
an embedded nats-server, four ``renqueue mock-backend`` processes (fresh ones for each
side), ``Services`` (router, worker, projector) and a ``Client`` in this process.

One route cascades over the four backends, in this order:

- ``flaky``: answers ``500`` to 30 % of calls, at random;
- ``outage``: healthy, but ``down`` (every connection reset, ``/health`` too) from 25 % to
  60 % of the arrivals, then back up;
- ``breaker``: 30 % of its streams break after a few tokens (the connection closes: no
  finish chunk, no ``[DONE]``), at random;
- ``steady``: never faulted, the last resort, with fewer slots (so a fallback to it has a
  cost: it waits for room, or, without a queue, is refused).

Each mock draws its faults from its own seeded generator, one draw per call in the order
calls arrive, so the n-th call to ``flaky`` gets the same answer on both sides; which
request makes the n-th call depends on timing, so runs differ a little (a streak of 500s
that trips a circuit in one run may not come in the next). The workload (seeded, the same
on both sides): ``--requests`` requests (480) at a fixed
``--rate`` (8 a second), each streamed by its client, with a deadline of ``--deadline``
seconds (20) from its submit and ``max_tokens`` of 32 to 128. The mocks stream 50-100
tokens a second after a 80-200 ms first token; every answer is ``max_tokens`` long, its
text known in advance (``tok0 tok1 ...``), so a completed answer is checked word for word
(a splice or a duplicate would show).

1. **Ren-Queue**: ``Client.submit_request`` and ``handle.stream()`` for each (a chunk with
   ``restart`` voids the text before it), then ``handle.result()``. Config: each backend's
   ``limits.concurrency`` = its slots; ``[routes.chat.fallback]`` ``attempts`` = 4 (every
   backend may be tried), ``retries`` = 1 (a transient failure is retried once where it
   happened); ``[backends.*.circuit]`` ``failures`` 5 in a row, or an error rate of 50 %
   over at least 10 calls in 10 s, ``cooloff`` 5 s; ``outage`` (a self-hosted server) has
   an active probe of ``/health`` every 1 s.
2. **LiteLLM** (fresh mocks, the same fault schedule): ``litellm.Router`` with one model
   group per backend (``openai/<name>`` at the mock's URL, ``max_parallel_requests`` =
   its slots), ``fallbacks = [{"flaky": ["outage", "breaker", "steady"]}]``,
   ``num_retries = 1``, ``cooldown_time = 5``, ``timeout`` = the deadline; streamed
   (``stream=True``); the client gives up at the deadline. Cooldowns are LiteLLM's own
   rules (``allowed_fails`` unset: see bench/README.md for why).

Reported per side: completed / total and the completion rate among requests that had a
healthy candidate within their deadline (``steady`` is never faulted and always up, so
every request qualifies: the target is 100 %), failed, expired, in the dead-letter stream
(Ren-Queue: ``RQ_DLQ`` messages; LiteLLM has none: the requests that raised), answers
that did not match the expected text, latency submit -> last token (p50 / p95 / p99) and
submit -> first token of the answer kept, **added latency from fallbacks**: the latency of
completed requests that met at least one failed upstream call minus that of the completed
requests that met none, in the same run (p50 and p95), upstream calls per mock and the
faults each injected (the mocks' ``/stats``), who served the requests. Ren-Queue's log
adds: ``fell_back`` events by failure class, ``retrying`` events, ``circuit`` changes per
backend with their times, and an audit (exactly one terminal event per request). The
history of every request Ren-Queue did not complete is printed and kept in the JSON.

Results: a table on stdout, JSON in ``bench/results/faults-<UTC>.json`` and
``bench/results/faults-latest.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from common import (
    RESULTS,
    ROOT,
    all_mock_stats,
    litellm_python,
    machine_info,
    mock_fleet,
    mock_settings,
    percentile,
    read_events,
    run_litellm_phase,
)

from renqueue import Client, Services, parse_config
from renqueue.broker import connect
from renqueue.config import Config
from renqueue.errors import RequestExpiredError, RequestFailedError
from renqueue.logs import configure_logging
from renqueue.schema import (
    DLQ_STREAM,
    SYSTEM_TENANT,
    CircuitChanged,
    Completed,
    Expired,
    Failed,
    FellBack,
    Probed,
    Retrying,
    Routed,
    Started,
    is_terminal,
)

TENANT = "bench"
ROUTE = "chat"
#: Words the prompts are made of (about one token each by the 4-characters rule).
WORDS = ("queue", "token", "fault", "route", "retry", "break", "down", "steady", "flaky", "model")


@dataclass(frozen=True)
class Backend:
    """One mock backend of the route: its speed, its slots, its faults.

    ``faults``: the mock's random fault mix (kind -> probability, seeded);
    ``after_tokens``: tokens streamed before a ``break``; ``outage``: taken down for
    ``Plan.outage``; ``probe``: Ren-Queue probes its ``/health`` (a self-hosted server).
    """

    name: str
    slots: int
    ttft: float
    tokens_per_second: float
    faults: dict[str, float] = field(default_factory=dict)
    after_tokens: int = 8
    outage: bool = False
    probe: bool = False


@dataclass(frozen=True)
class Plan:
    requests: int = 480
    #: Requests per second, evenly spaced (open loop: a slow answer delays no submit).
    rate: float = 8.0
    deadline: float = 20.0
    seed: int = 9
    #: The outage, as shares of the arrival period (``requests / rate``).
    outage: tuple[float, float] = (0.25, 0.60)
    max_tokens: tuple[int, ...] = (32, 64, 96, 128)
    prompt_words: tuple[int, int] = (20, 120)
    #: The mocks' answer length; a request's ``max_tokens`` caps it.
    output_tokens: int = 256
    #: Retries of a transient failure on the same backend (Ren-Queue ``fallback.retries``,
    #: LiteLLM ``num_retries``).
    retries: int = 1
    #: Ren-Queue's circuit breakers (every backend) and LiteLLM's ``cooldown_time``.
    circuit_failures: int = 5
    circuit_error_rate: float = 0.5
    circuit_min_calls: int = 10
    circuit_window: float = 10.0
    cooloff: float = 5.0
    probe_interval: float = 1.0
    #: LiteLLM's ``allowed_fails`` (None: unset, its own cooldown rules; see bench/README.md).
    litellm_allowed_fails: int | None = None
    backends: tuple[Backend, ...] = field(
        default_factory=lambda: (
            Backend("flaky", slots=6, ttft=0.08, tokens_per_second=100.0, faults={"500": 0.3}),
            Backend("outage", slots=6, ttft=0.1, tokens_per_second=80.0, outage=True, probe=True),
            Backend(
                "breaker",
                slots=6,
                ttft=0.15,
                tokens_per_second=70.0,
                faults={"break": 0.3},
                after_tokens=8,
            ),
            Backend("steady", slots=3, ttft=0.2, tokens_per_second=50.0),
        )
    )

    @property
    def cascade(self) -> list[str]:
        return [b.name for b in self.backends]

    @property
    def span(self) -> float:
        """Seconds over which the requests arrive."""
        return self.requests / self.rate

    @property
    def outage_window(self) -> tuple[float, float]:
        """Seconds from the first arrival: when ``outage`` goes down, when it comes back."""
        return (self.outage[0] * self.span, self.outage[1] * self.span)


def expected_text(max_tokens: int, output_tokens: int) -> str:
    """What the mock streams for a request (``tok0 tok1 ...``, capped by ``max_tokens``)."""
    return "".join(
        f"tok{i}" if i == 0 else f" tok{i}" for i in range(min(max_tokens, output_tokens))
    )


def make_workload(plan: Plan) -> list[dict[str, Any]]:
    """The requests, the same for every side: when (seconds from the start), a prompt and
    a ``max_tokens`` each."""
    rng = random.Random(plan.seed)
    out = []
    for index in range(plan.requests):
        words = rng.randint(*plan.prompt_words)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(
            {
                "at": index / plan.rate,
                "prompt": f"[{index}] {text}",
                "max_tokens": rng.choice(plan.max_tokens),
            }
        )
    return out


# ------------------------------------------------------------------- the mocks


def mock_config(backend: Backend, plan: Plan, index: int) -> dict[str, Any]:
    """The mock's settings (``POST /admin/settings``): speed, seeded faults, up."""
    return {
        "ttft": backend.ttft,
        "tokens_per_second": backend.tokens_per_second,
        "output_tokens": plan.output_tokens,
        # Each mock its own seed, the same on every side.
        "seed": plan.seed * 100 + index,
        "faults": {"random": backend.faults, "after_tokens": backend.after_tokens},
        "down": False,
    }


@contextlib.asynccontextmanager
async def mocks(plan: Plan) -> AsyncIterator[dict[str, str]]:
    """A fresh mock process per backend (fresh fault draws, counters at 0): name -> URL."""
    settings = {b.name: mock_config(b, plan, index) for index, b in enumerate(plan.backends)}
    async with mock_fleet(settings) as urls:
        yield urls


async def outage_schedule(plan: Plan, urls: dict[str, str], t0: float) -> list[dict[str, Any]]:
    """Take the ``outage`` backends down and back up at their times from ``t0``: what was
    done when (seconds from ``t0``)."""
    down_at, up_at = plan.outage_window
    done = []
    for at, down in ((down_at, True), (up_at, False)):
        await asyncio.sleep(max(0.0, t0 + at - time.time()))
        for backend in plan.backends:
            if backend.outage:
                await mock_settings(urls[backend.name], {"down": down})
                done.append({"backend": backend.name, "down": down, "at": time.time() - t0})
    return done


# ------------------------------------------------------------------- Ren-Queue


def renqueue_config(plan: Plan, urls: dict[str, str], data_dir: str) -> Config:
    backends: dict[str, Any] = {}
    for backend in plan.backends:
        settings: dict[str, Any] = {
            "base_url": urls[backend.name],
            "model": backend.name,
            "limits": {"concurrency": backend.slots},
            "circuit": {
                "failures": plan.circuit_failures,
                "error_rate": plan.circuit_error_rate,
                "min_calls": plan.circuit_min_calls,
                "window": f"{plan.circuit_window:g}s",
                "cooloff": f"{plan.cooloff:g}s",
            },
        }
        if backend.probe:
            settings["probe"] = {
                "path": "/health",
                "interval": f"{plan.probe_interval:g}s",
                "timeout": "1s",
            }
        backends[backend.name] = settings
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "backends": backends,
            "routes": {
                ROUTE: {
                    "backends": plan.cascade,
                    "fallback": {"attempts": len(plan.backends), "retries": plan.retries},
                }
            },
            "worker": {"drain_timeout": "5s"},
        },
        source="<bench:faults>",
    )


async def run_renqueue(plan: Plan, workload: list[dict[str, Any]]) -> dict[str, Any]:
    async with mocks(plan) as urls:
        with tempfile.TemporaryDirectory(prefix="renqueue-bench-faults-") as tmp:
            config = renqueue_config(plan, urls, tmp)
            async with Services(config, name="bench") as services:
                client_nc = await connect(services.url, name="bench-client")
                client = Client(client_nc, tenant=TENANT)
                try:
                    t0 = time.time() + 0.5
                    schedule = asyncio.create_task(outage_schedule(plan, urls, t0))

                    async def one(index: int, item: dict[str, Any]) -> dict[str, Any]:
                        await asyncio.sleep(max(0.0, t0 + item["at"] - time.time()))
                        return await renqueue_request(client, plan, index, item)

                    cpu = time.process_time()
                    rows = list(
                        await asyncio.gather(*(one(i, item) for i, item in enumerate(workload)))
                    )
                    ended = time.time()
                    cpu = time.process_time() - cpu
                    outage = await schedule
                    check_rows(plan, workload, rows)
                    # Give the log a moment: a terminal event a client saw is stored, but
                    # a late duplicate (the audit's concern) would come after it.
                    await asyncio.sleep(1.0)
                    events = await read_events(services.js, f"rq.evt.{TENANT}.>")
                    system = await read_events(services.js, f"rq.evt.{SYSTEM_TENANT}.>")
                    assert services.js is not None  # set while Services is open
                    dlq = (await services.js.stream_info(DLQ_STREAM)).state.messages
                finally:
                    await client.close()
                    await client_nc.drain()
        stats = await all_mock_stats(urls)
    return {
        "began": t0,
        "ended": ended,
        "cpu_s": cpu,
        "outage": outage,
        "rows": rows,
        "mocks": stats,
        "dlq_messages": dlq,
        "log": log_figures(events, system, rows, t0),
        "config": {
            "route": {
                "backends": plan.cascade,
                "fallback": {"attempts": len(plan.backends), "retries": plan.retries},
            },
            "backends": {
                name: {
                    "concurrency": backend.limits.concurrency,
                    "circuit": {
                        "failures": backend.circuit.failures,
                        "error_rate": backend.circuit.error_rate,
                        "min_calls": backend.circuit.min_calls,
                        "window": backend.circuit.window,
                        "cooloff": backend.circuit.cooloff,
                    },
                    "probe": None
                    if backend.probe is None
                    else {"path": backend.probe.path, "interval": backend.probe.interval},
                }
                for name, backend in config.backends.items()
            },
        },
    }


async def renqueue_request(
    client: Client, plan: Plan, index: int, item: dict[str, Any]
) -> dict[str, Any]:
    """One request as a streaming client sends it: submit, read the stream (a restart voids
    the text before it), then the result."""
    request = client.build_request(
        item["prompt"], route=ROUTE, max_tokens=item["max_tokens"], timeout=plan.deadline
    )
    start = time.time()
    row: dict[str, Any] = {"index": index, "submitted_at": start, "request_id": request.id}
    parts: list[str] = []
    first: float | None = None
    restarts = 0
    try:
        handle = await client.submit_request(request)
        async for chunk in handle.stream(timeout=plan.deadline + 30):
            if chunk.restart and parts:
                # A new run after text had come: the text so far is void.
                restarts += 1
                parts.clear()
                first = None
            if chunk.text:
                first = first or time.time()
                parts.append(chunk.text)
        result = await handle.result(timeout=30)
    except RequestExpiredError as exc:
        row.update(outcome="expired", error=f"{type(exc).__name__}: {exc}"[:300])
    except RequestFailedError as exc:
        row.update(outcome="failed", error=f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:  # noqa: BLE001 - every failure is a row
        row.update(outcome="error", error=f"{type(exc).__name__}: {exc}"[:300])
    else:
        row.update(
            outcome="completed",
            backend=result.backend,
            finish_reason=result.finish_reason,
            result_text_matches_stream=result.text == "".join(parts),
        )
    row.update(
        ended_at=time.time(),
        first_token_at=first,
        restarts=restarts,
        text="".join(parts),
    )
    return row


def log_figures(
    events: Sequence[Any], system: Sequence[Any], rows: Sequence[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """What the event log says: failed calls per request, fell_back by class, retrying,
    circuit changes and probes per backend, binds, and the audit (one terminal each)."""
    ours = {row["request_id"] for row in rows}
    fell_back: Counter[str] = Counter()
    fell_back_by_backend: Counter[str] = Counter()
    retrying: Counter[str] = Counter()
    routed: Counter[str] = Counter()
    failed_calls: defaultdict[str, list[str]] = defaultdict(list)
    #: Calls bound as a half-open circuit's probe, per backend (seconds from t0).
    probe_calls: defaultdict[str, list[float]] = defaultdict(list)
    terminals: defaultdict[str, list[str]] = defaultdict(list)
    histories: defaultdict[str, list[Any]] = defaultdict(list)
    for event in events:
        rid = event.request_id
        if rid not in ours:
            continue
        histories[rid].append(event)
        if isinstance(event, FellBack):
            fell_back[event.error_class] += 1
            fell_back_by_backend[f"{event.backend} {event.error_class}"] += 1
            failed_calls[rid].append(f"{event.backend} {event.error_class}")
        elif isinstance(event, Retrying):
            retrying[f"{event.backend} {event.error_class or event.error_type}"] += 1
            failed_calls[rid].append(f"{event.backend} {event.error_class or event.error_type}")
        elif isinstance(event, Routed):
            routed[event.backend] += 1
            if "probe of" in event.reason:
                probe_calls[event.backend].append(round(event.at - t0, 2))
        if is_terminal(event):
            terminals[rid].append(type(event).__name__)
    circuits: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
    probes: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in system:
        if isinstance(event, CircuitChanged):
            circuits[event.backend].append(
                {"at": round(event.at - t0, 2), "state": event.state, "reason": event.reason}
            )
        elif isinstance(event, Probed):
            probes[event.backend].append({"at": round(event.at - t0, 2), "ok": event.ok})
    not_completed = [row["request_id"] for row in rows if row["outcome"] != "completed"] + [
        row["request_id"] for row in rows if row["outcome"] == "completed" and not row["ok"]
    ]
    return {
        "fell_back_by_class": dict(fell_back.most_common()),
        "fell_back_by_backend": dict(fell_back_by_backend.most_common()),
        "retrying": dict(retrying.most_common()),
        "routed": dict(routed),
        "circuits": dict(circuits),
        "probes": dict(probes),
        "probe_calls": dict(probe_calls),
        "failed_calls": dict(failed_calls),
        "lost": sorted(rid for rid in ours if not terminals.get(rid)),
        "duplicated": {rid: kinds for rid, kinds in terminals.items() if len(kinds) > 1},
        "terminal_kinds": dict(Counter(k for kinds in terminals.values() for k in kinds)),
        "histories": {rid: [describe(e, t0) for e in histories[rid]] for rid in not_completed},
    }


def describe(event: Any, t0: float) -> str:
    """One line of a request's history, times in seconds from the run's start."""
    kind = type(event).__name__
    at = f"{event.at - t0:7.2f}s"
    if isinstance(event, Routed):
        return f"{at} routed -> {event.backend} (attempt {event.attempt}): {event.reason[:160]}"
    if isinstance(event, Started):
        return f"{at} started on {event.backend} (run {event.delivery})"
    if isinstance(event, Retrying):
        return (
            f"{at} retrying on {event.backend} ({event.error_class or event.error_type}) in "
            f"{event.retry_after:.2f}s: {event.reason[:120]}"
        )
    if isinstance(event, FellBack):
        return (
            f"{at} fell_back from {event.backend} ({event.error_class}), excluded "
            f"{list(event.fallback.excluded)}, count {event.fallback.count}"
            + (" [probe]" if event.probe else "")
            + f": {event.reason[:120]}"
        )
    if isinstance(event, Completed):
        return f"{at} completed on {event.backend} ({event.usage.completion_tokens} tokens)"
    if isinstance(event, Failed):
        return (
            f"{at} failed {event.error_type} ({event.error_class}) on {event.backend}: "
            + (event.reason[:200])
        )
    if isinstance(event, Expired):
        return f"{at} expired at {event.stage}: {event.reason[:200]}"
    return f"{at} {kind}"


# --------------------------------------------------------------------- LiteLLM


def litellm_router_kwargs(plan: Plan) -> dict[str, Any]:
    """The Router's settings besides its model list and fallbacks (see the module docstring
    and bench/README.md for why these)."""
    return {
        "num_retries": plan.retries,
        # A deployment at its max_parallel_requests answers 429 (LiteLLM has no queue):
        # go down the cascade at once, as Ren-Queue binds the next candidate with room,
        # rather than sleep and retry the full one.
        "retry_policy": {"RateLimitErrorRetries": 0},
        "cooldown_time": plan.cooloff,
    } | (
        {} if plan.litellm_allowed_fails is None else {"allowed_fails": plan.litellm_allowed_fails}
    )


async def run_litellm(plan: Plan, workload: list[dict[str, Any]], python: Path) -> dict[str, Any]:
    router_kwargs = litellm_router_kwargs(plan)
    async with mocks(plan) as urls:
        payload = {
            "mode": "open-loop",
            "backends": [
                {
                    "name": b.name,
                    "url": urls[b.name],
                    "max_parallel_requests": b.slots,
                    "price_in_per_mtok": 0.0,
                    "price_out_per_mtok": 0.0,
                }
                for b in plan.backends
            ],
            "fallback_order": plan.cascade,
            "timeout_s": plan.deadline,
            "deadline": plan.deadline,
            "router_kwargs": router_kwargs,
            "requests": workload,
        }
        limit = plan.span + plan.deadline + 120
        phase = await run_litellm_phase(
            python, payload, limit=limit, on_start=lambda t0: outage_schedule(plan, urls, t0)
        )
        stats = await all_mock_stats(urls)
    if phase.report is None:
        return {"error": phase.error}
    report = phase.report
    # The phase's clock starts when it reads "go": its own t0, within milliseconds of ours.
    report["outage"] = phase.started or []
    report["mocks"] = stats
    report["router_kwargs"] = router_kwargs
    return report


# -------------------------------------------------------------------- analysis


def check_rows(plan: Plan, workload: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Mark each completed row ``ok`` when its streamed text is the expected answer."""
    for row in rows:
        want = expected_text(workload[row["index"]]["max_tokens"], plan.output_tokens)
        row["ok"] = row["outcome"] == "completed" and row.get("text") == want
        row["text_chars"] = len(row.get("text") or "")
        row.pop("text", None)


def figures(plan: Plan, side: dict[str, Any], system: str) -> dict[str, Any]:
    """The same figures for either side, from its rows and its mocks' counters."""
    rows: list[dict[str, Any]] = side["rows"]
    t0 = side["began"]
    done = [r for r in rows if r["outcome"] == "completed"]
    ok = [r for r in done if r["ok"]]
    # Upstream calls that failed, per request: "<backend> <class>" each (Ren-Queue: its
    # retrying and fell_back events; LiteLLM: its failure callback, one per call it made).
    if system == "renqueue":
        calls = side["log"]["failed_calls"]
        failed = {r["index"]: calls.get(r["request_id"], []) for r in rows}
    else:
        failed = {r["index"]: r.get("failed_calls") or [] for r in rows}
    faulted = {index for index, calls in failed.items() if calls}
    # Fell back: served by another backend than one whose call failed it.
    fell = {
        r["index"]
        for r in ok
        if any(call.split()[0] != r.get("backend") for call in failed[r["index"]])
    }
    latency = [r["ended_at"] - r["submitted_at"] for r in ok]
    ttft = [r["first_token_at"] - r["submitted_at"] for r in ok if r.get("first_token_at")]
    hit = [r["ended_at"] - r["submitted_at"] for r in ok if r["index"] in faulted]
    moved = [r["ended_at"] - r["submitted_at"] for r in ok if r["index"] in fell]
    clean = [r["ended_at"] - r["submitted_at"] for r in ok if r["index"] not in faulted]
    # Requests that arrived while the outage backend was down (by their submit time).
    down_at, up_at = plan.outage_window
    in_outage = [r for r in rows if down_at <= r["submitted_at"] - t0 < up_at]
    mocks = side["mocks"]
    outcomes = Counter(r["outcome"] for r in rows)
    return {
        "requests": len(rows),
        "completed": len(ok),
        "completed_wrong_text": len(done) - len(ok),
        # steady is never faulted nor down: every request had a healthy candidate.
        "qualifying": len(rows),
        "completion_rate": len(ok) / len(rows) if rows else None,
        "failed": outcomes.get("failed", 0),
        "expired": outcomes.get("expired", 0),
        "other": sum(v for k, v in outcomes.items() if k not in {"completed", "failed", "expired"}),
        "dlq": side.get("dlq_messages")
        if system == "renqueue"
        else outcomes.get("failed", 0) + outcomes.get("expired", 0),
        "errors": dict(Counter(r["error"][:150] for r in rows if r.get("error")).most_common(6)),
        "latency_p50_s": percentile(latency, 50),
        "latency_p95_s": percentile(latency, 95),
        "latency_p99_s": percentile(latency, 99),
        "latency_max_s": max(latency, default=float("nan")),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "faulted": len(faulted),
        "faulted_completed": len(hit),
        "fell_back": len(fell),
        # LiteLLM's own count (x-litellm-attempted-fallbacks): it also counts moving on
        # from a deployment at its max_parallel_requests, with no call made.
        "fell_back_router_count": sum(1 for r in rows if (r.get("attempted_fallbacks") or 0) > 0)
        if system == "litellm"
        else None,
        "clean_p50_s": percentile(clean, 50),
        "clean_p95_s": percentile(clean, 95),
        "faulted_p50_s": percentile(hit, 50),
        "faulted_p95_s": percentile(hit, 95),
        "fell_back_p50_s": percentile(moved, 50),
        "fell_back_p95_s": percentile(moved, 95),
        "added_p50_s": percentile(moved, 50) - percentile(clean, 50),
        "added_p95_s": percentile(moved, 95) - percentile(clean, 95),
        "added_any_p50_s": percentile(hit, 50) - percentile(clean, 50),
        "added_any_p95_s": percentile(hit, 95) - percentile(clean, 95),
        "in_outage": len(in_outage),
        "in_outage_completed": sum(1 for r in in_outage if r["ok"]),
        "client_restarts": sum(r.get("restarts", 0) for r in rows),
        "served": {name: sum(1 for r in ok if r.get("backend") == name) for name in plan.cascade},
        "upstream_calls": {name: mocks[name]["requests"] for name in plan.cascade},
        "upstream_faults": {name: mocks[name].get("faults", {}) for name in plan.cascade},
        "upstream_completed": {name: mocks[name]["completed"] for name in plan.cascade},
        # Chat calls the outage backends did not answer (refused while down).
        "outage_refused": sum(
            mocks[b.name]["requests"] - mocks[b.name]["completed"]
            for b in plan.backends
            if b.outage
        ),
        "failed_calls": sum(len(calls) for calls in failed.values()),
        "failed_calls_by_kind": dict(
            Counter(call for calls in failed.values() for call in calls).most_common()
        ),
        "max_in_flight": {name: mocks[name]["max_in_flight_seen"] for name in plan.cascade},
        "wall_s": max((r["ended_at"] for r in rows), default=0.0) - t0,
        "cpu_s": side.get("cpu_s"),
    }


# ----------------------------------------------------------------------- print


def print_report(report: dict[str, Any]) -> None:
    plan = report["plan"]
    sides: dict[str, dict[str, Any]] = report["figures"]
    names = list(sides)
    cascade = [b["name"] for b in plan["backends"]]
    span = plan["requests"] / plan["rate"]
    print(
        f"\nFaults: {plan['requests']} requests at {plan['rate']:g}/s ({span:.0f} s), "
        f"streamed, deadline {plan['deadline']:g} s, max_tokens "
        f"{'/'.join(str(n) for n in plan['max_tokens'])}; route {' -> '.join(cascade)}"
    )
    for b in plan["backends"]:
        fault = (
            ", ".join(f"{k} {v:.0%}" for k, v in b["faults"].items())
            + (f" after {b['after_tokens']} tokens" if "break" in b["faults"] else "")
            if b["faults"]
            else ""
        )
        if b["outage"]:
            fault = f"down {plan['outage'][0]:.0%}-{plan['outage'][1]:.0%} of the arrivals " + (
                f"({plan['outage'][0] * span:.0f}-{plan['outage'][1] * span:.0f} s)"
            )
        print(
            f"  {b['name']:<8} {b['slots']} slots, ttft {b['ttft'] * 1000:.0f} ms, "
            f"{b['tokens_per_second']:g} tok/s; {fault or 'healthy'}"
        )
    if report.get("litellm_missing"):
        print(f"  LiteLLM: not run: {report['litellm_missing']}")
    width = 22
    print("\n  " + f"{'':<40}" + "".join(f"{n:>{width}}" for n in names))

    def line(label: str, cells: list[str]) -> None:
        print("  " + f"{label:<40}" + "".join(f"{c:>{width}}" for c in cells))

    def per_backend(key: str) -> list[str]:
        return ["/".join(str(sides[n][key][b]) for b in cascade) for n in names]

    def seconds(key: str) -> list[str]:
        return [f"{sides[n][key]:.2f}" for n in names]

    line(
        "completed (answer checked)", [f"{s['completed']}/{s['requests']}" for s in sides.values()]
    )
    line(
        "completion rate (healthy candidate: all)",
        [f"{s['completion_rate']:.1%}" for s in sides.values()],
    )
    line("failed", [str(s["failed"]) for s in sides.values()])
    line("expired", [str(s["expired"]) for s in sides.values()])
    line(
        "other / wrong text",
        [f"{s['other']} / {s['completed_wrong_text']}" for s in sides.values()],
    )
    line("in the DLQ (LiteLLM: raised)", [str(s["dlq"]) for s in sides.values()])
    line(
        "arrived in the outage: completed",
        [f"{s['in_outage_completed']}/{s['in_outage']}" for s in sides.values()],
    )
    line(
        "latency p50 / p95 / p99 s",
        [
            f"{s['latency_p50_s']:.2f}/{s['latency_p95_s']:.2f}/{s['latency_p99_s']:.2f}"
            for s in sides.values()
        ],
    )
    line("  max s", seconds("latency_max_s"))
    line(
        "first token p50 / p95 s",
        [f"{s['ttft_p50_s']:.2f}/{s['ttft_p95_s']:.2f}" for s in sides.values()],
    )
    line(
        "met a failed call / then fell back",
        [f"{s['faulted']} / {s['fell_back']}" for s in sides.values()],
    )
    line(
        "latency p50: clean / fell back / any fault",
        [
            f"{s['clean_p50_s']:.2f}/{s['fell_back_p50_s']:.2f}/{s['faulted_p50_s']:.2f}"
            for s in sides.values()
        ],
    )
    line(
        "latency p95: clean / fell back / any fault",
        [
            f"{s['clean_p95_s']:.2f}/{s['fell_back_p95_s']:.2f}/{s['faulted_p95_s']:.2f}"
            for s in sides.values()
        ],
    )
    line(
        "ADDED LATENCY, fell back: p50 / p95 s",
        [f"+{s['added_p50_s']:.2f} / +{s['added_p95_s']:.2f}" for s in sides.values()],
    )
    line(
        "  any failed call: p50 / p95 s",
        [f"+{s['added_any_p50_s']:.2f} / +{s['added_any_p95_s']:.2f}" for s in sides.values()],
    )
    line("streams restarted after text", [str(s["client_restarts"]) for s in sides.values()])
    line("served by " + "/".join(cascade), per_backend("served"))
    line("upstream calls " + "/".join(cascade), per_backend("upstream_calls"))
    line(
        "  faults: 500 / refused (down) / break",
        [
            f"{s['upstream_faults'][cascade[0]].get('500', 0)} / {s['outage_refused']} / "
            f"{s['upstream_faults'][cascade[2]].get('break', 0)}"
            for s in sides.values()
        ],
    )
    line("  failed calls the router saw", [str(s["failed_calls"]) for s in sides.values()])
    line(
        "fallbacks by LiteLLM's own count",
        [
            "-" if s["fell_back_router_count"] is None else str(s["fell_back_router_count"])
            for s in sides.values()
        ],
    )
    line("most in flight " + "/".join(cascade), per_backend("max_in_flight"))
    line("wall s (first submit -> last end)", seconds("wall_s"))
    line(
        "process CPU s",
        [f"{s['cpu_s']:.1f}" if s["cpu_s"] is not None else "-" for s in sides.values()],
    )
    for name in names:
        if sides[name]["errors"]:
            print(f"  {name} errors: {sides[name]['errors']}")
    side = report.get("renqueue")
    if side:
        log = side["log"]
        print(f"\n  ren-queue, its log: fell_back by class {log['fell_back_by_class'] or 'none'}")
        print(f"    fell_back by backend {log['fell_back_by_backend'] or 'none'}")
        print(f"    retrying {log['retrying'] or 'none'}; binds {log['routed']}")
        for backend, changes in log["circuits"].items():
            steps = ", ".join(
                f"{c['state']} at {c['at']:.1f}s ({_short(c['reason'])})" for c in changes
            )
            halves = sum(1 for c in changes if c["state"] == "half_open")
            print(f"    circuit {backend}: {steps}")
            if halves:
                calls = log["probe_calls"].get(backend, [])
                print(f"      {len(calls)} calls bound as its probe in {halves} half-open spells")
        if not log["circuits"]:
            print("    no circuit changed")
        for backend, answers in log["probes"].items():
            steps = ", ".join(f"{'up' if p['ok'] else 'down'} at {p['at']:.1f}s" for p in answers)
            print(f"    probe {backend}: {steps}")
        print(
            f"    audit: {len(log['lost'])} lost, {len(log['duplicated'])} with more than one "
            f"terminal event; terminal events {log['terminal_kinds']}"
        )
        for rid, lines in log["histories"].items():
            print(f"    history of {rid} (not completed or a wrong answer):")
            for text in lines:
                print(f"      {text}")
    for name, lit in report.get("litellm", {}).items():
        if "router_settings" in lit:
            print(
                f"\n  {name}: Router settings {lit['router_settings']}, {lit['router_kwargs']}, "
                f"fallbacks {lit['fallbacks']}"
            )


def _short(reason: str) -> str:
    """A circuit change's reason, shortened for the table."""
    return (
        reason.replace("backend faults in a row", "in a row")
        .replace(" s after it opened: one call decides", " s cool-off")
        .replace("calls failed in the last", "failed in")
        .replace("the health probe", "probe")
        .replace("the probe call", "probe call")
    )


# ------------------------------------------------------------------------ main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan(
        requests=args.requests,
        rate=args.rate,
        deadline=args.deadline,
        seed=args.seed,
        circuit_failures=args.circuit_failures,
        circuit_error_rate=args.circuit_error_rate,
        circuit_min_calls=args.circuit_min_calls,
        litellm_allowed_fails=args.litellm_allowed_fails,
    )
    if args.outage:
        plan = replace(plan, outage=(args.outage[0], args.outage[1]))
    workload = make_workload(plan)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "faults",
        "timestamp": stamp,
        "plan": asdict(plan),
        "workload": {
            "requests": len(workload),
            "max_tokens": dict(Counter(item["max_tokens"] for item in workload)),
            "prompt_chars_mean": sum(len(i["prompt"]) for i in workload) / max(1, len(workload)),
        },
        "machine": machine_info(httpx=httpx.__version__),
        "figures": {},
        "litellm": {},
    }
    began = time.perf_counter()
    if not args.no_renqueue:
        print("Ren-Queue phase ...", flush=True)
        side = await run_renqueue(plan, workload)
        report["renqueue"] = side
        report["figures"]["ren-queue"] = figures(plan, side, "renqueue")
    if not args.no_litellm:
        python, note = await asyncio.to_thread(litellm_python, args.fresh_litellm)
        report["litellm_install"] = note
        if python is None:
            report["litellm_missing"] = note
            print(f"  LiteLLM unavailable: {note}", flush=True)
        else:
            print("LiteLLM phase ...", flush=True)
            result = await run_litellm(plan, workload, python)
            if "error" in result:
                print(f"  {result['error']}", flush=True)
                report["litellm"]["litellm"] = result
            else:
                check_rows(plan, workload, result["rows"])
                report["litellm"]["litellm"] = result
                report["figures"]["litellm"] = figures(plan, result, "litellm")
    report["total_seconds"] = time.perf_counter() - began
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=480, help="requests in the workload")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--deadline", type=float, default=20.0, help="each request's deadline")
    parser.add_argument("--seed", type=int, default=9, help="seeds the workload and the faults")
    parser.add_argument(
        "--outage",
        type=float,
        nargs=2,
        metavar=("FROM", "TO"),
        help="when the outage backend is down, as shares of the arrivals (0.25 0.60)",
    )
    parser.add_argument(
        "--circuit-failures",
        type=int,
        default=5,
        help="Ren-Queue: open a circuit after this many backend faults in a row",
    )
    parser.add_argument(
        "--circuit-error-rate",
        type=float,
        default=0.5,
        help="Ren-Queue: open a circuit at this share of faults over 10 s ...",
    )
    parser.add_argument(
        "--circuit-min-calls", type=int, default=10, help="... of at least this many calls"
    )
    parser.add_argument(
        "--litellm-allowed-fails",
        type=int,
        help="set LiteLLM's allowed_fails (cool a deployment down after more failures than "
        "this within cooldown_time); default unset",
    )
    parser.add_argument("--no-renqueue", action="store_true", help="skip the Ren-Queue phase")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM phase")
    parser.add_argument(
        "--fresh-litellm", action="store_true", help="remake the LiteLLM venv before running"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    # The services log every fault they meet as a warning: thousands of lines here.
    configure_logging(level="ERROR")
    report = asyncio.run(run(args))
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"faults-{report['timestamp']}.json"
    text = json.dumps(report, indent=2, default=str) + "\n"
    path.write_text(text)
    (args.out / "faults-latest.json").write_text(text)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"\n  JSON: {shown}")
    print(f"  total {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
