"""Scheduling benchmark (issue #3): wait by level under overload, preemption, work stealing;
the binding order across several routers and binding after a router dies (issue #7).

Run with ``make bench-scheduling`` (about 3.5 minutes) or
``python bench/scheduling.py --quick`` (about 1.5 minutes). Everything runs on
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
the scheduling rules (``renqueue.policy.effective_rank``, N slots, the
service time measured in that run, zero routing overhead): the model says what
the rules promise; a gap between model and measurement is the implementation.

Two more parts, each with its own backends and runs:

4. Preemption: one backend, every slot running long batch calls (plus a
   backlog); critical requests arrive one by one. Their submit -> start, with
   the levels' default preemption and with ``[levels.critical] preempts =
   false``; the batch runs preempted, the tokens they had streamed (thrown
   away), and whether everything still completed.
5. Work stealing: two replicas of one model, one slow (ttft 1 s), one fast
   (0.1 s). (a) Poisson traffic through the router; (b) a burst of dispatches
   published straight to the slow replica's subject (what over-filling routers
   leave there). Each with and without a shared ``pool`` (stealing needs one):
   wait, each replica's calls and utilisation, ``stolen`` events.

And one part whose services are separate OS processes:

6. Binding order across routers: the ordering part's backend under strict priority,
   the same trace against 1 and against 3 ``renqueue router`` processes (plus a
   ``renqueue worker`` process), at 2x and 1x capacity: binds that passed over a more
   urgent, older waiting request (from the event log, server times), critical
   requests left waiting while batch work was bound, wait by level. Then failover:
   3 router processes under steady overload, the router that binds ``kill -9``-ed a
   few times: kill -> next bind, and what became of the requests it held
   (:class:`RouterTap` tells the router processes apart by their inbox prefixes).

``--only ordering|preemption|stealing|binding`` (repeatable) runs a subset.

Results: a table on stdout, JSON in ``bench/results/scheduling-<UTC>.json``
(+ ``scheduling-latest.json``) and a plot of wait by level over time in
``bench/results/scheduling-<UTC>.png`` (+ ``scheduling-latest.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
from chaos import (
    FILE_STORE,
    Fleet,
    NatsNode,
    Slot,
    log_problems,
    provision_with_retries,
    until_jetstream_answers,
)
from chaos import Backend as ChaosBackend
from common import (
    RESULTS,
    ROOT,
    machine_info,
    mock_process,
    percentile,
    read_stream,
    read_stream_stamped,
)
from common import read_events as read_events_on

from renqueue import Client, Services, parse_config
from renqueue.broker import connect
from renqueue.config import DEFAULT_PRIORITIES, Config, load_config
from renqueue.logs import configure_logging
from renqueue.policy import LevelPolicy, aging_bound, effective_rank
from renqueue.schema import (
    EVENT_DECODER,
    EVENTS_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    TOKENS_STREAM,
    Completed,
    Dispatch,
    Preempted,
    Promoted,
    Routed,
    Started,
    Stolen,
    Submitted,
    TokenChunk,
    dispatch_subject,
    encode,
    facts,
    is_terminal,
    msg_id,
    router_consumer,
)

BACKEND = "mock"
TENANT = "bench"
PROMPT = "Say something short."
LEVELS: tuple[str, ...] = tuple(DEFAULT_PRIORITIES)
#: Share of arrivals per level (critical 5 %, high 15 %, normal 40 %, low 20 %, batch 20 %).
MIX: dict[str, float] = {"critical": 0.05, "high": 0.15, "normal": 0.40, "low": 0.20, "batch": 0.20}
#: The two replicas of scenario 5 (route cascade order: slow first).
SLOW = "replica-slow"
#: The parts of the benchmark (``--only``).
PARTS = ("ordering", "preemption", "stealing", "binding")
FAST = "replica-fast"


@dataclass(frozen=True)
class PreemptionPlan:
    """Scenario 4: critical requests arriving while every slot runs long batch work.

    ``batch_requests`` batch calls of ``batch_tokens`` at ``tokens_per_second``
    (5 s each) are submitted at once: they fill every slot and leave a backlog
    of one more round. ``lead`` seconds later, ``critical_requests`` critical
    requests arrive ``critical_every`` seconds apart (all before the first
    batch round ends), each short (``max_tokens = critical_tokens``: 0.25 s)."""

    slots: int = 4
    tokens_per_second: float = 20.0
    batch_tokens: int = 100
    batch_requests: int = 8
    lead: float = 0.5
    critical_requests: int = 10
    critical_every: float = 0.4
    critical_tokens: int = 5

    @property
    def batch_call(self) -> float:
        return self.batch_tokens / self.tokens_per_second


@dataclass(frozen=True)
class StealingPlan:
    """Scenario 5: two replicas of one model, one slow (``slow_ttft``), one fast.

    (a) Poisson traffic at ``rate``/s for ``seconds`` through the router
    (route cascade: slow replica first); (b) ``burst`` dispatches published
    straight to the slow replica's subject, as over-filling routers would
    leave them. Each with and without ``pool`` (stealing needs a pool)."""

    slots: int = 4
    slow_ttft: float = 1.0
    fast_ttft: float = 0.1
    output_tokens: int = 4
    rate: float = 20.0
    seconds: float = 6.0
    burst: int = 24
    seed: int = 5
    router_path: bool = True


@dataclass(frozen=True)
class BindingPlan:
    """Scenario 6 (issue #7): the binding order across routers, and binding after one dies.

    The ordering part's backend (``Plan.slots`` slots, mock ttft ``Plan.ttft``) under
    strict priority (five levels, ``never_age``, no preemption): ordering alone.
    Routers, the worker and the projector are ``renqueue`` processes of their own on a
    nats-server of their own. (a) For each load in ``overloads``: Poisson arrivals at
    that multiple of capacity for ``arrival_seconds`` (seeded), the same trace played
    against each count in ``routers``. 2x is issue #7's overload; at 1x batch work is
    bound while more urgent work arrives, so a critical request can wait behind it.
    (b) ``failover_routers`` routers under ``failover_overload`` x capacity: ``kills``
    times, ``kill_every`` s apart from ``kill_lead`` s, the router that binds is
    ``kill -9``-ed and replaced at once; arrivals stop ``kill_tail`` s after the last
    kill."""

    routers: tuple[int, ...] = (1, 3)
    overloads: tuple[float, ...] = (2.0, 1.0)
    arrival_seconds: float = 20.0
    seed: int = 3
    #: One routing round: a more urgent, older request counts as passed over only if
    #: it was waiting at least this long before the bind (also reported with 0).
    round_slack: float = 0.05
    failover: bool = True
    failover_routers: int = 3
    failover_overload: float = 1.25
    kills: int = 5
    kill_every: float = 6.0
    kill_lead: float = 5.0
    kill_tail: float = 2.0
    #: ``router.ack_wait`` in the failover run (consumers and keepalive); None: the
    #: default (30 s), so a killed router's held requests come back after 30 s.
    failover_ack_wait: float | None = None
    seed_failover: int = 7


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
    preempt: PreemptionPlan = field(default_factory=PreemptionPlan)
    steal: StealingPlan = field(default_factory=StealingPlan)
    binding: BindingPlan = field(default_factory=BindingPlan)

    @property
    def nominal_capacity(self) -> float:
        """Requests/s the backend can serve if the service time were exactly ``ttft``."""
        return self.slots / self.ttft

    @property
    def arrival_rate(self) -> float:
        return self.overload * self.nominal_capacity


FULL = Plan()
QUICK = Plan(
    arrival_seconds=12.0,
    strict=False,
    preempt=PreemptionPlan(batch_tokens=60, critical_requests=6),
    steal=StealingPlan(burst=16, router_path=False),
    binding=BindingPlan(
        overloads=(2.0,), arrival_seconds=10.0, kills=3, kill_every=5.0, kill_lead=4.0
    ),
)


# --------------------------------------------------------------------- helpers


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


async def mock_calls(url: str) -> int:
    """Chat requests the mock has received so far (its ``/stats``)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        response = await http.get(url.removesuffix("/v1") + "/stats")
        response.raise_for_status()
        return int(response.json()["requests"])


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
                levels=strict_levels(preemption=plan.preemption),
            )
        )
    return out


def strict_levels(*, preemption: bool) -> dict[str, dict[str, Any]]:
    """``[levels.*]`` of strict priority: the five levels, no aging (``never_age``) and,
    unless ``preemption``, explicitly no preemption (the defaults have some)."""
    no_preemption: dict[str, Any] = {} if preemption else {"preempts": False, "preemptible": False}
    return {
        name: {**no_preemption, **({"never_age": True} if name != LEVELS[0] else {})}
        for name in LEVELS
    }


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
    """Every event of the bench tenant in the log, in order."""
    return await read_events_on(js, f"rq.evt.{TENANT}.>")


_CHUNK_DECODER = msgspec.json.Decoder(TokenChunk)


async def read_chunks(js: Any) -> list[TokenChunk]:
    """Every token chunk streamed to the bench tenant, in order."""
    chunks: list[TokenChunk] = []
    for data in await read_stream(js, TOKENS_STREAM, f"rq.tok.{TENANT}.>"):
        with contextlib.suppress(msgspec.DecodeError):
            chunks.append(_CHUNK_DECODER.decode(data))
    return chunks


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


# ------------------------------------------------- preemption and work stealing


@dataclass
class RunSpan:
    """One backend call of a request, from the event log: ``started`` to its end."""

    request_id: str
    backend: str
    delivery: int
    started: float
    ended: float | None = None
    how: str = ""  # "completed", "preempted" or another terminal kind


