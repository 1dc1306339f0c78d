"""A real model server as a backend (issue #32): llama-cpp-python's OpenAI-compatible
server on SmolLM2-135M-Instruct, through every path that matters.

The server runs from its own venv (``.renqueue/real-venv``, made by ``make test-real`` or
``make real-venv``; never a dependency of Ren-Queue). Without that venv every test here
is skipped, and ``make test`` says so in its summary (tests/conftest.py).

The server runs as a user gets it (``python -m llama_cpp.server --model ...``, its
defaults: one generation at a time, ``interrupt_requests`` on); a module's worth of
tests share one server, and the test that kills it starts its own, as does the
preemption test (with ``interrupt_requests`` off). The answers are
the model's own: the tests make them long where they need a call still running
(``min_tokens``, llama-cpp-python's own parameter, holds its end of turn back) and
greedy where they compare texts (``temperature`` 0).

What these tests found the server to do, and what differs from its docs and from
OpenAI's, is in docs/backends.md ("Tried with a real server").
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from test_quota_exhausted import describe

from renqueue import (
    Client,
    GenerationParams,
    RequestCancelledError,
    RequestExpiredError,
    RequestFailedError,
    Services,
    parse_config,
)
from renqueue.backends import make_backend
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config
from renqueue.llamacpp import MODEL_NAME, LlamaServer, RealModel, cached_model
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import MIN_SAMPLES
from renqueue.schema import (
    REQUEST_DECODER,
    Cancelled,
    Expired,
    FellBack,
    InferenceRequest,
    Preempted,
    Retrying,
    Started,
)

ROOT = Path(__file__).resolve().parent.parent
#: The venv ``make real-venv`` makes (``RENQUEUE_REAL_VENV``: another one).
VENV = Path(os.environ.get("RENQUEUE_REAL_VENV") or ROOT / ".renqueue" / "real-venv")
MODEL = cached_model(VENV)
TENANT = "t"

SHOWN = VENV.relative_to(ROOT) if VENV.is_relative_to(ROOT) else VENV

pytestmark = pytest.mark.skipif(
    MODEL is None,
    reason=f"no cached real-model venv at {SHOWN}"
    " (`make test-real` makes it: pip builds llama-cpp-python, 16 minutes or more, once)",
)

#: A prompt the model answers at length when its end of turn is held back.
LONG_PROMPT = "Tell me a long story about a lighthouse keeper."
#: Tokens of an answer still running when a test acts on it, however fast the machine
#: (about 10 s at 150 tokens/s; measured here under load: 5-15 tokens/s). No test waits
#: for one to end: each cancels it, lets it expire, preempts it or kills the server.
LONG = 1500


def long_params(tokens: int = LONG) -> GenerationParams:
    """An answer of exactly ``tokens`` tokens: its end of turn held back until then."""
    return GenerationParams(max_tokens=tokens, extra={"min_tokens": tokens})


@pytest.fixture(scope="module")
def model() -> RealModel:
    assert MODEL is not None
    return MODEL


@pytest.fixture(scope="module")
async def llama(
    model: RealModel, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LlamaServer]:
    """The server as its defaults make it, shared by the module's tests."""
    log = tmp_path_factory.mktemp("llama") / "server.log"
    async with LlamaServer(model, log=log) as server:
        yield server


def config_of(nats_url: str, backends: dict[str, tuple[str, str, int]], **extra: Any) -> Config:
    """Route ``chat`` over ``backends`` (name -> (base_url, model, slots)) in order."""
    return parse_config(
        {
            "nats": {"url": nats_url},
            "backends": {
                name: {"base_url": url, "model": model, "limits": {"concurrency": slots}}
                for name, (url, model, slots) in backends.items()
            },
            "routes": {"chat": {"backends": list(backends)}},
            "router": {"capacity_refresh": "20ms"},
            "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
            **extra,
        }
    )


def local(llama: LlamaServer, slots: int = 1) -> dict[str, tuple[str, str, int]]:
    return {"local": (llama.base_url, MODEL_NAME, slots)}


