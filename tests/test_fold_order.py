"""A decision logged after its run's events: the fold gives the same state in either order.

A binder that may have bound a request before logs its decision (``routed``)
only once the dispatch is stored, so a fast worker's events, even the
request's end, can be stored before it. Two things used to depend on that
order: a request that ended before its call began (its deadline passed or it
was cancelled at the worker) left its late decision's quota and cost reserved
until the 6-hour sweep; and a half-open circuit's probe call whose outcome
came before its decision was never counted (the circuit waited a cool-off
for another probe). Every event here is built by the services' own
constructors (``renqueue.schema`` ``Run`` and friends, ``renqueue.policy``'s endings).
"""

from __future__ import annotations

import itertools
from typing import Final

import msgspec
import pytest

from renqueue.cli._audit import details
from renqueue.policy import (
    Circuit,
    CircuitRules,
    Limit,
    cancelled_at_worker,
    cancelled_waiting,
    expired_before_call,
    expired_running,
    expired_waiting,
    next_circuit,
    used,
)
from renqueue.schema import (
    EVENT_DECODER,
    ChatMessage,
    Event,
    Fallback,
    InferenceRequest,
    Run,
    Usage,
    circuit_changed,
    encode,
    failed,
    kind_of,
    routed,
)
from renqueue.state import (
    STALE_IN_FLIGHT,
    STATE_VERSION,
    UNROUTED_KEPT,
    UPGRADED_IN_PLACE,
    ProjectionState,
    decode_state,
    diff_states,
    encode_state,
    fold_many,
)

T = 1_800_000_000.0
PER_MINUTE = Limit(kind="requests", count=3, window=60.0)
TOKENS = Limit(kind="tokens", count=1000, window=60.0)
RULES = CircuitRules()


def request(rid: str = "r1") -> InferenceRequest:
    return InferenceRequest(
        id=rid, tenant="t", route="chat", messages=[ChatMessage(role="user", content="hi")]
    )


def decision(rid: str = "r1", *, backend: str = "free", probe: bool = False) -> Event:
    return routed(
        request(rid),
        at=T,
        backend=backend,
        attempt=1,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=600,
        probe=probe,
        estimated_cost=0.25,
    )


def run_of(rid: str = "r1", backend: str = "free") -> Run:
    return Run(request_id=rid, tenant="t", backend=backend, attempt=1, delivery=1)


#: What may differ with the order, and why it does not matter: when the fold
#: last swept (at its first event) and the latest time a backend's spend log
#: recorded (a completion folded first spends its tokens at its end, the
#: decision then takes them back: the slots hold the same counts).
ORDER_SHOWS: Final = {"last_sweep_at", "splits.last_sweep_at", "backends.free.quota.spend.newest"}


def disagree(first: ProjectionState, late: ProjectionState) -> set[str]:
    """Where the two states differ, beyond :data:`ORDER_SHOWS`."""
    return {diff.path for diff in diff_states(first, late)} - ORDER_SHOWS


RUN = run_of()
# How a run's request ends before (or while) its decision is folded, by kind.
ENDS: dict[str, list[Event]] = {
    # The worker's gate, before its call: no `started`, nothing in flight.
    "expired before its call": [expired_before_call(RUN, T + 1.0)],
    "cancelled before its call": [cancelled_at_worker(RUN, T + 1.0, "queued")],
    # During its call.
    "expired during its call": [
        RUN.started(at=T + 0.1, worker="w"),
        expired_running(RUN, T + 1.0),
    ],
    "cancelled during its call": [
        RUN.started(at=T + 0.1, worker="w"),
        cancelled_at_worker(RUN, T + 1.0, "running"),
    ],
    "failed at its run": [
        RUN.failed(at=T + 1.0, error_type="backend_fatal", reason="x", error_class="fatal")
    ],
    # Out of deliveries: dead-lettered, failed by the advisory watcher.
    "dead-lettered": [
        failed(
            "r1",
            "t",
            at=T + 1.0,
            error_type="undeliverable",
            reason="ran out of deliveries",
            backend="free",
            attempt=1,
        )
    ],
    "completed": [
        RUN.started(at=T + 0.1, worker="w"),
        RUN.completed(at=T + 1.0, text="x", usage=Usage(prompt_tokens=100), cost=0.0),
    ],
    "completed over its estimate": [
        RUN.started(at=T + 0.1, worker="w"),
        RUN.completed(at=T + 1.0, text="x", usage=Usage(prompt_tokens=900), cost=0.0),
    ],
    # A provider that reported no usage: its estimate is reconciled away all the same.
    "completed using no tokens": [
        RUN.started(at=T + 0.1, worker="w"),
        RUN.completed(at=T + 1.0, text="x", usage=Usage(), cost=0.0),
    ],
    # Run on a pool sibling that stole its dispatch, expired there before its call.
    "expired before its call on a sibling": [
        expired_before_call(run_of(backend="free-2"), T + 1.0)
    ],
}


