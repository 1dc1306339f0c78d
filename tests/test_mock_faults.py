"""Fault injection in the mock backend: each kind's exact wire format, on real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest

from renqueue.mock import FaultSpec, MockBackend, MockSettings

CHAT = {"model": "m", "messages": [{"role": "user", "content": "12345678"}]}  # 2 prompt tokens
STREAM = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}

SERVER_ERROR = {
    "error": {
        "message": "The server had an error while processing your request. Sorry about that!",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}
OVERLOADED = {
    "error": {
        "message": "The server is overloaded or not ready yet.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}
ANTHROPIC_OVERLOADED = {
    "type": "error",
    "error": {"type": "overloaded_error", "message": "Overloaded"},
}
CONTEXT_LENGTH = {
    "error": {
        "message": "This model's maximum context length is 8192 tokens. However, your messages "
        "resulted in 9000 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5) as http:
        yield http


def faulty(*script: str, **settings: Any) -> MockSettings:
    """Settings whose faults are ``script`` (and the other FaultSpec fields in ``settings``)."""
    spec = {k: settings.pop(k) for k in list(settings) if k in FaultSpec.__struct_fields__}
    return msgspec.convert(
        {"faults": {"script": list(script), **spec}, **settings}, MockSettings, strict=False
    )


async def sse(
    client: httpx.AsyncClient, url: str, body: dict[str, Any] | None = None
) -> tuple[httpx.Response, list[str], Exception | None]:
    """A stream's ``data:`` payloads, and the error that cut it short (if any)."""
    payloads: list[str] = []
    async with client.stream("POST", url, json=body or STREAM) as response:
        try:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line[6:])
        except httpx.TransportError as exc:
            return response, payloads, exc
    return response, payloads, None


def text_of(payloads: list[str]) -> str:
    chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