def run_spans(events: Sequence[Any]) -> dict[tuple[str, int], RunSpan]:
    """Every run (request id, delivery) with its start and how it ended."""
    spans: dict[tuple[str, int], RunSpan] = {}
    for event in events:
        if isinstance(event, Started):
            spans.setdefault(
                (event.request_id, event.delivery),
                RunSpan(event.request_id, event.backend, event.delivery, event.at),
            )
        elif isinstance(event, Preempted | Completed):
            span = spans.get((event.request_id, event.delivery))
            if span is not None and span.ended is None:
                span.ended = event.at
                span.how = "preempted" if isinstance(event, Preempted) else "completed"
    return spans


def bench_config(
    data_dir: str,
    backends: dict[str, dict[str, Any]],
    route: list[str],
    *,
    levels: dict[str, dict[str, Any]] | None = None,
    source: str,
) -> Config:
    """Five default levels, the given backends, one route ``chat``."""
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "priorities": list(LEVELS),
            "levels": levels or {},
            "backends": backends,
            "routes": {"chat": {"backends": route}},
            "worker": {"drain_timeout": "5s"},
        },
        source=source,
    )


async def run_preemption(pp: PreemptionPlan, mock_url: str, *, preemption: bool) -> dict[str, Any]:
    """Fill every slot with long batch calls (plus a backlog), then submit critical
    requests one by one; follow everything to completion."""
    key = "on" if preemption else "off"
    # On: the defaults (critical preempts, batch preemptible). Off: critical does not.
    levels = {} if preemption else {"critical": {"preempts": False}}
    outcomes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"renqueue-bench-preempt-{key}-") as tmp:
        config = bench_config(
            tmp,
            {BACKEND: {"base_url": mock_url, "model": "mock", "limits": {"concurrency": pp.slots}}},
            [BACKEND],
            levels=levels,
            source=f"<bench:preemption-{key}>",
        )
        async with Services(config, name="bench") as services:
            client_nc = await connect(services.url, name="bench-client")
            client = Client(client_nc, tenant=TENANT)
            try:
                warm = [
                    await client.submit(PROMPT, route="chat", priority="critical", max_tokens=1)
                    for _ in range(pp.slots * 2)
                ]
                await asyncio.gather(*(handle.result(timeout=30) for handle in warm))

                async def follow(request_id: str, handle: Any) -> None:
                    try:
                        result = await handle.result(timeout=300)
                        outcomes[request_id] = (
                            "completed" if result.usage.completion_tokens else "empty"
                        )
                    except Exception as exc:  # noqa: BLE001 - counted and shown
                        outcomes[request_id] = type(exc).__name__

                calls_before = await mock_calls(mock_url)
                start = time.time()
                batch: dict[str, float] = {}
                tasks: list[asyncio.Task[None]] = []
                for _ in range(pp.batch_requests):
                    request = client.build_request(PROMPT, route="chat", priority="batch")
                    batch[request.id] = request.submitted_at
                    handle = await client.submit_request(request)
                    tasks.append(asyncio.create_task(follow(request.id, handle)))
                critical: dict[str, float] = {}
                for index in range(pp.critical_requests):
                    delay = start + pp.lead + index * pp.critical_every - time.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    request = client.build_request(
                        PROMPT, route="chat", priority="critical", max_tokens=pp.critical_tokens
                    )
                    critical[request.id] = request.submitted_at
                    handle = await client.submit_request(request)
                    tasks.append(asyncio.create_task(follow(request.id, handle)))
                await asyncio.gather(*tasks)
                drained = time.time()
                calls = await mock_calls(mock_url) - calls_before
                events = await read_events(services.js)
                chunks = await read_chunks(services.js)
            finally:
                await client.close()
                await client_nc.drain()
    raw = {"start": start, "drained": drained, "backend_calls": calls}
    return analyse_preemption(pp, preemption, raw, batch, critical, outcomes, events, chunks)


def analyse_preemption(
    pp: PreemptionPlan,
    preemption: bool,
    raw: dict[str, float],
    batch: dict[str, float],
    critical: dict[str, float],
    outcomes: dict[str, str],
    events: Sequence[Any],
    chunks: Sequence[TokenChunk],
) -> dict[str, Any]:
    start = raw["start"]
    spans = run_spans(events)
    first_start: dict[str, float] = {}
    for span in sorted(spans.values(), key=lambda span: span.started):
        first_start.setdefault(span.request_id, span.started)
    waits = {rid: first_start[rid] - at for rid, at in critical.items() if rid in first_start}
    batch_spans = [span for span in spans.values() if span.request_id in batch]

    def batch_running(t: float) -> int:
        return sum(
            1
            for span in batch_spans
            if span.started <= t and (span.ended is None or span.ended > t)
        )

    preempted = [e for e in events if isinstance(e, Preempted) and e.request_id in batch]
    lost_runs = {(e.request_id, e.delivery) for e in preempted}
    tokens_by_run: dict[tuple[str, int], int] = {}
    for chunk in chunks:
        if chunk.text:
            run = (chunk.request_id, chunk.delivery)
            tokens_by_run[run] = tokens_by_run.get(run, 0) + 1
    lost_tokens = sum(tokens_by_run.get(run, 0) for run in lost_runs)
    lost_seconds = sum(
        e.at - spans[(e.request_id, e.delivery)].started
        for e in preempted
        if (e.request_id, e.delivery) in spans
    )
    completed = {e.request_id: e for e in events if isinstance(e, Completed)}
    batch_full = sum(
        1
        for rid in batch
        if rid in completed and completed[rid].usage.completion_tokens == pp.batch_tokens
    )
    batch_done = [completed[rid].at for rid in batch if rid in completed]
    served_tokens = sum(tokens_by_run.values())
    preemptors = {e.by for e in preempted}
    return {
        "title": "preemption on (defaults: critical preempts, batch preemptible)"
        if preemption
        else "preemption off ([levels.critical] preempts = false)",
        "levels": {} if preemption else {"critical": {"preempts": False}},
        "requests": len(batch) + len(critical),
        "outcomes": _count(outcomes.values()),
        "all_completed": all(v == "completed" for v in outcomes.values())
        and len(outcomes) == len(batch) + len(critical),
        "critical_wait": summary(list(waits.values())),
        "critical_series": [
            {"t": round(at - start, 3), "wait": round(waits[rid], 4) if rid in waits else None}
            for rid, at in sorted(critical.items(), key=lambda item: item[1])
        ],
        "batch_running_at_critical_submit_min": min(
            (batch_running(at) for at in critical.values()), default=0
        ),
        "criticals_that_preempted": len(preemptors & set(critical)),
        "preempted_runs": len(preempted),
        "preempted_requests": len({e.request_id for e in preempted}),
        "preemptions_of_one_request_max": max(
            _count(e.request_id for e in preempted).values(), default=0
        ),
        "lost_tokens": lost_tokens,
        "lost_slot_seconds": lost_seconds,
        "tokens_streamed": served_tokens,
        "batch_tokens_needed": pp.batch_requests * pp.batch_tokens,
        "batch_completed_full": batch_full,
        "batch_last_completed_s": max(batch_done) - start if batch_done else float("nan"),
        "backend_calls": int(raw["backend_calls"]),
        "total_seconds": raw["drained"] - start,
    }


def steal_trace(sp: StealingPlan) -> list[float]:
    """Poisson arrival offsets at ``sp.rate`` for ``sp.seconds`` (seeded)."""
    rng = random.Random(sp.seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(sp.rate)
        if t >= sp.seconds:
            return out
        out.append(t)


async def run_stealing(
    sp: StealingPlan, urls: dict[str, str], *, pool: bool, burst: bool
) -> dict[str, Any]:
    """Two replicas (slow first in the route); traffic through the router, or a burst
    of dispatches bound to the slow one. ``pool`` puts both in one pool."""
    key = f"{'burst' if burst else 'router'}-{'pool' if pool else 'nopool'}"
    backends = {
        name: {
            "base_url": urls[name],
            "model": "mock",
            "limits": {"concurrency": sp.slots},
            **({"pool": "bench-pool"} if pool else {}),
        }
        for name in (SLOW, FAST)
    }
    outcomes: dict[str, str] = {}
    submitted: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix=f"renqueue-bench-steal-{key}-") as tmp:
        config = bench_config(tmp, backends, [SLOW, FAST], source=f"<bench:stealing-{key}>")
        async with Services(config, name="bench") as services:
            client_nc = await connect(services.url, name="bench-client")
            client = Client(client_nc, tenant=TENANT)
            try:
                # Warm-up through the router: fills the slow replica, then the fast one.
                warm = [await client.submit(PROMPT, route="chat") for _ in range(sp.slots * 2)]
                await asyncio.gather(*(handle.result(timeout=30) for handle in warm))

                async def follow(request_id: str, handle: Any) -> None:
                    try:
                        result = await handle.result(timeout=300)
                        outcomes[request_id] = "completed" if result.text else "empty"
                    except Exception as exc:  # noqa: BLE001 - counted and shown
                        outcomes[request_id] = type(exc).__name__

                tasks: list[asyncio.Task[None]] = []
                calls_before = {name: await mock_calls(urls[name]) for name in (SLOW, FAST)}
                start = time.time()
                if burst:
                    # As several routers over-filling the slow replica would leave it:
                    # its slots busy, the rest waiting on its subject.
                    for _ in range(sp.burst):
                        request = client.build_request(PROMPT, route="chat")
                        submitted[request.id] = request.submitted_at
                        await client.js.publish(
                            dispatch_subject(SLOW),
                            encode(Dispatch(request=request, backend=SLOW)),
                            headers={
                                "Nats-Msg-Id": msg_id(request.tenant, request.id, "dispatch", 1)
                            },
                        )
                        handle = client.handle(request.id)
                        tasks.append(asyncio.create_task(follow(request.id, handle)))
                else:
                    for offset in steal_trace(sp):
                        delay = start + offset - time.time()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        request = client.build_request(PROMPT, route="chat")
                        submitted[request.id] = request.submitted_at
                        handle = await client.submit_request(request)
                        tasks.append(asyncio.create_task(follow(request.id, handle)))
                await asyncio.gather(*tasks)
                drained = time.time()
                calls = {
                    name: await mock_calls(urls[name]) - calls_before[name] for name in (SLOW, FAST)
                }
                events = await read_events(services.js)
            finally:
                await client.close()
                await client_nc.drain()
    raw = {"start": start, "drained": drained, "backend_calls": calls}
    return analyse_stealing(sp, pool, burst, raw, submitted, outcomes, events)