@pytest.mark.parametrize("kind", list(ENDS))
def test_a_decision_logged_after_its_request_ended_folds_as_if_it_came_first(kind: str) -> None:
    """Regression (expired or cancelled before its call): the late decision
    reserved quota, and its cost in its tenant's `committed`, until the sweep."""
    first = fold_many(ProjectionState(), [decision(), *ENDS[kind]])
    late = fold_many(ProjectionState(), [*ENDS[kind], decision()])
    assert late.reserved == {}
    assert late.tenants["t"].committed == 0.0
    assert late.ended == {}  # the mark was consumed
    assert disagree(first, late) == set()
    assert used(late.backend("free").quota, PER_MINUTE, T + 2.0) == 1  # type: ignore[arg-type]


def test_a_router_ends_a_request_it_never_dispatched_and_leaves_no_mark() -> None:
    """Ended while waiting to be routed: no decision will come, so nothing is kept."""
    state = fold_many(
        ProjectionState(),
        [expired_waiting(request("a"), T + 1.0), cancelled_waiting(request("b"), T + 1.0)],
    )
    assert state.ended == {}


def test_the_mark_of_an_end_whose_decision_never_comes_is_swept_after_the_horizon() -> None:
    marked = fold_many(ProjectionState(), [expired_before_call(RUN, T + 1.0)])
    assert set(marked.ended) == {"t:r1"}
    assert decode_state(encode_state(marked)) == marked  # survives a checkpoint
    clock = run_of("other")  # another request's events move the log's clock
    kept = fold_many(marked, [clock.started(at=T + STALE_IN_FLIGHT - 60.0, worker="w")])
    assert set(kept.ended) == {"t:r1"}
    gone = fold_many(kept, [clock.started(at=T + 1.0 + STALE_IN_FLIGHT + 60.0, worker="w")])
    assert gone.ended == {}


def test_an_old_logs_worker_end_without_its_run_folds_as_it_did() -> None:
    """An `expired` written before it named its run decodes, and folds as it
    did then (no mark): a replay of an old log gives the state it gave."""
    raw = msgspec.json.decode(encode(expired_before_call(RUN, T + 1.0)))
    del raw["backend"], raw["attempt"]
    old = EVENT_DECODER.decode(msgspec.json.encode(raw))
    assert (old.backend, old.attempt) == (None, 0)  # type: ignore[union-attr]
    state = fold_many(ProjectionState(), [old, decision()])
    assert state.ended == {}
    assert set(state.reserved) == {"t:r1"}  # as before: released by the sweep


# ------------------------------------------------------------ a probe's late decision


HALF_OPEN = circuit_changed(
    "free", at=T - 1.0, state="half_open", previous="open", reason="cooled off"
)
PROBE = run_of("p")


def probe_outcomes() -> dict[str, list[Event]]:
    fault = {"error_type": "backend_unavailable", "error_class": "connect", "reason": "refused"}
    return {
        "completed": [
            PROBE.started(at=T + 0.1, worker="w"),
            PROBE.completed(at=T + 1.0, text="x", usage=Usage(), cost=0.0),
        ],
        "fell back": [
            PROBE.started(at=T + 0.1, worker="w"),
            PROBE.fell_back(at=T + 1.0, fallback=Fallback(), probe=True, **fault),  # type: ignore[arg-type]
        ],
        "retried then completed": [
            PROBE.started(at=T + 0.1, worker="w"),
            PROBE.retrying(at=T + 0.5, retry_after=0.1, **fault),  # type: ignore[arg-type]
            PROBE.completed(at=T + 1.0, text="x", usage=Usage(), cost=0.0),
        ],
        "failed": [PROBE.failed(at=T + 1.0, error_type="backend_fatal", reason="x")],
    }