async def until(check: Callable[[], bool], what: str, within: float = 5.0) -> None:
    """Wait until ``check()`` holds (polled), or fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {within} s waiting until {what}")
        await asyncio.sleep(0.005)


def chat_url(mock: MockBackend) -> str:
    return f"{mock.url}/chat/completions"


def base_url(mock: MockBackend) -> str:
    return mock.url.removesuffix("/v1")


# ------------------------------------------------------------ error answers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    ("kind", "status", "expected"),
    [
        ("500", 500, SERVER_ERROR),
        ("503", 503, OVERLOADED),
        ("529", 529, ANTHROPIC_OVERLOADED),
        ("context_length", 400, CONTEXT_LENGTH),
    ],
)
async def test_error_faults_answer_the_providers_status_and_body(
    client: httpx.AsyncClient, kind: str, status: int, expected: dict[str, Any], stream: bool
) -> None:
    async with MockBackend(faulty(kind)) as mock:
        response = await client.post(chat_url(mock), json=STREAM if stream else CHAT)
        stats = mock.stats()
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == expected
    assert stats.faults == {kind: 1}
    assert (stats.completed, stats.failed) == (0, 0)


async def test_content_filter_is_azures_prompt_filter_400(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("content_filter")) as mock:
        response = await client.post(chat_url(mock), json=CHAT)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["status"]) == ("content_filter", "prompt", 400)
    assert error["message"].startswith(
        "The response was filtered due to the prompt triggering Azure OpenAI's content "
        "management policy."
    )
    inner = error["innererror"]
    assert inner["code"] == "ResponsibleAIPolicyViolation"
    assert inner["content_filter_result"]["violence"] == {"filtered": True, "severity": "medium"}


async def test_error_faults_carry_the_dialects_rate_limit_headers(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend(faulty("503", rpm=10)) as mock:
        response = await client.post(chat_url(mock), json=CHAT)
    assert response.status_code == 503
    assert response.headers["x-ratelimit-limit-requests"] == "10"
    # Faults are not charged against the limits.
    assert response.headers["x-ratelimit-remaining-requests"] == "10"


# ------------------------------------------------------------ 429s


async def test_429_has_retry_after_and_429_bare_has_none(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("429", "429_bare", retry_after=7)) as mock:
        with_retry = await client.post(chat_url(mock), json=CHAT)
        bare = await client.post(chat_url(mock), json=CHAT)
        stats = mock.stats()
    assert with_retry.status_code == bare.status_code == 429
    assert with_retry.headers["retry-after"] == "7"
    assert with_retry.headers["retry-after-ms"] == "7000"
    assert "retry-after" not in bare.headers
    assert "retry-after-ms" not in bare.headers
    for response in (with_retry, bare):
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert error["message"].endswith("Please try again in 7s.")
    assert stats.faults == {"429": 1, "429_bare": 1}


@pytest.mark.parametrize(
    ("style", "error_type"), [("anthropic", "rate_limit_error"), ("cerebras", None)]
)
async def test_429_speaks_the_limit_style_dialect_and_adds_retry_after(
    client: httpx.AsyncClient, style: str, error_type: str | None
) -> None:
    async with MockBackend(faulty("429", "429_bare", limit_style=style, retry_after=3)) as mock:
        response = await client.post(chat_url(mock), json=CHAT)
        bare = await client.post(chat_url(mock), json=CHAT)
    assert response.headers["retry-after"] == "3"  # Cerebras sends none itself: added
    assert "retry-after" not in bare.headers
    body = response.json()
    if error_type is not None:
        assert body["error"]["type"] == error_type
    else:
        assert body["code"] == "request_quota_exceeded"


@pytest.mark.parametrize(
    ("style", "marker"),
    [("openai", "insufficient_quota"), ("gemini", "GenerateRequestsPerDayPerProjectPerModel")],
)
async def test_quota_fault_is_the_dialects_quota_exhausted_429(
    client: httpx.AsyncClient, style: str, marker: str
) -> None:
    async with MockBackend(faulty("quota", "ok", limit_style=style)) as mock:
        exhausted = await client.post(chat_url(mock), json=CHAT)
        after = await client.post(chat_url(mock), json=CHAT)
    assert exhausted.status_code == 429
    assert marker in exhausted.text
    assert after.status_code == 200


# ------------------------------------------------------------ broken connections


async def test_reset_resets_the_connection_without_a_response(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("reset")) as mock:
        with pytest.raises(httpx.ReadError):
            await client.post(chat_url(mock), json=CHAT)
        after = await client.post(chat_url(mock), json=CHAT)
        stats = mock.stats()
    assert after.status_code == 200
    assert stats.faults == {"reset": 1}
    assert stats.completed == 1


async def test_hang_sends_nothing_until_the_client_gives_up(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("hang")) as mock:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(chat_url(mock), json=CHAT, timeout=0.3)
        # The client hung up: the mock notices, and counts a disconnect.
        await until(lambda: mock.stats().disconnects == 1, "the mock saw the client go")
        after = await client.post(chat_url(mock), json=CHAT)
    assert after.status_code == 200


async def test_hang_does_not_block_shutdown_or_leak_tasks() -> None:
    mock = MockBackend(faulty("hang", "hang"), shutdown_timeout=30)
    await mock.start()
    before = asyncio.all_tasks()
    async with httpx.AsyncClient(timeout=60) as http:
        hung = [
            asyncio.create_task(http.post(chat_url(mock), json=body)) for body in (CHAT, STREAM)
        ]
        await until(lambda: mock.stats().faults.get("hang") == 2, "both requests hang")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await mock.close()
        closed_in = loop.time() - started
        results = await asyncio.gather(*hung, return_exceptions=True)
    # Far below shutdown_timeout: the hung handlers let go at once.
    assert closed_in < 5
    assert all(isinstance(r, httpx.RemoteProtocolError) for r in results), results
    assert asyncio.all_tasks() <= before


async def test_break_cuts_a_stream_after_n_tokens(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("break", output_tokens=6, after_tokens=3)) as mock:
        response, payloads, error = await sse(client, chat_url(mock))
        stats = mock.stats()
    assert response.status_code == 200
    assert isinstance(error, httpx.RemoteProtocolError)  # the chunked body never ended
    assert "[DONE]" not in payloads
    assert text_of(payloads) == "tok0 tok1 tok2"
    chunks = [json.loads(p) for p in payloads]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert stats.faults == {"break": 1}
    assert stats.completed == 0


async def test_break_cuts_a_json_answer_mid_body(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("break")) as mock:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(chat_url(mock), json=CHAT)


# ------------------------------------------------------------ broken streams


async def test_malformed_json_answer_is_a_200_that_is_not_json(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend(faulty("malformed")) as mock:
        response = await client.post(chat_url(mock), json=CHAT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.text.startswith('{"id":"chatcmpl-mock-')
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.text)


async def test_malformed_stream_has_one_data_line_that_is_not_json(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend(faulty("malformed", output_tokens=4, after_tokens=1)) as mock:
        _response, payloads, error = await sse(client, chat_url(mock))
    assert error is None
    assert payloads[-1] == "[DONE]"
    bad = []
    for payload in payloads[:-1]:
        try:
            json.loads(payload)
        except json.JSONDecodeError:
            bad.append(payload)
    assert len(bad) == 1
    assert bad[0].endswith('"delta":{"content":" tok1"')
    good = [p for p in payloads[:-1] if p not in bad]
    assert text_of(good) == "tok0 tok2 tok3"


async def test_no_done_ends_cleanly_with_finish_and_usage_but_no_done(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend(faulty("no_done", "no_done", output_tokens=3)) as mock:
        _response, payloads, error = await sse(client, chat_url(mock))
        plain = await client.post(chat_url(mock), json=CHAT)  # not a stream: a normal answer
        stats = mock.stats()
    assert error is None
    assert "[DONE]" not in payloads
    chunks = [json.loads(p) for p in payloads]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert text_of(payloads) == "tok0 tok1 tok2"
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    assert stats.faults == {"no_done": 1}


async def test_no_finish_ends_with_a_bare_done_as_llama_cpp_cuts_a_stream(
    client: httpx.AsyncClient,
) -> None:
    """As llama-cpp-python's server ends a running stream when a second call takes
    its one slot: ``after_tokens`` tokens, then ``data: [DONE]``; no chunk carries a
    ``finish_reason``, no usage chunk, and the body ends cleanly."""
    settings = faulty("no_finish", "no_finish", output_tokens=6, after_tokens=2)
    async with MockBackend(settings) as mock:
        _response, payloads, error = await sse(client, chat_url(mock))
        plain = await client.post(chat_url(mock), json=CHAT)  # not a stream: a normal answer
        stats = mock.stats()
    assert error is None
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * len(chunks)
    assert not any("usage" in c for c in chunks)
    assert text_of(payloads) == "tok0 tok1"
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    assert stats.faults == {"no_finish": 1}


@pytest.mark.parametrize("style", ["openai", "openrouter"])
async def test_sse_error_sends_an_error_event_mid_stream_then_ends(
    client: httpx.AsyncClient, style: str
) -> None:
    settings = faulty("sse_error", output_tokens=6, after_tokens=2, limit_style=style)
    async with MockBackend(settings) as mock:
        _response, payloads, error = await sse(client, chat_url(mock))
    assert error is None  # ended cleanly
    assert "[DONE]" not in payloads
    last = json.loads(payloads[-1])
    assert text_of(payloads[:-1]) == "tok0 tok1"
    if style == "openai":
        assert last == SERVER_ERROR
    else:
        assert last["error"] == {
            "code": "server_error",
            "message": "Provider disconnected unexpectedly",
        }
        assert last["choices"][0]["finish_reason"] == "error"
        assert last["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_filtered_answer_ends_with_finish_reason_content_filter(
    client: httpx.AsyncClient, stream: bool
) -> None:
    async with MockBackend(faulty("filtered", output_tokens=8, after_tokens=2)) as mock:
        if stream:
            _response, payloads, error = await sse(client, chat_url(mock))
            assert error is None
            assert payloads[-1] == "[DONE]"
            chunks = [json.loads(p) for p in payloads[:-1]]
            assert chunks[-2]["choices"][0]["finish_reason"] == "content_filter"
            assert chunks[-1]["usage"]["completion_tokens"] == 2
            assert text_of(payloads) == "tok0 tok1"
        else:
            answer = (await client.post(chat_url(mock), json=CHAT)).json()
            assert answer["choices"][0]["finish_reason"] == "content_filter"
            assert answer["choices"][0]["message"]["content"] == "tok0 tok1"


async def test_drip_sends_tokens_a_long_gap_apart(client: httpx.AsyncClient) -> None:
    gap = 0.2
    async with MockBackend(faulty("drip", output_tokens=3, drip_gap=gap)) as mock:
        loop = asyncio.get_running_loop()
        arrivals: list[float] = []
        async with client.stream("POST", chat_url(mock), json=STREAM) as response:
            headers_at = loop.time()
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    arrivals.append(loop.time())
        stats = mock.stats()
    assert response.status_code == 200
    assert len(arrivals) == 3
    gaps = [b - a for a, b in zip([headers_at, *arrivals], arrivals, strict=False)]
    # Generous: a stall timeout shorter than the gap must fire; never much too fast.
    assert all(g > gap * 0.6 for g in gaps), gaps
    assert stats.faults == {"drip": 1}


async def test_drip_json_answer_trickles_out_and_is_whole(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("drip", output_tokens=2, drip_gap=0.1)) as mock:
        loop = asyncio.get_running_loop()
        started = loop.time()
        response = await client.post(chat_url(mock), json=CHAT)
        elapsed = loop.time() - started
    assert response.json()["choices"][0]["message"]["content"] == "tok0 tok1"
    assert elapsed > 0.15


async def test_a_client_leaving_a_drip_is_a_disconnect(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("drip", output_tokens=50, drip_gap=0.05)) as mock:
        async with client.stream("POST", chat_url(mock), json=STREAM) as response:
            async for line in response.aiter_lines():
                if "tok1" in line:
                    break
        await until(lambda: mock.stats().disconnects == 1, "the mock saw the client go")
        assert mock.stats().in_flight == 0


# ------------------------------------------------------------ scheduling


async def test_script_applies_in_arrival_order_then_normal_answers(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend(faulty("500", "ok", "503")) as mock:
        statuses = [(await client.post(chat_url(mock), json=CHAT)).status_code for _ in range(5)]
        stats = mock.stats()
    assert statuses == [500, 200, 503, 200, 200]
    assert stats.faults == {"500": 1, "503": 1}
    assert stats.completed == 3


async def test_script_can_repeat(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("529", "ok", repeat=True)) as mock:
        statuses = [(await client.post(chat_url(mock), json=CHAT)).status_code for _ in range(5)]
    assert statuses == [529, 200, 529, 200, 529]


async def test_a_bad_request_body_takes_no_step_of_the_script(client: httpx.AsyncClient) -> None:
    async with MockBackend(faulty("500")) as mock:
        bad = await client.post(chat_url(mock), content=b"{not json")
        faulted = await client.post(chat_url(mock), json=CHAT)
    assert (bad.status_code, faulted.status_code) == (400, 500)


async def test_random_mix_is_reproducible_with_a_seed_and_near_its_rates(
    client: httpx.AsyncClient,
) -> None:
    settings = MockSettings(seed=11, faults=FaultSpec(random={"500": 0.3, "reset": 0.1}))

    async def outcomes() -> list[str]:
        seen = []
        async with MockBackend(settings) as mock:
            for _ in range(300):
                try:
                    seen.append(str((await client.post(chat_url(mock), json=CHAT)).status_code))
                except httpx.ReadError:
                    seen.append("reset")
            assert mock.stats().faults == {
                "500": seen.count("500"),
                "reset": seen.count("reset"),
            }
        return seen

    first, second = await outcomes(), await outcomes()
    assert first == second
    assert 60 <= first.count("500") <= 120  # 90 expected
    assert 15 <= first.count("reset") <= 50  # 30 expected


async def test_faults_are_set_at_runtime_and_restart_their_script(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend() as mock:
        admin = f"{base_url(mock)}/admin/settings"
        before = await client.post(chat_url(mock), json=CHAT)
        changed = await client.post(admin, json={"faults": {"script": ["503", "ok"]}})
        first = [(await client.post(chat_url(mock), json=CHAT)).status_code for _ in range(3)]
        await client.post(admin, json={"faults": {"script": ["503", "ok"]}})  # again: restarts
        second = (await client.post(chat_url(mock), json=CHAT)).status_code
        await client.post(admin, json={"faults": {}})
        cleared = (await client.post(chat_url(mock), json=CHAT)).status_code
        stats = (await client.get(f"{base_url(mock)}/stats")).json()
    assert before.status_code == 200
    assert changed.json()["faults"]["script"] == ["503", "ok"]
    assert first == [503, 200, 200]
    assert second == 503
    assert cleared == 200
    assert stats["faults"] == {"503": 2}


# ------------------------------------------------------------ down, context window


async def test_down_resets_every_connection_until_brought_back_up(
    client: httpx.AsyncClient,
) -> None:
    async with MockBackend() as mock:
        admin = f"{base_url(mock)}/admin/settings"
        assert (await client.post(admin, json={"down": True})).json()["down"] is True
        with pytest.raises(httpx.ReadError):
            await client.post(chat_url(mock), json=CHAT)
        with pytest.raises(httpx.ReadError):
            await client.get(f"{base_url(mock)}/health")
        stats = (await client.get(f"{base_url(mock)}/stats")).json()  # still answers
        await client.post(admin, json={"down": False})
        up = await client.post(chat_url(mock), json=CHAT)
    assert stats["faults"] == {"down": 2}
    assert up.status_code == 200


async def test_context_window_refuses_longer_prompts_with_context_length_400(
    client: httpx.AsyncClient,
) -> None:
    long_chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 100}]}  # 25 tokens
    async with MockBackend(MockSettings(context_window=20)) as mock:
        short = await client.post(chat_url(mock), json=CHAT)
        long = await client.post(chat_url(mock), json={**long_chat, "stream": True})
        await client.post(f"{base_url(mock)}/admin/settings", json={"context_window": 0})
        unlimited = await client.post(chat_url(mock), json=long_chat)
        stats = mock.stats()
    assert short.status_code == 200
    assert long.status_code == 400
    assert long.json()["error"] == {
        "message": "This model's maximum context length is 20 tokens. However, your messages "
        "resulted in 25 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert unlimited.status_code == 200
    assert stats.faults == {"context_length": 1}


async def test_no_faults_configured_means_no_faults(client: httpx.AsyncClient) -> None:
    async with MockBackend() as mock:
        for body in (CHAT, STREAM):
            assert (await client.post(chat_url(mock), json=body)).status_code == 200
        stats = mock.stats()
    assert stats.faults == {}
    assert stats.completed == 2


# ------------------------------------------------------------ bad specs


@pytest.mark.parametrize(
    "change",
    [
        {"faults": {"script": ["500", "nope"]}},
        {"faults": {"random": {"500": 1.5}}},
        {"faults": {"random": {"500": 0.6, "reset": 0.6}}},
        {"faults": {"random": {"teapot": 0.1}}},
        {"faults": {"scrpit": ["500"]}},
        {"faults": {"drip_gap": 0}},
        {"faults": ["500"]},
        {"context_window": -1},
        {"down": "yes"},
    ],
)
async def test_bad_fault_specs_are_a_400_and_change_nothing(
    client: httpx.AsyncClient, change: dict[str, Any]
) -> None:
    async with MockBackend(faulty("503")) as mock:
        refused = await client.post(f"{base_url(mock)}/admin/settings", json=change)
        still = await client.post(chat_url(mock), json=CHAT)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("invalid settings:")
    assert still.status_code == 503  # the old script, untouched


def test_fault_spec_names_the_rule_it_breaks() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"add up to 1\.2, more than 1"):
        msgspec.convert({"random": {"500": 0.6, "reset": 0.6}}, FaultSpec)


# ------------------------------------------------------------ the command line


async def run_mock(*flags: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "renqueue", "mock-backend", "--port", "0", "--ttft", "0", "--tps", "0"),
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--fault-script", "500,nope"), "unknown fault kind 'nope'"),
        (("--fault", "503"), "KIND=PROBABILITY"),
        (("--fault", "503=lots"), "is not a number"),
        (("--fault", "503=0.7", "--fault", "reset=0.7"), "more than 1"),
        (("--context-window", "-3"), "context_window"),
    ],
)
async def test_bad_fault_flags_are_a_cli_error(flags: tuple[str, ...], message: str) -> None:
    proc = await run_mock(*flags)
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert message in err.decode()
    assert "Traceback" not in err.decode()


async def test_fault_flags_set_the_faults_at_startup(client: httpx.AsyncClient) -> None:
    """And the faults that cut connections log nothing: no traceback, no error."""
    proc = await run_mock(
        *("--fault-script", "500,reset,break,hang", "--fault", "503=0.25", "--fault", "reset=0.1"),
        *("--context-window", "4096", "--drip-gap", "1.5", "--seed", "3"),
    )
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = line.split()[-1]
        first = await client.post(f"{url}/chat/completions", json=CHAT)
        with pytest.raises(httpx.ReadError):
            await client.post(f"{url}/chat/completions", json=CHAT)
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(f"{url}/chat/completions", json=STREAM)
        hung = asyncio.create_task(client.post(f"{url}/chat/completions", json=CHAT))
        settings = (await client.get(url.removesuffix("/v1") + "/admin/settings")).json()
        stats: dict[str, Any] = {}

        async def hanging() -> bool:
            stats.update((await client.get(url.removesuffix("/v1") + "/stats")).json())
            return "hang" in stats["faults"]

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await hanging():
            assert loop.time() < deadline, "the request never hung"
            await asyncio.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = await asyncio.wait_for(proc.communicate(), 30)
    with pytest.raises(httpx.RemoteProtocolError):  # dropped unanswered at shutdown
        await hung
    log = err.decode()
    assert "Traceback" not in log
    assert [json.loads(entry)["level"] for entry in log.splitlines()] == ["info"]
    assert first.status_code == 500
    assert stats["faults"] == {"500": 1, "reset": 1, "break": 1, "hang": 1}
    assert settings["faults"]["script"] == ["500", "reset", "break", "hang"]
    assert settings["faults"]["random"] == {"503": 0.25, "reset": 0.1}
    assert settings["faults"]["drip_gap"] == 1.5
    assert settings["context_window"] == 4096
