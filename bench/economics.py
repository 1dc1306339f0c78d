"""Economics benchmark: what a seeded day-in-the-life trace costs, and how many
requests meet their deadline, through Ren-Queue and through LiteLLM's Router, on mock
backends shaped like a team's real set.

Run with ``make bench-economics`` (about 5 minutes; ``--quick``: 40 requests, about
2 minutes). Everything is on loopback: an embedded nats-server, six
``renqueue mock-backend`` processes (fresh ones for each side), ``Services`` (router,
worker, projector) and a ``Client`` in this process; LiteLLM in its own venv and process
(``bench/_litellm_phase.py``, mode ``trace``), never a dependency of Ren-Queue.

The backends, one route cascading over them local -> free -> paid-small -> paid-large
(``Plan.backends``; tiers: 1 small, 2 mid, 3 frontier-class):

- ``local-small``: a small model on the team's own GPU (tier 1, 2 slots, fast);
- ``local-large``: a large open model on the team's GPU server (tier 3, 2 slots, slow);
- ``free-groq``: Groq's free tier shape (tier 2: 30 requests and 12,000 tokens a minute,
  1,000 requests a day; very fast);
- ``free-openrouter``: OpenRouter's ``:free`` shape without credits (tier 3: 20 requests
  a minute, 50 a day; slow);
- ``paid-small``: priced like OpenAI gpt-4o-mini ($0.15 / $0.60 per million tokens in /
  out; tier 2);
- ``paid-large``: priced like OpenAI gpt-4o ($2.50 / $10; tier 3).

The per-minute limits run on a compressed clock (``--minute``, 15 s: a "minute" of the
mocks' ``rate_window`` and of Ren-Queue's declared limits), so the windows bind during
the run; days are real days on both sides (50 a day binds, 1,000 does not).

Before the trace each side makes ``--warmup`` (5) short calls to every backend, not
counted (the mocks' counters are read after them and subtracted): a router that learns
backends' speeds from its log (Ren-Queue's planner needs 5 completed calls per backend)
starts warm, as it would after running a while; ``--warmup 0`` measures a cold start.
They use 5 of OpenRouter's 50 a day on both sides.

The trace (seeded, the same on both sides; ``make_trace``): ``--requests`` requests at
``--rate`` a second on average, open loop, with bursts (``Plan.bursts``: alternately a
spike of mixed traffic and a batch job dumping ``batch`` requests; 40 % of the requests
come in them); levels critical 5 %, high 15 %, normal 40 %, low 20 %, batch 20 % (plus
the batch jobs) with deadlines of 6 / 10 / 25 / 40 / 50 s;
kinds simple / moderate / hard (45 / 40 / 15 %: a prose question, a conversation or a
code snippet, a long code-and-math task) with ``max_tokens`` to match. Half the requests
name their tier (``complexity``); the others leave it to the route's estimator
(``[routes.chat.complexity] thresholds``), and the tier the estimator gives them (the
same function the router calls) is what they need on both sides. Some normal, low and
batch requests carry a cost cap (``max_cost``): a normal one may pay for the cheapest
paid model that can do it, a low or batch one may not pay at all.

1. **Ren-Queue**: ``Client.submit_request`` (priority, deadline, ``max_cost``, and
   ``complexity`` when named) then ``handle.result()``; the config declares each
   backend's tier, prices, slots (``limits.concurrency``) and limits (``30/15s``,
   ``1000/day``, ...). Whatever policy the checkout's router has decides.
2. **LiteLLM** (fresh mocks): ``litellm.Router`` with one model group per backend
   (``rpm``/``tpm`` per deployment, ``max_parallel_requests`` = the slots, the same
   prices), ``routing_strategy = "usage-based-routing-v2"`` (the one that honours
   rpm/tpm), ``num_retries = 0`` (a 429 goes down the cascade at once), each request on
   its own cascade (``model`` = the first backend of its tier, ``fallbacks`` = the rest,
   in the same order; a capped request's cascade leaves out the backends whose estimated
   cost is over its cap: LiteLLM has no per-request cost cap, so it is given the
   filtered list), at its priority through LiteLLM's priority scheduler (``priority`` =
   the level's rank, ``polling_interval = 0.03``), with its deadline as the call's
   ``timeout`` (the client gives up then). LiteLLM counts rpm/tpm per real minute and
   has no daily limit, so it runs once per way of scaling the compressed limits
   (``--litellm-variant``, as ``bench/ratelimits.py``): **same-rate** (rpm x 60/minute)
   and **same-count** (the numbers as they are, per real minute).

Reported per side: **cost** (usage x price, the same formula on both sides; each
router's own figure beside it) against **all-paid** (every request on the cheapest paid
model of a tier it needs, at the mock's prompt count and its ``max_tokens``: what the
trace costs with no local or free backend) and the **saving**; the **ideal** cost (each
request on the cheapest backend that could finish it before its deadline with no wait
and within its cap: ignores slots and windows, so a floor for any router that finishes
every request in time);
**deadline attainment** per level (completed before its deadline / submitted);
**upstream 429s** and local servers' busy refusals (the mocks' ``GET /stats``);
failed / expired / rejected; each backend's share; output tokens the paid mocks
generated for answers nobody got (a call cut off or thrown away). Ren-Queue's log adds
the binds per backend, binds that passed a candidate over for its quota, routing
reasons, expiries by stage, and whether its estimator agreed with the bench's.

Results: a table on stdout, JSON in ``bench/results/economics-<UTC>.json`` and
``economics-latest.json``, a plot (matplotlib, a dev extra) in
``bench/results/economics-<UTC>.png`` and ``economics-latest.png``; ``--update-plot``
also copies it to ``bench/economics.png`` (committed). ``--plot-from JSON`` draws the plot
again from a saved report without running anything (``--update-plot`` applies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
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
    read_events,
    run_litellm_phase,
)
from faults import describe
from ratelimits import log_figures

from renqueue import Client, Services, parse_config
from renqueue.broker import connect
from renqueue.config import DEFAULT_PRIORITIES, Config
from renqueue.errors import RequestExpiredError, RequestFailedError, RequestRejectedError
from renqueue.logs import configure_logging
from renqueue.policy import estimate_complexity, estimated_cost
from renqueue.schema import (
    ChatMessage,
    Expired,
    GenerationParams,
    InferenceRequest,
    Preempted,
    Routed,
)

TENANT = "bench"
ROUTE = "chat"
LEVELS: tuple[str, ...] = DEFAULT_PRIORITIES
KINDS = ("simple", "moderate", "hard")
#: The tier each kind of request is written to need.
KIND_TIER = {"simple": 1, "moderate": 2, "hard": 3}
#: Words the prose is made of (about one token each by the 4-characters rule).
WORDS = (
    "queue", "token", "limit", "route", "cost", "model", "answer", "latency", "budget",
    "deadline", "summary", "report", "customer", "invoice", "ticket", "release", "change",
    "service", "account", "policy", "review", "draft", "email", "meeting", "status",
)  # fmt: skip


@dataclass(frozen=True)
class Backend:
    """One mock backend and what is declared for it.

    ``rpm`` / ``tpm`` per compressed minute, ``rpd`` per real day (0: none); ``slots``:
    Ren-Queue's ``limits.concurrency`` and LiteLLM's ``max_parallel_requests`` (a local
    mock also refuses more, with a 503, as an overloaded server would).
    """

    name: str
    kind: str  # local, free or paid
    shaped_like: str
    tier: int
    slots: int
    ttft: float
    tokens_per_second: float
    limit_style: str = "openai"
    rpm: int = 0
    tpm: int = 0
    rpd: int = 0
    cost_input_per_mtok: float = 0.0
    cost_output_per_mtok: float = 0.0

    @property
    def paid(self) -> bool:
        return self.cost_input_per_mtok > 0 or self.cost_output_per_mtok > 0

    def seconds(self, max_tokens: int) -> float:
        """A call's duration with no wait: first token, then ``max_tokens`` at its pace."""
        return self.ttft + max_tokens / self.tokens_per_second

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """US dollars, the same formula for every side."""
        return (
            prompt_tokens * self.cost_input_per_mtok + completion_tokens * self.cost_output_per_mtok
        ) / 1e6