@pytest.mark.parametrize("kind", list(probe_outcomes()))
def test_a_probe_calls_outcome_counts_when_its_decision_is_logged_after_it(kind: str) -> None:
    """Regression: the outcome came while the fold did not know the call was
    the probe, and the decision that said so came after it: never counted, the
    circuit stayed half-open until another cool-off and another probe."""
    outcome = probe_outcomes()[kind]
    first = fold_many(ProjectionState(), [HALF_OPEN, decision("p", probe=True), *outcome])
    late = fold_many(ProjectionState(), [HALF_OPEN, *outcome, decision("p", probe=True)])
    # Put back to be bound again, its reservation (until the next decision)
    # knows its call had begun only in log order: a later start of this same
    # attempt (the old dispatch run again) would spend one request more.
    put_back = {"reserved.t:p.started"} if kind == "fell back" else set()
    assert disagree(first, late) == put_back
    backend = late.backend("free")
    assert backend.ok_since_circuit + backend.faults_since_circuit > 0
    assert backend.unrouted == ()
    assert backend.probe_call == "t:p:1"
    moved = next_circuit(Circuit(state="half_open", since=T - 1.0), backend, RULES, T + 2.0)
    assert moved.state == ("closed" if kind == "completed" else "open")


def test_only_the_probes_late_outcome_counts_and_what_is_kept_is_bounded() -> None:
    others = [run_of(f"o{n}") for n in range(UNROUTED_KEPT + 2)]
    ends = [
        run.completed(at=T + 1.0 + n, text="x", usage=Usage(), cost=0.0)
        for n, run in enumerate(others)
    ]
    state = fold_many(ProjectionState(), [HALF_OPEN, *ends])
    assert [call for call, _, _ in state.backend("free").unrouted] == [
        f"t:o{n}:1" for n in range(2, UNROUTED_KEPT + 2)
    ]
    # Their decisions, not probes, count nothing and take their entries away.
    routed_late = fold_many(state, [decision(f"o{n}") for n in range(UNROUTED_KEPT + 2)])
    assert routed_late.backend("free").unrouted == ()
    assert routed_late.backend("free").ok_since_circuit == 0
    # A call whose decision was folded is not the probe: nothing kept.
    folded = fold_many(ProjectionState(), [HALF_OPEN, decision("o0"), ends[0]]).backend("free")
    assert (folded.unrouted, folded.ok_since_circuit) == ((), 0)
    # The next circuit event starts the counts afresh, these too.
    opened = circuit_changed("free", at=T + 30, state="open", previous="half_open", reason="r")
    assert fold_many(state, [opened]).backend("free").unrouted == ()
    # Outcomes in a closed circuit are not kept.
    assert fold_many(ProjectionState(), ends).backend("free").unrouted == ()


def test_stored_states_of_versions_10_to_12_load_and_are_upgraded_in_place() -> None:
    marked = fold_many(
        ProjectionState(),
        [
            HALF_OPEN,
            *probe_outcomes()["completed"],
            expired_before_call(RUN, T + 1.0),
            decision("kept"),
        ],
    )
    assert marked.backend("free").unrouted  # kept, in the stored state too
    assert decode_state(encode_state(marked)) == marked
    for version in (10, 11, 12):
        old = msgspec.json.decode(encode_state(marked))
        old["v"] = version
        del old["backends"]["free"]["unrouted"]
        old["reserved"]["t:kept"] = old["reserved"]["t:kept"][:6]  # no `decided` before 13
        if version == 10:
            del old["ended"]
        elif version == 11:  # 11's marks had no `completed`
            old["ended"]["t:r1"] = old["ended"]["t:r1"][:4]
        else:  # 12's had no `older`, `decided`
            old["ended"]["t:r1"] = old["ended"]["t:r1"][:5]
        loaded = decode_state(msgspec.json.encode(old))
        assert loaded.v == version
        assert version in UPGRADED_IN_PLACE
        assert loaded.backend("free").unrouted == ()
        assert loaded.reserved["t:kept"].decided == 0  # not counted: no mark for older ones
        if version >= 11:
            assert (loaded.ended["t:r1"].older, loaded.ended["t:r1"].decided) == (0, False)
            assert "t:r1" not in fold_many(loaded, [decision()]).ended
        if version == 11:
            assert loaded.ended["t:r1"].completed is False
            assert fold_many(loaded, [decision()]).reserved.keys() == {"t:kept"}
    assert STATE_VERSION == 13