async def direct_stream(
    http: httpx.AsyncClient, llama: LlamaServer, body: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], list[float]]:
    """A streamed call straight to the server: its text, every chunk, and when each came."""
    chunks: list[dict[str, Any]] = []
    times: list[float] = []
    text = ""
    payload = {"model": MODEL_NAME, "stream": True, **body}
    async with http.stream("POST", f"{llama.base_url}/chat/completions", json=payload) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                chunks.append({"done": True})
                break
            chunk = msgspec.json.decode(data)
            chunks.append(chunk)
            delta = chunk["choices"][0]["delta"].get("content") or ""
            if delta:
                times.append(time.perf_counter())
                text += delta
    return text, chunks, times


def finish_reasons(chunks: list[dict[str, Any]]) -> list[str]:
    """The finish reasons a stream's chunks gave (an answer that ended gives one)."""
    return [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c.get("choices") and c["choices"][0]["finish_reason"]
    ]


async def until_logged(llama: LlamaServer, text: str, count: int, within: float = 20.0) -> None:
    """Until the server's log holds ``text`` ``count`` times."""
    give_up = time.monotonic() + within
    while llama.log_text().count(text) < count:
        assert time.monotonic() < give_up, f"the server never logged {text!r} x{count}"
        await asyncio.sleep(0.05)


async def until_started(
    client: Client, request_id: str, *, runs: int = 1, within: float = 60.0
) -> None:
    """Until the request's ``runs``-th run has started (the log has its ``started``)."""
    log = EventLog(client.js)
    async with asyncio.timeout(within):
        while True:
            events = await log.history(TENANT, request_id)
            if sum(isinstance(e, Started) for e in events) >= runs:
                return
            await asyncio.sleep(0.05)


DISCONNECTED = "Disconnected from client"


# ------------------------------------------------------------------ answers


