"""The what-if simulator on hand-made traces (tables), and the pieces around it:
reading a trace from events (hostile ones too), fitting backend models, the
summary and the report, the what-if file.

Backends here have one recorded call each (no spread), so every time is
exact: a call takes its overhead + time to first token + 0.01 s per token
after the first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from renqueue import ChatMessage, ConfigError, GenerationParams, InferenceRequest, parse_config
from renqueue.config import Config, SplitConfig
from renqueue.errors import FailureClass, RenQueueError
from renqueue.policy import estimate_prompt_tokens
from renqueue.schema import (
    Cancelled,
    Coalesced,
    Completed,
    Event,
    Expired,
    Failed,
    FellBack,
    Retrying,
    Routed,
    Started,
    Submitted,
    Usage,
)
from renqueue.schema._messages import Fallback
from renqueue.sim import (
    Arrival,
    BackendModel,
    Busy,
    CallRecord,
    Column,
    FailureRecord,
    ModelSpec,
    Outcome,
    Recorded,
    Release,
    Trace,
    compare,
    fit_models,
    load_what_if,
    recorded_outcomes,
    render,
    simulate,
    summarize,
    trace_of,
)
from renqueue.state import fold_many

T = 1_780_000_000.0
PROMPT = [ChatMessage(role="user", content="x" * 400)]  # 100 tokens estimated (+ overhead)


def config(
    backends: dict[str, dict[str, Any]],
    routes: dict[str, list[str]] | None = None,
    **extra: Any,
) -> Config:
    raw: dict[str, Any] = {
        "backends": {
            name: {"base_url": "http://mock", "model": "m", **settings}
            for name, settings in backends.items()
        },
        "routes": {
            name: {"backends": cascade}
            for name, cascade in (routes or {"chat": list(backends)}).items()
        },
        "worker": {"retry_delay": "100ms"},
        **extra,
    }
    return parse_config(raw)


def request(rid: str, **fields: Any) -> InferenceRequest:
    max_tokens = fields.pop("max_tokens", 11)
    return InferenceRequest(
        id=rid,
        tenant=fields.pop("tenant", "t1"),
        route=fields.pop("route", "chat"),
        messages=PROMPT,
        params=GenerationParams(max_tokens=max_tokens),
        **fields,
    )


def arrive(rid: str, at: float = 0.0, **fields: Any) -> Arrival:
    """Request ``rid`` arriving ``at`` seconds after T (its deadline, too, relative)."""
    extra = {
        key: fields.pop(key)
        for key in ("recorded", "cancelled_at", "refused", "read_at")
        if key in fields
    }
    for key in ("cancelled_at", "read_at"):
        if key in extra:
            extra[key] += T
    if fields.get("deadline") is not None:
        fields["deadline"] += T
    return Arrival(at=T + at, request=request(rid, **fields), **extra)


def model(name: str, ttft: float, *, overhead: float = 0.0, **fields: Any) -> BackendModel:
    """A backend whose every call takes ``ttft`` + 0.01 s per output token after the first."""
    call = CallRecord(backend=name, ttft=ttft, generating=0.99, tokens=100, overhead=overhead)
    return BackendModel(name, calls=(call,), overheads=((T, overhead),), **fields)


def completed_events(name: str, ttft: float, n: int = 6, at: float = T - 60) -> list[Event]:
    """``n`` calls of ``name`` in the warm-up: what its speed model starts from."""
    events: list[Event] = []
    for index in range(n):
        events.append(
            Completed(
                request_id=f"warm-{name}-{index}",
                tenant="t1",
                at=at + index,
                backend=name,
                attempt=1,
                delivery=1,
                text="",
                usage=Usage(prompt_tokens=100, completion_tokens=100),
                cost=0.0,
                ttft=ttft,
                duration=ttft + 0.99,
            )
        )
    return events


def run(
    cfg: Config,
    arrivals: list[Arrival],
    models: dict[str, BackendModel],
    *,
    warm: list[Event] | None = None,
    busy: tuple[Busy, ...] = (),
    seed: int = 0,
) -> dict[str, Outcome]:
    trace = Trace(
        since=T,
        until=T + 3600,
        arrivals=tuple(arrivals),
        prior=fold_many(trace_of([], since=T, until=T).prior, warm or []),
        busy=busy,
    )
    simulation = simulate(trace, cfg, models, seed=seed)
    return {outcome.request_id: outcome for outcome in simulation.outcomes}


def ended(outcomes: dict[str, Outcome]) -> dict[str, tuple[str, float | None, str | None]]:
    """Each request's (kind, seconds after T rounded to ms, backend)."""
    return {
        rid: (
            outcome.kind,
            None if outcome.at is None else round(outcome.at - T, 3),
            outcome.backend,
        )
        for rid, outcome in outcomes.items()
    }


