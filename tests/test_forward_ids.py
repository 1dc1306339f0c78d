"""A forwarded copy's message id taken first by another tenant (docs/scaling.md).

The forwarder publishes a request's copy under ``<tenant>:<id>:forwarded``.
Deduplication is stream-wide and tenants publish into the requests stream with
ids of their choice: tenant ``u`` may publish, on its own subject, a message
whose ``Nats-Msg-Id`` is ``t:x:forwarded`` before ``t`` submits ``x``. Read as
"stored", the duplicate ack would have ``t``'s original acked with no copy of
it anywhere: the request lost. A duplicate counts only when the message it
names is still there, on the copy's subject, with its payload (as the
services' put-backs, :func:`renqueue.broker.publish_stored`); otherwise the
copy is published again under a suffixed id, which admission accepts. These
tests pin that on a real nats-server: the forwarder alone (the id's message
still there, or gone as its binder would have rejected it), a copy stored by
an earlier try not stored twice, and end to end, the request served.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from test_binder_groups import stack
from test_forward_backlog import BACKLOG, LEVEL, body, forwarding, publish, waiting

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer, EventLog, JetStream
from renqueue.errors import NatsNotFoundError
from renqueue.schema import (
    REQUEST_DECODER,
    REQUESTS_STREAM,
    Rejected,
    is_terminal,
    msg_id,
    request_subject,
    submitted,
)
from renqueue.services.router._forward import open_forwarding
from renqueue.services.router._hold import stored_at

TENANT = "t"
#: The tenant that takes ``TENANT``'s copy's id first.
OTHER = "u"


async def take_the_copys_id(js: JetStream, request_id: str) -> int:
    """``OTHER`` publishes, on its own route subject, a request of its own under
    the id ``TENANT``'s copy of ``request_id`` will be forwarded under; its
    stream sequence."""
    ack = await js.publish(
        request_subject(LEVEL, OTHER, route="r1"),
        body(OTHER, request_id),
        headers={"Nats-Msg-Id": msg_id(TENANT, request_id, "forwarded")},
    )
    assert not ack.duplicate
    return ack.seq


async def stored_ids(js: JetStream, subject: str) -> list[str]:
    """The ``Nats-Msg-Id`` of each message stored on ``subject``."""
    ids: list[str] = []
    seq = 0
    while True:
        try:
            stored = await js.get_msg(REQUESTS_STREAM, seq=seq + 1, subject=subject, next=True)
        except NatsNotFoundError:  # none left
            return ids
        seq = stored.seq
        ids.append(str((stored.headers or {}).get("Nats-Msg-Id")))


@pytest.mark.parametrize("taker", ["still-there", "gone"])
async def test_another_tenant_taking_the_copys_id_first_does_not_lose_the_request(
    tmp_path: Path, isolated_server: EmbeddedServer, taker: str
) -> None:
    """``u`` took ``t:x:forwarded`` first (its message still waiting on its own
    subject, or already gone, as its binder rejects and acks it): ``t``'s copy
    is stored all the same, under that id and a suffix, on ``t``'s route
    subject, and only then is ``t``'s original acked."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        seq = await take_the_copys_id(js, "x")
        if taker == "gone":
            assert await js.delete_msg(REQUESTS_STREAM, seq)
        await publish(js, TENANT, "x")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        routed = request_subject(LEVEL, TENANT, route="r1")
        [stored] = await stored_ids(js, routed)
        assert stored.startswith(msg_id(TENANT, "x", "forwarded") + ":")
        assert await waiting(js, request_subject(LEVEL, TENANT)) == 0
        assert forwarder.forwarded == 1


