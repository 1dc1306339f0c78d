"""The quota folded from the log (issue #8 item 1): a pure fold of service events.

Each backend's quota is rebuilt from events alone, in event time: decisions
spend, calls reconcile, 429s pause, what providers report is learned, and
folding the same events again gives the same state.
"""

from __future__ import annotations

import msgspec

from renqueue.policy import Cost, Limit, check, used
from renqueue.schema import (
    Cancelled,
    Completed,
    Event,
    Expired,
    Failed,
    Preempted,
    ReportedLimit,
    Retrying,
    Routed,
    Started,
    Usage,
)
from renqueue.state import (
    STALE_IN_FLIGHT,
    STATE_VERSION,
    UPGRADED_IN_PLACE,
    ProjectionState,
    decode_state,
    encode_state,
    fold_many,
)

T = 1_800_000_000.0
PER_MINUTE = Limit(kind="requests", count=3, window=60.0)
TOKENS = Limit(kind="tokens", count=1000, window=60.0)


def routed(rid: str, at: float, tokens: int = 0, backend: str = "free") -> Routed:
    return Routed(
        request_id=rid,
        tenant="t",
        at=at,
        backend=backend,
        attempt=1,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=tokens,
    )


def started(rid: str, at: float, backend: str = "free", delivery: int = 1) -> Started:
    return Started(
        request_id=rid, tenant="t", at=at, backend=backend, attempt=1, delivery=delivery, worker="w"
    )


def completed(rid: str, at: float, used_tokens: int, **fields: object) -> Completed:
    return Completed(
        request_id=rid,
        tenant="t",
        at=at,
        backend="free",
        attempt=1,
        delivery=1,
        text="x",
        usage=Usage(prompt_tokens=used_tokens, completion_tokens=0),
        cost=0.0,
        **fields,  # type: ignore[arg-type]
    )


def rate_limited(reason: str, retry_after: float, **fields: object) -> Retrying:
    return Retrying(
        request_id="r1",
        tenant="t",
        at=T,
        backend="free",
        attempt=1,
        delivery=1,
        error_type="rate_limited",
        reason=reason,
        retry_after=retry_after,
        **fields,  # type: ignore[arg-type]
    )


def quota_of(state: ProjectionState, backend: str = "free"):  # type: ignore[no-untyped-def]
    quota = state.backend(backend).quota
    assert quota is not None
    return quota


def test_decisions_spend_and_a_full_window_says_so() -> None:
    state = fold_many(ProjectionState(), [routed(f"r{n}", T + n) for n in range(3)])
    quota = quota_of(state)
    assert used(quota, PER_MINUTE, T + 3) == 3
    verdict = check(quota, [PER_MINUTE], Cost(requests=1), T + 3)
    assert not verdict.ok
    assert verdict.reason.startswith("quota:requests/min 3/3, resets in")
    # The first decision leaves the window a minute after it was made.
    assert check(quota, [PER_MINUTE], Cost(requests=1), verdict.until).ok
    assert verdict.until >= T + 60


def test_a_retry_spends_another_request_and_a_reservation_is_reconciled() -> None:
    events = [
        routed("r1", T, tokens=600),
        started("r1", T + 0.1),
        started("r1", T + 1.0, delivery=2),  # the provider sees a second call
        completed("r1", T + 2.0, used_tokens=100, reserved_tokens=600),
    ]
    quota = quota_of(fold_many(ProjectionState(), events))
    assert used(quota, PER_MINUTE, T + 2.0) == 2
    assert used(quota, TOKENS, T + 2.0) == 100  # 600 reserved, 100 used: 500 refunded
    over = fold_many(
        ProjectionState(), [*events[:3], completed("r1", T + 2.0, 900, reserved_tokens=600)]
    )
    assert used(quota_of(over), TOKENS, T + 2.0) == 900


def test_a_run_elsewhere_than_its_decision_spends_where_it_ran() -> None:
    events = [routed("r1", T, backend="a"), started("r1", T + 0.1, backend="b")]
    state = fold_many(ProjectionState(), events)
    assert used(quota_of(state, "a"), PER_MINUTE, T + 1) == 1
    assert used(quota_of(state, "b"), PER_MINUTE, T + 1) == 1


def test_a_429_pauses_and_what_the_provider_reports_is_learned() -> None:
    retry = rate_limited(
        "429",
        7.0,
        limits=(
            ReportedLimit(
                kind="requests", window=86_400.0, limit=1000, remaining=0, reset_at=T + 50
            ),
        ),
    )
    quota = quota_of(fold_many(ProjectionState(), [retry]))
    assert quota.cooldown_until == T + 7.0
    blocked = check(quota, [], Cost(requests=1), T + 1)
    assert not blocked.ok
    assert blocked.until == T + 50  # the reported window holds longer than the cooldown
    assert check(quota, [], Cost(requests=1), T + 50).ok


