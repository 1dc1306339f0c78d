"""Bounded storage and input (issue 30, items 4 and 7): every store has a byte
limit sized from the config, admission range-checks what a request carries,
a hostile rejection's dead letter is an excerpt, and a full store is a typed
error that loses nothing and passes when room comes back. Pure rules first,
then on real nats-servers with the mock backend over loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats.js.errors
import pytest
from _waits import until

from renqueue import Client, RequestRejectedError, Services, parse_config
from renqueue.broker import (
    DLQ_HOSTILE_EXCERPT,
    STORES,
    Connection,
    EmbeddedServer,
    EventLog,
    JetStream,
    connect,
    provision,
    translate,
)
from renqueue.config import LEASE_BYTES, STORE_SHARES, Config, load_config
from renqueue.coordination import NEAR_LIMIT, read_status, render_status
from renqueue.coordination._cancellation import cancel_of
from renqueue.errors import ConfigError, OutOfRangeError, ProvisionError, StoreFullError
from renqueue.gateway import ApiError, Gateway, digest
from renqueue.gateway._errors import from_terminal
from renqueue.gateway._openai import parse_chat
from renqueue.gateway._openai import translate as translate_chat
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import validate
from renqueue.schema import (
    DLQ_STREAM,
    EVENTS_STREAM,
    MAX_EXTRA_BYTES,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    TERMINAL_BUCKET,
    CancelRequested,
    ChatMessage,
    GenerationParams,
    InferenceRequest,
    Rejected,
    encode,
    event_subject,
    is_terminal,
    kind_of,
    msg_id,
    request_subject,
)

TENANT = "t"
HI = {"role": "user", "content": "hi"}
FAST = MockSettings(ttft=0.0, output_tokens=3)


def config_of(url: str = "", backend: str = "http://127.0.0.1:1", **nats: Any) -> Config:
    return parse_config(
        {
            "nats": {"url": url, **nats} if url else nats,
            "backends": {"b": {"base_url": backend, "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"retry_delay": "10ms", "max_retry_delay": "20ms"},
            "router": {"capacity_refresh": "20ms"},
        }
    )


def request_of(**fields: Any) -> InferenceRequest:
    base: dict[str, Any] = {"id": "r", "tenant": TENANT, "route": "chat"}
    return InferenceRequest(messages=[ChatMessage(role="user", content="hi")], **(base | fields))


# ----------------------------------------------------------------- the config


def test_every_store_gets_its_share_of_max_file_store_and_they_fit_in_it() -> None:
    nats_config = parse_config({"nats": {"max_file_store": "1GB"}}).nats
    assert nats_config.store_bytes == 1024**3
    sizes = {store: nats_config.max_bytes(store) for store in STORE_SHARES}
    assert sizes["events"] == int(1024**3 * 0.40)
    assert all(size > 0 for size in sizes.values())
    assert sum(sizes.values()) + LEASE_BYTES <= nats_config.store_bytes
    # The default: 16 GiB, every store bounded.
    assert parse_config({}).nats.max_bytes("tokens") == int(16 * 1024**3 * 0.15)


def test_a_store_may_be_sized_on_its_own_and_sizes_that_do_not_fit_fail_at_load() -> None:
    nats_config = parse_config(
        {"nats": {"events": {"max_bytes": "512MB"}, "claims": {"max_bytes": 1_000_000}}}
    ).nats
    assert nats_config.max_bytes("events") == 512 * 1024**2
    assert nats_config.max_bytes("claims") == 1_000_000
    with pytest.raises(ConfigError, match=r"add up to .* over max_file_store.*at \$\.nats"):
        parse_config({"nats": {"max_file_store": "10MB", "events": {"max_bytes": "20MB"}}})
    with pytest.raises(ConfigError, match=r"nats\.max_file_store"):
        parse_config({"nats": {"max_file_store": "lots"}})


@pytest.mark.parametrize("store", sorted(STORE_SHARES))
def test_a_store_with_no_byte_limit_is_refused_at_load_saying_why(store: str) -> None:
    """Issue 30 item 4: every store is bounded. ``max_bytes = -1`` (the
    committed renqueue.toml had it for the event log) was taken as "no limit
    of its own", which lets one store fill the server's whole store."""
    with pytest.raises(ConfigError, match=rf"no limit.*must be bounded.*at \$\.nats\.{store}"):
        parse_config({"nats": {store: {"max_bytes": -1}}})


