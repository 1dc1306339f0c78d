"""Provisioning applies streams/ idempotently, updates what NATS can change, refuses the rest."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _waits import until

from renqueue import Client
from renqueue.broker import (
    STREAMS_DIR_ENV,
    Action,
    Connection,
    JetStream,
    find_streams_dir,
    provision,
)
from renqueue.config import Config, parse_config
from renqueue.errors import NatsTimeoutError, ProvisionError
from renqueue.schema import (
    ADVISORIES_CONSUMER,
    ADVISORIES_STREAM,
    CANCEL_SOURCE,
    CANCELS_STREAM,
    DISPATCH_STREAM,
    DLQ_STREAM,
    EVENTS_STREAM,
    MAX_CANCEL_BYTES,
    REQUESTS_STREAM,
    ROUTER_DELIVERY_BACKSTOP,
    STATE_BUCKET,
    TERMINAL_BUCKET,
    TOKENS_STREAM,
    dispatch_subject,
    event_subject,
    requests_of_level,
    router_consumer,
    worker_consumer,
)

REPO_STREAMS = Path(__file__).resolve().parents[1] / "streams"
ALL_STREAMS = (
    REQUESTS_STREAM,
    DISPATCH_STREAM,
    EVENTS_STREAM,
    TOKENS_STREAM,
    DLQ_STREAM,
    ADVISORIES_STREAM,
)


def make_config(**overrides: Any) -> Config:
    data: dict[str, Any] = {
        "backends": {
            "local": {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 3}},
            "cloud": {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 7}},
        },
    }
    data.update(overrides)
    return parse_config(data)


def copy_streams(tmp_path: Path) -> Path:
    target = tmp_path / "streams"
    shutil.copytree(REPO_STREAMS, target)
    return target


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


async def stream_config(nc: Connection, name: str) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.STREAM.INFO.{name}", b"", timeout=2)
    config: dict[str, Any] = json.loads(reply.data)["config"]
    return config


async def consumer_config(nc: Connection, stream: str, name: str) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.CONSUMER.INFO.{stream}.{name}", b"", timeout=2)
    config: dict[str, Any] = json.loads(reply.data)["config"]
    return config


async def test_first_run_creates_everything_and_second_run_changes_nothing(
    isolated_nc: Connection,
) -> None:
    config = make_config()
    first = await provision(isolated_nc, config)
    assert first.updated == []
    assert first.unchanged == []
    assert set(ALL_STREAMS) <= set(first.created)
    assert STATE_BUCKET in first.created

    second = await provision(isolated_nc, config)
    assert second.created == []
    assert second.updated == []
    assert second.unchanged == first.created


async def test_accepts_a_jetstream_context(isolated_js: JetStream) -> None:
    report = await provision(isolated_js, make_config())
    assert REQUESTS_STREAM in report.created


async def test_one_router_consumer_per_priority_and_one_worker_per_backend(
    isolated_nc: Connection,
) -> None:
    config = make_config(
        priorities=["urgent", "bulk"],
        default_priority="bulk",
        router={"ack_wait": "45s", "max_deliver": 4},
        worker={"ack_wait": "2m", "max_deliver": 3},
    )
    await provision(isolated_nc, config)

    requests = await stream_config(isolated_nc, REQUESTS_STREAM)
    assert requests["subjects"] == ["rq.req.urgent.>", "rq.req.bulk.>"]
    assert requests["retention"] == "workqueue"

    for level in ("urgent", "bulk"):
        router = await consumer_config(isolated_nc, REQUESTS_STREAM, router_consumer(level))
        assert router["filter_subject"] == requests_of_level(level)
        assert router["ack_policy"] == "explicit"
        assert router["ack_wait"] == 45 * 10**9
        # router.max_deliver counts failed dispatches; the consumer's limit is a
        # backstop far above it (every hand-back by a router is a delivery).
        assert router["max_deliver"] == 4 * ROUTER_DELIVERY_BACKSTOP

    for backend, concurrency in (("local", 3), ("cloud", 7)):
        worker = await consumer_config(isolated_nc, DISPATCH_STREAM, worker_consumer(backend))
        assert worker["filter_subject"] == f"rq.dispatch.{backend}"
        assert worker["max_ack_pending"] == concurrency
        assert worker["ack_wait"] == 120 * 10**9
        # The broker's limit is a backstop above the retry budget (max_deliver
        # counts failed runs), so shutdowns and crashes do not use up the budget.
        assert worker["max_deliver"] == 20

    limited = make_config(worker={"max_deliver": 3, "delivery_limit": 7})
    await provision(isolated_nc, limited)
    worker = await consumer_config(isolated_nc, DISPATCH_STREAM, worker_consumer("local"))
    assert worker["max_deliver"] == 7

    advisories = await consumer_config(isolated_nc, ADVISORIES_STREAM, ADVISORIES_CONSUMER)
    assert advisories["filter_subjects"] == [
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.RQ_REQUESTS.*",
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.RQ_DISPATCH.*",
    ]


async def test_retention_limits_from_config_override_the_files(isolated_nc: Connection) -> None:
    config = make_config(
        nats={
            "replicas": 1,
            "duplicate_window": "5m",
            "events": {"max_age": "2d", "max_bytes": 1_000_000},
        }
    )
    await provision(isolated_nc, config)
    events = await stream_config(isolated_nc, EVENTS_STREAM)
    assert events["max_age"] == 2 * 86400 * 10**9
    assert events["max_bytes"] == 1_000_000
    assert events["duplicate_window"] == 300 * 10**9
    tokens = await stream_config(isolated_nc, TOKENS_STREAM)
    assert tokens["max_age"] == 3600 * 10**9  # the config default for tokens


async def test_changed_max_age_is_updated_in_place(isolated_nc: Connection) -> None:
    await provision(isolated_nc, make_config())
    report = await provision(isolated_nc, make_config(nats={"events": {"max_age": "7d"}}))

    item = report.get(EVENTS_STREAM)
    assert item.action is Action.UPDATED
    assert any(change.startswith("max_age:") for change in item.changes)
    # Terminal claims live exactly as long as the events they guard.
    assert report.updated == [EVENTS_STREAM, TERMINAL_BUCKET]
    assert (await stream_config(isolated_nc, EVENTS_STREAM))["max_age"] == 7 * 86400 * 10**9
    claims = await stream_config(isolated_nc, f"KV_{TERMINAL_BUCKET}")
    assert claims["max_age"] == 7 * 86400 * 10**9


async def test_changed_concurrency_updates_the_worker_consumer(isolated_nc: Connection) -> None:
    await provision(isolated_nc, make_config())
    changed = make_config(
        backends={
            "local": {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 5}},
            "cloud": {"base_url": "http://127.0.0.1:9", "model": "m", "limits": {"concurrency": 7}},
        }
    )
    report = await provision(isolated_nc, changed)
    label = f"{DISPATCH_STREAM}/{worker_consumer('local')}"
    assert report.updated == [label]
    assert report.get(label).changes == ("max_ack_pending: 3 -> 5",)
    worker = await consumer_config(isolated_nc, DISPATCH_STREAM, worker_consumer("local"))
    assert worker["max_ack_pending"] == 5


async def test_new_priority_level_adds_its_subject_and_router_consumer(
    isolated_nc: Connection,
) -> None:
    await provision(isolated_nc, make_config(priorities=["high", "low"], default_priority="low"))
    report = await provision(
        isolated_nc, make_config(priorities=["high", "mid", "low"], default_priority="low")
    )
    assert report.get(REQUESTS_STREAM).action is Action.UPDATED
    assert report.get(f"{REQUESTS_STREAM}/{router_consumer('mid')}").action is Action.CREATED
    subjects = (await stream_config(isolated_nc, REQUESTS_STREAM))["subjects"]
    assert subjects == ["rq.req.high.>", "rq.req.mid.>", "rq.req.low.>"]


async def test_retention_change_is_refused_naming_the_field(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    await provision(isolated_nc, make_config(), streams_dir=streams)
    edit_json(streams / "events.json", retention="workqueue")

    with pytest.raises(ProvisionError) as caught:
        await provision(isolated_nc, make_config(), streams_dir=streams)
    message = str(caught.value)
    assert EVENTS_STREAM in message
    assert 'retention: "limits" -> "workqueue"' in message
    assert (await stream_config(isolated_nc, EVENTS_STREAM))["retention"] == "limits"


async def test_storage_change_is_refused_naming_the_field(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    await provision(isolated_nc, make_config(), streams_dir=streams)
    edit_json(streams / "tokens.json", storage="memory")

    with pytest.raises(ProvisionError, match='storage: "file" -> "memory"'):
        await provision(isolated_nc, make_config(), streams_dir=streams)


async def test_consumer_ack_policy_change_is_refused_naming_the_field(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    await provision(isolated_nc, make_config(), streams_dir=streams)
    edit_json(streams / "consumers" / "router.json", deliver_policy="new")

    with pytest.raises(ProvisionError) as caught:
        await provision(isolated_nc, make_config(), streams_dir=streams)
    assert f"{REQUESTS_STREAM}/router-critical" in str(caught.value)
    assert 'deliver_policy: "all" -> "new"' in str(caught.value)


async def test_malformed_stream_json_is_refused_naming_the_file(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    (streams / "dlq.json").write_text('{"name": "RQ_DLQ", ')

    with pytest.raises(ProvisionError, match=r"dlq\.json: not valid JSON"):
        await provision(isolated_nc, make_config(), streams_dir=streams)
    # Every file is checked before anything is sent: nothing was created.
    reply = await isolated_nc.request(f"$JS.API.STREAM.INFO.{REQUESTS_STREAM}", b"", timeout=2)
    assert json.loads(reply.data)["error"]["err_code"] == 10059


async def test_template_disagreeing_with_subject_layout_is_refused(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    edit_json(streams / "consumers" / "worker.json", filter_subject="rq.dispatch.{backend}.x")

    with pytest.raises(ProvisionError, match=r"worker\.json: renders"):
        await provision(isolated_nc, make_config(), streams_dir=streams)


async def test_unknown_placeholder_is_refused_naming_it(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    edit_json(streams / "consumers" / "router.json", max_ack_pending="{router.pending}")

    with pytest.raises(ProvisionError, match=r"unknown placeholder \{router\.pending\}"):
        await provision(isolated_nc, make_config(), streams_dir=streams)


async def test_state_bucket_is_a_usable_kv_with_history_one(isolated_nc: Connection) -> None:
    await provision(isolated_nc, make_config())
    kv = await isolated_nc.jetstream().key_value(STATE_BUCKET)
    await kv.put("k", b"1")
    await kv.put("k", b"2")
    assert (await kv.get("k")).value == b"2"
    info = await isolated_nc.jetstream().stream_info(f"KV_{STATE_BUCKET}")
    assert info.config.max_msgs_per_subject == 1  # history 1


async def test_max_deliveries_advisories_are_captured(isolated_nc: Connection) -> None:
    config = make_config(worker={"ack_wait": "100ms", "max_deliver": 1, "delivery_limit": 2})
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    await js.publish(dispatch_subject("local"), b"poison")
    sub = await js.pull_subscribe_bind(worker_consumer("local"), DISPATCH_STREAM)
    (first,) = await sub.fetch(1, timeout=2)  # delivered, never acked
    (again,) = await sub.fetch(1, timeout=2)  # redelivered: the last of delivery_limit
    assert again.metadata.sequence.stream == first.metadata.sequence.stream
    # The server gives up on the message (and announces it) when it would
    # deliver it a third time: to a consumer that asks for more.
    with pytest.raises(NatsTimeoutError):
        await sub.fetch(1, timeout=1)

    deadline = asyncio.get_running_loop().time() + 5
    while (await js.stream_info(ADVISORIES_STREAM)).state.messages == 0:
        assert asyncio.get_running_loop().time() < deadline, "no advisory captured"
        await asyncio.sleep(0.05)
    advisory = await js.get_last_msg(
        ADVISORIES_STREAM,
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{DISPATCH_STREAM}.{worker_consumer('local')}",
    )
    assert json.loads(advisory.data)["stream_seq"] == first.metadata.sequence.stream


def test_streams_dir_comes_from_argument_then_env_then_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (The packaged copy, for an installed wheel, is tested in test_packaging.py.)
    monkeypatch.delenv(STREAMS_DIR_ENV, raising=False)
    assert find_streams_dir() == REPO_STREAMS
    monkeypatch.setenv(STREAMS_DIR_ENV, str(tmp_path))
    assert find_streams_dir() == tmp_path
    assert find_streams_dir(REPO_STREAMS) == REPO_STREAMS
    monkeypatch.setenv(STREAMS_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(ProvisionError, match="missing"):
        find_streams_dir()


async def test_a_deployment_from_before_the_requeue_subject_is_upgraded_in_place(
    isolated_nc: Connection,
) -> None:
    """Levels were ``rq.req.<level>.*``; the services' requeue subject needs
    ``rq.req.<level>.>``: provisioning widens the stream and the router
    consumers' filters without losing what waits in them."""
    config = make_config()
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    info = await js.stream_info(REQUESTS_STREAM)
    info.config.subjects = [f"rq.req.{level}.*" for level in config.priorities]
    await js.context.update_stream(info.config)
    consumer = await js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
    consumer.config.filter_subject = "rq.req.normal.*"
    await js.add_consumer(REQUESTS_STREAM, consumer.config)
    await js.publish("rq.req.normal.t1", b"waiting")

    await provision(isolated_nc, config)
    info = await js.stream_info(REQUESTS_STREAM)
    assert info.config.subjects == [f"rq.req.{level}.>" for level in config.priorities]
    assert info.state.messages == 1
    consumer = await js.consumer_info(REQUESTS_STREAM, router_consumer("normal"))
    assert consumer.config.filter_subject == "rq.req.normal.>"
    assert consumer.num_pending == 1


