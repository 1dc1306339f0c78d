"""The fallback policy and the circuit breaker as plain functions (issue #9):
tables of what each failure class leads to, properties of the cascade, the
planner honouring a request's fallback, the fold of the new events."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from renqueue.config import parse_config
from renqueue.errors import (
    BackendError,
    BadRequestError,
    FailureClass,
    FatalBackendError,
    MalformedRequestError,
    OverCostCapError,
    RateLimitedError,
    RetryableBackendError,
)
from renqueue.policy import (
    CLOSED,
    DEFAULT_FALLBACK_ON,
    RETRY_HERE_FIRST,
    WAIT_HERE_IF_ALONE,
    BackendView,
    Bind,
    Candidate,
    Circuit,
    CircuitRules,
    Fail,
    FailurePolicy,
    FallBack,
    FallbackPolicy,
    LevelPolicy,
    PlanPolicy,
    RequeueElsewhere,
    Retry,
    RouteFacts,
    Wait,
    Waiting,
    after_failure,
    capable,
    next_circuit,
    plan,
    validate,
)
from renqueue.schema import (
    ChatMessage,
    CircuitChanged,
    Completed,
    Fallback,
    FellBack,
    InferenceRequest,
    Probed,
    Retrying,
    Routed,
    Usage,
)
from renqueue.services.router._circuits import Circuits
from renqueue.state import BackendState, ProjectionState, fold_many

POLICY = FailurePolicy(budget=5, retry_delay=1.0, max_retry_delay=30.0)
A = Candidate(name="a", tier=2, context_window=100)
B = Candidate(name="b", tier=1, context_window=1000, paid=True)
C = Candidate(name="c", tier=2, context_window=50)
ROUTE = (A, B, C)


def half(_: float = 0.0) -> float:
    return 0.5


def error(failure: FailureClass, *, backend: str = "a") -> BackendError:
    if failure in (FailureClass.RATE_LIMITED, FailureClass.QUOTA_EXHAUSTED):
        return RateLimitedError(
            "429", backend=backend, quota_exhausted=failure is FailureClass.QUOTA_EXHAUSTED
        )
    if failure in (
        FailureClass.BAD_REQUEST,
        FailureClass.CONTEXT_LENGTH,
        FailureClass.CONTENT_FILTER,
    ):
        return BadRequestError("400", backend=backend, failure=failure)
    if failure is FailureClass.UNAVAILABLE:
        return FatalBackendError("401", backend=backend, failure=failure)
    return RetryableBackendError("boom", backend=backend, failure=failure)


def facts(
    backend: Candidate = A,
    fallback: Fallback | None = None,
    policy: FallbackPolicy | None = None,
    *,
    probe: bool = False,
) -> RouteFacts:
    return RouteFacts(
        policy=policy or FallbackPolicy(),
        candidates=ROUTE,
        backend=backend,
        fallback=fallback or Fallback(),
        probe=probe,
        now=1000.0,
    )


# ------------------------------------------------------------------ the table

EXPECTED = {
    # class: (first failure, after the same-backend retries)
    FailureClass.CONNECT: (Retry, FallBack),
    FailureClass.CONNECT_TIMEOUT: (Retry, FallBack),
    FailureClass.FIRST_TOKEN_TIMEOUT: (Retry, FallBack),
    FailureClass.STALL: (Retry, FallBack),
    FailureClass.SERVER_ERROR: (Retry, FallBack),
    FailureClass.MALFORMED: (Retry, FallBack),
    FailureClass.TOTAL_TIMEOUT: (FallBack, FallBack),
    FailureClass.OVERLOADED: (FallBack, FallBack),
    FailureClass.RATE_LIMITED: (FallBack, FallBack),
    FailureClass.BROKEN_STREAM: (FallBack, FallBack),
    FailureClass.UNAVAILABLE: (FallBack, FallBack),
    FailureClass.CONTEXT_LENGTH: (FallBack, FallBack),
    FailureClass.QUOTA_EXHAUSTED: (RequeueElsewhere, RequeueElsewhere),
    FailureClass.BAD_REQUEST: (Fail, Fail),
    FailureClass.CONTENT_FILTER: (Fail, Fail),
}


def test_every_class_has_a_documented_outcome() -> None:
    assert set(EXPECTED) == set(FailureClass)
    assert RETRY_HERE_FIRST <= DEFAULT_FALLBACK_ON


@pytest.mark.parametrize("failure", list(FailureClass))
def test_each_class_leads_to_its_outcome(failure: FailureClass) -> None:
    first, then = EXPECTED[failure]
    got = after_failure(error(failure), failed_runs=0, policy=POLICY, random=half, route=facts())
    assert isinstance(got, first), got
    later = after_failure(error(failure), failed_runs=1, policy=POLICY, random=half, route=facts())
    assert isinstance(later, then), later


def test_a_fallback_excludes_the_backend_that_failed_and_counts_an_attempt() -> None:
    got = after_failure(
        error(FailureClass.OVERLOADED), failed_runs=0, policy=POLICY, random=half, route=facts()
    )
    assert isinstance(got, FallBack)
    assert got.error_class == "overloaded"
    assert got.fallback.excluded == ("a",)
    assert got.fallback.count == 1
    assert got.fallback.from_tier == 2
    # The earliest it may go back to a backend that failed it: a backoff on.
    assert got.fallback.not_before == pytest.approx(1000.0 + 0.75)


def test_a_429_falls_back_without_using_an_attempt() -> None:
    got = after_failure(
        error(FailureClass.RATE_LIMITED),
        failed_runs=0,
        policy=POLICY,
        random=half,
        route=facts(fallback=Fallback(count=1)),
    )
    assert isinstance(got, FallBack)
    assert got.fallback.count == 1


def test_the_attempts_bound_the_cascade() -> None:
    route = facts(fallback=Fallback(excluded=("b",), count=2))
    got = after_failure(
        error(FailureClass.OVERLOADED), failed_runs=0, policy=POLICY, random=half, route=route
    )
    assert isinstance(got, Fail)
    assert "3 attempts, the route's fallback.attempts, used on 2 backends: b, a" in got.reason


def test_a_request_that_used_its_attempts_on_one_backend_says_so() -> None:
    # A route whose other candidates could not take it binds it to the one that
    # failed it again: three attempts on one backend, not "3 backends".
    route = facts(fallback=Fallback(excluded=("a",), count=2))
    got = after_failure(
        error(FailureClass.SERVER_ERROR), failed_runs=1, policy=POLICY, random=half, route=route
    )
    assert isinstance(got, Fail)
    assert got.reason.endswith("(3 attempts, the route's fallback.attempts, used on 1 backend: a)")
    assert "backends" not in got.reason


def test_a_probe_call_that_fails_uses_no_attempt_and_is_not_retried_here() -> None:
    route = facts(fallback=Fallback(count=1, probes=3), probe=True)
    got = after_failure(
        error(FailureClass.SERVER_ERROR), failed_runs=0, policy=POLICY, random=half, route=route
    )
    assert isinstance(got, FallBack)
    assert got.fallback.count == 1
    assert got.fallback.probes == 4


def test_a_context_too_long_asks_for_a_larger_window_and_never_the_same_backend() -> None:
    got = after_failure(
        error(FailureClass.CONTEXT_LENGTH), failed_runs=0, policy=POLICY, random=half, route=facts()
    )
    assert isinstance(got, FallBack)
    assert got.fallback.min_context == 101
    assert got.fallback.excluded == ("a",)
    # Only b (1000) is that large; failing there too leaves nothing larger.
    again = after_failure(
        error(FailureClass.CONTEXT_LENGTH, backend="b"),
        failed_runs=0,
        policy=POLICY,
        random=half,
        route=facts(B, got.fallback),
    )
    assert isinstance(again, Fail)
    assert "larger context window" in again.reason


def test_without_downgrade_the_tier_may_not_drop_and_without_paid_only_free_ones() -> None:
    strict = FallbackPolicy(downgrade=False, paid=False)
    got = after_failure(
        error(FailureClass.OVERLOADED),
        failed_runs=0,
        policy=POLICY,
        random=half,
        route=facts(policy=strict),
    )
    assert isinstance(got, FallBack)
    assert got.fallback.min_tier == 2
    assert got.fallback.free_only


def test_every_backend_that_failed_it_stays_excluded() -> None:
    route = facts(C, Fallback(excluded=("a", "b"), count=1))
    got = after_failure(
        error(FailureClass.BROKEN_STREAM, backend="c"),
        failed_runs=0,
        policy=POLICY,
        random=half,
        route=route,
    )
    assert isinstance(got, FallBack)
    assert got.fallback.excluded == ("a", "b", "c")
    assert got.fallback.not_before == pytest.approx(1000.0 + 1.5)  # step 2: d = 2 s, half jitter


def test_a_candidate_below_the_requests_complexity_does_not_count_as_one_left() -> None:
    """Only a tier-1 candidate is left besides the failed one, and the request
    needs tier 2: nothing can take it, so it fails rather than wait for nothing."""
    route = msgspec.structs.replace(facts(A), candidates=(A, B), complexity=2)
    got = after_failure(
        error(FailureClass.CONTEXT_LENGTH), failed_runs=0, policy=POLICY, random=half, route=route
    )
    assert isinstance(got, Fail)


@pytest.mark.parametrize("failure", [FailureClass.RATE_LIMITED, FailureClass.OVERLOADED])
def test_not_now_waits_here_when_no_other_candidate_could_take_it(failure: FailureClass) -> None:
    """A 429 or a 503 on a route of one (or with the others excluded) is
    retried here after the provider's time, not sent round a new pass."""
    alone = RouteFacts(policy=FallbackPolicy(), candidates=(A,), backend=A, now=1000.0)
    got = after_failure(error(failure), failed_runs=0, policy=POLICY, random=half, route=alone)
    assert isinstance(got, Retry)
    others_out = facts(fallback=Fallback(excluded=("b", "c")))
    got = after_failure(error(failure), failed_runs=3, policy=POLICY, random=half, route=others_out)
    assert isinstance(got, Retry)
    used_up = after_failure(error(failure), failed_runs=4, policy=POLICY, random=half, route=alone)
    assert isinstance(used_up, FallBack)  # the budget is spent: the next pass, after a backoff
    assert used_up.fallback.not_before is not None


