"""Forwarding with ``router.tenant_backlog`` (docs/scaling.md, review finding F11).

With binding split in groups, requests sent without their route are moved
to their route's subject by one consumer every router reads,
``router-forward``. Its ``max_ack_pending`` is shared by every tenant: a
request it holds un-acked (handed back, to be tried again) takes a place
another tenant's request needs to be delivered at all. Before, a copy
refused because its tenant's route subject was full (the tenant at its
``tenant_backlog`` there) was handed back and tried again every second, so
one tenant's backlog filled the consumer and stopped every other tenant's
forwarding. These tests pin what the forwarder does at each refusal: a
tenant's full route ends its request (``rejected``, ``tenant_backlog_full``:
the tenant is over its cap, as the broker tells an unsplit submit) and holds
nothing; a put-back (the services' own) or a full stream (every tenant's
copies refused alike) is handed back and forwarded once room comes back;
a rejection that cannot be stored leaves its original un-acked. Each but
the end-to-end one runs the forwarder on a real nats-server without
binders, so the route subjects keep what is published to them. (A copy
over the broker's ``max_payload``: tests/test_binder_groups.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _waits import until

from renqueue import Client, Services
from renqueue.broker import (
    Connection,
    EmbeddedServer,
    EventLog,
    JetStream,
    JetStreamApi,
    connect,
    provision,
    router_consumer_configs,
)
from renqueue.config import Config, load_config
from renqueue.coordination import Coalescer
from renqueue.errors import RequestRejectedError, StoreFullError, TenantBacklogFullError
from renqueue.schema import (
    FORWARD_CONSUMER,
    REQUESTS_STREAM,
    Rejected,
    msg_id,
    request_subject,
)
from renqueue.services.router._endings import Endings
from renqueue.services.router._forward import Forwarder, open_forwarding

LEVEL = "normal"
#: router.tenant_backlog in these tests.
BACKLOG = 3


def write_config(path: Path, nats_url: str) -> Config:
    """Routes r1 -> b1 and r2 -> b2 (two binding groups), a tenant backlog of
    ``BACKLOG``. No backend is called: no worker runs, and a binder binds
    only to a backend whose worker asks for work (``require_worker``: its
    first count of a backend is read before it binds anything there)."""
    text = (
        f'[nats]\nurl = "{nats_url}"\n[router]\nsplit_binding = true\n'
        f"tenant_backlog = {BACKLOG}\nrequire_worker = true\n"
    )
    for backend, route in (("b1", "r1"), ("b2", "r2")):
        text += (
            f'[backends.{backend}]\nbase_url = "http://127.0.0.1:9"\nmodel = "mock"\n'
            f'[routes.{route}]\nbackends = ["{backend}"]\n'
        )
    path.write_text(text)
    return load_config(path, environ={})


def body(tenant: str, request_id: str, route: str = "r1", **extra: Any) -> bytes:
    return msgspec.json.encode(
        {
            "id": request_id,
            "tenant": tenant,
            "route": route,
            "priority": LEVEL,
            "messages": [{"role": "user", "content": "hi"}],
            **extra,
        }
    )


async def publish(
    js: JetStream,
    tenant: str,
    request_id: str,
    *,
    route: str | None = None,
    requeue: bool = False,
) -> None:
    """A request of ``tenant`` on its level's subject (``route``: the route's)."""
    subject = request_subject(LEVEL, tenant, requeue=requeue, route=route)
    if requeue:
        data = body(tenant, request_id, requeues=1)
        claimed = msg_id(tenant, request_id, "requeue", 1)
    else:
        data = body(tenant, request_id)
        claimed = msg_id(tenant, request_id)
    await js.publish(subject, data, headers={"Nats-Msg-Id": claimed})


async def waiting(js: JetStream, subject: str) -> int:
    """Messages stored on ``subject`` in the requests stream."""
    reply = await JetStreamApi(js).call(
        f"STREAM.INFO.{REQUESTS_STREAM}", {"subjects_filter": subject}
    )
    subjects = reply["state"].get("subjects") or {}
    return int(subjects.get(subject, 0))


async def set_forward_max_ack_pending(js: JetStream, config: Config, limit: int) -> None:
    """The forwarding consumer as provisioned, but with ``max_ack_pending``
    ``limit``: stands for its 10,000 with fewer messages."""
    [forward] = router_consumer_configs(config, group=FORWARD_CONSUMER)
    reply = await JetStreamApi(js).call(
        f"CONSUMER.CREATE.{REQUESTS_STREAM}.{FORWARD_CONSUMER}",
        {"stream_name": REQUESTS_STREAM, "config": {**forward, "max_ack_pending": limit}},
    )
    assert reply.get("error") is None, reply
    assert reply["config"]["max_ack_pending"] == limit


@asynccontextmanager
async def forwarding(
    tmp_path: Path, server: EmbeddedServer
) -> AsyncIterator[tuple[Connection, JetStream, Config, Forwarder]]:
    """A provisioned split layout and a forwarder of its own (not running)."""
    config = write_config(tmp_path / "rq.toml", server.url)
    nc = await connect(server.url, name="test-forwarder")
    try:
        js = nc.jetstream()
        await provision(nc, config)
        endings = Endings(EventLog(js), Coalescer(js), clock=time.time)
        yield nc, js, config, Forwarder(nc, js, config, endings)
    finally:
        await nc.close()


async def test_one_tenants_full_route_does_not_stop_another_tenants_forwarding(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Tenant ``flood`` has ``BACKLOG`` requests waiting on its route's subject
    (its cap there) and as many more sent without their route; the
    forwarding consumer takes as many un-acked as that (its 10,000, scaled
    down). Before, the forwarder handed each of those back to try again
    every second, for ever (until ``max_deliver``), and tenant ``quiet``'s
    request was never delivered. Now each is ended ``tenant_backlog_full``
    and acked, so ``quiet``'s request is forwarded; ``flood``'s route subject
    keeps its own."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, config, forwarder):
        await set_forward_max_ack_pending(js, config, BACKLOG)
        for n in range(BACKLOG):
            await publish(js, "flood", f"waiting-{n}", route="r1")
        with pytest.raises(TenantBacklogFullError):
            await publish(js, "flood", "one-too-many", route="r1")
        for n in range(BACKLOG):
            await publish(js, "flood", f"unrouted-{n}")
        psub = await open_forwarding(js)
        loop = asyncio.create_task(forwarder.loop(psub))
        try:
            # Only once the flood's requests were all delivered does the other
            # tenant publish: it is then behind all of them.
            async def flood_delivered() -> bool:
                delivered = (await psub.consumer_info()).delivered
                return delivered is not None and delivered.stream_seq >= 2 * BACKLOG

            await until(flood_delivered, "the flood's unrouted requests are delivered")
            await publish(js, "quiet", "hello")

            async def quiet_forwarded() -> bool:
                # Counted once its original is acked, after its copy is stored:
                # the loop is stopped only then.
                return forwarder.forwarded == 1

            await until(quiet_forwarded, "the other tenant's request is forwarded")
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        assert await waiting(js, request_subject(LEVEL, "quiet", route="r1")) == 1
        # The flood's waiting requests are its own, untouched; the ones sent
        # without their route are ended, told why, and gone from the stream.
        assert await waiting(js, request_subject(LEVEL, "flood", route="r1")) == BACKLOG
        assert await waiting(js, request_subject(LEVEL, "flood")) == 0
        log = EventLog(js)
        for n in range(BACKLOG):
            [ended] = await log.history("flood", f"unrouted-{n}", kind="rejected")
            assert isinstance(ended, Rejected)
            assert ended.error_type == "tenant_backlog_full"
            assert f"route r1 at level {LEVEL}" in ended.reason
        assert (await psub.consumer_info()).num_ack_pending == 0


async def test_a_put_back_refused_by_its_full_route_waits_and_is_forwarded_once_there_is_room(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A put-back (the services' own, on the ``.requeue`` subject: an admitted
    request) whose route's requeue subject is full is not ended: it is
    handed back, and forwarded once that subject has room, as unsplit a
    refused put-back waits in the worker."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        full = request_subject(LEVEL, "t", requeue=True, route="r1")
        for n in range(BACKLOG):
            await publish(js, "t", f"put-back-{n}", route="r1", requeue=True)
        await publish(js, "t", "preempted", requeue=True)
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert forwarder.forwarded == 0
        assert await log_of(js, "t", "preempted") == []
        reply = await JetStreamApi(js).call(
            f"STREAM.PURGE.{REQUESTS_STREAM}", {"filter": full, "keep": BACKLOG - 1}
        )
        assert reply.get("success"), reply
        [again] = await psub.fetch(batch=1, timeout=10)
        assert again.data == msg.data
        await forwarder._forward([again])
        assert forwarder.forwarded == 1
        assert await waiting(js, full) == BACKLOG


async def test_a_copy_refused_by_a_full_stream_waits_and_is_forwarded_once_there_is_room(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The requests stream at its limit refuses every tenant's copy alike
    (``store_full``, not the tenant's backlog): the request is handed back,
    not ended, and forwarded once the stream has room."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        await publish(js, "t", "first")
        api = JetStreamApi(js)
        info = await api.call(f"STREAM.INFO.{REQUESTS_STREAM}")
        stream = info["config"]
        reply = await api.call(
            f"STREAM.UPDATE.{REQUESTS_STREAM}", {**stream, "max_msgs": info["state"]["messages"]}
        )
        assert reply.get("error") is None, reply
        with pytest.raises(StoreFullError):
            await publish(js, "t", "refused", route="r2")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert forwarder.forwarded == 0
        assert await log_of(js, "t", "first") == []
        reply = await api.call(f"STREAM.UPDATE.{REQUESTS_STREAM}", stream)
        assert reply.get("error") is None, reply
        [again] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([again])
        assert forwarder.forwarded == 1
        assert await waiting(js, request_subject(LEVEL, "t", route="r1")) == 1


async def test_a_client_sending_without_the_route_is_told_tenant_backlog_full_by_the_event(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The services and the Python client, end to end: a tenant's requests
    wait on its route up to its cap (no worker: none is bound). Named in
    the subject, the next submit is refused at its publish
    (``TenantBacklogFullError``, nothing stored); sent without its route, it
    is stored, then rejected by the forwarder, and the client's handle says
    ``tenant_backlog_full``. Another tenant's request sent so is forwarded."""
    config = write_config(tmp_path / "rq.toml", isolated_server.url)
    async with Services(config, routers=1, backends=[]) as services:
        assert services.nc is not None
        async with (
            Client(services.nc, tenant="flood", route_subjects=True) as named,
            Client(services.nc, tenant="flood") as unnamed,
            Client(services.nc, tenant="quiet") as other,
        ):
            for n in range(BACKLOG):
                await named.submit(f"waiting {n}", route="r1")
            with pytest.raises(TenantBacklogFullError):
                await named.submit("refused at its publish", route="r1")
            handle = await unnamed.submit("sent without its route", route="r1")
            with pytest.raises(RequestRejectedError) as info:
                await handle.result(timeout=30)
            assert info.value.error_type == "tenant_backlog_full"
            [router] = services.routers
            assert router.forwarded == 0
            js = named.js
            assert await waiting(js, request_subject(LEVEL, "flood", route="r1")) == BACKLOG
            await other.submit("another tenant's", route="r1")

            async def forwarded() -> bool:
                return router.forwarded == 1

            await until(forwarded, "the other tenant's request is forwarded")
            assert services.supervisor.reason is None


