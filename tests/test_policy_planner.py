"""The round planner (renqueue.policy.plan): tables of rounds, then properties over any round."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.config import parse_config
from renqueue.policy import (
    BIND_REASON,
    DEADLINE_PASSED,
    Action,
    AskPreemption,
    BackendView,
    Bind,
    Expire,
    Inherit,
    LevelPolicy,
    NoRoom,
    PlanPolicy,
    Promote,
    RouteRules,
    Wait,
    Waiting,
    _predict,
    effective_rank,
    plan,
)
from renqueue.schema import ChatMessage, InferenceRequest

NOW = 1_000.0

LEVELS = (
    LevelPolicy(name="critical", rank=0, preempts=True),
    LevelPolicy(name="high", rank=1, age_after=10),
    LevelPolicy(name="normal", rank=2, age_after=20),
    LevelPolicy(name="low", rank=3, age_after=30, preemptible=True),
    LevelPolicy(name="batch", rank=4, preemptible=True),
)
CRITICAL, HIGH, NORMAL, LOW, BATCH = range(5)

POLICY = PlanPolicy(levels=LEVELS, routes={"chat": ("a", "b"), "solo": ("a",), "big": ("b", "a")})


def request(name: str, **fields: Any) -> InferenceRequest:
    base: dict[str, Any] = {
        "id": name,
        "tenant": "t",
        "route": "chat",
        "messages": [ChatMessage(role="user", content="hi")],
    }
    return InferenceRequest(**{**base, **fields})


def held(ref: int, rank: int, waited: float = 0.0, **fields: Any) -> Waiting:
    """Waiting request ``ref`` (id ``r<ref>``) at ``rank``, waiting ``waited`` s at NOW."""
    own = {
        k: fields.pop(k) for k in ("route", "deadline", "complexity", "parent_id") if k in fields
    }
    return Waiting(
        ref=ref,
        request=request(f"r{ref}", **own),
        rank=rank,
        submitted=NOW - waited,
        **fields,
    )


def view(name: str, capacity: int = 1, in_flight: int = 0, **fields: Any) -> BackendView:
    return BackendView(name=name, capacity=capacity, in_flight=in_flight, **fields)


def backends(*views: BackendView) -> dict[str, BackendView]:
    return {v.name: v for v in views}


def late(seconds: float) -> str:
    return f"cannot meet the deadline on any candidate: the fastest would finish {seconds} s late"


def outcome(actions: Sequence[Action]) -> dict[int, tuple[Any, ...]]:
    """Each request's round outcome: ("bind", backend) | ("wait", reason) | ("expire", reason)."""
    result: dict[int, tuple[Any, ...]] = {}
    for action in actions:
        if isinstance(action, Bind):
            result[action.ref] = ("bind", action.backend)
        elif isinstance(action, Wait):
            result[action.ref] = ("wait", action.reason)
        elif isinstance(action, Expire):
            result[action.ref] = ("expire", action.reason)
    return result


def asks(actions: Sequence[Action]) -> dict[int, tuple[int, tuple[str, ...]]]:
    return {a.ref: (a.rank, a.backends) for a in actions if isinstance(a, AskPreemption)}


FULL = NoRoom.FULL.value
NONE = NoRoom.NONE_CAPABLE.value


# ------------------------------------------------------------------ tables


