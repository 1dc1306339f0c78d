"""Cluster-wide metrics from the log (issue 27 item 1): one scrape target shows
the whole cluster, whichever process did the work.

Everything is real: a nats-server per test, mock backends on loopback, the
services in-process on their own connections, and the exporter on a
connection of the test's. Scrapes go through ``generate_latest`` on a thread
of their own, as Prometheus's HTTP server scrapes, and are parsed back with
``prometheus_client.parser``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
from _waits import until
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_fallback import FAST, config_for, failing

from renqueue import Client, Services, parse_config
from renqueue.broker import (
    STORES,
    EmbeddedServer,
    EventLog,
    JetStream,
    JetStreamApi,
    connect,
    provision,
)
from renqueue.config import Config
from renqueue.coordination import (
    ArmFigures,
    ArmReport,
    ClusterMetrics,
    ClusterReading,
    Exporter,
    Projector,
    SplitReport,
    StatusReport,
    backend_status,
    cluster_families,
)
from renqueue.coordination._exporter import COMPLETIONS
from renqueue.errors import NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import LimitUsage
from renqueue.schema import (
    EVENTS_STREAM,
    REQUESTS_STREAM,
    CancelRequested,
    Routed,
    event_subject,
    request_subject,
)
from renqueue.state import BackendState

TENANT = "acme"
T = 1_780_000_020.0


class Scrape:
    """One scrape, parsed: a sample's value by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))


async def scrape(registry: CollectorRegistry) -> Scrape:
    """A scrape from another thread, as Prometheus's HTTP server makes it."""
    return Scrape((await asyncio.to_thread(generate_latest, registry)).decode())


@asynccontextmanager
async def exporting(
    js: JetStream, config: Config, **settings: Any
) -> AsyncIterator[tuple[CollectorRegistry, ClusterMetrics]]:
    """An exporter on ``js`` whose every scrape reads the cluster anew (unless told)."""
    metrics = ClusterMetrics(config, **{"max_age": 0.0, **settings})
    registry = CollectorRegistry()
    registry.register(metrics)
    async with Exporter(js, metrics):
        yield registry, metrics


def one_backend(url: str, mock: MockBackend, **limits: Any) -> Config:
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                "b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 1, **limits}}
            },
            "routes": {"chat": {"backends": ["b"]}},
            "router": {"capacity_refresh": "20ms"},
            "worker": {"drain_timeout": "1s"},
            "tenants": {TENANT: {"daily_budget": 2.5, "budget": "hard"}},
        }
    )