def test_a_spent_daily_quota_takes_the_backend_out_until_it_comes_back() -> None:
    retry = rate_limited(
        "insufficient_quota",
        30.0,
        quota_exhausted_until=T + 3600,
    )
    quota = quota_of(fold_many(ProjectionState(), [retry]))
    verdict = check(quota, [], Cost(requests=1), T + 60)
    assert not verdict.ok
    assert verdict.until == T + 3600
    assert "exhausted" in verdict.reason


def test_the_fold_is_pure_and_repeatable() -> None:
    events = [
        routed("r1", T, 200),
        started("r1", T + 1),
        completed("r1", T + 2, 50, reserved_tokens=200),
    ]
    first = fold_many(ProjectionState(), events)
    again = fold_many(ProjectionState(), events)
    assert first == again
    assert first.reserved == {}  # ended: its reservation is reconciled and gone


def preempted(rid: str, at: float, backend: str = "free") -> Preempted:
    return Preempted(
        request_id=rid, tenant="t", at=at, backend=backend, attempt=1, delivery=1, by="urgent"
    )


def test_a_request_put_back_and_bound_elsewhere_spends_one_request_per_call() -> None:
    """After a put-back (a spent quota, or a preemption) the next decision's
    first call is the one it reserved: before, the request still counted as in
    flight on its old backend, so that call was charged twice on the new one."""
    spent = rate_limited("quota exhausted", 60.0, requeued=True)
    for put_back in (spent, preempted("r1", T + 0.5)):
        events = [
            routed("r1", T, backend="free"),
            started("r1", T + 0.1, backend="free"),
            put_back,
            msgspec.structs.replace(routed("r1", T + 1.0, backend="paid"), attempt=2),
            started("r1", T + 1.1, backend="paid"),
        ]
        state = fold_many(ProjectionState(), events)
        assert used(quota_of(state, "paid"), PER_MINUTE, T + 2) == 1, put_back
        assert used(quota_of(state, "free"), PER_MINUTE, T + 2) == 1, put_back
        assert state.backend("free").in_flight == 0, put_back
        assert state.backend("paid").in_flight == 1, put_back
        assert state.in_flight_count == 1, put_back


def test_a_put_back_request_leaves_its_backend_at_once() -> None:
    state = fold_many(
        ProjectionState(),
        [routed("r1", T), started("r1", T + 0.1), preempted("r1", T + 0.5)],
    )
    assert state.backend("free").in_flight == 0
    assert state.in_flight_count == 0


def test_a_start_logged_before_its_decision_is_its_reserved_call_and_a_retry_still_spends() -> None:
    """A binder logs a decision only after its dispatch was stored when the
    request may have been bound before (every request waiting at a take-over),
    so the worker's ``started`` can precede ``routed``: that call is the one
    reserved, and a retry after it is another call (before: the retry was the
    'reserved call' and went uncharged, so a strict provider could see more
    than the limit)."""
    events = [
        started("r1", T + 0.1),
        routed("r1", T + 0.2),
        started("r1", T + 1.0, delivery=2),
        started("r1", T + 2.0, delivery=3),
    ]
    assert used(quota_of(fold_many(ProjectionState(), events)), PER_MINUTE, T + 3) == 3


def test_a_request_bound_again_after_a_put_back_spends_once_per_call_in_any_order() -> None:
    spent = rate_limited("quota exhausted", 60.0, requeued=True)
    second = msgspec.structs.replace(routed("r1", T + 1.0, backend="paid"), attempt=2)
    start = msgspec.structs.replace(started("r1", T + 1.1, backend="paid"), attempt=2)
    retry = msgspec.structs.replace(started("r1", T + 1.5, backend="paid", delivery=2), attempt=2)
    head = [routed("r1", T, backend="free"), started("r1", T + 0.1, backend="free"), spent]
    for tail in ([second, start, retry], [start, second, retry]):
        state = fold_many(ProjectionState(), [*head, *tail])
        assert used(quota_of(state, "paid"), PER_MINUTE, T + 2) == 2, tail
        assert used(quota_of(state, "free"), PER_MINUTE, T + 2) == 1, tail


def test_a_put_back_for_a_spent_quota_marks_the_backend_exhausted_for_its_hold() -> None:
    """OpenAI's insufficient_quota names no reset: the worker logs its hold as
    retry_after, and the fold marks the backend exhausted (not merely cooling
    down) until then, so status and routing reasons say so."""
    state = fold_many(
        ProjectionState(),
        [routed("r1", T), started("r1", T), rate_limited("quota spent", 600.0, requeued=True)],
    )
    quota = quota_of(state)
    assert quota.exhausted_until == T + 600.0


# A binder that may have bound a request before logs its decision only once the
# dispatch is stored, so a fast worker's run, and even its end, can be stored
# before that `routed` (tests/test_restarts.py saw "submitted, started,
# completed, routed"). The fold must give the same state in either order.
COSTLY = msgspec.structs.replace(routed("r1", T, tokens=600), estimated_cost=0.25)


