"""Tenant isolation by Connection permissions alone: a real nats-server running nats/auth.conf.

The services connect as the ``renqueue`` user; tenants ``acme`` and
``globex`` connect as themselves with their own inbox prefixes. A tenant's
whole client (submit, tokens, result, events, handles of older requests)
works under its permissions, and every way at another tenant's subjects is
refused by the server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from renqueue import Client, RequestCancelledError, Services, parse_config
from renqueue.broker import (
    AckPolicy,
    Connection,
    DeliverPolicy,
    EmbeddedServer,
    EventLog,
    JetStreamApi,
)
from renqueue.errors import NatsError, NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    CANCELS_STREAM,
    EVENTS_STREAM,
    MAX_CANCEL_BYTES,
    TERMINAL_KINDS,
    TOKENS_STREAM,
    Completed,
    cancel_subject,
    request_subject,
    subject_matches,
)

AUTH_CONF = Path(__file__).resolve().parent.parent / "nats" / "auth.conf"
PASSWORDS = {
    "RQ_SERVICE_PASSWORD": "service-secret",
    "RQ_TENANT_ACME_PASSWORD": "acme-secret",
    "RQ_TENANT_GLOBEX_PASSWORD": "globex-secret",
    "RQ_SYS_PASSWORD": "sys-secret",
}
#: How long to wait for an answer that a refused request never gets.
REFUSED = 0.5


def user_url(server: EmbeddedServer, user: str, password: str) -> str:
    return server.url.replace("nats://", f"nats://{user}:{password}@")


@dataclass
class Tenant:
    """A raw connection as a tenant, recording the permission errors the server sends."""

    nc: Connection
    errors: list[str] = field(default_factory=list)

    async def violation(self, text: str) -> None:
        """Wait (briefly) for the server's permissions violation naming ``text``."""
        for _ in range(50):
            if any("permissions violation" in e and text.lower() in e for e in self.errors):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {text!r}; got {self.errors}")


@dataclass
class Stack:
    server: EmbeddedServer
    services: Services
    mock: MockBackend


@pytest.fixture
async def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    for name, value in PASSWORDS.items():
        monkeypatch.setenv(name, value)  # the server reads them from its environment
    async with (
        EmbeddedServer(tmp_path / "nats", port=-1, config_file=AUTH_CONF) as server,
        MockBackend(MockSettings(ttft=0.0, tokens_per_second=400, output_tokens=8)) as mock,
    ):
        config = parse_config(
            {
                "nats": {
                    "url": user_url(server, "renqueue", PASSWORDS["RQ_SERVICE_PASSWORD"]),
                    "inbox_prefix": "_INBOX_renqueue",
                },
                "backends": {"b1": {"base_url": mock.url, "model": "mock"}},
                "routes": {"chat": {"backends": ["b1"]}},
                "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
                "router": {"capacity_refresh": "20ms"},
            }
        )
        async with Services(config) as services:
            yield Stack(server, services, mock)


async def tenant_client(stack: Stack, tenant: str) -> Client:
    password = PASSWORDS[f"RQ_TENANT_{tenant.upper()}_PASSWORD"]
    return await Client.connect(
        user_url(stack.server, tenant, password),
        tenant=tenant,
        name=f"test-{tenant}",
        inbox_prefix=f"_INBOX_{tenant}",
    )