async def test_levels_dead_letters_and_the_binder_as_the_cluster_holds_them(
    isolated_server: EmbeddedServer,
) -> None:
    """Requests waiting at a level no worker serves show as its queue and its
    oldest wait, rising; a poison request as a dead letter; the binder's term is
    the one its decisions carry, and it is gone once its router stops."""
    async with MockBackend(FAST) as mock:
        config = one_backend(isolated_server.url, mock)
        nc = await connect(isolated_server.url, name="test-exporter")
        try:
            js = nc.jetstream()
            await provision(js, config)
            async with exporting(js, config) as (registry, _):
                first = await scrape(registry)
                assert first("renqueue_exporter_up") == 1
                assert first("renqueue_binder_present") == 0
                assert first("renqueue_binder_term") == 0
                assert first("renqueue_level_waiting_requests", level="low") == 0
                assert first("renqueue_level_oldest_wait_seconds", level="low") == 0
                assert first("renqueue_level_aging_bound_seconds", level="low") == 120
                assert first("renqueue_level_aging_bound_seconds", level="critical") == math.inf
                assert first("renqueue_dlq_messages") == 0
                assert first("renqueue_tenant_budget_dollars", tenant=TENANT, kind="hard") == 2.5
                assert first("renqueue_tenant_spend_today_dollars", tenant=TENANT) == 0

                # A router and the projector, no worker: b's one slot takes a
                # request, the others wait at their level.
                async with (
                    Services(config, backends=[]) as services,
                    Client(services.nc, tenant=TENANT) as client,
                ):
                    handles = [
                        await client.submit(f"p{n}", route="chat", priority="low") for n in range(3)
                    ]
                    now: Scrape | None = None

                    async def two_wait_and_one_is_dispatched() -> bool:
                        nonlocal now
                        now = await scrape(registry)
                        return (
                            now("renqueue_level_waiting_requests", level="low") == 2
                            and now("renqueue_backend_waiting_dispatches", backend="b") == 1
                        )

                    await until(two_wait_and_one_is_dispatched, "two wait at low, one at b")
                    assert now is not None
                    waited = now("renqueue_level_oldest_wait_seconds", level="low")
                    assert waited is not None
                    assert waited > 0

                    async def the_oldest_has_waited_longer() -> bool:
                        later = await scrape(registry)
                        wait = later("renqueue_level_oldest_wait_seconds", level="low")
                        return wait is not None and wait > waited + 0.3

                    await until(the_oldest_has_waited_longer, "the oldest wait rises")

                    poison = {"Nats-Msg-Id": f"{TENANT}:poison"}
                    await js.publish(
                        request_subject("normal", TENANT), b"{not json", headers=poison
                    )

                    async def a_dead_letter() -> bool:
                        return (await scrape(registry))("renqueue_dlq_messages") == 1

                    await until(a_dead_letter, "the poison request is a dead letter")

                    history = await EventLog(js).history(TENANT, handles[0].id)
                    (decision,) = (e for e in history if isinstance(e, Routed))
                    held = await scrape(registry)
                    assert held("renqueue_binder_present") == 1
                    assert held("renqueue_binder_term") == decision.term > 0

                    async def caught_up() -> bool:
                        s = await scrape(registry)
                        return (
                            s("renqueue_projection_lag_events") == 0
                            and s("renqueue_projection_lag_seconds") == 0
                        )

                    await until(caught_up, "the projection has folded the log")
                # The router gave its lease up: no binder; the last term is kept.
                gone = await scrape(registry)
                assert gone("renqueue_binder_present") == 0
                assert gone("renqueue_binder_term") == decision.term
        finally:
            await nc.close()


async def test_projection_lag_counts_and_ages_what_is_not_folded(
    isolated_server: EmbeddedServer,
) -> None:
    config = parse_config({"nats": {"url": isolated_server.url}})
    nc = await connect(isolated_server.url, name="test-exporter")
    try:
        js = nc.jetstream()
        await provision(js, config)
        async with exporting(js, config) as (registry, _):
            at = time.time()
            for n in range(2):
                await EventLog(js).append(CancelRequested(tenant=TENANT, request_id=f"r{n}", at=at))

            async def behind_and_ageing() -> bool:
                s = await scrape(registry)
                lag = s("renqueue_projection_lag_seconds")
                return s("renqueue_projection_lag_events") == 2 and lag is not None and lag > 0.2

            await until(behind_and_ageing, "two events not folded, ageing")
            async with Projector(js):

                async def caught_up() -> bool:
                    s = await scrape(registry)
                    return (
                        s("renqueue_projection_lag_events") == 0
                        and s("renqueue_projection_lag_seconds") == 0
                    )

                await until(caught_up, "the projector folded them")
    finally:
        await nc.close()


