"""The dead-letter stream as a tool (issue #9 item 8): ``renqueue dlq list | show |
requeue | purge`` against real dead letters, written by real services on a real
nats-server: a poison request and a request for an unknown route (rejected by
the router), a request a mock backend refuses with a 400 (failed by the
worker), a dispatch that ran out of deliveries (the advisory reader). The CLI
runs as a user runs it, in a process of its own.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _waits import until

from renqueue import Client, RequestFailedError, RequestRejectedError, Services, load_config
from renqueue.broker import EventLog
from renqueue.broker._dlq import (
    DeadLetter,
    DeadLetterError,
    DeadLetterFilter,
    DeadLetters,
    requeue_id,
    requeue_subject,
)
from renqueue.config import Config
from renqueue.errors import NatsTimeoutError
from renqueue.mock import MockBackend, MockSettings
from renqueue.schema import (
    DISPATCH_STREAM,
    DLQ_STREAM,
    Dispatch,
    InferenceRequest,
    Submitted,
    dispatch_subject,
    encode,
    kind_of,
    request_subject,
    worker_consumer,
)

#: The key the config's backend reads from the environment: the CLI never prints it.
SECRET = "sk-test-5ecret-do-not-print"


@pytest.fixture(autouse=True)
def backend_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services read the backend's key from the environment, as in production."""
    monkeypatch.setenv("RQ_TEST_KEY", SECRET)


def write_config(
    path: Path, *, nats_url: str, backend_url: str, worker: str = "", nats: str = ""
) -> Config:
    path.write_text(
        f'[nats]\nurl = "{nats_url}"\n{nats}'
        f'[router]\ncapacity_refresh = "20ms"\n'
        f'[worker]\nretry_delay = "50ms"\ndrain_timeout = "100ms"\n{worker}'
        f'[backends.b]\nbase_url = "{backend_url}"\nmodel = "mock"\napi_key_env = "RQ_TEST_KEY"\n'
        f"[backends.b.limits]\nconcurrency = 4\n"
        f'[routes.chat]\nbackends = ["b"]\n'
    )
    return load_config(path, environ={"RQ_TEST_KEY": SECRET})