def analyse_stealing(
    sp: StealingPlan,
    pool: bool,
    burst: bool,
    raw: dict[str, Any],
    submitted: dict[str, float],
    outcomes: dict[str, str],
    events: Sequence[Any],
) -> dict[str, Any]:
    start: float = raw["start"]
    drained: float = raw["drained"]
    mine = [e for e in events if e.request_id in submitted]
    spans = run_spans(mine)
    first_start: dict[str, float] = {}
    for span in sorted(spans.values(), key=lambda span: span.started):
        first_start.setdefault(span.request_id, span.started)
    completed = {e.request_id: e for e in mine if isinstance(e, Completed)}
    routed = {e.request_id: e.backend for e in mine if isinstance(e, Routed)}
    stolen = [e for e in mine if isinstance(e, Stolen)]
    end = max((e.at for e in completed.values()), default=drained)
    window = max(end - start, 1e-9)
    replicas: dict[str, Any] = {}
    for name in (SLOW, FAST):
        done = [e for e in completed.values() if e.backend == name]
        busy = sum(
            e.at - spans[(e.request_id, e.delivery)].started
            for e in done
            if (e.request_id, e.delivery) in spans
        )
        replicas[name] = {
            "bound": sum(1 for backend in routed.values() if backend == name)
            if not burst
            else (len(submitted) if name == SLOW else 0),
            "calls": len(done),
            "backend_calls": raw["backend_calls"][name],
            "busy_slot_seconds": busy,
            "utilisation": busy / (sp.slots * window),
            "calls_per_s": len(done) / window,
        }
    waits = [first_start[rid] - at for rid, at in submitted.items() if rid in first_start]
    latency = [completed[rid].at - at for rid, at in submitted.items() if rid in completed]
    series = sorted(
        (
            {
                "t": round(at - start, 4),
                "wait": round(first_start[rid] - at, 4) if rid in first_start else None,
                "backend": completed[rid].backend if rid in completed else None,
            }
            for rid, at in submitted.items()
        ),
        key=lambda row: row["t"] or 0.0,
    )
    return {
        "title": ("burst bound to the slow replica" if burst else "router path")
        + (", pool (stealing)" if pool else ", no pool"),
        "pool": pool,
        "requests": len(submitted),
        "outcomes": _count(outcomes.values()),
        "all_completed": all(v == "completed" for v in outcomes.values())
        and len(outcomes) == len(submitted),
        "wait": summary(waits),
        "latency": summary(latency),
        "stolen_events": len(stolen),
        # Stolen, but the sibling's worker had received the original first: the
        # thief's copy stepped back (same `started` id), the request ran where it was.
        "stolen_but_ran_on_sibling": sum(
            1
            for e in stolen
            if e.request_id in completed and completed[e.request_id].backend == e.from_backend
        ),
        "stolen_pairs": _count(f"{e.from_backend}->{e.to_backend}" for e in stolen),
        "window_s": window,
        "replicas": replicas,
        "series": series,
    }


# ------------------------------------------ binding order across routers (issue #7)

#: Inbox prefix of the router processes of the binding part, one per process:
#: ``<TAP_PREFIX>.<slot>.<generation>`` (see :class:`RouterTap`).
TAP_PREFIX = "_INBOX_RQB"


def binding_config_text(
    url: str,
    mock_url: str,
    slots: int,
    *,
    inbox_prefix: str | None = None,
    ack_wait: float | None = None,
) -> str:
    """The TOML every process of the binding part reads: strict priority (no aging, no
    preemption), one backend ``mock`` of ``slots`` slots, route ``chat``. A router
    process gets its own ``inbox_prefix``; ``ack_wait`` sets ``router.ack_wait``."""
    lines = [
        "# Written by bench/scheduling.py (binding part).",
        "priorities = [" + ", ".join(f'"{name}"' for name in LEVELS) + "]",
        f'default_priority = "{LEVELS[0]}"',
        "",
        "[nats]",
        f'url = "{url}"',
        # The streams' shares of the store NatsNode gives its server (the default, 16GB,
        # asks more than that server has: RQ_EVENTS was refused).
        f'max_file_store = "{FILE_STORE}"',
        *([f'inbox_prefix = "{inbox_prefix}"'] if inbox_prefix else []),
        "",
        "[worker]",
        'drain_timeout = "2s"',
        *(["", "[router]", f'ack_wait = "{ack_wait:g}s"'] if ack_wait else []),
    ]
    for name, options in strict_levels(preemption=False).items():
        lines += ["", f"[levels.{name}]"]
        lines += [f"{key} = {'true' if value else 'false'}" for key, value in options.items()]
    lines += [
        "",
        f"[backends.{BACKEND}]",
        f'base_url = "{mock_url}"',
        'model = "mock"',
        f"[backends.{BACKEND}.limits]",
        f"concurrency = {slots}",
        "",
        "[routes.chat]",
        f'backends = ["{BACKEND}"]',
        "",
    ]
    return "\n".join(lines)


@dataclass
class TapDelivery:
    """A request message JetStream delivered to a router process."""

    who: str  # ``<slot>.<generation>``: one router process
    t: float  # this process's clock at receipt
    stream_seq: int
    delivered: int
    request_id: str
    consumer: str  # ``router-<level>``


class RouterTap:
    """What each router process receives and binds, heard from outside on core NATS.

    Every router process runs with its own ``nats.inbox_prefix``
    (``<TAP_PREFIX>.<slot>.<generation>``), which nats-py uses for every inbox of
    that connection. So: the request messages its pull consumers receive
    (JetStream delivers them to the puller's inbox) are heard by subscribing under
    that prefix; a ``routed`` event it publishes carries a reply subject under it
    (JetStream's publish ack), which names the binder; and an ack, nak or term of a
    request message (``$JS.ACK.RQ_REQUESTS.<consumer>.<delivered>.<seq>...``) ends
    that delivery. Nothing here relies on the router's code, only on its
    connection honouring ``nats.inbox_prefix``. Times are this process's clock at
    receipt (event-loop lag included)."""

    def __init__(self, nc: Any) -> None:
        self._nc = nc
        self._subs: list[Any] = []
        self.deliveries: list[TapDelivery] = []
        #: (stream seq, delivered) -> (time, "ack" | "nak" | "term"): that delivery ended.
        self.ended: dict[tuple[int, int], tuple[float, str]] = {}
        #: request id -> (router process, time) of the first ``routed`` publish heard.
        self.binders: dict[str, tuple[str, float]] = {}
        self.binds: list[tuple[float, str]] = []

    async def start(self) -> None:
        self._subs.append(await self._nc.subscribe(f"$JS.ACK.{REQUESTS_STREAM}.>", cb=self._on_ack))
        self._subs.append(await self._nc.subscribe(f"rq.evt.{TENANT}.*.routed", cb=self._on_routed))
        # A request bound at once: its binding is carried by its `submitted` event.
        self._subs.append(
            await self._nc.subscribe(f"rq.evt.{TENANT}.*.submitted", cb=self._on_submitted)
        )
        await self._nc.flush()

    async def watch(self, who: str) -> str:
        """Listen under a new router process's inbox prefix (before it starts); returns
        the prefix to configure it with."""
        prefix = f"{TAP_PREFIX}.{who}"

        async def on_delivery(msg: Any) -> None:
            self._on_delivery(who, msg)

        # `<prefix>.<nuid>`: pull and push subscriptions; publish acks are one token deeper.
        self._subs.append(await self._nc.subscribe(f"{prefix}.*", cb=on_delivery))
        await self._nc.flush()
        return prefix

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    def _on_delivery(self, who: str, msg: Any) -> None:
        parts = (msg.reply or "").split(".")
        if len(parts) < 9 or parts[:3] != ["$JS", "ACK", REQUESTS_STREAM]:
            return  # a status message, a KV watch, another stream
        try:
            request_id = REQUEST_DECODER.decode(msg.data).id
        except msgspec.DecodeError:
            request_id = ""
        self.deliveries.append(
            TapDelivery(
                who=who,
                t=time.time(),
                stream_seq=int(parts[5]),
                delivered=int(parts[4]),
                request_id=request_id,
                consumer=parts[3],
            )
        )

    async def _on_ack(self, msg: Any) -> None:
        parts = msg.subject.split(".")
        if len(parts) < 9:
            return
        data = bytes(msg.data)
        if data in (b"", b"+ACK") or data.startswith(b"+NXT"):
            kind = "ack"
        elif data.startswith(b"-NAK"):
            kind = "nak"
        elif data.startswith(b"+TERM"):
            kind = "term"
        else:
            return  # +WPI: in progress, still held
        self.ended.setdefault((int(parts[5]), int(parts[4])), (time.time(), kind))

    async def _on_routed(self, msg: Any) -> None:
        parts = (msg.reply or "").split(".")
        who = f"{parts[1]}.{parts[2]}" if len(parts) > 3 and parts[0] == TAP_PREFIX else "?"
        now = time.time()
        self.binds.append((now, who))
        self.binders.setdefault(msg.subject.split(".")[3], (who, now))

    async def _on_submitted(self, msg: Any) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            event = EVENT_DECODER.decode(msg.data)
            if isinstance(event, Submitted) and event.routed is not None:
                await self._on_routed(msg)

    def summary(self) -> dict[str, int]:
        return {
            "deliveries": len(self.deliveries),
            "redeliveries": sum(1 for d in self.deliveries if d.delivered > 1),
            "deliveries_ended": len(self.ended),
            "routed_heard": len(self.binds),
            "routed_binder_unknown": sum(1 for _t, who in self.binds if who == "?"),
        }

    def recent_binds(self, since: float) -> Counter[str]:
        """``routed`` publishes heard since ``since``, per router process."""
        return Counter(who for t, who in self.binds if t >= since)