def test_a_jetstream_store_with_no_limit_is_refused_at_load_saying_why() -> None:
    with pytest.raises(ConfigError, match=r"max_file_store = -1 \(no limit\).*must be bounded"):
        parse_config({"nats": {"max_file_store": -1}})


def test_the_committed_config_bounds_every_store() -> None:
    nats_config = load_config(Path(__file__).parents[1] / "renqueue.toml").nats
    assert all(nats_config.max_bytes(store) > 0 for store in STORE_SHARES)


async def test_a_store_sized_zero_is_refused_at_load_not_left_unlimited(
    isolated_nc: Connection,
) -> None:
    """Review finding: ``max_bytes = 0`` (or a size that rounds down to 0
    bytes) passed the config, and JetStream reads a 0 as no limit: the store
    meant to be the smallest was unbounded."""
    await isolated_nc.client.jetstream().add_stream(name="ZERO", subjects=["zero"], max_bytes=0)
    info = await isolated_nc.jetstream().stream_info("ZERO")
    assert info.config.max_bytes == -1  # the server's reading of 0
    for zero in (0, "0MB", "0.0001K"):
        with pytest.raises(ConfigError, match=r"events\.max_bytes is 0 bytes"):
            parse_config({"nats": {"events": {"max_bytes": zero}}})


# ------------------------------------------------------------- the admission


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"v": 0}, "v"),
        ({"v": -1}, "v"),
        ({"params": {"stop": ["x" * 5_000_000]}}, r"params\.stop\[0\]"),
        ({"params": {"stop": ["ok", ""]}}, r"params\.stop\[1\]"),
        ({"params": {"seed": 2**70}}, r"params\.seed"),
        ({"params": {"seed": -(2**63) - 1}}, r"params\.seed"),
        ({"deadline": 1e300}, "deadline"),
        ({"deadline": time.time() + 31 * 86400}, "deadline"),
        ({"metadata": {f"k{i}": "v" * 300 for i in range(60)}}, "metadata"),
        # Issue 30 item 4: an unknown parameter of 5 MB went to the backend and the log.
        ({"params": {"extra": {"top_k": 40, "guided_json": "x" * 5_000_000}}}, r"params\.extra"),
        ({"params": {"extra": {f"k{i}": "v" * 1100 for i in range(60)}}}, r"params\.extra"),
    ],
)
def test_fields_past_their_bounds_are_rejected_out_of_range(
    raw: dict[str, Any], field: str
) -> None:
    """As the router reads them off the wire: the soak found each accepted."""
    body = {
        "id": "r",
        "tenant": TENANT,
        "route": "chat",
        "messages": [{"role": "user", "content": "hi"}],
    }
    request = REQUEST_DECODER.decode(json.dumps({**body, **raw}))
    with pytest.raises(OutOfRangeError, match=f"^{field}: ") as caught:
        validate(request, level="normal", tenant=TENANT, config=config_of(), now=time.time())
    assert caught.value.code == "out_of_range"


def test_fields_at_their_bounds_pass() -> None:
    request = request_of(
        params=GenerationParams(stop=["x" * 500] * 16, seed=2**63 - 1),
        deadline=time.time() + 29 * 86400,
        metadata={f"k{i}": "v" * 510 for i in range(30)},  # more than OpenAI's 16 x 576
    )
    request = msgspec.structs.replace(
        request,
        params=msgspec.structs.replace(
            request.params, extra={"top_k": 40, "guided_json": "x" * (MAX_EXTRA_BYTES - 40)}
        ),
    )
    assert len(msgspec.json.encode(request.params.extra)) <= MAX_EXTRA_BYTES
    validate(request, level="normal", tenant=TENANT, config=config_of(), now=time.time())
    validate(msgspec.structs.replace(request, v=1, params=GenerationParams(seed=-(2**63))),
             level="normal", tenant=TENANT, config=config_of())  # fmt: skip