ONE_SLOT = config({"a": {"limits": {"concurrency": 1}}})
A = {"a": model("a", 0.1)}

CASES = [
    pytest.param(
        ONE_SLOT,
        [arrive("r1")],
        A,
        {"r1": ("completed", 0.2, "a")},
        id="a call takes its time to first token and 0.01 s per token after it",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1", read_at=0.3)],
        A,
        {"r1": ("completed", 0.5, "a")},
        id="a request is routable when a router read it in the log",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1"), arrive("r2", 0.05)],
        A,
        {"r1": ("completed", 0.2, "a"), "r2": ("completed", 0.4, "a")},
        id="one slot: the second waits for the first",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1", max_tokens=101)],
        {"a": model("a", 0.1, overhead=0.05)},
        {"r1": ("completed", 1.14, "a")},
        id="the overhead from decision to start counts",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1", deadline=0.15)],
        A,
        {"r1": ("expired", 0.15, None)},
        id="a call past the deadline is cut there",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1"), arrive("r2", 0.01, deadline=0.1)],
        A,
        {"r1": ("completed", 0.2, "a"), "r2": ("expired", 0.1, None)},
        id="a request that cannot start before its deadline expires waiting",
    ),
    pytest.param(
        config({"a": {"limits": {"concurrency": 4, "requests": ["1/10s"]}}}),
        [arrive("r1"), arrive("r2")],
        A,
        # Spent in the second [T, T + 1): counted until a whole window after its end.
        {"r1": ("completed", 0.2, "a"), "r2": ("completed", 11.2, "a")},
        id="a declared limit holds the second until its window has room",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1"), arrive("r2", route="nope"), arrive("r3", priority="urgent")],
        A,
        {
            "r1": ("completed", 0.2, "a"),
            "r2": ("rejected", 0.0, None),
            "r3": ("rejected", 0.0, None),
        },
        id="a route or level the config lacks is rejected",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1"), arrive("r2", deadline=31 * 86400.0)],
        A,
        {"r1": ("completed", 0.2, "a"), "r2": ("rejected", 0.0, None)},
        # Review finding: the router bounds it by the request's stored time;
        # the simulation checked it against no time at all, and admitted it.
        id="a deadline further ahead of its arrival than admission allows is rejected",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1", cancelled_at=0.05), arrive("r2")],
        A,
        {"r1": ("cancelled", 0.05, None), "r2": ("completed", 0.25, "a")},
        id="a cancellation in the log cancels it then, and frees its slot",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1"), arrive("r2", 0.01, recorded=Recorded(kind="completed", leader="r1"))],
        A,
        {"r1": ("completed", 0.2, "a"), "r2": ("completed", 0.2, "a")},
        id="a request that shared a call in the log shares it again",
    ),
    pytest.param(
        ONE_SLOT,
        [
            arrive("r1"),
            arrive("r2", 0.01, recorded=Recorded(kind="cancelled", leader="r1"), cancelled_at=0.1),
        ],
        A,
        {"r1": ("completed", 0.2, "a"), "r2": ("cancelled", 0.1, None)},
        id="a request sharing a call may still be cancelled before it ends",
    ),
    pytest.param(
        ONE_SLOT,
        [arrive("r1"), arrive("r2")],
        {"a": model("a", 0.1, releases=((T, 0.05),))},
        {"r1": ("completed", 0.2, "a"), "r2": ("completed", 0.45, "a")},
        id="a freed slot is taken after the release the log shows",
    ),
    pytest.param(
        config({"a": {"limits": {"concurrency": 1}}}, router={"hold_limit": 1}),
        [arrive("r1"), arrive("r2"), arrive("r3")],
        A,
        {
            "r1": ("completed", 0.2, "a"),
            "r2": ("completed", 0.4, "a"),
            "r3": ("completed", 0.6, "a"),
        },
        id="past the router's hold limit, requests wait in the stream, in order",
    ),
    pytest.param(
        config({"a": {"limits": {"concurrency": 1, "tokens": ["10/min"]}}}),
        [arrive("r1")],
        A,
        {"r1": ("unfinished", None, None)},
        id="a request larger than a whole window never runs",
    ),
]


