"""Issue #31 item 1: a request bound in the first round after the binder read it
gets one stored event, its ``submitted`` carrying its ``routed`` decision, not two.

What these pin: the one stored event (and the pair a request that waits still
gets), that every reader reads it as the pair it stands for (the history, the
fold, the what-if trace, the console, the audit), that logs written before it
(the pair stored apart) read the same, and the binder's crash windows: a
binder that dies (or fails a publish) between its steps leaves nothing lost
and nothing logged twice for the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import msgspec
import pytest
from _waits import until
from test_binder import two_backends

from renqueue import Client, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog, connect, provision
from renqueue.cli._audit import timeline
from renqueue.config import Config
from renqueue.errors import NatsUnavailableError
from renqueue.gateway._console_feed import summary
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DISPATCH_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    ChatMessage,
    Dispatch,
    Event,
    InferenceRequest,
    Routed,
    Submitted,
    bound_at_once,
    encode,
    event_subject,
    facts,
    kind_of,
    routed,
    router_consumer,
    submitted,
)
from renqueue.schema._subjects import dispatch_subject, msg_id
from renqueue.services.router import Router
from renqueue.sim import trace_of
from renqueue.state import ProjectionState, fold_many

TENANT = "t"
LEVELS = ("critical", "high", "normal", "low", "batch")


async def stored(js: Any, request_id: str) -> list[tuple[str, Event]]:
    """The messages stored in the log for ``request_id``: (subject's kind, event)."""
    out: list[tuple[str, Event]] = []
    seq = 1
    subject = f"rq.evt.{TENANT}.{request_id}.*"
    while True:
        try:
            raw = await js.get_msg(EVENTS_STREAM, seq=seq, subject=subject, next=True)
        except Exception:
            return out
        out.append((raw.subject.rsplit(".", 1)[-1], EVENT_DECODER.decode(raw.data)))
        seq = raw.seq + 1


async def settled(js: Any) -> bool:
    infos = [await js.consumer_info(REQUESTS_STREAM, router_consumer(level)) for level in LEVELS]
    return all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)


def one_slot(mock: MockBackend, url: str) -> Config:
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {"b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 1}}},
            "routes": {"chat": {"backends": ["b"]}},
            "router": {"capacity_refresh": "20ms"},
            "levels": {
                level: {"never_age": True, "preempts": False, "preemptible": False}
                for level in LEVELS
            },
        }
    )


# ---------------------------------------------------------------- the new path