def test_an_out_of_range_rejection_names_the_field_to_an_openai_client() -> None:
    event = Rejected(
        request_id="r",
        tenant=TENANT,
        at=0.0,
        error_type="out_of_range",
        reason="params.stop[0]: a stop sequence has 1 to 500 characters, this one 5000000",
    )
    answer = from_terminal(event, now=0.0)
    assert (answer.status, answer.code, answer.param) == (400, "out_of_range", "stop")


def test_the_gateway_refuses_metadata_over_its_bound_before_submitting() -> None:
    body = {"model": "chat", "messages": [HI], "metadata": {f"k{i}": "v" * 500 for i in range(40)}}
    chat = parse_chat(json.dumps(body).encode())
    with pytest.raises(ApiError) as caught:
        translate_chat(chat, {}, levels=["normal"], default_level="normal", now=0.0)
    assert (caught.value.status, caught.value.code, caught.value.param) == (
        400,
        "out_of_range",
        "metadata",
    )


def test_a_cancellation_over_its_bound_is_no_cancellation() -> None:
    subject = event_subject(TENANT, "r", "cancel_requested")

    def cancel(reason: str) -> bytes:
        return encode(CancelRequested(request_id="r", tenant=TENANT, at=1.0, reason=reason))

    assert cancel_of(subject, cancel("changed my mind")) is not None
    assert cancel_of(subject, cancel("x" * 1001)) is None
    assert cancel_of(subject, cancel("x" * 5_000_000)) is None


@pytest.mark.parametrize(
    ("err_code", "description"),
    [(10077, "maximum bytes exceeded"), (10023, "insufficient resources")],
)
def test_a_full_stream_or_store_is_store_full(err_code: int, description: str) -> None:
    """Both come with status 503, which read as "not now": a submit retried
    them for its whole patience, and the gateway's queue_full never fired."""
    raw = nats.js.errors.ServiceUnavailableError(
        code=503, err_code=err_code, description=description
    )
    error = translate(raw)
    assert isinstance(error, StoreFullError)
    assert (error.code, error.err_code) == ("store_full", err_code)


# --------------------------------------------------------- on a nats-server