def default_backends() -> tuple[Backend, ...]:
    return (
        Backend(
            "local-small",
            "local",
            "a small model (Llama 3.1 8B class) on the team's own GPU, vLLM/llama.cpp",
            tier=1,
            slots=2,
            ttft=0.1,
            tokens_per_second=120.0,
        ),
        Backend(
            "local-large",
            "local",
            "a large open model (gpt-oss-120b / Qwen3-235B-A22B class) on the team's GPU server",
            tier=3,
            slots=2,
            ttft=0.8,
            tokens_per_second=25.0,
        ),
        Backend(
            "free-groq",
            "free",
            "Groq free tier, llama-3.3-70b-versatile: 30 req/min, 12,000 tok/min, 1,000 req/day",
            tier=2,
            slots=8,
            ttft=0.25,
            tokens_per_second=250.0,
            limit_style="groq",
            rpm=30,
            tpm=12_000,
            rpd=1_000,
        ),
        Backend(
            "free-openrouter",
            "free",
            "OpenRouter :free model (deepseek-chat-v3 class), no credits: 20 req/min, 50 req/day",
            tier=3,
            slots=8,
            ttft=1.2,
            tokens_per_second=40.0,
            limit_style="openrouter",
            rpm=20,
            rpd=50,
        ),
        Backend(
            "paid-small",
            "paid",
            "OpenAI gpt-4o-mini prices: $0.15 / $0.60 per M tokens in / out",
            tier=2,
            slots=32,
            ttft=0.4,
            tokens_per_second=100.0,
            cost_input_per_mtok=0.15,
            cost_output_per_mtok=0.60,
        ),
        Backend(
            "paid-large",
            "paid",
            "OpenAI gpt-4o prices: $2.50 / $10 per M tokens in / out",
            tier=3,
            slots=32,
            ttft=0.5,
            tokens_per_second=80.0,
            cost_input_per_mtok=2.50,
            cost_output_per_mtok=10.00,
        ),
    )


@dataclass(frozen=True)
class Plan:
    requests: int = 300
    #: Requests per second on average over the arrivals (bursts included).
    rate: float = 5.5
    seed: int = 10
    #: Seconds a rate-limit "minute" lasts (15: x4).
    minute: float = 15.0
    #: Bursts in the trace (alternately a spike and a batch job), their share of the
    #: requests and how long each lasts.
    bursts: int = 4
    burst_share: float = 0.4
    burst_seconds: float = 2.0
    mix: tuple[tuple[str, float], ...] = (
        ("critical", 0.05),
        ("high", 0.15),
        ("normal", 0.40),
        ("low", 0.20),
        ("batch", 0.20),
    )
    #: Seconds from submit to each level's deadline.
    deadlines: tuple[tuple[str, float], ...] = (
        ("critical", 6.0),
        ("high", 10.0),
        ("normal", 25.0),
        ("low", 40.0),
        ("batch", 50.0),
    )
    kinds: tuple[tuple[str, float], ...] = (("simple", 0.45), ("moderate", 0.40), ("hard", 0.15))
    #: Share of requests that name their tier (the rest leave it to the estimator).
    named_share: float = 0.5
    #: Share of each level's requests with a cost cap, and the cap as a multiple of the
    #: estimated cost on the cheapest paid backend of their tier (under 1: free only).
    caps: tuple[tuple[str, float, float], ...] = (
        ("normal", 0.2, 1.5),
        ("low", 0.5, 0.5),
        ("batch", 0.5, 0.5),
    )
    #: The route's complexity estimator: scores reaching these are tier 2, 3.
    thresholds: tuple[float, ...] = (0.08, 0.30)
    #: The mocks' answer length (a request's max_tokens caps it: every answer is that long).
    output_tokens: int = 512
    backends: tuple[Backend, ...] = field(default_factory=default_backends)
    litellm_variants: tuple[str, ...] = ("same-rate", "same-count")
    #: Calls made to each backend before the trace (not counted), so a router that learns
    #: from its log starts with that many of each (Ren-Queue's model needs 5); 0: a cold
    #: start.
    warmup: int = 5
    warmup_tokens: int = 64

    @property
    def cascade(self) -> list[str]:
        return [b.name for b in self.backends]

    @property
    def span(self) -> float:
        """Seconds over which the requests arrive."""
        return self.requests / self.rate

    @property
    def compression(self) -> float:
        return 60.0 / self.minute

    @property
    def highest_tier(self) -> int:
        return max(b.tier for b in self.backends)

    def deadline(self, level: str) -> float:
        return dict(self.deadlines)[level]

    def backend(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)


# ------------------------------------------------------------------- the trace


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _weighted(rng: random.Random, pairs: Sequence[tuple[str, float]]) -> str:
    return rng.choices([name for name, _ in pairs], weights=[w for _, w in pairs])[0]


def _messages(rng: random.Random, kind: str) -> list[dict[str, str]]:
    """A prompt written to need ``kind``'s tier: a short question; a conversation or a
    snippet to explain; a long code-and-math task (the estimator's markers)."""
    if kind == "simple":
        return [{"role": "user", "content": f"In one line: {_prose(rng, rng.randint(15, 60))}?"}]
    if kind == "moderate":
        if rng.random() < 0.5:
            turns = rng.choice((3, 5))
            return [
                {
                    "role": "assistant" if i % 2 else "user",
                    "content": _prose(rng, rng.randint(30, 80)),
                }
                for i in range(turns)
            ]
        snippet = "\n".join(_prose(rng, 6) for _ in range(rng.randint(3, 8)))
        text = f"Explain what this does:\n```\n{snippet}\n```\n{_prose(rng, rng.randint(60, 200))}"
        return [{"role": "user", "content": text}]
    code = "\n".join(
        (
            "def plan(queue, budget):",
            "    for item in queue: {",
            "        cost = item.tokens * price;",
            "    }",
            "class Router:",
        )
    )
    math = r"Prove that $\sum_i c_i x_i \le B$ and \frac{a}{b} = 2 where $x^2 + y^2 = 1$."
    text = f"{_prose(rng, rng.randint(200, 600))}\n```\n{code}\n```\n{math}\n" + _prose(rng, 40)
    return [{"role": "user", "content": text}]


