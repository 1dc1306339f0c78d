"""The mock LLM server: real HTTP on loopback, checked the way a provider would be."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import sys
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from renqueue.mock import MockBackend, MockSettings, format_reset, serve

CHAT = {"model": "m", "messages": [{"role": "user", "content": "12345678"}]}  # 2 prompt tokens


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5) as http:
        yield http


def sse_payloads(body: str) -> list[str]:
    return [line[6:] for line in body.split("\n") if line.startswith("data: ")]


async def test_stream_sends_tokens_then_finish_then_usage_then_done(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend(MockSettings(output_tokens=3)) as mock:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        response = await client.post(f"{mock.url}/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "tok0 tok1 tok2"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


async def test_stream_without_include_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    async with MockBackend(MockSettings(output_tokens=2)) as mock:
        response = await client.post(f"{mock.url}/chat/completions", json={**CHAT, "stream": True})
    chunks = [json.loads(p) for p in sse_payloads(response.text)[:-1]]
    assert all("usage" not in chunk for chunk in chunks)


async def test_non_streaming_answer_honours_max_tokens_as_a_cap(client: httpx.AsyncClient) -> None:
    async with MockBackend(MockSettings(output_tokens=10)) as mock:
        capped = await client.post(f"{mock.url}/chat/completions", json={**CHAT, "max_tokens": 4})
        full = await client.post(f"{mock.url}/chat/completions", json=CHAT)
        stats = mock.stats()
    answer = capped.json()
    assert answer["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 4
    assert full.json()["choices"][0]["finish_reason"] == "stop"
    assert full.json()["usage"]["completion_tokens"] == 10
    assert (stats.completed, stats.tokens_out, stats.streamed) == (2, 14, 0)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"{not json", "invalid request body"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b"[1, 2]", "object"),
    ],
)
async def test_bad_input_gets_400_with_openai_error_body_and_server_survives(
    client: httpx.AsyncClient, payload: bytes, fragment: str
) -> None:
    async with MockBackend() as mock:
        response = await client.post(f"{mock.url}/chat/completions", content=payload)
        after = await client.post(f"{mock.url}/chat/completions", json=CHAT)
        stats = mock.stats()
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert after.status_code == 200
    assert stats.bad_requests == 1


async def test_request_limit_gives_429_with_retry_after_and_ratelimit_headers(
    client: httpx.AsyncClient,
) -> None:
    settings = MockSettings(rpm=2)
    async with MockBackend(settings) as mock:
        url = f"{mock.url}/chat/completions"
        first = await client.post(url, json=CHAT)
        second = await client.post(url, json=CHAT)
        third = await client.post(url, json=CHAT)
        stats = mock.stats()
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.status_code == 429
    error = third.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert error["message"].startswith("Rate limit reached")
    # One request refills in 30 s (2 per 60 s).
    assert 29 <= int(third.headers["retry-after"]) <= 30
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.headers["x-ratelimit-reset-requests"].endswith("s")
    assert (stats.completed, stats.rate_limited) == (2, 1)


async def test_token_limit_counts_prompt_and_completion_tokens(client: httpx.AsyncClient) -> None:
    # Each request costs 2 prompt + 4 completion = 6 tokens; 10 allow one.
    settings = MockSettings(output_tokens=4, tpm=10)
    async with MockBackend(settings) as mock:
        url = f"{mock.url}/chat/completions"
        first = await client.post(url, json=CHAT)
        second = await client.post(url, json=CHAT)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == "4"
    assert "x-ratelimit-limit-requests" not in first.headers  # no request limit declared
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "tokens"
    assert int(second.headers["retry-after-ms"]) > 0


async def test_failure_rate_one_always_fails_with_openai_error(client: httpx.AsyncClient) -> None:
    async with MockBackend(MockSettings(failure_rate=1.0)) as mock:
        response = await client.post(f"{mock.url}/chat/completions", json=CHAT)
        stats = mock.stats()
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert (stats.failed, stats.completed) == (1, 0)


async def test_seeded_failures_repeat_exactly(client: httpx.AsyncClient) -> None:
    async def outcomes() -> list[int]:
        async with MockBackend(MockSettings(failure_rate=0.5, seed=7)) as mock:
            url = f"{mock.url}/chat/completions"
            return [(await client.post(url, json=CHAT)).status_code for _ in range(20)]

    first, second = await outcomes(), await outcomes()
    assert first == second
    assert {200, 500} == set(first)


@pytest.mark.parametrize("status", [429, 503])
async def test_concurrency_cap_rejects_with_configured_status(
    client: httpx.AsyncClient, status: int
) -> None:
    settings = MockSettings(concurrency=1, ttft=0.3, busy_status=status)  # type: ignore[arg-type]
    async with MockBackend(settings) as mock:
        url = f"{mock.url}/chat/completions"
        slow = asyncio.create_task(client.post(url, json=CHAT))
        for _ in range(400):  # until the slow one is generating
            if mock.stats().in_flight:
                break
            await asyncio.sleep(0.005)
        rejected = await client.post(url, json=CHAT)
        assert (await slow).status_code == 200
        stats = mock.stats()
    assert rejected.status_code == status
    assert rejected.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert (stats.busy, stats.max_in_flight_seen) == (1, 1)
    assert stats.rate_limited == (1 if status == 429 else 0)


async def test_client_disconnect_mid_stream_stops_generation(client: httpx.AsyncClient) -> None:
    settings = MockSettings(output_tokens=500, tokens_per_second=100)
    async with MockBackend(settings) as mock:
        body = {**CHAT, "stream": True}
        async with client.stream("POST", f"{mock.url}/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if "tok2" in line:
                    break
        for _ in range(200):
            if mock.stats().disconnects:
                break
            await asyncio.sleep(0.01)
        stats = mock.stats()
        await asyncio.sleep(0.1)
        later = mock.stats()
    assert stats.disconnects == 1
    assert stats.in_flight == 0
    assert stats.tokens_out < 50
    assert later.tokens_out == stats.tokens_out  # nothing generated after the disconnect
    assert stats.completed == 0


async def test_clients_hanging_up_are_counted_and_never_logged_as_errors() -> None:
    """A worker that cancels or preempts a call hangs up on the backend at any
    moment: while sending the request, before the answer starts, mid-stream,
    or with a TCP reset. The mock (here the ``renqueue mock-backend`` process,
    logging at INFO to stderr) counts each as a disconnect and logs no
    traceback: ``make demo`` shows this log."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "renqueue", "mock-backend", "--port", "0", "--ttft", "0.02"),
        *("--tps", "200", "--output-tokens", "400"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.split()[-1]
        port = int(url.removesuffix("/v1").rsplit(":", 1)[1])
        body = json.dumps({**CHAT, "stream": True}).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: mock\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()

        async def hang_up(how: str) -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if how == "while sending":
                writer.write(head + body[:5])
            else:
                writer.write(head + body)
            await writer.drain()
            if how == "mid-stream":
                await reader.readuntil(b"tok3")
            elif how == "with a reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif how == "while sending":
                # The server has the headers and waits for the rest of the body.
                for _ in range(500):
                    if (await mock_stats(url))["requests"] > started:
                        break
                    await asyncio.sleep(0.01)
            writer.close()
            await writer.wait_closed()

        ways = ["while sending", "before the answer", "mid-stream", "with a reset"]
        for how in ways:
            started = (await mock_stats(url))["requests"]
            await hang_up(how)
        stats = await mock_stats(url)
        for _ in range(500):
            if stats["requests"] == len(ways) and stats["in_flight"] == 0:
                break
            await asyncio.sleep(0.01)
            stats = await mock_stats(url)
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = await asyncio.wait_for(proc.communicate(), 30)
    log = err.decode()
    assert "Traceback" not in log
    assert "Error handling request" not in log
    assert stats["disconnects"] == len(ways), stats
    assert stats["completed"] == 0
    assert [json.loads(entry)["level"] for entry in log.splitlines()] == ["info"]  # listening


async def mock_stats(url: str) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(url.removesuffix("/v1") + "/stats")
    stats: dict[str, int] = response.json()
    return stats


async def test_tokens_are_paced_by_tokens_per_second(client: httpx.AsyncClient) -> None:
    settings = MockSettings(output_tokens=10, tokens_per_second=100, ttft=0.05)
    async with MockBackend(settings) as mock:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await client.post(f"{mock.url}/chat/completions", json={**CHAT, "stream": True})
        elapsed = loop.time() - start
    # ttft 50 ms + 9 more tokens at 10 ms each.
    assert 0.13 <= elapsed < 0.5


async def test_admin_settings_change_behaviour_at_runtime(client: httpx.AsyncClient) -> None:
    async with MockBackend(MockSettings(output_tokens=5)) as mock:
        url = f"{mock.url}/chat/completions"
        base = mock.url.removesuffix("/v1")
        before = await client.post(url, json=CHAT)
        changed = await client.post(f"{base}/admin/settings", json={"output_tokens": 2})
        after = await client.post(url, json=CHAT)
        invalid = await client.post(f"{base}/admin/settings", json={"failure_rate": 3})
        unknown = await client.post(f"{base}/admin/settings", json={"nope": 1})
        current = await client.get(f"{base}/admin/settings")
    assert before.json()["usage"]["completion_tokens"] == 5
    assert changed.json()["output_tokens"] == 2
    assert after.json()["choices"][0]["message"]["content"] == "tok0 tok1"
    assert invalid.status_code == 400
    assert unknown.status_code == 400
    assert current.json()["output_tokens"] == 2
    assert current.json()["failure_rate"] == 0.0


async def test_in_process_update_validates() -> None:
    async with MockBackend() as mock:
        assert mock.update(ttft=0.25).ttft == 0.25
        with pytest.raises(msgspec.ValidationError):
            mock.update(failure_rate=-1)
        assert mock.settings.failure_rate == 0.0


async def test_stats_health_models_and_last_request(client: httpx.AsyncClient) -> None:
    async with MockBackend(MockSettings(models=("alpha", "beta"))) as mock:
        base = mock.url.removesuffix("/v1")
        unknown = await client.post(f"{mock.url}/chat/completions", json=CHAT)
        ok = await client.post(
            f"{mock.url}/chat/completions", json={**CHAT, "model": "beta", "temperature": 0.3}
        )
        stats = (await client.get(f"{base}/stats")).json()
        health = await client.get(f"{base}/health")
        models = (await client.get(f"{mock.url}/models")).json()
    assert ok.status_code == 200
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert stats["requests"] == 2
    assert stats["completed"] == 1
    assert stats["last_request"]["temperature"] == 0.3
    assert health.text == "ok"
    assert [m["id"] for m in models["data"]] == ["alpha", "beta"]


async def test_required_api_key_is_checked(client: httpx.AsyncClient) -> None:
    async with MockBackend(MockSettings(require_api_key="sk-good")) as mock:
        url = f"{mock.url}/chat/completions"
        good = await client.post(url, json=CHAT, headers={"Authorization": "Bearer sk-good"})
        bad = await client.post(url, json=CHAT, headers={"Authorization": "Bearer sk-bad"})
    assert good.status_code == 200
    assert bad.status_code == 401
    assert bad.json()["error"]["code"] == "invalid_api_key"


async def test_serve_runs_until_cancelled(client: httpx.AsyncClient) -> None:
    ready: asyncio.Queue[str] = asyncio.Queue()
    task = asyncio.create_task(serve(MockSettings(), "127.0.0.1", 0, on_ready=ready.put_nowait))
    url = await asyncio.wait_for(ready.get(), 5)
    response = await client.get(url.removesuffix("/v1") + "/health")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert response.status_code == 200
    with pytest.raises(httpx.ConnectError):
        await client.get(url.removesuffix("/v1") + "/health")


async def test_close_is_idempotent_and_restart_is_refused() -> None:
    mock = MockBackend()
    await mock.start()
    await mock.close()
    await mock.close()
    with pytest.raises(RuntimeError):
        await mock.start()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.12, "120ms"), (1.0, "1s"), (7.66, "7.66s"), (360.0, "6m0s"), (3723.0, "1h2m3s")],
)
def test_format_reset_matches_openai_style(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text