async def read_events_stamped(js: Any) -> list[tuple[Any, float]]:
    """Every event of the bench tenant in the log, with the server's time of storing it."""
    events: list[tuple[Any, float]] = []
    for data, stored in await read_stream_stamped(js, EVENTS_STREAM, f"rq.evt.{TENANT}.>"):
        with contextlib.suppress(msgspec.DecodeError):
            # A `submitted` carrying its binding: the pair, both stored then.
            events.extend((fact, stored) for fact in facts(EVENT_DECODER.decode(data)))
    return events


def pick_victim(
    fleet: Fleet, tap: RouterTap, rng: random.Random, *, window: float = 2.0
) -> tuple[Slot | None, dict[str, int], str]:
    """The router to kill: the one that bound the most in the last ``window`` s (the
    only one, once a single router binds); a random started one if none bound."""
    routers = [s for s in fleet.slots if s.role == "router" and s.alive]
    ready = [s for s in routers if s.is_ready()] or routers
    if not ready:
        return None, {}, "no router alive"
    current = {f"{slot.name}.{slot.generation}": slot for slot in ready}
    recent = tap.recent_binds(time.time() - window)
    counts = {who: recent.get(who, 0) for who in current}
    best = max(counts.values())
    if best == 0:
        return rng.choice(ready), counts, f"random (no router bound in the last {window:g} s)"
    binding = sum(1 for n in counts.values() if n)
    slot = current[rng.choice([who for who, n in counts.items() if n == best])]
    return slot, counts, ("the only router binding" if binding == 1 else f"busiest of {binding}")


async def run_binding(
    plan: Plan,
    bp: BindingPlan,
    mock_url: str,
    trace: list[Arrival],
    *,
    routers: int,
    kills: Sequence[float] = (),
    ack_wait: float | None = None,
    keep: bool = False,
) -> dict[str, Any]:
    """``routers`` ``renqueue router`` processes and one ``renqueue worker`` process on a
    nats-server of their own; play ``trace``; ``kill -9`` the binding router at each
    offset in ``kills`` (replaced at once). Returns what the analysis needs."""
    workdir = Path(tempfile.mkdtemp(prefix=f"renqueue-bench-binding-{routers}-"))
    records: dict[str, str] = {}  # request id -> level
    outcomes: dict[str, str] = {}
    errors: list[str] = []
    kill_log: list[dict[str, Any]] = []
    rng = random.Random(bp.seed + routers)
    load_before = os.getloadavg()
    node = NatsNode("bench-binding", workdir / "nats")
    try:
        async with contextlib.AsyncExitStack() as stack:
            await node.start()
            stack.push_async_callback(node.stop)
            base = workdir / "renqueue.toml"
            base.write_text(binding_config_text(node.url, mock_url, plan.slots, ack_wait=ack_wait))
            config = load_config(base, environ={})
            nc = await connect(node.url, name="bench-harness", config=config.nats)
            stack.push_async_callback(nc.close)
            await until_jetstream_answers(nc)
            await provision_with_retries(nc, config)
            tap = RouterTap(nc)
            await tap.start()

            async def config_for(slot: Slot) -> Path:
                if slot.role != "router":
                    return base
                prefix = await tap.watch(f"{slot.name}.{slot.generation}")
                path = workdir / f"{slot.name}-{slot.generation:03d}.toml"
                path.write_text(
                    binding_config_text(
                        node.url, mock_url, plan.slots, inbox_prefix=prefix, ack_wait=ack_wait
                    )
                )
                return path

            fleet = Fleet(
                base,
                node.url,
                workdir / "logs",
                routers=routers,
                backends=(ChaosBackend(name=BACKEND, slots=plan.slots),),
                config_for=config_for,
            )
            stack.push_async_callback(fleet.stop)
            began = time.time()
            await fleet.start()
            ready_s = time.time() - began
            client_nc = await connect(node.url, name="bench-client", config=config.nats)
            stack.push_async_callback(client_nc.close)
            client = Client(client_nc, tenant=TENANT)
            stack.push_async_callback(client.close)
            warm = [
                await client.submit(PROMPT, route="chat", priority=LEVELS[0])
                for _ in range(plan.slots * 2)
            ]
            await asyncio.gather(*(handle.result(timeout=60) for handle in warm))

            async def one(arrival: Arrival) -> None:
                request = client.build_request(PROMPT, route="chat", priority=arrival.level)
                records[request.id] = arrival.level
                try:
                    handle = await client.submit_request(request)
                    result = await handle.result(timeout=600)
                    outcomes[request.id] = "completed" if result.text else "empty"
                except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
                    outcomes[request.id] = type(exc).__name__
                    if len(errors) < 3:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])

            async def killer(start: float) -> None:
                for offset in kills:
                    delay = start + offset - time.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    slot, counts, how = pick_victim(fleet, tap, rng)
                    if slot is None:
                        kill_log.append({"t": time.time(), "who": None, "how": how})
                        continue
                    who = f"{slot.name}.{slot.generation}"
                    at = time.time()
                    await fleet.kill(slot)
                    kill_log.append(
                        {
                            "t": at,
                            "offset_s": round(at - start, 3),
                            "who": who,
                            "how": how,
                            "binds_last_2s": counts,
                        }
                    )

            tasks: list[asyncio.Task[None]] = []
            start = time.time()
            killing = asyncio.create_task(killer(start))
            for arrival in trace:
                delay = start + arrival.offset - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(arrival)))
            arrivals_end = time.time()
            print(
                f"    {len(trace)} submitted in {arrivals_end - start:.1f}s; draining ...",
                flush=True,
            )
            await killing
            await asyncio.gather(*tasks)
            drained = time.time()
            events = await read_events_stamped(nc.jetstream())
            await tap.stop()
            problems = log_problems(fleet.log_files())
            spawned = fleet.spawned
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "routers": routers,
        "records": records,
        "outcomes": outcomes,
        "errors": errors,
        "events": events,
        "tap": tap,
        "kills": kill_log,
        "start": start,
        "arrivals_end": arrivals_end,
        "drained": drained,
        "services_ready_s": ready_s,
        "processes_spawned": spawned,
        "log_problems": problems,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "policies": config.level_policies(),
        "routes": {name: list(route.backends) for name, route in config.routes.items()},
        "ack_wait_s": ack_wait,
        "workdir": str(workdir) if keep else None,
    }


@dataclass
class Bind:
    """One request of a binding run, from the event log (server times)."""

    id: str
    level: str
    rank: int
    submitted: float  # the `submitted` event's time: when the broker stored the request
    candidates: tuple[str, ...]
    routed: float | None = None  # when the broker stored its first `routed` event
    backend: str | None = None
    binder: str | None = None  # the router process that published it (RouterTap)
    started: float | None = None
    completed: float | None = None
    #: (time, router process) of each delivery of its request message (RouterTap).
    deliveries: list[tuple[float, str]] = field(default_factory=list)

    def waiting_at(self, t: float) -> bool:
        """Not bound by time ``t``."""
        return self.routed is None or self.routed > t

    def holder_at(self, t: float) -> tuple[str, float] | None:
        """The router process its latest delivery by ``t`` went to, and when; None:
        none yet (still in the stream, as far as the tap heard)."""
        held = [(who, at) for at, who in self.deliveries if at <= t]
        return held[-1] if held else None


def binds_from_log(
    events: Sequence[tuple[Any, float]],
    ids: Sequence[str] | None,
    routes: dict[str, list[str]],
    tap: RouterTap,
) -> dict[str, Bind]:
    """Every request (of ``ids``, or all) with its submit, first bind, start and end,
    and what the tap heard: who bound it, where it was delivered."""
    binders = tap.binders
    wanted = None if ids is None else set(ids)
    rank = {name: index for index, name in enumerate(LEVELS)}
    out: dict[str, Bind] = {}
    for event, stored in events:
        if wanted is not None and event.request_id not in wanted:
            continue
        if isinstance(event, Submitted) and event.request_id not in out:
            request = event.request
            out[event.request_id] = Bind(
                id=event.request_id,
                level=request.priority,
                rank=rank.get(request.priority, len(LEVELS)),
                submitted=event.at,
                candidates=tuple(routes.get(request.route, ())),
            )
            continue
        bind = out.get(event.request_id)
        if bind is None:
            continue
        if isinstance(event, Routed) and bind.routed is None:
            bind.routed, bind.backend = stored, event.backend
            bind.binder = binders.get(event.request_id, (None, 0.0))[0]
        elif isinstance(event, Started) and bind.started is None:
            bind.started = event.at
        elif isinstance(event, Completed) and bind.completed is None:
            bind.completed = event.at
    for delivery in tap.deliveries:
        bind = out.get(delivery.request_id)
        if bind is not None:
            bind.deliveries.append((delivery.t, delivery.who))
    return out


