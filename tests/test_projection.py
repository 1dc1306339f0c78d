"""The projection: a pure fold of the event log, stored in KV, equal to a replay.

The fold tests need no server. The projector tests each run their own
nats-server (``isolated_js``): they assert on the whole event stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _waits import until
from prometheus_client import REGISTRY

from renqueue.broker import Connection, EmbeddedServer, EventLog, JetStream, connect, provision
from renqueue.config import parse_config
from renqueue.coordination import (
    PROGRESS_KEY,
    BackendView,
    Progress,
    Projector,
    StateView,
    backend_view_key,
    decode_backend_view,
    decode_progress,
    encode_view,
    rebuild,
)
from renqueue.errors import ProjectionVersionError
from renqueue.policy import is_healthy
from renqueue.schema import (
    STATE_BUCKET,
    Cancelled,
    CancelRequested,
    ChatMessage,
    Completed,
    Event,
    Expired,
    Failed,
    InferenceRequest,
    Rejected,
    Retrying,
    Routed,
    Started,
    Submitted,
    Usage,
    encode,
    event_subject,
    is_terminal,
)
from renqueue.state import (
    STALE_IN_FLIGHT,
    STATE_KEY,
    STATE_VERSION,
    UPGRADED_IN_PLACE,
    BackendState,
    InFlight,
    ProjectionState,
    decode_state,
    encode_state,
    fold,
    fold_many,
    utc_day,
)

T0 = 1_700_000_000.0
EMPTY = ProjectionState()

# ------------------------------------------------------------------ builders


def dropped(receiver: str) -> float:
    """This process's ``renqueue_misdirected_messages_total`` for ``receiver``."""
    value = REGISTRY.get_sample_value("renqueue_misdirected_messages_total", {"receiver": receiver})
    return value or 0.0


def submitted(rid: str, *, tenant: str = "t1", at: float = T0) -> Submitted:
    request = InferenceRequest(
        id=rid, tenant=tenant, route="chat", messages=[ChatMessage(role="user", content="hi")]
    )
    return Submitted(request_id=rid, tenant=tenant, at=at, request=request)


def started(
    rid: str, backend: str = "b1", *, at: float = T0, tenant: str = "t1", delivery: int = 1
) -> Started:
    return Started(
        request_id=rid,
        tenant=tenant,
        at=at,
        backend=backend,
        attempt=1,
        delivery=delivery,
        worker="w",
    )


def retrying(
    rid: str,
    error_type: str,
    backend: str = "b1",
    *,
    at: float = T0,
    tenant: str = "t1",
    delivery: int = 1,
) -> Retrying:
    return Retrying(
        request_id=rid,
        tenant=tenant,
        at=at,
        backend=backend,
        attempt=1,
        delivery=delivery,
        error_type=error_type,
        reason="boom",
        retry_after=0.1,
    )


def failed(
    rid: str, error_type: str, backend: str | None = "b1", *, at: float = T0, tenant: str = "t1"
) -> Failed:
    return Failed(
        request_id=rid, tenant=tenant, at=at, error_type=error_type, reason="x", backend=backend
    )


def completed(
    rid: str,
    backend: str = "b1",
    *,
    at: float = T0,
    tenant: str = "t1",
    cost: float = 0.0,
    tokens: tuple[int, int] = (0, 0),
    delivery: int = 1,
) -> Completed:
    return Completed(
        request_id=rid,
        tenant=tenant,
        at=at,
        backend=backend,
        attempt=1,
        delivery=delivery,
        text="ok",
        usage=Usage(prompt_tokens=tokens[0], completion_tokens=tokens[1]),
        cost=cost,
    )


def random_log(seed: int, requests: int = 60) -> list[Event]:
    """A plausible interleaved log: retries, re-routes, every terminal kind, some unfinished."""
    rng = random.Random(seed)
    backends = ["b1", "b2", "b3"]
    tenants = ["t1", "t2"]
    errors = ["backend_unavailable", "backend_fatal", "rate_limited", "backend_bad_request"]
    per_request: list[list[tuple[str, dict[str, Any]]]] = []
    for n in range(requests):
        rid, tenant = f"r{seed}-{n}", rng.choice(tenants)
        steps: list[tuple[str, dict[str, Any]]] = [("submitted", {})]
        if rng.random() < 0.1:
            steps.append(("rejected", {}))
        else:
            delivery = 0
            backend = rng.choice(backends)
            for _ in range(rng.randint(0, 3)):
                delivery += 1
                steps.append(("started", {"backend": backend, "delivery": delivery}))
                steps.append(("retrying", {"backend": backend, "delivery": delivery}))
                if rng.random() < 0.3:
                    backend = rng.choice(backends)
            delivery += 1
            steps.append(("started", {"backend": backend, "delivery": delivery}))
            end = rng.choice(["completed", "completed", "failed", "expired", "cancelled", None])
            if end is not None:
                steps.append((end, {"backend": backend, "delivery": delivery}))
        per_request.append([(kind, {**args, "rid": rid, "tenant": tenant}) for kind, args in steps])

    events: list[Event] = []
    at = T0
    while per_request:
        queue = rng.choice(per_request)
        kind, args = queue.pop(0)
        if not queue:
            per_request.remove(queue)
        at += rng.choice([0.0, 0.001, 0.5, 3.0, 20.0])
        rid, tenant = args["rid"], args["tenant"]
        backend, delivery = args.get("backend", "b1"), args.get("delivery", 1)
        if kind == "submitted":
            events.append(submitted(rid, tenant=tenant, at=at))
        elif kind == "rejected":
            events.append(
                Rejected(request_id=rid, tenant=tenant, at=at, error_type="malformed", reason="x")
            )
        elif kind == "started":
            events.append(started(rid, backend, at=at, tenant=tenant, delivery=delivery))
        elif kind == "retrying":
            error = rng.choice(errors)
            events.append(retrying(rid, error, backend, at=at, tenant=tenant, delivery=delivery))
        elif kind == "completed":
            cost = rng.choice([0.0, 0.1, 0.2, 1e-7, 0.30000000000000004])
            tokens = (rng.randint(0, 900), rng.randint(0, 900))
            events.append(
                completed(
                    rid, backend, at=at, tenant=tenant, cost=cost, tokens=tokens, delivery=delivery
                )
            )
        elif kind == "failed":
            events.append(failed(rid, rng.choice(errors), backend, at=at, tenant=tenant))
        elif kind == "expired":
            events.append(Expired(request_id=rid, tenant=tenant, at=at, stage="running"))
        else:
            events.append(Cancelled(request_id=rid, tenant=tenant, at=at, stage="running"))
    return events


