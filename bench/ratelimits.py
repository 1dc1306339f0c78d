"""Rate-limits benchmark (issue #8): a burst against mock free tiers and a paid backend,
through Ren-Queue and through LiteLLM's Router, on the same mocks.

Run with ``make bench-ratelimits`` (about 75 s; the first run also spends about
30 s making LiteLLM's venv). Everything is on loopback: an embedded nats-server, three
``renqueue mock-backend`` processes that enforce their limits as token buckets and
answer real 429s in their provider's dialect, ``Services`` (router, worker, projector)
and a ``Client`` in this process.

The backends, one route cascading over them (``free-a -> free-b -> paid``):

- ``free-a``: Groq's free tier shape: 30 requests and 6,000 tokens per minute, 1,000
  requests per day (``limit_style = "groq"``);
- ``free-b``: OpenRouter's ``:free`` shape: 20 requests per minute, 50 per day
  (``limit_style = "openrouter"``);
- ``paid``: no rate limit, priced ($2.50 / $10 per million input / output tokens).

The clock is compressed for the per-minute limits: a "minute" is ``--minute`` seconds
(6 by default, so 10x), set as the mocks' ``rate_window`` and declared to Ren-Queue as
``30/6s``. Daily limits are real days on both sides (the mock's ``rpd`` bucket refills
over 24 h): 1,000 a day never binds in the run, 50 a day does.

One burst of ``--requests`` requests (300: prompts of 40-190 words, ``max_tokens`` 64,
128 or 256, seeded) is sent at once, with a deadline of ``--deadline`` seconds:

1. **Ren-Queue**: ``Client.submit`` for each, the limits declared in the config
   (``limits.requests = ["30/6s", "1000/day"]``, ``limits.tokens = ["6000/6s"]``...).
   Twice: the paid backend with 16 slots (``limits.concurrency``: the excess waits for a
   slot, and meanwhile the free windows refill), and with one slot per request (no cap,
   as LiteLLM runs it); ``--paid-slots``.
2. **LiteLLM** (fresh mocks, same settings): ``litellm.Router`` with one model group
   per backend (``openai/<name>`` at the mock's URL), ``rpm``/``tpm`` per deployment,
   ``routing_strategy = "usage-based-routing-v2"`` (the one that honours them),
   ``fallbacks = [{"free-a": ["free-b", "paid"]}]`` and ``num_retries = 0`` (a 429 goes
   down the cascade at once, as in Ren-Queue; LiteLLM's default of 2 retries waits
   out ``retry-after`` and took 2-5 minutes here, ``--litellm-retries`` to see it).
   LiteLLM counts rpm and tpm per real (UTC clock) minute and has no per-day limit, so
   the compressed minute cannot be declared to it as such. It runs twice:
   **same rate**: ``rpm = 30 x 60/minute`` (300), ``tpm = 60,000``: the compressed
   limits' sustained rate per real minute; **same count**: ``rpm = 30``, ``tpm = 6,000``
   per real minute: never more than one compressed window's worth in a real minute.
   LiteLLM runs in a venv of its own (``.renqueue/bench-litellm/venv``, made on first
   run with ``pip install litellm==<pinned>``) as a subprocess
   (``bench/_litellm_phase.py``); it is never a dependency of Ren-Queue.

Per side: upstream 429s per mock (the mocks' own ``GET /stats``), requests the mocks
received, completed / failed / expired, who served each request and the share that
migrated (served by anything but ``free-a``), spend (usage x price, the same formula on
both sides; each router's own figure beside it), the longest wait (client submit ->
result, and p50 / p95), wall time (first submit -> last result), the most calls each
mock had in flight, the router process's CPU time. Ren-Queue also: binds that passed
over a candidate for its quota (from the ``routed`` events), ``retrying`` events (429s
its workers saw).

Results: a table on stdout, JSON in ``bench/results/ratelimits-<UTC>.json`` and
``bench/results/ratelimits-latest.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections import Counter
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
    percentile,
    reason_notes,
    run_litellm_phase,
)
from common import read_events as read_events_on

from renqueue import Client, Services, parse_config
from renqueue.broker import connect
from renqueue.config import Config
from renqueue.logs import configure_logging
from renqueue.schema import Retrying, Routed, Started

TENANT = "bench"
ROUTE = "chat"
#: Words the prompts are made of (about one token each by the 4-characters rule).
WORDS = ("queue", "token", "limit", "route", "cost", "free", "tier", "wait", "burst", "model")


@dataclass(frozen=True)
class Tier:
    """One mock backend and what is declared for it.

    ``rpm`` / ``tpm`` per compressed minute (0: none); ``rpd`` per real day (0: none).
    ``slots``: Ren-Queue's ``limits.concurrency`` for it (the mock itself has no cap).
    """

    name: str
    limit_style: str
    rpm: int = 0
    tpm: int = 0
    rpd: int = 0
    slots: int = 16
    ttft: float = 0.3
    tokens_per_second: float = 200.0
    price_in_per_mtok: float = 0.0
    price_out_per_mtok: float = 0.0


@dataclass(frozen=True)
class Plan:
    minute: float = 6.0
    requests: int = 300
    deadline: float = 120.0
    seed: int = 8
    #: The mocks' answer length; a request's ``max_tokens`` caps it.
    output_tokens: int = 256
    max_tokens: tuple[int, ...] = (64, 128, 256)
    prompt_words: tuple[int, int] = (40, 190)
    tiers: tuple[Tier, ...] = field(
        default_factory=lambda: (
            Tier(
                "free-a",
                "groq",
                rpm=30,
                tpm=6000,
                rpd=1000,
                slots=16,
                ttft=0.2,
                tokens_per_second=250.0,
            ),
            Tier("free-b", "openrouter", rpm=20, rpd=50, slots=16, ttft=0.4, tokens_per_second=150),
            Tier(
                "paid",
                "openai",
                slots=0,  # per run: Plan.paid_slots
                ttft=0.5,
                tokens_per_second=120.0,
                price_in_per_mtok=2.50,
                price_out_per_mtok=10.00,
            ),
        )
    )
    #: Ren-Queue runs, one per slot count of the paid backend (its ``limits.concurrency``);
    #: 0: as many as the burst has requests (no cap, as LiteLLM runs it).
    paid_slots: tuple[int, ...] = (16, 0)
    #: LiteLLM runs, one per way of scaling the per-minute limits (see the module docstring).
    litellm_variants: tuple[str, ...] = ("same-rate", "same-count")
    litellm_retries: bool = False

    @property
    def compression(self) -> float:
        return 60.0 / self.minute

    def with_paid_slots(self, slots: int) -> Plan:
        """This plan with the paid (last) tier's slots set (0: one per request)."""
        *free, paid = self.tiers
        return replace(self, tiers=(*free, replace(paid, slots=slots or self.requests)))

    @property
    def cascade(self) -> list[str]:
        return [tier.name for tier in self.tiers]


