"""Scheduling benchmark (issue #3): queue wait by priority level under overload.

Run with ``make bench-scheduling`` (about 3 minutes) or
``python bench/scheduling.py --quick`` (about a minute). Everything runs on
loopback: an embedded nats-server, a mock LLM with a fixed service time in a
child process, and ``Services`` (router, worker, projector) and one ``Client``
in this process, as ``bench/pipeline.py`` and the tests run them.

One open-loop arrival trace (Poisson, seeded, a fixed level mix) at about
twice the backend's capacity is played, identically, against:

1. Priority levels with short aging (``age_after`` 2 s at every level, so a
   ``batch`` request competes at the top after 8 s): the scheduler under test.
2. FIFO: one level (``priorities = ["fifo"]``), everything submitted there:
   the baseline, same arrivals, same backend.
3. Strict priority: the five levels with ``never_age`` (no aging): what
   priority alone does, so the effect of aging can be told apart.

Scenarios 1 and 3 turn preemption off (``preempts``/``preemptible`` false on
every level) so they measure ordering alone; ``--preemption`` keeps the
levels' defaults (critical preempts running low and batch work).

Wait = the ``started`` event's time minus the request's ``submitted_at``,
both read from the event log after the run (every request is followed to
completion: what is still queued when arrivals stop drains). Next to each
measured row the benchmark gives the same trace run through an ideal model of
the scheduling rules (``renqueue.scheduling.effective_rank``, N slots, the
service time measured in that run, zero routing overhead): the model says what
the rules promise; a gap between model and measurement is the implementation.

Preemption and work stealing are built but not measured here yet (issue #3):
the JSON holds a placeholder for each, no numbers.

Results: a table on stdout, JSON in ``bench/results/scheduling-<UTC>.json``
(+ ``scheduling-latest.json``) and a plot of wait by level over time in
``bench/results/scheduling-<UTC>.png`` (+ ``scheduling-latest.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import importlib.metadata
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from renqueue import Client, Services, parse_config
from renqueue.config import DEFAULT_PRIORITIES, Config
from renqueue.connection import connect
from renqueue.embedded import find_nats_server
from renqueue.logs import configure_logging
from renqueue.messages import EVENT_DECODER, Completed, Promoted, Routed, Started, is_terminal
from renqueue.scheduling import LevelPolicy, aging_bound, effective_rank
from renqueue.subjects import EVENTS_STREAM, REQUESTS_STREAM, router_consumer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BACKEND = "mock"
TENANT = "bench"
PROMPT = "Say something short."
LEVELS: tuple[str, ...] = tuple(DEFAULT_PRIORITIES)
#: Share of arrivals per level (critical 5 %, high 15 %, normal 40 %, low 20 %, batch 20 %).
MIX: dict[str, float] = {"critical": 0.05, "high": 0.15, "normal": 0.40, "low": 0.20, "batch": 0.20}
NOT_MEASURED = "not measured yet (issue #3): built, no scenario in this benchmark yet"


@dataclass(frozen=True)
class Plan:
    """The load: arrivals at ``overload`` x capacity for ``arrival_seconds``."""

    slots: int = 4
    ttft: float = 0.1
    output_tokens: int = 4
    overload: float = 2.0
    arrival_seconds: float = 20.0
    age_after: float = 2.0
    seed: int = 3
    strict: bool = True
    #: Keep the levels' default preemption (critical preempts running low and
    #: batch work). Off by default: scenarios 1 and 3 measure ordering alone.
    preemption: bool = False

    @property
    def nominal_capacity(self) -> float:
        """Requests/s the backend can serve if the service time were exactly ``ttft``."""
        return self.slots / self.ttft

    @property
    def arrival_rate(self) -> float:
        return self.overload * self.nominal_capacity


FULL = Plan()
QUICK = Plan(arrival_seconds=12.0, strict=False)


# --------------------------------------------------------------------- helpers


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Count, mean, p50/p95/p99/max of seconds."""
    return {
        "n": len(values),
        "mean_s": sum(values) / len(values) if values else float("nan"),
        "p50_s": percentile(values, 50),
        "p95_s": percentile(values, 95),
        "p99_s": percentile(values, 99),
        "max_s": max(values) if values else float("nan"),
    }


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


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        server = subprocess.run(
            [str(find_nats_server()), "--version"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        server = "unknown"
    try:
        nats_py = importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        nats_py = "unknown"
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_server": server,
        "nats_py": nats_py,
        "git_commit": git_commit(),
    }


# ------------------------------------------------------------------ arrivals


@dataclass(frozen=True)
class Arrival:
    offset: float  # seconds after the start of the scenario
    level: str


def arrival_trace(plan: Plan) -> list[Arrival]:
    """Poisson arrivals at ``plan.arrival_rate`` with levels drawn from :data:`MIX` (seeded)."""
    rng = random.Random(plan.seed)
    names = list(MIX)
    weights = [MIX[name] for name in names]
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(plan.arrival_rate)
        if t >= plan.arrival_seconds:
            return out
        out.append(Arrival(offset=t, level=rng.choices(names, weights)[0]))


# -------------------------------------------------------------- mock backend

_MOCK_CHILD = """
import asyncio, sys
from renqueue.logs import configure_logging
from renqueue.mockbackend import MockSettings, serve
configure_logging(level="WARNING")
settings = MockSettings(
    ttft=float(sys.argv[1]), tokens_per_second=0, output_tokens=int(sys.argv[2])
)
def ready(url):
    print(url, flush=True)
try:
    asyncio.run(serve(settings, port=0, on_ready=ready))
except KeyboardInterrupt:
    pass
"""


@contextlib.asynccontextmanager
async def mock_process(plan: Plan) -> AsyncIterator[str]:
    """The mock LLM (fixed ttft, all tokens at once) in its own process."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _MOCK_CHILD,
        str(plan.ttft),
        str(plan.output_tokens),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20.0)
        url = line.decode().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"mock backend did not start: {line!r}")
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()


# ------------------------------------------------------------------ scenarios


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    priorities: tuple[str, ...]
    levels: dict[str, dict[str, Any]]
    #: Submit every request at this level (FIFO); ``None`` = at its own level.
    submit_all_at: str | None = None


def scenarios(plan: Plan) -> list[Scenario]:
    age = f"{plan.age_after:g}s"
    # Explicit, so the defaults (critical preempts, low and batch preemptible) stay out.
    no_preemption: dict[str, Any] = (
        {} if plan.preemption else {"preempts": False, "preemptible": False}
    )
    out = [
        Scenario(
            key="priority_aging",
            title=f"priority levels + aging (age_after {age} at every level)"
            + ("" if plan.preemption else ", no preemption"),
            priorities=LEVELS,
            levels={
                name: {**no_preemption, **({"age_after": age} if name != LEVELS[0] else {})}
                for name in LEVELS
            },
        ),
        Scenario(
            key="fifo",
            title="FIFO baseline (one level)",
            priorities=("fifo",),
            levels={},
            submit_all_at="fifo",
        ),
    ]
    if plan.strict:
        out.append(
            Scenario(
                key="strict_priority",
                title="strict priority (five levels, never_age)"
                + ("" if plan.preemption else ", no preemption"),
                priorities=LEVELS,
                levels={
                    name: {**no_preemption, **({"never_age": True} if name != LEVELS[0] else {})}
                    for name in LEVELS
                },
            )
        )
    return out


def scenario_config(scenario: Scenario, data_dir: str, mock_url: str, plan: Plan) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "priorities": list(scenario.priorities),
            "default_priority": scenario.priorities[0],
            "levels": scenario.levels,
            "backends": {
                BACKEND: {
                    "base_url": mock_url,
                    "model": "mock",
                    "limits": {"concurrency": plan.slots},
                }
            },
            "routes": {"chat": {"backends": [BACKEND]}},
            "worker": {"drain_timeout": "5s"},
        },
        source=f"<bench:{scenario.key}>",
    )


@dataclass
class Record:
    """One request of the trace, as measured."""

    id: str
    level: str  # the level in the mix (what the request would be in a priority system)
    submit_level: str  # the level it was submitted at (``fifo`` in the baseline)
    submitted_at: float
    scheduled_offset: float
    outcome: str = ""
    routed_at: float | None = None
    queue_wait: float | None = None  # the router's own figure, in the routed event
    started_at: float | None = None
    completed_at: float | None = None
    service: float | None = None  # completed.at - started.at
    promotions: list[tuple[str, str, float]] = field(default_factory=list)

    @property
    def decided_at(self) -> float | None:
        """When the router bound it (else when it started)."""
        return self.routed_at if self.routed_at is not None else self.started_at

    @property
    def wait(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.submitted_at


async def read_events(js: Any) -> list[Any]:
    """Every event in the log, in order (one ephemeral pull consumer, no acks)."""
    psub = await js.pull_subscribe(
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
    events: list[Any] = []
    info = await js.stream_info(EVENTS_STREAM)
    last = int(info.state.last_seq)
    try:
        while True:
            try:
                msgs = await psub.fetch(batch=1000, timeout=2.0)
            except (TimeoutError, NatsTimeoutError):
                break
            done = False
            for msg in msgs:
                with contextlib.suppress(msgspec.DecodeError):
                    events.append(EVENT_DECODER.decode(msg.data))
                meta = msg.metadata
                if meta.num_pending == 0 or meta.sequence.stream >= last:
                    done = True
            if done:
                break
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
    return events


async def sample_queues(js: Any, config: Config, out: list[dict[str, Any]]) -> None:
    """Every second: per level, requests held by routers (delivered, unacked) and still in
    the stream (not yet delivered), from the router consumers' info."""
    while True:
        sample: dict[str, Any] = {"t": time.time()}
        for level in config.priorities:
            with contextlib.suppress(Exception):
                info = await js.consumer_info(REQUESTS_STREAM, router_consumer(level))
                sample[level] = {"held": info.num_ack_pending, "in_stream": info.num_pending}
        out.append(sample)
        await asyncio.sleep(1.0)


async def run_scenario(
    scenario: Scenario, plan: Plan, trace: list[Arrival], mock_url: str
) -> dict[str, Any]:
    """Play ``trace`` against fresh services configured for ``scenario``; measure every request."""
    records: dict[str, Record] = {}
    lateness: list[float] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix=f"renqueue-bench-{scenario.key}-") as tmp:
        config = scenario_config(scenario, tmp, mock_url, plan)
        async with Services(config, name="bench") as services:
            client_nc = await connect(services.url, name="bench-client")
            client = Client(client_nc, tenant=TENANT)
            try:
                # Warm-up (connections, pools, the client's event tap): not measured.
                warm = [
                    await client.submit(PROMPT, route="chat", priority=scenario.priorities[0])
                    for _ in range(plan.slots * 2)
                ]
                await asyncio.gather(*(handle.result(timeout=30) for handle in warm))

                async def one(arrival: Arrival, due: float) -> None:
                    level = scenario.submit_all_at or arrival.level
                    request = client.build_request(PROMPT, route="chat", priority=level)
                    lateness.append(time.time() - due)
                    records[request.id] = Record(
                        id=request.id,
                        level=arrival.level,
                        submit_level=level,
                        submitted_at=request.submitted_at,
                        scheduled_offset=arrival.offset,
                    )
                    try:
                        handle = await client.submit_request(request)
                        result = await handle.result(timeout=600)
                        records[request.id].outcome = "completed" if result.text else "empty"
                    except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
                        records[request.id].outcome = type(exc).__name__
                        if len(errors) < 3:
                            errors.append(f"{type(exc).__name__}: {exc}"[:200])

                samples: list[dict[str, Any]] = []
                sampler = asyncio.create_task(sample_queues(services.js, config, samples))
                tasks: list[asyncio.Task[None]] = []
                cpu_before = os.times()
                start = time.time()
                for arrival in trace:
                    due = start + arrival.offset
                    delay = due - time.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(arrival, due)))
                arrivals_end = time.time()
                print(
                    f"    {len(trace)} submitted in {arrivals_end - start:.1f}s; draining ...",
                    flush=True,
                )
                await asyncio.gather(*tasks)
                drained = time.time()
                cpu_after = os.times()
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
                for sample in samples:
                    sample["t"] = round(sample["t"] - start, 2)
                events = await read_events(services.js)
            finally:
                await client.close()
                await client_nc.drain()

    for event in events:
        record = records.get(event.request_id)
        if record is None:
            continue  # warm-up
        if isinstance(event, Started) and record.started_at is None:
            record.started_at = event.at
        elif isinstance(event, Routed) and record.routed_at is None:
            record.routed_at = event.at
            record.queue_wait = event.queue_wait
        elif isinstance(event, Promoted):
            record.promotions.append((event.from_level, event.to_level, event.waited))
        elif isinstance(event, Completed):
            record.completed_at = event.at
        if is_terminal(event) and not isinstance(event, Completed) and not record.outcome:
            record.outcome = type(event).__name__.lower()
    return {
        "records": list(records.values()),
        "start": start,
        "arrivals_end": arrivals_end,
        "drained": drained,
        "submit_lateness": summary(lateness),
        "python_cpu_cores": (
            cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system
        )
        / (drained - start),
        "queue_samples": samples,
        "errors": errors,
        "policies": config.level_policies(),
    }