def fold_list(events: Sequence[Event], state: ProjectionState = EMPTY) -> ProjectionState:
    for event in events:
        state = fold(state, event)
    return state


# ------------------------------------------------------------------ health


def test_backend_turns_unhealthy_after_threshold_consecutive_backend_faults() -> None:
    state = fold_list(
        [
            started("a"),
            retrying("a", "backend_unavailable", at=T0 + 1),
            retrying("a", "backend_unavailable", at=T0 + 2),
        ]
    )
    assert is_healthy(state.backend("b1"), T0 + 2)
    state = fold(state, failed("a", "backend_fatal", at=T0 + 3))
    b1 = state.backend("b1")
    assert b1.consecutive_failures == 3
    assert b1.last_fault_at == T0 + 3
    assert b1.last_error_type == "backend_fatal"
    assert not is_healthy(b1, T0 + 3)
    # Other backends are untouched.
    assert is_healthy(state.backend("b2"), T0 + 3)


def test_rate_limits_and_bad_requests_never_make_a_backend_unhealthy() -> None:
    events: list[Event] = []
    for n in range(10):
        events.append(retrying(f"r{n}", "rate_limited", at=T0 + n))
        events.append(failed(f"q{n}", "backend_bad_request", at=T0 + n))
    state = fold_list(events)
    b1 = state.backend("b1")
    assert is_healthy(b1, T0 + 10)
    assert b1.consecutive_failures == 0
    assert b1.calls_failed == 20
    assert b1.rate_limited == 10
    assert b1.last_error_type == "backend_bad_request"


def test_a_completion_restores_health_at_once() -> None:
    faults = [retrying("a", "backend_unavailable", at=T0 + n) for n in range(5)]
    state = fold_list(faults)
    assert not is_healthy(state.backend("b1"), T0 + 5)
    state = fold(state, completed("b", at=T0 + 6))
    assert state.backend("b1").consecutive_failures == 0
    assert is_healthy(state.backend("b1"), T0 + 6)


def test_cooldown_runs_from_the_last_fault_in_event_time() -> None:
    state = fold_list([retrying("a", "backend_unavailable", at=T0 + n) for n in range(3)])
    last = T0 + 2
    assert not is_healthy(state.backend("b1"), last + 29.9)
    assert is_healthy(state.backend("b1"), last + 30.0)
    # Half-open: one more fault after the cooldown re-arms it.
    state = fold(state, retrying("a", "backend_unavailable", at=last + 31))
    assert not is_healthy(state.backend("b1"), last + 31 + 29.9)
    assert is_healthy(state.backend("b1"), last + 31 + 30.0)


def test_threshold_and_cooldown_are_parameters() -> None:
    state = fold(EMPTY, retrying("a", "backend_unavailable", at=T0))
    b1 = state.backend("b1")
    assert is_healthy(b1, T0)
    assert not is_healthy(b1, T0, threshold=1)
    assert is_healthy(b1, T0 + 5, threshold=1, cooldown=5)


def test_a_backend_the_log_never_named_is_healthy() -> None:
    assert is_healthy(EMPTY.backend("nobody"), T0)
    assert EMPTY.backend("nobody") == BackendState()


# ---------------------------------------------------------- counting


def test_spend_and_tokens_sum_per_backend_tenant_and_total() -> None:
    state = fold_many(
        EMPTY,
        [
            completed("a", "b1", tenant="t1", cost=0.25, tokens=(10, 20)),
            completed("b", "b1", tenant="t2", cost=0.5, tokens=(1, 2)),
            completed("c", "b2", tenant="t1", cost=1.0, tokens=(100, 200)),
        ],
    )
    assert state.backend("b1").spend == 0.75
    assert (state.backend("b1").tokens_in, state.backend("b1").tokens_out) == (11, 22)
    assert state.backend("b2").spend == 1.0
    assert state.tenants["t1"].spend == 1.25
    assert state.tenants["t2"].spend == 0.5
    assert state.spend == 1.75
    assert state.terminal == {"completed": 3}


