"""What A/B splits cost (issue #10 item 5): the fold's throughput with and without a
split, the size of a split's state and view after a long busy run, and the binder's
per-request placement and per-second judgement.

In process, no NATS: the fold (renqueue.state.fold_many in batches of 512, as the
projector folds) over a synthetic log of ``--requests`` requests, each ``routed``,
``started`` and ``completed``, ``--in-flight`` of them open at a time, ``--rate``
requests a second of event time. Run: ``make bench-ab`` (or ``python bench/ab.py``).
Prints a table; writes bench/results/ab.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from common import RESULTS, machine_info

from renqueue.config import parse_config
from renqueue.coordination import SplitView, encode_view
from renqueue.policy import assign, judge
from renqueue.schema import ChatMessage, Completed, Event, InferenceRequest, Routed, Started, Usage
from renqueue.state import ProjectionState, encode_state, fold_many

BATCH = 512


def config(split: bool) -> Any:
    backend = {"base_url": "http://127.0.0.1:1/v1", "model": "m"}
    ab = {
        "arms": {"chat": 90, "canary": 10},
        "control": "chat",
        "key": "metadata.user",
        "rollback": {"error_rate": 0.2, "p95_latency": "8s", "min_requests": 20, "window": "10m"},
    }
    return parse_config(
        {
            "backends": {"a": backend, "b": backend},
            "routes": {
                "chat": {"backends": ["a"], **({"ab": ab} if split else {})},
                "canary": {"backends": ["b"]},
            },
        }
    )


def log(requests: int, in_flight: int, rate: float, *, split: bool, seed: int) -> list[Event]:
    """``requests`` requests, each routed, started and completed, ``in_flight`` open at
    a time, one arriving every ``1 / rate`` seconds of event time."""
    rng = random.Random(seed)
    policy = config(True).routes["chat"].ab.policy("chat")
    events: list[Event] = []
    opened: list[tuple[str, str, float]] = []
    for n in range(requests):
        at = 1_000_000.0 + n / rate
        rid = f"r{n}"
        arm = ""
        if split:
            probe = InferenceRequest(
                id=rid,
                tenant="t",
                route="chat",
                messages=[ChatMessage(role="user", content="x")],
                metadata={"user": f"u{rng.randrange(5000)}"},
            )
            arm = assign(policy, probe)
        backend = "b" if arm == "canary" else "a"
        events.append(
            Routed(
                request_id=rid,
                tenant="t",
                at=at,
                backend=backend,
                attempt=1,
                priority="normal",
                queue_wait=rng.uniform(0, 0.5),
                split="chat" if split else "",
                arm=arm,
            )
        )
        events.append(
            Started(
                request_id=rid,
                tenant="t",
                at=at,
                backend=backend,
                attempt=1,
                delivery=1,
                worker="w",
            )
        )
        opened.append((rid, backend, at))
        if len(opened) > in_flight:
            done, done_backend, began = opened.pop(rng.randrange(len(opened)))
            duration = rng.lognormvariate(0.0, 0.5)
            events.append(
                Completed(
                    request_id=done,
                    tenant="t",
                    at=max(at, began + duration),
                    backend=done_backend,
                    attempt=1,
                    delivery=1,
                    text="",
                    usage=Usage(prompt_tokens=100, completion_tokens=50),
                    cost=0.0001,
                    ttft=duration / 5,
                    duration=duration,
                )
            )
    return events


def fold_once(events: list[Event]) -> tuple[float, ProjectionState]:
    """Events folded per second, and the state, in batches as the projector folds."""
    state = ProjectionState()
    started = time.perf_counter()
    for start in range(0, len(events), BATCH):
        state = fold_many(state, events[start : start + BATCH])
    return len(events) / (time.perf_counter() - started), state


def fold_rates(
    plain: list[Event], split: list[Event], rounds: int
) -> tuple[float, float, ProjectionState, ProjectionState]:
    """The median events/s of each log over ``rounds``, run alternately (the
    machine is shared: a busy spell slows both alike), and their final states."""
    plain_rates, split_rates = [], []
    for _ in range(rounds):
        rate, plain_state = fold_once(plain)
        plain_rates.append(rate)
        rate, split_state = fold_once(split)
        split_rates.append(rate)
    return (
        statistics.median(plain_rates),
        statistics.median(split_rates),
        plain_state,
        split_state,
    )


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``fn`` (the best of 3 runs of ``calls``)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--in-flight", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s of event time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    plain = log(args.requests, args.in_flight, args.rate, split=False, seed=args.seed)
    split = log(args.requests, args.in_flight, args.rate, split=True, seed=args.seed)
    plain_rate, split_rate, plain_state, split_state = fold_rates(plain, split, args.rounds)
    folded = split_state.splits.routes["chat"]
    view = encode_view(SplitView(last_seq=1, split=folded))
    policy = config(True).routes["chat"].ab.policy("chat")
    request = InferenceRequest(
        id="r",
        tenant="t",
        route="chat",
        messages=[ChatMessage(role="user", content="x")],
        metadata={"user": "u1"},
    )
    now = split[-1].at
    results: dict[str, Any] = {
        "requests": args.requests,
        "in_flight": args.in_flight,
        "rate_per_s": args.rate,
        "event_time_s": round(split[-1].at - split[0].at, 1),
        "events": len(split),
        "fold_events_per_s_no_split": round(plain_rate),
        "fold_events_per_s_split": round(split_rate),
        "fold_slowdown": round(plain_rate / split_rate, 3),
        "state_bytes_no_split": len(encode_state(plain_state)),
        "state_bytes_split": len(encode_state(split_state)),
        "split_view_bytes": len(view),
        "buckets_per_arm": {arm: len(s.recent) for arm, s in folded.arms.items()},
        "open_requests_remembered": len(split_state.splits.requests),
        "assign_us": round(per_call(lambda: assign(policy, request), 20_000), 2),
        "judge_us": round(per_call(lambda: judge(policy, folded.arms, now), 2_000), 1),
    }
    rows = [
        ("events folded", f"{len(split)} ({results['event_time_s']} s of event time)"),
        ("fold, no split", f"{results['fold_events_per_s_no_split']:,} events/s"),
        ("fold, 90/10 split", f"{results['fold_events_per_s_split']:,} events/s"),
        ("slowdown", f"x{results['fold_slowdown']}"),
        ("checkpoint, no split", f"{results['state_bytes_no_split']:,} bytes"),
        ("checkpoint, split", f"{results['state_bytes_split']:,} bytes"),
        ("view.split.chat", f"{results['split_view_bytes']:,} bytes"),
        ("buckets per arm", json.dumps(results["buckets_per_arm"])),
        ("assign() per request", f"{results['assign_us']} us"),
        ("judge() per split, full buckets", f"{results['judge_us']} us"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "ab.json"
    out.write_text(
        json.dumps({"results": results, "machine": machine_info()}, indent=2, sort_keys=True) + "\n"
    )
    print(f"written to {out.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