def _ends() -> list[tuple[str, list[Event]]]:
    run = started("r1", T + 0.1)
    return [
        ("completed under", [run, completed("r1", T + 2.0, used_tokens=100)]),
        ("completed over", [run, completed("r1", T + 2.0, used_tokens=900)]),
        (
            "failed",
            [
                run,
                Failed(
                    request_id="r1",
                    tenant="t",
                    at=T + 2.0,
                    error_type="backend_fatal",
                    reason="x",
                    backend="free",
                    attempt=1,
                ),
            ],
        ),
        ("expired", [run, Expired(request_id="r1", tenant="t", at=T + 2.0, stage="running")]),
        ("cancelled", [run, Cancelled(request_id="r1", tenant="t", at=T + 2.0, stage="running")]),
    ]


def _same_spend(first: ProjectionState, second: ProjectionState, label: str) -> None:
    for now in (T + 2.0, T + 30.0, T + 61.0, T + 62.5):
        for limit in (PER_MINUTE, TOKENS):
            assert used(quota_of(first), limit, now) == used(quota_of(second), limit, now), (
                label,
                limit,
                now,
            )


def test_a_decision_logged_after_its_request_ended_reserves_nothing() -> None:
    """Regression: the late `routed` made a reservation for a request that was
    over: its tenant's `committed` kept the estimate and the backend's quota
    the token estimate besides the tokens used, until the 6-hour sweep."""
    for label, (run, end) in _ends():
        first = fold_many(ProjectionState(), [COSTLY, run, end])
        late = fold_many(ProjectionState(), [run, end, COSTLY])
        for state in (first, late):
            assert state.reserved == {}, label
            assert state.tenants["t"].committed == 0.0, label
            assert state.in_flight_count == 0, label
        _same_spend(first, late, label)
        # One request for the call, whichever order.
        assert used(quota_of(late), PER_MINUTE, T + 3) == 1, label
        assert late.ended == {}, label  # consumed by its decision


def test_tokens_used_are_counted_once_when_the_decision_comes_last() -> None:
    late = fold_many(
        ProjectionState(),
        [started("r1", T + 0.1), completed("r1", T + 2.0, used_tokens=100), COSTLY],
    )
    assert used(quota_of(late), TOKENS, T + 3) == 100  # not 600 + 100


def test_a_late_decision_of_a_request_run_again_elsewhere_is_folded_in_any_order() -> None:
    """Put back (fell back, preempted) and bound again: the second decision
    may land after the run it dispatched ended, and the first one's too."""
    first = routed("r1", T, tokens=300)
    second = msgspec.structs.replace(
        routed("r1", T + 1.0, tokens=600), attempt=2, estimated_cost=0.5
    )
    run2 = msgspec.structs.replace(started("r1", T + 1.1), attempt=2)
    end2 = msgspec.structs.replace(completed("r1", T + 2.0, used_tokens=100), attempt=2)
    head = [first, started("r1", T + 0.1), preempted("r1", T + 0.5)]
    ordered = fold_many(ProjectionState(), [*head, second, run2, end2])
    for tail in ([run2, end2, second], [run2, second, end2]):
        state = fold_many(ProjectionState(), [*head, *tail])
        assert state.reserved == {}, tail
        assert state.ended == {}, tail
        assert state.tenants["t"].committed == 0.0, tail
        _same_spend(ordered, state, str(tail))
    # The first decision landing after the second: the newer one's reservation stands.
    both = fold_many(
        ProjectionState(), [started("r1", T + 0.1), preempted("r1", T + 0.5), second, first]
    )
    assert both.reserved["t:r1"].attempt == 2
    assert both.tenants["t"].committed == 0.5


def test_a_coalesced_followers_end_and_a_request_that_never_ran_leave_no_mark() -> None:
    follower = completed("r1", T + 2.0, used_tokens=100, shared_with="lead")
    waited = Expired(request_id="r2", tenant="t", at=T + 2.0, stage="queued")
    state = fold_many(ProjectionState(), [follower, waited])
    assert state.ended == {}


def test_an_end_whose_decision_never_comes_is_swept_and_survives_a_checkpoint() -> None:
    state = fold_many(
        ProjectionState(), [started("r1", T + 0.1), completed("r1", T + 2.0, used_tokens=100)]
    )
    assert set(state.ended) == {"t:r1"}
    assert decode_state(encode_state(state)) == state
    # Resumed from the checkpoint, the late decision is consumed as live.
    resumed = fold_many(decode_state(encode_state(state)), [COSTLY])
    assert resumed == fold_many(state, [COSTLY])
    assert resumed.reserved == {}
    assert resumed.ended == {}
    later = fold_many(state, [started("r9", T + STALE_IN_FLIGHT + 120)])
    assert later.ended == {}


def test_a_stored_state_of_version_10_loads_and_is_upgraded_in_place() -> None:
    stored = encode_state(fold_many(ProjectionState(), [COSTLY, started("r1", T + 0.1)]))
    old = msgspec.json.decode(stored)
    del old["ended"]
    old["v"] = 10
    state = decode_state(msgspec.json.encode(old))
    assert state.v == 10
    assert state.ended == {}
    assert 10 in UPGRADED_IN_PLACE
    assert STATE_VERSION >= 11
    assert state.reserved["t:r1"].started
