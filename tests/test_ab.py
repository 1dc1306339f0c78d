"""A/B splits end to end (issue #10 item 5): a split route sends each request to
its arm by weight and keeps a key on its arm; an arm that fails is rolled back
automatically (an ``ab`` event) and traffic then goes to the control, across
a restart and a replay; held requests follow a rollback; operators promote,
roll back and resume with ``renqueue ab``.

Everything is real: a nats-server per test, mock backends on loopback, the CLI
in a process of its own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from _waits import until
from test_cli import run
from test_fallback import FAST, failing
from test_restarts import TENANT

from renqueue import Client, Config, Services, parse_config
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.coordination import move_split, read_splits, rebuild
from renqueue.errors import RequestFailedError
from renqueue.mock import MockBackend
from renqueue.policy import SplitPolicy, assign
from renqueue.schema import (
    SYSTEM_TENANT,
    ChatMessage,
    Event,
    InferenceRequest,
    Routed,
    SplitChanged,
    kind_of,
)

#: Never opened by the few failures these tests cause: only the split reacts.
NO_CIRCUIT = {"failures": 1000, "min_calls": 100_000}


def split_config(
    url: str,
    steady: MockBackend,
    new: MockBackend,
    *,
    ab: dict[str, Any] | None = None,
    new_settings: dict[str, Any] | None = None,
    **worker: Any,
) -> Config:
    """Route ``chat`` (backend ``steady``) split 50/50 by user with route
    ``canary`` (backend ``new``, never falling back)."""
    return parse_config(
        {
            "nats": {"url": url},
            "backends": {
                "steady": {"base_url": steady.url, "model": "m", "limits": {"concurrency": 4}},
                "new": {
                    "base_url": new.url,
                    "model": "m",
                    "limits": {"concurrency": 4},
                    "circuit": NO_CIRCUIT,
                    **(new_settings or {}),
                },
            },
            "routes": {
                "chat": {
                    "backends": ["steady"],
                    "ab": ab
                    or {
                        "arms": {"chat": 50, "canary": 50},
                        "control": "chat",
                        "key": "metadata.user",
                    },
                },
                "canary": {"backends": ["new"], "fallback": {"on": []}},
            },
            "router": {"capacity_refresh": "20ms"},
            "worker": {
                "retry_delay": "50ms",
                "max_retry_delay": "100ms",
                "drain_timeout": "500ms",
                **worker,
            },
        }
    )


def policy(config: Config) -> SplitPolicy:
    split = config.routes["chat"].ab
    assert split is not None
    return split.policy("chat")


def arm_of(config: Config, user: str) -> str:
    """The arm the split gives ``user`` of :data:`TENANT` (the rule, computed here)."""
    probe = InferenceRequest(
        id="x",
        tenant=TENANT,
        route="chat",
        messages=[ChatMessage(role="user", content="x")],
        metadata={"user": user},
    )
    return assign(policy(config), probe)


def users_on(config: Config, arm: str, count: int) -> list[str]:
    found = [f"user-{n}" for n in range(1000) if arm_of(config, f"user-{n}") == arm]
    return found[:count]


def decisions(events: list[Event]) -> list[tuple[str, str, str]]:
    return [(e.backend, e.split, e.arm) for e in events if isinstance(e, Routed)]


async def split_events(log: EventLog) -> list[SplitChanged]:
    return [e for e in await log.history(SYSTEM_TENANT, "chat") if isinstance(e, SplitChanged)]


BACKEND_OF = {"chat": "steady", "canary": "new"}


async def test_a_split_route_sends_each_user_to_its_arm_and_keeps_it_there(
    isolated_server: EmbeddedServer,
) -> None:
    async with MockBackend(FAST) as steady, MockBackend(FAST) as new:
        config = split_config(isolated_server.url, steady, new)
        users = [f"user-{n}" for n in range(30)]
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            first = [
                await client.submit(f"hello {u}", route="chat", metadata={"user": u}) for u in users
            ]
            # The same users again, later: each keeps its arm.
            again = [
                await client.submit(f"again {u}", route="chat", metadata={"user": u})
                for u in users[:10]
            ]
            await asyncio.gather(*(h.result(timeout=30) for h in [*first, *again]))
            expected = {u: arm_of(config, u) for u in users}
            assert set(expected.values()) == {"chat", "canary"}, "both arms get traffic"
            for user, handle in [*zip(users, first, strict=True), *zip(users, again, strict=False)]:
                arm = expected[user]
                assert decisions(await log.history(TENANT, handle.id)) == [
                    (BACKEND_OF[arm], "chat", arm)
                ], user
            counts = {
                arm: sum(1 for u in users if expected[u] == arm) for arm in ("chat", "canary")
            }
            counts = {
                arm: n + sum(1 for u in users[:10] if expected[u] == arm)
                for arm, n in counts.items()
            }
            assert steady.stats().requests == counts["chat"]
            assert new.stats().requests == counts["canary"]

            async def folded() -> bool:
                reports = await read_splits(client.js, config)
                arms = {a.arm: a.total for a in reports[0].arms}
                return all(arms[arm].completed == counts[arm] for arm in counts)

            await until(folded, "the projection counted every request on its arm")
            (report,) = await read_splits(client.js, config)
            assert report.state == "live"
            for arm in report.arms:
                assert arm.total.requests == counts[arm.arm]
                assert arm.total.failed == 0
                assert arm.total.latency_p95 is not None


async def test_a_failing_arm_is_rolled_back_and_stays_rolled_back_after_a_restart(
    isolated_server: EmbeddedServer,
) -> None:
    ab = {
        "arms": {"chat": 50, "canary": 50},
        "control": "chat",
        "key": "metadata.user",
        "rollback": {"error_rate": 0.5, "min_requests": 4, "window": "1m"},
    }
    async with MockBackend(FAST) as steady, MockBackend(failing("500")) as new:
        # One failed run fails a request: the canary arm never falls back.
        config = split_config(isolated_server.url, steady, new, ab=ab, max_deliver=1)
        canary_users = users_on(config, "canary", 10)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            doomed = [
                await client.submit("x", route="chat", metadata={"user": u})
                for u in canary_users[:6]
            ]
            outcomes = await asyncio.gather(
                *(h.result(timeout=30) for h in doomed), return_exceptions=True
            )
            assert all(isinstance(o, RequestFailedError) for o in outcomes), outcomes

            async def rolled_back() -> bool:
                return bool(await split_events(log))

            await until(rolled_back, "the binder rolled the split back")
            (event,) = await split_events(log)
            assert (event.state, event.arm, event.previous) == ("rolled_back", "chat", "live")
            assert event.operator == ""
            assert event.router
            assert "arm canary" in event.reason
            assert "error rate" in event.reason
            calls = new.stats().requests
            # Traffic then goes to the control, canary users' included.
            after = [
                await client.submit("y", route="chat", metadata={"user": u})
                for u in canary_users[6:]
            ]
            await asyncio.gather(*(h.result(timeout=30) for h in after))
            for handle in after:
                assert decisions(await log.history(TENANT, handle.id)) == [
                    ("steady", "chat", "chat")
                ]
            assert new.stats().requests == calls, "a rolled-back arm was called"

            async def shown() -> bool:
                (report,) = await read_splits(client.js, config)
                return report.state == "rolled_back"

            await until(shown, "ab status shows the rollback")
            (report,) = await read_splits(client.js, config)
            canary = next(a for a in report.arms if a.arm == "canary")
            assert canary.total.failed == 6
            assert report.arm == "chat"
            assert "error rate" in report.reason

        # A restart does not undo it, nor does a replay of the log.
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("z", route="chat", metadata={"user": canary_users[0]})
            await handle.result(timeout=30)
            assert decisions(await EventLog(client.js).history(TENANT, handle.id)) == [
                ("steady", "chat", "chat")
            ]
            replayed = await rebuild(client.js)
            assert replayed.splits.routes["chat"].state == "rolled_back"
            assert len(await split_events(EventLog(client.js))) == 1, "rolled back once"


async def test_a_request_waiting_on_an_arm_follows_its_rollback(
    isolated_server: EmbeddedServer,
) -> None:
    async with MockBackend(FAST) as steady, MockBackend(failing("hang")) as new:
        # One slot on the canary arm, taken by a call that never answers.
        config = split_config(
            isolated_server.url, steady, new, new_settings={"limits": {"concurrency": 1}}
        )
        stuck, waiting = users_on(config, "canary", 2)
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            running = await client.submit("hangs", route="chat", metadata={"user": stuck})
            await until(lambda: _started(log, running.id), "the canary call began")
            held = await client.submit("waits", route="chat", metadata={"user": waiting})

            async def routed_nowhere() -> bool:
                events = await log.history(TENANT, held.id)
                return any(kind_of(e) == "submitted" for e in events) and not decisions(events)

            await until(routed_nowhere, "the second canary request waits for the slot")
            event, _ = await move_split(
                client.js, config, "chat", "rollback", operator="test", reason="bad canary"
            )
            assert event is not None
            await held.result(timeout=30)
            assert decisions(await log.history(TENANT, held.id)) == [("steady", "chat", "chat")]
            await running.cancel("done")


async def _started(log: EventLog, request_id: str) -> bool:
    return any(kind_of(e) == "started" for e in await log.history(TENANT, request_id))


# ------------------------------------------------------------------------ CLI


def write_config(
    tmp_path: Path, steady: MockBackend, new: MockBackend, *, split: bool = True
) -> Path:
    ab = (
        '[routes.chat.ab]\narms = { chat = 50, canary = 50 }\ncontrol = "chat"\n'
        'key = "metadata.user"\n'
        if split
        else ""
    )
    file = tmp_path / f"renqueue-{'ab' if split else 'plain'}.toml"
    file.write_text(
        f'[backends.steady]\nbase_url = "{steady.url}"\nmodel = "m"\n'
        f'[backends.new]\nbase_url = "{new.url}"\nmodel = "m"\n'
        f'[routes.chat]\nbackends = ["steady"]\n{ab}'
        f'[routes.canary]\nbackends = ["new"]\n'
    )
    return file


async def renqueue(config: Path, url: str, *args: str) -> tuple[int, str, str]:
    return await run("-m", "renqueue", "-c", str(config), "--nats", url, *args)


#: Eleven commands, each bounded by ``run`` (the CLI's start-up is what a
#: loaded machine stretches): a bound for a hang, not a timing.
@pytest.mark.timeout(900)
async def test_operators_promote_roll_back_and_resume_with_the_cli(
    isolated_server: EmbeddedServer, tmp_path: Path
) -> None:
    url = isolated_server.url
    async with MockBackend(FAST) as steady, MockBackend(FAST) as new:
        file = write_config(tmp_path, steady, new)
        config = split_config(url, steady, new)
        chat_user = users_on(config, "chat", 1)[0]
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)

            async def lands() -> str:
                handle = await client.submit("x", route="chat", metadata={"user": chat_user})
                await handle.result(timeout=30)
                ((backend, split, arm),) = decisions(await log.history(TENANT, handle.id))
                assert (backend, split) == (BACKEND_OF[arm], "chat")
                return arm

            assert await lands() == "chat"
            code, out, err = await renqueue(file, url, "ab", "status")
            assert code == 0, err
            assert "A/B split chat: live" in out
            assert "chat (control)" in out

            code, out, err = await renqueue(
                file,
                url,
                "ab",
                "promote",
                "chat",
                "canary",
                "--reason",
                "looks good",
                "--by",
                "alice",
            )
            assert code == 0, err
            assert "promoted to canary" in out
            (event,) = await split_events(log)
            assert (event.state, event.arm, event.operator, event.reason) == (
                "promoted",
                "canary",
                "alice",
                "looks good",
            )

            async def on(arm: str) -> bool:
                return await lands() == arm

            # Every router follows it once the projection shows it.
            await until(lambda: on("canary"), "the chat user's requests go to canary")

            code, out, err = await renqueue(file, url, "ab", "promote", "chat", "canary")
            assert (code, "already" in out) == (0, True), out + err
            assert len(await split_events(log)) == 1, "a repeated promote logs nothing"

            code, out, err = await renqueue(file, url, "ab", "rollback", "chat")
            assert code == 0, err
            assert "rolled back to chat" in out
            await until(lambda: on("chat"), "the chat user's requests go back to chat")

            code, out, err = await renqueue(file, url, "ab", "status", "chat", "--json")
            assert code == 0, err
            (report,) = json.loads(out)
            assert (report["state"], report["arm"]) == ("rolled_back", "chat")
            assert report["by"]

            code, out, err = await renqueue(file, url, "ab", "resume", "chat")
            assert code == 0, err
            assert "resumed" in out
            assert [e.state for e in await split_events(log)] == [
                "promoted",
                "rolled_back",
                "live",
            ]

            code, out, err = await renqueue(file, url, "ab", "promote", "chat", "nowhere")
            assert code == 2
            assert err.strip().splitlines() == [
                "renqueue: 'nowhere' is not an arm of 'chat''s split (arms: chat, canary)"
            ]
            code, out, err = await renqueue(file, url, "ab", "rollback", "canary")
            assert code == 2
            assert "no A/B split" in err

        # A config without the split: the log still knows it.
        plain = write_config(tmp_path, steady, new, split=False)
        code, out, err = await renqueue(plain, url, "ab", "status")
        assert code == 0, err
        assert "not in this config" in out
        code, out, err = await renqueue(plain, url, "ab", "status", "nothing")
        assert code == 2
        assert "no A/B split" in err