#: Slacks (s) the out-of-order rate is also given for, in the JSON and the table.
LONGER_SLACKS = (0.25, 1.0)


def passed_over(binds: Sequence[Bind], slack: float) -> dict[str, Any]:
    """Binds that broke issue #7's rule: a ``routed`` event for r at server time t is
    out of order if some q of a more urgent level, capable of r's backend, whose wait
    began before r's (``submitted``) and at least ``slack`` before t (one routing
    round), was not bound by t. Counted per level of r, with how many it passed."""
    by_rank: list[list[Bind]] = [[] for _ in range(len(LEVELS) + 1)]
    for b in sorted(binds, key=lambda b: b.submitted):
        by_rank[b.rank].append(b)
    low = [0] * len(by_rank)
    levels: dict[str, Any] = {level: {"count": 0, "max_passed": 0} for level in LEVELS}
    total = 0
    passed_all: list[int] = []
    # Where each passed-over request was at t (as the tap heard it): held by the
    # router that bound r, by another router, or not delivered to any yet.
    where = {"same_router": 0, "another_router": 0, "not_delivered": 0}
    #: Per class: how long before t the passed-over request had been delivered there,
    #: and (all classes) how long it had waited since submitted.
    held_for: dict[str, list[float]] = {"same_router": [], "another_router": []}
    waited: list[float] = []
    by_another = 0
    bound = sorted((b for b in binds if b.routed is not None), key=lambda b: b.routed or 0.0)
    for r in bound:
        t = r.routed or 0.0
        passed = 0
        elsewhere = False
        for rank in range(r.rank):
            rows = by_rank[rank]
            while low[rank] < len(rows) and not rows[low[rank]].waiting_at(t):
                low[rank] += 1  # bound by now: never waiting again
            for q in rows[low[rank] :]:
                if q.submitted >= r.submitted or q.submitted > t - slack:
                    break
                if q.waiting_at(t) and r.backend in q.candidates:
                    passed += 1
                    waited.append(t - q.submitted)
                    holder = q.holder_at(t)
                    if holder is None:
                        where["not_delivered"] += 1
                        continue
                    place = "same_router" if holder[0] == r.binder else "another_router"
                    where[place] += 1
                    held_for[place].append(t - holder[1])
                    elsewhere = elsewhere or place == "another_router"
        by_another += elsewhere
        if passed:
            total += 1
            passed_all.append(passed)
            levels[r.level]["count"] += 1
            levels[r.level]["max_passed"] = max(levels[r.level]["max_passed"], passed)
    return {
        "slack_s": slack,
        "binds": len(bound),
        "out_of_order": total,
        "rate": total / len(bound) if bound else 0.0,
        "passed_p50": percentile(passed_all, 50) if passed_all else 0,
        "passed_max": max(passed_all, default=0),
        "levels": levels,
        "out_of_order_passing_one_held_by_another_router": by_another,
        "passed_over_where": where,
        "passed_over_delivered_ago_s": {k: summary(v) for k, v in held_for.items()},
        "passed_over_waited_s": summary(waited),
    }


def critical_behind_batch(binds: Sequence[Bind], slack: float) -> dict[str, Any]:
    """Critical requests that waited while a batch request was bound: some batch b,
    capable of the critical c's backend candidates, was bound at t_b with c waiting
    since at least ``slack`` before t_b and not bound by t_b (whatever b's age)."""
    critical = [b for b in binds if b.rank == 0]
    batch = sorted(
        (b for b in binds if b.rank == len(LEVELS) - 1 and b.routed is not None),
        key=lambda b: b.routed or 0.0,
    )
    affected = 0
    pairs = 0
    other_router = 0
    for c in critical:
        ahead = [
            b
            for b in batch
            if c.submitted <= (b.routed or 0.0) - slack
            and c.waiting_at(b.routed or 0.0)
            and b.backend in c.candidates
        ]
        if ahead:
            affected += 1
            pairs += len(ahead)
            other_router += sum(1 for b in ahead if b.binder and c.binder and b.binder != c.binder)
    return {
        "slack_s": slack,
        "critical": len(critical),
        "critical_behind_batch": affected,
        "batch_binds_ahead": pairs,
        "of_which_by_another_router": other_router,
    }


def analyse_binding(raw: dict[str, Any], bp: BindingPlan) -> dict[str, Any]:
    tap: RouterTap = raw["tap"]
    binds = binds_from_log(raw["events"], list(raw["records"]), raw["routes"], tap)
    rows = list(binds.values())
    start: float = raw["start"]
    ends = [b.completed for b in rows if b.completed is not None]
    starts = [b.started for b in rows if b.started is not None]
    first = min(starts, default=start)
    last = max(ends, default=start)
    # Bound but not finished at once (routed -> completed): over 4 means dispatches
    # waited in the backend subject (routers over-filling the backend).
    edges = sorted(
        [(b.routed, 1) for b in rows if b.routed is not None]
        + [(b.completed, -1) for b in rows if b.completed is not None and b.routed is not None]
    )
    level_now = peak = 0
    for _t, step in edges:
        level_now += step
        peak = max(peak, level_now)
    # The ordering part's figure, on the same binds: the router's own key, a request
    # counts once it waited 0.2 s and still waits 50 ms after the decision.
    as_records = [
        Record(
            id=b.id,
            level=b.level,
            submit_level=b.level,
            submitted_at=b.submitted,
            scheduled_offset=b.submitted - start,
            routed_at=b.routed,
            started_at=b.started,
        )
        for b in rows
        if b.rank < len(LEVELS)
    ]
    levels: dict[str, Any] = {}
    for level in LEVELS:
        mine = [b for b in rows if b.level == level]
        levels[level] = {
            "submitted": len(mine),
            "wait": summary([b.started - b.submitted for b in mine if b.started is not None]),
            "bind_wait": summary([b.routed - b.submitted for b in mine if b.routed is not None]),
        }
    by_router = Counter(b.binder or "?" for b in rows if b.routed is not None)
    return {
        "routers": raw["routers"],
        "requests": len(raw["records"]),
        "logged": len(rows),
        "bound": sum(1 for b in rows if b.routed is not None),
        "completed": len(ends),
        "outcomes": _count(raw["outcomes"].values()),
        "errors": raw["errors"],
        "out_of_order": passed_over(rows, bp.round_slack),
        "out_of_order_slack_0": passed_over(rows, 0.0),
        # Longer slacks tell a lagging round (a few hundred ms on a loaded machine)
        # from passing over a request that another router holds for seconds.
        "out_of_order_by_slack": {
            f"{slack:g}": {
                key: value
                for key, value in passed_over(rows, slack).items()
                if key in ("out_of_order", "rate", "passed_over_where")
            }
            for slack in LONGER_SLACKS
        },
        "critical_behind_batch": critical_behind_batch(rows, bp.round_slack),
        "critical_behind_batch_slack_0": critical_behind_batch(rows, 0.0),
        "ordering_part_figure": out_of_order(as_records, raw["policies"]),
        "binds_by_router": dict(sorted(by_router.items())),
        "tap": tap.summary(),
        "bound_not_finished_max": peak,
        "throughput_rps": len(ends) / (last - first) if last > first else float("nan"),
        "arrival_seconds": raw["arrivals_end"] - start,
        "drain_seconds": raw["drained"] - raw["arrivals_end"],
        "services_ready_s": raw["services_ready_s"],
        "loadavg_before": raw["loadavg_before"],
        "loadavg_after": raw["loadavg_after"],
        "log_problems": raw["log_problems"],
        "wait_all": summary([b.started - b.submitted for b in rows if b.started is not None]),
        "levels": levels,
        "workdir": raw["workdir"],
    }


