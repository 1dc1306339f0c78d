"""Fewer token writes per request (issue 31 item 1), on a real nats-server and the mock.

- The read that also brought the backend's end of stream does not get a chunk
  of its own: its text goes in the final chunk (one chunk for an answer that
  came in one read; a slow backend's earlier reads are still one chunk each,
  published as they come).
- A request submitted with ``stream=False`` stores no chunk at all: its answer
  is whole in ``completed``; ``stream()`` on its handle is a typed error.
- The gateway submits ``stream: false`` chat completions so.

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
from _loopback import serve
from _waits import until
from aiohttp import web
from test_coalescing import _wait_coalesced
from test_final_chunks import make_config, stored_chunks
from test_gateway_sdk import ACME, Stack, start
from test_resilience import config_of, one_mb_server

from renqueue import (
    Client,
    GenerationParams,
    RequestFailedError,
    Services,
    TokenChunk,
    TokensExpiredError,
    TokensNotStreamedError,
)
from renqueue.broker import EventLog
from renqueue.client._tokens import TokenFollower
from renqueue.errors import NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    REQUEST_DECODER,
    TOKENS_STREAM,
    Completed,
    InferenceRequest,
    encode,
    token_subject,
)

TENANT = "t"


async def streamed(client: Client, **submit: Any) -> tuple[list[TokenChunk], str, str]:
    """Submit, read ``handle.stream()`` to its end: the chunks, the result's text, the id."""
    handle = await client.submit("hi", route="chat", **submit)
    chunks = [chunk async for chunk in handle.stream(timeout=10)]
    result = await handle.result(timeout=10)
    return chunks, result.text, handle.id


async def no_chunk_stored(client: Client, tenant: str, request_id: str) -> bool:
    try:
        await client.js.get_last_msg(TOKENS_STREAM, token_subject(tenant, request_id), direct=True)
    except NatsNotFoundError:
        return True
    return False


@pytest.fixture
async def instant() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(tokens_per_second=0, output_tokens=4)) as mock:
        yield mock


async def test_an_answer_whose_end_came_in_its_one_read_is_one_final_chunk(
    tmp_path: Path, instant: MockBackend
) -> None:
    config = make_config(tmp_path, instant.url)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        chunks, text, request_id = await streamed(client)
        stored = await stored_chunks(client, request_id)
    assert text
    [only] = chunks
    assert (only.final, only.delivery, only.seq, only.restart) == (True, 1, 0, False)
    assert only.text == text
    assert only.finish_reason == "stop"
    assert only.usage is not None
    assert only.usage.completion_tokens == 4
    assert len(stored) == 1
    assert stored[0]["final"] is True
    assert stored[0]["text"] == text


