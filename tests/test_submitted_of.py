"""The one lookup of a request's ``submitted`` event (``broker.submitted_of``).

A request submitted again under its id after the duplicate window has two
``submitted`` events: the lookup gives the newer by default and the first when
asked, as the request's history starts (the DLQ's requeue marks read that one);
a payload that disagrees with its subject is never the answer.
"""

from __future__ import annotations

from renqueue.broker import Connection, DeadLetters, JetStream, provision, submitted_of
from renqueue.config import parse_config
from renqueue.schema import EVENTS_STREAM, InferenceRequest, encode, event_subject, submitted


def _request(tenant: str, request_id: str) -> InferenceRequest:
    return InferenceRequest(
        id=request_id,
        tenant=tenant,
        priority="normal",
        route="chat",
        messages=({"role": "user", "content": "hi"},),  # type: ignore[arg-type]
    )


async def _store(js: JetStream, tenant: str, request_id: str, at: float, *, on: str) -> None:
    """``tenant``'s ``submitted`` event of ``request_id`` at ``at``, on ``on``'s subject."""
    event = submitted(_request(tenant, request_id), at=at)
    await js.publish(event_subject(on, request_id, "submitted"), encode(event))


async def test_the_newer_by_default_the_first_when_asked(
    isolated_nc: Connection, isolated_js: JetStream
) -> None:
    await provision(isolated_nc, parse_config({}))
    await _store(isolated_js, "t", "twice", 100.0, on="t")
    await _store(isolated_js, "t", "twice", 900.0, on="t")

    newer = await submitted_of(isolated_js, "t", "twice")
    from_leader = await submitted_of(isolated_js, "t", "twice", direct=False)
    first = await submitted_of(isolated_js, "t", "twice", first=True)

    assert newer is not None
    assert newer.at == 900.0
    assert from_leader is not None
    assert from_leader.at == 900.0
    assert first is not None
    assert first.at == 100.0
    assert await submitted_of(isolated_js, "t", "never") is None
    assert await submitted_of(isolated_js, "t", "never", first=True) is None


async def test_a_payload_that_disagrees_with_its_subject_is_no_answer(
    isolated_nc: Connection, isolated_js: JetStream
) -> None:
    await provision(isolated_nc, parse_config({}))
    # Another tenant's event on t's subject, first and last: skipped by both reads.
    await _store(isolated_js, "other", "forged", 50.0, on="t")
    await _store(isolated_js, "t", "forged", 100.0, on="t")
    await _store(isolated_js, "other", "forged", 900.0, on="t")

    first = await submitted_of(isolated_js, "t", "forged", first=True)

    assert first is not None
    assert (first.tenant, first.at) == ("t", 100.0)
    assert await submitted_of(isolated_js, "t", "forged") is None
    info = await isolated_js.stream_info(EVENTS_STREAM)
    assert info.state.messages == 3


async def test_a_requeue_mark_reads_the_requeued_request_s_first_submit(
    isolated_nc: Connection, isolated_js: JetStream
) -> None:
    """The DLQ's requeue marks date a requeue by when it was first submitted."""
    await provision(isolated_nc, parse_config({}))
    await _store(isolated_js, "t", "again", 100.0, on="t")
    await _store(isolated_js, "t", "again", 900.0, on="t")

    found = await DeadLetters(isolated_js)._submitted("t", "again")

    assert found is not None
    assert found.at == 100.0
