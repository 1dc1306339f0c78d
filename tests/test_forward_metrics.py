"""The forwarder's own metrics, and what a request it refuses is told (docs/metrics.md).

With binding split in groups, one consumer every router reads moves requests
sent without their route to their route's subject (docs/scaling.md). A
platform team must see it work and fail: copies stored
(``renqueue_forwarded_total``), requests refused instead
(``renqueue_forward_rejected_total``), requests handed back to be tried again
(``renqueue_forward_retries_total``) and duplicate acks checked
(``renqueue_forward_duplicates_total``). Each test drives the forwarder on a
real nats-server and reads the series from prometheus_client's registry (the
one ``--metrics-port`` serves; tests/test_metrics_docs.py scrapes it), as a
difference: other tests of the process count too.

A request refused because its tenant's route subject is full is ended
``rejected``, ``tenant_backlog_full``; its reason is what the gateway and the
Python client show the user, so it says what happened and what to do, without
the broker's status and error codes.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY
from test_forward_backlog import BACKLOG, LEVEL, body, forwarding, publish, waiting

from renqueue.broker import EmbeddedServer, EventLog
from renqueue.coordination import cluster_families, read_cluster
from renqueue.schema import Rejected, msg_id, request_subject
from renqueue.services.router._forward import open_forwarding


def sample(name: str, **labels: str) -> float:
    """The series' value in this process (0 before its first count)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_forwarded_request_is_counted_by_route_and_level(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    forwarded = {"route": "r1", "priority": LEVEL}
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        before = sample("renqueue_forwarded_total", **forwarded)
        await publish(js, "t", "x")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        assert await waiting(js, request_subject(LEVEL, "t", route="r1")) == 1
    assert sample("renqueue_forwarded_total", **forwarded) == before + 1


async def test_a_request_over_its_tenants_backlog_is_counted_and_told_why_in_plain_words(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """Refused by the tenant's full route subject: counted as a rejection,
    not a forward, and its ``rejected`` event's reason is one sentence for
    the user: the backlog is full, retry later under a new id. Before, the
    reason ended with the broker's ``(status 503, err_code 10077)``."""
    rejected = {"error_type": "tenant_backlog_full"}
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        before = sample("renqueue_forward_rejected_total", **rejected)
        for n in range(BACKLOG):
            await publish(js, "flood", f"waiting-{n}", route="r1")
        await publish(js, "flood", "over")
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
        [ended] = await EventLog(js).history("flood", "over", kind="rejected")
    assert sample("renqueue_forward_rejected_total", **rejected) == before + 1
    assert isinstance(ended, Rejected)
    assert ended.error_type == "tenant_backlog_full"
    assert ended.reason == (
        f"Tenant flood's backlog for route r1 at level {LEVEL} is full: it already has "
        "as many requests waiting there as router.tenant_backlog allows, so this request "
        "was not queued. Retry later, under a new request id, once some of them have started."
    )
    for internal in ("status", "err_code", "503", "10077"):
        assert internal not in ended.reason


async def test_a_put_back_refused_by_its_full_route_is_counted_as_a_retry(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A put-back (the services' own) is handed back, not refused: a retry of
    kind ``put_back``, for the broker's refusal's code."""
    retried = {"kind": "put_back", "reason": "tenant_backlog_full"}
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        before = sample("renqueue_forward_retries_total", **retried)
        refused = sample("renqueue_forward_rejected_total", error_type="tenant_backlog_full")
        for n in range(BACKLOG):
            await publish(js, "t", f"put-back-{n}", route="r1", requeue=True)
        await publish(js, "t", "preempted", requeue=True)
        psub = await open_forwarding(js)
        [msg] = await psub.fetch(batch=1, timeout=10)
        await forwarder._forward([msg])
    assert sample("renqueue_forward_retries_total", **retried) == before + 1
    assert sample("renqueue_forward_rejected_total", error_type="tenant_backlog_full") == refused


async def test_duplicate_acks_are_counted_by_what_their_check_found(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """A duplicate whose message is the copy itself (an earlier try's, still
    waiting) is ``stored``; one whose id another tenant took first, on its own
    subject, is ``republished`` (the copy is stored again under a suffixed id)."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, _config, forwarder):
        stored = sample("renqueue_forward_duplicates_total", outcome="stored")
        republished = sample("renqueue_forward_duplicates_total", outcome="republished")
        # An earlier try's copy of t's request "mine", stored (its ack lost).
        await js.publish(
            request_subject(LEVEL, "t", route="r1"),
            body("t", "mine"),
            headers={"Nats-Msg-Id": msg_id("t", "mine", "forwarded")},
        )
        # Tenant u takes the id t's copy of "theirs" will be forwarded under.
        await js.publish(
            request_subject(LEVEL, "u", route="r1"),
            body("u", "theirs"),
            headers={"Nats-Msg-Id": msg_id("t", "theirs", "forwarded")},
        )
        await publish(js, "t", "mine")
        await publish(js, "t", "theirs")
        psub = await open_forwarding(js)
        msgs = await psub.fetch(batch=2, timeout=10)
        while len(msgs) < 2:
            msgs += await psub.fetch(batch=2 - len(msgs), timeout=10)
        await forwarder._forward(msgs)
        assert forwarder.forwarded == 2
        assert await waiting(js, request_subject(LEVEL, "t", route="r1")) == 2
    assert sample("renqueue_forward_duplicates_total", outcome="stored") == stored + 1
    assert sample("renqueue_forward_duplicates_total", outcome="republished") == republished + 1


async def test_the_exporter_shows_the_requests_waiting_to_be_forwarded(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    """The cluster-wide view (``renqueue_forward_waiting_requests``, alert
    ``ForwardingStalled``): requests sent without their route, at the
    forwarding consumer and not yet acked, whichever router will forward them;
    none once they are forwarded."""
    async with forwarding(tmp_path, isolated_server) as (_nc, js, config, forwarder):
        await publish(js, "t", "x")
        await publish(js, "t", "y")
        waiting_two = await read_cluster(js, config)
        psub = await open_forwarding(js)
        msgs = await psub.fetch(batch=2, timeout=10)
        while len(msgs) < 2:
            msgs += await psub.fetch(batch=2 - len(msgs), timeout=10)
        await forwarder._forward(msgs)
        forwarded = await read_cluster(js, config)
    assert waiting_two.forward_waiting == 2
    assert forwarded.forward_waiting == 0
    # The ack floor (alert ForwardingStalled) moves on as requests are forwarded.
    assert waiting_two.forward_floor is not None
    assert forwarded.forward_floor is not None
    assert forwarded.forward_floor > waiting_two.forward_floor
    families = cluster_families(waiting_two, config, up=True, term=1)
    [family] = [f for f in families if f.name == "renqueue_forward_waiting_requests"]
    assert [s.value for s in family.samples] == [2.0]
    [floor] = [f for f in families if f.name == "renqueue_forward_ack_floor"]
    assert [s.value for s in floor.samples] == [float(waiting_two.forward_floor)]
