"""A/B splits as pure functions (issue #10 item 5): assignment, the figures, the
rollback rule, the fold of their events, and the config that declares them.

Table tests for the rules' edges, property tests (hypothesis) for what must
hold over any keys and weights: the same key keeps its arm, shares converge to
the weights, a tenant cannot move another tenant's users, a percentile read
from the histogram is within 9 % of the true one.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.config import parse_config
from renqueue.coordination import decode_split_view, render_splits
from renqueue.errors import ConfigError, MalformedRequestError
from renqueue.policy import (
    AB_BUCKET,
    AB_HORIZON,
    ArmStats,
    ArmTally,
    RollbackRules,
    SplitPolicy,
    SplitStatus,
    Tally,
    assign,
    breach,
    judge,
    key_value,
    moved_to,
    percentile,
    place,
    record,
    validate,
    windowed,
)
from renqueue.policy._ab import bin_of, bin_value, hash_point, pick
from renqueue.schema import (
    SYSTEM_TENANT,
    Cancelled,
    ChatMessage,
    Completed,
    Event,
    Expired,
    Failed,
    InferenceRequest,
    Routed,
    SplitChanged,
    Usage,
)
from renqueue.state import STATE_VERSION, ProjectionState, decode_state, encode_state, fold_many

SPLIT = SplitPolicy(route="chat", arms=(("chat", 90.0), ("canary", 10.0)), control="chat")


def request(
    rid: str = "r1", *, tenant: str = "acme", user: str | None = None, **extra: Any
) -> InferenceRequest:
    return InferenceRequest(
        id=rid,
        tenant=tenant,
        route="chat",
        messages=[ChatMessage(role="user", content="hi")],
        metadata={} if user is None else {"user": user},
        **extra,
    )


# ----------------------------------------------------------------- assignment


@pytest.mark.parametrize(
    ("key", "req", "value"),
    [
        pytest.param("tenant", request(user="u1"), "acme", id="tenant"),
        pytest.param("metadata.user", request(user="u1"), "u1", id="a metadata field"),
        pytest.param("metadata.user", request("r9"), "r9", id="no such field: its id (not sticky)"),
        pytest.param("metadata.session", request("r9", user="u1"), "r9", id="another field"),
    ],
)
def test_the_sticky_key_is_the_tenant_or_a_metadata_field_else_the_request_id(
    key: str, req: InferenceRequest, value: str
) -> None:
    assert key_value(req, key) == value


def test_the_hash_is_the_same_in_every_process_whatever_pythons_hash_seed() -> None:
    code = (
        "from renqueue.policy._ab import hash_point;"
        "print(repr(hash_point('chat', 'acme', '', 'u1')))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert seen == {repr(hash_point("chat", "acme", "", "u1"))}
    assert 0 <= hash_point("chat", "acme", "", "u1") < 1


@pytest.mark.parametrize(
    ("arms", "point", "arm"),
    [
        ((("a", 1.0), ("b", 1.0)), 0.0, "a"),
        ((("a", 1.0), ("b", 1.0)), 0.4999, "a"),
        ((("a", 1.0), ("b", 1.0)), 0.5, "b"),
        ((("a", 1.0), ("b", 1.0)), 0.999999, "b"),
        ((("a", 0.0), ("b", 3.0)), 0.0, "b"),
        ((("a", 3.0), ("b", 0.0)), 0.999999, "a"),
        ((("a", 90.0), ("b", 10.0)), 0.9, "b"),
        ((("a", 1.0), ("b", 0.0), ("c", 1.0)), 0.75, "c"),
    ],
)
def test_an_arm_owns_its_share_of_the_unit_interval_in_config_order(
    arms: tuple[tuple[str, float], ...], point: float, arm: str
) -> None:
    assert pick(arms, point) == arm


keys = st.text(min_size=1, max_size=20)
weights = st.lists(st.integers(min_value=0, max_value=10), min_size=2, max_size=4).filter(
    lambda ws: sum(ws) > 0
)


@given(user=keys, ids=st.lists(st.text("abc123", min_size=1, max_size=8), min_size=2, max_size=5))
def test_the_same_key_always_gets_the_same_arm(user: str, ids: list[str]) -> None:
    arms = {assign(SPLIT, request(rid, user=user)) for rid in ids}
    split = msgspec.structs.replace(SPLIT, key="metadata.user")
    assert len({assign(split, request(rid, user=user)) for rid in ids}) == 1
    # Keyed by tenant, every request of the tenant is on one arm.
    assert len(arms) == 1


@settings(max_examples=30, deadline=None)
@given(ws=weights)
def test_shares_converge_to_the_weights(ws: list[int]) -> None:
    arms = tuple((f"arm{n}", float(w)) for n, w in enumerate(ws))
    split = SplitPolicy(route="chat", arms=arms, control="arm0", key="metadata.user")
    n = 4000
    counts = Counter(assign(split, request(user=f"user-{i}")) for i in range(n))
    total = sum(ws)
    for name, weight in arms:
        # 5 standard deviations of a share over n draws (<= 0.04).
        assert abs(counts[name] / n - weight / total) <= 5 * math.sqrt(0.25 / n), counts
        if weight == 0:
            assert counts[name] == 0


@settings(max_examples=20, deadline=None)
@given(first=st.integers(1, 10), more=st.integers(1, 10))
def test_raising_the_last_arms_weight_only_moves_keys_into_it(first: int, more: int) -> None:
    before = SplitPolicy(
        route="chat", arms=(("a", 10.0), ("b", float(first))), control="a", key="metadata.user"
    )
    after = msgspec.structs.replace(before, arms=(("a", 10.0), ("b", float(first + more))))
    for i in range(500):
        req = request(user=f"u{i}")
        if assign(before, req) == "b":
            assert assign(after, req) == "b"


def test_a_user_id_lands_independently_in_each_tenant() -> None:
    split = SplitPolicy(
        route="chat", arms=(("a", 1.0), ("b", 1.0)), control="a", key="metadata.user"
    )
    users = [f"user-{i}" for i in range(2000)]
    same = sum(
        assign(split, request(tenant="acme", user=u))
        == assign(split, request(tenant="evil", user=u))
        for u in users
    )
    # Independent: about half agree (not all of them, as a hash of the user alone would).
    assert 0.4 < same / len(users) < 0.6


def test_the_salt_reshuffles_who_lands_where() -> None:
    split = msgspec.structs.replace(SPLIT, arms=(("chat", 1.0), ("canary", 1.0)))
    salted = msgspec.structs.replace(split, salt="round-2")
    users = [request(user=f"u{i}", tenant=f"t{i}") for i in range(1000)]
    moved = sum(assign(split, r) != assign(salted, r) for r in users)
    assert 0.4 < moved / len(users) < 0.6


@pytest.mark.parametrize(
    ("status", "current", "serving", "arm"),
    [
        pytest.param(None, None, {"chat", "canary"}, "HASH", id="live: its own arm"),
        pytest.param(SplitStatus(), "canary", {"chat", "canary"}, "canary", id="put back: kept"),
        pytest.param(
            SplitStatus(state="rolled_back", arm="chat"),
            "canary",
            {"chat", "canary"},
            "chat",
            id="rolled back: the control",
        ),
        pytest.param(
            SplitStatus(state="promoted", arm="canary"),
            None,
            {"chat", "canary"},
            "canary",
            id="promoted: that arm",
        ),
        pytest.param(
            SplitStatus(state="rolled_back", arm="gone"),
            None,
            {"chat", "canary"},
            "chat",
            id="moved to an arm no longer configured: the control",
        ),
        pytest.param(
            SplitStatus(state="promoted", arm="canary"),
            None,
            {"chat"},
            "chat",
            id="an arm that cannot serve it: the control",
        ),
        pytest.param(None, None, set(), None, id="neither can: the route it named"),
    ],
)
def test_where_a_request_is_placed(
    status: SplitStatus | None, current: str | None, serving: set[str], arm: str | None
) -> None:
    split = msgspec.structs.replace(SPLIT, arms=(("chat", 1.0), ("canary", 1.0)))
    req = request(user="u1")
    expected = assign(split, req) if arm == "HASH" else arm
    assert place(split, status, req, lambda route: route in serving, current=current) == expected


def test_a_live_split_moves_nothing() -> None:
    assert moved_to(SPLIT, None) is None
    assert moved_to(SPLIT, SplitStatus(state="live")) is None
    assert moved_to(SPLIT, SplitStatus(state="rolled_back", arm="chat")) == "chat"


# ------------------------------------------------------------------ figures


@given(
    values=st.lists(
        st.floats(min_value=0.01, max_value=5000, allow_nan=False), min_size=1, max_size=200
    ),
    q=st.sampled_from([50, 90, 95, 99]),
)
def test_a_percentile_from_the_histogram_is_within_9_percent(values: list[float], q: int) -> None:
    counts = Counter(bin_of(v) for v in values)
    histogram = tuple(sorted(counts.items()))
    exact = sorted(values)[max(1, math.ceil(q / 100 * len(values))) - 1]
    estimate = percentile(histogram, q)
    assert estimate is not None
    assert 2 ** (-1 / 8) - 1e-9 <= estimate / exact <= 2 ** (1 / 8) + 1e-9


@pytest.mark.parametrize(
    ("seconds", "index"),
    [(0.0, 0), (0.009, 0), (math.nan, 0), (0.01, 1), (0.02, 5), (math.inf, 80), (1e9, 80)],
)
def test_histogram_bins(seconds: float, index: int) -> None:
    assert bin_of(seconds) == index
    assert bin_value(index) > 0


def test_buckets_keep_the_horizon_and_a_late_event_goes_in_order() -> None:
    stats = ArmStats()
    for at in range(0, 2 * AB_HORIZON, 5):
        stats = record(stats, 1000.0 + at, Tally(completed=1))
    assert stats.total.completed == 2 * AB_HORIZON // 5
    assert len(stats.recent) == AB_HORIZON // AB_BUCKET
    newest = stats.recent[-1][0]
    late = record(stats, newest - 30.0, Tally(failed=1))
    assert [start for start, _ in late.recent] == sorted(start for start, _ in late.recent)
    assert late.total.failed == 1
    # Older than the horizon: counted in the total only.
    ancient = record(stats, newest - 2 * AB_HORIZON, Tally(failed=1))
    assert ancient.recent == stats.recent
    assert ancient.total.failed == 1


deltas = st.builds(
    Tally,
    requests=st.integers(0, 2),
    completed=st.integers(0, 2),
    failed=st.integers(0, 2),
    cost=st.sampled_from([0.0, 0.1, 0.25]),
    latency=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 3)), max_size=2).map(
        lambda pairs: tuple(sorted(dict(pairs).items()))
    ),
)


@given(
    events=st.lists(
        st.tuples(st.floats(min_value=0, max_value=3 * AB_HORIZON, allow_nan=False), deltas),
        max_size=40,
    )
)
def test_the_figures_do_not_depend_on_where_the_folds_batches_end(
    events: list[tuple[float, Tally]],
) -> None:
    one_by_one = ArmStats()
    working = ArmTally(ArmStats())
    for at, delta in events:
        one_by_one = record(one_by_one, 1000.0 + at, delta)
        working.add(1000.0 + at, delta)
    assert working.freeze() == one_by_one
    assert len(one_by_one.recent) <= AB_HORIZON // AB_BUCKET


def test_the_window_counts_the_buckets_that_end_inside_it() -> None:
    stats = ArmStats()
    stats = record(stats, 1000.0, Tally(failed=1))
    stats = record(stats, 1055.0, Tally(completed=2))
    assert windowed(stats, 1060.0, 10.0).completed == 2
    assert windowed(stats, 1060.0, 10.0).failed == 0
    assert windowed(stats, 1060.0, 60.0).failed == 1


# ---------------------------------------------------------------- rollback

RULES = RollbackRules(error_rate=0.2, p95_latency=5.0, p95_ttft=1.0, min_requests=10, window=60)


def arm(
    completed: int, failed: int = 0, expired: int = 0, latency: float = 1.0, ttft: float = 0.1
) -> ArmStats:
    seen = Tally(
        requests=completed + failed + expired,
        completed=completed,
        failed=failed,
        expired=expired,
        latency=((bin_of(latency), completed),) if completed else (),
        ttft=((bin_of(ttft), completed),) if completed else (),
    )
    return record(ArmStats(), 1000.0, seen)


@pytest.mark.parametrize(
    ("stats", "words"),
    [
        pytest.param(arm(20), None, id="healthy"),
        pytest.param(arm(8, failed=1), None, id="fewer than min_requests ended"),
        pytest.param(arm(0, failed=9), None, id="9 failures of 9: below min_requests"),
        pytest.param(arm(9, failed=1), None, id="10 %: below the rate"),
        pytest.param(
            arm(8, failed=2), "error rate 20% (2 of 10 calls failed", id="20 %: at the rate"
        ),
        # Expiries are reported, never counted as errors: a tenant's own tight
        # deadlines must not roll a split back for everyone (latency is judged
        # by the p95s).
        pytest.param(arm(6, failed=1, expired=3), None, id="expiries do not count"),
        pytest.param(arm(8, failed=2, expired=1), "2 of 10 calls failed", id="2 of 10 calls"),
        pytest.param(arm(20, latency=6.0), "p95 latency", id="slow"),
        pytest.param(arm(20, ttft=1.5), "p95 time to first token", id="slow first token"),
        pytest.param(arm(9, latency=60.0), None, id="slow, but too few completed"),
    ],
)
def test_the_rollback_rule(stats: ArmStats, words: str | None) -> None:
    reason = breach(RULES, stats, 1001.0)
    if words is None:
        assert reason is None
    else:
        assert reason is not None
        assert words in reason


def test_outside_the_window_nothing_breaches() -> None:
    assert breach(RULES, arm(0, failed=50), 1000.0 + 61 + AB_BUCKET) is None


def test_only_arms_with_traffic_other_than_the_control_are_judged() -> None:
    split = SplitPolicy(
        route="chat",
        arms=(("chat", 80.0), ("old", 0.0), ("canary", 20.0)),
        control="chat",
        rollback=RULES,
    )
    bad = arm(0, failed=30)
    assert judge(split, {"chat": bad, "old": bad}, 1001.0) is None
    found = judge(split, {"chat": bad, "old": bad, "canary": bad}, 1001.0)
    assert found is not None
    assert found[0] == "canary"
    assert judge(msgspec.structs.replace(split, rollback=None), {"canary": bad}, 1001.0) is None


# ---------------------------------------------------------------------- fold


def routed(rid: str, at: float, *, arm: str = "canary", wait: float = 1.0) -> Routed:
    return Routed(
        request_id=rid,
        tenant="acme",
        at=at,
        backend="b",
        attempt=1,
        priority="normal",
        queue_wait=wait,
        split="chat",
        arm=arm,
    )


def completed(rid: str, at: float, *, duration: float = 2.0, ttft: float = 0.5) -> Completed:
    return Completed(
        request_id=rid,
        tenant="acme",
        at=at,
        backend="b",
        attempt=1,
        delivery=1,
        text="x",
        usage=Usage(),
        cost=0.25,
        ttft=ttft,
        duration=duration,
    )


def ab(
    state: str, at: float, *, arm: str = "chat", operator: str = "", tenant: str = SYSTEM_TENANT
) -> SplitChanged:
    return SplitChanged(
        request_id="chat",
        tenant=tenant,
        at=at,
        route="chat",
        state=state,
        arm=arm,
        operator=operator,
    )


def test_the_fold_counts_each_arms_requests_and_outcomes() -> None:
    events: list[Event] = [
        routed("a", 100.0, wait=1.0),
        completed("a", 104.0),  # submitted at 99: 5 s, first token at 99 + 2.5 s
        routed("b", 100.0),
        Failed(request_id="b", tenant="acme", at=101.0, error_type="backend_fatal", reason="x"),
        routed("c", 100.0, arm="chat"),
        Cancelled(request_id="c", tenant="acme", at=101.0, stage="queued"),
        # Expired waiting on the arm, never routed: a request and an expiry.
        Expired(
            request_id="d", tenant="acme", at=102.0, stage="queued", split="chat", arm="canary"
        ),
        # Routed twice on the same arm (a fallback): one request.
        routed("e", 100.0),
        routed("e", 101.0),
    ]
    state = fold_many(ProjectionState(), events)
    canary = state.splits.routes["chat"].arms["canary"].total
    assert (canary.requests, canary.completed, canary.failed, canary.expired) == (4, 1, 1, 1)
    assert canary.cost == 0.25
    assert percentile(canary.latency, 50) == pytest.approx(5.0, rel=0.1)
    assert percentile(canary.ttft, 50) == pytest.approx(3.5, rel=0.1)
    control = state.splits.routes["chat"].arms["chat"].total
    assert (control.requests, control.ended) == (1, 0)
    assert set(state.splits.requests) == {"acme:e"}


@pytest.mark.parametrize(
    ("events", "state", "arm"),
    [
        pytest.param([ab("rolled_back", 10.0)], "rolled_back", "chat", id="the binder's rollback"),
        pytest.param(
            [ab("promoted", 10.0, arm="canary", operator="ops"), ab("rolled_back", 11.0)],
            "promoted",
            "canary",
            id="the binder's rollback after an operator's promotion: ignored",
        ),
        pytest.param(
            [
                ab("promoted", 10.0, arm="canary", operator="ops"),
                ab("rolled_back", 11.0, operator="ops"),
            ],
            "rolled_back",
            "chat",
            id="an operator's rollback after a promotion",
        ),
        pytest.param(
            [ab("rolled_back", 10.0), ab("live", 11.0, arm="", operator="ops")],
            "live",
            "",
            id="resumed",
        ),
        pytest.param(
            [ab("rolled_back", 10.0, tenant="acme")], "live", "", id="not the services' subject"
        ),
        pytest.param([ab("paused", 10.0)], "live", "", id="a state it does not know"),
    ],
)
def test_the_fold_moves_a_split_by_its_ab_events(events: list[Event], state: str, arm: str) -> None:
    split = fold_many(ProjectionState(), events).splits.routes.get("chat")
    assert (split.state if split else "live", split.arm if split else "") == (state, arm)


def test_a_requests_own_failure_never_counts_against_its_arm() -> None:
    """Before: a tenant sending prompts too long for the canary's model (or
    content it filters) rolled the split back for every tenant."""
    own = Failed(
        request_id="a",
        tenant="acme",
        at=101.0,
        error_type="backend_bad_request",
        error_class="context_length",
        reason="x",
    )
    state = fold_many(ProjectionState(), [routed("a", 100.0), own])
    canary = state.splits.routes["chat"].arms["canary"]
    assert (canary.total.failed, canary.total.requests) == (0, 1)


def test_a_resumed_split_is_judged_afresh_and_keeps_its_totals() -> None:
    events: list[Event] = [routed("a", 100.0)]
    events.append(
        Failed(
            request_id="a",
            tenant="acme",
            at=101.0,
            error_type="backend_unavailable",
            error_class="server_error",
            reason="x",
        )
    )
    events += [ab("rolled_back", 102.0), ab("live", 103.0, arm="", operator="ops")]
    canary = fold_many(ProjectionState(), events).splits.routes["chat"].arms["canary"]
    assert canary.recent == ()
    assert canary.total.failed == 1


def test_the_state_round_trips_and_folding_in_one_go_equals_one_by_one() -> None:
    events: list[Event] = [routed("a", 100.0), completed("a", 104.0), ab("rolled_back", 105.0)]
    state = fold_many(ProjectionState(), events)
    stepwise = ProjectionState()
    for event in events:
        stepwise = fold_many(stepwise, [event])
    assert stepwise == state
    assert decode_state(encode_state(state)) == state
    assert state.v == STATE_VERSION


def test_a_request_left_on_an_arm_is_swept_after_six_hours() -> None:
    state = fold_many(ProjectionState(), [routed("a", 100.0)])
    assert "acme:a" in state.splits.requests
    later = fold_many(state, [routed("b", 100.0 + 6 * 3600 + 120)])
    assert "acme:a" not in later.splits.requests


# --------------------------------------------------------------------- config

BACKEND = {"base_url": "http://127.0.0.1:1/v1", "model": "m"}


def split_config(ab: dict[str, Any], **routes: dict[str, Any]) -> dict[str, Any]:
    return {
        "backends": {"a": BACKEND},
        "routes": {
            "chat": {"backends": ["a"], "ab": ab},
            "canary": {"backends": ["a"]},
            **routes,
        },
    }


GOOD = {"arms": {"chat": 90, "canary": 10}, "control": "chat"}


@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        (split_config({**GOOD, "control": "other"}), "$.routes.chat.ab", "control 'other'"),
        (split_config({**GOOD, "arms": {"chat": 0, "canary": 0}}), "$.routes.chat.ab", "sum to 0"),
        (
            split_config({**GOOD, "arms": {"chat": -1, "canary": 1}}),
            "$.routes.chat.ab",
            "arm 'chat': a weight is a finite number >= 0, not -1",
        ),
        (split_config({**GOOD, "arms": {}}), "$.routes.chat.ab.arms", "length >= 1"),
        (split_config({**GOOD, "arms": {"chat": math.inf}}), "$.routes.chat.ab", "not inf"),
        (
            split_config({**GOOD, "arms": {"chat": 1, "nowhere": 1}}),
            "$.routes.chat.ab.arms.nowhere",
            "unknown route 'nowhere'",
        ),
        (
            split_config(
                GOOD, canary={"backends": ["a"], "ab": {"arms": {"chat": 1}, "control": "chat"}}
            ),
            "$.routes.chat.ab.arms.canary",
            "an arm must not split again",
        ),
        (split_config({**GOOD, "key": "user"}), "$.routes.chat.ab.key", "match"),
        (split_config({**GOOD, "rollback": {}}), "$.routes.chat.ab.rollback", "at least one of"),
        (
            split_config({**GOOD, "rollback": {"error_rate": 0.2, "window": "1h"}}),
            "$.routes.chat.ab.rollback",
            "between 30s and 10m",
        ),
        (
            split_config({**GOOD, "rollback": {"error_rate": 1.5}}),
            "$.routes.chat.ab.rollback.error_rate",
            "<= 1",
        ),
        (split_config({**GOOD, "weights": {}}), "$.routes.chat.ab", "unknown field `weights`"),
    ],
)
def test_a_bad_split_fails_at_load_naming_its_field(
    data: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.path == path, str(info.value)
    assert words in str(info.value)


def test_a_good_split_loads_into_the_policy_the_binder_applies() -> None:
    config = parse_config(
        split_config(
            {
                **GOOD,
                "key": "metadata.user",
                "salt": "2",
                "rollback": {
                    "error_rate": 0.2,
                    "p95_latency": "8s",
                    "min_requests": 5,
                    "window": "2m",
                },
            }
        )
    )
    split = config.routes["chat"].ab
    assert split is not None
    policy = split.policy("chat")
    assert policy.arms == (("chat", 90.0), ("canary", 10.0))
    assert policy.rollback == RollbackRules(
        error_rate=0.2, p95_latency=8.0, min_requests=5, window=120.0
    )
    assert (policy.key, policy.salt, policy.control) == ("metadata.user", "2", "chat")


def test_a_client_cannot_choose_its_arm() -> None:
    config = parse_config(split_config(GOOD))
    with pytest.raises(MalformedRequestError, match="split is set by the services only"):
        validate(
            msgspec.structs.replace(request(), split="chat"),
            level="normal",
            tenant="acme",
            config=config,
        )


def test_ab_status_with_no_splits_says_so() -> None:
    assert render_splits([]) == [
        "no A/B splits: no route has an [routes.<name>.ab] section, and the log has none"
    ]


def test_a_damaged_split_view_fails_to_decode_and_a_wild_bin_is_read_as_the_last() -> None:
    """Before: a histogram bin past the last decoded, and a percentile of it
    raised OverflowError in the binder's round, every second, for every route."""
    damaged = b'{"last_seq":1,"split":{"arms":{"canary":{"total":[5,5,0,0,0.0,[[100000,5]],[]]}}}}'
    with pytest.raises(msgspec.ValidationError):
        decode_split_view(damaged)
    assert bin_value(10_000) == bin_value(80)