@pytest.mark.parametrize(("cfg", "arrivals", "models", "expected"), CASES)
def test_simulated_outcomes(
    cfg: Config,
    arrivals: list[Arrival],
    models: dict[str, BackendModel],
    expected: dict[str, tuple[str, float | None, str | None]],
) -> None:
    assert ended(run(cfg, arrivals, models)) == expected


def test_a_call_is_billed_by_the_config_it_is_simulated_under() -> None:
    paid = config({"a": {"cost_input_per_mtok": 1.0, "cost_output_per_mtok": 3.0}})
    done = run(paid, [arrive("r1", max_tokens=51)], A)["r1"]
    # The prompt as the policy estimates it (the log has no usage of it), 51 out.
    prompt = estimate_prompt_tokens(PROMPT)
    assert done.cost == pytest.approx((prompt * 1.0 + 51 * 3.0) / 1e6)


def test_the_real_output_and_prompt_length_are_used_when_the_log_has_them() -> None:
    paid = config({"a": {"cost_input_per_mtok": 1.0, "cost_output_per_mtok": 1.0}})
    recorded = Recorded(kind="completed", prompt_tokens=7, output_tokens=21)
    done = run(paid, [arrive("r1", max_tokens=None, recorded=recorded)], A)["r1"]
    assert (round(done.at - T, 3), done.cost) == (0.3, pytest.approx(28 / 1e6))


def test_cheapest_in_time_uses_the_speed_model_of_the_warm_up() -> None:
    """A free slow backend and a paid fast one: a loose deadline goes free, a
    tight one paid, as predicted by what the warm-up's calls taught."""
    cfg = config(
        {
            "free": {"limits": {"concurrency": 4}},
            "paid": {"limits": {"concurrency": 4}, "cost_output_per_mtok": 1.0},
        }
    )
    models = {"free": model("free", 2.0), "paid": model("paid", 0.1)}
    arrivals = [arrive("loose", deadline=10.0), arrive("tight", deadline=1.0)]
    warm = completed_events("free", 2.0) + completed_events("paid", 0.1)
    outcomes = ended(run(cfg, arrivals, models, warm=warm))
    assert outcomes == {"loose": ("completed", 2.1, "free"), "tight": ("completed", 0.2, "paid")}
    # Cold, the free one has no model yet: taken to be in time, it misses.
    cold = ended(run(cfg, arrivals, models))
    assert cold["tight"] == ("expired", 1.0, None)


def test_a_patient_level_waits_for_the_free_backend_instead_of_paying() -> None:
    """A request with no deadline at a level with patience chooses as if it had
    that deadline: with the free backend's slot taken for 2 s and 10 s of
    patience, it waits for it; with 1 s, it pays."""
    backends = {
        "free": {"limits": {"concurrency": 1}},
        "paid": {"limits": {"concurrency": 4}, "cost_output_per_mtok": 1.0},
    }
    models = {"free": model("free", 2.0), "paid": model("paid", 0.1)}
    warm = completed_events("free", 2.0) + completed_events("paid", 0.1)
    arrivals = [arrive("first", deadline=30.0), arrive("batch", 0.01, priority="batch")]
    for patience, expected in (
        ("10s", ("completed", 4.2, "free")),
        ("1s", ("completed", 0.21, "paid")),
    ):
        cfg = config(backends, levels={"batch": {"patience": patience}})
        assert ended(run(cfg, arrivals, models, warm=warm))["batch"] == expected