async def test_a_copy_stored_by_an_earlier_try_is_not_stored_twice(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A copy stored while its ack was lost, still waiting on the route
    subject: forwarded again, the duplicate is that copy (same subject, same
    payload), so nothing more is stored."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        routed = request_subject(LEVEL, TENANT, route="r1")
        await js.publish(
            routed, body(TENANT, "x"), headers={"Nats-Msg-Id": msg_id(TENANT, "x", "forwarded")}
        )
        await publish(js, TENANT, "x")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert await stored_ids(js, routed) == [msg_id(TENANT, "x", "forwarded")]
        assert await waiting(js, request_subject(LEVEL, TENANT)) == 0
        assert forwarder.forwarded == 1


async def test_a_copy_an_earlier_try_stored_and_its_binder_read_since_is_not_stored_again(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A copy stored while its ack was lost (its router killed), then read by
    its binder (gone from the stream, the request admitted): forwarded again
    by another router, the duplicate names nothing left, but the request's
    ``submitted`` event says the copy was its own. Nothing more is stored
    (a second copy, under a suffixed id, was dead-lettered as a copy by its
    binder: the suite's router-kill test saw that dead letter)."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        routed = request_subject(LEVEL, TENANT, route="r1")
        data = body(TENANT, "x")
        ack = await js.publish(
            routed, data, headers={"Nats-Msg-Id": msg_id(TENANT, "x", "forwarded")}
        )
        assert await js.delete_msg(REQUESTS_STREAM, ack.seq)  # read and acked by its binder
        await EventLog(js).append(submitted(REQUEST_DECODER.decode(data), at=time.time()))
        await publish(js, TENANT, "x")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert await stored_ids(js, routed) == []
        assert await waiting(js, request_subject(LEVEL, TENANT)) == 0
        assert forwarder.forwarded == 1
        assert (await js.stream_info("RQ_DLQ")).state.messages == 0


async def test_a_request_whose_copys_id_was_taken_is_served_end_to_end(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """With the services running, ``u`` takes ``t``'s copy's id first, then
    ``t`` submits without the route: admission takes the copy under its
    suffixed id, and the request is served."""
    async with (
        stack(tmp_path, isolated_server) as (_file, config),
        Services(config, routers=1) as services,
        Client(services.nc, tenant=TENANT) as client,
    ):
        js = services.js
        await take_the_copys_id(js, "x")
        request = client.build_request("hi", route="r1", request_id="x")
        await js.publish(
            request_subject(LEVEL, TENANT),
            msgspec.json.encode(request),
            headers={"Nats-Msg-Id": msg_id(TENANT, "x")},
        )
        assert (await client.handle("x").result(timeout=20)).text
        assert services.supervisor.reason is None


@pytest.mark.parametrize("copy", ["stored-by-a-lost-ack", "sent-again"])
async def test_a_copy_over_the_backlog_of_a_request_admitted_elsewhere_does_not_end_it(
    tmp_path: Path, isolated_server: EmbeddedServer, copy: str
) -> None:
    """Request ``x`` was admitted (its ``submitted`` event logged; it may be
    running) from another message than the one forwarded now: a copy an
    earlier try stored whose ack was lost, since bound and gone (the
    duplicate names nothing left, but the request is admitted: that copy was
    its own, and nothing is sent again), or the same request sent again by
    its tenant under another header. Its tenant's route subject is now full.
    The copy refused is dead-lettered as a copy (as the binder's
    :meth:`Endings.reject_copy`), and the request is not ended ``rejected``
    under the run that may be serving it."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        routed = request_subject(LEVEL, TENANT, route="r1")
        data = body(TENANT, "x")
        header = msg_id(TENANT, "x")
        if copy == "stored-by-a-lost-ack":
            ack = await js.publish(
                routed, data, headers={"Nats-Msg-Id": msg_id(TENANT, "x", "forwarded")}
            )
            assert await js.delete_msg(REQUESTS_STREAM, ack.seq)  # bound
        else:
            header = msg_id(TENANT, "x", "again")
        request = REQUEST_DECODER.decode(data)
        await EventLog(js).append(submitted(request, at=time.time()))
        for n in range(BACKLOG):
            await publish(js, TENANT, f"waiting-{n}", route="r1")
        await js.publish(request_subject(LEVEL, TENANT), data, headers={"Nats-Msg-Id": header})
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert [e for e in await EventLog(js).history(TENANT, "x") if is_terminal(e)] == []
        assert await waiting(js, request_subject(LEVEL, TENANT)) == 0
        if copy == "stored-by-a-lost-ack":
            # The copy gone was its own (the request is admitted): not sent again.
            assert (await js.stream_info("RQ_DLQ")).state.messages == 0
            assert forwarder.forwarded == 1
            return
        letter = await js.get_last_msg("RQ_DLQ", "rq.dlq.requests")
        assert (letter.headers or {}).get("Nats-Msg-Id") == msg_id(
            TENANT, "x", "dlq", "requests", f"rejected-{msg.metadata.sequence.stream}"
        )
        assert forwarder.forwarded == 0


async def test_a_request_admitted_from_the_very_message_forwarded_is_ended_over_the_backlog(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A ``submitted`` event at the forwarded message's own storing: the
    request was admitted from it (held by an unsplit binder before binding
    was split), so that message is the request, not a copy of it: over its
    tenant's backlog it is ended ``rejected`` (dropped as a copy, it would be
    lost)."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        for n in range(BACKLOG):
            await publish(js, TENANT, f"waiting-{n}", route="r1")
        await publish(js, TENANT, "x")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        request = REQUEST_DECODER.decode(msg.data)
        await EventLog(js).append(submitted(request, at=stored_at(msg)))
        await forwarder._forward([msg])
        [ended] = await EventLog(js).history(TENANT, "x", kind="rejected")
        assert isinstance(ended, Rejected)
        assert ended.error_type == "tenant_backlog_full"
        assert await waiting(js, request_subject(LEVEL, TENANT)) == 0
