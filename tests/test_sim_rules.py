"""The what-if simulator follows the services' rules, not copies of them
(issue 26 item 3): the same decision is run through a worker and through the
simulator, and they must agree.

- Route facts: what a worker gives the failure policy for a failed run
  (``Worker._route_facts``) and what the simulator gives it for a run it bound
  (``Calls.bind``, then ``Calls.route_facts``), with and without a half-open
  circuit's probe, on a first run and down a cascade.
- Each failure class's action: a live worker (a real nats-server, a backend
  adapter raising the error the simulator makes of a recorded failure) and
  the simulator's worker side (``Calls.run_failed``) record the same events
  for the same failed runs: a retry here, a fallback (with its cool-down after
  a 429), a requeue past a spent quota, a failure, and a request put back to
  routing too often. Both sides run at the same moment (the worker on a
  frozen clock, the simulation starting then) and draw the backoff's jitter
  at the middle of its range, so the events must be equal, field by field.

Were either side to change its copy of a rule, these fail.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from renqueue import ChatMessage, GenerationParams, InferenceRequest, parse_config
from renqueue.broker import Connection, EmbeddedServer, EventLog, JetStream, provision
from renqueue.config import Config
from renqueue.errors import FailureClass
from renqueue.policy import Bind, RouteFacts
from renqueue.schema import (
    MAX_REQUEUES,
    Dispatch,
    Event,
    Failed,
    Fallback,
    FellBack,
    Retrying,
    dispatch_subject,
    encode,
    msg_id,
)
from renqueue.services.worker import Worker
from renqueue.sim import Arrival, BackendModel, CallRecord, FailureRecord, Trace
from renqueue.sim._arrivals import Arrivals
from renqueue.sim._calls import Calls, error_of
from renqueue.sim._world import Item, World

TENANT = "t1"
#: What both sides' backoff jitter draws: the middle of its range.
MIDDLE = 0.5


def config_of(url: str = "nats://127.0.0.1:4222", *, alone: bool = False) -> Config:
    """Route ``chat`` over ``a`` (a small context window) then ``b``; ``alone``: ``a`` only."""
    backends = {
        "a": {"context_window": 2000},
        "b": {"context_window": 8000, "cost_input_per_mtok": 1.0, "cost_output_per_mtok": 2.0},
    }
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                name: {
                    "base_url": "http://127.0.0.1:9",
                    "model": "m",
                    "limits": {"concurrency": 2},
                    **extra,
                }
                for name, extra in backends.items()
            },
            "routes": {"chat": {"backends": ["a"] if alone else ["a", "b"]}},
            "worker": {"retry_delay": "20ms", "max_retry_delay": "40ms", "max_deliver": 3},
        }
    )


def request_of(rid: str, **fields: Any) -> InferenceRequest:
    return InferenceRequest(
        id=rid,
        tenant=TENANT,
        route="chat",
        messages=[ChatMessage(role="user", content="x" * 400)],
        params=GenerationParams(max_tokens=16),
        **fields,
    )


# ------------------------------------------------------------ the simulator


class _Middle(random.Random):
    """A random source that always draws the middle of its range."""

    def random(self) -> float:
        return MIDDLE


class _Recording(World):
    """A simulation's world that keeps every event it folds."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.events: list[Event] = []
        self.rng = _Middle()

    def fold(self, event: Event) -> None:
        self.events.append(event)
        super().fold(event)


def simulator_of(
    config: Config, request: InferenceRequest, at: float
) -> tuple[_Recording, Arrivals, Calls, Item]:
    """The simulator's parts for one request arriving ``at``, read into its router's hold."""
    call = CallRecord(backend="a", at=at, ttft=0.1, generating=0.5, tokens=16)
    models = {name: BackendModel(name, calls=(call,)) for name in config.backends}
    trace = Trace(since=at, until=at + 3600, arrivals=(Arrival(at=at, request=request),))
    world = _Recording(trace, config, models, 0)
    arrivals = Arrivals(world)
    calls = Calls(world, arrivals)
    item = world.items[0]
    arrivals.arrive(item)
    assert item.waiting is not None, world.events
    return world, arrivals, calls, item


def bound(calls: Calls, item: Item, *, probe: bool, attempt: int = 1) -> None:
    """The simulator binds ``item`` to ``a`` (its ``attempt``-th dispatch) as a round would."""
    item.attempt = attempt - 1
    calls.bind(item, Bind(ref=item.ref, backend="a", effective_rank=2, probe=probe))


