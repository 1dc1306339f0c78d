"""Idempotency-Key edge cases: a claim nobody will settle, a request with no body on record.

A key's first call claims it for its body before its publish (a compare-and-set
entry in ``rq-state`` holding the body's fingerprint, pending until the request
under the key is known to have that body). Stripe's semantics are the
reference: a key names one request, with one body; a key whose first request
never completed may be used again.

- A gateway killed between the claim and its publish left the claim pending
  with nothing stored: any other body was a 422 ``idempotency_key_reused`` for
  the claim's whole life (two duplicate windows, ~20 min), though no request
  under the key existed. A pending claim unchanged for the grace, with no
  request under the key on record, is taken over by the next call (a
  compare-and-set on the claim's revision: of two calls at once, one takes it).
- A request stored under a key's id with no body fingerprint on record (not
  by a gateway: a Client of the tenant naming the id itself) was joined by a
  call of any body, which was answered with the other body's text. Its
  content is compared instead: the same messages, route and parameters join
  it, others are a 422.

Real Services, a real nats-server and the mock backend over loopback HTTP
(the fixtures of tests/test_gateway_sdk.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from _waits import until
from test_gateway_sdk import ACME, Stack, joined_by_key, make_config, mock, start, unread_stack

from renqueue import Services
from renqueue.broker import JetStream, KeyValue
from renqueue.errors import NatsTimeoutError
from renqueue.gateway import Gateway
from renqueue.gateway._idempotency import claim_key, fingerprint, id_for_key
from renqueue.gateway._submissions import BODY_KEY
from renqueue.mock import MockBackend
from renqueue.schema import STATE_BUCKET

__all__ = ["mock"]  # the fixture, used by name

A = {"model": "chat", "messages": [{"role": "user", "content": "A"}]}
B = {"model": "chat", "messages": [{"role": "user", "content": "B"}]}
C = {"model": "chat", "messages": [{"role": "user", "content": "C"}]}


async def abandoned_claim(stack: Stack, key: str, body: bytes) -> tuple[KeyValue, str]:
    """What a gateway killed between its claim and its publish leaves: the
    key's claim, pending, for ``body``; nothing stored. The bucket and the
    claim's name."""
    assert stack.services.js is not None
    state = await stack.services.js.key_value(STATE_BUCKET)
    name = claim_key("acme", id_for_key(key))
    await state.create(name, b"?" + fingerprint("acme", body).encode(), msg_ttl=600)
    return state, name


async def confirmed_for(state: KeyValue, name: str, body: bytes) -> bool:
    entry = await state.latest(name)
    return entry is not None and entry.value == fingerprint("acme", body).encode()