def test_a_class_the_route_does_not_fall_back_on_is_retried_here_or_fails() -> None:
    only_overload = FallbackPolicy(on=frozenset({FailureClass.OVERLOADED}))
    route = facts(policy=only_overload)
    retried = after_failure(
        error(FailureClass.SERVER_ERROR), failed_runs=3, policy=POLICY, random=half, route=route
    )
    assert isinstance(retried, Retry)
    ended = after_failure(
        error(FailureClass.SERVER_ERROR), failed_runs=4, policy=POLICY, random=half, route=route
    )
    assert isinstance(ended, Fail)
    fatal = after_failure(
        error(FailureClass.UNAVAILABLE), failed_runs=0, policy=POLICY, random=half, route=route
    )
    assert isinstance(fatal, Fail)


@given(
    failure=st.sampled_from(sorted(DEFAULT_FALLBACK_ON - {FailureClass.QUOTA_EXHAUSTED})),
    failed_runs=st.integers(0, 6),
    count=st.integers(0, 5),
    excluded=st.sets(st.sampled_from(["a", "b", "c"])),
    at=st.sampled_from(ROUTE),
    probe=st.booleans(),
    attempts=st.integers(1, 5),
)
def test_the_cascade_never_leaves_the_route_never_goes_back_and_always_ends(
    failure: FailureClass,
    failed_runs: int,
    count: int,
    excluded: set[str],
    at: Candidate,
    probe: bool,
    attempts: int,
) -> None:
    route = facts(
        at,
        Fallback(excluded=tuple(sorted(excluded - {at.name})), count=count),
        FallbackPolicy(attempts=attempts),
        probe=probe,
    )
    got = after_failure(error(failure, backend=at.name), failed_runs=failed_runs,
                        policy=POLICY, random=half, route=route)  # fmt: skip
    free = probe or failure is FailureClass.RATE_LIMITED
    if isinstance(got, FallBack):
        names = {c.name for c in ROUTE}
        assert set(got.fallback.excluded) <= names
        assert got.fallback.count == count + (0 if free else 1) < attempts
        assert at.name in got.fallback.excluded
        assert set(route.fallback.excluded) <= set(got.fallback.excluded)
        assert got.fallback.not_before is not None
        assert got.fallback.not_before > route.now
    elif isinstance(got, Fail):
        assert (
            count + (0 if free else 1) >= attempts
            or failed_runs + 1 >= POLICY.budget
            or (failure is FailureClass.CONTEXT_LENGTH)
        )
    else:
        assert isinstance(got, Retry)
        assert not probe
        assert (failure in RETRY_HERE_FIRST and failed_runs < 1) or (
            failure in WAIT_HERE_IF_ALONE and failed_runs + 1 < POLICY.budget
        )