async def test_a_failing_backend_shows_down_with_its_circuit_open(
    isolated_server: EmbeddedServer,
) -> None:
    circuit: dict[str, Any] = {"failures": 3, "cooloff": "60s"}
    async with MockBackend(failing("500")) as flaky, MockBackend(FAST) as steady:
        config = config_for(
            isolated_server.url,
            {"flaky": flaky, "steady": steady},
            backends={"flaky": {"circuit": circuit}},
            fallback={"retries": 0},
        )
        nc = await connect(isolated_server.url, name="test-exporter")
        try:
            async with (
                Services(config) as services,
                Client(services.nc, tenant=TENANT) as client,
                exporting(nc.jetstream(), config) as (registry, _),
            ):
                before = await scrape(registry)
                assert before("renqueue_backend_up", backend="flaky") == 1
                assert (
                    before("renqueue_backend_circuit_state", backend="flaky", state="closed") == 1
                )
                assert before("renqueue_backend_slots_limit", backend="flaky") == 4
                for n in range(3):
                    handle = await client.submit(f"r{n}", route="chat")
                    assert (await handle.result(timeout=20)).backend == "steady"

                async def opened() -> bool:
                    # The exporter folds the log as it comes: wait for both facts.
                    now = await scrape(registry)
                    return (
                        now("renqueue_backend_up", backend="flaky") == 0
                        and now(
                            "renqueue_backend_calls_total", backend="steady", outcome="completed"
                        )
                        == 3
                    )

                await until(opened, "flaky shows down and steady's three calls are counted")
                after = await scrape(registry)
        finally:
            await nc.close()
    states = {
        state: after("renqueue_backend_circuit_state", backend="flaky", state=state)
        for state in ("closed", "open", "half_open")
    }
    assert states == {"closed": 0, "open": 1, "half_open": 0}
    assert after("renqueue_backend_faults_total", backend="flaky") == 3
    assert after("renqueue_backend_calls_total", backend="flaky", outcome="failed") == 3
    assert after("renqueue_backend_calls_total", backend="flaky", outcome="completed") == 0
    assert after("renqueue_backend_up", backend="steady") == 1
    assert after("renqueue_backend_calls_total", backend="steady", outcome="completed") == 3
    assert after("renqueue_backend_faults_total", backend="steady") == 0


async def test_quota_and_call_histograms_whichever_process_ran_the_calls(
    isolated_server: EmbeddedServer,
) -> None:
    """A declared window's use, limit, room and reset; the provider's reported
    limit; and the calls a worker of another process ran, in the histograms
    (only those completed after the exporter started: it does not replay)."""
    async with MockBackend(MockSettings(ttft=0.02, output_tokens=4, rpm=100)) as mock:
        config = one_backend(isolated_server.url, mock, requests=["5/min"])
        nc = await connect(isolated_server.url, name="test-exporter")
        try:
            js = nc.jetstream()
            async with (
                Services(config, backends=[], name="binder") as routing,
                Services(config, routers=0, provision_streams=False, name="workers"),
                Client(routing.nc, tenant=TENANT) as client,
            ):
                done = await client.submit("before", route="chat")
                await done.result(timeout=20)
                async with exporting(js, config) as (registry, _):
                    for n in range(2):
                        await (await client.submit(f"r{n}", route="chat")).result(timeout=20)

                    async def three_spent() -> bool:
                        # The quota counts a request once it is routed; the calls
                        # once its completion is folded, which may come later.
                        s = await scrape(registry)
                        labels = {"backend": "b", "window": "min", "unit": "requests"}
                        return (
                            s("renqueue_backend_quota_used", **labels) == 3
                            and s("renqueue_backend_calls_total", backend="b", outcome="completed")
                            == 3
                            and s("renqueue_backend_ttft_seconds_count", backend="b") == 2
                        )

                    await until(three_spent, "three requests spent of b's window and folded")
                    s = await scrape(registry)
        finally:
            await nc.close()
    window = {"backend": "b", "window": "min", "unit": "requests"}
    assert s("renqueue_backend_quota_limit", **window) == 5
    assert s("renqueue_backend_quota_remaining_ratio", **window) == 0.4
    read_at = s("renqueue_exporter_read_timestamp_seconds")
    reset = s("renqueue_backend_quota_reset_timestamp_seconds", **window)
    assert read_at is not None
    assert reset is not None
    assert read_at < reset <= read_at + 61
    assert s("renqueue_backend_learned_limit", **window) == 100  # the mock's rpm, reported
    assert s("renqueue_backend_ttft_seconds_count", backend="b") == 2
    assert s("renqueue_backend_duration_seconds_count", backend="b") == 2
    ttft_sum = s("renqueue_backend_ttft_seconds_sum", backend="b")
    assert ttft_sum is not None
    assert ttft_sum >= 0.04
    assert s("renqueue_backend_calls_total", backend="b", outcome="completed") == 3
    assert s("renqueue_backend_slots_in_use", backend="b") == 0
    spend = s("renqueue_tenant_spend_today_dollars", tenant=TENANT)
    assert spend is not None
    assert spend >= 0