def analyse_failover(raw: dict[str, Any]) -> dict[str, Any]:
    """Per kill: the time to the next bind, and what became of the requests the killed
    router held (delivered to it and never acked, nak'ed or terminated)."""
    tap: RouterTap = raw["tap"]
    binds = binds_from_log(raw["events"], None, raw["routes"], tap)
    bound = sorted(
        (b for b in binds.values() if b.routed is not None), key=lambda b: b.routed or 0.0
    )
    by_seq: dict[int, list[TapDelivery]] = {}
    for d in tap.deliveries:
        by_seq.setdefault(d.stream_seq, []).append(d)
    kills: list[dict[str, Any]] = []
    for kill in raw["kills"]:
        at, victim = kill["t"], kill["who"]
        row: dict[str, Any] = {k: v for k, v in kill.items() if k != "t"}
        if victim is None:
            kills.append(row)
            continue
        after = [b for b in bound if (b.routed or 0.0) > at]
        other = [b for b in after if b.binder not in (victim, None)]
        row["next_routed_s"] = (after[0].routed or 0.0) - at if after else None
        row["next_routed_by"] = after[0].binder if after else None
        row["next_routed_by_another_s"] = (other[0].routed or 0.0) - at if other else None
        row["next_routed_by_another"] = other[0].binder if other else None
        held = [
            d
            for d in tap.deliveries
            if d.who == victim and (d.stream_seq, d.delivered) not in tap.ended
        ]
        # Bound by the victim itself, stored after the kill: its decision was on the way.
        waiting = [
            d
            for d in held
            if d.request_id in binds
            and binds[d.request_id].waiting_at(at)
            and binds[d.request_id].binder != victim
        ]
        row["held"] = len(held)
        row["held_already_bound"] = len(held) - len(waiting)
        row["held_waiting"] = len(waiting)
        row["held_by_level"] = _count(d.consumer.removeprefix("router-") for d in waiting)
        redelivered = []
        for d in waiting:
            again = [x.t for x in by_seq.get(d.stream_seq, []) if x.delivered > d.delivered]
            if again:
                redelivered.append(min(again) - at)
        routed_after = [
            (binds[d.request_id].routed or 0.0) - at
            for d in waiting
            if binds[d.request_id].routed is not None
        ]
        row["held_redelivered"] = len(redelivered)
        row["first_redelivery_s"] = min(redelivered, default=None)
        row["held_routed"] = len(routed_after)
        row["first_held_routed_s"] = min(routed_after, default=None)
        row["last_held_routed_s"] = max(routed_after, default=None)
        row["held_routed_s"] = summary(routed_after)
        kills.append(row)

    def worst(key: str) -> float | None:
        values = [row[key] for row in kills if row.get(key) is not None]
        return max(values, default=None)

    records = raw["records"]
    completed = sum(1 for v in raw["outcomes"].values() if v == "completed")
    return {
        "routers": raw["routers"],
        "requests": len(records),
        "completed": completed,
        "outcomes": _count(raw["outcomes"].values()),
        "errors": raw["errors"],
        "router_ack_wait_s": raw["ack_wait_s"],
        "kills": kills,
        "tap": tap.summary(),
        "max_next_routed_s": worst("next_routed_s"),
        "max_next_routed_by_another_s": worst("next_routed_by_another_s"),
        "max_first_redelivery_s": worst("first_redelivery_s"),
        "max_first_held_routed_s": worst("first_held_routed_s"),
        "max_last_held_routed_s": worst("last_held_routed_s"),
        "processes_spawned": raw["processes_spawned"],
        "services_ready_s": raw["services_ready_s"],
        "arrival_seconds": raw["arrivals_end"] - raw["start"],
        "drain_seconds": raw["drained"] - raw["arrivals_end"],
        "loadavg_before": raw["loadavg_before"],
        "loadavg_after": raw["loadavg_after"],
        "log_problems": raw["log_problems"],
        "workdir": raw["workdir"],
    }


async def run_binding_part(plan: Plan, *, keep: bool = False) -> dict[str, Any]:
    """Part 6: the binding order with each router count, then the failover run."""
    bp = plan.binding
    section: dict[str, Any] = {"plan": asdict(bp), "loads": {}}
    async with mock_process(ttft=plan.ttft, output_tokens=plan.output_tokens) as (mock_url, _):
        for overload in bp.overloads:
            load = replace(
                plan, overload=overload, arrival_seconds=bp.arrival_seconds, seed=bp.seed
            )
            trace = arrival_trace(load)
            runs: dict[str, Any] = {}
            section["loads"][f"{overload:g}x"] = {
                "overload": overload,
                "arrival_rate": load.arrival_rate,
                "requests": len(trace),
                "runs": runs,
            }
            for routers in bp.routers:
                print(
                    f"binding order at {overload:g}x capacity, {routers} router process(es) ...",
                    flush=True,
                )
                raw = await run_binding(plan, bp, mock_url, trace, routers=routers, keep=keep)
                runs[f"routers_{routers}"] = analyse_binding(raw, bp)
        if bp.failover:
            seconds = bp.kill_lead + (bp.kills - 1) * bp.kill_every + bp.kill_tail
            steady = replace(
                plan,
                overload=bp.failover_overload,
                arrival_seconds=seconds,
                seed=bp.seed_failover,
            )
            kills = [bp.kill_lead + index * bp.kill_every for index in range(bp.kills)]
            print(
                f"failover: {bp.failover_routers} routers, {bp.kills} kills ...",
                flush=True,
            )
            raw = await run_binding(
                plan,
                bp,
                mock_url,
                arrival_trace(steady),
                routers=bp.failover_routers,
                kills=kills,
                ack_wait=bp.failover_ack_wait,
                keep=keep,
            )
            section["failover"] = {
                "arrival_rate": steady.arrival_rate,
                "planned_arrival_seconds": seconds,
                **analyse_failover(raw),
            }
    return section


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
    """Top row: one panel per ordering scenario (wait, log, against submit time, one
    colour/marker per level). Bottom row: preemption, work stealing (burst), replica
    utilisation."""
    import matplotlib  # noqa: PLC0415 - a dev extra, only needed here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [
        part
        for part, present in (
            ("ordering", bool(report["scenarios"])),
            ("extra", "preemption" in report or "work_stealing" in report),
        )
        if present
    ]
    if not rows:
        return
    columns = max(3, len(report["scenarios"]))
    heights = {"ordering": 5.6, "extra": 4.6}
    fig = plt.figure(
        figsize=(6.2 * columns, sum(heights[row] for row in rows)), layout="constrained"
    )
    subfigs = fig.subfigures(
        len(rows), 1, height_ratios=[heights[row] for row in rows], squeeze=False
    )[:, 0]
    for subfig, row in zip(subfigs, rows, strict=True):
        if row == "ordering":
            plot_ordering(subfig, report)
        else:
            axes = subfig.subplots(1, 3, squeeze=False)[0]
            plot_preemption(axes[0], report.get("preemption"))
            plot_stealing(axes[1], report.get("work_stealing"))
            plot_utilisation(axes[2], report.get("work_stealing"))
            subfig.suptitle(
                "Preemption (4) and work stealing (5): separate runs, own backends",
                fontsize=10,
            )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ordering(subfig: Any, report: dict[str, Any]) -> None:
    from matplotlib.lines import Line2D  # noqa: PLC0415

    runs = report["scenarios"]
    axes = subfig.subplots(1, len(runs), sharey=True, squeeze=False)
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
    subfig.suptitle(
        f"Ren-Queue scheduling: {plan['slots']} slots x {plan['ttft']}s service, arrivals "
        f"{plan['arrival_rate']:.0f}/s ({plan['overload']:.0f}x nominal capacity) for "
        f"{plan['arrival_seconds']:.0f}s, same trace in every panel  ({report['timestamp']})",
        fontsize=10,
    )


def plot_preemption(ax: Any, section: dict[str, Any] | None) -> None:
    """Critical submit -> start against submit time, with and without preemption."""
    if section is None:
        ax.set_axis_off()
        return
    pp = section["plan"]
    style = {"on": ("#d62728", "o", "with preemption"), "off": ("#7f7f7f", "^", "without")}
    for key, run in section["runs"].items():
        colour, marker, label = style[key]
        points = [(p["t"], p["wait"]) for p in run["critical_series"] if p["wait"] is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            wait = run["critical_wait"]
            ax.plot(
                xs,
                ys,
                marker=marker,
                color=colour,
                linestyle="-",
                linewidth=0.8,
                label=f"{label}: p50 {wait['p50_s']:.2f}s, max {wait['max_s']:.2f}s"
                + (
                    f"\n  ({run['preempted_runs']} batch runs preempted, "
                    f"{run['lost_tokens']} tokens lost)"
                    if key == "on"
                    else ""
                ),
            )
    ax.axhline(
        pp["batch_tokens"] / pp["tokens_per_second"],
        color="grey",
        linestyle=":",
        linewidth=1,
        label="one batch call",
    )
    ax.set_xlabel("critical submit time since the batch burst (s)")
    ax.set_ylabel("critical: started.at - submitted_at (s)")
    ax.set_title(
        f"4. critical requests while {pp['slots']} slots run batch calls of "
        f"{pp['batch_tokens'] / pp['tokens_per_second']:g}s",
        fontsize=9,
    )
    ax.set_ylim(0, pp["batch_tokens"] / pp["tokens_per_second"] * 1.25)
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")


def plot_stealing(ax: Any, section: dict[str, Any] | None) -> None:
    """Wait of each request of the burst bound to the slow replica, with and without a pool."""
    if section is None or "burst_pool" not in section["runs"]:
        ax.set_axis_off()
        return
    sp = section["plan"]
    for key, colour, marker, label in (
        ("burst_no_pool", "#7f7f7f", "^", "no pool"),
        ("burst_pool", "#1f77b4", "o", "pool (stealing)"),
    ):
        run = section["runs"][key]
        waits = [p["wait"] for p in run["series"] if p["wait"] is not None]
        wait = run["wait"]
        ax.plot(
            range(1, len(waits) + 1),
            waits,
            marker=marker,
            color=colour,
            linestyle="",
            markersize=4,
            label=f"{label}: p50 {wait['p50_s']:.2f}s, p95 {wait['p95_s']:.2f}s"
            + (f", {run['stolen_events']} stolen" if run["pool"] else ""),
        )
    ax.set_xlabel(f"request of the burst (published in this order to {SLOW})")
    ax.set_ylabel("started.at - submitted_at (s)")
    ax.set_title(
        f"5b. {sp['burst']} dispatches bound to the slow replica "
        f"(ttft {sp['slow_ttft']:g}s vs {sp['fast_ttft']:g}s, {sp['slots']} slots each)",
        fontsize=9,
    )
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.25)
    ax.legend(fontsize=8, loc="upper left")