# ---------------------------------------------------------------------- model


def model_waits(
    arrivals: Sequence[tuple[float, int]],
    policies: Sequence[LevelPolicy],
    slots: int,
    service: float,
) -> list[float]:
    """Ideal scheduler: ``slots`` servers, fixed ``service`` time, pick by the rules.

    ``arrivals`` are (submit time, rank) in submit order. Whenever a slot is
    free, the waiting request with the smallest (effective rank, submit time)
    starts; within one level the oldest request always has the smallest key,
    so only each level's head is compared. Returns each request's wait.
    """
    queues: list[deque[int]] = [deque() for _ in policies]
    free_at = [0.0] * slots
    heapq.heapify(free_at)
    waits = [0.0] * len(arrivals)
    index = 0
    now = 0.0
    done = 0
    while done < len(arrivals):
        now = max(now, heapq.heappop(free_at))
        while index < len(arrivals) and arrivals[index][0] <= now:
            queues[arrivals[index][1]].append(index)
            index += 1
        if not any(queues):  # idle: jump to the next arrival
            now = arrivals[index][0]
            queues[arrivals[index][1]].append(index)
            index += 1
        best: tuple[int, float] | None = None
        best_rank = 0
        for rank, queue in enumerate(queues):
            if queue:
                submitted = arrivals[queue[0]][0]
                key = (effective_rank(rank, now - submitted, policies), submitted)
                if best is None or key < best:
                    best, best_rank = key, rank
        chosen = queues[best_rank].popleft()
        waits[chosen] = now - arrivals[chosen][0]
        heapq.heappush(free_at, now + service)
        done += 1
    return waits


