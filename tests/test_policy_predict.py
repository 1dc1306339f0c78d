"""Cheapest in time (renqueue.policy: Perf, predict, choose_in_time): what a
backend's calls teach, what a request is predicted to take there, and the
choice, as tables and as properties over any round."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.policy import (
    MIN_SAMPLES,
    BackendView,
    Cost,
    Expire,
    LevelPolicy,
    NoRoom,
    Perf,
    PlanPolicy,
    Quota,
    RouteRules,
    Wait,
    choose_in_time,
    estimated_cost,
    learn_call,
    learn_fault,
    limits_of,
    plan,
    predict,
    reserve,
    service_time,
)
from renqueue.policy import Bind as BindAction
from renqueue.policy import Waiting as WaitingItem
from renqueue.schema import ChatMessage, GenerationParams, InferenceRequest

NOW = 1_000.0
ONE = Cost(requests=1)
CHEAPEST = RouteRules()

#: A fast local-like backend: first token in 0.2 s, 100 tokens/s, steady.
FAST = Perf(samples=10, ttft=0.2, rate=100.0, output=101.0)
#: A slow one: first token in 2 s, 10 tokens/s.
SLOW = Perf(samples=10, ttft=2.0, rate=10.0, output=101.0)


def request(
    deadline: float | None = None, max_tokens: int | None = 101, **fields: Any
) -> InferenceRequest:
    return InferenceRequest(
        id=fields.pop("id", "r"),
        tenant="t",
        route="chat",
        messages=[ChatMessage(role="user", content="hello " * 20)],
        params=GenerationParams(max_tokens=max_tokens),
        deadline=deadline,
        **fields,
    )


def view(name: str, *, price: float = 0.0, capacity: int = 1, **fields: Any) -> BackendView:
    return BackendView(
        name=name,
        capacity=capacity,
        in_flight=fields.pop("in_flight", 0),
        cost_input_per_mtok=price,
        cost_output_per_mtok=price * 4,
        **fields,
    )


def views(*items: BackendView) -> dict[str, BackendView]:
    return {item.name: item for item in items}


# ------------------------------------------------------------------ learning


def test_the_first_call_sets_the_model_and_later_ones_move_it_a_fifth_of_the_way() -> None:
    perf = learn_call(None, ttft=0.5, duration=1.5, output_tokens=101)
    assert (perf.samples, perf.ttft, perf.rate, perf.output) == (1, 0.5, 100.0, 101.0)
    assert perf.ttft_var == perf.rate_var == 0.0
    perf = learn_call(perf, ttft=1.5, duration=2.5, output_tokens=101)
    assert perf.ttft == pytest.approx(0.7)
    assert perf.rate == pytest.approx(100.0)
    assert perf.ttft_var > 0
    assert perf.ttft_sd == pytest.approx(math.sqrt(perf.ttft_var))


@pytest.mark.parametrize(
    ("ttft", "duration", "tokens"),
    [
        (None, 2.0, 50),  # not streamed: no first-token time
        (math.nan, 2.0, 50),
        (1.0, math.inf, 50),
        (3.0, 2.0, 50),  # a first token after the end: a broken clock
        (-1.0, 2.0, 50),
    ],
)
def test_a_call_whose_times_cannot_be_trusted_teaches_its_length_only(
    ttft: float | None, duration: float, tokens: int
) -> None:
    before = learn_call(None, ttft=0.5, duration=1.5, output_tokens=101)
    after = learn_call(before, ttft=ttft, duration=duration, output_tokens=tokens)
    assert (after.ttft, after.rate) == (before.ttft, before.rate)
    assert after.samples == 2
    assert after.output < before.output


def test_faults_and_429s_raise_their_probability_and_completions_lower_it() -> None:
    perf = learn_fault(FAST, fault=True, rate_limited=False)
    perf = learn_fault(perf, fault=False, rate_limited=True)
    assert perf.fault_p == pytest.approx(0.16)
    assert perf.limited_p == pytest.approx(0.2)
    assert perf.samples == FAST.samples  # a failure is no completion
    perf = learn_call(perf, ttft=0.2, duration=1.2, output_tokens=101)
    assert perf.fault_p < 0.16
    assert perf.limited_p < 0.2
    blameless = learn_fault(FAST, fault=False, rate_limited=False)
    assert (blameless.fault_p, blameless.limited_p) == (0.0, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 30, allow_nan=False),
            st.floats(0, 300, allow_nan=False),
            st.integers(0, 10_000),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_a_model_stays_finite_and_its_spread_never_negative(
    calls: list[tuple[float, float, int]],
) -> None:
    perf = None
    for ttft, duration, tokens in calls:
        perf = learn_call(perf, ttft=ttft, duration=ttft + duration, output_tokens=tokens)
    assert perf is not None
    for value in (perf.ttft, perf.ttft_var, perf.rate, perf.rate_var, perf.output, perf.output_var):
        assert math.isfinite(value)
        assert value >= 0


# ----------------------------------------------------------------- predicting


def test_the_service_time_is_first_token_plus_the_output_over_the_rate() -> None:
    fast = view("a", perf=FAST)
    # 0.2 s + 100 tokens after the first / 100 per second
    assert service_time(request(), fast, spread=0.0) == pytest.approx(1.2)
    # No max_tokens: the learned mean length (and its spread, when cautious).
    assert service_time(request(max_tokens=None), fast, spread=0.0) == pytest.approx(1.2)
    # The means cap the output at max_tokens; caution plans for all of it.
    assert service_time(request(max_tokens=51), fast, spread=0.0) == pytest.approx(0.7)
    assert service_time(request(max_tokens=501), fast, spread=1.0) == pytest.approx(5.2)
    # A short answer asked for is short on the slowest backend too.
    assert service_time(request(max_tokens=11), view("b", perf=SLOW), spread=0.0) == pytest.approx(
        3.0
    )


def test_caution_adds_the_spread_and_the_expected_time_lost_to_a_failed_try() -> None:
    shaky = Perf(
        samples=10, ttft=1.0, ttft_var=0.25, rate=50.0, rate_var=100.0, output=100.0, fault_p=0.1
    )
    # (1.0 + 0.5) + 100 / (50 - 10), then 10 % more for the try that may fail
    assert service_time(request(), view("a", perf=shaky), spread=1.0) == pytest.approx(4.4)
    # The rate is never taken below a quarter of its mean, however wide its spread.
    wild = Perf(samples=10, ttft=0.0, rate=40.0, rate_var=10_000.0, output=100.0)
    assert service_time(request(), view("a", perf=wild), spread=1.0) == pytest.approx(10.0)


def test_a_backend_without_a_model_falls_back_to_its_mean_duration_or_is_unknown() -> None:
    young = Perf(samples=MIN_SAMPLES - 1, ttft=0.1, rate=1000.0)
    assert service_time(request(), view("a", perf=young, expected_duration=3.0), spread=1.0) == 3.0
    assert service_time(request(), view("a", perf=young), spread=1.0) is None
    assert predict(request(), view("a"), NOW, cost=ONE).finish is None


def test_a_full_backend_starts_when_the_calls_ahead_end_over_its_slots() -> None:
    full = view("a", capacity=2, in_flight=3, perf=FAST)
    prediction = predict(request(), full, NOW, cost=ONE, spread=0.0)
    # 2 calls ahead (one over capacity, then this one's turn), 1.2 s each, 2 slots
    assert prediction.start == pytest.approx(NOW + 1.2)
    assert prediction.finish == pytest.approx(NOW + 2.4)
    assert prediction.held == "every slot taken"
    assert not prediction.now
    # Unknown speed: when it could start is unknown, and so is the finish.
    assert predict(request(), view("b", in_flight=1), NOW, cost=ONE).finish is None


def test_a_backend_out_of_quota_starts_when_its_window_lets_one_more_in() -> None:
    limits = limits_of([(1, 60.0)], [])
    spent = reserve(Quota(), ONE, NOW - 15)
    prediction = predict(request(), view("a", perf=FAST, limits=limits, quota=spent), NOW, cost=ONE)
    # (the spend log counts in whole seconds: one more)
    assert prediction.start == pytest.approx(NOW + 46)
    assert "requests/min" in prediction.held
    assert prediction.cost == 0.0


# ------------------------------------------------------------------- choosing


def pick(
    req: InferenceRequest, *items: BackendView, rules: RouteRules = CHEAPEST
) -> tuple[Any, str | None, str]:
    names = [item.name for item in items]
    result = choose_in_time(req, names, views(*items), ONE, NOW, rules=rules)
    return result.backend, result.wait_for, result.reason


def test_the_cheapest_in_time_wins_over_the_first_and_the_fastest() -> None:
    backend, wait_for, reason = pick(
        request(deadline=NOW + 20),
        view("paid", price=2.5, perf=FAST),
        view("local", perf=SLOW),
    )
    assert (backend, wait_for) == ("local", None)
    assert reason == "cheapest in time: local predicted 12.0 s of 20.0 s"


def test_paid_only_when_the_free_ones_would_miss_the_deadline() -> None:
    backend, _, reason = pick(
        request(deadline=NOW + 5),
        view("local", perf=SLOW),
        view("small", price=0.15, perf=SLOW),
        view("large", price=2.5, perf=FAST),
    )
    assert backend == "large"
    assert reason.startswith("cheapest in time: large $0.0011")
    assert "local predicted 12.0 s" in reason
    assert "small predicted 12.0 s" in reason


def test_work_with_time_waits_for_a_free_window_rather_than_paying() -> None:
    limits = limits_of([(1, 60.0)], [])
    free = view("free", perf=FAST, limits=limits, quota=reserve(Quota(), ONE, NOW - 40))
    paid = view("paid", price=2.5, perf=FAST)
    backend, wait_for, reason = pick(request(deadline=NOW + 120), free, paid)
    assert (backend, wait_for) == (NoRoom.FULL, "free")
    assert "once it has room" in reason
    assert "resets in 21 s" in reason
    # Not the time to wait: it pays.
    backend, wait_for, _ = pick(request(deadline=NOW + 10), free, paid)
    assert (backend, wait_for) == ("paid", None)


def test_no_deadline_means_the_cheapest_that_can_start_now() -> None:
    backend, wait_for, reason = pick(
        request(), view("paid", price=1.0, perf=FAST), view("free", perf=SLOW)
    )
    assert (backend, wait_for, reason) == ("free", None, "cheapest with room: free")
    backend, wait_for, reason = pick(
        request(), view("free", in_flight=1, perf=SLOW), view("paid", price=1.0, perf=FAST)
    )
    assert (backend, wait_for, reason) == ("paid", None, "")


def test_nothing_in_time_binds_the_soonest_that_can_start() -> None:
    backend, _, reason = pick(
        request(deadline=NOW + 1.1),
        view("a", perf=SLOW),
        view("b", price=1.0, perf=FAST),
    )
    # FAST's mean is 1.2 s (hopeless is the planner's to say); here it is the soonest.
    assert backend == "b"
    assert reason == "no candidate predicted in time; b is the soonest, predicted 0.1 s late"


def test_a_cascade_route_keeps_the_first_with_room() -> None:
    both = views(view("paid", price=2.5, perf=FAST), view("local", perf=SLOW))
    items = [WaitingItem(ref=1, request=request(deadline=NOW + 20), rank=0, submitted=NOW)]
    for rules, expected in ((RouteRules(strategy="cascade"), "paid"), (CHEAPEST, "local")):
        policy = PlanPolicy(
            levels=(LevelPolicy(name="normal", rank=0),),
            routes={"chat": ("paid", "local")},
            rules={"chat": rules},
        )
        (bind,) = [a for a in plan(items, both, NOW, policy) if isinstance(a, BindAction)]
        assert bind.backend == expected


def test_adapt_prefers_the_faster_of_equally_cheap_ones_and_exploring_is_deterministic() -> None:
    slow_first = (view("a", perf=SLOW), view("b", perf=FAST))
    assert pick(request(deadline=NOW + 60), *slow_first)[0] == "a"
    assert pick(request(deadline=NOW + 60), *slow_first, rules=RouteRules(adapt=True))[0] == "b"
    explore = RouteRules(adapt=True, explore=1.0)
    chosen = [
        pick(request(deadline=NOW + 60, id=f"r{n}"), *slow_first, rules=explore)[0]
        for n in range(40)
    ]
    again = [
        pick(request(deadline=NOW + 60, id=f"r{n}"), *slow_first, rules=explore)[0]
        for n in range(40)
    ]
    assert chosen == again  # a replay decides as the router did
    assert set(chosen) == {"b"}  # SLOW never draws below FAST here: no spread in either
    wide = Perf(samples=10, ttft=2.0, ttft_var=4.0, rate=10.0, rate_var=25.0, output=100.0)
    close = (
        view("a", perf=wide),
        view("b", perf=Perf(samples=10, ttft=2.0, rate=10.0, output=100.0)),
    )
    drawn = {
        pick(request(deadline=NOW + 600, id=f"r{n}"), *close, rules=explore)[0] for n in range(40)
    }
    assert drawn == {"a", "b"}


def test_a_backend_that_degrades_gets_less_traffic_before_any_circuit_opens() -> None:
    """With ``adapt``, faults and 429s make a backend's predicted finish later
    (the expected time lost to a failed try): traffic moves to an equally
    cheap one while both are still healthy."""
    adapt = RouteRules(adapt=True)
    first, second = view("first", perf=FAST), view("second", perf=FAST)
    assert pick(request(deadline=NOW + 60), first, second, rules=adapt)[0] == "first"
    perf = FAST
    for _ in range(3):
        perf = learn_fault(perf, fault=True, rate_limited=False)
    degraded = view("first", perf=perf)
    assert degraded.healthy
    assert pick(request(deadline=NOW + 60), degraded, second, rules=adapt)[0] == "second"
    # A strict cascade keeps its order while both are in time.
    assert pick(request(deadline=NOW + 60), degraded, second)[0] == "first"


def test_a_waiting_request_queues_later_ones_behind_it_in_the_same_round() -> None:
    limits = limits_of([(1, 60.0)], [])
    free = view("free", perf=FAST, limits=limits, quota=reserve(Quota(), ONE, NOW - 50))
    policy = PlanPolicy(
        levels=(LevelPolicy(name="normal", rank=0),), routes={"chat": ("free", "paid")}
    )
    items = [
        WaitingItem(
            ref=n, request=request(deadline=NOW + 13, id=f"r{n}"), rank=0, submitted=NOW - 5 + n
        )
        for n in range(2)
    ]
    actions = plan(items, views(free, view("paid", price=2.5, perf=FAST)), NOW, policy)
    outcome = {a.ref: a for a in actions if isinstance(a, BindAction | Wait)}
    # The first waits 10 s for the free window; the second would wait behind it past its deadline.
    assert isinstance(outcome[0], Wait)
    assert isinstance(outcome[1], BindAction)
    assert outcome[1].backend == "paid"


# ---------------------------------------------------------------- properties

PERFS = st.builds(
    Perf,
    samples=st.integers(0, 20),
    ttft=st.floats(0, 5),
    ttft_var=st.floats(0, 4),
    rate=st.floats(0, 200),
    rate_var=st.floats(0, 400),
    output=st.floats(0, 500),
    output_var=st.floats(0, 1000),
    fault_p=st.floats(0, 1),
    limited_p=st.floats(0, 1),
)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[InferenceRequest, list[BackendView]]:
    count = draw(st.integers(1, 5))
    items = [
        BackendView(
            name=f"b{index}",
            capacity=draw(st.integers(0, 3)),
            in_flight=draw(st.integers(0, 4)),
            healthy=draw(st.booleans()),
            tier=draw(st.integers(0, 3)),
            expected_duration=draw(st.none() | st.floats(0.01, 60)),
            perf=draw(st.none() | PERFS),
            cost_input_per_mtok=draw(st.sampled_from([0.0, 0.0, 0.15, 2.5])),
            cost_output_per_mtok=draw(st.sampled_from([0.0, 0.6, 10.0])),
        )
        for index in range(count)
    ]
    req = request(
        deadline=draw(st.none() | st.floats(NOW + 0.1, NOW + 300)),
        max_tokens=draw(st.none() | st.integers(1, 4000)),
        max_cost=draw(st.none() | st.floats(0, 0.05)),
        complexity=draw(st.none() | st.integers(0, 3)),
    )
    return req, items


@settings(max_examples=400, deadline=None)
@given(rounds())
def test_never_over_the_cost_cap_and_never_paid_when_a_free_one_is_predicted_in_time(
    round_: tuple[InferenceRequest, list[BackendView]],
) -> None:
    req, items = round_
    result = choose_in_time(req, [v.name for v in items], views(*items), ONE, NOW, rules=CHEAPEST)
    chosen = next((v for v in items if v.name in (result.backend, result.wait_for)), None)
    if chosen is None:
        return
    assert chosen.healthy
    if req.max_cost is not None:
        assert estimated_cost(req, chosen) <= req.max_cost
    if req.complexity is not None:
        assert chosen.tier >= req.complexity
    if not chosen.paid or req.deadline is None:
        return
    for other in items:
        if other.paid or not other.healthy or (req.complexity or 0) > other.tier:
            continue
        predicted = predict(req, other, NOW, cost=ONE)
        in_time = predicted.now if predicted.finish is None else predicted.finish <= req.deadline
        assert not in_time, f"paid {chosen.name} chosen while free {other.name} is in time"


@settings(max_examples=400, deadline=None)
@given(rounds())
def test_escalates_to_the_cheapest_paid_one_in_time_when_no_free_one_is(
    round_: tuple[InferenceRequest, list[BackendView]],
) -> None:
    req, items = round_
    if req.deadline is None:
        return
    deadline = req.deadline
    result = choose_in_time(req, [v.name for v in items], views(*items), ONE, NOW, rules=CHEAPEST)
    able = [
        v
        for v in items
        if v.healthy
        and (req.complexity is None or v.tier >= req.complexity)
        and (req.max_cost is None or estimated_cost(req, v) <= req.max_cost)
    ]
    predictions = {v.name: predict(req, v, NOW, cost=ONE) for v in able}

    def in_time(name: str) -> bool:
        p = predictions[name]
        return p.now if p.finish is None else p.finish <= deadline

    free_in_time = [v for v in able if not v.paid and in_time(v.name)]
    paid_in_time = [v for v in able if v.paid and in_time(v.name)]
    if not free_in_time and paid_in_time:
        # Bound to the cheapest paid one in time, or waiting for it.
        chosen = result.backend if result.wait_for is None else result.wait_for
        assert chosen in {v.name for v in paid_in_time}
        cheapest = min(predictions[v.name].cost for v in paid_in_time)
        assert predictions[str(chosen)].cost == cheapest


def _round(item: WaitingItem, *items: BackendView, now: float = NOW) -> BindAction | Wait:
    policy = PlanPolicy(
        levels=(LevelPolicy(name="normal", rank=0),),
        routes={"chat": tuple(v.name for v in items)},
    )
    [action] = [
        a for a in plan([item], views(*items), now, policy) if isinstance(a, BindAction | Wait)
    ]
    return action


#: A paid backend that answers in 3 s.
PAID_3S = Perf(samples=10, ttft=2.0, rate=100.0, output=101.0)


def test_a_wait_for_a_cheaper_backend_never_costs_the_deadline() -> None:
    """The free one is full (a slot frees in ~1.2 s, then 1.2 s more); the paid
    one takes 3 s. With 5 s to go the request can afford to wait; with 4 s,
    if the wait came to nothing the paid one would finish late: it pays now."""
    local = view("local", in_flight=1, perf=FAST)
    paid = view("paid", price=2.5, perf=PAID_3S)
    roomy = WaitingItem(ref=1, request=request(deadline=NOW + 5), rank=0, submitted=NOW)
    action = _round(roomy, local, paid)
    assert isinstance(action, Wait)
    assert (action.wait_for, action.wait_start) == ("local", pytest.approx(NOW + 1.2))
    tight = WaitingItem(ref=1, request=request(deadline=NOW + 4), rank=0, submitted=NOW)
    action = _round(tight, local, paid)
    assert isinstance(action, BindAction)
    assert action.backend == "paid"


@pytest.mark.parametrize("typical", [FAST, Perf(samples=10, ttft=0.0, rate=1e6, output=1.0)])
def test_a_promised_start_that_long_passed_is_not_waited_for_again(typical: Perf) -> None:
    """Before: a backend whose one slot was taken by a call that never ended
    was predicted to free "in 1.2 s" every round, and the request waited until
    it was too late for the paid one (or, with a mean of ~0, expired waiting)."""
    local = view("local", in_flight=1, perf=typical)
    paid = view("paid", price=2.5, perf=FAST)
    first = WaitingItem(ref=1, request=request(deadline=NOW + 60), rank=0, submitted=NOW)
    action = _round(first, local, paid)
    assert isinstance(action, Wait)
    assert action.wait_for == "local"
    promised = ("local", action.wait_start)
    # Still within a typical call of the promise (at least a second): it waits.
    later = msgspec.structs.replace(first, waiting_for=promised)
    assert isinstance(_round(later, local, paid, now=action.wait_start + 0.5), Wait)
    # Long past it: it pays, and says why.
    late = _round(later, local, paid, now=action.wait_start + 3.0)
    assert isinstance(late, BindAction)
    assert late.backend == "paid"
    assert "local not waited for again: the start it promised passed" in late.reason
    # The overdue backend is still taken if it has room by then.
    freed = view("local", perf=typical)
    assert _round(later, freed, paid, now=action.wait_start + 3.0).backend == "local"  # type: ignore[union-attr]


def test_a_patient_level_waits_for_a_free_window_rather_than_paying() -> None:
    """A batch request with no deadline at a level with ``patience`` waits for
    a free tier's window to reset (20 s away) rather than paying; past its
    patience, or with none, it pays at once. It never expires for it."""
    limits = limits_of([(1, 60.0)], [])
    free = view("free", perf=FAST, limits=limits, quota=reserve(Quota(), ONE, NOW - 40))
    paid = view("paid", price=2.5, perf=FAST)

    def decide(patience: float | None, waited: float = 0.0) -> BindAction | Wait:
        policy = PlanPolicy(
            levels=(LevelPolicy(name="batch", rank=0, patience=patience),),
            routes={"chat": ("free", "paid")},
        )
        item = WaitingItem(ref=1, request=request(), rank=0, submitted=NOW - waited)
        [action] = [
            a
            for a in plan([item], views(free, paid), NOW, policy)
            if isinstance(a, BindAction | Wait | Expire)
        ]
        assert not isinstance(action, Expire)
        return action

    waits = decide(patience=600.0)
    assert isinstance(waits, Wait)
    assert waits.wait_for == "free"
    assert isinstance(decide(patience=None), BindAction)
    assert decide(patience=None).backend == "paid"  # type: ignore[union-attr]
    impatient = decide(patience=600.0, waited=599.0)
    assert isinstance(impatient, BindAction)
    assert impatient.backend == "paid"