def test_a_soft_budget_keeps_a_tenant_off_the_paid_backend() -> None:
    cfg = config(
        {
            "free": {"limits": {"concurrency": 4}},
            "paid": {"limits": {"concurrency": 4}, "cost_output_per_mtok": 1.0},
        },
        tenants={"t1": {"daily_budget": 0.0}},
    )
    models = {"free": model("free", 2.0), "paid": model("paid", 0.1)}
    warm = completed_events("free", 2.0) + completed_events("paid", 0.1)
    outcomes = ended(run(cfg, [arrive("tight", deadline=1.0)], models, warm=warm))
    # The free one alone cannot make it: expired at once (hopeless), never paid.
    assert outcomes == {"tight": ("expired", 0.0, None)}


def test_a_hard_budget_spent_refuses_new_requests() -> None:
    cfg = config(
        {"paid": {"limits": {"concurrency": 4}, "cost_output_per_mtok": 1.0}},
        tenants={"t1": {"daily_budget": 0.00002, "budget": "hard"}},
    )
    models = {"paid": model("paid", 0.1)}
    # Each costs $0.000011 (11 output tokens at $1/M): while the first runs
    # its estimate counts, once it ended its cost: no room for a second.
    arrivals = [arrive("r1"), arrive("r2", 0.05), arrive("r3", 1.0)]
    outcomes = ended(run(cfg, arrivals, models))
    assert outcomes == {
        "r1": ("completed", 0.2, "paid"),
        "r2": ("rejected", 0.05, None),
        "r3": ("rejected", 1.0, None),
    }


def test_an_a_b_split_sends_each_tenant_to_its_arm() -> None:
    cfg = config(
        {"a": {"limits": {"concurrency": 8}}, "b": {"limits": {"concurrency": 8}}},
        routes={"chat": ["a"], "other": ["b"]},
    )
    raw = {"arms": {"chat": 1.0, "other": 1.0}, "control": "chat"}
    cfg = msgspec.structs.replace(
        cfg,
        routes={
            **cfg.routes,
            "chat": msgspec.structs.replace(
                cfg.routes["chat"], ab=msgspec.convert(raw, SplitConfig)
            ),
        },
    )
    models = {"a": model("a", 0.1), "b": model("b", 0.1)}
    arrivals = [arrive(f"r{index}", tenant=f"t{index}") for index in range(40)]
    backends = {outcome.backend for outcome in run(cfg, arrivals, models).values()}
    assert backends == {"a", "b"}


def test_a_call_running_when_the_trace_begins_holds_its_slot_until_it_really_ended() -> None:
    outcomes = run(ONE_SLOT, [arrive("r1")], A, busy=(Busy(backend="a", until=T + 1.0),))
    assert ended(outcomes) == {"r1": ("completed", 1.2, "a")}


FAILING = BackendModel(
    "a",
    calls=(CallRecord(backend="a", ttft=0.1, generating=0.99, tokens=100),),
    failures=(
        FailureRecord(
            backend="a", error_type="backend_unavailable", error_class="server_error", after=0.05
        ),
    ),
    failure_p=1.0,
)


def test_a_failing_backend_is_retried_then_fallen_back_from_as_the_worker_would() -> None:
    cfg = config({"a": {}, "b": {}}, routes={"chat": ["a", "b"]})
    outcome = run(cfg, [arrive("r1")], {"a": FAILING, "b": model("b", 0.1)})["r1"]
    # A server error is retried here once (after 50-100 ms), then falls back to b.
    assert (outcome.kind, outcome.backend) == ("completed", "b")
    assert 0.05 + 0.05 + 0.05 + 0.2 <= outcome.at - T <= 0.05 + 0.1 + 0.05 + 0.2 + 1e-9


def test_a_failure_of_the_requests_own_doing_is_replayed_where_it_happened() -> None:
    cfg = config({"a": {}, "b": {}}, routes={"chat": ["a", "b"]})
    too_long = FailureRecord(
        backend="a", error_type="backend_bad_request", error_class="context_length"
    )
    outcomes = run(
        cfg,
        [arrive("r1", refused={"a": too_long}), arrive("r2")],
        {"a": model("a", 0.1), "b": model("b", 0.1)},
    )
    assert ended(outcomes) == {"r1": ("completed", 0.2, "b"), "r2": ("completed", 0.2, "a")}


