"""`renqueue status` (issue #8 item 7): each backend's health, quota, in-flight
and queue, each level's waiting requests, each tenant's spend today.

The pure parts first (a backend's status from its folded state, the report
rendered as text), then the command as a user runs it against a live
workload: a backend busy with one request and two more waiting for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from test_binder import until
from test_cli import run

from renqueue import Client, Services, load_config, parse_config
from renqueue.errors import NatsNotFoundError
from renqueue.ops import EmbeddedServer
from renqueue.policy import LimitUsage, Quota, cool_down, reserve
from renqueue.policy._quota import Cost
from renqueue.state import (
    STATE_KEY,
    BackendState,
    BackendStatus,
    LevelStatus,
    StatusReport,
    TenantStatus,
    backend_status,
    decode_state,
    render_status,
)
from renqueue.tools import MockBackend, MockSettings
from renqueue.wire import JetStream

T = 1_780_000_020.0

CONFIG = parse_config(
    {
        "backends": {
            "groq": {
                "base_url": "http://127.0.0.1:1/v1",
                "model": "m",
                "api_key_env": "GROQ_TEST_KEY_NEVER_SET",
                "limits": {"concurrency": 4, "requests": ["2/min"], "tokens": ["1000/min"]},
            },
            "local": {"base_url": "http://127.0.0.1:2/v1", "model": "m"},
        }
    }
)


def spent(n: int, at: float, tokens: int = 0) -> Quota:
    quota = Quota()
    for _ in range(n):
        quota = reserve(quota, Cost(requests=1, tokens=tokens), at)
    return quota


@pytest.mark.parametrize(
    ("name", "state", "now", "expected"),
    [
        pytest.param(
            "local",
            BackendState(),
            T,
            {"healthy": True, "held": "", "limits": (), "concurrency": 4, "configured": True},
            id="nothing-yet",
        ),
        pytest.param(
            "local",
            BackendState(consecutive_failures=3, last_fault_at=T - 5, in_flight=2),
            T,
            {"healthy": False, "consecutive_failures": 3, "in_flight": 2},
            id="three-faults-within-the-cooldown",
        ),
        pytest.param(
            "local",
            BackendState(consecutive_failures=3, last_fault_at=T - 30),
            T,
            {"healthy": True},
            id="healthy-again-after-the-cooldown",
        ),
        pytest.param(
            "groq",
            BackendState(quota=spent(1, T, tokens=300)),
            T + 1,
            {"held": "", "limits_used": [("requests/min", 1, 1), ("tokens/min", 300, 700)]},
            id="room-left",
        ),
        pytest.param(
            "groq",
            BackendState(quota=spent(2, T)),
            T + 1,
            {
                "held": "quota:requests/min 2/2, resets in 60 s",
                "limits_used": [("requests/min", 2, 0), ("tokens/min", 0, 1000)],
            },
            id="a-full-window-holds-it-as-the-binder-says",
        ),
        pytest.param(
            "groq",
            BackendState(quota=cool_down(Quota(), T + 20)),
            T,
            {"held": "rate limited by the provider, retry in 20 s", "cooldown_until": T + 20},
            id="a-cooldown-ahead",
        ),
        pytest.param(
            "groq",
            BackendState(quota=cool_down(cool_down(Quota(), T - 1), T + 600, exhausted=True)),
            T,
            {"cooldown_until": None, "exhausted_until": T + 600},
            id="a-cooldown-past-is-not-shown",
        ),
        pytest.param(
            "gone",
            BackendState(calls_completed=5),
            T,
            {"configured": False, "concurrency": None, "limits": (), "calls_completed": 5},
            id="a-backend-only-the-log-names",
        ),
    ],
)
def test_backend_status(
    name: str, state: BackendState, now: float, expected: dict[str, object]
) -> None:
    status = backend_status(name, state, CONFIG, 7, now)
    assert status.queue_depth == 7
    for field, value in expected.items():
        if field == "limits_used":
            assert [(u.key, u.used, u.left) for u in status.limits] == value
        else:
            assert getattr(status, field) == value, field


def usage(key: str, used: int, count: int, **fields: object) -> LimitUsage:
    kind, _, _ = key.partition("/")
    values: dict[str, object] = {
        "key": key,
        "kind": kind,
        "window": 60.0,
        "calendar": "rolling",
        "count": count,
        "declared": count,
        "used": used,
        "left": max(0, count - used),
        "room_at": None,
        "resets_at": None,
        **fields,
    }
    return LimitUsage(**values)  # type: ignore[arg-type]


REPORT = StatusReport(
    at=T,
    projected=True,
    last_seq=1234,
    log_time=T - 2,
    events_behind=3,
    in_flight=3,
    backends=(
        BackendStatus(
            name="groq",
            configured=True,
            healthy=True,
            consecutive_failures=0,
            last_error_type="rate_limited",
            in_flight=2,
            queue_depth=3,
            concurrency=4,
            cooldown_until=T + 12,
            exhausted_until=None,
            held="rate limited by the provider, retry in 12 s",
            limits=(
                usage("requests/min", 30, 30, room_at=T + 3, resets_at=T + 58),
                usage(
                    "tokens/day",
                    1200,
                    5000,
                    window=86400.0,
                    calendar="utc",
                    declared=None,
                    resets_at=T + 7200,
                    reported_left=3800,
                    reported_reset_at=T + 7200,
                ),
            ),
            calls_completed=120,
            calls_failed=4,
            rate_limited=3,
            spend=0.0,
        ),
        BackendStatus(
            name="local",
            configured=True,
            healthy=False,
            consecutive_failures=3,
            last_error_type="backend_unavailable",
            in_flight=1,
            queue_depth=None,
            concurrency=16,
            cooldown_until=None,
            exhausted_until=None,
            held="",
            limits=(),
            calls_completed=7,
            calls_failed=3,
            rate_limited=0,
            spend=0.125,
        ),
    ),
    levels=(
        LevelStatus(name="critical", waiting=0, oldest_at=None, oldest_wait=None),
        LevelStatus(name="batch", waiting=42, oldest_at=T - 95.4, oldest_wait=95.4),
    ),
    tenants=(
        TenantStatus(
            name="acme",
            spend_today=0.05,
            spend=1.5,
            submitted=130,
            terminal={"failed": 1, "completed": 127},
        ),
    ),
)


def section(text: str, title: str) -> list[str]:
    """The rows of a section of the rendered text (its heading and blank line off)."""
    return text.split(f"\n{title}")[1].split("\n\n", maxsplit=1)[0].splitlines()[2:]


def test_render_status_lines() -> None:
    lines = render_status(REPORT)
    assert lines[:2] == [
        "Ren-Queue status at 2026-05-28T20:27:00+00:00",
        "  projection at seq 1234 (3 events behind the log), log time"
        " 2026-05-28T20:26:58+00:00; 3 in flight",
    ]
    text = "\n".join(lines)
    backends = text.split("Backends\n")[1].split("\n\n")[0].splitlines()
    assert section(text, "Backends") == backends[1:]
    assert backends[0].split() == [
        *("backend", "health", "in", "flight", "queue", "slots", "done", "failed", "429s"),
        *("spend", "$", "held"),
    ]
    assert backends[1].split() == [
        *("groq", "healthy", "2", "3", "4", "120", "4", "3", "0.000000", "rate", "limited"),
        *("by", "the", "provider,", "retry", "in", "12", "s"),
    ]
    assert backends[2].split() == [
        *("local", "unhealthy", "(3)", "1", "-", "16", "7", "3", "0", "0.125000", "-"),
    ]
    # every row of a table starts its columns at the same place
    assert (
        backends[1].index("healthy")
        == backends[2].index("unhealthy")
        == backends[0].index("health")
    )
    assert "Paused by the provider\n  groq: rate limited (429), retry in 12 s" in text
    limits = text.split("Rate limits")[1].split("\n\n")[0].splitlines()[2:]
    assert limits[0].split() == [
        *("groq", "requests/min", "30", "30", "0", "30", "58", "s;", "room", "for", "one"),
        *("more", "in", "3.0", "s"),
    ]
    assert limits[1].split() == [
        *("groq", "tokens/day", "(utc)", "1200", "5000", "3800", "-", "2.0", "h;", "provider"),
        *("says", "3800", "left,", "resets", "in", "2.0", "h"),
    ]
    levels = text.split("Priority levels\n")[1].split("\n\n")[0].splitlines()
    assert [line.split() for line in levels[1:]] == [
        ["critical", "0", "-"],
        ["batch", "42", "95", "s"],
    ]
    tenants = text.split("Tenants\n")[1].splitlines()
    assert tenants[1].split() == [
        "acme",
        "0.050000",
        "1.500000",
        "130",
        "completed=127",
        "failed=1",
    ]


def test_render_status_before_any_projection() -> None:
    empty = StatusReport(
        at=T,
        projected=False,
        last_seq=0,
        log_time=0.0,
        events_behind=5,
        in_flight=0,
        backends=(),
        levels=(),
        tenants=(),
    )
    lines = render_status(empty)
    assert "no projection stored yet" in lines[1]
    assert lines[-2:] == ["Tenants", "  none yet"]
    assert not any("Rate limits" in line or "Paused" in line for line in lines)


# ------------------------------------------------------------------ the command


def write_config(tmp_path: Path, url: str, slow: str, paid: str) -> Path:
    file = tmp_path / "renqueue.toml"
    file.write_text(
        f'[nats]\nurl = "{url}"\n'
        '[router]\ncapacity_refresh = "20ms"\n'
        '[worker]\ndrain_timeout = "500ms"\n'
        f'[backends.slow]\nbase_url = "{slow}"\nmodel = "m"\n'
        'api_key_env = "RENQUEUE_TEST_STATUS_KEY"\n'
        '[backends.slow.limits]\nconcurrency = 1\nrequests = ["100/min"]\n'
        f'[backends.paid]\nbase_url = "{paid}"\nmodel = "m"\n'
        "cost_input_per_mtok = 1000.0\ncost_output_per_mtok = 2000.0\n"
        '[routes.slow]\nbackends = ["slow"]\n'
        '[routes.paid]\nbackends = ["paid"]\n'
    )
    return file


async def consumer_waiting(js: JetStream, consumer: str) -> int:
    info = await js.consumer_info("RQ_REQUESTS", consumer)
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


async def test_status_reports_a_live_workload(
    tmp_path: Path, isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-status-test-never-printed"
    monkeypatch.setenv("RENQUEUE_TEST_STATUS_KEY", secret)
    async with (
        MockBackend(MockSettings(ttft=60.0)) as slow,
        MockBackend(MockSettings(output_tokens=5)) as paid,
    ):
        config = write_config(tmp_path, isolated_server.url, slow.url, paid.url)
        async with (
            Services(load_config(config)) as services,
            Client(services.nc, tenant="t1") as t1,
            Client(services.nc, tenant="t2") as t2,
        ):
            done = [await t1.submit(f"p{n}", route="paid") for n in range(2)]
            results = await asyncio.gather(*(h.result(timeout=30) for h in done))
            for n in range(3):
                await t2.submit(f"s{n}", route="slow", priority="low")
            js = services.js
            kv = await js.key_value("rq-state")

            async def one_running_two_waiting() -> bool:
                try:
                    state = decode_state((await kv.get(STATE_KEY)).value)
                except NatsNotFoundError:
                    return False  # the projector has not written its first checkpoint yet
                return (
                    state.backend("slow").in_flight == 1
                    and await consumer_waiting(js, "router-low") == 2
                )

            await until(one_running_two_waiting, "one request runs on slow, two wait")
            code, out, err = await run("-m", "renqueue", "-c", str(config), "status", "--json")
            assert code == 0, err
            report = json.loads(out)
            code, text, err = await run("-m", "renqueue", "-c", str(config), "status")
            assert code == 0, err
            watched = await watch(config, refreshes=2)

    backends = {b["name"]: b for b in report["backends"]}
    slow_status = backends["slow"]
    assert slow_status["healthy"] is True
    assert (slow_status["in_flight"], slow_status["queue_depth"]) == (1, 1)
    assert slow_status["concurrency"] == 1
    assert slow_status["held"] == ""
    (requests,) = slow_status["limits"]
    assert (requests["key"], requests["used"], requests["left"], requests["count"]) == (
        "requests/min",
        1,
        99,
        100,
    )
    assert report["at"] < requests["resets_at"] <= report["at"] + 61
    assert backends["paid"]["calls_completed"] == 2
    assert backends["paid"]["limits"] == []

    levels = {level["name"]: level for level in report["levels"]}
    assert levels["low"]["waiting"] == 2
    assert levels["low"]["oldest_wait"] > 0
    assert levels["critical"] == {
        "name": "critical",
        "waiting": 0,
        "oldest_at": None,
        "oldest_wait": None,
    }

    tenants = {t["name"]: t for t in report["tenants"]}
    spend = sum(result.cost for result in results)
    assert spend > 0
    assert tenants["t1"]["spend_today"] == pytest.approx(spend)
    assert tenants["t1"]["spend"] == pytest.approx(spend)
    assert (tenants["t1"]["submitted"], tenants["t1"]["terminal"]) == (2, {"completed": 2})

    rows = {line.split()[0]: line.split() for line in section(text, "Backends")}
    assert rows["slow"][1:5] == ["healthy", "1", "1", "1"]
    rows = {line.split()[0]: line.split() for line in section(text, "Priority levels")}
    assert rows["low"][1] == "2"
    assert secret not in out + text
    assert len(watched) == 2
    assert watched[0]["at"] < watched[1]["at"]


async def watch(config: Path, refreshes: int) -> list[dict[str, object]]:
    """``status --watch --json`` for ``refreshes`` redraws, then Ctrl-C (SIGINT)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "-c", str(config),
        "status", "--watch", "--interval", "0.2", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )  # fmt: skip
    assert proc.stdout is not None
    reports = []
    try:
        for _ in range(refreshes):
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            reports.append(json.loads(line))
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 130
    return reports