def plot_utilisation(ax: Any, section: dict[str, Any] | None) -> None:
    """Each replica's utilisation per stealing run, calls served on top of each bar."""
    if section is None:
        ax.set_axis_off()
        return
    runs = section["runs"]
    keys = list(runs)
    width = 0.38
    for offset, name, colour in ((-width / 2, SLOW, "#9467bd"), (width / 2, FAST, "#2ca02c")):
        values = [runs[key]["replicas"][name]["utilisation"] * 100 for key in keys]
        bars = ax.bar(
            [index + offset for index in range(len(keys))],
            values,
            width,
            color=colour,
            label=name,
        )
        for bar, key in zip(bars, keys, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height() + 1,
                f"{runs[key]['replicas'][name]['calls']}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(
        range(len(keys)),
        [key.replace("_", "\n", 1).replace("_", " ") for key in keys],
        fontsize=8,
    )
    ax.set_ylim(0, 115)
    ax.set_ylabel("utilisation: busy slot-s / (slots x window) (%)")
    ax.set_title("5. replica utilisation (number on bar: calls served)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")


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
    if "preemption" in report:
        print_preemption(report["preemption"])
    if "work_stealing" in report:
        print_stealing(report["work_stealing"])
    if "binding" in report:
        print_binding(report["binding"], report["plan"])
    print("\n" + "\n".join(f"  {line}" for line in report["reading"]))


def print_preemption(section: dict[str, Any]) -> None:
    pp = section["plan"]
    batch_call = pp["batch_tokens"] / pp["tokens_per_second"]
    print(
        f"\n4. Preemption: 1 backend x {pp['slots']} slots; {pp['batch_requests']} batch calls "
        f"of {pp['batch_tokens']} tokens at {pp['tokens_per_second']:g} tok/s ({batch_call:g} s "
        f"each) submitted at once; from +{pp['lead']:g} s, {pp['critical_requests']} critical "
        f"requests {pp['critical_every']:g} s apart ({pp['critical_tokens']} tokens each)"
    )
    print(
        f"  {'preemption':<10} {'crit p50 s':>10} {'p95 s':>6} {'max s':>6} {'batch busy':>10}"
        f" {'preempted':>9} {'requests':>8} {'lost tok':>8} {'lost slot-s':>11}"
        f" {'batch done s':>12} {'calls':>5} {'all done':>8}"
    )
    for key, run in section["runs"].items():
        wait = run["critical_wait"]
        print(
            f"  {key:<10} {wait['p50_s']:>10.2f} {wait['p95_s']:>6.2f} {wait['max_s']:>6.2f}"
            f" {run['batch_running_at_critical_submit_min']:>10}"
            f" {run['preempted_runs']:>9} {run['preempted_requests']:>8}"
            f" {run['lost_tokens']:>8} {run['lost_slot_seconds']:>11.2f}"
            f" {run['batch_last_completed_s']:>12.1f} {run['backend_calls']:>5}"
            f" {'yes' if run['all_completed'] else 'NO':>8}"
        )
    print(
        "  crit = submit -> first `started` of each critical request; batch busy = fewest batch "
        "runs in progress when a critical request was submitted; lost tok = tokens streamed by "
        "preempted runs (thrown away); batch done = last batch completion after the burst; "
        "calls = chat calls the mock received (requests + preempted runs if none is repeated)"
    )


def print_stealing(section: dict[str, Any]) -> None:
    sp = section["plan"]
    print(
        f"\n5. Work stealing: 2 replicas x {sp['slots']} slots, {SLOW} ttft {sp['slow_ttft']:g} s, "
        f"{FAST} ttft {sp['fast_ttft']:g} s (route: slow first); (a) router path: Poisson "
        f"{sp['rate']:g}/s for {sp['seconds']:g} s; (b) burst: {sp['burst']} dispatches "
        f"published to {SLOW}'s subject"
    )
    print(
        f"  {'run':<16} {'n':>4} {'wait p50':>8} {'p95':>6} {'max':>6} {'lat p95':>7}"
        f" {'stolen':>6} {'slow calls':>10} {'util':>5} {'fast calls':>10} {'util':>5}"
        f" {'window s':>8} {'calls':>5} {'all done':>8}"
    )
    for key, run in section["runs"].items():
        wait = run["wait"]
        slow, fast = run["replicas"][SLOW], run["replicas"][FAST]
        print(
            f"  {key:<16} {run['requests']:>4} {wait['p50_s']:>8.2f} {wait['p95_s']:>6.2f}"
            f" {wait['max_s']:>6.2f} {run['latency']['p95_s']:>7.2f} {run['stolen_events']:>6}"
            f" {slow['calls']:>10} {slow['utilisation']:>5.0%} {fast['calls']:>10}"
            f" {fast['utilisation']:>5.0%} {run['window_s']:>8.1f}"
            f" {slow['backend_calls'] + fast['backend_calls']:>5}"
            f" {'yes' if run['all_completed'] else 'NO':>8}"
        )
    print(
        "  wait = submit -> first `started`; lat = submit -> `completed`; util = busy slot-"
        "seconds (started -> completed of the completing run) / (slots x window); window = "
        "first submit -> last completion; calls = chat calls both mocks received (= n: no "
        "request called twice)"
    )


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_binding(section: dict[str, Any], plan: dict[str, Any]) -> None:
    bp = section["plan"]
    slack_ms = bp["round_slack"] * 1000
    print(
        f"\n6. Binding order across routers (issue #7): 1 backend x {plan['slots']} slots, mock "
        f"ttft {plan['ttft']:g} s, strict priority (never_age, no preemption); Poisson "
        f"arrivals for {bp['arrival_seconds']:g} s (seed {bp['seed']}); routers, worker and "
        "projectors are `renqueue` processes"
    )
    for load in section["loads"].values():
        print_binding_load(load, slack_ms)
    print(
        f"  out of order = a `routed` of r at server time t while a more urgent request, "
        f"capable of r's backend, submitted before r and >= {slack_ms:.0f} ms before t (one "
        "routing round; slack 0: before t; 0.25 s / 1 s: rate with those slacks), was not yet "
        "bound; crit<-batch = critical "
        "requests (of all) not bound while a batch request was bound, pairs = such batch "
        "binds, other rtr = of those, bound by another router than the critical one; "
        "ordering fig = the ordering part's definition (router's own key, waited > 0.2 s, "
        "still waiting 50 ms later); passed = where the requests passed over (50 ms) were at "
        "the bind (tap): held by the binding router / by another router / not yet delivered "
        "to any; in flight = max bound-not-completed (over "
        f"{plan['slots']}: dispatches waited in the backend subject)"
    )
    print_failover(section.get("failover"))


def print_binding_load(load: dict[str, Any], slack_ms: float) -> None:
    runs = load["runs"]
    print(
        f"  {load['overload']:g}x capacity: {load['arrival_rate']:.0f}/s, "
        f"{load['requests']} requests"
    )
    print(
        f"  {'routers':>7} {'binds':>5} {f'out of order ({slack_ms:.0f} ms)':>24}"
        f" {'(slack 0)':>14} {'(0.25 s)':>8} {'(1 s)':>6} {'crit<-batch':>11} {'pairs':>5}"
        f" {'other rtr':>9}"
        f" {'ordering fig':>12} {'in flight':>9} {'req/s':>5} {'passed: same/other/stream':>25}"
        "  binds by router"
    )
    for run in runs.values():
        ooo, ooo0 = run["out_of_order"], run["out_of_order_slack_0"]
        cb = run["critical_behind_batch"]
        fig = run["ordering_part_figure"]
        rate = f"{ooo['out_of_order']} ({ooo['rate']:.1%})"
        rate0 = f"{ooo0['out_of_order']} ({ooo0['rate']:.1%})"
        crit = f"{cb['critical_behind_batch']}/{cb['critical']}"
        figure = f"{fig['total']} ({fig['share']:.1%})"
        longer = run["out_of_order_by_slack"]
        at = ooo["passed_over_where"]
        where = f"{at['same_router']}/{at['another_router']}/{at['not_delivered']}"
        print(
            f"  {run['routers']:>7} {ooo['binds']:>5} {rate:>24} {rate0:>14}"
            f" {longer['0.25']['rate']:>8.1%} {longer['1']['rate']:>6.1%} {crit:>11}"
            f" {cb['batch_binds_ahead']:>5} {cb['of_which_by_another_router']:>9} {figure:>12}"
            f" {run['bound_not_finished_max']:>9} {run['throughput_rps']:>5.1f} {where:>25}  "
            + ", ".join(f"{k} {v}" for k, v in run["binds_by_router"].items())
        )
    keys = list(runs)
    print(
        "  wait (submitted -> started) p50 / p95 s per level: "
        + "   ".join(f"{runs[k]['routers']} router(s)" for k in keys)
    )
    for level in LEVELS:
        cells = []
        for key in keys:
            wait = runs[key]["levels"][level]["wait"]
            cells.append(f"{wait['p50_s']:>7.2f} / {wait['p95_s']:>6.2f}")
        n = runs[keys[0]]["levels"][level]["submitted"]
        print(f"  {level:<9} n {n:>4}  " + "   ".join(cells))