def simulated_failures(
    config: Config, failure: FailureRecord, *, at: float, probe: bool, attempt: int, most: int
) -> list[Event]:
    """The events the simulator records (at ``at``) for ``failure`` on every
    run of ``a``, up to ``most`` failed runs or the first that does not retry here."""
    world, _arrivals, calls, item = simulator_of(config, request_of("r1"), at)
    bound(calls, item, probe=probe, attempt=attempt)
    failed: list[Event] = []
    for _ in range(most):
        seen = len(world.events)
        calls.run_failed(item, failure)
        failed.extend(e for e in world.events[seen:] if isinstance(e, Retrying | FellBack | Failed))
        if _last(failed[-1]):
            break
        calls.start_run(item)  # the retry, when its delay has passed
    return failed


def _last(event: Event) -> bool:
    """Whether ``event`` is the last of its dispatch's failed runs: not a retry here."""
    return not isinstance(event, Retrying) or event.requeued


# --------------------------------------------------------------- the worker


class Raises:
    """A backend adapter whose every call fails with ``error``."""

    name = "a"

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def stream(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> AsyncIterator[Any]:
        raise self.error
        yield  # an async generator, as the protocol asks

    async def complete(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> Any:
        raise self.error

    async def aclose(self) -> None:
        return None


async def worker_failures(
    server: EmbeddedServer,
    nc: Connection,
    js: JetStream,
    failure: FailureRecord,
    *,
    at: float,
    alone: bool,
    probe: bool,
    attempt: int,
    count: int,
) -> list[Event]:
    """The first ``count`` events a live worker of ``a`` (its clock stopped at
    ``at``) records for the failed runs of a dispatch whose calls fail as
    ``failure`` says."""
    config = config_of(server.url, alone=alone)
    await provision(nc, config)
    request = request_of("r1", requeues=attempt - 1)
    error = error_of(failure, "a", at)
    worker = Worker(nc, js, config, "a", Raises(error), name="w", clock=lambda: at)
    await worker.start()
    try:
        dispatch = Dispatch(
            request=request, backend="a", attempt=attempt, routed_at=at, probe=probe
        )
        await js.publish(
            dispatch_subject("a"),
            encode(dispatch),
            headers={"Nats-Msg-Id": msg_id(TENANT, "r1", "dispatch", attempt)},
        )
        log = EventLog(js)
        failed: list[Event] = []
        async with asyncio.timeout(10):
            while len(failed) < count and not (failed and _last(failed[-1])):
                await asyncio.sleep(0.02)
                events = await log.history(TENANT, "r1")
                failed = [e for e in events if isinstance(e, Retrying | FellBack | Failed)]
    finally:
        await worker.close()
    return failed[:count]


# -------------------------------------------------------------- comparison


def comparable(event: Event) -> dict[str, Any]:
    """``event``'s fields but its run number (numbered differently: the worker
    by deliveries of each attempt, the simulator over the request's life; no
    fold reads it)."""
    fields = msgspec.structs.asdict(event)
    fields.pop("delivery", None)
    return fields


def record(error_type: str, error_class: str = "", **fields: Any) -> FailureRecord:
    return FailureRecord(backend="a", error_type=error_type, error_class=error_class, **fields)


#: Each failure class (and a worker error), as a recorded failure; the route
#: of two backends unless ``alone``.
CASES = [
    pytest.param(record("backend_unavailable", "connect"), {}, id="connect"),
    pytest.param(record("backend_unavailable", "connect_timeout"), {}, id="connect_timeout"),
    pytest.param(
        record("backend_unavailable", "first_token_timeout"), {}, id="first_token_timeout"
    ),
    pytest.param(record("backend_unavailable", "total_timeout"), {}, id="total_timeout"),
    pytest.param(record("backend_unavailable", "stall"), {}, id="stall"),
    pytest.param(record("backend_unavailable", "server_error"), {}, id="server_error"),
    pytest.param(
        record("backend_unavailable", "server_error"), {"probe": True}, id="server_error-probe"
    ),
    pytest.param(
        record("backend_unavailable", "server_error"), {"alone": True}, id="server_error-alone"
    ),
    pytest.param(record("backend_unavailable", "overloaded"), {}, id="overloaded"),
    pytest.param(record("backend_unavailable", "malformed"), {}, id="malformed"),
    pytest.param(record("backend_unavailable", "broken_stream"), {}, id="broken_stream"),
    pytest.param(record("backend_fatal", "unavailable"), {}, id="unavailable"),
    pytest.param(record("backend_bad_request", "bad_request"), {}, id="bad_request"),
    pytest.param(record("backend_bad_request", "context_length"), {}, id="context_length"),
    pytest.param(record("backend_bad_request", "content_filter"), {}, id="content_filter"),
    pytest.param(
        record("rate_limited", "rate_limited", retry_after=0.05), {}, id="rate_limited-retry_after"
    ),
    pytest.param(record("rate_limited", "rate_limited"), {}, id="rate_limited-no-retry_after"),
    pytest.param(
        record("rate_limited", "rate_limited", retry_after=900.0), {}, id="rate_limited-for-days"
    ),
    pytest.param(
        record("rate_limited", "rate_limited", retry_after=0.05),
        {"alone": True},
        id="rate_limited-alone",
    ),
    pytest.param(
        record("rate_limited", "quota_exhausted", retry_after=120.0, exhausted_for=60.0),
        {},
        id="quota_exhausted-retry_after-later",
    ),
    pytest.param(
        record("rate_limited", "quota_exhausted", retry_after=30.0, exhausted_for=60.0),
        {},
        id="quota_exhausted-reset-later",
    ),
    pytest.param(record("rate_limited", "quota_exhausted"), {}, id="quota_exhausted-no-reset"),
    pytest.param(record("worker_error"), {}, id="internal"),
    pytest.param(
        record("backend_unavailable", "server_error"),
        {"attempt": MAX_REQUEUES + 1, "most": 2},
        id="fell_back-too-often",
    ),
    pytest.param(
        record("rate_limited", "quota_exhausted", exhausted_for=60.0),
        {"attempt": MAX_REQUEUES + 1},
        id="quota_exhausted-too-often",
    ),
]


async def test_every_failure_class_is_listed() -> None:
    listed = {
        param.values[0].error_class for param in CASES if isinstance(param.values[0], FailureRecord)
    }
    assert {str(failure) for failure in FailureClass} <= listed


@pytest.mark.parametrize(("failure", "options"), CASES)
async def test_a_failed_run_is_recorded_alike_by_the_worker_and_the_simulator(
    failure: FailureRecord,
    options: dict[str, Any],
    isolated_server: EmbeddedServer,
    isolated_nc: Connection,
    isolated_js: JetStream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alone = options.get("alone", False)
    probe = options.get("probe", False)
    attempt = options.get("attempt", 1)
    now = time.time()
    simulated = simulated_failures(
        config_of(alone=alone),
        failure,
        at=now,
        probe=probe,
        attempt=attempt,
        most=options.get("most", 3),
    )
    assert simulated
    # The worker draws its jitter from the random module: the middle, as the simulator's.
    monkeypatch.setattr(random, "random", lambda: MIDDLE)
    live = await worker_failures(
        isolated_server,
        isolated_nc,
        isolated_js,
        failure,
        at=now,
        alone=alone,
        probe=probe,
        attempt=attempt,
        count=len(simulated),
    )
    assert [comparable(event) for event in simulated] == [comparable(event) for event in live]


FACTS_CASES = [
    pytest.param(False, None, None, id="first-run"),
    pytest.param(True, None, None, id="first-run-probe"),
    pytest.param(False, Fallback(excluded=("b",), count=1), None, id="down-the-cascade"),
    pytest.param(
        True, Fallback(excluded=("b",), count=1, probes=1), 0.5, id="down-the-cascade-probe"
    ),
]


@pytest.mark.parametrize(("probe", "fallback", "max_cost"), FACTS_CASES)
async def test_route_facts_are_the_workers_in_the_simulator(
    probe: bool,
    fallback: Fallback | None,
    max_cost: float | None,
    isolated_nc: Connection,
    isolated_js: JetStream,
) -> None:
    config = config_of()
    request = request_of("r1", max_cost=max_cost)
    _world, _arrivals, calls, item = simulator_of(config, request, time.time())
    bound(calls, item, probe=probe)
    item.request = msgspec.structs.replace(item.request, fallback=fallback)
    simulated = calls.route_facts(item)
    worker = Worker(isolated_nc, isolated_js, config, "a", Raises(RuntimeError()), name="w")
    dispatch = Dispatch(request=item.request, backend="a", attempt=item.attempt, probe=probe)
    live = worker._route_facts(dispatch)
    assert isinstance(simulated, RouteFacts)
    assert isinstance(live, RouteFacts)
    assert simulated.probe is probe
    assert msgspec.structs.replace(simulated, now=0.0) == msgspec.structs.replace(live, now=0.0)