def test_the_same_seed_gives_the_same_simulation_and_draws_vary_with_it() -> None:
    cfg = config({"a": {"limits": {"concurrency": 2}}})
    calls = tuple(
        CallRecord(backend="a", ttft=0.05 * index, generating=0.5, tokens=51)
        for index in range(1, 20)
    )
    models = {"a": BackendModel("a", calls=calls, failures=FAILING.failures, failure_p=0.2)}
    arrivals = [arrive(f"r{index}", index * 0.1) for index in range(30)]
    first = run(cfg, arrivals, models, seed=1)
    assert run(cfg, arrivals, models, seed=1) == first
    assert run(cfg, arrivals, models, seed=2) != first


def test_a_backend_is_slow_or_failing_when_the_log_shows_it_was() -> None:
    """Runs are drawn from the recorded ones nearest in time: a backend that was
    slow for the first minute and failed in the third is simulated so."""
    slow = [
        CallRecord(backend="a", at=T + index, ttft=1.0, generating=0.99, tokens=100)
        for index in range(60)
    ]
    fast = [
        CallRecord(backend="a", at=T + 60 + index, ttft=0.1, generating=0.99, tokens=100)
        for index in range(60)
    ]
    down = [
        FailureRecord(
            backend="a", at=T + 120 + index, error_type="backend_fatal", error_class="unavailable"
        )
        for index in range(60)
    ]
    models = {"a": BackendModel("a", calls=slow + fast, failures=down)}
    arrivals = [arrive("early", 10), arrive("late", 90), arrive("down", 150)]
    outcomes = ended(run(ONE_SLOT, arrivals, models))
    assert (outcomes["early"], outcomes["late"]) == (
        ("completed", 11.1, "a"),
        ("completed", 90.2, "a"),
    )
    # Fallen back from, back to it once its backoff ends (the only candidate), failed again.
    kind, at, backend = outcomes["down"]
    assert (kind, backend) == ("failed", "a")
    assert at is not None
    assert 150.0 < at < 151.0


def test_a_simulation_past_its_round_limit_stops_and_says_so() -> None:
    cfg = config({"a": {"limits": {"concurrency": 1}}})
    trace = Trace(
        since=T, until=T + 10, arrivals=tuple(arrive(f"r{i}", i * 0.01) for i in range(20))
    )
    simulation = simulate(trace, cfg, A, max_rounds=3)
    assert simulation.stopped_early
    assert {outcome.kind for outcome in simulation.outcomes} >= {"unfinished"}


# ------------------------------------------------------------------ the trace


def submitted(rid: str, at: float, **fields: Any) -> Submitted:
    return Submitted(request_id=rid, tenant="t1", at=T + at, request=request(rid, **fields))


def routed(rid: str, at: float, backend: str, *, wait: float = 0.0, attempt: int = 1) -> Routed:
    return Routed(
        request_id=rid,
        tenant="t1",
        at=T + at,
        backend=backend,
        attempt=attempt,
        priority="normal",
        queue_wait=wait,
    )


def started(rid: str, at: float, backend: str) -> Started:
    return Started(
        request_id=rid, tenant="t1", at=T + at, backend=backend, attempt=1, delivery=1, worker="w"
    )


def completed(rid: str, at: float, backend: str, **fields: Any) -> Completed:
    values: dict[str, Any] = {
        "attempt": 1,
        "delivery": 1,
        "text": "",
        "usage": Usage(prompt_tokens=10, completion_tokens=21),
        "cost": 0.5,
        "ttft": 0.1,
        "duration": 0.3,
    }
    values.update(fields)
    return Completed(request_id=rid, tenant="t1", at=T + at, backend=backend, **values)