def test_a_probes_decision_logged_after_a_later_attempts_still_counts_its_outcome() -> None:
    """Regression: a probe's `routed` folded after the request's next attempt's
    decision (or after its end at that attempt: a binder that took over logs the
    decision of a dispatch stored before it) took the early way out of the
    fold's decision (an older decision: spend only) and never named the probe
    call: its outcome, kept while its decision was not folded, was never counted."""
    fault = {"error_type": "backend_unavailable", "error_class": "connect", "reason": "refused"}
    probe = Run(request_id="p", tenant="t", backend="free", attempt=1, delivery=1)
    then = Run(request_id="p", tenant="t", backend="paid", attempt=2, delivery=1)
    probe_decision = routed(
        request("p"),
        at=T,
        backend="free",
        attempt=1,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=600,
        probe=True,
        estimated_cost=0.25,
    )
    next_decision = routed(
        request("p"),
        at=T + 1.5,
        backend="paid",
        attempt=2,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=600,
        estimated_cost=0.25,
    )
    runs: list[Event] = [
        probe.started(at=T + 0.5, worker="w"),
        probe.fell_back(at=T + 1.0, fallback=Fallback(), probe=True, **fault),  # type: ignore[arg-type]
    ]
    ends: list[Event] = [
        then.started(at=T + 2.0, worker="w"),
        then.completed(at=T + 3.0, text="x", usage=Usage(prompt_tokens=10), cost=0.0),
    ]
    first = fold_many(ProjectionState(), [HALF_OPEN, probe_decision, *runs, next_decision, *ends])
    orders = {
        "after the next decision": [HALF_OPEN, *runs, next_decision, probe_decision, *ends],
        "after the end at the next attempt": [
            HALF_OPEN,
            *runs,
            *ends,
            probe_decision,
            next_decision,
        ],
    }
    for name, events in orders.items():
        late = fold_many(ProjectionState(), events)
        backend = late.backend("free")
        assert (backend.faults_since_circuit, backend.probe_call, backend.unrouted) == (
            1,
            "t:p:1",
            (),
        ), name
        assert not {d for d in disagree(first, late) if d.startswith("backends.free")}, name


def nothing_held(state: ProjectionState) -> None:
    """No reservation, cost committed, call in flight or mark is left."""
    assert state.reserved == {}
    assert {tenant.committed for tenant in state.tenants.values()} <= {0.0}
    assert state.in_flight == {}
    assert {name: b.in_flight for name, b in state.backends.items() if b.in_flight} == {}
    assert state.ended == {}


FIRST_ATTEMPT = Run(request_id="r1", tenant="t", backend="free", attempt=1, delivery=1)
SECOND_ATTEMPT = Run(request_id="r1", tenant="t", backend="paid", attempt=2, delivery=1)


def attempt_decision(attempt: int, backend: str, at: float) -> Event:
    return routed(
        request(),
        at=at,
        backend=backend,
        attempt=attempt,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=600,
        estimated_cost=0.25,
    )