async def log_of(js: JetStream, tenant: str, request_id: str) -> list[Any]:
    """The request's events (none: nothing ended it)."""
    return await EventLog(js).history(tenant, request_id)


async def test_a_rejection_that_cannot_be_recorded_leaves_the_request_waiting(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The original is acked only once its rejection is stored: with the
    dead-letter stream refusing (full, ``discard: new`` for the test), the
    request over its tenant's backlog is handed back, not acked; once the
    stream takes it, the next delivery ends it ``tenant_backlog_full``."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        for n in range(BACKLOG):
            await publish(js, "flood", f"waiting-{n}", route="r1")
        await publish(js, "flood", "over")
        api = JetStreamApi(js)
        await js.publish("rq.dlq.requests", b"taking the only place")
        info = await api.call("STREAM.INFO.RQ_DLQ")
        dlq = info["config"]
        full = {**dlq, "discard": "new", "max_msgs": info["state"]["messages"]}
        reply = await api.call("STREAM.UPDATE.RQ_DLQ", full)
        assert reply.get("error") is None, reply
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert await log_of(js, "flood", "over") == []
        assert await waiting(js, request_subject(LEVEL, "flood")) == 1
        reply = await api.call("STREAM.UPDATE.RQ_DLQ", dlq)
        assert reply.get("error") is None, reply
        [again] = await psub.fetch(batch=1, timeout=10)
        assert again.data == msg.data
        await forwarder._forward([again])
        [ended] = await EventLog(js).history("flood", "over", kind="rejected")
        assert isinstance(ended, Rejected)
        assert ended.error_type == "tenant_backlog_full"
        assert await waiting(js, request_subject(LEVEL, "flood")) == 0
        assert forwarder.forwarded == 0
