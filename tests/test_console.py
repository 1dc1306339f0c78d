"""The gateway's web console over HTTP: its admin key, its snapshot, a request's
timeline and the live event stream, against real Services, a real nats-server and
a mock backend over loopback. (tests/test_console_browser.py drives the page in
a real browser.)
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, get_args

import httpx
import msgspec
import pytest
from _waits import until
from test_dlq import poison
from test_gateway_sdk import ACME, MESSAGES, Stack, mock, start  # noqa: F401 - fixture

from renqueue import parse_config
from renqueue.broker import EventLog, provision
from renqueue.cli import main
from renqueue.coordination import read_status
from renqueue.errors import ConfigError
from renqueue.gateway import digest
from renqueue.gateway._console import COOKIE, SESSION_AGE, Sessions
from renqueue.gateway._console_feed import (
    SHOWN,
    TEXT_SHOWN,
    EventFeed,
    event_id,
    parse_event_id,
)
from renqueue.mock import MockBackend
from renqueue.schema import (
    EVENTS_STREAM,
    ChatMessage,
    Completed,
    Event,
    Expired,
    GenerationParams,
    InferenceRequest,
    Submitted,
    TokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
    Usage,
    encode,
    event_subject,
    kind_of,
)
from renqueue.tasks import Supervisor

ADMIN = "rq-test-admin-key-0123456789abcdef0123"


@pytest.fixture
async def stack(tmp_path: Path, mock: MockBackend) -> AsyncIterator[Stack]:  # noqa: F811
    async for value in start(tmp_path, mock, gateway={"admin_keys": [digest(ADMIN)]}):
        yield value


def console(stack: Stack, key: str | None = ADMIN) -> httpx.AsyncClient:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    base = f"http://{stack.gateway.host}:{stack.gateway.port}"
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=30)


async def complete(stack: Stack, count: int) -> list[str]:
    sdk = stack.sdk()
    answers = await asyncio.gather(
        *(sdk.chat.completions.create(model="chat", messages=MESSAGES) for _ in range(count))
    )
    return [answer.id for answer in answers]


async def test_the_console_needs_an_admin_key_and_a_tenant_key_is_not_one(stack: Stack) -> None:
    async with (
        console(stack, None) as anyone,
        console(stack, ACME) as tenant,
        console(stack, "rq-not-a-key") as stranger,
        console(stack) as admin,
    ):
        for path in ("/console/api/status", "/console/api/events", "/console/api/requests/x"):
            nobody = await anyone.get(path)
            assert nobody.status_code == 401, path
            assert nobody.json()["error"]["code"] == "invalid_api_key"
            assert (await stranger.get(path)).status_code == 401, path
            refused = await tenant.get(path)
            assert refused.status_code == 403, path
            assert refused.json()["error"]["code"] == "admin_key_required"
        assert (await admin.get("/console/api/status")).status_code == 200
        # The page itself holds no data: it loads for anyone, then asks for the key.
        page = await anyone.get("/console")
        assert page.status_code == 200
        assert "text/html" in page.headers["content-type"]
        assert "default-src 'none'" in page.headers["content-security-policy"]
        for name in ("console.js", "console.css"):
            assert (await anyone.get(f"/console/static/{name}")).status_code == 200
        assert (await anyone.get("/console/static/../_console.py")).status_code == 404
        # Logging in keeps the key in an HttpOnly cookie the page's requests carry.
        wrong = await anyone.post("/console/login", json={"key": ACME})
        assert wrong.status_code == 403
        assert "set-cookie" not in wrong.headers
        logged = await anyone.post("/console/login", data={"key": ADMIN})
        assert logged.status_code == 204
        cookie = logged.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "Path=/console" in cookie
        assert (await anyone.get("/console/api/status")).status_code == 200
        await anyone.post("/console/logout")
        anyone.cookies.clear()
        assert (await anyone.get("/console/api/status")).status_code == 401


async def test_without_admin_keys_there_is_no_console(tmp_path: Path, mock: MockBackend) -> None:  # noqa: F811
    async for stack in start(tmp_path, mock):
        async with console(stack) as client:
            for path in ("/console", "/console/api/status"):
                answer = await client.get(path)
                assert answer.status_code == 404
                assert answer.json()["error"]["code"] == "console_disabled"


async def test_the_snapshot_says_what_the_log_says(stack: Stack) -> None:
    await complete(stack, 3)
    assert stack.services.js is not None
    js = stack.services.js
    snap: dict[str, Any] = {}
    async with console(stack) as client:

        async def counted() -> bool:
            snap.update((await client.get("/console/api/status")).json())
            return bool(snap["status"]["backends"][0]["calls_completed"] == 3)

        await until(counted, "the console counts the 3 calls")
    report = await read_status(js, stack.services.config)
    (b1,) = snap["status"]["backends"]
    assert b1["name"] == "b1"
    assert b1["calls_completed"] == report.backends[0].calls_completed == 3
    assert b1["concurrency"] == 8
    (acme,) = snap["status"]["tenants"]
    assert (acme["name"], acme["submitted"], acme["terminal"]) == ("acme", 3, {"completed": 3})
    assert [level["name"] for level in snap["status"]["levels"]] == stack.services.config.priorities
    assert snap["aging"]["normal"] == 60.0
    assert snap["aging"]["critical"] is None
    assert snap["dlq"]["count"] == 0
    assert snap["splits"] == []


async def test_the_snapshot_is_built_once_for_every_console(stack: Stack) -> None:
    async with console(stack) as client:
        built = stack.gateway.console.snapshots_built
        answers = await asyncio.gather(*(client.get("/console/api/status") for _ in range(10)))
    assert {answer.status_code for answer in answers} == {200}
    assert stack.gateway.console.snapshots_built == built + 1


async def test_the_snapshot_lists_dead_letters(stack: Stack) -> None:
    assert stack.services.js is not None
    await poison(stack.services.js, "acme", "poison-1")
    async with console(stack) as client:
        snap: dict[str, Any] = {}

        async def listed() -> bool:
            snap.update((await client.get("/console/api/status")).json())
            return bool(snap["dlq"]["count"])

        await until(listed, "the poison request is dead-lettered and listed")
    (entry,) = snap["dlq"]["entries"]
    assert (entry["tenant"], entry["request_id"], entry["stage"]) == (
        "acme",
        "poison-1",
        "requests",
    )
    assert entry["error_type"] == "malformed"


async def test_a_timeline_is_the_requests_history(stack: Stack) -> None:
    (request_id,) = await complete(stack, 1)
    assert stack.services.js is not None
    async with console(stack) as client:

        async def ended() -> bool:
            events = await EventLog(stack.services.js).history("acme", request_id)
            return any(kind_of(e) == "completed" for e in events)

        await until(ended, "the request's completion is logged")
        history = await EventLog(stack.services.js).history("acme", request_id)
        timeline = (await client.get(f"/console/api/requests/{request_id}")).json()
        scoped = await client.get(f"/console/api/requests/{request_id}", params={"tenant": "acme"})
        other = await client.get(f"/console/api/requests/{request_id}", params={"tenant": "globex"})
        missing = await client.get("/console/api/requests/no-such-request")
        bad = await client.get("/console/api/requests/a.b")
        bad_tenant = await client.get(f"/console/api/requests/{request_id}?tenant=a*")
    assert timeline["tenant"] == "acme"
    assert [e["kind"] for e in timeline["events"]] == [kind_of(e) for e in history]
    assert [e["at"] for e in timeline["events"]] == [e.at for e in history]
    routed = next(e for e in timeline["events"] if e["kind"] == "routed")
    assert routed["backend"] == "b1"
    assert routed["reason"]
    submitted = timeline["events"][0]
    assert submitted["request"] == {
        "route": "chat",
        "priority": "normal",
        "messages": 1,
        "deadline": None,
        "max_cost": None,
    }
    assert scoped.json() == timeline
    assert other.status_code == 404
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "request_not_found"
    assert bad.status_code in (400, 404)
    assert bad_tenant.status_code == 400


async def test_an_id_or_tenant_with_a_trailing_newline_is_refused_as_such(stack: Stack) -> None:
    """``^...$`` matches before a final newline: ``abc\n`` passed the id check and reached
    a lookup of a subject NATS refuses. An id is its characters and nothing after."""
    async with console(stack) as client:
        bad_id = await client.get("/console/api/requests/abc%0A")
        bad_tenant = await client.get("/console/api/requests/abc", params={"tenant": "acme\n"})
    assert bad_id.status_code == 400, bad_id.text
    assert bad_id.json()["error"]["code"] == "invalid_id"
    assert bad_tenant.status_code == 400, bad_tenant.text
    assert bad_tenant.json()["error"]["code"] == "invalid_tenant"


async def read_events(
    response: httpx.Response | AsyncIterator[str], wanted: Any, within: float = 20.0
) -> list[dict[str, Any]]:
    """Data of the stream's events until ``wanted(events)`` holds (from a response,
    or from its lines, to read on where an earlier call stopped); an event's SSE
    id, when it has one, as ``_id``."""
    events: list[dict[str, Any]] = []
    lines = response.aiter_lines() if isinstance(response, httpx.Response) else response

    async def read() -> None:
        event_type = "message"
        event_id: str | None = None
        async for line in lines:
            if line.startswith("event: "):
                event_type = line[7:]
            elif line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                said = {} if event_id is None else {"_id": event_id}
                events.append({"type": event_type, **data, **said})
                event_type, event_id = "message", None
                if wanted(events):
                    return

    await asyncio.wait_for(read(), within)
    return events


async def test_the_event_stream_delivers_new_events_and_resumes(stack: Stack) -> None:
    async with console(stack) as client:
        async with client.stream("GET", "/console/api/events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            # Subscribed first: what is submitted now comes through the stream.
            (request_id,) = await complete(stack, 1)
            events = await read_events(
                response,
                lambda got: any(
                    e.get("request_id") == request_id and e.get("kind") == "completed" for e in got
                ),
            )
        mine = [e for e in events if e.get("request_id") == request_id]
        kinds = [e["kind"] for e in mine]
        assert kinds[0] == "submitted"
        assert "routed" in kinds
        assert kinds[-1] == "completed"
        completed = mine[-1]
        assert completed["tenant"] == "acme"
        assert completed["backend"] == "b1"
        # Neither the prompt nor the answer goes to the browser: the answer's length does.
        assert "hello" not in json.dumps(mine)
        assert "tok0" not in json.dumps(mine)
        assert "text=" in completed["line"]
        assert "characters" in completed["line"]
        seqs = [e["seq"] for e in events if "seq" in e]
        assert seqs == sorted(seqs)
        # One stored event per sequence, but a request bound at once: its one
        # stored `submitted` carries its `routed`, shown as the two lines.
        shared = [
            [e["kind"] for e in events if e.get("seq") == seq]
            for seq in sorted(set(seqs))
            if seqs.count(seq) > 1
        ]
        assert all(kinds == ["submitted", "routed"] for kinds in shared), shared
        assert kinds[:2] == ["submitted", "routed"]
        assert mine[0]["seq"] == mine[1]["seq"]
        # Each line has an id of its own: the second of a pair, `<seq>.1`.
        assert mine[0]["_id"] == str(mine[0]["seq"])
        assert mine[1]["_id"] == f"{mine[1]['seq']}.1"
        # A console that reconnects names the last line it got: it gets what came after.
        resume_after = mine[1]["seq"]
        async with client.stream(
            "GET", "/console/api/events", headers={"Last-Event-ID": mine[1]["_id"]}
        ) as response:
            again = await read_events(response, lambda got: any(e["seq"] >= seqs[-1] for e in got))
        assert again[0]["seq"] == resume_after + 1
        assert [e["seq"] for e in again] == [s for s in seqs if s > resume_after][: len(again)]


async def test_a_console_that_reconnects_after_any_line_gets_every_later_one_once(
    stack: Stack,
) -> None:
    """Review i33: a request bound at once is one stored event shown as two lines
    (its `submitted`, then its `routed`), which both had the event's sequence as
    their SSE id: a console that reconnected between them named that sequence and
    never got the `routed`. Every line has an id of its own, in order, so a
    reconnect after any line, between the two of a pair too, resumes with the
    line after it: nothing lost, nothing twice."""
    async with console(stack) as client:
        async with client.stream("GET", "/console/api/events") as response:
            (request_id,) = await complete(stack, 1)
            lines = await read_events(
                response,
                lambda got: any(
                    e.get("request_id") == request_id and e.get("kind") == "completed" for e in got
                ),
            )
        lines = [e for e in lines if e["type"] == "message"]
        ids = [e["_id"] for e in lines]
        mine = [e for e in lines if e.get("request_id") == request_id]
        assert [e["kind"] for e in mine[:2]] == ["submitted", "routed"]
        assert mine[0]["seq"] == mine[1]["seq"]  # the pair: one stored event
        pair = lines.index(mine[0])
        # Between the two lines of the pair first, then after every other line.
        for at in [pair, *range(len(lines) - 1)]:
            async with client.stream(
                "GET", "/console/api/events", headers={"Last-Event-ID": ids[at]}
            ) as response:
                again = await read_events(response, lambda got: got[-1].get("_id") == ids[-1])
            assert [e["_id"] for e in again] == ids[at + 1 :], ids[at]
    assert len(set(ids)) == len(ids), ids  # one id per line


async def test_every_console_shares_one_tail_of_the_log(stack: Stack) -> None:
    assert stack.services.js is not None
    js = stack.services.js
    feed = stack.gateway.console.feed
    before = (await js.stream_info(EVENTS_STREAM)).state.consumer_count
    async with console(stack) as client:
        streams = [client.stream("GET", "/console/api/events") for _ in range(3)]
        responses = [await s.__aenter__() for s in streams]
        try:

            async def tailing() -> bool:
                return feed.subscribers == 3 and feed.consumer is not None

            await until(tailing, "three consoles subscribed, the tail reading")
            during = (await js.stream_info(EVENTS_STREAM)).state.consumer_count
            (request_id,) = await complete(stack, 1)
            for response in responses:
                await read_events(
                    response,
                    lambda got: any(
                        e.get("request_id") == request_id and e.get("kind") == "completed"
                        for e in got
                    ),
                )
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)

        async def stopped() -> bool:
            return feed.subscribers == 0 and not feed.running and feed.consumer is None

        await until(stopped, "the tail stops with the last console")
    assert during == before + 1
    assert feed.consumers_made == 1
    assert feed.consumer is None


def test_keygen_admin_prints_a_key_and_its_config_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "keygen", "--admin"]) == 0
    out = capsys.readouterr().out
    key = re.search(r"^\s+(rq-\S+)$", out, re.MULTILINE)
    sha = re.search(r'admin_keys = \["([0-9a-f]{64})"\]', out)
    assert key is not None
    assert sha is not None
    assert digest(key.group(1)) == sha.group(1)
    config = parse_config({"gateway": {"admin_keys": [sha.group(1)]}})
    assert config.gateway.admin_keys == [sha.group(1)]
    # A tenant and --admin, or neither: a clear refusal.
    assert main(["gateway", "keygen", "--admin", "acme"]) == 2
    assert main(["gateway", "keygen"]) == 2
    with pytest.raises(ConfigError, match=r"admin_keys"):
        parse_config({"gateway": {"admin_keys": ["not-a-digest"]}})


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_reads_the_console_api_as_the_docs_show(stack: Stack) -> None:
    """docs/gateway.md's commands: the snapshot and a timeline with the admin key."""
    (request_id,) = await complete(stack, 1)
    base = f"http://{stack.gateway.host}:{stack.gateway.port}"

    async def curl(path: str) -> Any:
        process = await asyncio.create_subprocess_exec(
            "curl", "-sf", f"{base}{path}", "-H", f"Authorization: Bearer {ADMIN}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await process.communicate()
        assert process.returncode == 0, path
        return json.loads(out)

    # The event stream: curl prints events as they come (-N); the first is enough.
    streaming = await asyncio.create_subprocess_exec(
        "curl", "-sN", f"{base}/console/api/events", "-H", f"Authorization: Bearer {ADMIN}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert streaming.stdout is not None
        line = b""
        while not line.startswith(b"data: "):
            line = await asyncio.wait_for(streaming.stdout.readline(), 20)
            assert line, "curl's event stream ended"
        assert json.loads(line[6:])["request_id"] == request_id
    finally:
        streaming.kill()
        await streaming.wait()
    snapshot = await curl("/console/api/status")
    assert {"status", "aging", "splits", "dlq", "feed"} <= set(snapshot)
    timeline = await curl(f"/console/api/requests/{request_id}")
    assert timeline["events"][0]["kind"] == "submitted"


def expired(request_id: str) -> tuple[str, bytes]:
    event = Expired(request_id=request_id, tenant="acme", at=1.0, stage="queued", reason="late")
    return event_subject("acme", request_id, "expired"), msgspec.json.encode(event)


def test_a_lines_sse_id_names_its_position_and_reads_back() -> None:
    """Pure: ``<seq>`` for an event's first line, ``<seq>.<part>`` for the next."""
    for position, text in (((7, 0), "7"), ((7, 1), "7.1"), ((10**18, 1), f"{10**18}.1")):
        assert event_id(position) == text
        assert parse_event_id(text) == position
        assert parse_event_id(f" {text} ") == position
    assert parse_event_id(None) is None
    for junk in ("", "7.", ".1", "7.1.1", "7.1234", "7.-1", "²", "1" * 20, "7,1"):
        assert parse_event_id(junk) is None, junk


def test_a_feed_that_no_longer_keeps_what_a_console_missed_says_so() -> None:
    """Pure: the ring of the latest events, and the gap a reconnecting console is told of."""
    feed = EventFeed(lambda: pytest.fail("no NATS here"), Supervisor("test"), backlog=3)
    for seq in range(1, 6):
        feed._take(seq, *expired(f"r{seq}"))
    # A payload that disagrees with its subject is no fact: not shown.
    subject, _ = expired("r6")
    feed._take(6, subject, expired("r7")[1])
    assert [at for at, _ in feed.recent()] == [(3, 0), (4, 0), (5, 0)]
    assert feed.since((1, 0)) is None  # 2 is gone: the console is told of a gap
    assert [at for at, _ in feed.since((2, 0)) or []] == [(3, 0), (4, 0), (5, 0)]
    assert [at for at, _ in feed.since((3, 0)) or []] == [(4, 0), (5, 0)]
    assert feed.since((6, 0)) == []
    line = msgspec.json.decode(feed.recent()[0][1])
    assert line == {
        "seq": 3,
        "at": 1.0,
        "kind": "expired",
        "tenant": "acme",
        "request_id": "r3",
        "backend": None,
        "line": "stage=queued reason=late",
    }


async def test_a_gateway_that_stops_ends_the_consoles_streams_at_once(stack: Stack) -> None:
    feed = stack.gateway.console.feed
    loop = asyncio.get_running_loop()
    async with console(stack) as client, client.stream("GET", "/console/api/events") as response:

        async def tailing() -> bool:
            return feed.subscribers == 1 and feed.consumer is not None

        await until(tailing, "the console subscribed")
        began = loop.time()
        await stack.gateway.close()
        took = loop.time() - began
        # The stream ends (not cut off after the gateway's 5 s grace for answers).
        async for _ in response.aiter_lines():
            pass
    assert took < 2.0, took
    assert feed.subscribers == 0
    assert feed.consumer is None


SECRET_PROMPT = "the-secret-prompt-7f3a"
SECRET_TOKEN = "tok-secret-9c1e"
SECRET_ARGUMENT = "arg-secret-44d2"


def leaky_events(request_id: str) -> list[Event]:
    """A request whose prompt, tool-call arguments and token log probabilities are
    secrets: none of them may reach a console."""
    request = InferenceRequest(
        id=request_id,
        tenant="acme",
        route="chat",
        messages=[ChatMessage(role="user", content=SECRET_PROMPT)],
        params=GenerationParams(tools=(Tool(name="lookup", description=SECRET_PROMPT),)),
        metadata={"note": SECRET_PROMPT},
    )
    token = TokenLogprob(
        token=SECRET_TOKEN, logprob=-0.5, top_logprobs=(TopLogprob(token=SECRET_TOKEN, logprob=-1),)
    )
    call = ToolCall(id="call-1", name="lookup", arguments=json.dumps({"q": SECRET_ARGUMENT}))
    return [
        Submitted(request_id=request_id, tenant="acme", at=1.0, request=request),
        Completed(
            request_id=request_id,
            tenant="acme",
            at=2.0,
            backend="b1",
            attempt=1,
            delivery=1,
            text=SECRET_TOKEN * 40,
            usage=Usage(prompt_tokens=5, completion_tokens=3),
            cost=0.0,
            tool_calls=(call, call),
            logprobs=(token, token, token),
        ),
    ]


def test_every_kind_of_event_has_an_allow_list_of_what_a_console_shows() -> None:
    kinds = {member.__struct_config__.tag for member in get_args(Event)}
    assert set(SHOWN) == kinds
    for member in get_args(Event):
        fields = set(member.__struct_fields__)
        assert set(SHOWN[member.__struct_config__.tag]) <= fields, member


async def test_the_console_never_shows_a_prompt_tool_arguments_or_tokens(stack: Stack) -> None:
    assert stack.services.js is not None
    js = stack.services.js
    request_id = "leaky-1"
    async with console(stack) as client, client.stream("GET", "/console/api/events") as response:
        for event in leaky_events(request_id):
            await js.publish(event_subject("acme", request_id, kind_of(event)), encode(event))
        live = await read_events(
            response,
            lambda got: any(
                e.get("request_id") == request_id and e.get("kind") == "completed" for e in got
            ),
        )
        timeline = await client.get(f"/console/api/requests/{request_id}")
    mine = [e for e in live if e.get("request_id") == request_id]
    assert [e["kind"] for e in mine] == ["submitted", "completed"]
    completed = mine[-1]["line"]
    assert "tool_calls=2" in completed
    assert "logprobs=3" in completed
    assert f"text={40 * len(SECRET_TOKEN)} characters" in completed
    assert timeline.status_code == 200
    events = timeline.json()["events"]
    assert events[0]["request"] == {
        "route": "chat",
        "priority": "normal",
        "messages": 1,
        "deadline": None,
        "max_cost": None,
    }
    assert events[1]["tool_calls"] == 2
    assert events[1]["logprobs"] == 3
    assert len(events[1]["text"]) == 200
    for shown_text in (json.dumps(mine), timeline.text):
        for secret in (SECRET_PROMPT, SECRET_ARGUMENT, "lookup"):
            assert secret not in shown_text
    # The answer's text: its length live, its first 200 characters in a timeline only.
    assert SECRET_TOKEN not in json.dumps(mine)
    assert timeline.text.count(SECRET_TOKEN) == (TEXT_SHOWN - 3) // len(SECRET_TOKEN)


async def test_a_last_event_id_not_of_the_feeds_form_is_ignored(stack: Stack) -> None:
    (request_id,) = await complete(stack, 1)
    async with console(stack) as client:
        for junk in ("²", "١٢", "12x", "-1", "9" * 20, "1.", ".1", "1.2.3", "1.x", "1.²"):
            async with client.stream(
                "GET", "/console/api/events", headers={"Last-Event-ID": junk.encode()}
            ) as response:
                assert response.status_code == 200, junk
                # Ignored: the stream starts on the recent past, as with no id.
                events = await read_events(
                    response, lambda got: any(e.get("request_id") == request_id for e in got)
                )
            assert events[0]["seq"] == 1, junk


async def test_a_login_is_a_session_token_never_the_key(stack: Stack) -> None:
    now = [1000.0]
    stack.gateway.console.sessions = Sessions(clock=lambda: now[0])
    async with console(stack, None) as page, console(stack, None) as copy:
        logged = await page.post("/console/login", json={"key": ADMIN})
        assert logged.status_code == 204
        token = page.cookies[COOKIE]
        assert ADMIN not in logged.headers["set-cookie"]
        assert digest(ADMIN) not in logged.headers["set-cookie"]
        assert len(token) >= 32
        # On loopback over plain HTTP the cookie is not Secure (else no browser keeps it).
        assert "secure" not in logged.headers["set-cookie"].lower()
        assert (await page.get("/console/api/status")).status_code == 200
        # Logging out ends the session in the gateway: a copy of the cookie stops working.
        copy.cookies.set(COOKIE, token)
        assert (await copy.get("/console/api/status")).status_code == 200
        assert (await page.post("/console/logout")).status_code == 204
        ended = await copy.get("/console/api/status")
        assert ended.status_code == 401
        assert ended.json()["error"]["code"] == "invalid_api_key"
        # A session lasts SESSION_AGE; then it is refused (the clock is the test's).
        assert (await page.post("/console/login", data={"key": ADMIN})).status_code == 204
        assert (await page.get("/console/api/status")).status_code == 200
        now[0] += SESSION_AGE - 1
        assert (await page.get("/console/api/status")).status_code == 200
        now[0] += 1
        assert (await page.get("/console/api/status")).status_code == 401
        assert len(stack.gateway.console.sessions) == 0


async def test_a_login_from_another_site_is_refused_and_a_remote_cookie_is_secure(
    stack: Stack,
) -> None:
    base = f"http://{stack.gateway.host}:{stack.gateway.port}"
    async with console(stack, None) as page:
        for origin in ("https://evil.example", "null", f"http://evil.example:{stack.gateway.port}"):
            refused = await page.post(
                "/console/login", json={"key": ADMIN}, headers={"Origin": origin}
            )
            assert refused.status_code == 403, origin
            assert refused.json()["error"]["code"] == "cross_origin"
            assert "set-cookie" not in refused.headers
        own = await page.post("/console/login", json={"key": ADMIN}, headers={"Origin": base})
        assert own.status_code == 204
        # Another site cannot log the page out either: the session goes on.
        out = await page.post("/console/logout", headers={"Origin": "https://evil.example"})
        assert out.status_code == 403
        assert (await page.get("/console/api/status")).status_code == 200
        # Reached by another name than loopback, the gateway is behind TLS: Secure.
        remote = await page.post(
            "/console/login",
            json={"key": ADMIN},
            headers={"Host": "console.example.com", "Origin": "https://console.example.com"},
        )
        assert remote.status_code == 204
        assert "secure" in remote.headers["set-cookie"].lower()


async def test_a_failing_feed_tells_the_consoles_and_never_stops_the_gateway(
    stack: Stack,
) -> None:
    """RQ_EVENTS deleted under an open console: the feed says so and retries on
    its own; the tenants' API goes on; once the log is provisioned again the
    console's stream goes on, from the new log's start."""
    assert stack.services.js is not None
    js = stack.services.js
    gateway = stack.gateway
    feed = gateway.console.feed
    async with (
        console(stack) as client,
        stack.http() as tenant,
        client.stream("GET", "/console/api/events") as response,
    ):

        async def tailing() -> bool:
            return feed.consumer is not None

        await until(tailing, "the console's feed tails the log")
        lines = response.aiter_lines()
        (request_id,) = await complete(stack, 1)
        before = await read_events(
            lines,
            lambda got: any(
                e.get("request_id") == request_id and e.get("kind") == "completed" for e in got
            ),
        )
        await js.context.delete_stream(EVENTS_STREAM)
        # Told at once it is down, then why (the stream is missing) as it retries.
        told = await read_events(
            lines,
            lambda got: got[-1]["type"] == "error" and "RQ_EVENTS" in got[-1]["reason"],
            within=30,
        )
        assert "is Ren-Queue provisioned?" in told[-1]["reason"]

        # The feed failed, and went on failing on its own: the gateway did not count it.
        async def retried() -> bool:
            return feed.failures >= 2

        await until(retried, "the feed fails again, and retries again")
        assert gateway.supervisor.failures("renqueue-gateway-console-feed") == 0
        assert not gateway.supervisor.failed.is_set()
        assert (await tenant.get("/models")).status_code == 200
        # Provisioned again: the feed is back, and reads the new log from its start.
        await provision(js, stack.services.config)
        back = await read_events(lines, lambda got: got[-1]["type"] == "gap", within=30)
        assert back[-1]["reason"]
        subject, payload = expired("after-reprovision")
        await js.publish(subject, payload)
        after = await read_events(
            lines, lambda got: any(e.get("request_id") == "after-reprovision" for e in got)
        )
    # The new log's sequences start over: its first event is read all the same.
    (event,) = [e for e in after if e.get("request_id") == "after-reprovision"]
    assert event["seq"] < max(e["seq"] for e in before if "seq" in e)
    assert feed.down is None
    assert not gateway.supervisor.failed.is_set()