# ---------------------------------------------------------------- the planner

LEVELS = (LevelPolicy(name="normal", rank=0, age_after=None),)


def view(name: str, **fields: object) -> BackendView:
    return BackendView(**{"name": name, "capacity": 4, "in_flight": 0, **fields})  # type: ignore[arg-type]


def request(fallback: Fallback | None = None, **fields: object) -> InferenceRequest:
    return InferenceRequest(
        id="r",
        tenant="t",
        route="chat",
        messages=[ChatMessage(role="user", content="hi")],
        fallback=fallback,
        requeues=1 if fallback else 0,
        **fields,  # type: ignore[arg-type]
    )


VIEWS = {
    "a": view("a", tier=2, context_window=100),
    "b": view("b", tier=1, context_window=1000, cost_input_per_mtok=1.0, cost_output_per_mtok=1.0),
    "c": view("c", tier=2, context_window=50),
}


@pytest.mark.parametrize(
    ("fallback", "max_cost", "expected"),
    [
        (None, None, ["a", "b", "c"]),
        (Fallback(excluded=("a",)), None, ["b", "c"]),
        (Fallback(min_tier=2), None, ["a", "c"]),
        (Fallback(min_context=101), None, ["b"]),
        (Fallback(free_only=True), None, ["a", "c"]),
        # b's estimate: a few prompt tokens + 1024 output tokens at $1/Mtok: about $0.001.
        (Fallback(), 0.0001, ["a", "c"]),
        (Fallback(), 0.01, ["a", "b", "c"]),
    ],
)
def test_the_planner_binds_a_fallen_back_request_only_where_its_fallback_allows(
    fallback: Fallback | None, max_cost: float | None, expected: list[str]
) -> None:
    allowed = capable(request(fallback, max_cost=max_cost), ["a", "b", "c"], VIEWS)
    assert [v.name for v in allowed] == expected