@pytest.mark.parametrize(
    "order",
    [
        "newer decision first",
        "newer decision after the end",
        "older decision between the end and the newer one",
    ],
)
def test_an_older_attempts_decision_logged_after_the_request_ended_at_a_newer_one_reserves_nothing(
    order: str,
) -> None:
    """Regression: the request fell back from attempt 1 and completed at
    attempt 2, and attempt 1's decision (a binder that took over logs the
    decision of a dispatch stored before it) was folded after all that: with
    nothing left of the request, it reserved its quota and committed its cost
    until the 6-hour sweep."""
    fault = {"error_type": "backend_unavailable", "error_class": "connect", "reason": "refused"}
    older, newer = attempt_decision(1, "free", T), attempt_decision(2, "paid", T + 1.5)
    runs: list[Event] = [
        FIRST_ATTEMPT.started(at=T + 0.5, worker="w"),
        FIRST_ATTEMPT.fell_back(at=T + 1.0, fallback=Fallback(), **fault),  # type: ignore[arg-type]
    ]
    end: list[Event] = [
        SECOND_ATTEMPT.started(at=T + 2.0, worker="w"),
        SECOND_ATTEMPT.completed(at=T + 3.0, text="x", usage=Usage(prompt_tokens=10), cost=0.0),
    ]
    first = fold_many(ProjectionState(), [older, *runs, newer, *end])
    nothing_held(first)
    orders = {
        "newer decision first": [*runs, newer, *end, older],
        "newer decision after the end": [*runs, *end, newer, older],
        "older decision between the end and the newer one": [*runs, *end, older, newer],
    }
    late = fold_many(ProjectionState(), orders[order])
    nothing_held(late)
    # Each decision spent its request on its backend, in either order.
    assert used(late.backend("free").quota, PER_MINUTE, T + 4.0) == 1  # type: ignore[arg-type]
    assert used(late.backend("paid").quota, PER_MINUTE, T + 4.0) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("taken_over_start", ["none", "before the end", "after the end"])
def test_a_stolen_runs_completion_before_its_decision_leaves_nothing_in_flight(
    taken_over_start: str,
) -> None:
    """A pool sibling (``free-2``) ran the dispatch bound to ``free`` and
    completed it before the decision was folded; the run it took over (on
    ``free``) may have logged its start too, even after the completion (its
    worker's publish stored late). Regression (after the end): that start put
    the request in flight on ``free`` after its end, for good (until the sweep)."""
    stolen_run = run_of(backend="free-2")
    taken_over = RUN.started(at=T + 0.1, worker="w")
    ran: list[Event] = [
        stolen_run.started(at=T + 0.2, worker="w2"),
        stolen_run.completed(at=T + 1.0, text="x", usage=Usage(prompt_tokens=100), cost=0.0),
    ]
    events = {
        "none": ran,
        "before the end": [taken_over, *ran],
        "after the end": [*ran, taken_over],
    }[taken_over_start]
    late = fold_many(ProjectionState(), [*events, decision()])
    nothing_held(late)
    assert late.backend("free-2").calls_completed == 1


def test_the_audit_names_a_workers_run_on_its_end_and_no_attempt_on_a_routers() -> None:
    """The run's fields an `expired`/`cancelled` carries read in `renqueue audit`
    where a worker ended it; a router's end (no run: `null`/0) shows no
    `attempt=0`, which named no attempt the request ever had."""

    def shown(event: Event) -> str:
        return details(kind_of(event), msgspec.json.decode(encode(event)))

    at_worker = shown(expired_before_call(RUN, T + 1.0))
    assert "backend=free" in at_worker
    assert "attempt=1" in at_worker
    for waiting in (expired_waiting(request(), T + 1.0), cancelled_waiting(request(), T + 1.0)):
        assert "attempt" not in shown(waiting)
        assert "backend" not in shown(waiting)


@pytest.mark.parametrize("kind", list(ENDS))
def test_an_arms_request_whose_decision_is_logged_after_its_end_is_counted_on_its_arm(
    kind: str,
) -> None:
    """Regression (a strict xfail before): the A/B part of the fold counted a
    request's end on its arm only if its decision came first; an end before it
    was not counted, and the late decision held an arm entry until the splits'
    sweep. The end is now kept until the decision, which counts both."""
    on_arm = msgspec.structs.replace(request(), split="chat", route="canary")
    arm_decision = routed(
        on_arm,
        at=T,
        backend="free",
        attempt=1,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=600,
        estimated_cost=0.25,
    )
    first = fold_many(ProjectionState(), [arm_decision, *ENDS[kind]])
    late = fold_many(ProjectionState(), [*ENDS[kind], arm_decision])
    assert late.splits.requests == {}
    assert {path for path in disagree(first, late) if path.startswith("splits")} == set()


