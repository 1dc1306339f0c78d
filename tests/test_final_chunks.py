"""The token stream's wire contract (issue #6 items 20, 21).

Every chunk carries ``v``, ``delivery`` (the run number) and ``seq`` on the
wire, and every final chunk, whatever the outcome, carries the number of the
run that ended the request and that run's next ``seq``: a client that orders
chunks by ``(delivery, seq)``, as docs/wire-format.md says, sees it last.
The chunks are read back raw from ``RQ_TOKENS``, as a client in another
language would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from renqueue import (
    Client,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    Services,
    parse_config,
)
from renqueue.backends.base import Delta
from renqueue.broker import EventLog, read_subject
from renqueue.config import Config
from renqueue.errors import FatalBackendError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    SCHEMA_VERSION,
    TOKEN_DECODER,
    TOKENS_STREAM,
    Preempted,
    Retrying,
    Started,
    token_subject,
)
from renqueue.services.worker import Worker

TENANT = "t"


def make_config(
    tmp_path: Path, url: str, *, fallback: dict[str, Any] | None = None, **worker: Any
) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"b": {"base_url": url, "model": "m", "limits": {"concurrency": 2}}},
            "routes": {"chat": {"backends": ["b"], "fallback": fallback or {}}},
            "worker": {"retry_delay": "50ms", "drain_timeout": "1s", **worker},
            "router": {"capacity_refresh": "20ms"},
        }
    )


async def stored_chunks(client: Client, request_id: str) -> list[dict[str, Any]]:
    """The request's chunks as stored, decoded as plain JSON (no defaults filled in),
    once the final one is stored (it is published together with the terminal event,
    so it may land just after the result)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        raws = await read_subject(
            client.nc, client.js, TOKENS_STREAM, token_subject(TENANT, request_id)
        )
        chunks = [json.loads(data) for _, data in raws]
        if (chunks and chunks[-1].get("final")) or loop.time() > deadline:
            return chunks
        await asyncio.sleep(0.02)


def assert_final_follows_the_text(chunks: list[dict[str, Any]], *, run: int) -> None:
    *texts, final = chunks
    assert final.get("final") is True, chunks
    assert texts, "the run streamed text before it ended"
    last = texts[-1]
    position = (final.get("delivery", 1), final.get("seq", 0))
    assert position == (last.get("delivery", 1), last.get("seq", 0) + 1), chunks
    assert position[0] == run
    # In (delivery, seq) order, the final chunk is the last one.
    order = sorted(chunks, key=lambda c: (c.get("delivery", 1), c.get("seq", 0)))
    assert order[-1] is final


@pytest.fixture
async def slow_mock() -> AsyncIterator[MockBackend]:
    # ~3 s of generation, a chunk every 50 ms: long enough to end it mid-stream.
    async with MockBackend(MockSettings(tokens_per_second=20, output_tokens=60)) as mock:
        yield mock


async def test_a_request_cancelled_while_running_ends_with_a_final_chunk_after_its_text(
    tmp_path: Path, slow_mock: MockBackend
) -> None:
    config = make_config(tmp_path, slow_mock.url)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit("a long answer", route="chat")
        stream = handle.stream(timeout=10)
        for _ in range(3):
            await anext(stream)
        await stream.aclose()
        await handle.cancel("enough")
        with pytest.raises(RequestCancelledError):
            await handle.result(timeout=10)
        chunks = await stored_chunks(client, handle.id)
    assert_final_follows_the_text(chunks, run=1)


async def test_a_request_expired_while_running_ends_with_a_final_chunk_after_its_text(
    tmp_path: Path, slow_mock: MockBackend
) -> None:
    config = make_config(tmp_path, slow_mock.url)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit("a long answer", route="chat", timeout=1.0)
        with pytest.raises(RequestExpiredError):
            await handle.result(timeout=10)
        chunks = await stored_chunks(client, handle.id)
    assert_final_follows_the_text(chunks, run=1)