def test_a_quality_downgrade_and_the_backends_left_out_are_in_the_reason() -> None:
    waiting = Waiting(
        ref=1, request=request(Fallback(excluded=("a", "c"), count=2, from_tier=2)),
        rank=0, submitted=0.0,
    )  # fmt: skip
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a", "b", "c")})
    [bind] = plan([waiting], VIEWS, 10.0, policy)
    assert isinstance(bind, Bind)
    assert bind.backend == "b"
    assert "fell back (not to a, c)" in bind.reason
    assert "quality downgrade: tier 2 -> 1" in bind.reason


def test_excluded_is_a_preference_never_a_rule() -> None:
    """A request every candidate failed goes back to one of them once its
    backoff is over; so does one whose only other candidates cannot take it
    (open, or over its cost cap): it must not wait forever."""
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a", "b", "c")})
    all_failed = Waiting(
        ref=1,
        request=request(Fallback(excluded=("a", "b", "c"), not_before=12.0)),
        rank=0,
        submitted=0.0,
    )
    [wait] = plan([all_failed], VIEWS, 10.0, policy)
    assert isinstance(wait, Wait)
    assert "in 2.0 s" in wait.reason
    [bind] = plan([all_failed], VIEWS, 12.0, policy)
    assert isinstance(bind, Bind)
    assert bind.backend == "a"
    assert "back to a: no other candidate could take it" in bind.reason
    b_open = {**VIEWS, "b": msgspec.structs.replace(VIEWS["b"], healthy=False)}
    only_b_left = Waiting(
        ref=2,
        request=request(Fallback(excluded=("a", "c"), not_before=12.0)),
        rank=0,
        submitted=0.0,
    )
    assert isinstance(plan([only_b_left], b_open, 11.0, policy)[0], Wait)
    [back] = plan([only_b_left], b_open, 12.0, policy)
    assert isinstance(back, Bind)
    assert back.backend == "a"
    over_cap = Waiting(
        ref=3,
        request=request(Fallback(excluded=("a", "c"), not_before=12.0), max_cost=1e-9),
        rank=0,
        submitted=0.0,
    )
    [cheap] = plan([over_cap], VIEWS, 12.0, policy)
    assert isinstance(cheap, Bind)
    assert cheap.backend == "a"