async def test_provisioning_gives_every_stream_and_bucket_its_max_bytes(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    config = config_of(isolated_server.url, max_file_store="256MB")
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    limits = {name: (await js.stream_info(name)).config for name in STORES}
    assert limits[REQUESTS_STREAM].max_bytes == config.nats.max_bytes("requests")
    assert limits[EVENTS_STREAM].max_bytes == config.nats.max_bytes("events")
    assert limits["KV_rq-terminal"].max_bytes == config.nats.max_bytes("claims")
    assert limits["KV_rq-leases"].max_bytes == LEASE_BYTES
    assert all((c.max_bytes or -1) > 0 for c in limits.values())
    # The event log refuses rather than drop events of requests under way.
    discard = limits[EVENTS_STREAM].discard
    assert getattr(discard, "value", discard) == "new"


async def publish_until_full(js: JetStream, tenant: str, count: int = 200) -> int:
    """Publish on ``tenant``'s normal level until the store refuses (1 KB
    messages, then 100 bytes, then 10: no room left for a small request), or
    until ``count`` are stored; how many were stored."""
    stored = 0
    for size in (1000, 100, 10):
        while stored < count:
            try:
                await js.publish(
                    request_subject("normal", tenant),
                    b"x" * size,
                    headers={"Nats-Msg-Id": f"{tenant}:filler-{stored}"},
                )
            except StoreFullError:
                break
            stored += 1
    return stored


async def test_an_asynchronous_publish_to_a_full_stream_ends_with_store_full(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    """nats-py 2.16 raised a JetStream error inside its ack handler: the
    future of a ``publish_async`` to a full stream waited out its timeout
    (the router's "no acks for the decision within 10 s", the worker's "1 of
    2 publishes unacknowledged after 5 s"), as if the broker were gone."""
    await provision(isolated_nc, config_of(isolated_server.url, requests={"max_bytes": 8 * 1024}))
    js = isolated_nc.jetstream()
    assert await publish_until_full(js, TENANT) > 0
    ack = await js.publish_async(
        request_subject("normal", TENANT), b"x" * 1000, headers={"Nats-Msg-Id": "t:one-more"}
    )
    with pytest.raises(StoreFullError) as caught:
        await ack
    assert caught.value.err_code == 10077


async def fill(
    client: Client, prefix: str, size: int = 900, limit: int = 2000
) -> tuple[list[str], StoreFullError]:
    """Submit prompts of ``size`` characters until the store refuses: the ids
    it took, and the refusal."""
    taken: list[str] = []
    for index in range(limit):
        try:
            await client.submit("x" * size, route="chat", request_id=f"{prefix}-{index}")
        except StoreFullError as exc:
            return taken, exc
        taken.append(f"{prefix}-{index}")
    pytest.fail(f"{limit} requests stored and the store never refused one")


async def test_a_full_requests_stream_refuses_submits_loses_nothing_and_recovers(
    isolated_server: EmbeddedServer,
) -> None:
    """Issue 30 item 7, a stream's byte limit reached: the submitter gets
    StoreFullError at once, every request stored before runs to its end, and
    once they have drained the stream takes requests again."""
    async with MockBackend(FAST) as mock:
        config = config_of(isolated_server.url, mock.url, requests={"max_bytes": 64 * 1024})
        nc = await connect(isolated_server.url, name="filler")
        try:
            await provision(nc, config)
            async with Client(nc, tenant=TENANT) as client:
                taken, refused = await fill(client, "full")
        finally:
            await nc.close()
        assert refused.err_code == 10077
        assert 20 < len(taken) < 80
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            results = [await client.handle(rid).result(timeout=30) for rid in taken]
            assert all(result.text for result in results)
            again = await client.submit("room again", route="chat")
            assert (await again.result(timeout=30)).text
            # Each ended once: nothing lost, nothing run twice.
            log = EventLog(client.js)
            for rid in taken:
                ends = [e for e in await log.history(TENANT, rid) if is_terminal(e)]
                assert [kind_of(e) for e in ends] == ["completed"]


async def test_requests_wait_for_room_in_a_full_dispatch_queue_and_none_fails(
    isolated_server: EmbeddedServer,
) -> None:
    """A backend's dispatch queue at its byte limit: a bind refused
    ``store_full`` is no failed dispatch. Before, each refusal counted
    against ``router.max_deliver`` and waiting requests ended
    ``undeliverable`` after ten of them (a few seconds)."""
    slow = MockSettings(ttft=0.4, output_tokens=2)
    async with MockBackend(slow) as mock:
        config = parse_config(
            {
                "nats": {"url": isolated_server.url, "dispatch": {"max_bytes": 3 * 1024}},
                "backends": {
                    "b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 8}}
                },
                "routes": {"chat": {"backends": ["b"]}},
                "router": {"capacity_refresh": "20ms", "max_deliver": 3},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handles = [
                await client.submit("y" * 600, route="chat", request_id=f"d-{i}") for i in range(12)
            ]
            results = [await handle.result(timeout=60) for handle in handles]
    assert all(result.text for result in results)


async def test_a_full_event_log_stops_work_without_losing_it_until_its_limit_is_raised(
    isolated_server: EmbeddedServer,
) -> None:
    """The event log refuses new events when full (``discard: new``): the
    services wait instead of dropping the events of requests under way.
    Once its limit is raised (provisioned again), every request submitted
    meanwhile ends, once each."""
    async with MockBackend(FAST) as mock:
        small = config_of(isolated_server.url, mock.url, events={"max_bytes": 24 * 1024})
        async with Services(small) as services, Client(services.nc, tenant=TENANT) as client:
            handles = [
                await client.submit("z" * 300, route="chat", request_id=f"e-{i}") for i in range(40)
            ]
            js = client.js

            async def log_full() -> bool:
                info = await js.stream_info(EVENTS_STREAM)
                return (info.state.bytes or 0) > 20 * 1024

            await until(log_full, "the event log is nearly full")
            ended = [h.id for h in handles if any(is_terminal(e) for e in await h.events())]
            assert len(ended) < len(handles), "every request ended in 24 KB of events"
            raised = config_of(isolated_server.url, mock.url, events={"max_bytes": "8MB"})
            assert services.nc is not None
            await provision(services.nc, raised)
            results = [await h.result(timeout=60) for h in handles]
            assert all(result.text for result in results)
            log = EventLog(js)
            for handle in handles:
                ends = [e for e in await log.history(TENANT, handle.id) if is_terminal(e)]
                assert [kind_of(e) for e in ends] == ["completed"]
        # Review finding: a run's ``started`` refused by the full log was seen
        # only after its backend call; the run was handed back and called
        # again, every redelivery, until the log had room.
        assert mock.stats().requests == len(handles), "a backend was called again"


async def test_a_full_claims_bucket_holds_finished_runs_instead_of_calling_the_backend_again(
    isolated_server: EmbeddedServer,
) -> None:
    """The terminal claims' bucket refuses new claims when full (``discard:
    new``), while the event log still has room. A run that finished on its
    backend then cannot record its outcome: its worker holds the outcome and
    writes it once there is room, instead of handing the dispatch back to be
    run (and its backend paid) again on every redelivery. Once the limit is
    raised every request ends completed, and the backend was called once per
    request."""
    count = 24
    async with MockBackend(FAST) as mock:
        small = config_of(isolated_server.url, mock.url, claims={"max_bytes": 6 * 1024})
        async with Services(small) as services, Client(services.nc, tenant=TENANT) as client:
            handles = [
                await client.submit("c" * 100, route="chat", request_id=f"c-{i}")
                for i in range(count)
            ]
            js = client.js

            async def a_run_could_not_claim() -> bool:
                info = await js.stream_info(f"KV_{TERMINAL_BUCKET}")
                return mock.stats().completed > (info.state.messages or 0)

            await until(a_run_could_not_claim, "a finished run finds the claims bucket full")
            raised = config_of(isolated_server.url, mock.url, claims={"max_bytes": "8MB"})
            assert services.nc is not None
            await provision(services.nc, raised)
            results = [await h.result(timeout=60) for h in handles]
        assert all(result.text for result in results)
        assert mock.stats().requests == count, "a finished run's backend was called again"


async def test_a_stream_at_its_limit_takes_requests_again_once_the_limit_is_raised(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    """Room back without draining: ``nats.requests.max_bytes`` raised and
    provisioned again (the update applies in place)."""
    small = config_of(isolated_server.url, requests={"max_bytes": 16 * 1024})
    await provision(isolated_nc, small)
    async with Client(isolated_nc, tenant=TENANT) as client:
        taken, _ = await fill(client, "raise")
        await provision(isolated_nc, config_of(isolated_server.url, requests={"max_bytes": "1MB"}))
        handle = await client.submit("after the raise", route="chat", request_id="raised")
    assert not handle.duplicate
    info = await isolated_nc.jetstream().stream_info(REQUESTS_STREAM)
    assert info.state.messages == len(taken) + 1


async def test_a_full_server_store_refuses_submits_and_nothing_is_lost_when_it_grows(
    tmp_path: Path,
) -> None:
    """Item 7 on a small store: the embedded server capped at 2 MB
    (``max_file_store``), shared with a stream that is not Ren-Queue's and
    has no byte limit (every store of Ren-Queue's has one: a config without
    is refused), which fills the server's store. Then nothing can write,
    not even the services (docs/operations.md#storage): submits are refused
    ``store_full``, and once the store is given room (the server started
    again with a bigger cap) every request stored before runs to its end."""
    data = tmp_path / "nats"
    small, big = 2 * 1024 * 1024, 64 * 1024 * 1024
    config = config_of("", max_file_store=small)
    async with EmbeddedServer(data, port=-1, max_file_store=small) as server:
        nc = await connect(server.url, name="filler")
        try:
            await provision(nc, config)
            js = nc.jetstream()
            await js.context.add_stream(name="OTHER", subjects=["other.>"])
            async with Client(nc, tenant=TENANT) as client:
                taken = [f"tiny-{n}" for n in range(3)]
                for rid in taken:
                    await client.submit("x" * 20_000, route="chat", request_id=rid)
                for _ in range(100):
                    try:
                        await js.publish("other.fill", b"o" * 100_000)
                    except StoreFullError:
                        break
                else:
                    pytest.fail("the server's store never filled")
                with pytest.raises(StoreFullError) as refused:
                    await client.submit("x" * 20_000, route="chat", request_id="tiny-refused")
        finally:
            await nc.close()
    assert refused.value.err_code == 10023
    async with (
        EmbeddedServer(data, port=-1, max_file_store=big) as server,
        MockBackend(FAST) as mock,
    ):
        config = config_of(server.url, mock.url, max_file_store=small)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            for rid in taken:
                assert (await client.handle(rid).result(timeout=30)).text
            again = await client.submit("room again", route="chat")
            assert (await again.result(timeout=30)).text


async def test_the_gateway_answers_a_full_store_with_a_503_store_full(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    key = "rq-test-bounds-key-0123456789abcdef"
    config = parse_config(
        {
            "nats": {"url": isolated_server.url, "requests": {"max_bytes": 16 * 1024}},
            "backends": {"b": {"base_url": "http://127.0.0.1:1", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
            "gateway": {"port": 0, "keys": [{"tenant": "acme", "sha256": digest(key)}]},
        }
    )
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    assert await publish_until_full(js, "acme") > 0  # no router runs: they wait
    async with (
        Gateway(config, url=isolated_server.url) as gateway,
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as http,
    ):
        answer = await http.post(
            "/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert (error["code"], error["type"]) == ("store_full", "server_error")
    assert "retry-after" in answer.headers


async def test_hostile_rejections_cost_the_dead_letters_an_excerpt_each(
    isolated_server: EmbeddedServer,
) -> None:
    """The soak's 1,491 hostile rejections took 79.8 MB of dead letters
    (whole payloads, kept 30 days); scaled down: 20 rejections of 50 KB and
    one request with a 5 MB stop string. The stop string never reaches the
    backend, and each dead letter keeps 2 KB, its size and its sha256."""
    async with MockBackend(FAST) as mock:
        config = config_of(isolated_server.url, mock.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            js = client.js
            before = (await js.stream_info(DLQ_STREAM)).state.bytes or 0
            junk = b'{"id": "' + b"z" * 50_000  # does not decode
            hostile = [f"junk-{i}" for i in range(20)]
            for rid in hostile:
                await js.publish(request_subject("normal", TENANT), junk,
                                 headers={"Nats-Msg-Id": msg_id(TENANT, rid)})  # fmt: skip
            stop = request_of(id="stop-5mb", params=GenerationParams(stop=["s" * 5_000_000]))
            big = encode(stop)
            await js.publish(request_subject("normal", TENANT), big,
                             headers={"Nats-Msg-Id": msg_id(TENANT, stop.id)})  # fmt: skip
            for rid in hostile:
                with pytest.raises(RequestRejectedError):
                    await client.handle(rid).result(timeout=30)
            with pytest.raises(RequestRejectedError, match=r"params\.stop\[0\]") as caught:
                await client.handle(stop.id).result(timeout=30)
            assert caught.value.error_type == "out_of_range"
            after = (await js.stream_info(DLQ_STREAM)).state.bytes or 0
            per_rejection = (after - before) / (len(hostile) + 1)
            assert per_rejection < DLQ_HOSTILE_EXCERPT + 1024, per_rejection
            entry = await js.get_last_msg(DLQ_STREAM, "rq.dlq.requests")
            assert entry.headers is not None
            assert entry.headers["Rq-Original-Size"] == str(len(big))
            assert entry.headers["Rq-Original-Sha256"] == hashlib.sha256(big).hexdigest()
            assert entry.data == big[:DLQ_HOSTILE_EXCERPT]
            # The level still flows, and the backend never saw the stop string.
            assert (await (await client.submit("fine", route="chat")).result(timeout=30)).text
            assert mock.stats().requests == 1


async def test_status_shows_each_store_against_its_limit_and_warns_near_it(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    config = config_of(isolated_server.url, requests={"max_bytes": 32 * 1024})
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    report = await read_status(js, config)
    assert report.near_limit == ()
    assert {s.name for s in report.stores} == set(STORES)
    assert NEAR_LIMIT not in render_status(report)
    assert await publish_until_full(js, TENANT, count=28) == 28  # 28 KB of the 32: past 80 %
    report = await read_status(js, config)
    assert report.near_limit == (REQUESTS_STREAM,)
    requests = next(s for s in report.stores if s.name == REQUESTS_STREAM)
    assert (requests.max_bytes, requests.discard) == (32 * 1024, "new")
    assert requests.bytes >= 0.8 * requests.max_bytes
    assert report.store_used >= requests.bytes
    assert report.store_limit == config.nats.store_bytes
    lines = render_status(report)
    near = lines[lines.index(NEAR_LIMIT) + 1 :]
    assert near[0].startswith("  RQ_REQUESTS: "), lines
    assert near[0].endswith("full (over 80%)"), lines
    assert msgspec.json.decode(msgspec.json.encode(report))["near_limit"] == [REQUESTS_STREAM]


async def cli_submit(
    config: Path, url: str, request_id: str, tenant: str = "default"
) -> tuple[int, str]:
    """``renqueue submit`` as a user runs it: its exit code and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "-c", str(config), "--nats", url,
        "submit", "x", "--route", "chat", "--id", request_id, "--tenant", tenant, "--wait", "20",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )  # fmt: skip
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_a_submit_the_broker_refuses_exits_3_from_the_cli_saying_why(
    isolated_server: EmbeddedServer, tmp_path: Path
) -> None:
    """A full store and a tenant's full backlog are refusals (nothing stored,
    the broker answered): ``submit`` exits 3 with one line saying which, as
    docs/cli.md's exit codes say. Before, a full store was reported as NATS
    lost (exit 4) and a full backlog as an unexpected error."""
    config = tmp_path / "renqueue.toml"
    config.write_text(
        '[nats.requests]\nmax_bytes = "64KB"\n[router]\ntenant_backlog = 1\n'
        '[backends.b]\nbase_url = "http://127.0.0.1:1"\nmodel = "m"\n'
        '[routes.chat]\nbackends = ["b"]\n'
    )
    nc = await connect(isolated_server.url, name="filler")
    try:
        await provision(nc, load_config(config))
        async with Client(nc, tenant="default") as client:
            await client.submit("x", route="chat", request_id="first")
        code, err = await cli_submit(config, isolated_server.url, "second")
        assert code == 3, err
        assert "tenant_backlog" in err
        assert "Traceback" not in err
        # Fill the stream with other tenants' requests (a backlog of 1 each).
        for index in range(2000):
            async with Client(nc, tenant=f"t{index}") as other:
                try:
                    await other.submit("x", route="chat", request_id="fill")
                except StoreFullError:
                    break
        else:
            pytest.fail("the requests stream never filled")
        code, err = await cli_submit(config, isolated_server.url, "third", tenant="unseen")
    finally:
        await nc.close()
    assert code == 3, err
    assert "store is full" in err
    assert "Traceback" not in err


async def test_a_server_too_small_for_the_stores_is_refused_saying_what_to_set(
    tmp_path: Path,
) -> None:
    """A nats-server of one's own whose JetStream store is smaller than
    ``[nats] max_file_store`` (16 GiB by default) cannot reserve the streams'
    byte limits: provisioning says which setting to change, not only NATS's
    "insufficient storage resources" (``make soak`` met it on a 4 GB server)."""
    server = EmbeddedServer(tmp_path / "small", port=-1, max_file_store=1024**3)
    await server.start()
    try:
        nc = await connect(server.url, name="provision")
        try:
            with pytest.raises(ProvisionError, match="insufficient storage") as caught:
                await provision(nc, config_of())
            assert "set max_file_store to at most the server's" in str(caught.value)
            await provision(nc, config_of(max_file_store="512MB"))  # fits: provisioned
        finally:
            await nc.close()
    finally:
        await server.close()
