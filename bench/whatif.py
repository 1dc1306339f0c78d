"""What-if replay speed (issue #10 item 6): how long ``renqueue replay --what-if``
takes to simulate an hour of recorded traffic.

No NATS here: the trace is made by hand, as :func:`renqueue.sim.trace_of`
would make it from the log, so only the simulation is timed. An hour of
Poisson arrivals (``--requests``, 3000 by default) at every level, deadlines
from 1 s to none; three backends as a team has them (a local server with 4
slots, a free tier of 8 slots limited to 30 requests a minute, a paid API of
16 slots), each with recorded calls spread over the hour (their speed
drifts, as real ones do) and a few failures. Then, each timed:

1. fitting the models (:func:`renqueue.sim.fit_models`);
2. the live config simulated (:func:`renqueue.sim.simulate`);
3. the same without the paid backend: queues build up, so rounds plan over
   many waiting requests (the expensive case);
4. the same with the route's strategy ``cascade`` (the first candidate with
   room) instead of ``cheapest`` (in time).

Each row: wall time, planner rounds, backend runs, and what the simulation
came to (cost, expired). Results: a table on stdout, JSON in
``bench/results/whatif-<UTC>.json`` (+ ``whatif-latest.json``).

    .venv/bin/python bench/whatif.py                 # 3000 requests in an hour
    .venv/bin/python bench/whatif.py --requests 6000
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import UTC, datetime
from typing import Any

from common import RESULTS, machine_info

from renqueue import ChatMessage, GenerationParams, InferenceRequest, parse_config
from renqueue.config import Config
from renqueue.sim import (
    Arrival,
    CallRecord,
    FailureRecord,
    Recorded,
    Trace,
    fit_models,
    simulate,
    summarize,
)

START = 1_780_000_000.0
HOUR = 3600.0
LEVELS = {"critical": 2.0, "high": 5.0, "normal": 15.0, "low": 60.0, "batch": None}
#: Each backend: (slots, time to first token, seconds per output token, failure share).
BACKENDS = {
    "local": (4, 0.2, 0.02, 0.0),
    "free": (8, 0.4, 0.01, 0.03),
    "paid": (16, 0.1, 0.005, 0.01),
}


def config(*, paid: bool = True, strategy: str = "cheapest") -> Config:
    backends: dict[str, Any] = {
        "local": {"limits": {"concurrency": 4}},
        "free": {"limits": {"concurrency": 8, "requests": ["30/min"]}},
    }
    if paid:
        backends["paid"] = {
            "limits": {"concurrency": 16},
            "cost_input_per_mtok": 0.15,
            "cost_output_per_mtok": 0.6,
        }
    return parse_config(
        {
            "backends": {
                name: {"base_url": "http://mock", "model": "m", **settings}
                for name, settings in backends.items()
            },
            "routes": {"chat": {"backends": list(backends), "strategy": strategy}},
        }
    )


def make_trace(requests: int, seed: int) -> Trace:
    draw = random.Random(seed)
    arrivals = []
    at = START
    for index in range(requests):
        at += draw.expovariate(requests / HOUR)
        level = draw.choice(list(LEVELS))
        budget = LEVELS[level]
        output = draw.choice([32, 64, 128, 256, 512])
        arrivals.append(
            Arrival(
                at=at,
                request=InferenceRequest(
                    id=f"r{index}",
                    route="chat",
                    messages=[ChatMessage(role="user", content="x" * draw.randint(40, 4000))],
                    params=GenerationParams(max_tokens=1024),
                    priority=level,
                    deadline=None if budget is None else at + budget,
                ),
                recorded=Recorded(kind="completed", output_tokens=output, prompt_tokens=500),
            )
        )
    calls = []
    failures = []
    for name, (_slots, ttft, per_token, fail) in BACKENDS.items():
        for index in range(400):
            when = START + index * HOUR / 400
            drift = 1 + 0.5 * draw.random()  # slower and faster spells
            tokens = draw.choice([32, 64, 128, 256, 512])
            calls.append(
                CallRecord(
                    backend=name,
                    at=when,
                    ttft=ttft * drift,
                    generating=per_token * drift * (tokens - 1),
                    tokens=tokens,
                    overhead=0.01 * drift,
                )
            )
            if draw.random() < fail:
                failures.append(
                    FailureRecord(
                        backend=name,
                        at=when,
                        error_type="backend_unavailable",
                        error_class="server_error",
                        after=ttft,
                    )
                )
    return Trace(
        since=START,
        until=START + HOUR,
        arrivals=tuple(arrivals),
        calls=tuple(calls),
        failures=tuple(failures),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="arrivals in the hour")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trace = make_trace(args.requests, args.seed)
    live = config()
    started = time.perf_counter()
    models = fit_models(trace, live.backends)
    fitted = time.perf_counter() - started
    rows: list[dict[str, Any]] = [{"what": "fit models", "seconds": fitted}]
    for name, cfg in (
        ("live config", live),
        ("without paid", config(paid=False)),
        ("cascade", config(strategy="cascade")),
    ):
        started = time.perf_counter()
        simulation = simulate(trace, cfg, models, seed=args.seed)
        seconds = time.perf_counter() - started
        summary = summarize(simulation.outcomes, cfg.priorities)
        rows.append(
            {
                "what": name,
                "seconds": seconds,
                "rounds": simulation.rounds,
                "runs": simulation.runs,
                "cost": summary.cost,
                "expired": summary.ended["expired"],
                "stopped_early": simulation.stopped_early,
            }
        )
    print(f"What-if simulation of {args.requests} requests over an hour (seed {args.seed})")
    print(f"{'':<16} {'seconds':>8} {'rounds':>8} {'runs':>6} {'cost $':>10} {'expired':>8}")
    for row in rows:
        if "rounds" not in row:
            print(f"{row['what']:<16} {row['seconds']:>8.2f}")
            continue
        print(
            f"{row['what']:<16} {row['seconds']:>8.2f} {row['rounds']:>8} {row['runs']:>6}"
            f" {row['cost']:>10.4f} {row['expired']:>8}"
        )
    report = {
        "benchmark": "whatif",
        "at": datetime.now(tz=UTC).isoformat(),
        "requests": args.requests,
        "seed": args.seed,
        "rows": rows,
        "machine": machine_info(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(tz=UTC).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(report, indent=2) + "\n"
    (RESULTS / f"whatif-{stamp}.json").write_text(text)
    (RESULTS / "whatif-latest.json").write_text(text)


if __name__ == "__main__":
    main()
