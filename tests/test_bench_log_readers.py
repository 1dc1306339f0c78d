"""The benches' readers of the event log (bench/common.py, scheduling.py, chaos.py)
read a ``submitted`` event that carries its request's binding (issue #31: one stored
event for a request bound at once) as the pair it stands for, as the services' own
readers do (``schema.facts``): the economics, rate-limit, scheduling and chaos benches
count binds, bind waits and binders from ``routed`` events, so a bench that missed the
carried ones would give other verdicts than before on the same behaviour."""

from __future__ import annotations

import asyncio
import importlib
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from renqueue.broker import EmbeddedServer, connect, provision
from renqueue.config import parse_config, parse_size
from renqueue.schema import (
    ChatMessage,
    Event,
    InferenceRequest,
    Routed,
    Submitted,
    bound_at_once,
    encode,
    event_subject,
    routed,
    submitted,
)

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """bench/common.py, scheduling.py and chaos.py, imported as the benches import them."""
    monkeypatch.syspath_prepend(str(BENCH))
    names = ("common", "chaos", "scheduling")
    before = {name: sys.modules.get(name) for name in names}
    try:
        yield {name: importlib.import_module(name) for name in names}
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _pair(tenant: str, request_id: str = "r1") -> tuple[Submitted, Routed]:
    request = InferenceRequest(
        id=request_id, tenant=tenant, route="chat", priority="normal", submitted_at=100.0,
        messages=[ChatMessage(role="user", content="hi")],
    )  # fmt: skip
    first = submitted(request, at=100.0, read=100.001)
    decision = routed(
        request, at=100.002, backend="b", attempt=1, priority="normal", queue_wait=0.002,
        reason="bind", router="r", term=3,
    )  # fmt: skip
    return first, decision


def _config(url: str) -> Any:
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {"b": {"base_url": "http://127.0.0.1:9", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
        }
    )


async def test_the_benches_read_a_submitted_carrying_its_binding_as_the_pair(
    isolated_server: EmbeddedServer, bench: dict[str, ModuleType]
) -> None:
    common, chaos, scheduling = bench["common"], bench["chaos"], bench["scheduling"]
    nc = await connect(isolated_server.url, name="bench-readers")
    try:
        js = nc.jetstream()
        await provision(nc, _config(isolated_server.url))
        tap = scheduling.RouterTap(nc)
        await tap.start()
        pairs: dict[str, tuple[Submitted, Routed]] = {}
        for tenant in {"t", chaos.TENANT, scheduling.TENANT}:
            first, decision = pairs[tenant] = _pair(tenant)
            subject = event_subject(tenant, first.request_id, "submitted")
            await js.publish(subject, encode(bound_at_once(first, decision)))
        old: list[Event] = list(pairs["t"])
        # economics, ratelimits, faults (and scheduling's read_events): common.read_events.
        assert await common.read_events(js, "rq.evt.t.>") == old
        # scheduling's stamped reader: both, at the one event's storing.
        stamped = await scheduling.read_events_stamped(js)
        assert [event for event, _ in stamped] == list(pairs[scheduling.TENANT])
        assert stamped[0][1] == stamped[1][1]
        # chaos: a request's history, both under the one sequence.
        history = (await chaos._read_events_once(js))["r1"]
        assert [item.event for item in history] == list(pairs[chaos.TENANT])
        assert history[0].seq == history[1].seq
        # scheduling's tap (who bound what, for the kill campaign) hears the carried binding.
        for _ in range(500):
            if "r1" in tap.binders:
                break
            await asyncio.sleep(0.01)
        assert "r1" in tap.binders
        await tap.stop()
    finally:
        await nc.close()


def test_the_binding_parts_streams_fit_the_store_of_its_server(
    bench: dict[str, ModuleType],
) -> None:
    """scheduling's binding part runs its own nats-server (chaos.NatsNode, max_file_store
    chaos.FILE_STORE): its config must ask the streams' shares of that store, not of the
    16GB default (the server refused RQ_EVENTS's 6.4GB, and the part could not start)."""
    chaos, scheduling = bench["chaos"], bench["scheduling"]
    text = scheduling.binding_config_text("nats://127.0.0.1:4222", "http://127.0.0.1:9", 4)
    config = parse_config(tomllib.loads(text))
    assert config.nats.store_bytes == parse_size(chaos.FILE_STORE)