def test_a_newer_decision_logged_after_an_end_its_older_arm_counted_counts_nothing_more() -> None:
    """Attempt 1 was routed on an arm, put back, and expired at attempt 2
    before attempt 2's decision was folded: the arm (attempt 1's) counted the
    end. Regression: attempt 2's late decision counted the request a second
    time and held an arm entry until the splits' sweep."""
    fault = {"error_type": "backend_unavailable", "error_class": "connect", "reason": "refused"}
    on_arm = msgspec.structs.replace(request(), split="chat", route="canary")
    decisions = [
        routed(
            on_arm,
            at=T + 2.0 * (attempt - 1),
            backend="free",
            attempt=attempt,
            priority="normal",
            queue_wait=0.0,
            reserved_tokens=600,
            estimated_cost=0.25,
        )
        for attempt in (1, 2)
    ]
    then = Run(request_id="r1", tenant="t", backend="free", attempt=2, delivery=1)
    put_back: list[Event] = [
        RUN.started(at=T + 0.5, worker="w"),
        RUN.retrying(at=T + 1.0, retry_after=0.1, requeued=True, **fault),  # type: ignore[arg-type]
    ]
    end = expired_before_call(then, T + 3.0)
    first = fold_many(ProjectionState(), [decisions[0], *put_back, decisions[1], end])
    late = fold_many(ProjectionState(), [decisions[0], *put_back, end, decisions[1]])
    assert late.splits.requests == {}
    assert late.splits.ended == {}
    assert {path for path in disagree(first, late) if path.startswith("splits")} == set()
    nothing_held(late)


def arm_attempt_decision(attempt: int, at: float) -> Event:
    """Attempt ``attempt``'s decision of a request on arm ``canary`` of split ``chat``."""
    on_arm = msgspec.structs.replace(request(), split="chat", route="canary")
    return routed(
        on_arm,
        at=at,
        backend="free",
        attempt=attempt,
        priority="normal",
        queue_wait=0.0,
        reserved_tokens=600,
        estimated_cost=0.25,
    )


@pytest.mark.parametrize(
    "order", ["end, older, newer", "end, newer, older", "newer, end, older", "older, end, newer"]
)
def test_an_arms_request_whose_two_decisions_are_folded_around_its_end_counts_once(
    order: str,
) -> None:
    """Attempt 1 put back, attempt 2 completed, on the same arm: in order the
    arm counts one request and one completion. Regression: with the end folded
    before both decisions, the first to come (even the older one) took the end
    kept for the decision, and the other counted the request a second time and
    held an arm entry until the splits' 6-hour sweep; an older decision folded
    after the end its newer one counted did the same."""
    fault = {"error_type": "backend_unavailable", "error_class": "connect", "reason": "refused"}
    older, newer = arm_attempt_decision(1, T), arm_attempt_decision(2, T + 1.5)
    then = Run(request_id="r1", tenant="t", backend="free", attempt=2, delivery=1)
    put_back: list[Event] = [
        RUN.started(at=T + 0.5, worker="w"),
        RUN.retrying(at=T + 1.0, retry_after=0.1, requeued=True, **fault),  # type: ignore[arg-type]
    ]
    end: list[Event] = [
        then.started(at=T + 2.0, worker="w"),
        then.completed(at=T + 3.0, text="x", usage=Usage(prompt_tokens=10), cost=0.0),
    ]
    first = fold_many(ProjectionState(), [older, *put_back, newer, *end])
    late = fold_many(
        ProjectionState(),
        {
            "end, older, newer": [*put_back, *end, older, newer],
            "end, newer, older": [*put_back, *end, newer, older],
            "newer, end, older": [*put_back, newer, *end, older],
            "older, end, newer": [older, *put_back, *end, newer],
        }[order],
    )
    assert (late.splits.requests, late.splits.ended) == ({}, {})
    nothing_held(late)
    arm = late.splits.routes["chat"].arms["canary"].total
    assert (arm.requests, arm.completed) == (1, 1)
    differ = {path for path in disagree(first, late) if path.startswith("splits")}
    if order.index("newer") < order.index("older"):
        # An older decision folded after a newer one (with or without the end
        # between) times the arm's wait from the newer one's: as before 13.
        differ = {path for path in differ if "latency" not in path}
    assert differ == set()