def test_a_trace_holds_the_window_s_requests_and_what_became_of_each() -> None:
    events: list[Event] = [
        submitted("before", -10),
        routed("before", -9.9, "a"),
        started("before", -9.9, "a"),  # still running at T: busy until 2.0
        submitted("r1", 0.0),
        submitted("r1", 0.5),  # logged again: the first stands
        routed("r1", 0.01, "a"),
        started("r1", 0.01, "a"),
        completed("r1", 0.33, "a"),
        submitted("r2", 1.0, priority="high", deadline=T + 2),
        Expired(request_id="r2", tenant="t1", at=T + 3, stage="queued"),
        completed("before", 2.0, "a", cost=0.25),
        submitted("r3", 4.0),
        Coalesced(request_id="r3", tenant="t1", at=T + 4, leader="r1"),
        Cancelled(request_id="r3", tenant="t1", at=T + 4.5, stage="queued"),
        submitted("r4", 5.0),
        # r4 joins r2's call, is put back when r2 ends on its own, joins r1's:
        # the last join stands.
        Coalesced(request_id="r4", tenant="t1", at=T + 5, leader="r2"),
        Coalesced(request_id="r4", tenant="t1", at=T + 6, leader="r1"),
        submitted("late", 11.0),
    ]
    trace = trace_of(events, since=T, until=T + 10)
    assert [a.request.id for a in trace.arrivals] == ["r1", "r2", "r3", "r4"]
    assert trace.arrivals[0].at == T
    assert trace.arrivals[0].recorded == Recorded(
        kind="completed", at=T + 0.33, backend="a", cost=0.5, prompt_tokens=10, output_tokens=21
    )
    assert trace.arrivals[1].recorded.kind == "expired"
    assert trace.arrivals[2].recorded.leader == "r1"
    assert trace.arrivals[2].cancelled_at == T + 4.5
    assert trace.arrivals[3].recorded.leader == "r1"
    # The call of r1: 0.1 s to the first token, 0.2 s after, 0.02 s from its decision.
    r1 = next(call for call in trace.calls if call.ttft == 0.1 and call.tokens == 21)
    assert r1.generating == pytest.approx(0.2)
    assert r1.overhead == pytest.approx(0.02, abs=1e-6)
    assert trace.busy == (Busy(backend="a", until=T + 2.0),)
    assert trace.prior.backend("a").calls_started == 1
    assert len(trace.calls) == 2


def test_a_trace_keeps_failures_and_which_were_the_request_s_own() -> None:
    too_long = Fallback(excluded=("a",), count=1)
    events: list[Event] = [
        submitted("r1", 0.0),
        routed("r1", 0.0, "a"),
        started("r1", 0.0, "a"),
        Retrying(
            request_id="r1",
            tenant="t1",
            at=T + 0.25,
            backend="a",
            attempt=1,
            delivery=1,
            error_type="rate_limited",
            reason="429",
            retry_after=2.0,
            error_class="rate_limited",
        ),
        FellBack(
            request_id="r1",
            tenant="t1",
            at=T + 3,
            backend="a",
            attempt=1,
            delivery=2,
            error_type="backend_bad_request",
            error_class="context_length",
            reason="too long",
            fallback=too_long,
        ),
        Failed(request_id="r1", tenant="t1", at=T + 4, error_type="x", reason="gone"),
    ]
    trace = trace_of(events, since=T, until=T + 10)
    assert trace.failures == (
        FailureRecord(
            backend="a",
            error_type="rate_limited",
            at=T,
            error_class="rate_limited",
            after=0.25,
            retry_after=2.0,
        ),
    )
    assert trace.arrivals[0].refused["a"].error_class == FailureClass.CONTEXT_LENGTH
    assert trace.arrivals[0].recorded.kind == "failed"


def test_a_trace_measures_how_long_a_freed_slot_took_to_be_taken() -> None:
    events: list[Event] = [
        submitted("r1", 0.0),
        routed("r1", 0.0, "a"),
        submitted("r2", 0.1),
        completed("r1", 0.3, "a"),
        routed("r2", 0.31, "a", wait=0.21),  # waiting when r1's slot freed
        completed("r2", 0.6, "a"),
        submitted("r3", 1.0),
        routed("r3", 1.0, "a", wait=0.0),  # not waiting when r2's slot freed
    ]
    trace = trace_of(events, since=T, until=T + 10)
    assert trace.releases == (Release(backend="a", after=pytest.approx(0.01), busy=1, at=T + 0.3),)


@pytest.mark.parametrize(
    "bad",
    [
        {"duration": math.nan},
        {"duration": -1.0},
        {"ttft": 5.0},  # after the call ended
        {"duration": 1e12},
        {"usage": Usage(prompt_tokens=1, completion_tokens=10**12)},
    ],
    ids=["nan", "negative", "ttft past the end", "longer than a day", "absurd output"],
)
def test_a_call_no_backend_could_have_made_is_not_fitted(bad: dict[str, Any]) -> None:
    events: list[Event] = [submitted("r1", 0.0), completed("r1", 1.0, "a", **bad)]
    trace = trace_of(events, since=T, until=T + 10)
    assert trace.calls == ()
    assert len(trace.arrivals) == 1


