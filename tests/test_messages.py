"""Wire format: round trips, validation of hostile input, schema, idempotency ids."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from renqueue.wire import (
    EVENT_DECODER,
    REQUEST_DECODER,
    SCHEMA_VERSION,
    Completed,
    Failed,
    Routed,
    Usage,
    encode,
    is_terminal,
    msg_id_of,
)

VALID = {
    "id": "req-1",
    "route": "chat",
    "messages": [{"role": "user", "content": "hi"}],
}


def test_request_round_trips_with_schema_version() -> None:
    request = REQUEST_DECODER.decode(json.dumps(VALID))
    assert request.v == SCHEMA_VERSION
    assert REQUEST_DECODER.decode(encode(request)) == request


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        ({"id": "has.dot"}, "$.id"),
        ({"id": "x" * 200}, "$.id"),
        ({"tenant": "a b"}, "$.tenant"),
        ({"messages": []}, "$.messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "$.messages[0].role"),
        ({"params": {"temperature": 9}}, "$.params.temperature"),
        ({"deadline": -1}, "$.deadline"),
        ({"route": None}, "$.route"),
    ],
)
def test_hostile_requests_fail_validation_naming_the_field(
    patch: dict[str, object], words: str
) -> None:
    with pytest.raises(
        msgspec.ValidationError, match=words.replace("[", r"\[").replace("$", r"\$")
    ):
        REQUEST_DECODER.decode(json.dumps({**VALID, **patch}))


def test_events_decode_by_kind_and_terminal_ones_have_no_msg_id() -> None:
    completed = Completed(
        request_id="r",
        tenant="t",
        at=1.0,
        backend="b",
        attempt=1,
        delivery=2,
        text="x",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        cost=0.0,
    )
    failed = Failed(request_id="r", tenant="t", at=2.0, error_type="e", reason="why")
    routed = Routed(
        request_id="r", tenant="t", at=0.5, backend="b", attempt=1, priority="high", queue_wait=0.1
    )
    assert EVENT_DECODER.decode(encode(completed)) == completed
    assert json.loads(encode(failed))["kind"] == "failed"
    assert is_terminal(completed)
    assert is_terminal(failed)
    assert not is_terminal(routed)
    # Exactly one terminal event rests on the terminal claim, not on a message
    # id a tenant could pre-occupy: terminal events are published without one.
    for terminal in (completed, failed):
        with pytest.raises(ValueError, match=r"EventLog\.finish"):
            msg_id_of(terminal)
    assert msg_id_of(routed) == "t:r:routed:1"


def test_old_events_without_new_fields_still_decode() -> None:
    # Schema evolution: fields with defaults may be absent in older log entries.
    old = {
        "kind": "failed",
        "request_id": "r",
        "tenant": "t",
        "at": 1.0,
        "error_type": "e",
        "reason": "r",
    }
    event = EVENT_DECODER.decode(json.dumps(old))
    assert isinstance(event, Failed)
    assert event.backend is None


def test_schema_command_prints_json_schema_for_every_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "renqueue", "schema"], check=True, capture_output=True, text=True
    ).stdout
    defs = json.loads(out)["$defs"]
    for name in ("InferenceRequest", "Dispatch", "TokenChunk", "Completed", "Rejected"):
        assert name in defs
    assert defs["InferenceRequest"]["properties"]["id"]["pattern"]