def test_marks_for_older_decisions_that_never_come_are_swept_after_the_horizon() -> None:
    """A request whose first decision was its attempt 2 (a coalesced follower
    put back runs as attempt 2; attempt 1 was never decided), ended on an arm
    with that decision folded after its end: the fold's mark waits for an
    attempt 1 decision that never comes, and the splits keep the end for it.
    Both are swept at the horizon (6 hours of event time), not kept for good."""
    then = Run(request_id="r1", tenant="t", backend="free", attempt=2, delivery=1)
    ended = fold_many(
        ProjectionState(),
        [
            then.started(at=T + 2.0, worker="w"),
            then.completed(at=T + 3.0, text="x", usage=Usage(prompt_tokens=10), cost=0.0),
            arm_attempt_decision(2, T + 1.5),
        ],
    )
    assert set(ended.ended) == {"t:r1"}  # an attempt 1 decision may still come
    assert ended.splits.routes["chat"].arms["canary"].total.completed == 1
    assert decode_state(encode_state(ended)) == ended  # survives a checkpoint
    clock = run_of("other")  # another request's events move the log's clock
    kept = fold_many(ended, [clock.started(at=T + STALE_IN_FLIGHT - 60.0, worker="w")])
    assert set(kept.ended) == {"t:r1"}
    gone = fold_many(kept, [clock.started(at=T + 3.0 + STALE_IN_FLIGHT + 60.0, worker="w")])
    assert (gone.ended, gone.splits.ended, gone.splits.requests) == ({}, {}, {})


@pytest.mark.parametrize("on_arm", [False, True], ids=["no split", "on an arm"])
def test_every_interleaving_of_three_attempts_decisions_folds_as_in_order(on_arm: bool) -> None:
    """Attempts 1 and 2 put back, attempt 3 completed; each decision folded
    anywhere among the runs' events, in any order of the three (2,058 logs):
    each folds to the state of the log in order, and nothing is left held or
    kept. Only the arm's wait may differ, when an older decision is folded
    after a newer one (as before 13). Regression (on an arm): 546 of them
    counted the request twice or held an arm entry until the splits' sweep."""
    fault = {"error_type": "backend_unavailable", "error_class": "connect", "reason": "refused"}
    attempts = 3
    runs: list[list[Event]] = []
    for attempt in range(1, attempts + 1):
        run = Run(request_id="r1", tenant="t", backend="free", attempt=attempt, delivery=1)
        runs.append(
            [
                run.started(at=T + attempt, worker="w"),
                run.completed(at=T + attempt + 0.5, text="x", usage=Usage(), cost=0.0)
                if attempt == attempts
                else run.retrying(at=T + attempt + 0.5, retry_after=0.1, requeued=True, **fault),  # type: ignore[arg-type]
            ]
        )
    decisions = [
        arm_attempt_decision(attempt, T + attempt - 0.1)
        if on_arm
        else attempt_decision(attempt, "free", T + attempt - 0.1)
        for attempt in range(1, attempts + 1)
    ]
    first = fold_many(
        ProjectionState(),
        [event for pair in zip(decisions, runs, strict=True) for event in (pair[0], *pair[1])],
    )
    events = [event for run in runs for event in run]
    differ: set[str] = set()
    for slots in itertools.product(range(len(events) + 1), repeat=attempts):
        for order in itertools.permutations(decisions):
            log: list[Event] = []
            for at in range(len(events) + 1):
                log += [decision for slot, decision in zip(slots, order, strict=True) if slot == at]
                log += events[at : at + 1]
            late = fold_many(ProjectionState(), log)
            nothing_held(late)
            assert (late.splits.requests, late.splits.ended) == ({}, {})
            differ |= {path for path in disagree(first, late) if "latency" not in path}
    assert differ == set()