def test_a_trace_knows_when_a_router_read_each_request_if_that_could_be() -> None:
    events: list[Event] = [submitted("r1", 0.0), submitted("r2", 1.0), submitted("r3", 2.0)]
    read_at = {"t1:r1": T + 0.01, "t1:r2": T + 0.5, "t1:r3": T + 2 + 86_401}  # before it; a day on
    trace = trace_of(events, since=T, until=T + 10, read_at=read_at)
    assert [arrival.read_at for arrival in trace.arrivals] == [T + 0.01, None, None]


def test_an_event_whose_time_is_no_time_is_dropped() -> None:
    events: list[Event] = [
        submitted("r1", 0.0),
        Submitted(request_id="r2", tenant="t1", at=math.inf, request=request("r2")),
    ]
    trace = trace_of(events, since=T, until=T + 10)
    assert [a.request.id for a in trace.arrivals] == ["r1"]
    assert (trace.events, trace.dropped) == (1, 1)


# ------------------------------------------------------------------ the models


def test_models_are_fitted_per_backend_and_pooled_for_one_the_log_has_not_seen() -> None:
    trace = Trace(
        since=T,
        until=T + 10,
        calls=(
            CallRecord(backend="a", ttft=0.1, generating=0.2, tokens=10, overhead=0.01),
            CallRecord(backend="b", ttft=0.3, generating=0.2, tokens=10),
        ),
        failures=(FailureRecord(backend="a", error_type="backend_unavailable"),),
        releases=(
            Release(backend="a", after=0.02, busy=2),
            Release(backend="a", after=0.5, busy=1),
        ),
    )
    models = fit_models(
        trace,
        ["a", "b", "c", "d"],
        {"d": ModelSpec(ttft=1.0, tokens_per_second=10)},
        slots={"a": 2},
    )
    assert len(models["a"].runs) == 2  # a call and a failure: half its runs fail
    assert not models["a"].assumed
    # Fewer than 5 releases of its own where it was full: the pooled ones (the same here).
    assert models["a"].releases.values == [0.02]
    assert models["c"].assumed
    assert len(models["c"].calls) == 2
    assert models["d"].calls == [CallRecord(backend="d", ttft=1.0, generating=25.5, tokens=256)]
    with pytest.raises(RenQueueError, match="nothing to model backend 'x' on"):
        fit_models(Trace(since=T, until=T + 1), ["x"])


def test_a_backend_the_log_never_called_is_simulated_on_pooled_calls_and_said_so() -> None:
    cfg = config({"new": {}, "a": {}})  # "new" first in the cascade: it is used
    trace = Trace(
        since=T,
        until=T + 10,
        arrivals=(arrive("r1"),),
        calls=(CallRecord(backend="a", at=T, ttft=0.1, generating=0.99, tokens=100),),
    )
    comparison = compare(trace, [("live", cfg)])
    assert comparison.summary(1).share == {"new": 1}
    assert comparison.simulations[0].assumed == ("new",)
    (note,) = comparison.columns[1].notes
    assert note.startswith("live: no call of new in the log: it was simulated on every")
    assert "[whatif.models.new]" in note


# ------------------------------------------------------------ summary, report


def outcome(rid: str, kind: str, at: float | None, **fields: Any) -> Outcome:
    return Outcome(
        request_id=rid, tenant="t1", level=fields.pop("level", "high"), kind=kind, at=at, **fields
    )