async def rq(config: Path, *args: str, stdin: str = "") -> tuple[int, str, str]:
    """``renqueue -c config ARGS`` in a process of its own, as in a 120-column
    terminal (pytest-xdist's workers say 80): (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "-c", str(config), *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": "", "RQ_TEST_KEY": SECRET, "COLUMNS": "120"},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 60)
    assert proc.returncode is not None
    text, errors = out.decode(), err.decode()
    assert "Traceback" not in errors, errors
    assert SECRET not in text + errors
    assert all(line.isprintable() for line in text.splitlines()), text
    return proc.returncode, text, errors


def lines_json(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def iso(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, tz=datetime.UTC).isoformat()


async def entries(js: Any, **where: Any) -> list[DeadLetter]:
    return (await DeadLetters(js).find(DeadLetterFilter(**where))).entries


async def kinds(js: Any, tenant: str, request_id: str) -> list[str]:
    return [kind_of(e) for e in await EventLog(js).history(tenant, request_id)]


async def poison(js: Any, tenant: str, request_id: str, payload: bytes = b"{not json") -> None:
    """What a broken client publishes: not a request at all."""
    await js.publish(
        request_subject("normal", tenant),
        payload,
        headers={"Nats-Msg-Id": f"{tenant}:{request_id}"},
    )


@asynccontextmanager
async def stack(
    tmp_path: Path, server: Any, settings: MockSettings, **options: Any
) -> AsyncIterator[tuple[Services, MockBackend, Path]]:
    """Services (routers, a worker for ``b``, the advisory reader) over a mock backend."""
    async with MockBackend(settings) as mock:
        path = tmp_path / "rq.toml"
        config = write_config(path, nats_url=server.url, backend_url=mock.url, **options)
        async with Services(config) as services:
            yield services, mock, path


async def test_list_filters_by_tenant_reason_stage_and_time_and_show_gives_reason_and_history(
    tmp_path: Path, isolated_server: Any
) -> None:
    bad_request = MockSettings(failure_rate=1.0, failure_status=400, output_tokens=4)
    async with (
        stack(tmp_path, isolated_server, bad_request) as (services, mock, config),
        Client(services.nc, tenant="t1") as t1,
        Client(services.nc, tenant="t2") as t2,
    ):
        js = services.js
        await poison(js, "t1", "poison-1")
        with pytest.raises(RequestRejectedError):
            await t1.handle("poison-1").result(timeout=15)
        unknown = await t2.submit("to nowhere", route="no-such-route")
        with pytest.raises(RequestRejectedError):
            await unknown.result(timeout=15)
        refused = await t1.submit("refused", route="chat", timeout=30)
        with pytest.raises(RequestFailedError) as info:
            await refused.result(timeout=15)
        failure = info.value.error_type  # the worker's word for a 400
        assert "bad_request" in failure
        found = await entries(js)
        assert [(e.stage, e.tenant, e.request_id, e.error_type) for e in found] == [
            ("requests", "t1", "poison-1", "malformed"),
            ("requests", "t2", unknown.id, "unknown_route"),
            ("dispatch", "t1", refused.id, failure),
        ]
        first, second, third = found

        async def listed(*args: str) -> list[int]:
            code, out, err = await rq(config, "dlq", "list", "--json", *args)
            assert code == 0, err
            return [entry["seq"] for entry in lines_json(out)]

        assert await listed() == [first.seq, second.seq, third.seq]
        assert await listed("--tenant", "t1") == [first.seq, third.seq]
        assert await listed("--reason", "malformed") == [first.seq]
        assert await listed("--reason", f"{failure.upper()}:") == [third.seq]
        assert await listed("--stage", "dispatch") == [third.seq]
        assert await listed("--tenant", "t2", "--stage", "dispatch") == []
        assert await listed("--since", "1h") == [first.seq, second.seq, third.seq]
        assert await listed("--until", "1h") == []
        middle = (first.time + second.time) / 2
        assert await listed("--since", iso(middle)) == [second.seq, third.seq]
        assert await listed("--until", iso(middle)) == [first.seq]
        assert await listed("--limit", "2") == [second.seq, third.seq]

        code, out, err = await rq(config, "dlq", "list")
        assert code == 0, err
        assert out.splitlines()[0].split() == [
            *("seq", "stored", "stage", "tenant", "request", "reason")
        ]
        assert "3 of 3 dead letters match" in out

        # show: the reason, and the request's whole history from the log.
        code, out, err = await rq(config, "dlq", "show", str(third.seq))
        assert code == 0, err
        reason = out.split("\n  reason ")[1].split("\n  from ")[0]
        assert " ".join(reason.split()) == " ".join(third.reason.split())
        assert third.reason.startswith(f"{failure}: ")
        assert re.search(r"\n  requeued +no ", out), out
        history = out[out.index("history (4 events):") :].splitlines()[1:]
        # One row per event (its details may wrap onto lines that start blank).
        events = [line.split()[1] for line in history if not line.startswith("   ")]
        assert events == ["submitted", "routed", "started", "failed"]
        # The history for a person (issue 28 item 11): rounded numbers, no
        # Python reprs, no lines wider than the table.
        assert not re.search(r"\d\.\d{4,}", "\n".join(history)), history
        assert not [line for line in history if "{'" in line or "('" in line], history
        assert max(map(len, history)) <= 120, history
        code, out, err = await rq(config, "dlq", "show", "--json", str(third.seq))
        assert code == 0, err
        [shown] = lines_json(out)
        assert shown["reason"] == third.reason
        assert shown["payload"]["request"]["id"] == refused.id
        assert [e["kind"] for e in shown["history"]] == ["submitted", "routed", "started", "failed"]

        # A poison message: its reason, its bytes, and what the log knows (its rejection).
        code, out, err = await rq(config, "dlq", "show", str(first.seq))
        assert code == 0, err
        assert re.search(r"\n  reason +malformed: ", out), out
        assert "a poison message" in out
        assert "{not json" in out
        assert [
            line.split()[1]
            for line in out.split("history (1 events):")[1].splitlines()[1:]
            if not line.startswith("   ")
        ] == ["rejected"]

        # An entry that is not there: one line, exit 1, the others still shown.
        code, out, err = await rq(config, "dlq", "show", "999", str(second.seq))
        assert code == 1
        assert "no dead letter 999" in err
        assert f"dead letter {second.seq} on rq.dlq.requests" in out
        assert mock.stats().requests == 1


async def test_requeue_runs_a_new_request_once_with_a_fresh_budget_whatever_the_window(
    tmp_path: Path, isolated_server: Any
) -> None:
    bad_request = MockSettings(failure_rate=1.0, failure_status=400, output_tokens=4)
    async with (
        stack(tmp_path, isolated_server, bad_request, nats='duplicate_window = "1s"\n') as (
            services,
            mock,
            config,
        ),
        Client(services.nc, tenant="t1") as client,
    ):
        js = services.js
        await poison(js, "t1", "poison-2")
        with pytest.raises(RequestRejectedError):
            await client.handle("poison-2").result(timeout=15)
        handle = await client.submit(
            "try again later", route="chat", timeout=30, metadata={"team": "a"}
        )
        with pytest.raises(RequestFailedError):
            await handle.result(timeout=15)
        bad, good = await entries(js)
        assert (bad.request_id, good.request_id) == ("poison-2", handle.id)
        new_id = requeue_id(handle.id, good.seq)
        assert new_id == f"{handle.id}-dlq{good.seq}"
        mock.update(failure_rate=0.0)  # the backend is healthy again

        # The poison entry is refused; the other is requeued all the same.
        code, out, err = await rq(config, "dlq", "requeue", str(bad.seq), str(good.seq))
        assert code == 1
        assert f"dead letter {bad.seq}: the payload is not a request (a poison message)" in err
        assert f"dead letter {good.seq}: requeued as {new_id}" in out
        result = await client.handle(new_id).result(timeout=15)
        assert result.backend == "b"
        assert mock.stats().requests == 2  # the 400, then the requeue

        [submitted] = [
            e for e in await EventLog(js).history("t1", new_id) if isinstance(e, Submitted)
        ]
        again = submitted.request
        assert again.metadata == {"team": "a", "requeued_from": handle.id, "dlq_seq": str(good.seq)}
        assert again.requeues == 0
        assert again.deadline is not None
        # The original's budget (30 s from its submit), counted from the requeue.
        assert 28 < again.deadline - submitted.at < 31

        # Again: nothing new, whether the window holds the first publish or not.
        code, out, err = await rq(config, "dlq", "requeue", str(good.seq))
        assert code == 0, err
        assert f"already requeued as {new_id}" in out
        await window_passed(js)
        await js.delete_msg(
            DLQ_STREAM, (await js.get_last_msg(DLQ_STREAM, requeue_subject(good.seq))).seq
        )
        code, out, err = await rq(config, "dlq", "requeue", "--id", handle.id, "--json")
        assert code == 0, err
        [done] = lines_json(out)
        assert (done["ok"], done["already"], done["new_id"]) == (True, True, new_id)
        assert await kinds(js, "t1", new_id) == ["submitted", "routed", "started", "completed"]
        assert mock.stats().requests == 2

        # list and show say it was requeued, and as which id (the marker is back).
        code, out, err = await rq(config, "dlq", "list", "--tenant", "t1")
        assert code == 0, err
        # Under the entry's reason (the row's last column), whole.
        assert f"requeued as {new_id}" in out, out
        code, out, err = await rq(config, "dlq", "show", str(good.seq))
        assert re.search(rf"\n  requeued +as {new_id} ", out), out

        # A dead-letter copy of a request that completed (written by a run that
        # lost the race to end it) is never run again.
        await EventLog(js).dead_letter(
            "dispatch", encode(Dispatch(request=again, backend="b")), reason="timeout: late copy",
            source_subject=dispatch_subject("b"), tenant="t1", request_id=new_id,
        )  # fmt: skip
        [late] = await entries(js, request_id=new_id)
        code, out, err = await rq(config, "dlq", "requeue", str(late.seq))
        assert code == 1, (out, err)
        assert f"request {new_id} completed" in err
        assert mock.stats().requests == 2


async def window_passed(js: Any) -> None:
    """Wait until the duplicate window of everything published so far has passed:
    a probe published now is stored again once its own window is over."""
    subject = dispatch_subject("probe-nobody-serves")
    probe = f"probe-{os.urandom(4).hex()}"
    await js.publish(subject, b"probe", headers={"Nats-Msg-Id": probe})

    async def stored_again() -> bool:
        ack = await js.publish(subject, b"probe", headers={"Nats-Msg-Id": probe})
        return not ack.duplicate

    await until(stored_again, "the duplicate window has passed", within=10)


async def test_an_undeliverable_dispatch_requeued_twice_at_once_runs_once(
    tmp_path: Path, isolated_server: Any
) -> None:
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        path = tmp_path / "rq.toml"
        config = write_config(
            path,
            nats_url=isolated_server.url,
            backend_url=mock.url,
            worker="max_deliver = 1\ndelivery_limit = 2\n",
        )
        async with (
            Services(config, backends=[]) as routers,
            Client(routers.nc, tenant="t1") as client,
        ):
            js = routers.js
            handle = await client.submit("doomed", route="chat", timeout=20)
            # No worker: play one that takes the dispatch and never finishes it.
            psub = await js.pull_subscribe_bind(
                durable=worker_consumer("b"), stream=DISPATCH_STREAM
            )
            try:
                for _ in range(2):
                    [msg] = await psub.fetch(batch=1, timeout=10)
                    await msg.nak()
                with pytest.raises(NatsTimeoutError):
                    await psub.fetch(batch=1, timeout=1)
            finally:
                await psub.unsubscribe()
            with pytest.raises(RequestFailedError) as info:
                await handle.result(timeout=15)
            assert info.value.error_type == "undeliverable"
            [entry] = await entries(js, reason="undeliverable")
            assert (entry.stage, entry.request_id) == ("dispatch", handle.id)

            # A worker comes; two operators requeue the entry at the same moment.
            async with Services(
                config, routers=0, backends=["b"], provision_streams=False, name="late-worker"
            ):
                dead = DeadLetters(js)
                one, two = await asyncio.gather(dead.requeue(entry), dead.requeue(entry))
                assert one.new_id == two.new_id == requeue_id(handle.id, entry.seq)
                assert sorted([one.already, two.already]) == [False, True]
                result = await client.handle(one.new_id).result(timeout=15)
                assert isinstance(result.backend, str)
                assert await kinds(js, "t1", one.new_id) == [
                    "submitted", "routed", "started", "completed",
                ]  # fmt: skip
                # And once more, after it finished.
                three = await dead.requeue(await dead.get(entry.seq))
                assert three.already
                assert (await dead.get(entry.seq)).requeued is not None
    assert mock.stats().requests == 1


async def test_purge_asks_and_deletes_only_what_matched(
    tmp_path: Path, isolated_server: Any
) -> None:
    async with (
        stack(tmp_path, isolated_server, MockSettings()) as (services, _mock, config),
        Client(services.nc, tenant="t1") as t1,
        Client(services.nc, tenant="t2") as t2,
    ):
        js = services.js
        for client in (t1, t1, t2):
            handle = await client.submit("to nowhere", route="no-such-route")
            with pytest.raises(RequestRejectedError):
                await handle.result(timeout=15)
        a, b, c = await entries(js)
        assert [e.tenant for e in (a, b, c)] == ["t1", "t1", "t2"]

        for answer in ("n\n", "\n", "", "yes please\n"):
            code, out, err = await rq(config, "dlq", "purge", "--tenant", "t1", stdin=answer)
            assert code == 0, err
            assert "Purge 2 dead letters? [y/N]" in err
            assert "nothing purged" in err
            assert len(await entries(js)) == 3

        code, out, err = await rq(config, "dlq", "purge", "--tenant", "t1", "--yes")
        assert code == 0, err
        assert "purged 2 dead letters" in out
        assert [e.seq for e in await entries(js)] == [c.seq]

        # By sequence: a missing one fails (exit 1), the one that is there goes.
        code, out, err = await rq(config, "dlq", "purge", str(a.seq), str(c.seq), stdin="y\n")
        assert code == 1
        assert f"no dead letter {a.seq}" in err
        assert "Purge 1 dead letter? [y/N]" in err
        assert await entries(js) == []

        # Nothing named: refused rather than purging everything.
        code, out, err = await rq(config, "dlq", "purge", "--yes")
        assert code == 2
        assert "sequences, a filter" in err


async def test_hostile_entries_never_crash_the_tool(tmp_path: Path, isolated_server: Any) -> None:
    """Bytes that are not UTF-8, control characters and escape sequences, huge
    headers, JSON that is no request, headers missing, a forged marker, and a
    reason that echoes the backend's key: every command reads them, prints
    them escaped (never the key), and refuses what cannot be done, entry by
    entry."""
    async with stack(tmp_path, isolated_server, MockSettings()) as (services, _mock, config):
        js = services.js
        hostile = [
            (b"\xff\xfe\x00\x1b[2J", {"Rq-Tenant": "t1", "Rq-Reason": "malformed: \x1b[31mred"}),
            (b"[1, 2, 3]", {"Rq-Tenant": "t\u00e9\u202e", "Rq-Reason": "x" * 60_000}),
            (b'{"id": "x", "tenant": "t1"}', {}),
            (
                b"{}",
                {
                    "Rq-Tenant": "*",
                    "Rq-Request-Id": ">",
                    "Rq-Reason": f"fatal: 401 bad key {SECRET}",
                },
            ),
        ]
        for payload, headers in hostile:
            await js.publish("rq.dlq.requests", payload, headers=headers or None)
        await js.publish(requeue_subject(1), b"\xff not a marker")
        await js.publish("rq.dlq.requests", b"\xc3", headers={"Rq-Reason": "caf\u00e9 \r\n evil"})

        code, out, err = await rq(config, "dlq", "list")
        assert code == 0, err
        assert "5 of 5 dead letters match" in out
        assert "\\x1b[31mred" in out
        assert "[redacted]" in out
        code, out, err = await rq(config, "dlq", "list", "--json")
        assert code == 0, err
        assert len(lines_json(out)) == 5
        seqs = [str(e["seq"]) for e in lines_json(out)]

        code, out, err = await rq(config, "dlq", "show", *seqs)
        assert code == 0, err
        assert "history: no events logged" in out
        code, out, err = await rq(config, "dlq", "show", "--json", *seqs)
        assert code == 0, err
        shown = lines_json(out)
        assert shown[0]["payload"] is None
        assert shown[0]["payload_text"].startswith("\\xff\\xfe")
        assert shown[4]["reason"].startswith("caf\u00e9")

        code, out, err = await rq(config, "dlq", "requeue", "--all")
        assert code == 1
        assert len([line for line in err.splitlines() if "dead letter" in line]) == 5

        code, out, err = await rq(config, "dlq", "purge", "--all", "--yes")
        assert code == 0, err
        assert "purged 5 dead letters" in out
        assert await entries(js) == []


async def test_requeue_refuses_what_admission_would_reject_and_keeps_or_sets_the_deadline(
    tmp_path: Path, isolated_server: Any
) -> None:
    async with (
        stack(tmp_path, isolated_server, MockSettings(output_tokens=2)) as (services, _m, config),
        Client(services.nc, tenant="t1") as client,
    ):
        js = services.js
        unknown = await client.submit("nowhere", route="no-such-route", timeout=10)
        with pytest.raises(RequestRejectedError):
            await unknown.result(timeout=15)
        [entry] = await entries(js)
        code, _out, err = await rq(config, "dlq", "requeue", str(entry.seq))
        assert code == 1
        assert "admission would reject it" in err
        assert "no-such-route" in err
        # Without a config to check against, it goes, and is rejected again (a
        # new dead letter, of the new id): the tool is no way around admission.
        dead = DeadLetters(js)
        done = await dead.requeue(entry, keep_budget=False, budget=60.0)
        assert done.deadline is not None
        with pytest.raises(RequestRejectedError):
            await client.handle(done.new_id).result(timeout=15)
        # Rejected before it was logged as submitted: its own dead letter has it.
        first, second = await entries(js)
        assert (first.request_id, second.request_id) == (unknown.id, done.new_id)
        again = second.request()
        assert again.metadata == {"requeued_from": unknown.id, "dlq_seq": str(entry.seq)}
        assert 58 < (again.deadline or 0) - second.time < 61
        with pytest.raises(DeadLetterError, match="no dead letter 999"):
            await dead.get(999)

        # A level no stream takes (the config changed since): refused, with or without a config.
        urgent = msgspec.structs.replace(again, id="urgent-1", priority="urgent", metadata={})
        await EventLog(js).dead_letter(
            "requests", encode(urgent), reason="undeliverable: test",
            source_subject=request_subject("urgent", "t1"), tenant="t1", request_id="urgent-1",
        )  # fmt: skip
        [*_, odd] = await entries(js)
        code, _out, err = await rq(config, "dlq", "requeue", str(odd.seq))
        assert code == 1
        assert "no priority level 'urgent' in the config" in err
        with pytest.raises(DeadLetterError, match="no stream takes priority 'urgent'"):
            await dead.requeue(odd)


async def test_a_server_without_the_stream_cannot_be_read_exit_2(
    tmp_path: Path, isolated_server: Any
) -> None:
    path = tmp_path / "rq.toml"
    write_config(path, nats_url=isolated_server.url, backend_url="http://127.0.0.1:9")
    for args in (["list"], ["show", "1"], ["requeue", "--all"], ["purge", "1", "--yes"]):
        code, out, err = await rq(path, "dlq", *args)
        assert code == 2, (args, out, err)
        assert f"renqueue: no dead-letter stream {DLQ_STREAM}" in err
        assert out == ""


def test_a_requeue_id_is_deterministic_and_always_a_valid_request_id() -> None:
    long = "a" * 128
    new = requeue_id(long, 123456789)
    assert len(new) == 128
    assert new == requeue_id(long, 123456789)
    assert new != requeue_id("a" * 127 + "b", 123456789)
    assert new.startswith("a" * 50)
    assert "-dlq123456789-" in new
    assert requeue_id("short", 7) == "short-dlq7"
    for request_id in (new, requeue_id("x" * 120, 1), requeue_id("short", 7)):
        request = msgspec.convert(
            {"id": request_id, "route": "chat", "messages": [{"role": "user", "content": "hi"}]},
            type=InferenceRequest,
        )
        assert request.id == request_id