async def test_a_deployment_from_before_rq_cancels_is_upgraded_in_place(
    isolated_nc: Connection,
) -> None:
    """Issue 30 item 4: clients cancel on RQ_CANCELS, which the log sources.
    An event log provisioned before it (no sources, no RQ_CANCELS) gets both
    from the next provisioning, keeping every event, and a cancellation
    published then reaches the log on its old subject."""
    config = make_config()
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    # As the previous version left it.
    old = await stream_config(isolated_nc, EVENTS_STREAM)
    old.pop("sources")
    reply = await isolated_nc.request(
        f"$JS.API.STREAM.UPDATE.{EVENTS_STREAM}", json.dumps(old).encode(), timeout=2
    )
    assert "error" not in json.loads(reply.data), reply.data
    assert await js.context.delete_stream(CANCELS_STREAM)
    await js.publish(event_subject("t1", "older", "cancel_requested"), b"{}")

    report = await provision(isolated_nc, config)
    assert CANCELS_STREAM in report.created
    assert EVENTS_STREAM in report.updated
    assert (await stream_config(isolated_nc, EVENTS_STREAM))["sources"] == [CANCEL_SOURCE]
    assert (await stream_config(isolated_nc, CANCELS_STREAM))["max_msg_size"] == MAX_CANCEL_BYTES
    async with Client(isolated_nc, tenant="t1") as client:
        await client.handle("newer").cancel("changed my mind")

    async def both_in_the_log() -> bool:
        info = await js.stream_info(EVENTS_STREAM)
        return info.state.messages == 2

    await until(both_in_the_log, "the new cancellation to reach the log")
    newer = await js.get_last_msg(EVENTS_STREAM, event_subject("t1", "newer", "cancel_requested"))
    assert b"changed my mind" in newer.data


async def test_an_event_log_that_does_not_source_the_cancellations_is_refused(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    streams = copy_streams(tmp_path)
    edit_json(streams / "events.json", sources=[])
    with pytest.raises(ProvisionError, match=r"events\.json: sources .* cancellations"):
        await provision(isolated_nc, make_config(), streams_dir=streams)


async def test_a_copy_of_the_streams_from_before_rq_cancels_is_refused_naming_the_file(
    isolated_nc: Connection, tmp_path: Path
) -> None:
    """docs/operations.md#upgrade: an edited copy of streams/ from before
    RQ_CANCELS ($RENQUEUE_STREAMS_DIR) has no cancels.json and no source in
    events.json; provision says which file is missing, and creates nothing."""
    streams = copy_streams(tmp_path)
    (streams / "cancels.json").unlink()
    events = json.loads((streams / "events.json").read_text())
    del events["sources"]
    (streams / "events.json").write_text(json.dumps(events))
    with pytest.raises(ProvisionError, match=r"cancels\.json: definition file not found"):
        await provision(isolated_nc, make_config(), streams_dir=streams)
    reply = await isolated_nc.request("$JS.API.STREAM.NAMES", b"", timeout=2)
    assert not json.loads(reply.data).get("streams")