def make_burst(plan: Plan) -> list[dict[str, Any]]:
    """The requests, the same for every side: a prompt and a ``max_tokens`` each."""
    rng = random.Random(plan.seed)
    burst = []
    for index in range(plan.requests):
        words = rng.randint(*plan.prompt_words)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        burst.append({"prompt": f"[{index}] {text}", "max_tokens": rng.choice(plan.max_tokens)})
    return burst


# ------------------------------------------------------------------- the mocks


def mock_settings(tier: Tier, plan: Plan) -> dict[str, Any]:
    """The mock's settings (``POST /admin/settings``) for ``tier``: new buckets, full."""
    return {
        "ttft": tier.ttft,
        "tokens_per_second": tier.tokens_per_second,
        "output_tokens": plan.output_tokens,
        "rpm": tier.rpm,
        "tpm": tier.tpm,
        "rpd": tier.rpd,
        "rate_window": plan.minute,
        "limit_style": tier.limit_style,
    }


@contextlib.asynccontextmanager
async def mocks(plan: Plan) -> AsyncIterator[dict[str, str]]:
    """A fresh mock process per tier (fresh buckets, counters at 0): name -> base URL."""
    async with mock_fleet({tier.name: mock_settings(tier, plan) for tier in plan.tiers}) as urls:
        yield urls