class FailsMidStream:
    """A backend that streams three pieces, then fails for good on every run."""

    name = "b"

    async def stream(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> AsyncIterator[Delta]:
        for index in range(3):
            yield Delta(text=f"piece {index} ")
        raise FatalBackendError("the model went away", backend="b")

    async def complete(
        self, request: Any, *, priority: int | None = None, traceparent: str | None = None
    ) -> Any:
        raise FatalBackendError("the model went away", backend="b")

    async def close(self) -> None:
        return None


async def test_a_failed_request_ends_with_a_final_chunk_after_its_runs_text(
    tmp_path: Path, slow_mock: MockBackend
) -> None:
    # No fallback: it fails where it ran.
    config = make_config(tmp_path, slow_mock.url, fallback={"on": []})
    async with Services(config, backends=[]) as services:
        worker = Worker(services.nc, services.js, config, "b", FailsMidStream())
        await worker.start()
        try:
            async with Client(services.nc, tenant=TENANT) as client:
                handle = await client.submit("x", route="chat")
                with pytest.raises(RequestFailedError) as info:
                    await handle.result(timeout=10)
                chunks = await stored_chunks(client, handle.id)
                events = await EventLog(client.js).history(TENANT, handle.id)
        finally:
            await worker.close()
    assert info.value.error_type == "backend_fatal"
    [started] = [e for e in events if isinstance(e, Started)]
    assert_final_follows_the_text(chunks, run=started.delivery)


async def test_every_chunk_carries_v_delivery_and_seq_on_the_wire(
    tmp_path: Path, slow_mock: MockBackend
) -> None:
    slow_mock.update(tokens_per_second=0, output_tokens=4)
    config = make_config(tmp_path, slow_mock.url)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit("hi", route="chat")
        await handle.result(timeout=10)
        chunks = await stored_chunks(client, handle.id)
    # The instant mock's answer and its end come in one read: one chunk, the final one.
    assert len(chunks) == 1, chunks
    assert chunks[0] == {
        "v": SCHEMA_VERSION,
        "request_id": handle.id,
        "delivery": 1,
        "seq": 0,
        "text": chunks[0]["text"],
        "restart": False,
        "final": True,
        "tool_calls": [],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "completion_tokens": 4},
        "logprobs": [],
    }
    assert chunks[0]["text"]


def test_chunks_written_by_earlier_versions_still_decode() -> None:
    """Earlier versions left fields at their defaults out; readers fill them in
    (a chunk without ``v`` reads as the current version: every version-1 field
    decodes under it)."""
    old = TOKEN_DECODER.decode(b'{"request_id": "r", "text": "hi"}')
    assert (old.v, old.delivery, old.seq, old.restart, old.final) == (
        SCHEMA_VERSION,
        1,
        0,
        False,
        False,
    )
    assert (old.tool_calls, old.finish_reason, old.usage) == ((), None, None)
    final = TOKEN_DECODER.decode(b'{"v": 1, "request_id": "r", "seq": 3, "final": true}')
    assert (final.delivery, final.seq, final.text, final.final) == (1, 3, "", True)


async def test_a_request_failing_after_a_preemption_numbers_its_final_chunk_by_run(
    tmp_path: Path,
) -> None:
    """Issue #6 item 20, the failed path on a second attempt: after a
    preemption the request is dispatched again (attempt 2), so its runs are
    numbered from ``delivery_limit + 1`` while the broker's delivery count
    starts again at 1. Its ``retrying`` event and its final chunk carry the
    run number (the same as its ``started`` events), not the delivery count,
    so the final chunk still sorts after every chunk of the first run."""
    long = MockSettings(ttft=0.0, tokens_per_second=25, output_tokens=50)
    async with MockBackend(long) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    "b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 1}}
                },
                # No fallback: the second attempt's runs all on b.
                "routes": {"chat": {"backends": ["b"], "fallback": {"on": []}}},
                "worker": {"retry_delay": "50ms", "drain_timeout": "1s", "max_deliver": 2},
                "router": {"capacity_refresh": "20ms"},
            }
        )
        stride = config.worker.deliveries
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            batch = await client.submit("long batch", route="chat", priority="batch")
            stream = batch.stream(timeout=10)
            for _ in range(3):
                await anext(stream)  # its first run streams
            await stream.aclose()
            urgent = await client.submit("now", route="chat", priority="critical", max_tokens=2)
            stream = urgent.stream(timeout=10)
            await anext(stream)  # it runs on the preempted slot: the backend admitted it
            await stream.aclose()
            # From now on every call fails (retryable): the batch request's
            # second attempt fails once, is retried, and fails for good.
            mock.update(failure_rate=1.0, failure_status=500)
            assert (await urgent.result(timeout=10)).text
            with pytest.raises(RequestFailedError) as info:
                await batch.result(timeout=20)
            chunks = await stored_chunks(client, batch.id)
            events = await EventLog(client.js).history(TENANT, batch.id)
    assert info.value.error_type == "backend_unavailable"
    assert [e.attempt for e in events if isinstance(e, Preempted)] == [1]
    runs = [(e.attempt, e.delivery) for e in events if isinstance(e, Started)]
    assert runs == [(1, 1), (2, stride + 1), (2, stride + 2)]
    assert [(e.attempt, e.delivery) for e in events if isinstance(e, Retrying)] == [(2, stride + 1)]
    *texts, final = chunks
    assert final.get("final") is True, chunks
    assert (final["delivery"], final["seq"]) == (stride + 2, 0)
    assert texts
    assert all(chunk["delivery"] == 1 for chunk in texts)
    order = sorted(chunks, key=lambda c: (c.get("delivery", 1), c.get("seq", 0)))
    assert order[-1] is final