async def test_streamed_and_whole_answers_are_the_servers_text_with_its_token_counts(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    """A greedy answer is the same text streamed to a subscriber, waited for whole, and
    asked of the server directly; the adapter's whole (non-streamed) call carries the
    server's usage. The server sends no usage in a stream, so Ren-Queue's count of a
    streamed answer is its chunks: the server's own count of the same answer."""
    prompt = "What is the capital of France? Answer in one sentence."
    params = GenerationParams(max_tokens=40, temperature=0.0, seed=1)
    config = config_of(isolated_server.url, local(llama))
    adapter = make_backend("local", config.backends["local"])
    request: InferenceRequest = REQUEST_DECODER.decode(
        msgspec.json.encode(
            {
                "id": "direct",
                "tenant": TENANT,
                "route": "chat",
                "messages": [{"role": "user", "content": prompt}],
                "params": msgspec.to_builtins(params),
            }
        )
    )
    try:
        whole = await adapter.complete(request)
    finally:
        await adapter.close()
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        streamed = await client.submit(prompt, route="chat", params=params)
        chunks = [chunk async for chunk in streamed.stream(timeout=60)]
        streamed_result = await streamed.result(timeout=60)
        waited = await client.submit(prompt, route="chat", params=params)
        waited_result = await waited.result(timeout=60)
    assert whole.text.strip(), "the model said something"
    assert "Paris" in whole.text
    assert "".join(c.text for c in chunks) == streamed_result.text == whole.text
    assert waited_result.text == whole.text
    assert streamed_result.backend == waited_result.backend == "local"
    assert whole.finish_reason == streamed_result.finish_reason == "stop"
    # The server's count, and Ren-Queue's count of the streamed answer (its chunks).
    assert whole.usage.completion_tokens > 1
    assert streamed_result.usage.completion_tokens == whole.usage.completion_tokens
    assert waited_result.usage.completion_tokens == whole.usage.completion_tokens
    # The prompt is estimated (characters / 4): the server counts its chat template too.
    assert whole.usage.prompt_tokens > streamed_result.usage.prompt_tokens > 0


async def test_the_servers_models_health_and_error_answers(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    """``/v1/models`` lists the model under its alias; there is no ``/health``; a body
    the server cannot read is a 500, not a 400. A prompt past the context is OpenAI's 400
    ``context_length_exceeded`` when the answer is asked for whole, but streamed (as
    workers ask) a 200 whose stream ends at once, empty, without ``[DONE]``: Ren-Queue
    can only take that for a malformed answer, retry it and fail it."""
    too_long = "word " * 2500  # past --n_ctx 2048
    async with httpx.AsyncClient(timeout=60.0) as http:
        models = (await http.get(f"{llama.base_url}/models")).json()
        health = await http.get(f"{llama.origin}/health")
        unreadable = await http.post(f"{llama.base_url}/chat/completions", json={"messages": "x"})
        past_context = await http.post(
            f"{llama.base_url}/chat/completions",
            json={"messages": [{"role": "user", "content": too_long}], "max_tokens": 4},
        )
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert health.status_code == 404
    assert unreadable.status_code == 500
    assert past_context.status_code == 400
    assert past_context.json()["error"]["code"] == "context_length_exceeded"

    config = config_of(isolated_server.url, local(llama))
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit(too_long, route="chat", max_tokens=4)
        with pytest.raises(RequestFailedError) as failed:
            await handle.result(timeout=60)
        events = await EventLog(client.js).history(TENANT, handle.id)
    assert "stream ended before [DONE]" in str(failed.value)
    assert {e.error_class for e in events if isinstance(e, FellBack)} == {"malformed"}


# ------------------------------------------------------------- one slot


async def test_past_its_one_slot_the_server_cuts_the_running_stream_and_renqueue_never_asks(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    """The server generates one answer at a time. A second call while a stream runs
    gets no error: the running stream ends at once with a bare ``[DONE]``, no
    ``finish_reason``, short of its tokens (``interrupt_requests``, its default), and
    the second is served. A ``GET /v1/models`` (a health probe) cuts it the same way;
    ``GET /openapi.json`` does not. Ren-Queue with the backend's concurrency at 1
    never sends a second call: three at once all end whole."""
    messages = [{"role": "user", "content": LONG_PROMPT}]
    long_body = {"messages": messages, "max_tokens": LONG, "min_tokens": LONG}
    async with httpx.AsyncClient(timeout=120.0) as http:

        async def cut_by(interloper: Any) -> list[dict[str, Any]]:
            """A long stream's chunks when ``interloper()`` is called after its first token."""
            first_token = asyncio.Event()

            async def running() -> list[dict[str, Any]]:
                chunks: list[dict[str, Any]] = []
                payload = {"model": MODEL_NAME, "stream": True, **long_body}
                url = f"{llama.base_url}/chat/completions"
                async with http.stream("POST", url, json=payload) as answer:
                    async for line in answer.aiter_lines():
                        if line == "data: [DONE]":
                            chunks.append({"done": True})
                        elif line.startswith("data: "):
                            chunks.append(msgspec.json.decode(line.removeprefix("data: ")))
                            first_token.set()
                return chunks

            task = asyncio.create_task(running())
            await first_token.wait()
            await interloper()
            return await task

        second: list[dict[str, Any]] = []

        async def another_call() -> None:
            second.extend(
                (await direct_stream(http, llama, {"messages": messages, "max_tokens": 4}))[1]
            )

        async def models_probe() -> None:
            assert (await http.get(f"{llama.base_url}/models")).status_code == 200

        async def openapi_probe() -> None:
            assert (await http.get(f"{llama.origin}/openapi.json")).status_code == 200

        by_call = await cut_by(another_call)
        by_models = await cut_by(models_probe)
        # Not cut: this one runs to the end, so a short one.
        long_body.update(max_tokens=24, min_tokens=24)
        by_openapi = await cut_by(openapi_probe)
    for cut in (by_call, by_models):
        assert cut[-1] == {"done": True}
        assert finish_reasons(cut) == [], "cut short: no finish_reason at all"
        assert (
            sum(bool(c.get("choices") and c["choices"][0]["delta"].get("content")) for c in cut)
            < LONG
        )
    assert finish_reasons(second) == ["length"]
    assert finish_reasons(by_openapi) == ["length"]

    config = config_of(isolated_server.url, local(llama, slots=1))
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        cuts_before = llama.log_text().count(DISCONNECTED)
        handles = [
            await client.submit(LONG_PROMPT, route="chat", params=long_params(12)) for _ in range(3)
        ]
        outcomes = [await h.result(timeout=90) for h in handles]
        log = EventLog(client.js)
        histories = [await log.history(TENANT, h.id) for h in handles]
    assert [r.finish_reason for r in outcomes] == ["length"] * 3
    assert [r.usage.completion_tokens for r in outcomes] == [12] * 3
    # Each served by one call, none cut: a second call sent past the slot would have cut
    # the running one (the server logs that) and shown as a retry or a fallback.
    assert llama.log_text().count(DISCONNECTED) == cuts_before
    for events in histories:
        assert sum(isinstance(e, Started) for e in events) == 1, describe(events)
        assert not [e for e in events if isinstance(e, Retrying | FellBack)], describe(events)


async def test_past_its_slot_through_renqueue_a_cut_stream_falls_back_and_is_never_an_answer(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    """The backend declared with two slots, one more than the server has: Ren-Queue sends
    two calls at once and the server cuts one of them short (a bare ``[DONE]``, no
    ``finish_reason``). Ren-Queue takes the cut stream for what it is, a broken one (or a
    malformed one, cut before its first token), never for an answer: the request falls
    back to the next tier. What ``concurrency = 1`` (the test above) keeps from happening."""
    tokens = 48
    async with MockBackend(MockSettings(ttft=0.01, output_tokens=5)) as paid:
        config = config_of(
            isolated_server.url, {**local(llama, slots=2), "paid": (paid.url, "m", 4)}
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            cuts_before = llama.log_text().count(DISCONNECTED)
            handles = [
                await client.submit(LONG_PROMPT, route="chat", params=long_params(tokens))
                for _ in range(2)
            ]
            outcomes = [await h.result(timeout=90) for h in handles]
            log = EventLog(client.js)
            histories = [await log.history(TENANT, h.id) for h in handles]
    fell = [e for events in histories for e in events if isinstance(e, FellBack)]
    assert fell, [describe(events) for events in histories]
    assert {e.backend for e in fell} == {"local"}
    assert {e.error_class for e in fell} <= {"broken_stream", "malformed"}
    assert llama.log_text().count(DISCONNECTED) > cuts_before
    assert paid.stats().completed >= 1
    for result in outcomes:
        # An answer of the real model is whole; anything cut went on to the paid tier.
        if result.backend == "local":
            assert (result.finish_reason, result.usage.completion_tokens) == ("length", tokens)
        else:
            assert result.backend == "paid"


# ------------------------------------------------- cancellation and deadlines


async def test_a_request_cancelled_mid_stream_stops_the_servers_generation(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    """The worker closes the call; the server notices after its next token, says so in
    its log, and its one slot is free: the next request is served."""
    config = config_of(isolated_server.url, local(llama))
    before = llama.log_text().count(DISCONNECTED)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit(LONG_PROMPT, route="chat", params=long_params())
        stream = handle.stream(timeout=60)
        got = [await anext(stream) for _ in range(3)]  # it is generating
        await handle.cancel("changed my mind")
        with pytest.raises(RequestCancelledError):
            await handle.result(timeout=30)
        rest = [chunk async for chunk in stream]
        await until_logged(llama, DISCONNECTED, before + 1)
        after = await client.submit("Say hi.", route="chat", max_tokens=8)
        served = await after.result(timeout=60)
        events = await EventLog(client.js).history(TENANT, handle.id)
    [cancelled] = [e for e in events if isinstance(e, Cancelled)]
    assert cancelled.stage == "running"
    assert len(got) + len(rest) < LONG
    assert served.backend == "local"
    assert served.text


async def test_a_deadline_that_expires_mid_call_ends_the_request_and_the_generation(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    config = config_of(isolated_server.url, local(llama))
    before = llama.log_text().count(DISCONNECTED)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        handle = await client.submit(LONG_PROMPT, route="chat", params=long_params(), timeout=8.0)
        with pytest.raises(RequestExpiredError):
            await handle.result(timeout=60)
        await until_logged(llama, DISCONNECTED, before + 1)
        events = await EventLog(client.js).history(TENANT, handle.id)
    [expired] = [e for e in events if isinstance(e, Expired)]
    assert expired.stage == "running"
    assert any(isinstance(e, Started) for e in events)


# ---------------------------------------------------------------- preemption


async def test_a_critical_request_preempts_a_batch_call_on_the_real_server(
    isolated_server: EmbeddedServer, model: RealModel, tmp_path: Path
) -> None:
    """The batch call holds the server's one slot; a critical request takes it (the
    batch call is closed, the server stops it), then the batch request runs again
    (and is cancelled there: its whole answer would take minutes).

    On a server that does not cut a running call for a new one (``interrupt_requests``
    off): the critical call gets the model only because Ren-Queue closed the batch
    call. With the default server a preemption that never closed it would pass
    unnoticed, the critical call itself cutting the batch stream short."""
    async with LlamaServer(model, log=tmp_path / "llama.log", interrupt_requests=False) as llama:
        await _preempt(isolated_server, llama)


async def _preempt(isolated_server: EmbeddedServer, llama: LlamaServer) -> None:
    config = config_of(isolated_server.url, local(llama))
    before = llama.log_text().count(DISCONNECTED)
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        batch = await client.submit(
            LONG_PROMPT, route="chat", priority="batch", params=long_params()
        )
        await until_started(client, batch.id)
        urgent = await client.submit("Say yes.", route="chat", priority="critical", max_tokens=8)
        urgent_result = await urgent.result(timeout=60)
        await until_started(client, batch.id, runs=2)
        chunks = batch.stream(timeout=60)
        seen = [await anext(chunks)]
        while not any(chunk.restart for chunk in seen):
            seen.append(await anext(chunks))
        await batch.cancel("seen enough")
        with pytest.raises(RequestCancelledError):
            await batch.result(timeout=30)
        # The server stopped the batch call for the urgent one, and its second at the end.
        await until_logged(llama, DISCONNECTED, before + 2)
        log = EventLog(client.js)
        batch_events = await log.history(TENANT, batch.id)
        urgent_events = await log.history(TENANT, urgent.id)
    [preempted] = [e for e in batch_events if isinstance(e, Preempted)]
    assert preempted.by == urgent.id
    assert urgent_result.backend == "local"
    assert urgent_result.text
    assert sum(isinstance(e, Started) for e in urgent_events) == 1


# ------------------------------------------------------------ a crashed server


async def test_a_server_killed_mid_stream_falls_back_to_the_next_tier_with_a_restart(
    isolated_server: EmbeddedServer, model: RealModel, tmp_path: Path
) -> None:
    """SIGKILL the server while it streams: the request goes on down its route to the
    next tier (a mock paid API here); subscribers see the local tokens, then a chunk
    marked ``restart``, then the paid answer, which is the result."""
    async with (
        LlamaServer(model, log=tmp_path / "llama.log") as doomed,
        MockBackend(MockSettings(ttft=0.01, output_tokens=5)) as paid,
    ):
        config = config_of(isolated_server.url, {**local(doomed), "paid": (paid.url, "m", 4)})
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit(LONG_PROMPT, route="chat", params=long_params())
            stream = handle.stream(timeout=60)
            chunks = [await anext(stream) for _ in range(3)]
            await doomed.kill()
            chunks += [chunk async for chunk in stream]
            result = await handle.result(timeout=60)
            events = await EventLog(client.js).history(TENANT, handle.id)
    restarts = [n for n, chunk in enumerate(chunks) if chunk.restart]
    assert len(restarts) == 1, chunks
    assert "".join(c.text for c in chunks[: restarts[0]]), "the real model's tokens came first"
    assert "".join(c.text for c in chunks[restarts[0] :]) == result.text
    assert result.backend == "paid"
    assert [e.backend for e in events if isinstance(e, FellBack)] == ["local"], describe(events)
    assert paid.stats().completed == 1


# --------------------------------------------------------- the learned speed


async def test_the_learned_speed_model_converges_to_the_servers_real_rate(
    isolated_server: EmbeddedServer, llama: LlamaServer
) -> None:
    """After a few calls, the speed the router plans with (learned from the log) is the
    rate the server streams at, measured by calling it directly before and after: within
    a factor of 2 either way (a shared machine's load moves the rate between calls, and
    ``make test`` runs other servers beside this one; the model is what is checked: an
    unlearned one has no rate at all)."""
    tokens = 24
    body = {
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "max_tokens": tokens,
        "min_tokens": tokens,
    }
    rates: list[float] = []

    async def measure_directly() -> None:
        async with httpx.AsyncClient(timeout=60.0) as http:
            for _ in range(2):
                _text, _chunks, times = await direct_stream(http, llama, body)
                rates.append((len(times) - 1) / (times[-1] - times[0]))

    await measure_directly()
    config = config_of(isolated_server.url, local(llama))
    async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
        for _ in range(MIN_SAMPLES + 2):
            handle = await client.submit(LONG_PROMPT, route="chat", params=long_params(tokens))
            await handle.result(timeout=60)
        router = services.routers[0]
        async with asyncio.timeout(30):
            while True:
                projection = router.projection
                perf = None if projection is None else projection.backend("local").perf
                if perf is not None and perf.samples >= MIN_SAMPLES + 2:
                    break
                await asyncio.sleep(0.05)
    await measure_directly()
    direct_rate = statistics.median(rates)
    assert perf.output == pytest.approx(tokens)
    assert 0 < perf.ttft < 10
    assert direct_rate / 2 < perf.rate < direct_rate * 2, (perf.rate, rates)


# ------------------------------------------------------------------ the demo


@pytest.mark.timeout(400)
async def test_the_real_demo_answers_with_the_real_model_and_shows_its_speed() -> None:
    """``renqueue demo --real`` (``make demo-real``): the cached venv, the server as the
    local tier beside the mock free and paid tiers, real answers, and the real backend's
    TTFT and tokens/s as Ren-Queue measured them."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "demo", "--real", "--requests", "6", "--venv", str(VENV),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 380)
    text = out.decode()
    assert proc.returncode == 0, text
    assert f"venv {VENV} (cached; its build took" in text
    lines = text.splitlines()
    header = next(n for n, line in enumerate(lines) if line.split()[:2] == ["backend", "requests"])
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 4]}
    assert set(rows) == {"local", "free-api", "paid-api"}
    requests, ttft_ms, rate = (
        int(rows["local"][1]),
        float(rows["local"][4]),
        float(rows["local"][5]),
    )
    assert requests >= 3, text  # the local-only half at least
    assert ttft_ms > 0
    assert rate > 0
    assert "learned from the log (what the router plans with): local " in text
    # The model's own words, as the summary shows them: "[stop] Paris is ...".
    first_answer = lines[lines.index("  Some of the real model's answers:") + 1].split()
    assert first_answer[0] in {"[stop]", "[length]"}, text
    assert len(first_answer) > 1, text
    assert "OK: 6/6 requests reached a terminal state" in text


# ------------------------------------------------------------------ the bench


@pytest.mark.timeout(400)
async def test_the_real_bench_measures_renqueue_against_the_server_directly(
    tmp_path: Path,
) -> None:
    """``make bench-real`` (``bench/pipeline.py --real``), at its smallest: one call each way
    at one caller, every one the 32 tokens asked for, and the difference reported (its
    numbers are bench/README.md's business, not this test's)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "pipeline.py"), "--real", "--levels", "1",
        "--real-requests", "1", "--real-rounds", "1", "--real-venv", str(VENV),
        "--out", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 380)
    text = out.decode()
    assert proc.returncode == 0, text
    report = msgspec.json.decode((tmp_path / "pipeline-real-latest.json").read_bytes())
    [row] = report["levels"].values()
    for path in ("direct", "renqueue"):
        assert (row[path]["requests"], row[path]["errors"]) == (1, 0), text
        assert row[path]["latency"]["p50_ms"] > 0
    assert set(row["added_ms"]) >= {"latency_p50_ms", "first_token_p50_ms"}
    assert " 1 added     latency p50 " in text