# ------------------------------------------------------------------- Ren-Queue


def renqueue_config(plan: Plan, urls: dict[str, str], data_dir: str) -> Config:
    window = f"{plan.minute:g}s"
    backends: dict[str, Any] = {}
    for tier in plan.tiers:
        limits: dict[str, Any] = {"concurrency": tier.slots}
        requests = []
        if tier.rpm:
            requests.append(f"{tier.rpm}/{window}")
        if tier.rpd:
            requests.append(f"{tier.rpd}/day")
        if requests:
            limits["requests"] = requests
        if tier.tpm:
            limits["tokens"] = [f"{tier.tpm}/{window}"]
        backends[tier.name] = {
            "base_url": urls[tier.name],
            "model": tier.name,
            "limit_style": tier.limit_style,
            "cost_input_per_mtok": tier.price_in_per_mtok,
            "cost_output_per_mtok": tier.price_out_per_mtok,
            "limits": limits,
        }
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "backends": backends,
            "routes": {ROUTE: {"backends": plan.cascade}},
            "worker": {"drain_timeout": "5s"},
        },
        source="<bench:ratelimits>",
    )


async def read_events(js: Any) -> list[Any]:
    """Every event of the bench tenant in the log, in order."""
    return await read_events_on(js, f"rq.evt.{TENANT}.>")