async def raw_tenant(stack: Stack, tenant: str) -> Tenant:
    password = PASSWORDS[f"RQ_TENANT_{tenant.upper()}_PASSWORD"]
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = Connection()
    await nc.open(
        5,
        servers=user_url(stack.server, tenant, password),
        inbox_prefix=f"_INBOX_{tenant}",
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    return Tenant(nc, errors)


async def test_a_tenant_uses_the_whole_client_on_its_own_subjects_only(stack: Stack) -> None:
    started = time.monotonic()
    async with await tenant_client(stack, "globex") as globex:
        theirs = await globex.submit("globex's secret", route="chat")
        assert (await theirs.result(timeout=10)).backend == "b1"

    async with await tenant_client(stack, "acme") as acme:
        # Submit, stream live, result, events.
        handle = await acme.submit("hello", route="chat", priority="high")
        chunks = [chunk async for chunk in handle.stream(timeout=10)]
        result = await handle.result(timeout=10)
        assert "".join(c.text for c in chunks) == result.text
        # One chunk per network read of the backend's stream: their number
        # varies, but they are numbered from 0 without a gap.
        assert chunks
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        kinds = [type(e).__name__ for e in await handle.events()]
        assert kinds == ["Submitted", "Routed", "Started", "Completed"]

        # A handle for an older request: result from the log, stored tokens replayed.
        older = acme.handle(handle.id)
        assert (await older.result(timeout=10)).text == result.text
        replayed = [chunk async for chunk in older.stream(timeout=10)]
        assert [(c.seq, c.text) for c in replayed] == [(c.seq, c.text) for c in chunks]
        assert len(await older.events()) == 4
        # Unknown request: nothing stored, nothing read, no error.
        assert await acme.handle("no-such-request").events() == []

    await check_refusals(stack, globex_request=theirs.id)
    assert time.monotonic() - started < 15


async def check_refusals(stack: Stack, *, globex_request: str) -> None:
    acme = await raw_tenant(stack, "acme")
    js = acme.nc.jetstream(timeout=REFUSED)
    try:
        # Publishing a request as another tenant: denied, so never acked.
        with pytest.raises(TimeoutError):
            await js.publish(
                request_subject("normal", "globex"), b"{}", headers={"Nats-Msg-Id": "forged-1"}
            )
        await acme.violation('publish to "rq.req.normal.globex"')
        # Putting a request back is the services' alone, even for its own.
        with pytest.raises(TimeoutError):
            await js.publish(
                request_subject("normal", "acme", requeue=True),
                b"{}",
                headers={"Nats-Msg-Id": "acme:x:requeue:1"},
            )
        await acme.violation('publish to "rq.req.normal.acme.requeue"')
        # Cancelling another tenant's request: its cancel subject is not acme's.
        forged = {"v": 2, "kind": "cancel_requested", "request_id": globex_request,
                  "tenant": "globex", "at": 0.0, "reason": "forged"}  # fmt: skip
        with pytest.raises(TimeoutError):
            await js.publish(cancel_subject("globex", globex_request), json.dumps(forged).encode())
        await acme.violation(f'publish to "rq.cancel.globex.{globex_request}"')
        # Nor its own, straight into the log (the subject before RQ_CANCELS).
        with pytest.raises(TimeoutError):
            await js.publish("rq.evt.acme.x.cancel_requested", b"{}")
        await acme.violation('publish to "rq.evt.acme.x.cancel_requested"')
        # Nor reading what others cancel: RQ_CANCELS grants no reads at all.
        with pytest.raises(TimeoutError):
            await js.get_last_msg(
                CANCELS_STREAM, cancel_subject("globex", globex_request), direct=True
            )
        await acme.violation(f'"$js.api.direct.get.rq_cancels.rq.cancel.globex.{globex_request}')

        # Subscribing to another tenant's tokens: denied, nothing arrives.
        received: list[bytes] = []

        async def collect(msg: object) -> None:
            received.append(getattr(msg, "data", b""))

        await acme.nc.subscribe("rq.tok.globex.>", cb=collect)
        await acme.violation('subscription to "rq.tok.globex.>"')
        await stack.services.nc.publish(f"rq.tok.globex.{globex_request}", b"leak")
        await stack.services.nc.flush()
        await asyncio.sleep(0.1)
        assert received == []

        # A consumer on another tenant's events: the create subject names the
        # filter, and that filter is not acme's.
        inbox = acme.nc.new_inbox()
        with pytest.raises(TimeoutError):
            await js.add_consumer(
                EVENTS_STREAM,
                name="peek",
                filter_subject="rq.evt.globex.*.*",
                deliver_subject=inbox,
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
            )
        await acme.violation('"$js.api.consumer.create.rq_events.peek.rq.evt.globex.*.*"')
        # Nor unnamed (an ordered consumer), nor all events.
        with pytest.raises(TimeoutError):
            await js.add_consumer(EVENTS_STREAM, deliver_subject=inbox, ack_policy=AckPolicy.NONE)
        await acme.violation('"$js.api.consumer.create.rq_events"')
        with pytest.raises(TimeoutError):
            await js.add_consumer(
                EVENTS_STREAM, name="all", filter_subject=">", deliver_subject=inbox
            )
        await acme.violation('"$js.api.consumer.create.rq_events.all"')
        # Nor acme's filter in the subject with globex's in the body: the server checks.
        body = {
            "stream_name": EVENTS_STREAM,
            "config": {
                "name": "sly",
                "filter_subjects": ["rq.evt.globex.>"],
                "deliver_subject": inbox,
                "ack_policy": "none",
            },
        }
        reply = await acme.nc.request(
            f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.sly.rq.evt.acme.>",
            json.dumps(body).encode(),
            timeout=2,
        )
        assert "error" in json.loads(reply.data)
        body["config"] = {**body["config"], "filter_subject": "rq.evt.globex.>"}
        del body["config"]["filter_subjects"]
        reply = await acme.nc.request(
            f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.sly.rq.evt.acme.>",
            json.dumps(body).encode(),
            timeout=2,
        )
        assert "did not match" in json.loads(reply.data)["error"]["description"]

        # Direct gets of another tenant's subjects: by subject in the API subject
        # (refused), or by subject in the body (refused whatever the body says).
        with pytest.raises(TimeoutError):
            await js.get_last_msg(
                EVENTS_STREAM, f"rq.evt.globex.{globex_request}.completed", direct=True
            )
        await acme.violation(f'"$js.api.direct.get.rq_events.rq.evt.globex.{globex_request}')
        with pytest.raises(TimeoutError):
            await js.get_msg(
                TOKENS_STREAM,
                seq=1,
                subject=f"rq.tok.globex.{globex_request}",
                next=True,
                direct=True,
            )
        await acme.violation('"$js.api.direct.get.rq_tokens"')
        # An allowed subject with a body asking for another's: the server refuses the body.
        reply = await acme.nc.request(
            f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.rq.evt.acme.x.completed",
            json.dumps({"seq": 1, "next_by_subj": "rq.evt.globex.>"}).encode(),
            timeout=2,
        )
        assert reply.headers is not None
        assert reply.headers.get("Status") == "408"
        assert reply.data == b""
        # The stream API's get, and listing consumers, are not granted at all.
        with pytest.raises(TimeoutError):
            await js.get_msg(EVENTS_STREAM, seq=1)
        await acme.violation('"$js.api.stream.msg.get.rq_events"')
    finally:
        await acme.nc.close()

    # Nothing acme tried reached globex's log.
    svc_log = EventLog(stack.services.js)
    assert await svc_log.history("globex", "forged-1") == []
    assert [type(e).__name__ for e in await svc_log.history("globex", globex_request)][-1] == (
        "Completed"
    )


def test_auth_configs_grant_the_same_permissions() -> None:
    """nats/auth-tls.conf is nats/auth.conf plus TLS: the same accounts, users and permissions."""

    def accounts(path: Path) -> str:
        text = path.read_text()
        return text[text.index("\naccounts {") :]

    assert accounts(AUTH_CONF.with_name("auth-tls.conf")) == accounts(AUTH_CONF)


async def test_tap_deleted_by_the_server_is_recreated_and_nothing_is_missed(
    stack: Stack,
) -> None:
    acme = await tenant_client(stack, "acme")
    acme.tap_heartbeat = 0.3
    try:
        await (await acme.submit("warm up", route="chat")).result(timeout=10)
        # The request ends while the tap is gone (it is noticed only after
        # three silent heartbeats): only the log can resolve it.
        stack.mock.update(ttft=0.3)
        handle = await acme.submit("while the tap is gone", route="chat")
        names = acme._tap.names
        for name in names:
            await stack.services.js.delete_consumer(EVENTS_STREAM, name)
        result = await handle.result(timeout=10)
        assert result.text
        filters = set()
        for name in names:
            info = await stack.services.js.consumer_info(EVENTS_STREAM, name)
            filters.add(info.config.filter_subject)
        # One consumer per terminal kind: the tap sees a request's end, not its steps.
        assert filters == {f"rq.evt.acme.*.{kind}" for kind in TERMINAL_KINDS}
        # The new tap resolves the next request live.
        stack.mock.update(ttft=0.0)
        assert (await (await acme.submit("after", route="chat")).result(timeout=10)).text
    finally:
        started = time.monotonic()
        await acme.close()
        assert time.monotonic() - started < 3
    # Closing deleted the tap.
    for name in names:
        with pytest.raises(NatsNotFoundError):
            await stack.services.js.consumer_info(EVENTS_STREAM, name)
    events = await EventLog(stack.services.js).history("acme", handle.id)
    assert sum(isinstance(e, Completed) for e in events) == 1


async def test_one_of_the_taps_consumers_deleted_is_noticed_though_the_others_beat(
    stack: Stack,
) -> None:
    """Only the ``completed`` consumer is gone; the four others go on sending
    heartbeats. Its own silence is noticed: it is made again, and the result
    that ended meanwhile comes from the log."""
    acme = await tenant_client(stack, "acme")
    acme.tap_heartbeat = 0.3
    try:
        await (await acme.submit("warm up", route="chat")).result(timeout=10)
        stack.mock.update(ttft=0.3)
        handle = await acme.submit("while one consumer is gone", route="chat")
        (completed,) = [name for name in acme._tap.names if name.endswith("-completed")]
        await stack.services.js.delete_consumer(EVENTS_STREAM, completed)
        assert (await handle.result(timeout=10)).text
        info = await stack.services.js.consumer_info(EVENTS_STREAM, completed)
        assert info.config.filter_subject == "rq.evt.acme.*.completed"
    finally:
        await acme.close()


async def test_a_lost_tap_delivery_shows_as_a_gap_and_the_log_resolves_it(stack: Stack) -> None:
    acme = await tenant_client(stack, "acme")
    acme.tap_heartbeat = 0.3
    on_tap = acme._tap._on_message
    dropped: list[bytes] = []

    async def lossy(msg: Any) -> None:
        # Lose the terminal event, as a slow consumer or a reconnect would.
        if b'"kind":"completed"' in msg.data and not dropped:
            dropped.append(msg.data)
            return
        await on_tap(msg)

    acme._tap._on_message = lossy  # type: ignore[method-assign]
    try:
        handle = await acme.submit("lost", route="chat")
        result = await handle.result(timeout=5)
        assert dropped
        assert result.text
    finally:
        await acme.close()


async def test_the_documented_token_replay_works_under_tenant_permissions(stack: Stack) -> None:
    """docs/wire-format.md "Following tokens", step by step with raw requests
    (no client-library helper): a tenant reads its stored chunks and knows
    when it has them all."""
    async with await tenant_client(stack, "acme") as acme:
        handle = await acme.submit("replay me", route="chat")
        text = (await handle.result(timeout=10)).text
    tenant = await raw_tenant(stack, "acme")
    nc = tenant.nc
    subject = f"rq.tok.acme.{handle.id}"
    try:
        # Step 1: last-by-subject direct get, empty body.
        last = await nc.request(f"$JS.API.DIRECT.GET.{TOKENS_STREAM}.{subject}", b"", timeout=2)
        assert last.headers is not None
        last_seq = int(last.headers["Nats-Sequence"])
        # Step 2: a named push consumer with that one filter.
        deliver = f"_INBOX_acme.replay-{handle.id}"
        received: asyncio.Queue[Any] = asyncio.Queue()

        async def collect(msg: Any) -> None:
            received.put_nowait(msg)

        await nc.subscribe(deliver, cb=collect)
        name = f"rq-tok-acme-{handle.id[:8]}"
        body = {
            "stream_name": TOKENS_STREAM,
            "config": {
                "name": name,
                "filter_subject": subject,
                "deliver_subject": deliver,
                "deliver_policy": "all",
                "ack_policy": "none",
                "inactive_threshold": 10_000_000_000,
                "mem_storage": True,
                "num_replicas": 1,
            },
        }
        created = await nc.request(
            f"$JS.API.CONSUMER.CREATE.{TOKENS_STREAM}.{name}.{subject}",
            json.dumps(body).encode(),
            timeout=2,
        )
        assert json.loads(created.data)["num_pending"] > 0
        chunks = []
        while True:
            msg = await asyncio.wait_for(received.get(), 5)
            # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
            parts = msg.reply.split(".")
            chunks.append(json.loads(msg.data))
            if int(parts[5]) >= last_seq or int(parts[8]) == 0:
                break
        deleted = await nc.request(
            f"$JS.API.CONSUMER.DELETE.{TOKENS_STREAM}.{name}", b"", timeout=2
        )
        assert json.loads(deleted.data).get("success") is True
    finally:
        await nc.close()
    assert tenant.errors == []
    assert chunks[-1]["final"] is True
    assert "".join(c.get("text", "") for c in chunks) == text


# ------------------------------------------------ deliveries a tenant can aim
#
# A tenant may create push consumers on its own subjects, and a consumer's
# deliver_subject is in the request body, which no permission checks: the
# server delivers the tenant's own stored messages (on their stored subjects)
# to any subject. Every receiver checks the subject (issue #6, review 1).


def misdirected(receiver: str) -> float:
    """Messages ``receiver`` dropped for their subject (renqueue_misdirected_messages_total)."""
    value = REGISTRY.get_sample_value("renqueue_misdirected_messages_total", {"receiver": receiver})
    return value or 0.0


async def until(condition: Any, what: str, *, bound: float = 10.0) -> None:
    """Poll ``condition`` (an async callable) until it holds, for at most ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def aim(stack: Stack, tenant: Tenant, name: str, stored_on: str, deliver_to: str) -> None:
    """Have ``tenant``'s push consumer deliver what it stored on ``stored_on`` to
    ``deliver_to``, and wait until the server has delivered all of it."""
    js = tenant.nc.jetstream(timeout=2)
    await js.add_consumer(
        EVENTS_STREAM,
        name=name,
        filter_subject=stored_on,
        deliver_subject=deliver_to,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
    )

    async def delivered() -> bool:
        info = await stack.services.js.consumer_info(EVENTS_STREAM, name)
        return info.num_pending == 0 and info.delivered.consumer_seq > 0

    await until(delivered, f"{name} to deliver to {deliver_to}")
    assert tenant.errors == []  # nothing here is refused: the server does it all


async def cancel_as(stack: Stack, tenant: Tenant, name: str, request_id: str, payload: Any) -> int:
    """Publish ``payload`` as ``tenant``'s (named ``name``) cancellation of
    ``request_id`` (on ``RQ_CANCELS``, the one subject of the log's a tenant
    writes), and wait until the log has sourced it: its sequence there."""
    data = json.dumps(payload).encode()
    await tenant.nc.jetstream(timeout=2).publish(cancel_subject(name, request_id), data)
    logged = f"rq.evt.{name}.{request_id}.cancel_requested"
    seq = 0

    async def sourced() -> bool:
        nonlocal seq
        try:
            last = await stack.services.js.get_last_msg(EVENTS_STREAM, logged)
        except NatsNotFoundError:
            return False
        seq = last.seq
        return last.data == data

    await until(sourced, f"the log to source {logged}")
    return seq


async def test_another_tenants_consumer_cannot_inject_tokens_into_a_stream(stack: Stack) -> None:
    acme = await raw_tenant(stack, "acme")
    rid = "victim-stream"
    try:
        # Chunk-shaped payloads on acme's own (tenant-writable) cancel subject.
        carrier = f"rq.evt.acme.{rid}-carrier.cancel_requested"
        for chunk in (
            {"request_id": rid, "delivery": 50, "seq": 0, "text": "INJECTED BY ACME"},
            {"request_id": rid, "delivery": 50, "seq": 1, "final": True},
        ):
            await cancel_as(stack, acme, "acme", f"{rid}-carrier", chunk)
        before = misdirected("tokens")
        async with await tenant_client(stack, "globex") as globex:
            stream = globex.handle(rid).stream(timeout=10)
            first = asyncio.ensure_future(anext(stream))
            # The consumer delivers only once someone listens on the deliver
            # subject: globex's follower, subscribed to rq.tok.globex.<rid>.
            await aim(stack, acme, "carrier-tokens", carrier, f"rq.tok.globex.{rid}")
            assert not first.done()
            handle = await globex.submit("real text", route="chat", request_id=rid)
            chunks = [await first, *[chunk async for chunk in stream]]
            result = await handle.result(timeout=10)
        assert "".join(c.text for c in chunks) == result.text
        assert all(c.delivery == 1 for c in chunks)
        assert misdirected("tokens") >= before + 2
    finally:
        await acme.nc.close()


async def test_a_forged_result_on_the_cancel_subject_resolves_nothing(stack: Stack) -> None:
    """A tenant may write only cancel_requested events: a ``completed`` payload
    there is no result, neither live (the tap), nor in ``events()``."""
    stack.mock.update(ttft=30.0)  # the request runs until it is cancelled
    forger = await raw_tenant(stack, "acme")
    try:
        async with await tenant_client(stack, "acme") as acme:
            handle = await acme.submit("hello", route="chat")
            forged = {
                "kind": "completed",
                "v": 1,
                "request_id": handle.id,
                "tenant": "acme",
                "at": 0.0,
                "backend": "b1",
                "attempt": 1,
                "delivery": 1,
                "text": "FORGED",
                "usage": {"prompt_tokens": 0, "completion_tokens": 0},
                "cost": 1e6,
            }
            await cancel_as(stack, forger, "acme", handle.id, forged)
            # The tap's consumers follow the terminal kinds alone: the forged
            # payload, logged on the cancel subject, is none of theirs.
            logged = f"rq.evt.acme.{handle.id}.cancel_requested"
            assert len(acme._tap.names) == 5
            for name in acme._tap.names:
                info = await stack.services.js.consumer_info(EVENTS_STREAM, name)
                assert info.config.filter_subject is not None
                assert not subject_matches(info.config.filter_subject, logged)
            await handle.cancel()
            with pytest.raises(RequestCancelledError):
                await handle.result(timeout=10)
            kinds = [type(e).__name__ for e in await handle.events()]
            assert "Completed" not in kinds
            assert kinds[-1] == "Cancelled"
    finally:
        await forger.nc.close()


async def test_a_tenants_consumer_cannot_speak_for_the_services(stack: Stack) -> None:
    """rq.boost, rq.capacity and rq.preempt are the services' own subjects: a
    tenant's consumer delivering there is dropped and counted by the routers
    and workers, not acted on."""
    acme = await raw_tenant(stack, "acme")
    try:
        carrier = "rq.evt.acme.carrier.cancel_requested"
        boost = {"leader": "my-batch-job", "rank": 0, "submitted": 0.0}
        await cancel_as(stack, acme, "acme", "carrier", boost)
        for receiver, target in (
            ("boost", "rq.boost.acme"),
            ("capacity", "rq.capacity.b1"),
            ("preempt", "rq.preempt.b1.ask"),
        ):
            before = misdirected(receiver)
            # nats-server 2.15 pushes only to a deliver subject with a literal
            # subscriber (the services' own are wildcards): one listens here,
            # and the services' wildcard subscriptions receive the delivery too.
            listener = await stack.services.nc.client.subscribe(target)
            await aim(stack, acme, f"carrier-{receiver}", carrier, target)
            await listener.unsubscribe()

            async def counted(receiver: str = receiver, before: float = before) -> bool:
                return misdirected(receiver) > before

            await until(counted, f"the {receiver} receiver to drop the delivery")
    finally:
        await acme.nc.close()
    # The services still work.
    async with await tenant_client(stack, "acme") as client:
        handle = await client.submit("after", route="chat")
        assert (await handle.result(timeout=10)).text


async def test_a_tenant_s_oversized_cancellation_is_refused_by_the_broker_and_never_stored(
    stack: Stack,
) -> None:
    """Issue 30 item 4: a 5 MB cancellation used to be stored in the 30-day
    event log (the services then ignored it, but the bytes stayed). A tenant
    may now write cancellations only to RQ_CANCELS, whose max_msg_size is
    MAX_CANCEL_BYTES: on every subject a tenant may cancel on, it is refused
    and the JetStream store does not grow by it. A cancellation within the
    bound still works, through the log."""
    api = JetStreamApi(stack.services.js)

    async def stored() -> int:
        info = await api.call("INFO")
        assert isinstance(info, dict)
        return int(info["storage"])

    acme = await raw_tenant(stack, "acme")
    try:
        huge = json.dumps(
            {"kind": "cancel_requested", "v": 2, "request_id": "big", "tenant": "acme",
             "at": 0.0, "reason": "x" * 5_000_000}
        ).encode()  # fmt: skip
        before = await stored()
        js = acme.nc.jetstream(timeout=2)
        for subject in (cancel_subject("acme", "big"), "rq.evt.acme.big.cancel_requested"):
            with pytest.raises(NatsError):
                await js.publish(subject, huge)
        # The services' own writes meanwhile (the projection's checkpoint) are a few bytes.
        assert await stored() - before < 64 * 1024
        cancels = await stack.services.js.stream_info(CANCELS_STREAM)
        assert cancels.config.max_msg_size == MAX_CANCEL_BYTES
        assert cancels.state.messages == 0
    finally:
        await acme.nc.close()
    stack.mock.update(ttft=30.0)  # the request runs until it is cancelled
    async with await tenant_client(stack, "acme") as client:
        handle = await client.submit("cancel me", route="chat")
        await handle.cancel("a reason within the bound")
        with pytest.raises(RequestCancelledError):
            await handle.result(timeout=10)