def test_a_bucket_stamped_ahead_is_not_the_last_minutes() -> None:
    """A fast worker clock put one failure 20 minutes ahead: that bucket is not
    in "the last 60 s" of now (before: it was, for 20 minutes). (The buckets it
    pushed out of the horizon stay out: the arm is judged on fewer until the
    clock catches up; docs/ab-testing.md says so.)"""
    stats = record(arm(8, failed=2), 2200.0, Tally(requests=1, failed=1))
    assert windowed(stats, 1030.0, 60.0).failed == 0
    assert windowed(stats, 2230.0, 60.0).failed == 1


def test_weights_and_thresholds_that_cannot_work_are_refused() -> None:
    def split(**ab: object) -> None:
        parse_config(
            {
                "backends": {"a": {"base_url": "http://127.0.0.1:1", "model": "m"}},
                "routes": {
                    "chat": {"backends": ["a"], "ab": {"control": "chat", **ab}},
                    "canary": {"backends": ["a"]},
                },
            }
        )

    with pytest.raises(ConfigError, match="float holds"):
        split(arms={"chat": 1e308, "canary": 1e308})
    with pytest.raises(ConfigError, match="above 0"):
        split(arms={"chat": 9, "canary": 1}, rollback={"p95_latency": "0s", "min_requests": 5})