async def run_renqueue(plan: Plan, burst: list[dict[str, Any]]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    async with mocks(plan) as urls:
        with tempfile.TemporaryDirectory(prefix="renqueue-bench-ratelimits-") as tmp:
            config = renqueue_config(plan, urls, tmp)
            async with Services(config, name="bench") as services:
                client_nc = await connect(services.url, name="bench-client")
                client = Client(client_nc, tenant=TENANT)
                try:

                    async def one(index: int, item: dict[str, Any]) -> dict[str, Any]:
                        start = time.time()
                        row: dict[str, Any] = {"index": index, "submitted_at": start}
                        request = client.build_request(
                            item["prompt"],
                            route=ROUTE,
                            max_tokens=item["max_tokens"],
                            timeout=plan.deadline,
                        )
                        row["request_id"] = request.id
                        try:
                            handle = await client.submit_request(request)
                            result = await handle.result(timeout=plan.deadline + 30)
                        except Exception as exc:  # noqa: BLE001 - every failure is a row
                            row.update(
                                outcome=type(exc).__name__,
                                error=f"{type(exc).__name__}: {exc}"[:300],
                                ended_at=time.time(),
                            )
                            return row
                        row.update(
                            outcome="completed",
                            ended_at=time.time(),
                            backend=result.backend,
                            prompt_tokens=result.usage.prompt_tokens,
                            completion_tokens=result.usage.completion_tokens,
                            router_cost=result.cost,
                            text_chars=len(result.text),
                        )
                        return row

                    cpu = time.process_time()
                    began = time.time()
                    rows = list(
                        await asyncio.gather(*(one(i, item) for i, item in enumerate(burst)))
                    )
                    ended = time.time()
                    cpu = time.process_time() - cpu
                    events = await read_events(services.js)
                finally:
                    await client.close()
                    await client_nc.drain()
        stats = await all_mock_stats(urls)
    return {
        "began": began,
        "ended": ended,
        "cpu_s": cpu,
        "rows": rows,
        "mocks": stats,
        "log": log_figures(events, rows),
        "config": {
            name: {
                "limit_style": backend.limit_style,
                "concurrency": backend.limits.concurrency,
                "requests": list(backend.limits.requests),
                "tokens": list(backend.limits.tokens),
            }
            for name, backend in config.backends.items()
        },
    }


def log_figures(events: Sequence[Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the event log says: binds per backend, binds that passed a candidate over for
    its quota (and the reasons' kinds), 429s the workers saw, submit -> started."""
    ours = {row.get("request_id") for row in rows}
    submitted = {row.get("request_id"): row["submitted_at"] for row in rows}
    routed: Counter[str] = Counter()
    passed_over = 0
    reasons: Counter[str] = Counter()
    others: Counter[str] = Counter()
    retrying: Counter[str] = Counter()
    first_start: dict[str, float] = {}
    for event in events:
        if event.request_id not in ours:
            continue
        if isinstance(event, Routed):
            routed[event.backend] += 1
            notes = reason_notes(event.reason)
            quota = [(b, kind) for b, kind in notes if "/" in kind or kind == "rate limited"]
            passed_over += bool(quota)
            # "free-a quota:requests/6s 30/30, resets in 1 s" -> "free-a requests/6s"
            reasons.update(f"{b} {kind}" for b, kind in quota)
            others.update(f"{b} {kind}" for b, kind in notes if (b, kind) not in quota)
        elif isinstance(event, Retrying):
            retrying[f"{event.backend} {event.error_type}"] += 1
        elif isinstance(event, Started):
            first_start.setdefault(event.request_id, event.at)
    waits = [at - submitted[rid] for rid, at in first_start.items() if rid in submitted]
    return {
        "routed": dict(routed),
        "binds_passing_over_quota": passed_over,
        "passed_over_for": dict(reasons.most_common()),
        # Candidates passed over for anything else (full, predicted late: the planner's).
        "passed_over_otherwise": dict(others.most_common()),
        "retrying": dict(retrying),
        "submit_to_started_max_s": max(waits, default=float("nan")),
        "submit_to_started_p95_s": percentile(waits, 95),
    }


# --------------------------------------------------------------------- LiteLLM


def litellm_backends(plan: Plan, urls: dict[str, str], variant: str) -> list[dict[str, Any]]:
    """The backends as LiteLLM is told them: per real minute, scaled by ``variant``."""
    factor = plan.compression if variant == "same-rate" else 1.0
    return [
        {
            "name": tier.name,
            "url": urls[tier.name],
            "rpm": round(tier.rpm * factor) if tier.rpm else None,
            "tpm": round(tier.tpm * factor) if tier.tpm else None,
            "price_in_per_mtok": tier.price_in_per_mtok,
            "price_out_per_mtok": tier.price_out_per_mtok,
        }
        for tier in plan.tiers
    ]


async def run_litellm(
    plan: Plan, burst: list[dict[str, Any]], python: Path, variant: str
) -> dict[str, Any]:
    router_kwargs: dict[str, Any] = {} if plan.litellm_retries else {"num_retries": 0}
    async with mocks(plan) as urls:
        payload: dict[str, Any] = {
            "backends": litellm_backends(plan, urls, variant),
            "fallback_order": plan.cascade,
            "timeout_s": plan.deadline,
            "router_kwargs": router_kwargs,
            "burst": burst,
        }
        limit = plan.deadline * (4 if plan.litellm_retries else 1) + 60
        phase = await run_litellm_phase(python, payload, limit=limit)
        stats = await all_mock_stats(urls)
    if phase.report is None:
        return {"error": phase.error}
    report = phase.report
    report["mocks"] = stats
    report["router_kwargs"] = router_kwargs
    report["declared"] = {
        b["name"]: {"rpm": b["rpm"], "tpm": b["tpm"]} for b in payload["backends"]
    }
    return report


# -------------------------------------------------------------------- analysis


def figures(plan: Plan, side: dict[str, Any]) -> dict[str, Any]:
    """The same figures for either side, from its rows and its mocks' counters."""
    rows: list[dict[str, Any]] = side["rows"]
    prices = {t.name: (t.price_in_per_mtok, t.price_out_per_mtok) for t in plan.tiers}
    done = [r for r in rows if r["outcome"] == "completed"]
    served = Counter(r["backend"] for r in done)
    spend = sum(
        r["prompt_tokens"] * prices[r["backend"]][0] / 1e6
        + r["completion_tokens"] * prices[r["backend"]][1] / 1e6
        for r in done
        if r["backend"] in prices
    )
    own_costs = [r.get("router_cost", r.get("litellm_cost")) for r in done]
    own = sum(c for c in own_costs if isinstance(c, (int, float)))
    waits = [r["ended_at"] - r["submitted_at"] for r in done]
    mocks = side["mocks"]
    first = plan.cascade[0]
    return {
        "requests": len(rows),
        "completed": len(done),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "errors": dict(Counter(r["error"][:160] for r in rows if r.get("error")).most_common(5)),
        "served": {name: served.get(name, 0) for name in plan.cascade},
        "migrated": sum(n for name, n in served.items() if name != first),
        "migrated_share": (len(done) - served.get(first, 0)) / len(done) if done else None,
        "upstream_429s": {name: mocks[name]["rate_limited"] for name in plan.cascade},
        "upstream_429s_total": sum(mocks[name]["rate_limited"] for name in plan.cascade),
        "upstream_calls": {name: mocks[name]["requests"] for name in plan.cascade},
        "max_in_flight": {name: mocks[name]["max_in_flight_seen"] for name in plan.cascade},
        "spend_usd": spend,
        "spend_router_usd": own if any(c is not None for c in own_costs) else None,
        "wait_max_s": max(waits, default=float("nan")),
        "wait_p50_s": percentile(waits, 50),
        "wait_p95_s": percentile(waits, 95),
        "wall_s": max((r["ended_at"] for r in rows), default=0.0)
        - min((r["submitted_at"] for r in rows), default=0.0),
        "utc_minutes_spanned": _minutes(rows),
        "cpu_s": side.get("cpu_s"),
    }


def _minutes(rows: Sequence[dict[str, Any]]) -> int:
    """How many UTC clock minutes the burst touched (LiteLLM's counters are per such minute)."""
    if not rows:
        return 0
    start = min(r["submitted_at"] for r in rows) // 60
    end = max(r["ended_at"] for r in rows) // 60
    return int(end - start) + 1


# ----------------------------------------------------------------------- print


def print_report(report: dict[str, Any]) -> None:
    plan = report["plan"]
    sides: dict[str, dict[str, Any]] = report["figures"]
    names = list(sides)
    cascade = [t["name"] for t in plan["tiers"]]
    print(
        f"\nRate limits: a burst of {plan['requests']} requests at once, deadline "
        f"{plan['deadline']:g} s, minute compressed to {plan['minute']:g} s "
        f"(x{60 / plan['minute']:g}); route {' -> '.join(cascade)}"
    )
    for tier in plan["tiers"]:
        limits = ", ".join(
            text
            for text in (
                f"{tier['rpm']} req/min" if tier["rpm"] else "",
                f"{tier['tpm']} tok/min" if tier["tpm"] else "",
                f"{tier['rpd']} req/day" if tier["rpd"] else "",
            )
            if text
        )
        price = (
            f"${tier['price_in_per_mtok']:g} / ${tier['price_out_per_mtok']:g} per M in/out"
            if tier["price_in_per_mtok"] or tier["price_out_per_mtok"]
            else "free"
        )
        print(
            f"  {tier['name']:<7} {tier['limit_style']:<11} {limits or 'no rate limit':<36} "
            f"{price}"
            + (f"; Ren-Queue slots {tier['slots']}" if tier is not plan["tiers"][-1] else "")
        )
    if report.get("renqueue"):
        print(
            "  Ren-Queue runs, one per slot count of the paid backend: "
            + ", ".join(name.removeprefix("ren-queue paid ") for name in report["renqueue"])
        )
    for name, side in report.get("litellm", {}).items():
        if "declared" in side:
            declared = ", ".join(
                f"{b} rpm={v['rpm']} tpm={v['tpm']}" for b, v in side["declared"].items()
            )
            print(f"  LiteLLM {name}: {declared} (per real minute)")
    if report.get("litellm_missing"):
        print(f"  LiteLLM: not run: {report['litellm_missing']}")
    width = 20
    print("\n  " + f"{'':<34}" + "".join(f"{n:>{width}}" for n in names))

    def line(label: str, cells: list[str]) -> None:
        print("  " + f"{label:<34}" + "".join(f"{c:>{width}}" for c in cells))

    def per_backend(key: str) -> list[str]:
        return ["/".join(str(sides[n][key][b]) for b in cascade) for n in names]

    line("upstream 429s (total)", [str(sides[n]["upstream_429s_total"]) for n in names])
    line("  per mock " + "/".join(cascade), per_backend("upstream_429s"))
    line("calls the mocks received", per_backend("upstream_calls"))
    line("completed", [f"{sides[n]['completed']}/{sides[n]['requests']}" for n in names])
    line(
        "failed / expired / other",
        [str(sum(v for k, v in sides[n]["outcomes"].items() if k != "completed")) for n in names],
    )
    line("served by " + "/".join(cascade), per_backend("served"))
    line(
        "migrated (not on the first)",
        [_share(sides[n]["migrated_share"]) for n in names],
    )
    line("spend $ (usage x price)", [f"{sides[n]['spend_usd']:.4f}" for n in names])
    line(
        "spend $ (the router's own figure)",
        [
            f"{sides[n]['spend_router_usd']:.4f}"
            if sides[n]["spend_router_usd"] is not None
            else "-"
            for n in names
        ],
    )
    line("longest wait s (submit->result)", [f"{sides[n]['wait_max_s']:.2f}" for n in names])
    line(
        "  wait p50 / p95 s",
        [f"{sides[n]['wait_p50_s']:.2f} / {sides[n]['wait_p95_s']:.2f}" for n in names],
    )
    line("wall s (first submit->last)", [f"{sides[n]['wall_s']:.2f}" for n in names])
    line("most in flight at " + "/".join(cascade), per_backend("max_in_flight"))
    line(
        "router process CPU s in the burst",
        [f"{sides[n]['cpu_s']:.1f}" if sides[n]["cpu_s"] is not None else "-" for n in names],
    )
    line("UTC minutes the burst touched", [str(sides[n]["utc_minutes_spanned"]) for n in names])
    for name in names:
        if sides[name]["errors"]:
            print(f"  {name} errors: {sides[name]['errors']}")
    for name, side in report.get("renqueue", {}).items():
        log = side["log"]
        print(
            f"\n  {name}, its log: binds {log['routed']}; {log['binds_passing_over_quota']} binds "
            f"passed a candidate over for its quota ({log['passed_over_for']}); retrying events "
            f"{log['retrying'] or 'none'}; submit -> started max "
            f"{log['submit_to_started_max_s']:.2f} s"
        )
    for line_ in report["reading"]:
        print(f"  - {line_}")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def reading(report: dict[str, Any]) -> list[str]:
    """One sentence per side; LiteLLM's spend against Ren-Queue's with the paid backend
    uncapped (the last Ren-Queue run), as LiteLLM runs it."""
    out = []
    sides = report["figures"]
    ours = [name for name in sides if name.startswith("ren-queue")]
    base = sides[ours[-1]] if ours else None
    for name, side in sides.items():
        sentence = (
            f"{name}: {side['upstream_429s_total']} upstream 429s"
            + (" (target 0)" if name in ours else "")
            + f", {side['completed']}/{side['requests']} completed, "
            f"{_share(side['migrated_share'])} migrated, ${side['spend_usd']:.4f} spent"
        )
        if base and name not in ours and base["spend_usd"]:
            sentence += f" ({side['spend_usd'] / base['spend_usd']:.2f}x {ours[-1]})"
        out.append(sentence + f", longest wait {side['wait_max_s']:.1f} s.")
    return out


# ------------------------------------------------------------------------ main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan(
        minute=args.minute,
        requests=args.requests,
        deadline=args.deadline,
        seed=args.seed,
        litellm_retries=args.litellm_retries,
    )
    if args.paid_slots:
        plan = replace(plan, paid_slots=tuple(args.paid_slots))
    if args.litellm_variant:
        plan = replace(plan, litellm_variants=tuple(args.litellm_variant))
    burst = make_burst(plan)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "ratelimits",
        "timestamp": stamp,
        "plan": {**asdict(plan), "compression": plan.compression},
        "burst": {
            "requests": len(burst),
            "max_tokens": dict(Counter(item["max_tokens"] for item in burst)),
            "prompt_chars_mean": sum(len(i["prompt"]) for i in burst) / max(1, len(burst)),
        },
        "machine": machine_info(httpx=httpx.__version__),
        "figures": {},
        "litellm": {},
    }
    began = time.perf_counter()
    report["renqueue"] = {}
    for slots in () if args.no_renqueue else plan.paid_slots:
        run_plan = plan.with_paid_slots(slots)
        name = f"ren-queue paid {run_plan.tiers[-1].slots}"
        print(f"Ren-Queue phase ({name}) ...", flush=True)
        side = await run_renqueue(run_plan, burst)
        report["renqueue"][name] = side
        report["figures"][name] = figures(run_plan, side)
    if not args.no_litellm:
        python, note = await asyncio.to_thread(litellm_python, args.fresh_litellm)
        report["litellm_install"] = note
        if python is None:
            report["litellm_missing"] = note
            print(f"  LiteLLM unavailable: {note}", flush=True)
        else:
            for variant in plan.litellm_variants:
                print(f"LiteLLM phase ({variant}) ...", flush=True)
                result = await run_litellm(plan, burst, python, variant)
                report["litellm"][variant] = result
                if "error" in result:
                    print(f"  {result['error']}", flush=True)
                    continue
                report["figures"][f"litellm {variant}"] = figures(plan, result)
    report["reading"] = reading(report)
    report["total_seconds"] = time.perf_counter() - began
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="the burst's size")
    parser.add_argument(
        "--minute", type=float, default=6.0, help="seconds a rate-limit minute lasts (6: x10)"
    )
    parser.add_argument("--deadline", type=float, default=120.0, help="each request's deadline")
    parser.add_argument("--seed", type=int, default=8, help="seeds the prompts and max_tokens")
    parser.add_argument(
        "--paid-slots",
        type=int,
        action="append",
        help="Ren-Queue's slots for the paid backend, one run each (repeatable; default 16 "
        "and 0 = one per request)",
    )
    parser.add_argument("--no-renqueue", action="store_true", help="skip the Ren-Queue phases")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM phases")
    parser.add_argument(
        "--litellm-variant",
        action="append",
        choices=("same-rate", "same-count"),
        help="LiteLLM's rpm/tpm scaling (repeatable; default both)",
    )
    parser.add_argument(
        "--litellm-retries",
        action="store_true",
        help="keep LiteLLM's default retries (num_retries 2, waits out retry-after: minutes)",
    )
    parser.add_argument(
        "--fresh-litellm", action="store_true", help="remake the LiteLLM venv before running"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    configure_logging(level="WARNING")
    report = asyncio.run(run(args))
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ratelimits-{report['timestamp']}.json"
    text = json.dumps(report, indent=2, default=str) + "\n"
    path.write_text(text)
    (args.out / "ratelimits-latest.json").write_text(text)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"\n  JSON: {shown}")
    print(f"  total {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