async def test_a_claim_left_pending_with_nothing_stored_is_taken_over_by_another_body(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Before, the call of body B was a 422 ``idempotency_key_reused`` (for
    the claim's whole life). Now B takes the claim over after the grace and
    is served; the key then names B's request, and body A is the 422."""
    key = "abandoned-1"
    body_a = b'{"model": "chat", "messages": [{"role": "user", "content": "A"}]}'
    async for stack in start(tmp_path, mock):
        state, name = await abandoned_claim(stack, key, body_a)
        async with stack.http() as http:
            taken = await http.post("/chat/completions", json=B, headers={"Idempotency-Key": key})
            assert taken.status_code == 200, taken.text
            body_b = taken.request.content

            async def confirmed(
                state: KeyValue = state, name: str = name, body_b: bytes = body_b
            ) -> bool:
                return await confirmed_for(state, name, body_b)

            await until(confirmed, "the claim is B's, confirmed")
            again = await http.post(
                "/chat/completions",
                content=body_a,
                headers={"Idempotency-Key": key, "content-type": "application/json"},
            )
    assert taken.json()["id"] == id_for_key(key)
    assert again.status_code == 422, again.text
    assert again.json()["error"]["code"] == "idempotency_key_reused"
    assert mock.stats().requests == 1


async def test_two_gateways_cannot_both_take_an_abandoned_claim_over(
    tmp_path: Path, mock: MockBackend
) -> None:
    """Two gateway processes, each a call of its own body, at once: the
    take-over is a compare-and-set on the claim's revision, so one takes it
    and is served; the other then finds the winner's claim and is a 422.
    One request is stored and run."""
    key = "abandoned-2"
    body_a = b'{"model": "chat", "messages": [{"role": "user", "content": "A"}]}'
    config = make_config(tmp_path, mock)
    async with (
        Services(config) as services,
        Gateway(config, url=services.url) as one,
        Gateway(config, url=services.url) as two,
    ):
        stack = Stack(services, one)
        state, name = await abandoned_claim(stack, key, body_a)
        headers = {"Idempotency-Key": key, "Authorization": f"Bearer {ACME}"}
        async with (
            _http(one.url, headers) as first,
            _http(two.url, headers) as second,
        ):
            answers = await asyncio.gather(
                first.post("/chat/completions", json=B), second.post("/chat/completions", json=C)
            )
        entry = await state.latest(name)
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200, 422], [answer.text for answer in answers]
    [won] = [answer for answer in answers if answer.status_code == 200]
    [lost] = [answer for answer in answers if answer.status_code == 422]
    assert lost.json()["error"]["code"] == "idempotency_key_reused"
    assert entry is not None
    assert entry.value == fingerprint("acme", won.request.content).encode()
    assert mock.stats().requests == 1


async def test_a_claim_taken_over_is_put_back_when_its_first_body_was_stored_unread(
    tmp_path: Path, mock: MockBackend
) -> None:
    """The abandoned claim's call had stored its request (and went away before
    confirming), and no router has read it: the call of body B takes the claim
    over, its publish is a duplicate and nothing on record tells its body, so
    it is a 409 ``idempotency_key_unverified`` (never joined), and the claim
    is put back as it was: a call of body A then joins the stored request
    (taking nothing over), and once a router reads it, B is a 422."""
    key = "stored-abandoned-1"
    rid = id_for_key(key)
    body_a = b'{"model": "chat", "messages": [{"role": "user", "content": "A"}]}'
    headers = {"Idempotency-Key": key}
    async with unread_stack(tmp_path, mock) as (stack, routed), stack.http() as http:
        state, name = await abandoned_claim(stack, key, body_a)
        async with stack.client() as client:
            built = client.build_request(
                [{"role": "user", "content": "A"}],
                route="chat",
                request_id=rid,
                metadata={BODY_KEY: fingerprint("acme", body_a)},
            )
            await client.submit_request(built)
        unverified = await http.post("/chat/completions", json=B, headers=headers)
        pending_a = b"?" + fingerprint("acme", body_a).encode()

        async def put_back(state: KeyValue = state, name: str = name) -> bool:
            entry = await state.latest(name)
            return entry is not None and entry.value == pending_a

        await until(put_back, "the claim is put back, pending for A")
        joined = joined_by_key()
        call = asyncio.create_task(
            http.post(
                "/chat/completions",
                content=body_a,
                headers={**headers, "content-type": "application/json"},
            )
        )

        async def answered_or_joined() -> bool:
            return call.done() or joined_by_key() > joined

        await until(answered_or_joined, "the call of A joins the stored request")
        assert not call.done(), call.result().text
        async with Services(routed, routers=1, provision_streams=False):
            answer = await call
            refused = await http.post("/chat/completions", json=B, headers=headers)
    assert unverified.status_code == 409, unverified.text
    assert unverified.json()["error"]["code"] == "idempotency_key_unverified"
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == rid
    assert refused.status_code == 422, refused.text
    assert mock.stats().requests == 1


async def test_a_call_whose_claim_was_taken_over_meanwhile_never_joins_the_takers_request(
    tmp_path: Path, mock: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Call A (gateway one) claims its key; its first publish is not answered
    for longer than the grace (its ack lost, nothing stored), so call B of
    another body (gateway two) takes the claim over, stores its request and
    confirms the claim. A's publish, sent again, finds a request stored: not
    its own first try, as a retry after a lost ack would otherwise assume
    (joined unchecked, A would be answered with B's text), since its claim is
    no longer its own: with no router to tell the bodies apart, a 409."""
    key = "slow-claimer-1"
    rid = id_for_key(key)
    name = claim_key("acme", rid)
    headers = {"Idempotency-Key": key, "Authorization": f"Bearer {ACME}"}
    real = JetStream.publish
    held: list[str] = []
    config = make_config(tmp_path, mock)
    async with Services(config, routers=0, backends=[]) as services:
        assert services.js is not None
        state = await services.js.key_value(STATE_BUCKET)

        async def claim_holds(body: bytes, *, pending: bool) -> bool:
            entry = await state.latest(name)
            value = fingerprint("acme", body).encode()
            return entry is not None and entry.value == (b"?" + value if pending else value)

        body_a = b'{"model": "chat", "messages": [{"role": "user", "content": "A"}]}'
        body_b = b'{"model": "chat", "messages": [{"role": "user", "content": "B"}]}'

        async def a_slow(self: JetStream, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
            if subject.startswith("rq.req.") and b'"A"' in payload and not held:
                held.append(subject)
                # Not answered until B has taken the claim over and stored its request.
                await until(
                    lambda: claim_holds(body_b, pending=False), "B's claim is confirmed", 60
                )
                raise NatsTimeoutError("nats: timeout")
            return await real(self, subject, payload, **kwargs)

        monkeypatch.setattr(JetStream, "publish", a_slow)
        async with (
            Gateway(config, url=services.url) as one,
            Gateway(config, url=services.url) as two,
            _http(one.url, headers) as first,
            _http(two.url, headers) as second,
        ):
            call_a = asyncio.create_task(
                first.post(
                    "/chat/completions",
                    content=body_a,
                    headers={"content-type": "application/json"},
                )
            )
            await until(lambda: claim_holds(body_a, pending=True), "A's claim is made")
            call_b = asyncio.create_task(
                second.post(
                    "/chat/completions",
                    content=body_b,
                    headers={"content-type": "application/json"},
                )
            )

            async def a_answered_or_joined() -> bool:
                return call_a.done() or one._submissions.recent("acme", rid) is not None

            await until(a_answered_or_joined, "A is answered, or joins B's request", 60)
            joined = not call_a.done()
            call_b.cancel()
            call_a.cancel()
            results = await asyncio.gather(call_a, call_b, return_exceptions=True)
    assert held
    assert not joined, "A joined B's request"
    answer = results[0]
    assert isinstance(answer, httpx.Response)
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "idempotency_key_unverified"


async def test_a_claim_taken_over_and_left_pending_never_joins_its_body_to_the_first_request(
    tmp_path: Path, mock: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of the take-over: the abandoned claim's call had stored its
    request A (unread), and call B1 took the claim over, but its own publish
    never came back (its gateway killed, or the publish slow: a lost ack sent
    again) so it neither found the duplicate nor put the claim back. B's SDK
    retry (B2) then met a pending claim of its own body unchanged past the
    grace and took it for "its claimer stored the request and went away":
    it joined A's request and would be answered with A's text. A claim made
    by a take-over says so: its claimer's publish may have met another body's
    request, so B2 is a 409 until a router tells the bodies apart."""
    key = "taken-and-gone-1"
    rid = id_for_key(key)
    body_a = b'{"model": "chat", "messages": [{"role": "user", "content": "A"}]}'
    body_b = b'{"model": "chat", "messages": [{"role": "user", "content": "B"}]}'
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    real = JetStream.publish
    held: list[str] = []
    release = asyncio.Event()

    async def b_gone(self: JetStream, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        if subject.startswith("rq.req.") and b'"B"' in payload and not held:
            held.append(subject)
            await release.wait()  # B1's publish never answered while the test runs
            raise NatsTimeoutError("nats: timeout")
        return await real(self, subject, payload, **kwargs)

    async with unread_stack(tmp_path, mock) as (stack, _routed), stack.http() as http:
        state, name = await abandoned_claim(stack, key, body_a)
        async with stack.client() as client:
            built = client.build_request(
                [{"role": "user", "content": "A"}],
                route="chat",
                request_id=rid,
                metadata={BODY_KEY: fingerprint("acme", body_a)},
            )
            await client.submit_request(built)
        monkeypatch.setattr(JetStream, "publish", b_gone)
        first = asyncio.create_task(http.post("/chat/completions", content=body_b, headers=headers))
        try:

            async def b_publishing() -> bool:
                entry = await state.latest(name)
                taken = entry is not None and entry.value.endswith(
                    fingerprint("acme", body_b).encode()
                )
                return taken and bool(held)

            await until(b_publishing, "B1 took the claim over and publishes", 60)
            joined = joined_by_key()
            retry = asyncio.create_task(
                http.post("/chat/completions", content=body_b, headers=headers)
            )

            async def answered_or_joined() -> bool:
                return retry.done() or joined_by_key() > joined

            await until(answered_or_joined, "B2 is answered, or joins A's request", 60)
            assert retry.done(), "B2 joined A's request"
            answer = await retry
        finally:
            release.set()
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "idempotency_key_unverified"
    assert mock.stats().requests == 0


async def test_a_lost_ack_retry_never_takes_a_claim_another_call_took_over_for_its_own(
    tmp_path: Path, mock: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Call A claims its key and its first publish is not answered (its ack
    lost, nothing stored). Meanwhile call B of another body took the claim
    over and stored its request, and, B gone, a later call of body A took
    B's claim over in turn (a claim of A's body again, marked taken over).
    A's publish, sent again, finds a request stored: B's. Its claim names
    its body, but not as A made it: not A's first try, so not joined
    unchecked (A would be answered with B's text) but a 409."""
    key = "taken-twice-1"
    rid = id_for_key(key)
    name = claim_key("acme", rid)
    body_a = b'{"model": "chat", "messages": [{"role": "user", "content": "A"}]}'
    body_b = b'{"model": "chat", "messages": [{"role": "user", "content": "B"}]}'
    real = JetStream.publish
    held: list[str] = []
    go = asyncio.Event()

    async def a_lost(self: JetStream, subject: str, payload: bytes = b"", **kwargs: Any) -> Any:
        if subject.startswith("rq.req.") and b'"A"' in payload and not held:
            held.append(subject)
            await go.wait()
            raise NatsTimeoutError("nats: timeout")  # its ack lost: sent again
        return await real(self, subject, payload, **kwargs)

    async with unread_stack(tmp_path, mock) as (stack, _routed), stack.http() as http:
        assert stack.services.js is not None
        state = await stack.services.js.key_value(STATE_BUCKET)
        pending_a = b"?" + fingerprint("acme", body_a).encode()
        monkeypatch.setattr(JetStream, "publish", a_lost)
        call_a = asyncio.create_task(
            http.post(
                "/chat/completions",
                content=body_a,
                headers={"Idempotency-Key": key, "content-type": "application/json"},
            )
        )
        try:

            async def a_publishing() -> bool:
                entry = await state.latest(name)
                return entry is not None and entry.value == pending_a and bool(held)

            await until(a_publishing, "A claimed the key and publishes")
            # B took A's claim over and stored its request ...
            async with stack.client() as client:
                built = client.build_request(
                    [{"role": "user", "content": "B"}],
                    route="chat",
                    request_id=rid,
                    metadata={BODY_KEY: fingerprint("acme", body_b)},
                )
                await client.submit_request(built)
            entry = await state.latest(name)
            assert entry is not None
            taken_b = b"?!" + fingerprint("acme", body_b).encode()
            revision = await state.update(name, taken_b, last=entry.revision)
            # ... and a later call of body A took B's claim over in turn.
            await state.update(name, b"?!" + pending_a[1:], last=revision)
            go.set()

            async def a_answered_or_joined() -> bool:
                return call_a.done() or stack.gateway._submissions.recent("acme", rid) is not None

            await until(a_answered_or_joined, "A is answered, or joins B's request", 60)
            assert call_a.done(), "A joined B's request"
            answer = await call_a
        finally:
            go.set()
            call_a.cancel()
            await asyncio.gather(call_a, return_exceptions=True)
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "idempotency_key_unverified"


async def test_a_request_stored_without_a_body_on_record_is_joined_only_by_its_own_content(
    tmp_path: Path, mock: MockBackend
) -> None:
    """A request stored under a key's id by a Client of the tenant naming the
    id itself (no body fingerprint in its metadata), and read by a router.
    Before, a call of the key with any body joined it, and was answered with
    its text. Now its content is compared: other messages are a 422, the
    same ones join it."""
    key = "client-made-1"
    rid = id_for_key(key)
    async for stack in start(tmp_path, mock):
        async with stack.client() as client:
            handle = await client.submit("A", route="chat", request_id=rid)
            await handle.result(timeout=30)
        async with stack.http() as http:
            other = await http.post("/chat/completions", json=B, headers={"Idempotency-Key": key})
            same = await http.post("/chat/completions", json=A, headers={"Idempotency-Key": key})
    assert other.status_code == 422, other.text
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert same.status_code == 200, same.text
    assert same.json()["id"] == rid
    assert mock.stats().requests == 1


def _http(url: str, headers: dict[str, str]) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=60)


pytestmark = pytest.mark.timeout(120)