async def test_a_request_bound_at_once_is_one_stored_event_and_one_that_waits_two(
    isolated_server: EmbeddedServer,
) -> None:
    """r1 finds the slot free: one stored ``submitted`` carrying its binding.
    r2 waits for it (held past its first round): its ``submitted`` is stored
    on its own then, and its ``routed`` once it is bound. Both read the same."""
    async with MockBackend(MockSettings(ttft=0.0, output_tokens=2)) as mock:
        config = one_slot(mock, isolated_server.url)
        async with (
            Services(config, backends=[]) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            js = services.js
            first = await client.submit("one", route="chat", request_id="r1")
            second = await client.submit("two", route="chat", request_id="r2")

            async def waits_logged() -> bool:
                return [kind for kind, _ in await stored(js, "r2")] == ["submitted"]

            # No worker yet: r1 sits on the backend's subject, r2 waits, held.
            await until(waits_logged, "r2's submitted is logged while it waits")
            async with Services(config, routers=0, backends=["b"], projector=False):
                await asyncio.gather(first.result(timeout=30), second.result(timeout=30))
            one, two = await stored(js, "r1"), await stored(js, "r2")
            log = EventLog(js)
            histories = [await log.history(TENANT, rid) for rid in ("r1", "r2")]
            routed_only = await log.history(TENANT, "r1", kind="routed")
            submitted_only = await log.history(TENANT, "r1", kind="submitted")
    assert [kind for kind, _ in one] == ["submitted", "started", "completed"]
    carried = one[0][1]
    assert isinstance(carried, Submitted)
    assert carried.routed is not None
    assert carried.routed.backend == "b"
    assert carried.routed.attempt == 1
    assert carried.traceparent is not None
    # Neither is stored as it was read: each says when it was (the what-if's read delay).
    assert carried.read is not None
    assert carried.at <= carried.read <= carried.routed.at
    assert [kind for kind, _ in two] == ["submitted", "routed", "started", "completed"]
    alone = two[0][1]
    assert isinstance(alone, Submitted)
    assert alone.routed is None
    assert alone.read is not None
    # Read back, both are what the pair stored apart always was.
    for events in histories:
        assert [kind_of(e) for e in events] == ["submitted", "routed", "started", "completed"]
        assert isinstance(events[0], Submitted)
        assert events[0].routed is None
    assert [type(e) for e in routed_only] == [Routed]
    assert [type(e) for e in submitted_only] == [Submitted]


# ------------------------------------------------------ readers, old and new logs


def _pair() -> tuple[Submitted, Routed]:
    request = InferenceRequest(
        id="r1", tenant=TENANT, route="chat", priority="normal", submitted_at=100.0,
        messages=[ChatMessage(role="user", content="hi")],
    )  # fmt: skip
    first = submitted(request, at=100.0, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    decision = routed(
        request, at=100.002, backend="b", attempt=1, priority="normal", queue_wait=0.002,
        reason="bind", router="r", term=3, estimated_cost=0.001,
    )  # fmt: skip
    return first, decision


def test_every_reader_reads_the_one_event_as_the_pair_an_old_log_stored() -> None:
    first, decision = _pair()
    one = bound_at_once(first, decision)
    # On the wire: one event, the binding a whole `routed` event inside it.
    wire = msgspec.json.decode(encode(one))
    assert wire["kind"] == "submitted"
    assert wire["routed"]["kind"] == "routed"
    assert EVENT_DECODER.decode(encode(one)) == one
    old: list[Event] = [first, decision]
    assert list(facts(one)) == old
    assert facts(first) == (first,)
    # The fold (the projector, replay and verify all fold through it).
    assert fold_many(ProjectionState(), [one]) == fold_many(ProjectionState(), old)
    # The what-if trace.
    assert trace_of([one], since=0.0, until=200.0) == trace_of(old, since=0.0, until=200.0)
    # The console's lines and the audit's timeline.
    assert [summary(7, e) for e in facts(one)] == [summary(7, e) for e in old]
    assert timeline(list(facts(one)), header=True) == timeline(old, header=True)


def test_a_binding_of_another_request_is_no_fact_of_this_one() -> None:
    first, decision = _pair()
    with pytest.raises(ValueError, match="its own binding"):
        bound_at_once(first, msgspec.structs.replace(decision, request_id="other"))
    # A hand-made one (only services write the log; a reader does not trust it).
    forged = msgspec.structs.replace(first, routed=msgspec.structs.replace(decision, tenant="x"))
    assert facts(forged) == (first,)


async def test_an_old_log_with_the_pair_stored_apart_reads_the_same(
    isolated_server: EmbeddedServer,
) -> None:
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="old-log")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        first, decision = _pair()
        for event, kind in ((first, "submitted"), (decision, "routed")):
            await js.publish(event_subject(TENANT, "r1", kind), encode(event))
        log = EventLog(js)
        assert await log.history(TENANT, "r1") == [first, decision]
        assert await log.history(TENANT, "r1", kind="routed") == [decision]
        assert await log.history(TENANT, "r1", kind="submitted") == [first]
        found = await log.decision_of(TENANT, "r1", 1)
        assert found is not None
        assert found[0] == decision
        assert await log.decision_of(TENANT, "r1", 2) is None
    finally:
        await nc.close()


# -------------------------------------------------------------- crash windows


def _request_of(js: Any) -> Awaitable[InferenceRequest]:
    async def read() -> InferenceRequest:
        return REQUEST_DECODER.decode((await js.get_msg(REQUESTS_STREAM, seq=1)).data)

    return read()


async def _bind_after(nc: Any, js: Any, config: Config) -> None:
    """A new binder takes over and settles what the dead one left."""
    router = Router(nc, js, config, name="next-binder")
    await router.start()
    try:
        await until(lambda: settled(js), "the request message is settled")
    finally:
        await router.close()


@pytest.mark.parametrize("dispatched", [False, True], ids=["no-dispatch", "dispatched"])
async def test_a_binder_dead_after_its_one_event_leaves_the_next_one_nothing_to_log_twice(
    isolated_server: EmbeddedServer, dispatched: bool
) -> None:
    """The dead binder stored r1's ``submitted`` carrying its binding to ``b``
    (``a`` was full then), and died before the dispatch was stored, or before
    it acked the request. The next binder finds ``a`` free, yet the logged
    decision stands: the dispatch goes to ``b`` (once), and nothing more is
    logged: one stored event, the request acked."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="dead-binder")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            await client.submit("hello", route="chat", request_id="r1")
            request = await _request_of(js)
            first = submitted(request, at=1.0)
            decision = routed(
                request, at=1.0, backend="b", attempt=1, priority="normal", queue_wait=0.0
            )
            await js.publish(
                event_subject(TENANT, "r1", "submitted"),
                encode(bound_at_once(first, decision)),
                headers={"Nats-Msg-Id": msg_id(TENANT, "r1", "submitted")},
            )
            if dispatched:
                await js.publish(
                    dispatch_subject("b"),
                    encode(Dispatch(request=request, backend="b", attempt=1, routed_at=1.0)),
                    headers={"Nats-Msg-Id": msg_id(TENANT, "r1", "dispatch", 1)},
                )
            await _bind_after(nc, js, config)
            kinds = [kind for kind, _ in await stored(js, "r1")]
            history = await EventLog(js).history(TENANT, "r1")
            on_a = (await js.consumer_info(DISPATCH_STREAM, "worker-a")).num_pending
            on_b = (await js.consumer_info(DISPATCH_STREAM, "worker-b")).num_pending
    finally:
        await nc.close()
    assert kinds == ["submitted"]
    assert [kind_of(e) for e in history] == ["submitted", "routed"]
    assert isinstance(history[1], Routed)
    assert history[1].backend == "b"
    assert (on_a, on_b) == (0, 1)


async def test_a_binder_dead_before_its_one_event_is_stored_logs_the_pair_next_time(
    isolated_server: EmbeddedServer,
) -> None:
    """It read r1 and died before its round bound it (or before the event
    left it): nothing of r1 is in the log. The next binder reads it as stored
    before its term (an earlier bind may have dispatched it): its first word
    on its own, its decision once its dispatch is stored; each fact once."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="dead-early")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            await client.submit("hello", route="chat", request_id="r1")
            await _bind_after(nc, js, config)
            history = await EventLog(js).history(TENANT, "r1")
            dispatches = (await js.stream_info(DISPATCH_STREAM)).state.messages
    finally:
        await nc.close()
    assert [kind_of(e) for e in history] == ["submitted", "routed"]
    assert dispatches == 1


class RefusingDispatch:
    """A binder's JetStream whose first dispatch publishes fail after its
    ``submitted`` (carrying the decision) went out: a broker fault between the two."""

    def __init__(self, js: Any, refusals: int) -> None:
        self._js = js
        self.refusals = refusals

    async def publish_async(self, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        if subject.startswith("rq.dispatch.") and self.refusals > 0:
            self.refusals -= 1
            raise NatsUnavailableError("nats: outbound buffer limit exceeded")
        return await self._js.publish_async(subject, payload, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_a_dispatch_that_fails_after_the_one_event_goes_where_it_says(
    isolated_server: EmbeddedServer,
) -> None:
    """The decision is stored with the ``submitted``, the dispatch fails: the
    request waits again and, delivered again, is dispatched where the logged
    decision says, with nothing logged twice."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="failing-dispatch")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        refusing = RefusingDispatch(js, refusals=1)
        router = Router(nc, refusing, config, name="binder")
        await router.start()
        try:
            async with Client(nc, tenant=TENANT) as client:
                await client.submit("hello", route="chat", request_id="r1")
                await until(lambda: settled(js), "the request message is settled")
        finally:
            await router.close()
        kinds = [kind for kind, _ in await stored(js, "r1")]
        history = await EventLog(js).history(TENANT, "r1")
        dispatches = (await js.stream_info(DISPATCH_STREAM)).state.messages
    finally:
        await nc.close()
    assert refusing.refusals == 0
    assert kinds == ["submitted"]
    assert [kind_of(e) for e in history] == ["submitted", "routed"]
    assert isinstance(history[1], Routed)
    assert dispatches == 1
    on = history[1].backend
    assert (await _pending_on(isolated_server, on)) == 1


async def _pending_on(server: EmbeddedServer, backend: str) -> int:
    nc = await connect(server.url, name="pending")
    try:
        return int(
            (await nc.jetstream().consumer_info(DISPATCH_STREAM, f"worker-{backend}")).num_pending
        )
    finally:
        await nc.close()


async def test_a_binding_whose_one_event_is_deduplicated_is_logged_on_its_own(
    isolated_server: EmbeddedServer,
) -> None:
    """The request's ``submitted`` is stored already under its message id when
    the binder binds it at once (the round logged it on its own meanwhile, or
    a copy of a request still waiting was read past the requests' duplicate
    window): the event carrying the decision is deduplicated into that one,
    which does not carry it, so the decision is logged on its own."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="dedup")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        router = Router(nc, js, config, name="binder")
        await router.start()
        try:
            async with Client(nc, tenant=TENANT) as client:
                request = client.build_request("hello", route="chat", request_id="r1")
                earlier = submitted(request, at=1.0)
                await js.publish(
                    event_subject(TENANT, "r1", "submitted"),
                    encode(earlier),
                    headers={"Nats-Msg-Id": msg_id(TENANT, "r1", "submitted")},
                )
                await client.submit("hello", route="chat", request_id="r1")
                await until(lambda: settled(js), "the request message is settled")
        finally:
            await router.close()
        kinds = [kind for kind, _ in await stored(js, "r1")]
        history = await EventLog(js).history(TENANT, "r1")
    finally:
        await nc.close()
    assert kinds == ["submitted", "routed"]
    assert history[0] == earlier
    assert isinstance(history[1], Routed)


class _Watched(asyncio.Future[Any]):
    """A publish's ack that says when someone begins to wait for it."""

    def __init__(self, waited: asyncio.Event) -> None:
        super().__init__()
        self._waited = waited

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        self._waited.set()
        super().add_done_callback(fn, context=context)


class LateFirstWord:
    """The next binder's JetStream, where its own ``submitted`` of r1 (a
    redelivery's, deduplicated by its message id) is stored only after the
    dead binder's one event, still on its way when the next binder read r1
    again, has landed: that lands once the next binder waits for its own
    ``submitted``'s ack, or once it has read r1's decisions without doing so."""

    def __init__(self, js: Any, late: bytes) -> None:
        self._js = js
        self._late = late
        self._go = asyncio.Event()
        self._reads = 0
        self._landing: asyncio.Task[None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def get_msg(self, stream: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._js.get_msg(stream, *args, **kwargs)
        finally:
            if str(kwargs.get("subject", "")).startswith(f"rq.evt.{TENANT}.r1."):
                self._reads += 1
                if self._reads >= 2:  # both of decision_of's subjects read
                    self._go.set()

    async def publish_async(self, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        if subject != event_subject(TENANT, "r1", "submitted") or self._landing is not None:
            return await self._js.publish_async(subject, payload, **kwargs)
        ack = _Watched(self._go)

        async def land() -> None:
            await self._go.wait()
            await self._js.publish(
                subject, self._late, headers={"Nats-Msg-Id": msg_id(TENANT, "r1", "submitted")}
            )
            try:
                ack.set_result(await self._js.publish(subject, payload, **kwargs))
            except Exception as exc:
                ack.set_exception(exc)

        self._landing = asyncio.create_task(land())
        return ack


async def test_a_dead_binders_one_event_landing_late_is_the_one_decision(
    isolated_server: EmbeddedServer,
) -> None:
    """The dead binder's ``submitted`` carrying r1's binding to ``b`` was on its
    way when the next binder read r1 again (stored before its term: it may have
    been bound). The next binder's own ``submitted`` of r1 is then deduplicated
    into that one; so its read of r1's decisions must come after its own
    ``submitted`` is acked, or it misses the decision, dispatches elsewhere and
    logs a second ``routed`` for the attempt (the carried one is under the
    ``submitted`` message id, so the ``routed`` one's does not stop it)."""
    config = two_backends(isolated_server.url)
    nc = await connect(isolated_server.url, name="late-one-event")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        async with Client(nc, tenant=TENANT) as client:
            await client.submit("hello", route="chat", request_id="r1")
            request = await _request_of(js)
            decision = routed(
                request, at=1.0, backend="b", attempt=1, priority="normal", queue_wait=0.0
            )
            late = encode(bound_at_once(submitted(request, at=1.0), decision))
            router = Router(nc, LateFirstWord(js, late), config, name="next-binder")
            await router.start()
            try:
                await until(lambda: settled(js), "the request message is settled")
            finally:
                await router.close()
            history = await EventLog(js).history(TENANT, "r1")
            on_a = (await js.consumer_info(DISPATCH_STREAM, "worker-a")).num_pending
            on_b = (await js.consumer_info(DISPATCH_STREAM, "worker-b")).num_pending
    finally:
        await nc.close()
    decisions = [(e.attempt, e.backend) for e in history if isinstance(e, Routed)]
    assert decisions == [(1, "b")], [kind_of(e) for e in history]
    assert (on_a, on_b) == (0, 1)