async def test_a_scrape_with_the_broker_gone_answers_in_time_with_the_last_values(
    tmp_path: Path,
) -> None:
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    try:
        config = parse_config({"nats": {"url": server.url}})
        nc = await connect(server.url, name="test-exporter")
        try:
            js = nc.jetstream()
            await provision(js, config)
            async with exporting(js, config, patience=1.0) as (registry, metrics):
                up = await scrape(registry)
                assert up("renqueue_exporter_up") == 1
                assert up("renqueue_dlq_messages") == 0
                port = server.port
                await server.close()
                started = time.monotonic()
                down = await scrape(registry)
                assert time.monotonic() - started < metrics.patience + 1.0
                assert down("renqueue_exporter_up") == 0
                assert down("renqueue_dlq_messages") == 0  # the last value read
                assert down("renqueue_exporter_read_timestamp_seconds") == up(
                    "renqueue_exporter_read_timestamp_seconds"
                )
                server = EmbeddedServer(store, port=port)
                await server.start()

                async def back() -> bool:
                    return (await scrape(registry))("renqueue_exporter_up") == 1

                await until(back, "the exporter reads the cluster again", within=30)
        finally:
            await nc.close()
    finally:
        await server.close()


async def test_a_scrape_on_the_event_loop_never_waits(isolated_server: EmbeddedServer) -> None:
    """The gateway's /metrics runs on the event loop: a scrape there shows what
    there is and asks for a fresh reading, which a later scrape shows."""
    config = parse_config({"nats": {"url": isolated_server.url}})
    nc = await connect(isolated_server.url, name="test-exporter")
    try:
        js = nc.jetstream()
        await provision(js, config)
        async with exporting(js, config, max_age=60.0) as (registry, metrics):
            first = Scrape(generate_latest(registry).decode())  # on the loop's own thread
            assert first("renqueue_exporter_up") == 0
            assert first("renqueue_exporter_read_timestamp_seconds") == 0

            async def read() -> bool:
                return metrics.reading is not None

            await until(read, "the reading the scrape asked for")
            second = Scrape(generate_latest(registry).decode())
            assert second("renqueue_exporter_up") == 1
    finally:
        await nc.close()