async def test_two_reads_are_still_two_chunks_the_second_one_final(tmp_path: Path) -> None:
    # Two tokens 200 ms apart: the first one's read is published at once, the
    # second came with the end and is the final chunk.
    async with MockBackend(MockSettings(tokens_per_second=5, output_tokens=2)) as mock:
        config = make_config(tmp_path, mock.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            chunks, text, request_id = await streamed(client)
            stored = await stored_chunks(client, request_id)
    assert [(c.seq, c.final) for c in chunks] == [(0, False), (1, True)]
    assert chunks[0].text
    assert chunks[1].text
    assert "".join(c.text for c in chunks) == text
    assert [(c["seq"], c["final"]) for c in stored] == [(0, False), (1, True)]


async def test_a_request_submitted_without_stream_stores_no_chunk_and_its_result_is_whole(
    tmp_path: Path, instant: MockBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(tmp_path, instant.url)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        quiet = await client.submit("hi", route="chat", stream=False)
        assert quiet.streamed is False
        result = await quiet.result(timeout=10)
        with pytest.raises(TokensNotStreamedError) as raised:
            await anext(quiet.stream())
        assert raised.value.request_id == quiet.id
        # A request streamed after it: once its chunks are stored, anything the
        # first one had published (earlier, on the same connection) would be too.
        chunks, text, loud = await streamed(client)
        await stored_chunks(client, loud)
        assert await no_chunk_stored(client, TENANT, quiet.id)
        claim = await EventLog(client.js).claim_of(TENANT, quiet.id)
        # Through a handle that did not submit it: no chunk ever comes.
        monkeypatch.setattr(TokenFollower, "IDLE", 0.1)
        with pytest.raises(TokensExpiredError):
            await anext(client.handle(quiet.id).stream(timeout=10))
    assert result.text == text
    assert result.text == "".join(c.text for c in chunks)
    assert result.finish_reason == "stop"
    assert result.usage.completion_tokens == 4
    assert claim is not None
    assert claim.stream is False
    assert isinstance(claim.event, Completed)


async def test_the_gateway_submits_whole_answers_without_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TokenFollower, "IDLE", 0.1)
    settings = MockSettings(ttft=0.0, tokens_per_second=0, output_tokens=8)
    async with MockBackend(settings) as mock:
        async for stack in start(tmp_path, mock):
            await whole_and_streamed(stack)


async def whole_and_streamed(stack: Stack) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
    async with stack.http(ACME) as http:
        whole = await http.post("/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        whole_id = whole.headers["x-request-id"]
        content = whole.json()["choices"][0]["message"]["content"]
        # A streamed one after it: its chunks, the final one with the text.
        pieces = []
        async with http.stream(
            "POST", "/chat/completions", json={**body, "stream": True}
        ) as response:
            assert response.status_code == 200
            stream_id = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"]
                    if delta:
                        pieces.append(delta[0]["delta"].get("content") or "")
    async with stack.client("acme") as client:
        await final_stored(client, "acme", stream_id)
        assert await no_chunk_stored(client, "acme", whole_id)
    async with stack.http(ACME) as http:
        # A whole answer has no stream to join.
        joined = await http.get(f"/requests/{whole_id}/stream")
        assert joined.status_code == 410, joined.text
        assert joined.json()["error"]["code"] == "stream_expired"
    assert content
    assert "".join(pieces) == content


async def final_stored(client: Client, tenant: str, request_id: str) -> None:
    """Wait until ``request_id``'s final chunk is stored."""

    async def stored() -> bool:
        try:
            last = await client.js.get_last_msg(
                TOKENS_STREAM, token_subject(tenant, request_id), direct=True
            )
        except NatsNotFoundError:
            return False
        return bool(json.loads(last.data or b"{}").get("final"))

    await until(stored, f"the final chunk of {request_id} is stored")


async def test_a_coalesced_follower_gets_the_whole_answer_in_one_final_chunk(
    tmp_path: Path,
) -> None:
    # The leader's call takes a while (its first token after 0.5 s): time to join it.
    async with MockBackend(MockSettings(ttft=0.5, tokens_per_second=0, output_tokens=4)) as mock:
        config = make_config(tmp_path, mock.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            leader = await client.submit("same", route="chat", coalesce=True)
            follower = await client.submit("same", route="chat", coalesce=True)
            await _wait_coalesced(client, follower.id)
            chunks = [chunk async for chunk in follower.stream(timeout=10)]
            led = await leader.result(timeout=10)
            shared = await follower.result(timeout=10)
            stored = await stored_chunks(client, follower.id)
    assert shared.text == led.text
    [only] = chunks
    assert (only.final, only.delivery, only.seq, only.text) == (True, 1, 0, led.text)
    assert [(c["final"], c["text"]) for c in stored] == [(True, led.text)]


# ------------------------------------------- a backend that ends its body late

_CHUNK = 'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n'
_FINISH = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'


async def test_the_read_with_the_end_marker_is_not_held_until_the_body_ends(
    tmp_path: Path,
) -> None:
    # A server (or a proxy before it) that sends its last token and [DONE] in
    # one write, then keeps the body open: the token is a slow backend's
    # token, it is not held back until the body ends.
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write((_CHUNK % "Hello" + _FINISH + "data: [DONE]\n\n").encode())
        await release.wait()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with serve(app) as origin:
        config = make_config(tmp_path, f"{origin}/v1")
        try:
            async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
                handle = await client.submit("hi", route="chat")
                chunks = handle.stream(timeout=10).__aiter__()
                first = await asyncio.wait_for(anext(chunks), 10)
                assert first.text == "Hello"
                release.set()
                assert (await handle.result(timeout=10)).text == "Hello"
        finally:
            release.set()


async def test_a_request_written_without_stream_gets_chunks_an_older_reader_reads_whole(
    tmp_path: Path, instant: MockBackend
) -> None:
    # An older client writes no `stream` and drops a final chunk's text (it
    # ended its stream at `final`): its requests keep the shape it reads, the
    # text in chunks of their own and an empty final chunk, whatever the
    # upgraded workers do for clients that say `stream`.
    config = make_config(tmp_path, instant.url)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        built = client.build_request("hi", route="chat")
        raw = json.loads(encode(built))
        del raw["stream"]
        old = REQUEST_DECODER.decode(json.dumps(raw).encode())
        handle = await client.submit_request(old)
        text = (await handle.result(timeout=10)).text
        stored = await stored_chunks(client, handle.id)
    assert text
    assert stored[-1]["final"] is True
    assert stored[-1]["text"] == ""  # what an older reader drops is empty
    assert "".join(chunk["text"] for chunk in stored[:-1]) == text


async def test_an_answer_too_big_to_record_still_streams_its_last_read(tmp_path: Path) -> None:
    # Its `completed` event is over a 1 MB broker: the request fails, and the
    # last read's text, held for a final chunk that cannot carry it, is
    # streamed as a chunk of its own, as every other read was.
    settings = MockSettings(ttft=0.01, output_tokens=150_000)
    async with MockBackend(settings) as mock, one_mb_server(tmp_path) as server:
        config = config_of(mock.url, nats_url=server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit(
                "a long answer", route="chat", params=GenerationParams(max_tokens=150_000)
            )
            text = "".join([chunk.text async for chunk in handle.stream(timeout=60)])
            with pytest.raises(RequestFailedError, match="too big to record whole"):
                await handle.result(timeout=60)
    assert text.endswith(" tok149999")


async def test_an_answer_too_big_to_record_and_not_streamed_does_not_say_streamed(
    tmp_path: Path,
) -> None:
    settings = MockSettings(ttft=0.01, output_tokens=150_000)
    async with MockBackend(settings) as mock, one_mb_server(tmp_path) as server:
        config = config_of(mock.url, nats_url=server.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit(
                "a long answer",
                route="chat",
                params=GenerationParams(max_tokens=150_000),
                stream=False,
            )
            with pytest.raises(RequestFailedError, match="too big to record whole") as caught:
                await handle.result(timeout=60)
            assert await no_chunk_stored(client, TENANT, handle.id)
    assert "streamed" not in str(caught.value).replace("not streamed", "")


def _as_an_older_client_writes(request: InferenceRequest) -> InferenceRequest:
    """``request`` without ``stream``, as a client older than the field writes it."""
    raw = json.loads(encode(request))
    del raw["stream"]
    return REQUEST_DECODER.decode(json.dumps(raw).encode())


async def test_a_coalesced_follower_from_an_older_client_gets_its_text_in_a_chunk(
    tmp_path: Path,
) -> None:
    async with MockBackend(MockSettings(ttft=0.5, tokens_per_second=0, output_tokens=4)) as mock:
        config = make_config(tmp_path, mock.url)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            leader = await client.submit("same", route="chat", coalesce=True)
            built = client.build_request("same", route="chat", coalesce=True)
            follower = await client.submit_request(_as_an_older_client_writes(built))
            await _wait_coalesced(client, follower.id)
            led = await leader.result(timeout=10)
            assert (await follower.result(timeout=10)).text == led.text
            stored = await stored_chunks(client, follower.id)
    assert [(c["final"], c["text"]) for c in stored] == [(False, led.text), (True, "")]