# ------------------------------------------------------------------- analysis


def analyse(raw: dict[str, Any], plan: Plan, scenario: Scenario) -> dict[str, Any]:
    records: list[Record] = raw["records"]
    policies: list[LevelPolicy] = raw["policies"]
    start: float = raw["start"]
    starts = [r.started_at for r in records if r.started_at is not None]
    ends = [r.completed_at for r in records if r.completed_at is not None]
    services = [
        r.completed_at - r.started_at
        for r in records
        if r.completed_at is not None and r.started_at is not None
    ]
    first = min(starts, default=start)
    last = max(ends, default=start)
    window_end: float = raw["arrivals_end"]
    done = len(ends)
    in_window = sum(1 for end in ends if end <= window_end)
    throughput = done / (last - first) if last > first else float("nan")
    # Slot time per request as the scheduler sees it (dispatch to freed slot),
    # from the measured throughput while saturated: the model's service time.
    slot_time = plan.slots / throughput if throughput == throughput else plan.ttft

    by_rank = {policy.name: policy.rank for policy in policies}
    ordered = sorted(records, key=lambda r: r.submitted_at)
    model = model_waits(
        [(r.submitted_at - start, by_rank[r.submit_level]) for r in ordered],
        policies,
        plan.slots,
        slot_time,
    )
    model_by_id = {r.id: w for r, w in zip(ordered, model, strict=True)}

    levels: dict[str, Any] = {}
    for level in LEVELS:
        rows = [r for r in records if r.level == level]
        waits = [r.wait for r in rows if r.wait is not None]
        policy = next((p for p in policies if p.name == level), None)
        bound = None if policy is None else aging_bound(policy.rank, policies)
        promoted_events: dict[str, int] = {}
        for r in rows:
            for from_level, to_level, _waited in r.promotions:
                step = f"{from_level}->{to_level}"
                promoted_events[step] = promoted_events.get(step, 0) + 1
        model_level = [model_by_id[r.id] for r in rows]
        levels[level] = {
            "submitted": len(rows),
            "completed": sum(1 for r in rows if r.completed_at is not None),
            "wait": summary(waits),
            "router_queue_wait": summary([r.queue_wait for r in rows if r.queue_wait is not None]),
            "aging_bound_s": bound,
            "over_bound": None if bound is None else sum(1 for w in waits if w > bound),
            "promoted_events": sum(promoted_events.values()),
            "promoted_requests": sum(1 for r in rows if r.promotions),
            "promotion_steps": promoted_events,
            "model_wait": summary(model_level),
        }
    all_waits = [r.wait for r in records if r.wait is not None]
    services_sorted = sorted(services)
    return {
        "title": scenario.title,
        "config": {
            "priorities": list(scenario.priorities),
            "levels": scenario.levels,
            "submit_all_at": scenario.submit_all_at,
        },
        "level_policies": [msgspec.to_builtins(p) for p in policies],
        "requests": len(records),
        "completed": done,
        "outcomes": _count(r.outcome for r in records),
        "errors": raw["errors"],
        "arrival_seconds": window_end - start,
        "drain_seconds": raw["drained"] - window_end,
        "total_seconds": raw["drained"] - start,
        "throughput_rps": throughput,
        "throughput_during_arrivals_rps": in_window / (window_end - first)
        if window_end > first
        else float("nan"),
        "service_s": summary(services_sorted),
        "model_slot_time_s": slot_time,
        "submit_lateness_s": raw["submit_lateness"],
        "python_cpu_cores": raw["python_cpu_cores"],
        "router_held_max": max(
            (
                sum(v["held"] for k, v in sample.items() if k != "t")
                for sample in raw["queue_samples"]
            ),
            default=0,
        ),
        "queue_samples": raw["queue_samples"],
        "wait_all": summary(all_waits),
        "model_wait_all": summary(model),
        "levels": levels,
        "out_of_order": out_of_order(records, policies),
        "series": [
            {
                "level": r.level,
                "t": round(r.submitted_at - start, 4),
                "wait": None if r.wait is None else round(r.wait, 4),
                "router_wait": None if r.queue_wait is None else round(r.queue_wait, 4),
                "model_wait": round(model_by_id[r.id], 4),
                "promotions": len(r.promotions),
            }
            for r in ordered
        ],
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


#: A request counts as overtaken only once it has been waiting this long (the
#: router has certainly read it) and still waits this much after the start.
VISIBLE_AFTER = 0.2
STILL_WAITING = 0.05


def out_of_order(records: Sequence[Record], policies: Sequence[LevelPolicy]) -> dict[str, Any]:
    """Routing decisions that broke the rules: another request had the smaller pick key.

    For each decision at time t (the ``routed`` event's time; ``started`` if
    none), every request still waiting (submitted at least
    :data:`VISIBLE_AFTER` before t, routed more than :data:`STILL_WAITING`
    after t) whose ``(effective rank at t, submitted_at)`` -- the router's own
    order -- is smaller than the routed one's was skipped. Within a level the
    key grows with submit time, so each level's waiting requests are scanned
    oldest first until the key is no longer smaller. Counted per level of the
    request that jumped ahead (its level in the mix).
    """
    rank = {policy.name: policy.rank for policy in policies}
    decided = [r for r in records if r.decided_at is not None]
    per_rank: list[list[Record]] = [[] for _ in policies]
    for r in sorted(decided, key=lambda r: r.submitted_at):
        per_rank[rank[r.submit_level]].append(r)
    low = [0] * len(policies)
    out: dict[str, Any] = {level: {"count": 0, "max_skipped": 0} for level in LEVELS}
    total = 0
    skipped_all: list[int] = []
    for r in sorted(decided, key=lambda r: r.decided_at or 0.0):
        t = r.decided_at or 0.0
        mine = (effective_rank(rank[r.submit_level], t - r.submitted_at, policies), r.submitted_at)
        skipped = 0
        for level_rank, rows in enumerate(per_rank):
            while low[level_rank] < len(rows) and (rows[low[level_rank]].decided_at or 0.0) <= t:
                low[level_rank] += 1  # routed by now: never waiting again
            for w in rows[low[level_rank] :]:
                if w.submitted_at > t - VISIBLE_AFTER:
                    break
                if (w.decided_at or 0.0) <= t + STILL_WAITING:
                    continue
                key = (effective_rank(level_rank, t - w.submitted_at, policies), w.submitted_at)
                if key >= mine:
                    break
                skipped += 1
        if skipped:
            total += 1
            skipped_all.append(skipped)
            out[r.level]["count"] += 1
            out[r.level]["max_skipped"] = max(out[r.level]["max_skipped"], skipped)
    return {
        "total": total,
        "share": total / len(decided) if decided else 0.0,
        "skipped_p50": percentile(skipped_all, 50) if skipped_all else 0,
        "skipped_max": max(skipped_all, default=0),
        "levels": out,
    }


# ---------------------------------------------------------------------- plot

COLOURS = {
    "critical": "#d62728",
    "high": "#ff7f0e",
    "normal": "#2ca02c",
    "low": "#1f77b4",
    "batch": "#9467bd",
}
MARKERS = {"critical": "o", "high": "^", "normal": "s", "low": "D", "batch": "v"}


def plot(report: dict[str, Any], path: Path) -> None:
    """One panel per scenario: wait (log) against submit time, one colour/marker per level."""
    import matplotlib  # noqa: PLC0415 - a dev extra, only needed here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.lines import Line2D  # noqa: PLC0415

    runs = report["scenarios"]
    fig, axes = plt.subplots(
        1, len(runs), figsize=(6.2 * len(runs), 5.4), sharey=True, squeeze=False
    )
    plan = report["plan"]
    for ax, (key, run) in zip(axes[0], runs.items(), strict=True):
        series = run["series"]
        for level in LEVELS:
            points = [(p["t"], p["wait"]) for p in series if p["level"] == level and p["wait"]]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.scatter(
                xs,
                ys,
                s=9 if level in ("critical", "high") else 6,
                c=COLOURS[level],
                marker=MARKERS[level],
                alpha=0.75 if level in ("critical", "high") else 0.45,
                linewidths=0,
                label=f"{level} ({MIX[level]:.0%})",
                zorder=3 if level == "critical" else 2,
            )
            bound = run["levels"][level]["aging_bound_s"]
            if key == "priority_aging" and bound:
                ax.axhline(bound, color=COLOURS[level], linestyle="--", linewidth=0.9, alpha=0.8)
        ax.axvline(run["arrival_seconds"], color="grey", linestyle=":", linewidth=1)
        ax.text(
            run["arrival_seconds"],
            0.5,
            "arrivals stop ",
            transform=ax.get_xaxis_transform(),
            color="grey",
            fontsize=8,
            rotation=90,
            ha="right",
            va="center",
        )
        ax.set_yscale("log")
        ax.set_ylim(0.01, max(1.0, run["wait_all"]["max_s"] * 1.5))
        ax.set_xlabel("submit time since start (s)")
        p50 = run["wait_all"]["p50_s"]
        ax.set_title(
            f"{run['title']}\nall: p50 {p50:.1f}s, max {run['wait_all']['max_s']:.1f}s, "
            f"{run['throughput_rps']:.1f} req/s served",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.25)
    axes[0][0].set_ylabel("queue wait: started.at - submitted_at (s, log)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(Line2D([0], [0], color="black", linestyle="--", linewidth=0.9))
    labels.append("aging bound B of the level\n(competes at the top after B)")
    axes[0][0].legend(handles, labels, loc="lower right", fontsize=8, markerscale=2)
    fig.suptitle(
        f"Ren-Queue scheduling: {plan['slots']} slots x {plan['ttft']}s service, arrivals "
        f"{plan['arrival_rate']:.0f}/s ({plan['overload']:.0f}x nominal capacity) for "
        f"{plan['arrival_seconds']:.0f}s, same trace in every panel  ({report['timestamp']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- report


def print_report(report: dict[str, Any]) -> None:
    plan = report["plan"]
    machine = report["machine"]
    print()
    print(
        f"Ren-Queue scheduling benchmark  {report['timestamp']}  "
        f"commit {machine['git_commit'][:12]}  mode {report['mode']}"
    )
    print(
        f"  {plan['slots']} slots x mock ttft {plan['ttft']}s (nominal capacity "
        f"{plan['nominal_capacity']:.0f} req/s); Poisson arrivals {plan['arrival_rate']:.0f}/s "
        f"for {plan['arrival_seconds']:.0f}s ({report['trace']['requests']} requests, seed "
        f"{plan['seed']}); mix " + ", ".join(f"{k} {v:.0%}" for k, v in MIX.items())
    )
    fifo = report["scenarios"].get("fifo")
    for index, (key, run) in enumerate(report["scenarios"].items(), 1):
        print(f"\n{index}. {run['title']}")
        print(
            f"  served {run['completed']}/{run['requests']} "
            f"(outcomes {run['outcomes']}), {run['throughput_rps']:.1f} req/s overall, "
            f"{run['throughput_during_arrivals_rps']:.1f} req/s while arrivals ran; "
            f"service p50 {run['service_s']['p50_s'] * 1000:.0f} ms; "
            f"drain {run['drain_seconds']:.0f}s after arrivals stopped; python process "
            f"{run['python_cpu_cores']:.2f} cores busy; routers held up to "
            f"{run['router_held_max']} requests"
        )
        print(
            f"  {'level':<9} {'n':>5} {'p50 s':>7} {'p95 s':>7} {'max s':>7}"
            f" {'bound s':>8} {'>bound':>6} {'promoted':>8} {'p50/FIFO':>9}"
            f" {'model p50':>9} {'model max':>9}"
        )
        for level, row in run["levels"].items():
            wait = row["wait"]
            bound = row["aging_bound_s"]
            ratio = (
                wait["p50_s"] / fifo["levels"][level]["wait"]["p50_s"]
                if fifo and key != "fifo"
                else float("nan")
            )
            print(
                f"  {level:<9} {wait['n']:>5} {wait['p50_s']:>7.2f} {wait['p95_s']:>7.2f}"
                f" {wait['max_s']:>7.2f} {'-' if bound is None else f'{bound:g}':>8}"
                f" {'-' if row['over_bound'] is None else row['over_bound']:>6}"
                f" {row['promoted_events']:>8} {'' if ratio != ratio else f'{ratio:.2f}':>9}"
                f" {row['model_wait']['p50_s']:>9.2f} {row['model_wait']['max_s']:>9.2f}"
            )
        w = run["wait_all"]
        print(
            f"  {'all':<9} {w['n']:>5} {w['p50_s']:>7.2f} {w['p95_s']:>7.2f} {w['max_s']:>7.2f}"
            f" {'':>8} {'':>6} {'':>8} {'':>9} {run['model_wait_all']['p50_s']:>9.2f}"
            f" {run['model_wait_all']['max_s']:>9.2f}"
        )
        ooo = run["out_of_order"]
        bad = {lv: v["count"] for lv, v in ooo["levels"].items() if v["count"]}
        print(
            "  out-of-order routing (bound while a request with a smaller (effective rank,"
            + " submitted_at) had waited >0.2 s): "
            + (
                "none"
                if not bad
                else f"{ooo['total']} ({ooo['share']:.1%}) by level {bad}; each jumped "
                f"ahead of {ooo['skipped_p50']:.0f} (p50), up to {ooo['skipped_max']} requests"
            )
            + f"; submit lateness p99 {run['submit_lateness_s']['p99_s'] * 1000:.0f} ms"
        )
        if run["errors"]:
            print(f"  errors: {run['errors']}")
    print()
    for name, entry in report["not_measured"].items():
        print(f"{name}: {entry['status']}")
    print("\n" + "\n".join(f"  {line}" for line in report["reading"]))


def reading(report: dict[str, Any]) -> list[str]:
    """A few computed sentences: the bound, and whether higher levels waited less."""
    out: list[str] = []
    plan = report["plan"]
    for key, run in report["scenarios"].items():
        if key == "fifo":
            continue
        p50s = [run["levels"][lv]["wait"]["p50_s"] for lv in LEVELS]
        maxes = [run["levels"][lv]["wait"]["max_s"] for lv in LEVELS]
        monotone = all(a <= b for a, b in itertools.pairwise(p50s))
        out.append(
            f"{key}: p50 wait by level (critical..batch) "
            + ", ".join(f"{v:.2f}" for v in p50s)
            + (" -- higher levels wait less" if monotone else " -- NOT ordered by level")
            + "; max "
            + ", ".join(f"{v:.1f}" for v in maxes)
        )
    aging = report["scenarios"].get("priority_aging")
    if aging:
        batch = aging["levels"]["batch"]
        bound = batch["aging_bound_s"]
        out.append(
            f"batch: aging bound B = {bound:g}s (competes at the top after B); measured max "
            f"wait {batch['wait']['max_s']:.1f}s, {batch['over_bound']}/{batch['wait']['n']} "
            f"over B; the ideal model of the same rules gives max "
            f"{batch['model_wait']['max_s']:.1f}s (B + the older top-level backlog to drain)."
        )
        backlog = sum(
            1 for p in aging["series"] if p["t"] + (p["wait"] or 0.0) > aging["arrival_seconds"]
        )
        out.append(
            f"under {plan['overload']:.0f}x overload the backlog only grows ({backlog} requests "
            f"waiting when arrivals stopped, {backlog / aging['throughput_rps']:.0f}s of service): "
            "once the oldest waiting requests are older than every level's bound, aged requests "
            "alone arrive at the top faster than they are served, and the top level is "
            "oldest-first, so fresh critical work queues behind them: FIFO."
        )
    for key, run in report["scenarios"].items():
        ooo = run["out_of_order"]
        out.append(
            f"{key}: {ooo['total']} routing decisions ({ooo['share']:.1%}) overtook a request "
            "the rules put first (see README: a slot freed during a dispatch round goes to "
            "the request the round is looking at)."
        )
    return out


# ------------------------------------------------------------------------ main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    if args.seconds:
        plan = Plan(**{**asdict(plan), "arrival_seconds": args.seconds})
    if args.no_strict:
        plan = Plan(**{**asdict(plan), "strict": False})
    if args.preemption:
        plan = Plan(**{**asdict(plan), "preemption": True})
    trace = arrival_trace(plan)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "scheduling",
        "timestamp": stamp,
        "mode": "quick" if args.quick else "full",
        "plan": {
            **asdict(plan),
            "nominal_capacity": plan.nominal_capacity,
            "arrival_rate": plan.arrival_rate,
        },
        "mix": MIX,
        "machine": machine_info(),
        "trace": {
            "requests": len(trace),
            "by_level": _count(a.level for a in trace),
        },
        "scenarios": {},
    }
    began = time.perf_counter()
    items = scenarios(plan)
    async with mock_process(plan) as mock_url:
        for index, scenario in enumerate(items, 1):
            print(f"{index}/{len(items)} {scenario.title} ...", flush=True)
            raw = await run_scenario(scenario, plan, trace, mock_url)
            report["scenarios"][scenario.key] = analyse(raw, plan, scenario)
    report["not_measured"] = {
        "preemption": {
            "status": NOT_MEASURED,
            "built": "yes (e101fa8: an urgent request takes a slot from running batch work)",
            "what": "urgent arrivals preempting running low/batch work: their wait, the "
            "service time thrown away, throughput. Scenarios 1 and 3 run with preemption "
            "off unless --preemption.",
        },
        "work_stealing": {
            "status": NOT_MEASURED,
            "built": "yes (c5a4f8f: an idle replica takes work queued on a busy pool sibling)",
            "what": "an idle backend taking work queued on a busy sibling (needs two backends)",
        },
    }
    report["reading"] = reading(report)
    report["total_seconds"] = time.perf_counter() - began
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="12 s of arrivals, no strict run")
    parser.add_argument("--seconds", type=float, default=0.0, help="arrival window (s)")
    parser.add_argument("--no-strict", action="store_true", help="skip the strict-priority run")
    parser.add_argument(
        "--preemption",
        action="store_true",
        help="keep the levels' default preemption in the priority runs (off: ordering alone)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write JSON + PNG")
    args = parser.parse_args()
    configure_logging(level="WARNING")
    report = asyncio.run(run(args))
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"scheduling-{report['timestamp']}"
    text = json.dumps(report, indent=2) + "\n"
    base.with_suffix(".json").write_text(text)
    (args.out / "scheduling-latest.json").write_text(text)
    plot(report, base.with_suffix(".png"))
    (args.out / "scheduling-latest.png").write_bytes(base.with_suffix(".png").read_bytes())
    shown = base.relative_to(ROOT) if base.is_relative_to(ROOT) else base
    print(f"\n  JSON: {shown}.json\n  plot: {shown}.png")
    print(f"  total {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