def make_trace(plan: Plan) -> list[dict[str, Any]]:
    """The requests, the same for every side (see the module docstring): when (seconds from
    the start), level, kind, messages, ``max_tokens``, deadline, named tier, cost cap."""
    rng = random.Random(plan.seed)
    span = plan.span
    in_bursts = round(plan.requests * plan.burst_share) if plan.bursts else 0
    arrivals: list[tuple[float, str]] = []
    for b in range(plan.bursts):
        count = in_bursts // plan.bursts + (1 if b < in_bursts % plan.bursts else 0)
        start = span * (b + 0.5) / plan.bursts
        kind = "batch job" if b % 2 else "spike"
        arrivals += [(start + rng.uniform(0, plan.burst_seconds), kind) for _ in range(count)]
    arrivals += [(rng.uniform(0, span), "") for _ in range(plan.requests - in_bursts)]
    arrivals.sort()
    caps = {level: (share, factor) for level, share, factor in plan.caps}
    trace = []
    for index, (at, burst) in enumerate(arrivals):
        level = "batch" if burst == "batch job" else _weighted(rng, plan.mix)
        kind = _weighted(rng, plan.kinds)
        urgent = level in ("critical", "high")
        choices = {
            "simple": (32, 64, 96, 128),
            "moderate": (128, 192, 256),
            # An interactive hard request asks for less: a frontier model must be able
            # to finish it before a 6 s deadline.
            "hard": (128, 192, 256) if urgent else (256, 384, 512),
        }[kind]
        share, factor = caps.get(level, (0.0, 0.0))
        trace.append(
            {
                "index": index,
                "at": round(at, 3),
                "burst": burst,
                "level": level,
                "kind": kind,
                "messages": _messages(rng, kind),
                "max_tokens": rng.choice(choices),
                "deadline_s": plan.deadline(level),
                "named": rng.random() < plan.named_share,
                "cap_factor": factor if rng.random() < share else None,
            }
        )
    for item in trace:
        annotate(plan, item)
    return trace


def as_request(item: dict[str, Any], plan: Plan) -> InferenceRequest:
    """The trace item as the router sees it (for the estimator and the cost estimate)."""
    return InferenceRequest(
        id=f"trace-{item['index']}",
        tenant=TENANT,
        route=ROUTE,
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in item["messages"]],
        params=GenerationParams(max_tokens=item["max_tokens"]),
        priority=item["level"],
        complexity=KIND_TIER[item["kind"]] if item["named"] else None,
    )


