"""W3C trace context from the caller to the backend (issue #27, item 5).

A request carries a ``traceparent`` from the gateway or the Client through the
router and the worker to the backend's HTTP call, each hop under a span of its
own in the same trace; ``renqueue audit`` prints the trace id; a malformed one
is dropped (a new trace begins) and never forwarded; a request put back keeps
its trace. Real Services, a real nats-server and mock backends on loopback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from _waits import until
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from test_fallback import FAST, config_for, failing
from test_gateway_sdk import MESSAGES, Stack, start

from renqueue import Client, Services, export_spans
from renqueue.broker import EmbeddedServer, EventLog, hop, next_hop, trace_of
from renqueue.cli import main
from renqueue.logs import EVENT_ATTRIBUTE
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    EVENT_DECODER,
    FellBack,
    InferenceRequest,
    Submitted,
    TraceParent,
    encode,
    msg_id,
    parse_traceparent,
    request_subject,
)

GIVEN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


# ------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(GIVEN, GIVEN, id="valid"),
        pytest.param(GIVEN[:-2] + "00", GIVEN[:-2] + "00", id="not sampled"),
        pytest.param(GIVEN[:-2] + "ff", GIVEN[:-2] + "01", id="unknown flags: sampled kept"),
        pytest.param(f"  {GIVEN}\t", GIVEN, id="surrounding blanks"),
        pytest.param("01" + GIVEN[2:] + "-later-fields", GIVEN, id="a later version's fields"),
    ],
)
def test_a_valid_traceparent_is_read_and_written_anew(text: str, expected: str) -> None:
    parsed = parse_traceparent(text)
    assert parsed is not None
    assert parsed.header == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(None, id="none"),
        pytest.param(42, id="not a string"),
        pytest.param("", id="empty"),
        pytest.param(GIVEN.upper(), id="upper case"),
        pytest.param("00-" + "0" * 32 + "-00f067aa0ba902b7-01", id="trace id of zeros"),
        pytest.param("00-" + TRACE_ID + "-" + "0" * 16 + "-01", id="parent id of zeros"),
        pytest.param("ff" + GIVEN[2:], id="version ff"),
        pytest.param(GIVEN + "-more", id="version 00 with more"),
        pytest.param(GIVEN[:-1], id="short"),
        pytest.param(GIVEN.replace("-", "_"), id="no dashes"),
        pytest.param("00-" + TRACE_ID + "-00f067aa0ba902bz-01", id="not hex"),
        pytest.param("01" + GIVEN[2:] + "x" * 600, id="too long"),
        pytest.param("00-" + TRACE_ID + "-00f067aa0ba902b7-01\r\nx-evil: 1", id="header injection"),
    ],
)
def test_a_malformed_traceparent_is_none_never_an_error(text: object) -> None:
    assert parse_traceparent(text) is None


def test_each_hop_keeps_the_trace_under_a_span_of_its_own() -> None:
    hop = next_hop(GIVEN)
    assert hop.trace_id == TRACE_ID
    assert hop.parent_id not in ("00f067aa0ba902b7", "0" * 16)
    assert parse_traceparent(hop.header) == hop
    assert next_hop(hop).trace_id == TRACE_ID
    fresh = next_hop("garbage")
    assert fresh.trace_id != TRACE_ID
    assert parse_traceparent(fresh.header) == fresh
    assert next_hop(None).trace_id != fresh.trace_id
    with pytest.raises(ValueError, match="span id"):
        hop.child("XYZ")


# ------------------------------------------------------------------ end to end


def traced(mock: MockBackend) -> list[TraceParent]:
    """The valid ``traceparent`` of each call ``mock`` got (none may lack one)."""
    headers = mock.stats().traceparents
    parsed = [parse_traceparent(header) for header in headers]
    assert None not in parsed, headers
    return [trace for trace in parsed if trace is not None]


async def submitted_trace(log: EventLog, tenant: str, request_id: str) -> TraceParent | None:
    [event] = await log.history(tenant, request_id, kind="submitted")
    assert isinstance(event, Submitted)
    return parse_traceparent(event.traceparent)


def audit(url: str, request_id: str) -> int:
    return main(["--nats", url, "audit", request_id, "--tenant", "acme"])


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=400, output_tokens=4)) as m:
        yield m


@pytest.fixture
async def stack(tmp_path: Path, mock: MockBackend) -> AsyncIterator[Stack]:
    async for value in start(tmp_path, mock):
        yield value


async def test_a_traceparent_given_to_the_gateway_reaches_the_backend_and_the_audit(
    stack: Stack,
    mock: MockBackend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with stack.http() as http:
        response = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
            headers={"traceparent": GIVEN},
        )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    [call] = traced(mock)
    assert call.trace_id == TRACE_ID
    # Each hop sent its own span: the backend's parent is not the caller's.
    assert call.parent_id != "00f067aa0ba902b7"
    assert stack.services.js is not None
    logged = await submitted_trace(EventLog(stack.services.js), "acme", request_id)
    assert logged is not None
    assert logged.trace_id == TRACE_ID
    assert logged.parent_id not in ("00f067aa0ba902b7", call.parent_id)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RENQUEUE_CONFIG", "")
    assert stack.services.url is not None
    assert await asyncio.to_thread(audit, stack.services.url, request_id) == 0
    lines = capsys.readouterr().out.splitlines()
    [first] = [n for n, line in enumerate(lines) if " submitted " in line]
    # The event's row, and the lines its details wrap onto (they start blank).
    wrapped = itertools.takewhile(lambda line: line.startswith(" "), lines[first + 1 :])
    row = [lines[first], *wrapped]
    assert f"trace={TRACE_ID}" in " ".join(row)


async def test_a_malformed_traceparent_at_the_gateway_is_replaced_not_forwarded(
    stack: Stack, mock: MockBackend
) -> None:
    hostile = "00-" + TRACE_ID.upper() + "-00f067aa0ba902b7-01"
    async with stack.http() as http:
        response = await http.post(
            "/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
            headers={"traceparent": hostile},
        )
    assert response.status_code == 200, response.text
    [call] = traced(mock)
    assert call.trace_id not in (TRACE_ID, TRACE_ID.upper())
    assert stack.services.js is not None
    logged = await submitted_trace(
        EventLog(stack.services.js), "acme", response.headers["x-request-id"]
    )
    assert logged is not None
    assert logged.trace_id == call.trace_id


async def test_the_client_carries_a_given_trace_or_starts_one(
    stack: Stack, mock: MockBackend
) -> None:
    async with stack.client() as client:
        given = await client.submit("hello", route="chat", traceparent=GIVEN)
        await given.result(timeout=10)
        started = await client.submit("hello", route="chat")
        await started.result(timeout=10)
        malformed = await client.submit("hello", route="chat", traceparent="00-nonsense")
        await malformed.result(timeout=10)
        log = EventLog(client.js)
        logged = [await submitted_trace(log, "acme", h.id) for h in (given, started, malformed)]
    sent = [parse_traceparent(h.traceparent) for h in (given, started, malformed)]
    assert None not in sent
    assert [trace.trace_id for trace in sent if trace] == [
        trace.trace_id for trace in logged if trace
    ]
    assert sent[0] is not None
    assert sent[0].trace_id == TRACE_ID
    assert sent[0].parent_id != "00f067aa0ba902b7"  # the submit's own span
    assert len({trace.trace_id for trace in sent if trace}) == 3
    # The backend got each request's own trace, in the order they ran.
    assert [call.trace_id for call in traced(mock)] == [trace.trace_id for trace in sent if trace]


async def test_a_request_that_falls_back_keeps_its_trace(
    isolated_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="renqueue.worker")
    async with MockBackend(failing("503")) as bad, MockBackend(FAST) as good:
        config = config_for(isolated_server.url, {"bad": bad, "good": good})
        async with Services(config) as services, Client(services.nc, tenant="acme") as client:
            handle = await client.submit("hello", route="chat", traceparent=GIVEN)
            result = await handle.result(timeout=15)
            events = await EventLog(client.js).history("acme", handle.id)
    assert result.backend == "good"
    assert any(isinstance(event, FellBack) for event in events)
    [first] = traced(bad)
    [second] = traced(good)
    assert first.trace_id == second.trace_id == TRACE_ID
    assert first.parent_id != second.parent_id
    # The worker's log lines about the request carry its trace id.
    lines = [
        getattr(record, EVENT_ATTRIBUTE)
        for record in caplog.records
        if getattr(record, EVENT_ATTRIBUTE, {}).get("request_id") == handle.id
    ]
    assert lines
    assert {line.get("trace_id") for line in lines} == {TRACE_ID}


def test_a_message_header_is_read_only_when_valid() -> None:
    assert trace_of({"traceparent": GIVEN}) == parse_traceparent(GIVEN)
    assert trace_of({"traceparent": GIVEN.upper()}) is None
    assert trace_of({"Nats-Msg-Id": "acme:x"}) is None
    assert trace_of(None) is None


# ------------------------------------------------------------------ OpenTelemetry


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Every hop of this process exported to an in-memory exporter, for the test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    export_spans(provider)
    try:
        yield exporter
    finally:
        export_spans(enabled=False)
        provider.shutdown()


def spans_named(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        named.setdefault(span.name, []).append(span)
    return named


def ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def parent_id(span: ReadableSpan) -> str:
    assert span.parent is not None
    return f"{span.parent.span_id:016x}"


async def test_each_hop_is_an_exported_span_whose_ids_are_the_ones_sent_on(
    stack: Stack, mock: MockBackend, exported: InMemorySpanExporter
) -> None:
    async with stack.client() as client:
        handle = await client.submit("hello", route="chat", traceparent=GIVEN)
        await handle.result(timeout=10)

    async def all_ended() -> bool:
        return {"renqueue.submit", "renqueue.bind", "renqueue.backend_call"} <= set(
            spans_named(exported)
        )

    await until(all_ended, "the three hops' spans ended")
    named = spans_named(exported)
    [submit], [bind], [call] = (
        named["renqueue.submit"],
        named["renqueue.bind"],
        named["renqueue.backend_call"],
    )
    # One trace, the caller's; each hop the child of the one before.
    assert {ids(span)[0] for span in (submit, bind, call)} == {TRACE_ID}
    assert parent_id(submit) == "00f067aa0ba902b7"
    assert parent_id(bind) == ids(submit)[1]
    assert parent_id(call) == ids(bind)[1]
    # What was sent on is what was exported: the handle's header, the backend's.
    assert handle.traceparent == f"00-{TRACE_ID}-{ids(submit)[1]}-01"
    [received] = traced(mock)
    assert received.parent_id == ids(call)[1]
    assert (submit.kind, bind.kind, call.kind) == (
        SpanKind.PRODUCER,
        SpanKind.PRODUCER,
        SpanKind.CLIENT,
    )
    assert call.attributes is not None
    assert call.attributes["renqueue.request_id"] == handle.id
    assert call.attributes["renqueue.backend"] == "b1"
    # Nothing of the prompt or the answer leaves the process in a span.
    for span in (submit, bind, call):
        assert "hello" not in repr(dict(span.attributes or {}))


async def test_a_failed_backend_call_is_an_error_span_naming_only_the_error_type(
    isolated_server: EmbeddedServer, exported: InMemorySpanExporter
) -> None:
    async with MockBackend(failing("503")) as bad, MockBackend(FAST) as good:
        config = config_for(isolated_server.url, {"bad": bad, "good": good})
        async with Services(config) as services, Client(services.nc, tenant="acme") as client:
            handle = await client.submit("hello", route="chat")
            await handle.result(timeout=15)

            async def two_calls() -> bool:
                return len(spans_named(exported).get("renqueue.backend_call", [])) == 2

            await until(two_calls, "both backend calls' spans ended")
    named = spans_named(exported)
    failed, served = sorted(
        named["renqueue.backend_call"],
        key=lambda span: span.attributes["renqueue.backend"] != "bad",
    )
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "RetryableBackendError"
    assert not failed.events  # no exception message or traceback
    assert served.status.status_code is StatusCode.UNSET
    # The put back is a hop of the same trace, and the second bind its child.
    [put_back] = named["renqueue.put_back"]
    second_bind = next(s for s in named["renqueue.bind"] if parent_id(s) == ids(put_back)[1])
    assert {ids(s)[0] for s in (failed, served, put_back, second_bind)} == {
        ids(named["renqueue.submit"][0])[0]
    }


def test_nothing_imports_opentelemetry_unless_spans_are_exported() -> None:
    code = (
        "import sys, renqueue, renqueue.services, renqueue.gateway, renqueue.mock, renqueue.cli\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_export_example_in_the_docs_runs() -> None:
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## Tracing", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(example, "docs/architecture.md", "exec"), scope)
    provider = scope["provider"]
    assert isinstance(provider, TracerProvider)
    try:
        with hop("renqueue.submit", GIVEN) as trace:
            assert trace.trace_id == TRACE_ID
    finally:
        export_spans(enabled=False)
        provider.shutdown()


async def test_a_copy_put_back_without_a_header_runs_in_the_trace_its_submit_logged(
    stack: Stack, mock: MockBackend
) -> None:
    """A request the services put back with no ``traceparent`` (written before
    tracing, or by a path that does not carry one) keeps the trace its first
    ``submitted`` event logged rather than starting a new one."""
    async with stack.client() as client:
        request = client.build_request("hello", route="chat")
        log = EventLog(client.js)
        await log.append(
            Submitted(
                request_id=request.id,
                tenant=request.tenant,
                at=time.time(),
                request=request,
                traceparent=GIVEN,
            )
        )
        again = msgspec.structs.replace(request, requeues=1)
        await client.js.publish(
            request_subject(request.priority, request.tenant, requeue=True),
            encode(again),
            headers={"Nats-Msg-Id": msg_id(request.tenant, request.id, "requeue", 1)},
        )
        await client.handle(request.id).result(timeout=10)
    [call] = traced(mock)
    assert call.trace_id == TRACE_ID


def test_a_submitted_event_from_before_tracing_still_decodes() -> None:
    request = msgspec.convert(
        {
            "id": "r1",
            "tenant": "acme",
            "route": "chat",
            "messages": [{"role": "user", "content": "hi"}],
        },
        InferenceRequest,
    )
    event = Submitted(request_id="r1", tenant="acme", at=1.0, request=request, traceparent=GIVEN)
    old = msgspec.json.decode(encode(event))
    del old["traceparent"]
    decoded = EVENT_DECODER.decode(msgspec.json.encode(old))
    assert isinstance(decoded, Submitted)
    assert decoded.traceparent is None
    assert EVENT_DECODER.decode(encode(event)) == event