@pytest.mark.parametrize(
    ("case", "waiting", "views", "expected"),
    [
        (
            "the most urgent level takes the only slot",
            [held(1, NORMAL), held(2, CRITICAL), held(3, HIGH)],
            backends(view("a"), view("b", in_flight=1)),
            {1: ("wait", FULL), 2: ("bind", "a"), 3: ("wait", FULL)},
        ),
        (
            "within a level the oldest goes first",
            [held(1, HIGH, waited=1), held(2, HIGH, waited=5)],
            backends(view("a"), view("b", in_flight=1)),
            {1: ("wait", FULL), 2: ("bind", "a")},
        ),
        (
            "a request aged to the top beats a fresh one submitted there",
            # normal waited 35 s: high after 20 s, critical after 30 s; older wins at the top
            [held(1, CRITICAL, waited=1), held(2, NORMAL, waited=35)],
            backends(view("a"), view("b", in_flight=1)),
            {1: ("wait", FULL), 2: ("bind", "a")},
        ),
        (
            "a child competes at its parent's level",
            [
                held(1, HIGH, waited=5),
                held(2, BATCH, waited=1, parent_id="p", parent=(CRITICAL, NOW - 1)),
            ],
            backends(view("a"), view("b", in_flight=1)),
            {1: ("wait", FULL), 2: ("bind", "a")},
        ),
        (
            "a leader competes at its most urgent follower's level",
            [held(1, HIGH, waited=5), held(2, BATCH, waited=1, boost=(CRITICAL, NOW - 1))],
            backends(view("a"), view("b", in_flight=1)),
            {1: ("wait", FULL), 2: ("bind", "a")},
        ),
        (
            "cascade order, and slots are used up as the round binds",
            [held(1, HIGH, waited=3), held(2, HIGH, waited=2), held(3, HIGH, waited=1)],
            backends(view("a", capacity=3, in_flight=1), view("b", capacity=1)),
            {1: ("bind", "a"), 2: ("bind", "a"), 3: ("bind", "b")},
        ),
        (
            "a route's own cascade order decides",
            [held(1, HIGH, route="big")],
            backends(view("a"), view("b")),
            {1: ("bind", "b")},
        ),
        (
            "unhealthy and too weak candidates are skipped",
            [held(1, HIGH, waited=2, complexity=2), held(2, HIGH, waited=1)],
            backends(view("a", capacity=4, tier=1), view("b", healthy=False, tier=3)),
            {1: ("wait", NONE), 2: ("bind", "a")},
        ),
        (
            "a request too complex for the free backend waits; a later one takes the slot",
            [held(1, CRITICAL, complexity=2), held(2, BATCH)],
            backends(view("a", tier=1), view("b", tier=2, in_flight=1)),
            {1: ("wait", FULL), 2: ("bind", "a")},
        ),
        (
            "an unknown route waits instead of failing the round",
            [held(1, HIGH, route="nowhere"), held(2, HIGH)],
            backends(view("a")),
            {1: ("wait", NONE), 2: ("bind", "a")},
        ),
        (
            "a passed deadline expires, using no slot",
            [held(1, CRITICAL, deadline=NOW), held(2, BATCH, deadline=NOW + 1)],
            backends(view("a"), view("b", in_flight=1)),
            {1: ("expire", DEADLINE_PASSED), 2: ("bind", "a")},
        ),
        (
            "hopeless: every healthy candidate would finish late",
            [held(1, HIGH, deadline=NOW + 5)],
            backends(
                view("a", expected_duration=6.0),
                view("b", expected_duration=7.5),
            ),
            {1: ("expire", late(1.0))},
        ),
        (
            "an unhealthy fast candidate does not rescue a request",
            [held(1, HIGH, deadline=NOW + 5)],
            backends(
                view("a", expected_duration=1.0, healthy=False),
                view("b", expected_duration=7.0),
            ),
            {1: ("expire", late(2.0))},
        ),
        (
            # and is chosen over the first candidate, predicted to finish late
            "a candidate with no estimate yet may make it",
            [held(1, HIGH, deadline=NOW + 5)],
            backends(view("a", expected_duration=60.0), view("b")),
            {1: ("bind", "b")},
        ),
        (
            # and it waits for that one rather than binding to one predicted late
            "one candidate fast enough, even a full one, keeps a request from expiring",
            [held(1, HIGH, deadline=NOW + 5)],
            backends(view("a", in_flight=1, expected_duration=1.0), view("b", expected_duration=9)),
            {
                1: (
                    "wait",
                    "cheapest in time: a predicted 2.0 s of 5.0 s once it has room"
                    " (every slot taken, in 1.0 s); b predicted 9.0 s",
                )
            },
        ),
        (
            "nothing waiting, nothing to do",
            [],
            backends(view("a")),
            {},
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_round_binds_waits_and_expires_as_the_rules_say(
    case: str, waiting: list[Waiting], views: dict[str, BackendView], expected: dict[int, Any]
) -> None:
    assert outcome(plan(waiting, views, NOW, POLICY)) == expected, case


def test_a_binding_carries_its_reason_and_the_effective_rank_it_competed_at() -> None:
    actions = plan([held(1, NORMAL, waited=25)], backends(view("a")), NOW, POLICY)
    assert actions[-1] == Bind(ref=1, backend="a", effective_rank=HIGH, reason=BIND_REASON)


def test_a_wait_names_every_candidate_of_its_route() -> None:
    actions = plan([held(1, HIGH, route="big")], backends(view("a", in_flight=1)), NOW, POLICY)
    assert actions == [Wait(ref=1, backends=("b", "a"), reason=FULL)]


ALL_FULL = backends(view("a", in_flight=1), view("b", in_flight=1, tier=2))


def test_a_backlog_with_every_slot_taken_is_planned_without_a_prediction_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A binder holds thousands of requests while every slot is taken, and plans
    all of them each round: one with no deadline can only wait, so the round
    predicts no finish for it (it did, per candidate: ~150 us a request, the
    binder's whole time in a backlog). Those with a deadline are predicted."""

    calls = Counter[str]()
    predict = _predict.predict

    def counted(request: InferenceRequest, view: BackendView, *args: Any, **kw: Any) -> Any:
        calls[request.id] += 1
        return predict(request, view, *args, **kw)

    monkeypatch.setattr(_predict, "predict", counted)
    waiting = [held(ref, ref % 5, waited=ref / 100) for ref in range(1, 501)]
    waiting.append(held(501, NORMAL, deadline=NOW + 60))
    for strategy in ("cheapest", "cascade"):
        policy = msgspec.structs.replace(
            POLICY, rules={"chat": msgspec.convert({"strategy": strategy}, RouteRules)}
        )
        actions = plan(waiting, ALL_FULL, NOW, policy)
        waits = [a for a in actions if isinstance(a, Wait)]
        assert len(waits) == len(waiting)
        assert all(a.reason == FULL for a in waits if a.ref != 501)
        asked = {a.ref for a in actions if isinstance(a, AskPreemption)}
        assert asked == {item.ref for item in waiting if item.rank == CRITICAL}
    assert set(calls) == {"r501"}


PREEMPTION_CASES = {
    "a critical request asks every capable candidate": (
        held(1, CRITICAL),
        ALL_FULL,
        {1: (CRITICAL, ("a", "b"))},
    ),
    "only capable candidates are asked": (
        held(1, CRITICAL, complexity=2),
        ALL_FULL,
        {1: (CRITICAL, ("b",))},
    ),
    "a level that does not preempt waits": (held(1, HIGH), ALL_FULL, {}),
    "aging to the top does not give the right to preempt": (
        held(1, NORMAL, waited=40),
        ALL_FULL,
        {},
    ),
    "a critical parent's child preempts at the parent's level": (
        held(1, BATCH, parent_id="p", parent=(CRITICAL, NOW - 1)),
        ALL_FULL,
        {1: (CRITICAL, ("a", "b"))},
    ),
    "a follower's boost does not give the right to preempt": (
        held(1, BATCH, boost=(CRITICAL, NOW - 1)),
        ALL_FULL,
        {},
    ),
    "one run per request: never again once one was preempted": (
        held(1, CRITICAL, preempted_one=True),
        ALL_FULL,
        {},
    ),
    "an ask that found nothing is not repeated within the retry interval": (
        held(1, CRITICAL, preempt_asked=NOW - 1.9),
        ALL_FULL,
        {},
    ),
    "and is repeated after it": (
        held(1, CRITICAL, preempt_asked=NOW - 2.0),
        ALL_FULL,
        {1: (CRITICAL, ("a", "b"))},
    ),
    "no capable candidate: nothing to preempt": (
        held(1, CRITICAL, complexity=2),
        backends(view("a", in_flight=1), view("b", tier=2, healthy=False)),
        {},
    ),
    "a free slot: no preemption": (held(1, CRITICAL), backends(view("a"), view("b")), {}),
}


@pytest.mark.parametrize(
    ("item", "views", "expected"),
    [pytest.param(*case, id=name) for name, case in PREEMPTION_CASES.items()],
)
def test_preemption_is_asked_for_only_by_those_the_rules_allow(
    item: Waiting, views: dict[str, BackendView], expected: dict[int, Any]
) -> None:
    actions = plan([item], views, NOW, POLICY)
    assert asks(actions) == expected
    if expected:  # the ask comes with the wait: the request stays held
        decided = [type(a) for a in actions if not isinstance(a, Promote | Inherit)]
        assert decided == [AskPreemption, Wait]


def test_promotions_are_announced_once_each_at_the_time_they_were_earned() -> None:
    actions = plan([held(1, NORMAL, waited=35)], backends(view("a", in_flight=1)), NOW, POLICY)
    start = NOW - 35
    assert [a for a in actions if isinstance(a, Promote)] == [
        Promote(ref=1, from_level="normal", to_level="high", at=start + 20, waited=20, promoted=1),
        Promote(
            ref=1, from_level="high", to_level="critical", at=start + 30, waited=30, promoted=2
        ),
    ]
    again = plan(
        [held(1, NORMAL, waited=35, promoted=1)], backends(view("a", in_flight=1)), NOW, POLICY
    )
    assert [(a.to_level, a.promoted) for a in again if isinstance(a, Promote)] == [("critical", 2)]
    done = plan(
        [held(1, NORMAL, waited=35, promoted=2)], backends(view("a", in_flight=1)), NOW, POLICY
    )
    assert not [a for a in done if isinstance(a, Promote)]


def test_a_request_is_announced_before_it_is_bound_or_expired() -> None:
    actions = plan(
        [held(1, NORMAL, waited=25), held(2, LOW, waited=31, deadline=NOW)],
        backends(view("a")),
        NOW,
        POLICY,
    )
    assert [(type(a).__name__, a.ref) for a in actions] == [
        ("Promote", 1),
        ("Bind", 1),
        ("Promote", 2),
        ("Expire", 2),
    ]


def test_inheritance_is_announced_with_its_reason_once_per_level() -> None:
    child = held(1, BATCH, waited=2, parent_id="p", parent=(HIGH, NOW - 3))
    actions = plan([child], backends(view("a", in_flight=1)), NOW, POLICY)
    assert [a for a in actions if isinstance(a, Inherit)] == [
        Inherit(
            ref=1,
            from_level="batch",
            to_level="high",
            rank=HIGH,
            at=NOW,
            waited=2,
            reason="inherited from parent p",
        )
    ]
    announced = msgspec.structs.replace(child, inherited=HIGH)
    assert not [a for a in plan([announced], ALL_FULL, NOW, POLICY) if isinstance(a, Inherit)]
    # The parent aged on to critical: that is announced too.
    aged = plan([announced], ALL_FULL, NOW + 10, POLICY)
    assert [(a.to_level, a.rank) for a in aged if isinstance(a, Inherit)] == [("critical", 0)]


def test_a_followers_boost_is_not_announced_as_an_inheritance() -> None:
    """Regression: the router announced any lift of a child above its own
    level as "inherited from parent", also one that came from a coalesced
    follower's boost while the parent was no more urgent than the child."""
    child = held(1, NORMAL, parent_id="p", parent=(BATCH, NOW - 1), boost=(CRITICAL, NOW))
    actions = plan([child], backends(view("a")), NOW, POLICY)
    assert not [a for a in actions if isinstance(a, Inherit)]
    assert actions == [Bind(ref=1, backend="a", effective_rank=CRITICAL)]


def test_the_plan_of_a_config_uses_its_levels_and_cascade_order() -> None:
    config = parse_config(
        {
            "backends": {
                name: {"base_url": "http://127.0.0.1:1/v1", "model": "m"} for name in ("x", "y")
            },
            "routes": {"chat": {"backends": ["y", "x"]}},
        }
    )
    policy = config.plan_policy()
    assert policy.routes == {"chat": ("y", "x")}
    assert [level.name for level in policy.levels] == config.priorities
    assert plan([held(1, HIGH)], backends(view("x"), view("y")), NOW, policy)[-1] == Bind(
        ref=1, backend="y", effective_rank=HIGH
    )


# -------------------------------------------------------------- properties

NAMES = ("a", "b", "c", "d")


@st.composite
def rounds(draw: st.DrawFn) -> tuple[list[Waiting], dict[str, BackendView], PlanPolicy]:
    """Any hold, load and route set a router may plan a round over."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    views = {
        name: BackendView(
            name=name,
            capacity=draw(st.integers(1, 4)),
            in_flight=draw(st.integers(0, 5)),
            healthy=draw(st.booleans()),
            tier=draw(st.integers(1, 3)),
            expected_duration=draw(st.none() | st.floats(0.1, 30)),
        )
        for name in names
    }
    routes = {
        f"r{index}": tuple(draw(st.permutations(names))[: draw(st.integers(1, len(names)))])
        for index in range(draw(st.integers(1, 3)))
    }
    policy = PlanPolicy(levels=LEVELS, routes=routes)
    moment = st.floats(0, 120).map(lambda ago: NOW - ago)
    waiting = [
        Waiting(
            ref=ref,
            request=request(
                f"r{ref}",
                route=draw(st.sampled_from(sorted(routes))),
                deadline=draw(st.none() | st.floats(NOW - 5, NOW + 40)),
                complexity=draw(st.none() | st.integers(1, 3)),
            ),
            rank=draw(st.integers(0, 4)),
            submitted=draw(moment),
            parent=draw(st.none() | st.tuples(st.integers(0, 4), moment)),
            boost=draw(st.none() | st.tuples(st.integers(0, 4), moment)),
            promoted=draw(st.integers(0, 2)),
            preempt_asked=draw(st.none() | st.floats(0, 3).map(lambda ago: NOW - ago)),
            preempted_one=draw(st.booleans()),
        )
        for ref in range(draw(st.integers(0, 12)))
    ]
    return waiting, views, policy


#: Examples per property: 80 in `make test` (the suite's time budget);
#: ``RENQUEUE_PROPERTY_EXAMPLES=2000`` for a thorough run.
PROPERTIES = settings(
    max_examples=int(os.environ.get("RENQUEUE_PROPERTY_EXAMPLES", "80")), deadline=None
)


def fits(item: Waiting, view: BackendView, policy: PlanPolicy) -> bool:
    """Whether ``item`` may run on ``view``: a healthy candidate of its route, of its tier."""
    complexity = item.request.complexity
    return (
        view.name in policy.routes.get(item.request.route, ())
        and view.healthy
        and (complexity is None or view.tier >= complexity)
    )


def urgency(item: Waiting) -> tuple[int, float]:
    """(effective rank, submit time): the most urgent of its own aged level, its
    parent's and its boost's."""
    ranks = [effective_rank(item.rank, NOW - item.submitted, LEVELS)]
    for rank, since in filter(None, (item.parent, item.boost)):
        ranks.append(effective_rank(rank, NOW - since, LEVELS))
    return (min(ranks), item.submitted)


def doomed(item: Waiting, views: dict[str, BackendView], policy: PlanPolicy) -> bool:
    """Past its deadline, or no capable candidate's expected duration fits
    before it (healthy, of the tier it needs: one that cannot serve it does
    not make it hopeless, nor save it)."""
    deadline = item.request.deadline
    if deadline is None:
        return False
    if deadline <= NOW:
        return True
    complexity = item.request.complexity or 0
    durations = [
        views[name].expected_duration
        for name in policy.routes.get(item.request.route, ())
        if name in views and views[name].healthy and views[name].tier >= complexity
    ]
    return bool(durations) and all(d is not None and NOW + d > deadline for d in durations)


@PROPERTIES
@given(rounds())
def test_every_waiting_request_is_bound_expired_or_kept_exactly_once(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    waiting, views, policy = round_
    actions = plan(waiting, views, NOW, policy)
    ends = Counter(a.ref for a in actions if isinstance(a, Bind | Expire | Wait))
    assert ends == Counter(item.ref for item in waiting)


@PROPERTIES
@given(rounds())
def test_it_never_binds_beyond_a_backends_free_slots_nor_where_a_request_cannot_run(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    waiting, views, policy = round_
    actions = plan(waiting, views, NOW, policy)
    by_ref = {item.ref: item for item in waiting}
    binds = [a for a in actions if isinstance(a, Bind)]
    for name, count in Counter(a.backend for a in binds).items():
        assert count <= views[name].free
    for bind in binds:
        assert fits(by_ref[bind.ref], views[bind.backend], policy)


@PROPERTIES
@given(rounds())
def test_it_never_binds_a_request_to_a_backend_a_more_urgent_waiting_one_could_have_taken(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    """For requests u, v where u is more urgent (smaller (effective rank, submit
    time); equal keys: u came first in the hold): if v is bound to backend B and
    u stays waiting, then u could not run on B (not a healthy candidate of u's
    route of the tier u needs). A slot on B was free when v took it, so it was
    free when u, earlier in the order, was decided. Unless u chose to wait: for
    a candidate cheaper, or in time where B was predicted late ("cheapest in
    time: ... once it has room")."""
    waiting, views, policy = round_
    result = outcome(plan(waiting, views, NOW, policy))
    order = sorted(waiting, key=urgency)  # stable: equal keys keep the hold's order
    for i, more in enumerate(order):
        if result[more.ref][0] != "wait" or "once it has room" in result[more.ref][1]:
            continue
        for less in order[i + 1 :]:
            if result[less.ref][0] == "bind":
                assert not fits(more, views[result[less.ref][1]], policy)


@PROPERTIES
@given(rounds())
def test_it_leaves_no_slot_idle_that_a_waiting_request_could_use(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    waiting, views, policy = round_
    actions = plan(waiting, views, NOW, policy)
    used = Counter(a.backend for a in actions if isinstance(a, Bind))
    result = outcome(actions)
    for item in waiting:
        # (unless it chose to wait for a cheaper one, or one in time)
        if result[item.ref][0] == "wait" and "once it has room" not in result[item.ref][1]:
            assert not [
                v for v in views.values() if fits(item, v, policy) and v.free > used[v.name]
            ]


@PROPERTIES
@given(rounds())
def test_it_expires_exactly_the_requests_past_or_certain_to_miss_their_deadline(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    waiting, views, policy = round_
    result = outcome(plan(waiting, views, NOW, policy))
    for item in waiting:
        assert (result[item.ref][0] == "expire") == doomed(item, views, policy)


@PROPERTIES
@given(rounds())
def test_only_a_preempting_level_with_every_capable_slot_full_asks_and_at_its_pace(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    waiting, views, policy = round_
    actions = plan(waiting, views, NOW, policy)
    result = outcome(actions)
    asked = asks(actions)
    for item in waiting:
        rank = item.rank if item.parent is None else min(item.rank, item.parent[0])
        due = item.preempt_asked is None or NOW - item.preempt_asked >= policy.preempt_retry
        eligible = LEVELS[rank].preempts and not item.preempted_one and due
        full = result[item.ref][0] == "wait" and result[item.ref][1].startswith(FULL)
        assert (item.ref in asked) == (eligible and full)
        if item.ref in asked:
            assert asked[item.ref] == (
                rank,
                tuple(
                    name
                    for name in policy.routes[item.request.route]
                    if name in views and fits(item, views[name], policy)
                ),
            )


@PROPERTIES
@given(rounds())
def test_planning_is_pure(
    round_: tuple[list[Waiting], dict[str, BackendView], PlanPolicy],
) -> None:
    waiting, views, policy = round_
    before = (list(waiting), dict(views))
    assert plan(waiting, views, NOW, policy) == plan(waiting, views, NOW, policy)
    assert (waiting, views) == before