def test_a_full_candidate_that_has_not_failed_it_is_waited_for() -> None:
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a", "b")})
    views = {"a": VIEWS["a"], "b": msgspec.structs.replace(VIEWS["b"], in_flight=4)}
    item = Waiting(
        ref=1, request=request(Fallback(excluded=("a",), not_before=0.0)), rank=0, submitted=0.0
    )
    [wait] = plan([item], views, 10.0, policy)
    assert isinstance(wait, Wait)


def test_a_half_open_backend_takes_one_call_its_probe() -> None:
    views = {"a": view("a", half_open=True)}
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a",)})
    items = [Waiting(ref=n, request=request(), rank=0, submitted=float(n)) for n in range(3)]
    actions = plan(items, views, 10.0, policy)
    binds = [a for a in actions if isinstance(a, Bind)]
    assert len(binds) == 1
    assert binds[0].probe
    assert "probe of a's half-open circuit" in binds[0].reason
    busy = {"a": view("a", half_open=True, in_flight=1)}
    assert not [a for a in plan(items, busy, 10.0, policy) if isinstance(a, Bind)]


def test_only_the_services_may_set_a_fallback_and_no_tenant_is_called_system() -> None:
    config = parse_config(
        {
            "backends": {"a": {"base_url": "http://127.0.0.1:1", "model": "m"}},
            "routes": {"chat": {"backends": ["a"]}},
        }
    )
    forged = msgspec.structs.replace(request(Fallback(excluded=("a",))), requeues=0)
    with pytest.raises(MalformedRequestError, match="fallback is set by the services only"):
        validate(forged, level="normal", tenant="t", config=config)
    system = msgspec.structs.replace(request(), tenant="_system")
    with pytest.raises(MalformedRequestError, match="reserved"):
        validate(system, level="normal", tenant="_system", config=config)


# ------------------------------------------------------------------ the circuit

RULES = CircuitRules(failures=3, error_rate=0.5, min_calls=10, window=60.0, cooloff=30.0)


def state(**fields: object) -> BackendState:
    return BackendState(**fields)  # type: ignore[arg-type]


PROBED = msgspec.structs.replace(RULES, probed=True)
OPEN = Circuit(state="open", since=100.0)
HALF = Circuit(state="half_open", since=130.0)


@pytest.mark.parametrize(
    ("current", "facts_", "rules", "now", "expected", "reason"),
    [
        (CLOSED, state(consecutive_failures=2), RULES, 100.0, "closed", ""),
        (CLOSED, state(consecutive_failures=3), RULES, 100.0, "open", "3 backend faults in a row"),
        # 5 faults of 10 calls in the window: the error rate trips it.
        (CLOSED, state(outcomes=((50, 3, 2), (90, 2, 3))), RULES, 100.0, "open", "5 of 10 calls"),
        # The same, but half of them older than the window: not enough calls.
        (CLOSED, state(outcomes=((0, 3, 2), (90, 2, 3))), RULES, 100.0, "closed", ""),
        # Closed 5 s ago (the counts afresh, the fast failures first): the rate
        # is not judged until it has been closed for half the window.
        (Circuit(since=95.0), state(outcomes=((90, 3, 7),)), RULES, 100.0, "closed", ""),
        (Circuit(since=69.0), state(outcomes=((90, 3, 7),)), RULES, 100.0, "open", "7 of 10"),
        (CLOSED, state(probe_ok=False), PROBED, 100.0, "open", "the health probe failed"),
        (OPEN, state(circuit="open"), RULES, 129.0, "open", ""),
        (OPEN, state(circuit="open"), RULES, 130.0, "half_open", "one call decides"),
        # The log does not show it open yet: only the cool-off runs.
        (OPEN, state(consecutive_failures=9), RULES, 130.0, "half_open", "one call decides"),
        # The probe still fails: the probe decides, not the cool-off.
        (OPEN, state(circuit="open", probe_ok=False), PROBED, 200.0, "open", ""),
        # A probe answer logged after it opened (log order, no clock compared).
        (
            OPEN,
            state(circuit="open", probe_ok=True, probe_since_circuit=True),
            PROBED,
            101.0,
            "closed",
            "the health probe succeeded",
        ),
        # An old good answer, from before it opened, does not close it.
        (OPEN, state(circuit="open", probe_ok=True), PROBED, 101.0, "open", ""),
        (HALF, state(circuit="half_open"), RULES, 140.0, "half_open", ""),
        (
            HALF,
            state(circuit="half_open", ok_since_circuit=1),
            RULES,
            140.0,
            "closed",
            "the probe call completed",
        ),
        (
            HALF,
            state(circuit="half_open", faults_since_circuit=1, consecutive_failures=4),
            RULES,
            140.0,
            "open",
            "the probe call failed",
        ),
        # Facts of the open circuit before it (the log not caught up): no decision.
        (HALF, state(circuit="open", ok_since_circuit=3), RULES, 140.0, "half_open", ""),
        (
            HALF,
            state(circuit="half_open", probe_since_circuit=False),
            PROBED,
            140.0,
            "open",
            "the health probe failed",
        ),
    ],
)
def test_the_circuit_moves_by_its_rules(
    current: Circuit,
    facts_: BackendState,
    rules: CircuitRules,
    now: float,
    expected: str,
    reason: str,
) -> None:
    moved = next_circuit(current, facts_, rules, now)
    assert moved.state == expected
    assert reason in moved.reason
    if moved.state == current.state:
        assert moved is current
    else:
        assert moved.since == now