async def test_each_store_s_bytes_and_limit_are_exported_as_the_broker_holds_them(
    isolated_server: EmbeddedServer,
) -> None:
    """Issue 30 item 4: Prometheus sees store use, not only ``renqueue status``.
    Requests waiting in a 16 KB requests stream (no router runs) show as its
    bytes against its limit, every provisioned stream and bucket has a limit,
    and the whole store's use and cap and the warning threshold are there, so
    StoreNearLimit can fire at the threshold ``renqueue status`` uses."""
    config = parse_config(
        {
            "nats": {
                "url": isolated_server.url,
                "max_file_store": "64MB",
                "store_warn": 0.5,
                "requests": {"max_bytes": 16 * 1024},
            },
            "backends": {"b": {"base_url": "http://127.0.0.1:1", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
        }
    )
    nc = await connect(isolated_server.url, name="test-exporter")
    try:
        js = nc.jetstream()
        await provision(js, config)
        for n in range(10):
            await js.publish(
                request_subject("normal", TENANT), b"x" * 1000,
                headers={"Nats-Msg-Id": f"{TENANT}:filler-{n}"},
            )  # fmt: skip
        held = (await js.stream_info(REQUESTS_STREAM)).state.bytes
        async with exporting(js, config) as (registry, _):
            now = await scrape(registry)
        assert now("renqueue_store_bytes", store=REQUESTS_STREAM) == held > 10_000
        assert now("renqueue_store_limit_bytes", store=REQUESTS_STREAM) == 16 * 1024
        for store in STORES:
            assert now("renqueue_store_bytes", store=store) is not None, store
            limit = now("renqueue_store_limit_bytes", store=store)
            assert limit is not None, store
            assert limit > 0, store
        assert now("renqueue_store_limit_bytes", store=EVENTS_STREAM) == config.nats.max_bytes(
            "events"
        )
        used = now("renqueue_jetstream_used_bytes")
        assert used is not None
        assert used >= held
        assert now("renqueue_jetstream_limit_bytes") == 64 * 1024 * 1024
        assert now("renqueue_store_warn_ratio") == 0.5
    finally:
        await nc.close()


async def test_cancellations_the_log_has_not_sourced_are_exported(
    isolated_server: EmbeddedServer,
) -> None:
    """Clients cancel on RQ_CANCELS, and the services read the log's copy: a
    cancellation acknowledged but not copied is one they do not know. Seen by
    Prometheus (CancellationsNotSourced): 0 once the log took it in; with the
    log's source gone, every cancellation RQ_CANCELS holds; with the log full
    (the server's own source ``lag`` says 0 then), the one that waits, until
    the log has room and takes it in."""
    config = parse_config(
        {
            "nats": {"url": isolated_server.url},
            "backends": {"b": {"base_url": "http://127.0.0.1:1", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
        }
    )
    nc = await connect(isolated_server.url, name="test-exporter")
    api = JetStreamApi(nc)

    async def update_events(**change: Any) -> None:
        info = await api.call(f"STREAM.INFO.{EVENTS_STREAM}")
        stream = {k: v for k, v in info["config"].items() if k not in change or v is not None}
        stream.update({k: v for k, v in change.items() if v is not None})
        for key in [k for k, v in change.items() if v is None]:
            stream.pop(key, None)
        reply = await api.call(f"STREAM.UPDATE.{EVENTS_STREAM}", stream)
        assert "error" not in reply, reply

    async def unsourced(js: JetStream) -> float | None:
        async with exporting(js, config) as (registry, _):
            return (await scrape(registry))("renqueue_cancels_unsourced_messages")

    async def logged(js: JetStream, request_id: str) -> bool:
        subject = event_subject(TENANT, request_id, "cancel_requested")
        try:
            await js.get_last_msg(EVENTS_STREAM, subject, direct=True)
        except NatsNotFoundError:
            return False
        return True

    try:
        js = nc.jetstream()
        await provision(js, config)
        log = EventLog(js)
        await log.append(CancelRequested(request_id="taken", tenant=TENANT, at=time.time()))
        await until(lambda: logged(js, "taken"), "the log took the cancellation in")
        assert await unsourced(js) == 0

        # The log full: the next cancellation waits in RQ_CANCELS.
        held = (await js.stream_info(EVENTS_STREAM)).state.bytes
        await update_events(max_bytes=held + 1)
        await log.append(CancelRequested(request_id="waits", tenant=TENANT, at=time.time()))
        assert await unsourced(js) == 1
        assert not await logged(js, "waits")
        await update_events(max_bytes=config.nats.max_bytes("events"))
        await until(lambda: logged(js, "waits"), "the log took the waiting one in")
        assert await unsourced(js) == 0

        # The log's source removed: nothing RQ_CANCELS holds reaches it.
        await update_events(sources=None)
        await log.append(CancelRequested(request_id="lost", tenant=TENANT, at=time.time()))
        assert await unsourced(js) == 3
    finally:
        await nc.close()


def test_a_reading_as_families_names_every_label_it_promised() -> None:
    """Pure: A/B arms and split states, budgets of tenants that spent nothing,
    one series per window and unit, no reset while nothing counts."""
    config = parse_config(
        {
            "backends": {"b": {"base_url": "http://127.0.0.1:1/v1", "model": "m"}},
            "tenants": {"quiet": {"daily_budget": 1.0}, "*": {"daily_budget": 9.0}},
        }
    )
    figures = ArmFigures(
        requests=7, completed=5, failed=2, expired=0, error_rate=2 / 7, latency_p50=None,
        latency_p95=None, ttft_p50=None, ttft_p95=None, cost=0.25,
    )  # fmt: skip
    split = SplitReport(
        route="chat", configured=True, state="rolled_back", arm="a", since=T, reason="errors",
        by="binder", control="a", key="tenant", window=300.0,
        arms=(ArmReport(arm="b", weight=0.5, control=False, window=figures, total=figures),),
    )  # fmt: skip
    window = LimitUsage(
        key="requests/min", kind="requests", window=60.0, calendar="rolling", count=10,
        declared=10, used=0, left=10, room_at=None, resets_at=None,
    )  # fmt: skip
    status = StatusReport(
        at=T, projected=True, last_seq=9, log_time=T, events_behind=0, in_flight=0,
        backends=(
            msgspec.structs.replace(
                backend_status("b", BackendState(), config, T), limits=(window, window)
            ),
        ),
        levels=(), tenants=(),
    )  # fmt: skip
    reading = ClusterReading(
        at=T, status=status, splits=(split,), dlq_messages=3, binder=None, lag_seconds=0.0
    )
    families = {f.name: f for f in cluster_families(reading, config, up=True, term=4, out={"b"})}

    def value(name: str, **labels: str) -> float | None:
        family = families[name.removesuffix("_total")]
        found = [s.value for s in family.samples if s.labels == labels]
        return found[0] if found else None

    assert value("renqueue_ab_arm_requests_total", route="chat", arm="b") == 7
    assert value("renqueue_ab_arm_failures_total", route="chat", arm="b") == 2
    assert value("renqueue_ab_arm_cost_dollars_total", route="chat", arm="b") == 0.25
    states = {s.labels["state"]: s.value for s in families["renqueue_ab_split_state"].samples}
    assert states == {"live": 0, "promoted": 0, "rolled_back": 1}
    assert value("renqueue_tenant_budget_dollars", tenant="quiet", kind="soft") == 1.0
    assert value("renqueue_tenant_spend_today_dollars", tenant="quiet") == 0
    assert "*" not in {
        s.labels.get("tenant") for s in families["renqueue_tenant_budget_dollars"].samples
    }
    assert len(families["renqueue_backend_quota_limit"].samples) == 1
    assert families["renqueue_backend_quota_reset_timestamp_seconds"].samples == []
    assert (
        value("renqueue_backend_quota_remaining_ratio", backend="b", window="min", unit="requests")
        == 1
    )
    assert value("renqueue_backend_up", backend="b") == 0  # out of service here
    assert value("renqueue_binder_term") == 4
    assert value("renqueue_binder_present") == 0
    assert value("renqueue_dlq_messages") == 3


async def test_the_histograms_go_on_after_the_tail_s_consumer_is_lost(
    isolated_server: EmbeddedServer,
) -> None:
    """A server that loses the tail's consumer (the node holding it restarted)
    answers its fetches with nothing: the tail notices, and starts again where
    it was, so the histograms never silently freeze."""
    async with MockBackend(MockSettings(output_tokens=2)) as mock:
        config = one_backend(isolated_server.url, mock)
        nc = await connect(isolated_server.url, name="test-exporter")
        try:
            js = nc.jetstream()
            async with (
                Services(config, name="all") as services,
                Client(services.nc, tenant=TENANT) as client,
                exporting(js, config) as (registry, _),
            ):
                tails = [
                    info.name
                    for info in await js.context.consumers_info(EVENTS_STREAM)
                    if info.config.filter_subject == COMPLETIONS
                ]
                assert len(tails) == 1
                await js.delete_consumer(EVENTS_STREAM, tails[0])
                await (await client.submit("after", route="chat")).result(timeout=20)

                async def counted() -> bool:
                    s = await scrape(registry)
                    return s("renqueue_backend_ttft_seconds_count", backend="b") == 1

                await until(counted, "the completion after the loss in the histogram")
        finally:
            await nc.close()