def print_failover(fo: dict[str, Any] | None) -> None:
    if not fo:
        return
    ack = fo["router_ack_wait_s"]
    print(
        f"\n  kill -9 failover: {fo['routers']} routers, Poisson {fo['arrival_rate']:.0f}/s for "
        f"{fo['planned_arrival_seconds']:g} s ({fo['requests']} requests), kill -9 at "
        + ", ".join(f"{k['offset_s']:.0f}" for k in fo["kills"] if k.get("who"))
        + " s, router ack_wait "
        + (f"{ack:g} s" if ack else "30 s (default)")
        + f"; served {fo['completed']}/{fo['requests']} ({fo['outcomes']})"
    )
    print(
        f"  {'kill':>4} {'at s':>5} {'victim':<12} {'chosen as':<28} {'next bind s':>11}"
        f" {'by':<12} {'held':>4} {'bound':>5} {'redeliv s':>9} {'1st held bound s':>16}"
        f" {'last s':>6}  held waiting by level"
    )
    for index, kill in enumerate(fo["kills"], 1):
        if kill.get("who") is None:
            print(f"  {index:>4} no kill: {kill.get('how')}")
            continue
        print(
            f"  {index:>4} {kill['offset_s']:>5.1f} {kill['who']:<12} {kill['how'][:28]:<28}"
            f" {_s(kill['next_routed_by_another_s'], 3):>11}"
            f" {kill['next_routed_by_another'] or '-':<12}"
            f" {kill['held_waiting']:>4} {kill['held_already_bound']:>5}"
            f" {_s(kill['first_redelivery_s']):>9} {_s(kill['first_held_routed_s']):>16}"
            f" {_s(kill['last_held_routed_s']):>6}  {kill['held_by_level']}"
        )
    print(
        f"  max: next bind by another router {_s(fo['max_next_routed_by_another_s'], 3)} s "
        f"(any router {_s(fo['max_next_routed_s'], 3)} s), first held request redelivered "
        f"{_s(fo['max_first_redelivery_s'])} s, first held request bound "
        f"{_s(fo['max_first_held_routed_s'])} s, last {_s(fo['max_last_held_routed_s'])} s"
    )
    print(
        "  next bind = kill -> the next `routed` event stored (server time) that another "
        "router process published; held = requests delivered to the killed process and never "
        "acked/nak'ed (RouterTap) and not bound before the kill (bound = bound, or on the "
        "way, but not acked); redeliv = kill -> first of "
        "them delivered again (to any router); 1st / last held bound = kill -> their first "
        "/ last `routed`"
    )


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
    if "preemption" in report:
        on, off = (report["preemption"]["runs"][k] for k in ("on", "off"))
        pp = report["preemption"]["plan"]
        out.append(
            f"preemption: critical submit->start p50 {on['critical_wait']['p50_s']:.2f}s / max "
            f"{on['critical_wait']['max_s']:.2f}s with preemption, "
            f"{off['critical_wait']['p50_s']:.2f}s / {off['critical_wait']['max_s']:.2f}s "
            f"without (a batch call is {pp['batch_tokens'] / pp['tokens_per_second']:g}s); "
            f"cost: {on['preempted_runs']} batch runs preempted ({on['preempted_requests']} "
            f"requests), {on['lost_tokens']} tokens thrown away "
            f"({on['lost_tokens'] / on['batch_tokens_needed']:.1%} of the batch work), last "
            f"batch done at {on['batch_last_completed_s']:.1f}s vs "
            f"{off['batch_last_completed_s']:.1f}s; every request completed: "
            f"{'yes' if on['all_completed'] and off['all_completed'] else 'NO'}."
        )
    if "work_stealing" in report:
        runs = report["work_stealing"]["runs"]
        for mode in ("router", "burst"):
            if f"{mode}_pool" not in runs:
                continue
            pool, nopool = runs[f"{mode}_pool"], runs[f"{mode}_no_pool"]
            out.append(
                f"work stealing, {mode}: wait p95 {nopool['wait']['p95_s']:.2f}s without a pool, "
                f"{pool['wait']['p95_s']:.2f}s with ({pool['stolen_events']} stolen); calls "
                f"slow/fast {nopool['replicas'][SLOW]['calls']}/{nopool['replicas'][FAST]['calls']}"
                f" vs {pool['replicas'][SLOW]['calls']}/{pool['replicas'][FAST]['calls']}; "
                f"utilisation slow/fast {nopool['replicas'][SLOW]['utilisation']:.0%}/"
                f"{nopool['replicas'][FAST]['utilisation']:.0%} vs "
                f"{pool['replicas'][SLOW]['utilisation']:.0%}/"
                f"{pool['replicas'][FAST]['utilisation']:.0%}."
                + (
                    f" {pool['stolen_but_ran_on_sibling']} stolen request(s) ran on the slow "
                    "replica anyway (its worker had the original first; the copy stepped back)."
                    if pool.get("stolen_but_ran_on_sibling")
                    else ""
                )
            )
    if "binding" in report:
        section = report["binding"]
        for name, load in section["loads"].items():
            out.append(
                f"binding order at {name} capacity: out-of-order binds (slack "
                f"{section['plan']['round_slack'] * 1000:.0f} ms / 0) "
                + "; ".join(
                    f"{run['routers']} router(s) {run['out_of_order']['rate']:.1%} / "
                    f"{run['out_of_order_slack_0']['rate']:.1%}, critical behind batch "
                    f"{run['critical_behind_batch']['critical_behind_batch']}/"
                    f"{run['critical_behind_batch']['critical']}"
                    for run in load["runs"].values()
                )
                + "."
            )
        fo = section.get("failover")
        if fo:
            out.append(
                f"failover ({len(fo['kills'])} kill -9 of {fo['routers']} routers): next bind "
                f"(by another router) after at most {_s(fo['max_next_routed_by_another_s'], 3)}"
                " s; the killed router's "
                f"held requests first redelivered after up to {_s(fo['max_first_redelivery_s'])}"
                f" s, first bound after up to {_s(fo['max_first_held_routed_s'])} s."
            )
    return out


# ------------------------------------------------------------------------ main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    if args.seconds:
        plan = replace(plan, arrival_seconds=args.seconds)
    if args.no_strict:
        plan = replace(plan, strict=False)
    if args.preemption:
        plan = replace(plan, preemption=True)
    if args.no_failover or args.failover_ack_wait is not None or args.binding_overload:
        plan = replace(
            plan,
            binding=replace(
                plan.binding,
                failover=not args.no_failover,
                failover_ack_wait=args.failover_ack_wait,
                overloads=tuple(args.binding_overload or plan.binding.overloads),
            ),
        )
    parts = set(args.only or PARTS)
    trace = arrival_trace(plan)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "scheduling",
        "timestamp": stamp,
        "mode": "quick" if args.quick else "full",
        "parts": sorted(parts),
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
    if "ordering" in parts:
        items = scenarios(plan)
        async with mock_process(ttft=plan.ttft, output_tokens=plan.output_tokens) as (
            mock_url,
            _pid,
        ):
            for index, scenario in enumerate(items, 1):
                print(f"{index}/{len(items)} {scenario.title} ...", flush=True)
                raw = await run_scenario(scenario, plan, trace, mock_url)
                report["scenarios"][scenario.key] = analyse(raw, plan, scenario)
    if "preemption" in parts:
        pp = plan.preempt
        runs: dict[str, Any] = {}
        async with mock_process(
            ttft=0.0, output_tokens=pp.batch_tokens, tokens_per_second=pp.tokens_per_second
        ) as (mock_url, _pid):
            for key, on in (("on", True), ("off", False)):
                print(f"preemption {key} ...", flush=True)
                runs[key] = await run_preemption(pp, mock_url, preemption=on)
        report["preemption"] = {"plan": asdict(pp), "runs": runs}
    if "stealing" in parts:
        sp = plan.steal
        stealing: dict[str, Any] = {}
        async with (
            mock_process(ttft=sp.slow_ttft, output_tokens=sp.output_tokens) as (slow_url, _),
            mock_process(ttft=sp.fast_ttft, output_tokens=sp.output_tokens) as (fast_url, _),
        ):
            urls = {SLOW: slow_url, FAST: fast_url}
            for burst in (False, True) if sp.router_path else (True,):
                for pool in (False, True):
                    key = f"{'burst' if burst else 'router'}_{'pool' if pool else 'no_pool'}"
                    print(f"work stealing {key} ...", flush=True)
                    stealing[key] = await run_stealing(sp, urls, pool=pool, burst=burst)
        report["work_stealing"] = {"plan": asdict(sp), "runs": stealing}
    if "binding" in parts:
        report["binding"] = await run_binding_part(plan, keep=args.keep)
    report["reading"] = reading(report)
    report["total_seconds"] = time.perf_counter() - began
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="12 s of arrivals, no strict run; shorter preemption run, stealing burst only",
    )
    parser.add_argument("--seconds", type=float, default=0.0, help="arrival window (s)")
    parser.add_argument("--no-strict", action="store_true", help="skip the strict-priority run")
    parser.add_argument(
        "--preemption",
        action="store_true",
        help="keep the levels' default preemption in the priority runs (off: ordering alone)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=PARTS,
        help="run only this part (repeatable): ordering (1-3), preemption (4), stealing (5), "
        "binding (6: binding order with 1 and 3 router processes, kill -9 failover)",
    )
    parser.add_argument(
        "--no-failover", action="store_true", help="binding part: skip the kill -9 run"
    )
    parser.add_argument(
        "--failover-ack-wait",
        type=float,
        default=None,
        help="binding part: router.ack_wait (s) in the failover run (default: the config's, 30)",
    )
    parser.add_argument(
        "--binding-overload",
        type=float,
        action="append",
        help="binding part: arrivals as a multiple of capacity in the order runs "
        "(repeatable; default 2 and 1, --quick: 2)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="binding part: keep the work dirs (service logs)"
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
    shown = base.relative_to(ROOT) if base.is_relative_to(ROOT) else base
    print(f"\n  JSON: {shown}.json")
    if base.with_suffix(".png").exists():  # no plot for the binding part alone
        (args.out / "scheduling-latest.png").write_bytes(base.with_suffix(".png").read_bytes())
        print(f"  plot: {shown}.png")
    print(f"  total {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