def annotate(plan: Plan, item: dict[str, Any]) -> None:
    """Add what the trace implies: the tier needed (named, or the route's estimator), the
    prompt tokens the mocks count (characters / 4, rounded up), the cost cap, the all-paid
    cost and the ideal (no-wait) cost."""
    request = as_request(item, plan)
    if item["named"]:
        item["tier"] = KIND_TIER[item["kind"]]
        item["estimate"] = None
    else:
        found = estimate_complexity(request, plan.thresholds, highest=plan.highest_tier)
        item["tier"] = found.tier
        item["estimate"] = {"tier": found.tier, "score": found.score}
    chars = sum(len(m["content"]) for m in item["messages"])
    item["prompt_tokens"] = -(-chars // 4)
    capable = [b for b in plan.backends if b.tier >= item["tier"]]
    paid = min(
        (b for b in capable if b.paid), key=lambda b: b.cost(item["prompt_tokens"], 1_000_000)
    )
    item["all_paid_backend"] = paid.name
    item["all_paid_usd"] = paid.cost(item["prompt_tokens"], item["max_tokens"])
    factor = item.pop("cap_factor")
    item["max_cost"] = None if factor is None else factor * estimated_cost(request, paid)
    # The cascade each side may use: capable, and within the cap by the router's own
    # estimate (LiteLLM is given this list; Ren-Queue applies the same rule itself).
    item["cascade"] = [
        b.name
        for b in capable
        if item["max_cost"] is None or estimated_cost(request, b) <= item["max_cost"]
    ]
    in_time = [
        b
        for b in capable
        if b.name in item["cascade"] and b.seconds(item["max_tokens"]) <= item["deadline_s"]
    ]
    item["feasible"] = bool(in_time)
    item["ideal_backend"] = (
        min(in_time, key=lambda b: (b.cost(item["prompt_tokens"], item["max_tokens"]), b.ttft)).name
        if in_time
        else None
    )
    item["ideal_usd"] = (
        plan.backend(item["ideal_backend"]).cost(item["prompt_tokens"], item["max_tokens"])
        if item["ideal_backend"]
        else 0.0
    )


def trace_summary(plan: Plan, trace: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trace's make-up, its all-paid and ideal costs, and how the estimator judged the
    requests that named no tier (against the kind they were written as)."""
    unnamed = [i for i in trace if not i["named"]]
    agreement = Counter(f"{i['kind']} -> tier {i['tier']}" for i in unnamed)
    all_paid = sum(i["all_paid_usd"] for i in trace)
    ideal = sum(i["ideal_usd"] for i in trace)
    return {
        "requests": len(trace),
        "span_s": plan.span,
        "levels": {level: sum(1 for i in trace if i["level"] == level) for level in LEVELS},
        "kinds": {kind: sum(1 for i in trace if i["kind"] == kind) for kind in KINDS},
        "tiers": dict(sorted(Counter(i["tier"] for i in trace).items())),
        "named": len(trace) - len(unnamed),
        "estimated": dict(sorted(agreement.items())),
        "capped": dict(Counter(i["level"] for i in trace if i["max_cost"] is not None)),
        "bursts": dict(Counter(i["burst"] for i in trace if i["burst"])),
        "max_tokens_mean": sum(i["max_tokens"] for i in trace) / max(1, len(trace)),
        "prompt_tokens_mean": sum(i["prompt_tokens"] for i in trace) / max(1, len(trace)),
        "all_paid_usd": all_paid,
        "all_paid_by_backend": {
            name: sum(i["all_paid_usd"] for i in trace if i["all_paid_backend"] == name)
            for name in plan.cascade
            if any(i["all_paid_backend"] == name for i in trace)
        },
        "ideal_usd": ideal,
        "ideal_saving": 1 - ideal / all_paid if all_paid else None,
        "ideal_paid": dict(
            Counter(
                i["ideal_backend"]
                for i in trace
                if i["ideal_backend"] and plan.backend(i["ideal_backend"]).paid
            )
        ),
        "infeasible": sum(1 for i in trace if not i["feasible"]),
    }


def warmup_calls(plan: Plan) -> list[dict[str, Any]]:
    """``Plan.warmup`` short calls per backend (the same on both sides): backend, prompt."""
    rng = random.Random(plan.seed + 1)
    return [
        {
            "model": b.name,
            "messages": [{"role": "user", "content": f"Warm up: {_prose(rng, 20)}"}],
            "max_tokens": plan.warmup_tokens,
        }
        for b in plan.backends
        for _ in range(plan.warmup)
    ]


# ------------------------------------------------------------------- the mocks


def mock_settings(backend: Backend, plan: Plan) -> dict[str, Any]:
    """The mock's settings (``POST /admin/settings``) for ``backend``: new buckets, full."""
    return {
        "ttft": backend.ttft,
        "tokens_per_second": backend.tokens_per_second,
        "output_tokens": plan.output_tokens,
        "rpm": backend.rpm,
        "tpm": backend.tpm,
        "rpd": backend.rpd,
        "rate_window": plan.minute,
        "limit_style": backend.limit_style,
        # A local server holds only its slots; one more is refused as an overloaded
        # server would (a provider's concurrency is not the limit here: its windows are).
        "concurrency": backend.slots if backend.kind == "local" else 0,
        "busy_status": 503,
    }


def fleet(plan: Plan) -> Any:
    return mock_fleet({b.name: mock_settings(b, plan) for b in plan.backends})


def since(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The mocks' counters of the trace alone: ``after`` less the warm-up's ``before`` (the
    gauges, in flight and its high-water mark, as they are in ``after``)."""
    gauges = ("in_flight", "max_in_flight_seen")
    out: dict[str, Any] = {}
    for name, counters in after.items():
        earlier = before.get(name, {})
        out[name] = {
            key: value - earlier.get(key, 0)
            if isinstance(value, int) and key not in gauges
            else value
            for key, value in counters.items()
        }
    return out


# ------------------------------------------------------------------- Ren-Queue


def renqueue_config(plan: Plan, urls: dict[str, str], data_dir: str) -> Config:
    window = f"{plan.minute:g}s"
    backends: dict[str, Any] = {}
    for b in plan.backends:
        limits: dict[str, Any] = {"concurrency": b.slots}
        requests = [f"{b.rpm}/{window}"] if b.rpm else []
        requests += [f"{b.rpd}/day"] if b.rpd else []
        if requests:
            limits["requests"] = requests
        if b.tpm:
            limits["tokens"] = [f"{b.tpm}/{window}"]
        backends[b.name] = {
            "base_url": urls[b.name],
            "model": b.name,
            "tier": b.tier,
            "limit_style": b.limit_style,
            "cost_input_per_mtok": b.cost_input_per_mtok,
            "cost_output_per_mtok": b.cost_output_per_mtok,
            "limits": limits,
        }
    return parse_config(
        {
            "nats": {"data_dir": data_dir, "port": -1},
            "backends": backends,
            "routes": {
                ROUTE: {
                    "backends": plan.cascade,
                    "complexity": {"thresholds": list(plan.thresholds)},
                },
                # One route per backend for the warm-up calls.
                **{f"warm-{b.name}": {"backends": [b.name]} for b in plan.backends},
            },
            "worker": {"drain_timeout": "5s"},
        },
        source="<bench:economics>",
    )


async def renqueue_request(client: Client, item: dict[str, Any]) -> dict[str, Any]:
    """One request as the trace says it: submit, then wait for its end."""
    request = client.build_request(
        item["messages"],
        route=ROUTE,
        priority=item["level"],
        max_tokens=item["max_tokens"],
        timeout=item["deadline_s"],
        max_cost=item["max_cost"],
        complexity=item["tier"] if item["named"] else None,
    )
    row: dict[str, Any] = {
        "index": item["index"],
        "submitted_at": time.time(),
        "request_id": request.id,
    }
    try:
        handle = await client.submit_request(request)
        result = await handle.result(timeout=item["deadline_s"] + 30)
    except RequestExpiredError as exc:
        row.update(outcome="expired", error=f"{type(exc).__name__}: {exc}"[:300])
    except RequestRejectedError as exc:
        row.update(outcome="rejected", error=f"{type(exc).__name__}: {exc}"[:300])
    except RequestFailedError as exc:
        row.update(outcome="failed", error=f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:  # noqa: BLE001 - every failure is a row
        row.update(outcome="error", error=f"{type(exc).__name__}: {exc}"[:300])
    else:
        row.update(
            outcome="completed",
            backend=result.backend,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            router_cost=result.cost,
        )
    row["ended_at"] = time.time()
    return row


async def run_renqueue(plan: Plan, trace: list[dict[str, Any]]) -> dict[str, Any]:
    async with fleet(plan) as urls:
        with tempfile.TemporaryDirectory(prefix="renqueue-bench-economics-") as tmp:
            config = renqueue_config(plan, urls, tmp)
            async with Services(config, name="bench") as services:
                client_nc = await connect(services.url, name="bench-client")
                client = Client(client_nc, tenant=TENANT)
                try:
                    warmed = await renqueue_warm_up(client, plan)
                    before = await all_mock_stats(urls)
                    t0 = time.time() + 0.5

                    async def one(item: dict[str, Any]) -> dict[str, Any]:
                        await asyncio.sleep(max(0.0, t0 + item["at"] - time.time()))
                        return await renqueue_request(client, item)

                    cpu = time.process_time()
                    rows = list(await asyncio.gather(*(one(item) for item in trace)))
                    cpu = time.process_time() - cpu
                    ended = time.time()
                    events = await read_events(services.js, f"rq.evt.{TENANT}.>")
                finally:
                    await client.close()
                    await client_nc.drain()
        stats = since(await all_mock_stats(urls), before)
    return {
        "began": t0,
        "ended": ended,
        "cpu_s": cpu,
        "warmup": warmed,
        "rows": rows,
        "mocks": stats,
        "log": renqueue_log(events, rows, trace, t0),
    }


async def renqueue_warm_up(client: Client, plan: Plan) -> dict[str, Any]:
    """The warm-up calls, each on its backend's own route: per backend, how many completed
    and the errors of the others."""

    async def one(call: dict[str, Any]) -> tuple[str, str]:
        try:
            handle = await client.submit(
                call["messages"],
                route=f"warm-{call['model']}",
                max_tokens=call["max_tokens"],
                timeout=120,
            )
            await handle.result(timeout=150)
        except Exception as exc:  # noqa: BLE001 - reported with the warm-up
            return call["model"], f"{type(exc).__name__}: {exc}"[:200]
        return call["model"], "ok"

    done = await asyncio.gather(*(one(call) for call in warmup_calls(plan)))
    return {
        name: {
            "ok": sum(1 for n, r in done if n == name and r == "ok"),
            "errors": [r for n, r in done if n == name and r != "ok"][:3],
        }
        for name in plan.cascade
        if any(n == name for n, _ in done)
    }


def renqueue_log(
    events: Sequence[Any],
    rows: Sequence[dict[str, Any]],
    trace: Sequence[dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    """What the event log says: binds per backend (and those that passed a candidate over
    for its quota: :func:`ratelimits.log_figures`), routing reasons, expiries by stage,
    preemptions, and whether the router's estimates match the bench's."""
    figures = log_figures(events, rows)
    by_id = {row["request_id"]: trace[row["index"]] for row in rows}
    reasons: Counter[str] = Counter()
    expired: Counter[str] = Counter()
    preempted = 0
    estimates = {"agree": 0, "differ": 0, "missing": 0}
    estimated_ids: set[str] = set()
    for event in events:
        item = by_id.get(event.request_id)
        if item is None:
            continue
        if isinstance(event, Routed):
            reasons[reason_head(event.reason)] += 1
            if event.complexity_estimate is not None and event.request_id not in estimated_ids:
                estimated_ids.add(event.request_id)
                same = event.complexity_estimate.tier == item["tier"]
                estimates["agree" if same else "differ"] += 1
        elif isinstance(event, Expired):
            expired[f"{event.stage}: {event.reason[:70]}"] += 1
        elif isinstance(event, Preempted):
            preempted += 1
    routed = {event.request_id for event in events if isinstance(event, Routed)}
    unnamed = {rid for rid, item in by_id.items() if not item["named"] and rid in routed}
    estimates["missing"] = len(unnamed - estimated_ids)
    # The history of each critical or high request that missed its deadline, and of the
    # first few others that did.
    missed = [
        row
        for row in rows
        if row["outcome"] != "completed"
        or row["ended_at"] - row["submitted_at"] > trace[row["index"]]["deadline_s"]
    ]
    urgent = [r for r in missed if trace[r["index"]]["level"] in ("critical", "high")]
    shown = urgent + [r for r in missed if r not in urgent][:5]
    histories = {}
    for row in shown:
        item = trace[row["index"]]
        title = (
            f"#{item['index']} {item['level']} {item['kind']} tier {item['tier']} "
            f"max_tokens {item['max_tokens']} at {row['submitted_at'] - t0:.2f}s, deadline "
            f"{item['deadline_s']:g}s: {row['outcome']}"
        )
        histories[title] = [describe(e, t0) for e in events if e.request_id == row["request_id"]]
    figures.update(
        histories=histories,
        reasons=dict(reasons.most_common(8)),
        expired=dict(expired.most_common(8)),
        preempted=preempted,
        estimates=estimates,
    )
    return figures


# --------------------------------------------------------------------- LiteLLM


def reason_head(reason: str) -> str:
    """What kind of choice a ``routed`` reason records: ``cheapest in time``, ``no
    candidate predicted in time``, ``first candidate with room`` (the router before
    cheapest in time), with ``, after a fallback`` when it says so."""
    parts = [part.strip() for part in reason.split(";")]
    head = next(
        (
            part.split(":")[0]
            for part in parts
            if part.startswith(("cheapest in time", "no candidate predicted"))
        ),
        "first candidate with room"
        if not reason or any(p.startswith(("first candidate", "bound to")) for p in parts)
        else parts[0][:60],
    )
    return head + (", after a fallback" if "fell back" in reason else "")


def litellm_backends(plan: Plan, urls: dict[str, str], variant: str) -> list[dict[str, Any]]:
    """The backends as LiteLLM is told them: limits per real minute, scaled by ``variant``
    (same-rate: x 60/minute; same-count: as they are); no daily limit (it has none)."""
    factor = plan.compression if variant == "same-rate" else 1.0
    return [
        {
            "name": b.name,
            "url": urls[b.name],
            "rpm": round(b.rpm * factor) if b.rpm else None,
            "tpm": round(b.tpm * factor) if b.tpm else None,
            "max_parallel_requests": b.slots,
            "price_in_per_mtok": b.cost_input_per_mtok,
            "price_out_per_mtok": b.cost_output_per_mtok,
        }
        for b in plan.backends
    ]


#: The Router's settings besides its model list (see the module docstring).
LITELLM_ROUTER_KWARGS: dict[str, Any] = {
    "routing_strategy": "usage-based-routing-v2",
    "num_retries": 0,
    "polling_interval": 0.03,
}


async def run_litellm(
    plan: Plan, trace: list[dict[str, Any]], python: Path, variant: str
) -> dict[str, Any]:
    longest = max((i["deadline_s"] for i in trace), default=0.0)
    async with fleet(plan) as urls:
        payload: dict[str, Any] = {
            "mode": "trace",
            "backends": litellm_backends(plan, urls, variant),
            "timeout_s": longest,
            "router_kwargs": LITELLM_ROUTER_KWARGS,
            "requests": [
                {
                    "at": item["at"],
                    "messages": item["messages"],
                    "max_tokens": item["max_tokens"],
                    "models": item["cascade"],
                    "priority": LEVELS.index(item["level"]),
                    "deadline": item["deadline_s"],
                }
                for item in trace
            ],
            "warmup": warmup_calls(plan),
        }
        before: dict[str, dict[str, Any]] = {}

        async def snapshot() -> None:
            before.update(await all_mock_stats(urls))

        phase = await run_litellm_phase(
            python, payload, limit=plan.span + longest + 60, on_ready=snapshot
        )
        stats = since(await all_mock_stats(urls), before)
    if phase.report is None:
        return {"error": phase.error}
    report = phase.report
    report["mocks"] = stats
    report["router_kwargs"] = LITELLM_ROUTER_KWARGS
    report["declared"] = {
        b["name"]: {"rpm": b["rpm"], "tpm": b["tpm"]} for b in payload["backends"]
    }
    return report


# -------------------------------------------------------------------- analysis


def figures(plan: Plan, trace: Sequence[dict[str, Any]], side: dict[str, Any]) -> dict[str, Any]:
    """The same figures for either side, from its rows and its mocks' counters."""
    rows = sorted(side["rows"], key=lambda r: r["index"])
    done = [r for r in rows if r["outcome"] == "completed"]
    for row in rows:
        item = trace[row["index"]]
        row["latency_s"] = row["ended_at"] - row["submitted_at"]
        row["on_time"] = row["outcome"] == "completed" and row["latency_s"] <= item["deadline_s"]
    spend = sum(
        plan.backend(r["backend"]).cost(r["prompt_tokens"], r["completion_tokens"])
        for r in done
        if r.get("backend") in plan.cascade
    )
    own = [r.get("router_cost", r.get("litellm_cost")) for r in done]
    all_paid = sum(i["all_paid_usd"] for i in trace)
    all_paid_done = sum(trace[r["index"]]["all_paid_usd"] for r in done)
    levels = {}
    for level in LEVELS:
        mine = [r for r in rows if trace[r["index"]]["level"] == level]
        late = [r["latency_s"] for r in mine if r["outcome"] == "completed"]
        levels[level] = {
            "submitted": len(mine),
            "completed": sum(1 for r in mine if r["outcome"] == "completed"),
            "on_time": sum(1 for r in mine if r["on_time"]),
            "attainment": sum(1 for r in mine if r["on_time"]) / len(mine) if mine else None,
            "latency_p50_s": percentile(late, 50),
            "latency_p95_s": percentile(late, 95),
        }
    mocks = side["mocks"]
    served = Counter(r.get("backend") for r in done)
    wasted = {
        b.name: mocks[b.name]["tokens_out"]
        - sum(r["completion_tokens"] for r in done if r.get("backend") == b.name)
        for b in plan.backends
        if b.paid
    }
    paid_by_tier = Counter(
        f"{r['backend']} tier {trace[r['index']]['tier']}"
        for r in done
        if plan.backend(r["backend"]).paid
    )
    return {
        "requests": len(rows),
        "completed": len(done),
        "on_time": sum(1 for r in rows if r["on_time"]),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "errors": dict(Counter(r["error"][:150] for r in rows if r.get("error")).most_common(6)),
        "spend_usd": spend,
        "spend_router_usd": sum(c for c in own if isinstance(c, (int, float)))
        if any(isinstance(c, (int, float)) for c in own)
        else None,
        "all_paid_usd": all_paid,
        "saving": 1 - spend / all_paid if all_paid else None,
        "all_paid_completed_usd": all_paid_done,
        "saving_on_completed": 1 - spend / all_paid_done if all_paid_done else None,
        "levels": levels,
        "served": {name: served.get(name, 0) for name in plan.cascade},
        "paid_by_tier": dict(sorted(paid_by_tier.items())),
        "upstream_429s": {name: mocks[name]["rate_limited"] for name in plan.cascade},
        "upstream_429s_total": sum(mocks[name]["rate_limited"] for name in plan.cascade),
        "busy_refusals": {
            b.name: mocks[b.name]["busy"] for b in plan.backends if b.kind == "local"
        },
        "upstream_calls": {name: mocks[name]["requests"] for name in plan.cascade},
        "max_in_flight": {name: mocks[name]["max_in_flight_seen"] for name in plan.cascade},
        "wasted_paid_tokens": wasted,
        "wasted_paid_usd": sum(
            n * plan.backend(name).cost_output_per_mtok / 1e6 for name, n in wasted.items()
        ),
        "latency_p50_s": percentile([r["latency_s"] for r in done], 50),
        "latency_p95_s": percentile([r["latency_s"] for r in done], 95),
        "wall_s": max((r["ended_at"] for r in rows), default=0.0)
        - min((r["submitted_at"] for r in rows), default=0.0),
        "cpu_s": side.get("cpu_s"),
    }


def targets(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue #10's targets, per side (reported, not asserted): >= 80 % cheaper than
    all-paid, >= 99 % of critical and high on time; and Ren-Queue against the best LiteLLM
    run on cost, attainment (critical + high, and all) and 429s."""
    out: dict[str, Any] = {}
    for name, side in sides.items():
        urgent = [side["levels"][lv] for lv in ("critical", "high")]
        submitted = sum(lv["submitted"] for lv in urgent)
        on_time = sum(lv["on_time"] for lv in urgent)
        out[name] = {
            "saving_at_least_80": (side["saving"] or 0) >= 0.8,
            "critical_high_on_time": on_time / submitted if submitted else None,
            "critical_high_at_least_99": submitted == 0 or on_time / submitted >= 0.99,
        }
    ours = sides.get("ren-queue")
    others = [s for n, s in sides.items() if n.startswith("litellm")]
    if ours and others:
        mine = out["ren-queue"]["critical_high_on_time"] or 0.0
        out["ren-queue vs every litellm run"] = {
            "cheaper": all(ours["spend_usd"] < s["spend_usd"] for s in others),
            "more_on_time": all(ours["on_time"] > s["on_time"] for s in others),
            "critical_high_no_worse": all(
                mine >= (out[n]["critical_high_on_time"] or 0.0)
                for n in sides
                if n.startswith("litellm")
            ),
            "fewer_429s": all(
                ours["upstream_429s_total"] < s["upstream_429s_total"] for s in others
            ),
            "no_more_429s": all(
                ours["upstream_429s_total"] <= s["upstream_429s_total"] for s in others
            ),
        }
    return out


# ----------------------------------------------------------------------- print


def print_report(report: dict[str, Any]) -> None:
    plan = report["plan"]
    summary = report["trace"]
    sides: dict[str, dict[str, Any]] = report["figures"]
    names = list(sides)
    cascade = [b["name"] for b in plan["backends"]]
    print(
        f"\nEconomics: {summary['requests']} requests over {summary['span_s']:.0f} s "
        f"(open loop, {plan['bursts']} bursts), minute compressed to {plan['minute']:g} s; "
        f"route {' -> '.join(cascade)}"
    )
    for b in plan["backends"]:
        limits = ", ".join(
            text
            for text in (
                f"{b['rpm']}/min" if b["rpm"] else "",
                f"{b['tpm']} tok/min" if b["tpm"] else "",
                f"{b['rpd']}/day" if b["rpd"] else "",
            )
            if text
        )
        price = (
            f"${b['cost_input_per_mtok']:g}/${b['cost_output_per_mtok']:g} per M"
            if b["cost_input_per_mtok"] or b["cost_output_per_mtok"]
            else "free"
        )
        print(
            f"  {b['name']:<16} tier {b['tier']}  {b['slots']:>2} slots  ttft {b['ttft']:<4g} "
            f"{b['tokens_per_second']:>4g} tok/s  {price:<18} {limits}"
        )
    print(
        f"  levels {summary['levels']}; kinds {summary['kinds']}; tiers needed "
        f"{summary['tiers']}; {summary['named']} named a tier, the estimator judged the rest: "
        f"{summary['estimated']}; capped {summary['capped']}"
    )
    print(
        f"  all-paid ${summary['all_paid_usd']:.4f} {summary['all_paid_by_backend']}; ideal "
        f"(no wait, no slots or windows) ${summary['ideal_usd']:.4f} = "
        f"{_pct(summary['ideal_saving'])} saved, paid in it {summary['ideal_paid']}; "
        f"infeasible {summary['infeasible']}"
    )
    if report.get("litellm_missing"):
        print(f"  LiteLLM: not run: {report['litellm_missing']}")
    for name, lit in report.get("litellm", {}).items():
        if "error" in lit:
            print(f"  LiteLLM {name}: {lit['error']}")
    width = 22
    print("\n  " + f"{'':<36}" + "".join(f"{n:>{width}}" for n in names))

    def line(label: str, cells: list[str]) -> None:
        print("  " + f"{label:<36}" + "".join(f"{c:>{width}}" for c in cells))

    def per_backend(key: str) -> list[str]:
        return ["/".join(str(sides[n][key][b]) for b in cascade) for n in names]

    line("cost $ (usage x price)", [f"{sides[n]['spend_usd']:.4f}" for n in names])
    line(
        "  the router's own figure $",
        [
            "-" if sides[n]["spend_router_usd"] is None else f"{sides[n]['spend_router_usd']:.4f}"
            for n in names
        ],
    )
    line("SAVED vs all-paid", [_pct(sides[n]["saving"]) for n in names])
    line(
        "  vs all-paid of what it completed", [_pct(sides[n]["saving_on_completed"]) for n in names]
    )
    line(
        "ON TIME (completed by the deadline)",
        [f"{sides[n]['on_time']}/{sides[n]['requests']}" for n in names],
    )
    for level in LEVELS:
        line(
            f"  {level} ({plan_deadline(plan, level):g} s)",
            [_level_cell(sides[n]["levels"][level]) for n in names],
        )
    line("upstream 429s", [str(sides[n]["upstream_429s_total"]) for n in names])
    line("  per mock", per_backend("upstream_429s"))
    line(
        "local busy refusals (503)",
        ["/".join(str(v) for v in sides[n]["busy_refusals"].values()) for n in names],
    )
    line(
        "completed / failed / expired / other",
        [_outcome_cell(sides[n]) for n in names],
    )
    line("served " + "/".join(b.split("-")[-1][:5] for b in cascade), per_backend("served"))
    line(
        "  share on local / free / paid",
        [_shares(plan, sides[n]) for n in names],
    )
    line("upstream calls", per_backend("upstream_calls"))
    line(
        "paid tokens nobody got ($)",
        [
            f"{sum(sides[n]['wasted_paid_tokens'].values())} ({sides[n]['wasted_paid_usd']:.4f})"
            for n in names
        ],
    )
    line(
        "latency p50 / p95 s",
        [f"{sides[n]['latency_p50_s']:.2f} / {sides[n]['latency_p95_s']:.2f}" for n in names],
    )
    line("wall s", [f"{sides[n]['wall_s']:.1f}" for n in names])
    line(
        "process CPU s",
        [f"{sides[n]['cpu_s']:.1f}" if sides[n]["cpu_s"] is not None else "-" for n in names],
    )
    for name in names:
        print(f"  {name}: paid calls {sides[name]['paid_by_tier'] or 'none'}")
        if sides[name]["errors"]:
            print(f"    errors: {sides[name]['errors']}")
    side = report.get("renqueue")
    if side:
        log = side["log"]
        print(
            f"\n  ren-queue, its log: binds {log['routed']}; {log['binds_passing_over_quota']} "
            f"binds passed a candidate over for its quota ({log['passed_over_for']})"
        )
        print(f"    passed over otherwise {log['passed_over_otherwise']}")
        print(f"    reasons {log['reasons']}")
        print(f"    expired {log['expired'] or 'none'}; preempted {log['preempted']}")
        print(f"    estimator in the routed events vs the bench's: {log['estimates']}")
        print(f"    warm-up (not counted): {side['warmup'] or 'none'}")
        for title, lines in log["histories"].items():
            print(f"    {title}")
            for text in lines:
                print(f"      {text}")
    for name, lit in report.get("litellm", {}).items():
        if "router_settings" in lit:
            declared = ", ".join(
                f"{b} rpm={v['rpm']} tpm={v['tpm']}"
                for b, v in lit["declared"].items()
                if v["rpm"] or v["tpm"]
            )
            print(f"\n  litellm {name}: {declared} per real minute; {lit['router_settings']}")
            print(f"    warm-up (not counted): {lit.get('warmup') or 'none'}")
    print("\n  targets (reported, not asserted):")
    for name, verdict in report["targets"].items():
        print(f"    {name}: {verdict}")


def plan_deadline(plan: dict[str, Any], level: str) -> float:
    return float(dict(plan["deadlines"])[level])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _outcome_cell(side: dict[str, Any]) -> str:
    failed = side["outcomes"].get("failed", 0)
    expired = side["outcomes"].get("expired", 0)
    other = side["requests"] - side["completed"] - failed - expired
    return f"{side['completed']}/{failed}/{expired}/{other}"


def _level_cell(level: dict[str, Any]) -> str:
    if not level["submitted"]:
        return "-"
    return f"{level['attainment']:.0%} ({level['on_time']}/{level['submitted']})"


def _shares(plan: dict[str, Any], side: dict[str, Any]) -> str:
    done = max(1, side["completed"])
    kinds = {b["name"]: b["kind"] for b in plan["backends"]}
    by_kind: Counter[str] = Counter()
    for name, n in side["served"].items():
        by_kind[kinds[name]] += n
    return " / ".join(f"{by_kind[k] / done:.0%}" for k in ("local", "free", "paid"))


# ------------------------------------------------------------------------ plot

SIDE_COLOURS = ("#2ca02c", "#1f77b4", "#9467bd", "#8c564b")
BACKEND_COLOURS = ("#98df8a", "#2ca02c", "#aec7e8", "#1f77b4", "#ffbb78", "#d62728")


def plot(report: dict[str, Any], path: Path) -> None:
    """Cost against all-paid and the ideal; attainment per level; backend shares; 429s."""
    import matplotlib  # noqa: PLC0415 - a dev extra, only needed here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sides: dict[str, dict[str, Any]] = report["figures"]
    if not sides:
        return
    names = list(sides)
    summary = report["trace"]
    cascade = [b["name"] for b in report["plan"]["backends"]]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), layout="constrained")
    cost, attain, share, limits = axes[0][0], axes[0][1], axes[1][0], axes[1][1]

    xs = range(len(names))
    bars = cost.bar(xs, [sides[n]["spend_usd"] for n in names], color=SIDE_COLOURS[: len(names)])
    for bar, name in zip(bars, names, strict=True):
        cost.annotate(
            f"${sides[name]['spend_usd']:.3f}\n{_pct(sides[name]['saving'])} saved",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    all_paid = summary["all_paid_usd"]
    cost.axhline(all_paid, color="#d62728", linestyle="--", linewidth=1, label="all paid")
    cost.axhline(
        all_paid * 0.2, color="grey", linestyle=":", linewidth=1, label="target: 80 % below"
    )
    cost.axhline(
        summary["ideal_usd"],
        color="#2ca02c",
        linestyle="-.",
        linewidth=1,
        label="ideal (no wait, no slots or windows)",
    )
    top = max([all_paid, *(sides[n]["spend_usd"] for n in names)])
    cost.set_ylim(0, top * 1.35)
    cost.legend(fontsize=8, loc="upper left")
    cost.set_xticks(list(xs), names, fontsize=9)
    cost.set_ylabel("US dollars for the trace")
    cost.set_title("Cost (usage x price)", fontsize=10)

    width = 0.8 / len(names)
    for k, name in enumerate(names):
        values = [100 * (sides[name]["levels"][lv]["attainment"] or 0) for lv in LEVELS]
        attain.bar(
            [i + k * width for i in range(len(LEVELS))],
            values,
            width,
            label=name,
            color=SIDE_COLOURS[k],
        )
    attain.axhline(
        99, color="#d62728", linestyle="--", linewidth=1, label="target 99 % (critical, high)"
    )
    attain.set_xticks(
        [i + width * (len(names) - 1) / 2 for i in range(len(LEVELS))],
        [f"{lv}\n{plan_deadline(report['plan'], lv):g} s" for lv in LEVELS],
        fontsize=9,
    )
    attain.set_ylim(0, 105)
    attain.set_ylabel("% completed before the deadline")
    attain.set_title("Deadline attainment per level", fontsize=10)
    attain.legend(fontsize=8, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))

    bottoms = [0.0] * len(names)
    for colour, backend in zip(BACKEND_COLOURS, cascade, strict=False):
        values = [100 * sides[n]["served"][backend] / max(1, sides[n]["requests"]) for n in names]
        share.barh(list(xs), values, left=bottoms, color=colour, label=backend)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    missed = [100 - b for b in bottoms]
    share.barh(list(xs), missed, left=bottoms, color="#dddddd", label="not completed")
    share.set_yticks(list(xs), names, fontsize=9)
    share.invert_yaxis()
    share.set_xlim(0, 100)
    share.set_xlabel("% of the requests, by who served them")
    share.set_title("Backend share (cascade order, left to right)", fontsize=10)
    share.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))

    left = [0.0] * len(names)
    for colour, backend in zip(BACKEND_COLOURS, cascade, strict=False):
        counts = [float(sides[n]["upstream_429s"][backend]) for n in names]
        if any(counts):
            limits.barh(list(xs), counts, left=left, color=colour, label=backend)
            left = [a + v for a, v in zip(left, counts, strict=True)]
    for i, name in enumerate(names):
        limits.text(left[i], i, f" {sides[name]['upstream_429s_total']}", va="center", fontsize=9)
    limits.set_xlim(0, max(1.0, *left) * 1.15)
    limits.set_yticks(list(xs), names, fontsize=9)
    limits.invert_yaxis()
    limits.set_xlabel("429s the mocks answered")
    limits.set_title("Upstream 429s (the mocks' own counters)", fontsize=10)
    if any(left):
        limits.legend(fontsize=8)
    fig.suptitle(
        f"Economics: {summary['requests']} requests over {summary['span_s']:.0f} s, "
        f"seed {report['plan']['seed']}, {report['label']}  "
        f"({report['timestamp']})",
        fontsize=11,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------ main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan(
        requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        minute=args.minute,
        warmup=args.warmup,
    )
    if args.litellm_variant:
        plan = replace(plan, litellm_variants=tuple(args.litellm_variant))
    trace = make_trace(plan)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report: dict[str, Any] = {
        "benchmark": "economics",
        "timestamp": stamp,
        "plan": {**asdict(plan), "compression": plan.compression, "span": plan.span},
        "trace": trace_summary(plan, trace),
        "machine": machine_info(httpx=httpx.__version__),
        "label": args.label,
        "figures": {},
        "litellm": {},
    }
    began = time.perf_counter()
    if not args.no_renqueue:
        print("Ren-Queue phase ...", flush=True)
        side = await run_renqueue(plan, trace)
        report["renqueue"] = side
        report["figures"]["ren-queue"] = figures(plan, trace, side)
    if not args.no_litellm:
        python, note = await asyncio.to_thread(litellm_python, args.fresh_litellm)
        report["litellm_install"] = note
        if python is None:
            report["litellm_missing"] = note
            print(f"  LiteLLM unavailable: {note}", flush=True)
        else:
            for variant in plan.litellm_variants:
                print(f"LiteLLM phase ({variant}) ...", flush=True)
                result = await run_litellm(plan, trace, python, variant)
                report["litellm"][variant] = result
                if "error" in result:
                    print(f"  {result['error']}", flush=True)
                    continue
                report["figures"][f"litellm {variant}"] = figures(plan, trace, result)
    report["label"] = args.label or f"commit {report['machine']['git_commit'][:12]}"
    report["targets"] = targets(report["figures"])
    report["requests"] = trace
    report["total_seconds"] = time.perf_counter() - began
    return report


def replot(saved: Path, *, update: bool) -> None:
    """The plot of a saved report, drawn again (a changed title or layout, no new run)."""
    report = json.loads(saved.read_text())
    picture = saved.with_suffix(".png")
    plot(report, picture)
    print(f"  plot: {picture}")
    if update:
        shutil.copyfile(picture, ROOT / "bench" / "economics.png")
        print("  plot copied to bench/economics.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="requests in the trace")
    parser.add_argument("--rate", type=float, default=5.5, help="requests per second, on average")
    parser.add_argument("--seed", type=int, default=10, help="seeds the trace")
    parser.add_argument(
        "--minute", type=float, default=15.0, help="seconds a rate-limit minute lasts (15: x4)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="calls to each backend before the trace, not counted (0: a cold start)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 40 requests (about 1.5 minutes)"
    )
    parser.add_argument("--no-renqueue", action="store_true", help="skip the Ren-Queue phase")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM phases")
    parser.add_argument(
        "--litellm-variant",
        action="append",
        choices=("same-rate", "same-count"),
        help="LiteLLM's rpm/tpm scaling (repeatable; default both)",
    )
    parser.add_argument(
        "--fresh-litellm", action="store_true", help="remake the LiteLLM venv before running"
    )
    parser.add_argument(
        "--update-plot",
        action="store_true",
        help="also copy the plot to bench/economics.png (the committed one)",
    )
    parser.add_argument(
        "--label",
        help="what was measured, for the report and the plot's title (default: the git "
        "commit; say which when running a copy with no .git, as compare.py does)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write JSON and plot")
    parser.add_argument(
        "--plot-from",
        type=Path,
        metavar="JSON",
        help="run nothing: draw the plot again from a saved report (e.g. "
        "bench/results/economics-latest.json), beside it as .png",
    )
    args = parser.parse_args()
    if args.plot_from is not None:
        replot(args.plot_from, update=args.update_plot)
        return
    if args.quick:
        args.requests = 40
    # The services log every 429 and expiry they meet as a warning: many lines here.
    configure_logging(level="ERROR")
    report = asyncio.run(run(args))
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"economics-{report['timestamp']}.json"
    text = json.dumps(report, indent=2, default=str) + "\n"
    path.write_text(text)
    (args.out / "economics-latest.json").write_text(text)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"\n  JSON: {shown}")
    picture = path.with_suffix(".png")
    try:
        plot(report, picture)
    except ImportError as exc:
        print(f"  no plot: {exc} (matplotlib is in the dev extra)")
    else:
        if picture.exists():
            shutil.copyfile(picture, args.out / "economics-latest.png")
            print(
                f"  plot: {picture.relative_to(ROOT) if picture.is_relative_to(ROOT) else picture}"
            )
            if args.update_plot:
                shutil.copyfile(picture, ROOT / "bench" / "economics.png")
                print("  plot copied to bench/economics.png")
    print(f"  total {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