def test_requests_are_counted_by_terminal_kind_per_tenant() -> None:
    state = fold_many(
        EMPTY,
        [
            submitted("a", tenant="t1"),
            submitted("b", tenant="t2"),
            completed("a", tenant="t1"),
            Rejected(request_id="b", tenant="t2", at=T0, error_type="malformed", reason="x"),
            Expired(request_id="c", tenant="t1", at=T0, stage="queued"),
            Cancelled(request_id="d", tenant="t1", at=T0, stage="queued"),
            failed("e", "backend_fatal", tenant="t1"),
        ],
    )
    assert state.submitted == 2
    assert state.tenants["t1"].submitted == 1
    assert state.tenants["t1"].terminal == {
        "completed": 1,
        "expired": 1,
        "cancelled": 1,
        "failed": 1,
    }
    assert state.tenants["t2"].terminal == {"rejected": 1}
    assert sum(state.terminal.values()) == 5


def test_in_flight_follows_starts_retries_reroutes_and_goes_back_to_zero() -> None:
    state = fold_list([started("a", "b1"), started("b", "b1"), started("c", "b2")])
    assert state.in_flight_count == 3
    assert (state.backend("b1").in_flight, state.backend("b2").in_flight) == (2, 1)
    # A retry and a redelivery on the same backend are still one request.
    state = fold_list([retrying("a", "backend_unavailable"), started("a", "b1", delivery=2)], state)
    assert state.backend("b1").in_flight == 2
    assert state.backend("b1").calls_started == 3
    # Re-routed to another backend: it moves.
    state = fold(state, started("b", "b2", delivery=2))
    assert (state.backend("b1").in_flight, state.backend("b2").in_flight) == (1, 2)
    state = fold_list(
        [
            completed("a", "b1"),
            failed("b", "backend_fatal", "b2"),
            Expired(request_id="c", tenant="t1", at=T0, stage="running"),
        ],
        state,
    )
    assert state.in_flight_count == 0
    assert state.in_flight == {}
    assert (state.backend("b1").in_flight, state.backend("b2").in_flight) == (0, 0)


def test_in_flight_entries_are_scoped_by_tenant() -> None:
    # Two tenants may use the same request id (ids are scoped by tenant): one
    # tenant's request ending must not end the other's.
    state = fold_list([started("same", "b1", tenant="t1"), started("same", "b2", tenant="t2")])
    assert set(state.in_flight) == {"t1:same", "t2:same"}
    state = fold(state, completed("same", "b1", tenant="t1"))
    assert set(state.in_flight) == {"t2:same"}
    assert (state.backend("b1").in_flight, state.backend("b2").in_flight) == (0, 1)


def test_a_tenant_written_cancel_request_never_moves_the_projection_clock() -> None:
    state = fold(EMPTY, started("a", at=T0))
    # A tenant may put any `at` on its own cancel_requested: year 3000.
    forged = CancelRequested(request_id="a", tenant="t1", at=32_503_680_000.0)
    after = fold(state, forged)
    assert after.log_time == T0
    assert after.last_sweep_at == state.last_sweep_at
    assert after.in_flight == state.in_flight
    assert after.events == state.events + 1


def test_terminal_events_of_requests_never_started_leave_in_flight_alone() -> None:
    state = fold_list(
        [
            started("a"),
            Rejected(request_id="x", tenant="t1", at=T0, error_type="malformed", reason="x"),
            Expired(request_id="y", tenant="t1", at=T0, stage="queued"),
        ]
    )
    assert state.in_flight_count == 1
    assert state.backend("b1").in_flight == 1


def test_a_start_that_never_ends_is_swept_after_the_stale_horizon_of_event_time() -> None:
    state = fold_list([started("lost", at=T0), started("live", at=T0 + STALE_IN_FLIGHT)])
    assert set(state.in_flight) == {"t1:live", "t1:lost"}
    later = Routed(
        request_id="z",
        tenant="t1",
        at=T0 + STALE_IN_FLIGHT + 61,
        backend="b1",
        attempt=1,
        priority="normal",
        queue_wait=0,
    )
    state = fold(state, later)
    assert set(state.in_flight) == {"t1:live"}
    assert state.in_flight_dropped == 1
    assert state.backend("b1").in_flight == 1


def test_a_non_finite_cost_or_time_cannot_poison_the_stored_state() -> None:
    state = fold(EMPTY, completed("a", cost=float("nan"), at=float("inf")))
    assert state.spend == 0.0
    assert decode_state(encode_state(state)) == state