# -------------------------------------------------------------------- the fold


def test_the_fold_counts_faults_by_class_keeps_outcomes_and_folds_circuits_and_probes() -> None:
    base = {"tenant": "t", "attempt": 1, "delivery": 1}
    events = [
        FellBack(
            request_id="r1",
            at=10.0,
            backend="a",
            error_type="backend_unavailable",
            error_class="connect",
            reason="x",
            fallback=Fallback(),
            **base,
        ),
        Retrying(
            request_id="r2",
            at=11.0,
            backend="a",
            error_type="backend_bad_request",
            error_class="context_length",
            reason="x",
            retry_after=0.0,
            **base,
        ),
        Completed(request_id="r3", at=21.0, backend="a", text="", usage=Usage(), cost=0.0, **base),
        FellBack(
            request_id="r4",
            at=22.0,
            backend="a",
            error_type="backend_unavailable",
            error_class="overloaded",
            reason="x",
            fallback=Fallback(),
            **base,
        ),
        CircuitChanged(
            request_id="a",
            tenant="_system",
            at=30.0,
            backend="a",
            state="open",
            previous="closed",
            reason="r",
        ),
        Probed(request_id="a", tenant="_system", at=31.0, backend="a", ok=False),
    ]
    folded = fold_many(ProjectionState(), events).backend("a")
    assert folded.consecutive_failures == 1  # the context length is not the backend's fault
    assert folded.outcomes == ((10, 0, 1), (20, 1, 1))
    assert (folded.circuit, folded.circuit_at) == ("open", 30.0)
    assert (folded.probe_ok, folded.probe_at) == (False, 31.0)
    # Logged after the circuit event: the probe's answer; before it, the calls.
    assert (folded.ok_since_circuit, folded.faults_since_circuit) == (0, 0)
    assert folded.probe_since_circuit is False
    closed = fold_many(
        ProjectionState(),
        [
            *events,
            CircuitChanged(
                request_id="a",
                tenant="_system",
                at=40.0,
                backend="a",
                state="closed",
                previous="half_open",
                reason="r",
            ),
        ],
    ).backend("a")
    assert closed.circuit == "closed"
    assert closed.outcomes == ()
    assert closed.consecutive_failures == 0


def test_a_half_open_probe_goes_to_a_request_that_failed_as_one_the_fewest_times() -> None:
    """The oldest request failed as this backend's probe before: the next
    probe is a younger one's, so one request cannot keep a circuit open."""
    views = {"a": view("a", half_open=True)}
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a",)})
    veteran = Waiting(
        ref=1, request=request(Fallback(excluded=(), probes=1)), rank=0, submitted=0.0
    )
    fresh = Waiting(ref=2, request=request(), rank=0, submitted=5.0)
    binds = [a for a in plan([veteran, fresh], views, 10.0, policy) if isinstance(a, Bind)]
    assert [b.ref for b in binds] == [2]
    # Alone, it is the probe again (and is not charged for it).
    [alone] = [a for a in plan([veteran], views, 10.0, policy) if isinstance(a, Bind)]
    assert alone.ref == 1


