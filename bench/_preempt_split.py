"""Where a preempting request's submit -> start goes (issue 31, item 5).

Runs ``bench/scheduling.py``'s preemption part (preemption on) ``--runs``
times, with a timestamp (``time.time()``, one clock: everything runs in this
process) taken at each step of the protocol by wrapping the services' own
methods here (the product is not changed), and prints p50/p95/max of each
step over the critical requests a run was preempted for:

    PYTHONPATH=. python bench/_preempt_split.py --runs 3 [--json out.json]

Steps: the client's submit to the router's fetch and hold; the round that
decides to ask; the ask reaching the worker; its offer answered by a confirm;
the call stopped; the grace (``preempt_grace``); the put-back (``preempted``
event, the copy, the ack); the freed slot's announcement reaching the binder;
the bind; the worker's fetch of the dispatch; the backend call's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scheduling

from renqueue.schema import ASK_DECODER, CONFIRM_DECODER, Preempted, Started
from renqueue.services.router import _capacity, _dispatch, _hold, _intake, _round
from renqueue.services.worker import _call, _outcomes, _worker, _yielding
from renqueue.services.worker import _delivery as _wdelivery

#: name -> request id -> first time seen (time.time()).
MARKS: dict[str, dict[str, float]] = defaultdict(dict)
#: Times a worker's freed-slot announcement reached the router.
FREED: list[float] = []
ROUNDS: list[tuple[float, float]] = []
#: Broker reads of a backend's in-flight count: (time, count read).
READS: list[tuple[float, int]] = []


def mark(name: str, key: str) -> None:
    MARKS[name].setdefault(key, time.time())


def wrap_async(cls: Any, attr: str, before: Any = None, after: Any = None) -> None:
    original = getattr(cls, attr)

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = await original(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return result

    setattr(cls, attr, wrapper)


def install() -> None:
    original_add = _hold.Hold.add

    def add(self: Any, level: str, item: Any) -> None:
        mark("held", item.request.id)
        original_add(self, level, item)

    _hold.Hold.add = add  # type: ignore[method-assign]

    original_maybe = _round.Round._maybe_preempt

    def maybe(self: Any, item: Any, action: Any, now: float) -> None:
        mark("decide", item.request.id)
        original_maybe(self, item, action, now)

    _round.Round._maybe_preempt = maybe  # type: ignore[method-assign]

    original_bind = _round.Round._bind

    def bind(self: Any, item: Any, action: Any, now: float, term: int) -> None:
        mark("bind", item.request.id)
        original_bind(self, item, action, now, term)

    _round.Round._bind = bind  # type: ignore[method-assign]

    original_round = _round.Round._round

    async def round_(self: Any, term: int) -> Any:
        began = time.time()
        try:
            return await original_round(self, term)
        finally:
            ROUNDS.append((began, time.time()))

    _round.Round._round = round_  # type: ignore[method-assign]

    original_freed = _round.Round.on_freed

    async def on_freed(self: Any, msg: Any) -> None:
        FREED.append(time.time())
        await original_freed(self, msg)

    _round.Round.on_freed = on_freed  # type: ignore[method-assign]

    original_refresh = _capacity.Capacity.refresh

    async def refresh(self: Any, backends: list[str], **kwargs: Any) -> None:
        before = dict(self._at)
        await original_refresh(self, backends, **kwargs)
        for name in backends:
            if self._at[name] != before.get(name):
                READS.append((time.time(), self._known[name]))

    _capacity.Capacity.refresh = refresh  # type: ignore[method-assign]

    original_claims = _intake.Intake._claims_of

    async def claims_of(self: Any, msgs: list[Any]) -> Any:
        now = time.time()
        for msg in msgs:
            with contextlib.suppress(Exception):  # not a request: not ours to time
                MARKS["fetched_by_router"].setdefault(
                    scheduling.REQUEST_DECODER.decode(msg.data).id, now
                )
        return await original_claims(self, msgs)

    _intake.Intake._claims_of = claims_of  # type: ignore[method-assign]

    wrap_async(
        _dispatch.Dispatcher,
        "bind",
        after=lambda self, item, *a, **k: mark("dispatched", item.request.id),
    )

    original_on_message = _yielding.Preemptible.on_message

    async def on_message(self: Any, msg: Any) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        try:
            if token == "ask":
                mark("ask_at_worker", ASK_DECODER.decode(msg.data).by)
            elif token == self.token:
                by = CONFIRM_DECODER.decode(msg.data).by
                mark("confirm_at_worker", by)
        except Exception:  # noqa: BLE001 - instrumentation only
            pass
        await original_on_message(self, msg)

    _yielding.Preemptible.on_message = on_message  # type: ignore[method-assign]

    wrap_async(
        _worker.Worker,
        "_call_stopped",
        before=lambda self, delivery, by: by and mark("call_stopped", by),
    )
    wrap_async(
        _outcomes.Outcomes,
        "requeue",
        before=lambda self, delivery, run, by: mark("requeue_begins", by),
        after=lambda self, delivery, run, by: mark("requeued", by),
    )
    original_open = _wdelivery.Delivery.open

    def open_(self: Any, *, backend: str, stride: int) -> Any:
        dispatch = original_open(self, backend=backend, stride=stride)
        mark("fetched", dispatch.request.id)
        return dispatch

    _wdelivery.Delivery.open = open_  # type: ignore[method-assign]

    original_call = _call.Caller.call

    async def call(self: Any, dispatch: Any, *args: Any, **kwargs: Any) -> Any:
        mark("call", dispatch.request.id)
        return await original_call(self, dispatch, *args, **kwargs)

    _call.Caller.call = call  # type: ignore[method-assign]


CAPTURED: dict[str, Any] = {}


def capture() -> None:
    original = scheduling.analyse_preemption

    def analyse(pp: Any, preemption: bool, raw: Any, batch: Any, critical: Any, *rest: Any) -> Any:
        CAPTURED["critical"] = dict(critical)
        CAPTURED["events"] = list(rest[1])
        return original(pp, preemption, raw, batch, critical, *rest)

    scheduling.analyse_preemption = analyse


STEPS = (
    ("submit -> router fetched it", "submit", "fetched_by_router"),
    ("fetched -> router holds it", "fetched_by_router", "held"),
    ("held -> round decides to ask", "held", "decide"),
    ("decide -> ask at worker", "decide", "ask_at_worker"),
    ("ask -> confirm at worker (offer window)", "ask_at_worker", "confirm_at_worker"),
    ("confirm -> call stopped", "confirm_at_worker", "call_stopped"),
    ("call stopped -> requeue begins (grace)", "call_stopped", "requeue_begins"),
    ("requeue: preempted event, put back, ack", "requeue_begins", "requeued"),
    ("requeued -> freed slot at router", "requeued", "freed"),
    ("freed at router -> bind decided", "freed", "bind"),
    ("bind -> dispatch fetched by worker", "bind", "fetched"),
    ("fetched -> backend call starts", "fetched", "call"),
    ("total: submit -> backend call", "submit", "call"),
    ("bench's wait: submit -> started", "submit", "started"),
)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def split() -> dict[str, Any]:
    critical = CAPTURED["critical"]
    events = CAPTURED["events"]
    preempted_for = {e.by for e in events if isinstance(e, Preempted)}
    started: dict[str, float] = {}
    for e in events:
        if isinstance(e, Started):
            started.setdefault(e.request_id, e.at)
    rows: dict[str, list[float]] = defaultdict(list)
    others: list[float] = []
    #: Broker reads after a freed slot's announcement that did not see it free.
    stale_reads = 0
    for rid, submitted in critical.items():
        if rid not in preempted_for:
            if rid in started:
                others.append(started[rid] - submitted)
            continue
        t = {name: MARKS[name].get(rid) for name in MARKS}
        t["submit"] = submitted
        t["started"] = started.get(rid)
        requeued = t.get("requeued")
        t["freed"] = next((f for f in FREED if requeued is not None and f >= requeued), None)
        if t.get("freed") is not None and t.get("bind") is not None:
            reads = [n for at, n in READS if t["freed"] <= at <= t["bind"]]
            stale_reads += max(0, len(reads) - 1)
        for label, a, b in STEPS:
            if t.get(a) is not None and t.get(b) is not None:
                rows[label].append(t[b] - t[a])  # type: ignore[operator]
    out = {
        label: {
            "n": len(values),
            "p50_ms": 1000 * pct(values, 0.5),
            "p95_ms": 1000 * pct(values, 0.95),
            "max_ms": 1000 * max(values),
        }
        for label, values in rows.items()
        if values
    }
    return {
        "preempting": len(preempted_for & set(critical)),
        "not_preempting_waits_ms": sorted(round(1000 * v, 1) for v in others),
        "reads_that_missed_the_freed_slot": stale_reads,
        "steps": out,
    }


async def main(runs: int) -> dict[str, Any]:
    install()
    capture()
    pp = scheduling.FULL.preempt
    captured: list[tuple[dict[str, float], list[Any]]] = []
    waits: list[float] = []
    async with scheduling.mock_process(
        ttft=0.0, output_tokens=pp.batch_tokens, tokens_per_second=pp.tokens_per_second
    ) as (mock_url, _pid):
        for _ in range(runs):
            result = await scheduling.run_preemption(pp, mock_url, preemption=True)
            captured.append((CAPTURED["critical"], CAPTURED["events"]))
            waits.extend(
                row["wait"] for row in result["critical_series"] if row["wait"] is not None
            )
    CAPTURED["critical"] = {k: v for critical, _ in captured for k, v in critical.items()}
    CAPTURED["events"] = [e for _, events in captured for e in events]
    report = split()
    report["bench_critical_wait"] = scheduling.summary(waits)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    scheduling.configure_logging(level="WARNING")
    report = asyncio.run(main(args.runs))
    print(f"critical requests that preempted: {report['preempting']}")
    print(f"the others' waits (ms): {report['not_preempting_waits_ms']}")
    print(f"binder reads that missed the freed slot: {report['reads_that_missed_the_freed_slot']}")
    for label, row in report["steps"].items():
        print(
            f"  {label:44s} n={row['n']:2d} p50 {row['p50_ms']:7.1f}  "
            f"p95 {row['p95_ms']:7.1f}  max {row['max_ms']:7.1f} ms"
        )
    wait = report["bench_critical_wait"]
    print(
        f"bench's critical wait (every critical request): n={wait['n']} "
        f"p50 {wait['p50_s'] * 1000:.1f} p95 {wait['p95_s'] * 1000:.1f} "
        f"max {wait['max_s'] * 1000:.1f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