def test_fold_never_changes_its_input() -> None:
    events = random_log(7)
    half = fold_many(EMPTY, events[: len(events) // 2])
    before = encode_state(half)
    fold_many(half, events[len(events) // 2 :])
    for event in events:
        fold(half, event)
    assert encode_state(half) == before
    assert encode_state(EMPTY) == encode_state(ProjectionState())


# ------------------------------------------------------------- determinism


@pytest.mark.parametrize("seed", range(25))
def test_folding_the_same_log_always_gives_the_same_state(seed: int) -> None:
    events = random_log(seed)
    once = fold_many(EMPTY, events)
    assert fold_many(EMPTY, events) == once
    assert fold_list(events) == once
    # Resuming from a stored (JSON round-tripped) state at any cut equals one pass:
    # what a projector does after a restart.
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(events)), 4))
    state = EMPTY
    for start, end in zip([0, *cuts], [*cuts, len(events)], strict=True):
        state = decode_state(encode_state(fold_many(state, events[start:end])))
    assert state == once
    assert encode_state(state) == encode_state(once)


@pytest.mark.parametrize("seed", range(10))
def test_in_flight_is_exactly_the_started_requests_with_no_terminal_event(seed: int) -> None:
    events = random_log(seed, requests=80)
    started_ids = {f"{e.tenant}:{e.request_id}" for e in events if isinstance(e, Started)}
    ended = {f"{e.tenant}:{e.request_id}" for e in events if is_terminal(e)}
    state = fold_many(EMPTY, events)
    assert set(state.in_flight) == started_ids - ended
    assert sum(b.in_flight for b in state.backends.values()) == state.in_flight_count
    assert sum(state.terminal.values()) == len(ended)
    assert sum(b.calls_started for b in state.backends.values()) == sum(
        isinstance(e, Started) for e in events
    )


# --------------------------------------------------------- with a real NATS


@pytest.fixture
async def events_js(isolated_nc: Connection, isolated_js: JetStream) -> JetStream:
    config = parse_config(
        {
            "backends": {
                name: {"base_url": "http://127.0.0.1:9", "model": "m"} for name in ("b1", "b2")
            },
            "routes": {"chat": {"backends": ["b1", "b2"]}},
        }
    )
    await provision(isolated_nc, config)
    return isolated_js


@pytest.fixture
async def projector(events_js: JetStream) -> AsyncIterator[Projector]:
    async with Projector(events_js, name="p1") as p:
        yield p


async def publish(js: JetStream, events: Sequence[Event]) -> None:
    log = EventLog(js)
    for event in events:
        if is_terminal(event):  # the one way a terminal event is written
            await log.finish(event, delivery=1, seq=0)
        else:
            await log.append(event)


def progress(seq: int) -> bytes:
    """A progress mark, as the projector writes it after the backend views."""
    return encode_view(Progress(last_seq=seq, log_time=T0))


async def stored(js: JetStream) -> ProjectionState:
    kv = await js.key_value(STATE_BUCKET)
    return decode_state((await kv.get(STATE_KEY)).value or b"")


async def test_stored_state_equals_a_replay_of_the_log(
    events_js: JetStream, projector: Projector
) -> None:
    events = random_log(101, requests=80)
    # Some events before a reader exists, some while the projector runs.
    await publish(events_js, events[:100])
    await asyncio.sleep(0.15)
    await publish(events_js, events[100:])
    async with asyncio.timeout(10):
        live = await projector.sync()
    replayed = await rebuild(events_js)

    assert live.last_seq == (await events_js.stream_info("RQ_EVENTS")).state.last_seq
    assert replayed == live
    assert encode_state(replayed) == encode_state(live)
    assert live.events == len(events)
    assert projector.state == live
    # And the pure fold of the published list, up to the sequence numbers.
    assert msgspec.structs.replace(fold_many(EMPTY, events), last_seq=live.last_seq) == live


async def test_undecodable_events_are_skipped_counted_and_the_projector_keeps_going(
    events_js: JetStream, projector: Projector
) -> None:
    await publish(events_js, [started("a")])
    await events_js.publish(event_subject("t1", "bad", "completed"), b"{not json")
    await events_js.publish(event_subject("t1", "bad2", "started"), b'{"kind": "started"}')
    await publish(events_js, [completed("a", cost=0.5)])
    async with asyncio.timeout(10):
        live = await projector.sync()

    assert live.skipped == 2
    assert live.events == 2
    assert live.backend("b1").calls_completed == 1
    assert live.in_flight_count == 0
    assert await rebuild(events_js) == live


async def test_state_view_follows_the_stored_state_and_judges_health(
    events_js: JetStream, projector: Projector
) -> None:
    async with await StateView.open(events_js) as view:
        assert view.backend_healthy("b1", T0)
        await publish(
            events_js,
            [started("a", "b1")]
            + [
                retrying("a", "backend_unavailable", "b1", at=T0 + n, delivery=n)
                for n in range(1, 4)
            ],
        )
        last = (await events_js.stream_info("RQ_EVENTS")).state.last_seq
        async with asyncio.timeout(10):
            await view.wait_for(last)
        assert not view.backend_healthy("b1", T0 + 4)
        assert view.backend_healthy("b1", T0 + 3 + 30)
        assert view.backend_healthy("b2", T0 + 4)
        assert view.backend_healthy("never-heard-of", T0 + 4)
        checkpoint = await stored(events_js)
        assert view.state.backends == checkpoint.backends
        assert view.state.last_seq == checkpoint.last_seq
        assert view.state.log_time == checkpoint.log_time


async def test_a_restarted_projector_resumes_from_the_stored_sequence(
    events_js: JetStream,
) -> None:
    events = random_log(202, requests=40)
    async with Projector(events_js, name="first") as first:
        await publish(events_js, events[:60])
        async with asyncio.timeout(10):
            await first.sync()
    await publish(events_js, events[60:])  # while no projector runs
    async with Projector(events_js, name="second") as second:
        assert second.state.last_seq > 0  # it started from the stored state
        async with asyncio.timeout(10):
            live = await second.sync()
    assert live == await rebuild(events_js)
    assert live.events == len(events)


async def test_two_projectors_at_once_never_clobber_the_stored_state(
    events_js: JetStream,
) -> None:
    kv = await events_js.context.key_value(STATE_BUCKET)  # nats-py's own: an iterator
    watcher: Any = await kv.watch(STATE_KEY)
    seen: list[int] = []

    async def record() -> None:
        async for entry in watcher:
            if entry is not None and entry.value:
                seen.append(decode_state(entry.value).last_seq)

    recorder = asyncio.create_task(record())
    events = random_log(303, requests=120)
    try:
        async with (
            Projector(events_js, name="p1", flush_interval=0.02) as p1,
            Projector(events_js, name="p2", flush_interval=0.02) as p2,
        ):
            for start in range(0, len(events), 40):
                await publish(events_js, events[start : start + 40])
                await asyncio.sleep(0.05)
            async with asyncio.timeout(10):
                live = await p1.sync()
            assert p1.writes + p2.writes > 2
    finally:
        await watcher.stop()  # nats-py's own watcher
        recorder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recorder

    assert live == await rebuild(events_js)
    assert live.events == len(events)
    # Every stored value is based on the one before: the sequence never goes back.
    assert seen == sorted(seen)
    assert len(seen) > 2


async def test_of_two_projectors_over_a_busy_log_one_writes_and_the_other_stands_by(
    events_js: JetStream,
) -> None:
    """The soak's two router processes each ran a projector: both folded every
    event and raced to write, the loser refolding after each of ~3 conflicts a
    second (its consumer made again each time). The one that loses a write now
    stands by while the stored state keeps moving, and takes over, folding on
    from the stored state, once the writer stops."""
    events = random_log(707, requests=200)
    half = len(events) // 2
    async with (
        Projector(events_js, name="p1", flush_interval=0.02, stand_by=0.5) as p1,
        Projector(events_js, name="p2", flush_interval=0.02, stand_by=0.5) as p2,
    ):
        for start in range(0, half, 10):
            await publish(events_js, events[start : start + 10])
            await asyncio.sleep(0.03)  # a log that grows across many flush intervals
        async with asyncio.timeout(10):
            await p1.sync()
        assert p1.conflicts + p2.conflicts <= 2, (p1.conflicts, p2.conflicts)
        assert p1.stood_by + p2.stood_by >= 1
        writer, standby = (p1, p2) if p1.writes >= p2.writes else (p2, p1)
        writes = standby.writes
        await writer.close()
        await publish(events_js, events[half:])
        async with asyncio.timeout(10):
            live = await standby.sync()
        assert standby.writes > writes  # it took over
    assert live == await rebuild(events_js)
    assert live.submitted == 200


async def test_a_projector_never_overwrites_a_newer_state_written_by_another(
    events_js: JetStream, projector: Projector
) -> None:
    await publish(events_js, [started("a"), completed("a", cost=0.5)])
    async with asyncio.timeout(10):
        before = await projector.sync()
    # Another projector (simulated) stored a state far ahead of this one.
    kv = await events_js.key_value(STATE_BUCKET)
    ahead = msgspec.structs.replace(before, last_seq=before.last_seq + 1000, events=999_999)
    await kv.put(STATE_KEY, encode_state(ahead))

    await publish(events_js, [started("b"), completed("b", cost=0.25)])
    await asyncio.sleep(0.5)  # several flush intervals: no write may land

    assert projector.conflicts >= 1
    assert await stored(events_js) == ahead
    assert projector.state == ahead


async def test_an_undecodable_stored_state_is_rebuilt_from_the_log(
    events_js: JetStream,
) -> None:
    await publish(events_js, random_log(404, requests=10))
    kv = await events_js.key_value(STATE_BUCKET)
    await kv.put(STATE_KEY, b"written by some other version")
    async with Projector(events_js) as fresh:
        async with asyncio.timeout(10):
            live = await fresh.sync()
    assert live == await rebuild(events_js)


async def test_deleting_the_stored_state_makes_the_next_projector_refold_the_log(
    events_js: JetStream,
) -> None:
    events = random_log(505, requests=10)
    await publish(events_js, events)
    async with Projector(events_js, name="first") as first:
        async with asyncio.timeout(10):
            await first.sync()
    kv = await events_js.key_value(STATE_BUCKET)
    await kv.delete(STATE_KEY)
    async with Projector(events_js, name="second") as second:
        assert second.state.last_seq == 0
        async with asyncio.timeout(10):
            live = await second.sync()
    assert live == await rebuild(events_js)
    assert live.events == len(events)


async def test_a_payload_that_disagrees_with_its_subject_is_counted_never_folded(
    events_js: JetStream, projector: Projector
) -> None:
    before = dropped("projection")
    # What a tenant can do with its permissions: any payload on its own
    # cancel_requested subject. And misfiled payloads on service subjects.
    forged_failure = encode(failed("x", "backend_unavailable", "b1", tenant="t1"))
    for n in range(3):
        await events_js.publish(event_subject("t1", f"x{n}", "cancel_requested"), forged_failure)
    other_tenant = encode(completed("y", tenant="t2", cost=1_000_000.0))
    await events_js.publish(event_subject("t1", "y", "cancel_requested"), other_tenant)
    await events_js.publish(event_subject("t1", "y", "completed"), other_tenant)
    other_id = encode(completed("z", tenant="t1", cost=5.0))
    await events_js.publish(event_subject("t1", "not-z", "completed"), other_id)
    await events_js.publish("rq.evt.t1.z.completed.extra", other_id)
    await publish(events_js, [started("a"), completed("a", cost=0.5)])
    async with asyncio.timeout(10):
        live = await projector.sync()

    assert live.mismatched == 7
    assert dropped("projection") - before == 7  # counted where it is scraped, too
    assert live.events == 2
    assert live.backend("b1").consecutive_failures == 0
    assert live.backend("b1").calls_failed == 0
    assert live.spend == 0.5
    assert "t2" not in live.tenants
    assert live.log_time == T0
    assert await rebuild(events_js) == live


async def test_a_stored_state_of_the_old_schema_is_rebuilt_from_the_log(
    events_js: JetStream,
) -> None:
    # Schema 1 keyed in-flight requests by id alone (across tenants).
    await publish(events_js, [started("a"), started("b", tenant="t2")])
    last = (await events_js.stream_info("RQ_EVENTS")).state.last_seq
    kv = await events_js.key_value(STATE_BUCKET)
    old = ProjectionState(v=1, last_seq=last, events=2, in_flight={"a": InFlight("b1", T0)})
    await kv.put(STATE_KEY, encode_state(old))
    async with Projector(events_js) as fresh:
        await publish(events_js, [completed("a")])
        async with asyncio.timeout(10):
            live = await fresh.sync()
    assert live.v == STATE_VERSION
    assert live == await rebuild(events_js)
    assert set(live.in_flight) == {"t2:b"}


async def test_a_stored_state_of_a_compatible_older_version_is_kept_not_refolded(
    events_js: JetStream,
) -> None:
    """Version 9 lacks only fields with defaults (``faults``): the projector
    keeps what it folded (a refold would lose what is past the log's
    max_age), marks it current and folds on from its sequence."""
    await publish(events_js, [started("a")])
    last = (await events_js.stream_info("RQ_EVENTS")).state.last_seq
    kv = await events_js.key_value(STATE_BUCKET)
    # A spend the log does not hold any more: a refold would lose it.
    kept = ProjectionState(v=9, last_seq=last, events=1, spend=7.5)
    await kv.put(STATE_KEY, encode_state(kept))
    async with Projector(events_js) as fresh:
        await publish(events_js, [completed("a")])
        async with asyncio.timeout(10):
            live = await fresh.sync()
    assert 9 in UPGRADED_IN_PLACE
    assert live.v == STATE_VERSION
    assert live.spend >= 7.5
    assert live.events == 2


async def test_a_state_view_whose_watch_went_stale_resumes_and_sees_later_writes(
    events_js: JetStream, isolated_nc: Connection
) -> None:
    kv = await events_js.key_value(STATE_BUCKET)
    for seq in (1, 2, 3):
        await kv.put(PROGRESS_KEY, progress(seq))
    async with await StateView.open(events_js, check_every=0.1) as view:
        assert view.state.last_seq == 3
        # The bucket is re-created (a re-provision after it was lost): the
        # watch's consumer is gone and the new bucket's revisions start over.
        await events_js.context.delete_key_value(STATE_BUCKET)
        await provision(isolated_nc, parse_config({}))
        kv = await events_js.key_value(STATE_BUCKET)
        await kv.put(PROGRESS_KEY, progress(10))
        async with asyncio.timeout(10):
            await view.wait_for(10)
        assert view.reopened >= 1
        # And the re-opened watch follows live writes.
        await kv.put(PROGRESS_KEY, progress(11))
        async with asyncio.timeout(10):
            await view.wait_for(11)


@pytest.mark.parametrize("store", ["kept", "lost"])
async def test_a_state_view_sees_writes_made_after_the_server_restarted(
    tmp_path: Path, store: str
) -> None:
    """Issue #6 item 10: a server restart loses the watch's (in-memory) consumer.
    With the store kept, nats-py's ordered consumer re-creates it from the
    next sequence; with the store lost (the bucket made again, revisions
    from 1), that sequence is past anything the new bucket holds and the
    view went silently stale. Either way it must see the next write."""
    server = EmbeddedServer(tmp_path / "nats", port=-1)
    await server.start()
    port = server.port
    nc = await connect(server.url, name="test-view")
    try:
        js = nc.jetstream()
        await provision(nc, parse_config({}))
        kv = await js.key_value(STATE_BUCKET)
        await kv.put(PROGRESS_KEY, progress(1))
        async with await StateView.open(js, check_every=0.2) as view:
            assert view.state.last_seq == 1
            await server.close()
            server = EmbeddedServer(tmp_path / ("nats" if store == "kept" else "nats-2"), port=port)
            await server.start()  # back on the same address

            async def write() -> None:
                # The first calls may land while the client still reconnects.
                while True:
                    try:
                        if store == "lost":
                            await provision(nc, parse_config({}))
                        bucket = await js.key_value(STATE_BUCKET)
                        await bucket.put(PROGRESS_KEY, progress(2))
                    except Exception:  # retry until the server answers
                        await asyncio.sleep(0.1)
                    else:
                        return

            async with asyncio.timeout(20):
                await write()
                await view.wait_for(2)
            if store == "lost":
                assert view.reopened >= 1
    finally:
        await nc.close()
        await server.close()


async def test_a_projector_folds_what_comes_after_a_server_restart_whatever_its_pull_length(
    tmp_path: Path,
) -> None:
    """A server restart loses the projector's (in-memory) consumer and the pull
    waiting on it, silently: only the idle check of the consumer finds it. That
    check runs every 5 s of idleness, so no idle pull may outlast it (here the
    pulls could last a minute, and the views are not due for an hour): a pull
    that ran on past the check's time kept the fold blind for its whole length
    (with the default 5 s pulls cut short by the views' republish, ~10 s)."""
    server = EmbeddedServer(tmp_path / "nats", port=-1)
    await server.start()
    port = server.port
    nc = await connect(server.url, name="test-projector-restart")
    try:
        js = nc.jetstream()
        await provision(nc, parse_config({}))
        await publish(js, [started("before")])
        async with Projector(js, fetch_timeout=60.0, republish_every=3600.0) as projector:

            async def folded(seq: int) -> bool:
                return projector.state.last_seq >= seq

            await until(functools.partial(folded, 1), "the first event is folded")
            await server.close()
            server = EmbeddedServer(tmp_path / "nats", port=port)
            await server.start()  # back on the same address, the store kept

            async def appended() -> bool:
                try:  # the first calls may land while the client still reconnects
                    await publish(js, [started("after")])
                except Exception:  # retried until the server answers
                    return False
                return True

            await until(appended, "the server takes an event again")
            await until(functools.partial(folded, 2), "the event after the restart is folded")
    finally:
        await nc.close()
        await server.close()


# ------------------------------------------------------------ per-backend views


async def views(js: JetStream) -> tuple[dict[str, tuple[int, Any]], Any]:
    """The stored backend views by backend name (revision, view), and the progress mark."""
    kv = await js.key_value(STATE_BUCKET)
    found: dict[str, tuple[int, Any]] = {}
    for key in await kv.keys():
        if key.startswith("view.backend."):
            entry = await kv.get(key)
            found[key.removeprefix("view.backend.")] = (
                entry.revision,
                decode_backend_view(entry.value),
            )
    return found, decode_progress((await kv.get(PROGRESS_KEY)).value)


async def views_cover(js: JetStream, seq: int) -> None:
    """Until the views' progress mark reaches ``seq`` (a view that waits for it)."""
    async with await StateView.open(js) as view:
        await view.wait_for(seq)


async def test_each_backend_has_a_view_equal_to_the_checkpoint_and_progress_comes_last(
    events_js: JetStream, projector: Projector
) -> None:
    await publish(events_js, [started("a", "b1"), started("b", "b2"), completed("a", "b1")])
    async with asyncio.timeout(10):
        live = await projector.sync()
        await views_cover(events_js, live.last_seq)
    found, mark = await views(events_js)
    assert set(found) == {"b1", "b2"}
    for name, (_, view) in found.items():
        assert view.backend == live.backend(name)
        assert view.last_seq <= mark.last_seq
    assert mark.log_time == live.log_time
    # The progress mark is stored after the views it covers.
    kv = await events_js.key_value(STATE_BUCKET)
    assert (await kv.get(PROGRESS_KEY)).revision > max(rev for rev, _ in found.values())


async def test_only_a_backend_the_log_changed_has_its_view_rewritten(
    events_js: JetStream, projector: Projector
) -> None:
    await publish(events_js, [started("a", "b1"), started("b", "b2")])
    async with asyncio.timeout(10):
        first = await projector.sync()
        await views_cover(events_js, first.last_seq)
    before, _ = await views(events_js)
    await publish(events_js, [completed("a", "b1")])
    async with asyncio.timeout(10):
        second = await projector.sync()
        await views_cover(events_js, second.last_seq)
    after, _ = await views(events_js)
    assert after["b2"][0] == before["b2"][0]  # untouched: not written again
    assert after["b1"][0] > before["b1"][0]
    assert after["b1"][1].backend.calls_completed == 1


async def test_a_restarted_projector_repairs_a_tampered_or_deleted_view(
    events_js: JetStream,
) -> None:
    await publish(events_js, [started("a", "b1"), started("b", "b2")])
    async with Projector(events_js, name="first") as first:
        async with asyncio.timeout(10):
            live = await first.sync()
    kv = await events_js.key_value(STATE_BUCKET)
    await kv.put(backend_view_key("b1"), b"tampered")
    await kv.delete(backend_view_key("b2"))
    kv_before = (await kv.get(STATE_KEY)).revision
    watcher = await kv.watch("view.>")
    repaired: dict[str, BackendState] = {}
    try:
        async with Projector(events_js, name="second"):  # the log is idle: nothing to fold
            async with asyncio.timeout(10):
                while repaired.get("b1") != live.backend("b1") or "b2" not in repaired:
                    entry = await watcher.updates(timeout=10.0)
                    if entry is not None and entry.key.startswith("view.backend."):
                        with contextlib.suppress(msgspec.DecodeError):  # the tampered one
                            view = decode_backend_view(entry.value)
                            repaired[entry.key.removeprefix("view.backend.")] = view.backend
    finally:
        await watcher.close()
    assert repaired["b2"] == live.backend("b2")
    assert (await kv.get(STATE_KEY)).revision == kv_before  # the checkpoint was not rewritten


async def test_two_projectors_over_an_idle_log_do_not_trade_writes(events_js: JetStream) -> None:
    await publish(events_js, random_log(606, requests=10))
    async with (
        Projector(events_js, name="p1", flush_interval=0.02) as p1,
        Projector(events_js, name="p2", flush_interval=0.02) as p2,
    ):
        async with asyncio.timeout(10):
            await p1.sync()
            await views_cover(events_js, p1.state.last_seq)
        writes = p1.writes + p2.writes
        # A window of many flush intervals: an idle log must cause no checkpoint write.
        await asyncio.sleep(0.4)
        assert p1.writes + p2.writes == writes


def test_a_tenants_spend_today_starts_over_each_utc_day_and_ignores_late_days() -> None:
    day0 = utc_day(T0)
    next_day = (day0 + 1) * 86400.0 + 5.0
    state = fold_many(
        EMPTY,
        [
            completed("a", at=T0, cost=1.0),
            completed("b", at=T0 + 1, cost=2.0),
            completed("c", at=next_day, cost=0.5),
            completed("d", at=T0 + 2, cost=4.0),  # late: counts in the total only
        ],
    )
    tenant = state.tenants["t1"]
    assert tenant.spend == 7.5
    assert tenant.spend_on(day0 + 1) == 0.5
    assert tenant.spend_on(day0) == 0.0  # not the latest day: not kept
    assert tenant.spend_on(day0 + 2) == 0.0
    assert fold_many(EMPTY, [completed("a", at=T0, cost=1.0)]).tenants["t1"].spend_on(day0) == 1.0


async def test_a_backend_name_that_cannot_be_a_key_is_folded_and_never_stops_the_views(
    events_js: JetStream, projector: Projector
) -> None:
    """A bad name in a service event (a bug, or a forged one) made every view
    write fail after the checkpoint: the fold loop failed until its process died."""
    await publish(events_js, [started("a", "b1"), failed("a", "backend_unavailable", "")])
    await publish(events_js, [started("b", "b2")])
    last = (await events_js.stream_info("RQ_EVENTS")).state.last_seq
    async with asyncio.timeout(10):
        await views_cover(events_js, last)
    found, _ = await views(events_js)
    assert set(found) == {"b1", "b2"}
    assert projector.views_skipped == 1
    assert projector.state.backend("").calls_failed == 1  # folded all the same


async def test_a_refold_from_the_start_never_publishes_views_older_than_the_stored_ones(
    events_js: JetStream,
) -> None:
    events = random_log(707, requests=60)
    await publish(events_js, events)
    async with Projector(events_js, name="first") as first:
        async with asyncio.timeout(10):
            live = await first.sync()
            await views_cover(events_js, live.last_seq)
    kv = await events_js.key_value(STATE_BUCKET)
    await kv.delete(STATE_KEY)  # the next projector folds the log from its first event
    watcher = await kv.watch("view.>")
    seqs: list[int] = []
    try:
        while await watcher.updates(timeout=5.0) is not None:
            pass  # what is stored now
        async with Projector(events_js, name="second", batch=16, flush_interval=0.0) as second:
            async with asyncio.timeout(10):
                await second.sync()
                while not seqs or seqs[-1] < live.last_seq:
                    entry = await watcher.updates(timeout=5.0)
                    if entry is not None and entry.key == PROGRESS_KEY:
                        seqs.append(decode_progress(entry.value).last_seq)
    finally:
        await watcher.close()
    assert second.writes > 2  # it did write partial checkpoints on the way
    assert min(seqs) >= live.last_seq


async def test_a_state_view_keeps_the_newer_of_two_views_until_the_log_is_made_again(
    events_js: JetStream,
) -> None:
    kv = await events_js.key_value(STATE_BUCKET)

    async def put(key: str, value: BackendView | Progress) -> None:
        await kv.put(key, encode_view(value))

    fresh, stale = BackendState(calls_started=9), BackendState(calls_started=1)
    async with await StateView.open(events_js) as view:
        await put(backend_view_key("b1"), BackendView(last_seq=9, epoch="e1", backend=fresh))
        await put(PROGRESS_KEY, Progress(last_seq=9, epoch="e1", log_time=T0))
        async with asyncio.timeout(10):
            await view.wait_for(9)
        # A slower projector's late writes of an older fold: ignored.
        await put(backend_view_key("b1"), BackendView(last_seq=4, epoch="e1", backend=stale))
        await put(PROGRESS_KEY, Progress(last_seq=4, epoch="e1", log_time=T0))
        await kv.delete(backend_view_key("b1"))
        await put(PROGRESS_KEY, Progress(last_seq=10, epoch="e1", log_time=T0))
        async with asyncio.timeout(10):
            await view.wait_for(10)
        assert view.state.backend("b1") == fresh
        # The events stream made again: sequences start over, the old views go.
        await put(backend_view_key("b2"), BackendView(last_seq=1, epoch="e2", backend=stale))
        await put(PROGRESS_KEY, Progress(last_seq=1, epoch="e2", log_time=T0))

        async def started_over() -> bool:
            return view.state.last_seq == 1

        await until(started_over, "the view takes the new log's progress")
        assert set(view.state.backends) == {"b2"}


async def test_every_view_is_written_again_within_republish_every(
    events_js: JetStream,
) -> None:
    await publish(events_js, [started("a", "b1")])
    kv = await events_js.key_value(STATE_BUCKET)
    async with Projector(events_js, name="p", republish_every=0.2) as p:
        async with asyncio.timeout(10):
            live = await p.sync()
            await views_cover(events_js, live.last_seq)
        watcher = await kv.watch(backend_view_key("b1"))
        try:
            assert await watcher.updates(timeout=5.0) is not None  # the stored view
            assert await watcher.updates(timeout=5.0) is None
            await kv.delete(backend_view_key("b1"))
            async with asyncio.timeout(10):
                while True:  # the delete marker, then the view written again
                    entry = await watcher.updates(timeout=5.0)
                    if entry is not None and entry.operation is None:
                        break
        finally:
            await watcher.close()
    assert decode_backend_view(entry.value).backend == live.backend("b1")


async def test_a_projector_never_overwrites_a_newer_versions_state(events_js: JetStream) -> None:
    kv = await events_js.key_value(STATE_BUCKET)
    newer = ProjectionState(v=STATE_VERSION + 1, last_seq=5)
    await kv.put(STATE_KEY, encode_state(newer))
    with pytest.raises(ProjectionVersionError):
        await Projector(events_js).start()
    assert decode_state((await kv.get(STATE_KEY)).value) == newer