def test_a_backend_that_said_the_context_is_too_long_is_never_tried_again() -> None:
    """With no window declared anywhere, the backends that said "too long"
    are a rule, not a preference: the request never goes back to them."""
    blind = tuple(msgspec.structs.replace(c, context_window=None) for c in ROUTE)
    route = RouteFacts(policy=FallbackPolicy(), candidates=blind, backend=blind[0], now=1000.0)
    got = after_failure(
        error(FailureClass.CONTEXT_LENGTH), failed_runs=0, policy=POLICY, random=half, route=route
    )
    assert isinstance(got, FallBack)
    assert got.fallback.too_small == ("a",)
    views = {name: msgspec.structs.replace(v, context_window=None) for name, v in VIEWS.items()}
    views["b"] = msgspec.structs.replace(views["b"], healthy=False)
    views["c"] = msgspec.structs.replace(views["c"], healthy=False)
    item = Waiting(ref=1, request=request(got.fallback), rank=0, submitted=0.0)
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a", "b", "c")})
    # b and c are down: the request waits, and never goes back to a.
    assert all(not isinstance(a, Bind) for a in plan([item], views, 2000.0, policy))


# ---------------------------------------------------------------- the cost cap


def test_no_request_is_bound_where_its_estimated_cost_is_over_its_cap() -> None:
    """Not only after a fallback: any request with a max_cost (issue #10 item 1)."""
    assert [v.name for v in capable(request(max_cost=0.0001), ["a", "b", "c"], VIEWS)] == [
        "a",
        "c",
    ]
    assert [v.name for v in capable(request(max_cost=0.01), ["a", "b", "c"], VIEWS)] == [
        "a",
        "b",
        "c",
    ]


def test_a_cap_no_candidate_can_meet_is_rejected_at_admission() -> None:
    config = parse_config(
        {
            "backends": {
                "paid": {
                    "base_url": "http://127.0.0.1:1",
                    "model": "m",
                    "cost_input_per_mtok": 10.0,
                    "cost_output_per_mtok": 30.0,
                },
                "free": {"base_url": "http://127.0.0.1:1", "model": "m"},
            },
            "routes": {
                "paid-only": {"backends": ["paid"]},
                "mixed": {"backends": ["paid", "free"]},
            },
        }
    )
    capped = msgspec.structs.replace(request(max_cost=0.001), route="paid-only")
    with pytest.raises(OverCostCapError, match="below the estimated cost") as info:
        validate(capped, level="normal", tenant="t", config=config)
    assert info.value.code == "over_cost_cap"
    # 1024 output tokens at $30/Mtok: about $0.031; with max_tokens=10, well under.
    tight = msgspec.structs.replace(
        capped, params=msgspec.structs.replace(capped.params, max_tokens=10)
    )
    validate(tight, level="normal", tenant="t", config=config)
    # A free candidate can always meet it.
    validate(msgspec.structs.replace(capped, route="mixed"), level="normal", tenant="t",
             config=config)  # fmt: skip


# ------------------------------------------------ second review's regressions


def test_a_context_failure_with_only_candidates_over_the_cap_fails_at_once() -> None:
    """Free small model says too long; the only larger one is over the cost
    cap: nothing can take it, so it fails (it waited forever)."""
    small = Candidate(name="small", context_window=8000)
    big = Candidate(name="big", context_window=128_000, paid=True, cost=0.05)
    route = RouteFacts(
        policy=FallbackPolicy(), candidates=(small, big), backend=small, now=1.0, max_cost=0.001
    )
    got = after_failure(
        error(FailureClass.CONTEXT_LENGTH, backend="small"),
        failed_runs=0,
        policy=POLICY,
        random=half,
        route=route,
    )
    assert isinstance(got, Fail)
    assert "larger context window" in got.reason


def test_not_now_waits_here_when_the_others_are_below_its_complexity() -> None:
    route = msgspec.structs.replace(facts(A), candidates=(A, B), complexity=2)
    got = after_failure(
        error(FailureClass.OVERLOADED), failed_runs=0, policy=POLICY, random=half, route=route
    )
    assert isinstance(got, Retry)


def test_429s_are_free_only_so_many_times() -> None:
    """Two backends answering 429 cannot pass a request between them forever:
    past 3 free 429s per allowed attempt, each uses one."""
    fallback = Fallback(count=0, rate_limited=9)  # 3 x attempts (3) used up
    got = after_failure(
        error(FailureClass.RATE_LIMITED),
        failed_runs=0,
        policy=POLICY,
        random=half,
        route=facts(fallback=fallback),
    )
    assert isinstance(got, FallBack)
    assert got.fallback.count == 1
    assert got.fallback.rate_limited == 10