def test_attainment_is_completed_in_time_over_submitted_per_level() -> None:
    outcomes = [
        outcome("in-time", "completed", T + 1, deadline=T + 2, backend="a", cost=0.5),
        outcome("late", "completed", T + 3, deadline=T + 2, backend="b", cost=0.25),
        outcome("no-deadline", "completed", T + 9, backend="a"),
        outcome("expired", "expired", T + 2, deadline=T + 2),
        outcome("batch", "failed", T + 1, level="batch"),
    ]
    summary = summarize(outcomes, ["critical", "high", "batch"])
    assert summary.cost == 0.75
    assert summary.levels["high"].attainment == 0.5
    assert (summary.levels["high"].submitted, summary.levels["high"].with_deadline) == (4, 3)
    assert summary.levels["batch"].attainment == 0.0
    assert summary.levels["critical"].submitted == 0
    assert summary.share == {"a": 2, "b": 1}
    assert summary.share_of("a") == pytest.approx(2 / 3)
    assert summary.ended["completed"] == 3


def test_the_report_puts_the_runs_side_by_side() -> None:
    trace = Trace(since=T, until=T + 60, arrivals=(arrive("r1"),), events=4)
    assert recorded_outcomes(trace)[0].kind == "unfinished"
    real = summarize(
        [outcome("r1", "completed", T + 1, backend="a", cost=1.0)], ["critical", "high"]
    )
    sim = summarize(
        [outcome("r1", "completed", T + 1, backend="b", cost=0.5)], ["critical", "high"]
    )
    lines = render(
        trace,
        [
            Column(title="recorded", summary=real),
            Column(title="x.toml (sim)", summary=sim, notes=("a note",)),
        ],
        seed=3,
    )
    assert lines[0] == (
        "What-if replay of 1 request submitted 2026-05-28T20:26:40Z .. 2026-05-28T20:27:40Z"
        " (4 events read, 0 dropped; seed 3)"
    )
    text = "\n".join(lines)
    assert "$0.500000 (-50.0 %)" in text
    assert "critical" not in text  # no request at that level in any run
    assert lines[-1] == "a note"


# ------------------------------------------------------------------ the file


def test_a_what_if_file_is_a_config_with_models_for_backends_the_log_has_not_seen(
    tmp_path: Path,
) -> None:
    path = tmp_path / "other.toml"
    path.write_text(
        '[backends.new]\nbase_url = "http://x"\nmodel = "m"\n'
        '[routes.chat]\nbackends = ["new"]\n'
        "[whatif.models.new]\nttft = 0.2\ntokens_per_second = 40\n"
    )
    loaded = load_what_if(path)
    assert list(loaded.config.backends) == ["new"]
    assert loaded.models == {"new": ModelSpec(ttft=0.2, tokens_per_second=40.0)}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[nats\n", "not valid TOML"),
        (
            '[routes.chat]\nbackends = ["ghost"]\n',
            "unknown backend 'ghost' (at $.routes.chat.backends[0])",
        ),
        ("[whatif]\nmodles = 1\n", "expected a table with only 'models' (at $.whatif)"),
        ("[whatif.models.x]\nfailure_rate = 2\n", "(at $.whatif.models.x.failure_rate)"),
        ("[whatif.models.x]\nspeed = 2\n", "unknown field `speed` (at $.whatif.models.x)"),
    ],
    ids=["not toml", "bad config", "bad whatif", "bad model value", "unknown model field"],
)
def test_a_bad_what_if_file_is_a_config_error_naming_the_field(
    tmp_path: Path, text: str, error: str
) -> None:
    path = tmp_path / "other.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_what_if(path)
    assert error in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"#" * (16 * 1024 * 1024) + b"\n", "over 16 MiB: not a config file"),
        (b"a = " + b"[" * 5000 + b"]" * 5000, "not valid TOML: nested too deeply"),
        (b'[nats]\nurl = "caf\xe9"\n', "not UTF-8 (byte 17)"),
    ],
    ids=["huge", "deep", "latin1"],
)
def test_a_what_if_file_is_read_as_the_config_is(
    tmp_path: Path, content: bytes, error: str
) -> None:
    """`replay --what-if` read its file whole (`--what-if /dev/zero` never
    ended) and a deeply nested one was a RecursionError: the config's reader,
    bounded, reads it now."""
    path = tmp_path / "other.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_what_if(path)
    assert error in str(info.value)
    assert str(path) in str(info.value)


def test_a_trace_survives_a_round_trip_through_json() -> None:
    trace = trace_of([submitted("r1", 0.0), completed("r1", 0.5, "a")], since=T, until=T + 1)
    assert msgspec.json.decode(msgspec.json.encode(trace), type=Trace) == trace