def test_a_retry_after_of_a_year_waits_here_no_longer_than_quota_hold() -> None:
    alone = RouteFacts(policy=FallbackPolicy(), candidates=(A,), backend=A, now=1000.0)
    huge = RateLimitedError("429", backend="a", retry_after=3e7)
    got = after_failure(huge, failed_runs=0, policy=POLICY, random=half, route=alone)
    assert isinstance(got, Retry)
    assert got.delay == POLICY.quota_hold


def test_a_request_that_cannot_use_a_half_open_backend_does_not_hold_its_probe() -> None:
    """The request with no failed probes cannot go to a (over its cost cap):
    the probe goes to the one that can, though it failed as a probe before."""
    views = {"a": view("a", half_open=True, cost_input_per_mtok=1.0, cost_output_per_mtok=1.0)}
    policy = PlanPolicy(levels=LEVELS, routes={"chat": ("a",)})
    cannot = Waiting(ref=1, request=request(max_cost=1e-9), rank=0, submitted=0.0)
    can = Waiting(ref=2, request=request(Fallback(probes=1)), rank=0, submitted=5.0)
    binds = [a for a in plan([cannot, can], views, 10.0, policy) if isinstance(a, Bind)]
    assert [b.ref for b in binds] == [2]


def test_only_the_probe_calls_outcome_decides_a_half_open_circuit() -> None:
    """A call that began before the circuit opened and ends while it is
    half-open decides nothing; the probe call's outcome does."""
    base = {"tenant": "t", "delivery": 1}
    half_open = CircuitChanged(request_id="a", tenant="_system", at=10.0, backend="a",
                               state="half_open", previous="open", reason="r")  # fmt: skip
    probe = Routed(request_id="p", tenant="t", at=11.0, backend="a", attempt=1,
                   priority="normal", queue_wait=0.0, probe=True)  # fmt: skip
    old_call = Completed(request_id="old", at=12.0, backend="a", text="", usage=Usage(),
                         cost=0.0, attempt=1, **base)  # fmt: skip
    state = fold_many(ProjectionState(), [half_open, probe, old_call]).backend("a")
    assert state.ok_since_circuit == 0
    probe_done = Completed(request_id="p", at=13.0, backend="a", text="", usage=Usage(),
                           cost=0.0, attempt=1, **base)  # fmt: skip
    state = fold_many(ProjectionState(), [half_open, probe, old_call, probe_done]).backend("a")
    assert state.ok_since_circuit == 1
    assert (
        next_circuit(Circuit(state="half_open", since=10.0), state, RULES, 14.0).state == "closed"
    )


def test_a_circuit_change_from_a_binder_whose_term_ended_is_not_folded() -> None:
    """A binder that lost its lease mid-round logs a change after the new
    binder's: the log keeps the newer term's word."""
    newer = CircuitChanged(request_id="a", tenant="_system", at=130.0, backend="a",
                           state="half_open", previous="open", reason="r", term=2)  # fmt: skip
    zombie = CircuitChanged(request_id="a", tenant="_system", at=129.0, backend="a",
                            state="open", previous="closed", reason="r", term=1)  # fmt: skip
    state = fold_many(ProjectionState(), [newer, zombie]).backend("a")
    assert (state.circuit, state.circuit_term) == ("half_open", 2)


def test_a_binder_keeps_its_own_word_over_an_older_terms_and_yields_to_a_newer() -> None:
    config = parse_config(
        {
            "backends": {"a": {"base_url": "http://127.0.0.1:1", "model": "m"}},
            "routes": {"chat": {"backends": ["a"]}},
        }
    )
    circuits = Circuits(config)
    opened = state(consecutive_failures=9)
    # Term 3 opens it (its own word, not logged yet).
    moved, _ = circuits.judge("a", opened, 100.0, term=3)
    assert moved.state == "open"
    # The log still shows an older term's closed circuit from "later" (another
    # clock): this binder's word stands.
    older = state(consecutive_failures=9, circuit="closed", circuit_at=500.0, circuit_term=2)
    kept, _ = circuits.judge("a", older, 101.0, term=3)
    assert kept.state == "open"
    # A newer term logged something: its word is the log's.
    newer = state(circuit="half_open", circuit_at=50.0, circuit_term=4)
    yielded, _ = circuits.judge("a", newer, 102.0, term=3)
    assert yielded.state == "half_open"
