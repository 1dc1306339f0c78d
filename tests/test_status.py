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

import msgspec
import pytest
from _waits import until
from test_cli import run

from renqueue import Client, Services, load_config, parse_config
from renqueue.broker import EmbeddedServer, JetStream, connect, provision
from renqueue.coordination import (
    BackendStatus,
    LevelStatus,
    StatusReport,
    TenantStatus,
    backend_status,
    render_status,
)
from renqueue.errors import NatsNotFoundError
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import Budget, Learned, LimitUsage, Perf, Quota, cool_down, reserve
from renqueue.policy._quota import Cost
from renqueue.state import (
    STATE_KEY,
    BackendState,
    ProjectionState,
    TenantState,
    decode_state,
    encode_state,
)
from renqueue.text import printable

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
            BackendState(
                consecutive_failures=3,
                last_fault_at=T - 5,
                in_flight=2,
                circuit="open",
                circuit_at=T - 5,
                circuit_reason="3 backend faults in a row",
            ),
            T,
            {
                "healthy": False,
                "consecutive_failures": 3,
                "in_flight": 2,
                "circuit": "open",
                "circuit_since": T - 5,
                "circuit_reason": "3 backend faults in a row",
            },
            id="its-circuit-open",
        ),
        pytest.param(
            "local",
            BackendState(consecutive_failures=3, last_fault_at=T - 30, circuit="half_open"),
            T,
            {"healthy": True, "circuit": "half_open"},
            id="half-open-takes-its-probe-call",
        ),
        pytest.param(
            "local",
            BackendState(probe_ok=False, probe_at=T - 1),
            T,
            {"healthy": True, "probe_ok": False},
            id="a-failed-probe-the-binder-has-not-acted-on-yet",
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
    status = backend_status(name, state, CONFIG, now, waiting=7, running=2)
    assert (status.waiting, status.running) == (7, 2)
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
            waiting=3,
            running=2,
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
            perf=Perf(
                samples=120, ttft=0.21, ttft_var=0.0025, rate=98.0, rate_var=16.0, output=120.0
            ),
        ),
        BackendStatus(
            name="local",
            configured=True,
            healthy=False,
            circuit="open",
            circuit_since=T - 10,
            circuit_reason="3 backend faults in a row",
            consecutive_failures=3,
            last_error_type="backend_unavailable",
            in_flight=1,
            waiting=None,
            running=None,
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
            budget=Budget(daily=5.0, mode="hard"),
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
        *("backend", "health", "in", "flight", "waiting", "running", "slots", "done", "failed"),
        *("429s", "spend", "$"),
    ]
    assert backends[1].split() == [
        *("groq", "ok", "2", "3", "2", "4", "120", "4", "3", "0.000000"),
    ]
    assert backends[2].split() == [
        *("local", "open", "(3)", "1", "-", "-", "16", "7", "3", "0", "0.125000"),
    ]
    # Why the binder passes a backend over: a section of its own, in words.
    assert (
        "Held back (why the binder would pass it over for the smallest request now)\n"
        "  groq: rate limited by the provider, retry in 12 s\n"
    ) in text
    # every row of a table starts its columns at the same place
    assert backends[1].index("ok ") == backends[2].index("open") == backends[0].index("health")
    assert (
        "Paused by the provider\n"
        "  groq: 429 from the provider: no call until 2026-05-28T20:27:12+00:00 (in 12 s)\n"
    ) in text
    assert (
        "Circuit breakers not closed (the binder moves them; circuit events)\n"
        "  local: open since 2026-05-28T20:26:50+00:00: 3 backend faults in a row\n"
    ) in text
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
    learned = section(text, "Learned from the log")
    assert [row.split() for row in learned] == [
        [*("groq", "120", "0.21", "+-", "0.05", "98", "+-", "4"), *("120", "+-", "0", "0%", "0%")]
    ]
    tenants = text.split("Tenants\n")[1].splitlines()
    assert tenants[1].split() == [
        "acme",
        "0.050000",
        "5.000000",
        "hard",
        "1.500000",
        "130",
        "completed=127",
        "failed=1",
    ]


def test_cancellations_the_log_has_not_sourced_are_named() -> None:
    """A cancellation acknowledged by RQ_CANCELS but not in the log is one the
    services do not know: status says how many wait (none: no section)."""
    assert not any("Cancellations not in the log" in line for line in render_status(REPORT))
    waiting = msgspec.structs.replace(REPORT, cancels_unsourced=3)
    text = "\n".join(render_status(waiting))
    assert "Cancellations not in the log" in text
    assert "RQ_CANCELS" in text
    assert "3 waiting to be sourced" in text


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


def write_config(tmp_path: Path, url: str, slow: str, paid: str, spent: str) -> Path:
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
        f'[backends.spent]\nbase_url = "{spent}"\nmodel = "m"\nlimit_style = "groq"\n'
        '[routes.slow]\nbackends = ["slow"]\n'
        '[routes.paid]\nbackends = ["paid"]\n'
        '[routes.spent]\nbackends = ["spent"]\n'
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
        MockBackend(MockSettings(limit_style="groq", quota_exhausted=True)) as spent,
    ):
        config = write_config(tmp_path, isolated_server.url, slow.url, paid.url, spent.url)
        # The key is there for every run below to print, were it to: in the
        # environment they inherit, named by the config they read.
        key = load_config(config).backends["slow"].api_key()
        assert key is not None
        assert key.reveal() == secret
        code, out, _ = await run("-c", "import os; print(os.environ['RENQUEUE_TEST_STATUS_KEY'])")
        assert (code, out.strip()) == (0, secret)
        async with (
            Services(load_config(config)) as services,
            Client(services.nc, tenant="t1") as t1,
            Client(services.nc, tenant="t2") as t2,
            Client(services.nc, tenant="t3") as t3,
        ):
            done = [await t1.submit(f"p{n}", route="paid") for n in range(2)]
            results = await asyncio.gather(*(h.result(timeout=30) for h in done))
            for n in range(3):
                await t2.submit(f"s{n}", route="slow", priority="low")
            await t3.submit("out of quota", route="spent", priority="high")
            js = services.js
            kv = await js.key_value("rq-state")

            async def one_running_two_waiting_and_a_quota_spent() -> bool:
                try:
                    state = decode_state((await kv.get(STATE_KEY)).value)
                except NatsNotFoundError:
                    return False  # the projector has not written its first checkpoint yet
                quota = state.backend("spent").quota
                return (
                    state.backend("slow").in_flight == 1
                    and await consumer_waiting(js, "router-low") == 2
                    and quota is not None
                    and quota.exhausted_until is not None
                )

            await until(
                one_running_two_waiting_and_a_quota_spent,
                "one request runs on slow, two wait, spent's quota is gone",
            )
            base = ("-m", "renqueue", "-c", str(config))
            code, out, err = await run(*base, "status", "--json")
            assert code == 0, err
            report = json.loads(out)
            code, text, text_err = await run(*base, "--log-level", "DEBUG", "status")
            assert code == 0, text_err
            watched, watch_err = await watch(config, refreshes=2)
            printed = [out, err, text, text_err, *map(json.dumps, watched), watch_err]
            # NATS unreachable: the error run prints what it can on stderr.
            code, gone_out, gone_err = await run(
                *base, "--log-level", "DEBUG", "--nats", "nats://127.0.0.1:1", "status"
            )
            assert code == 4, gone_err  # NATS unreachable
            printed += [gone_out, gone_err]

    for output in printed:
        assert secret not in output

    backends = {b["name"]: b for b in report["backends"]}
    slow_status = backends["slow"]
    assert slow_status["healthy"] is True
    # One dispatch runs on slow (a worker holds it); none waits at its worker
    # consumer: the two others wait at their level, to be bound.
    assert (slow_status["in_flight"], slow_status["waiting"], slow_status["running"]) == (1, 0, 1)
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
    # Groq's daily request counter at 0: out until the next UTC midnight.
    midnight = (int(report["at"]) // 86400 + 1) * 86400
    assert backends["spent"]["exhausted_until"] == pytest.approx(midnight, abs=2)
    assert backends["spent"]["held"] != ""  # the binder passes it over

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
    assert rows["slow"][1:6] == ["ok", "1", "0", "1", "1"]
    rows = {line.split()[0]: line.split() for line in section(text, "Priority levels")}
    assert rows["low"][1] == "2"
    # An exhausted quota is named as one, not as a rate limit.
    pauses = text.split("\nPaused by the provider\n")[1].split("\n\n")[0].splitlines()
    (spent_pause,) = (line for line in pauses if line.startswith("  spent: "))
    assert spent_pause.startswith("  spent: quota exhausted until ")
    assert "429" not in spent_pause
    assert "rate limited" not in spent_pause
    assert len(watched) == 2
    assert watched[0]["at"] < watched[1]["at"]


async def start_watch(config: Path, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", "-c", str(config),
        "status", "--watch", "--interval", "0.2", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )  # fmt: skip


async def interrupt(proc: asyncio.subprocess.Process) -> str:
    """Ctrl-C (SIGINT) to a watch: its exit status must be 130; its stderr."""
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 130, err.decode()
    return err.decode()


async def watch(config: Path, refreshes: int) -> tuple[list[dict[str, object]], str]:
    """``status --watch --json`` for ``refreshes`` redraws, then Ctrl-C: the reports, stderr."""
    proc = await start_watch(config, "--json")
    assert proc.stdout is not None
    reports = []
    try:
        for _ in range(refreshes):
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            reports.append(json.loads(line))
    finally:
        err = await interrupt(proc)
    return reports, err


@pytest.mark.parametrize(
    ("exhausted_until", "cooldown_until", "expected"),
    [
        pytest.param(
            T + 3600,
            T + 3600.4,
            "quota exhausted until 2026-05-28T21:27:00+00:00 (in 1.0 h)",
            id="a-spent-quota-and-the-pause-its-worker-set-are-one",
        ),
        pytest.param(
            None,
            T + 600,
            "429 from the provider: no call until 2026-05-28T20:37:00+00:00 (in 600 s)",
            id="a-cooldown-alone",
        ),
        pytest.param(1e300, None, "quota exhausted until far future", id="far-future"),
    ],
)
def test_a_pause_is_named_for_what_the_provider_said(
    exhausted_until: float | None, cooldown_until: float | None, expected: str
) -> None:
    groq = msgspec.structs.replace(
        REPORT.backends[0], exhausted_until=exhausted_until, cooldown_until=cooldown_until
    )
    text = "\n".join(render_status(msgspec.structs.replace(REPORT, backends=(groq,))))
    assert text.split("\nPaused by the provider\n")[1].split("\n")[0] == f"  groq: {expected}"


def test_render_escapes_names_and_survives_times_no_calendar_holds() -> None:
    odd = msgspec.structs.replace(
        REPORT.backends[1],
        name="\x1b[31mred",
        held="held \x1b]0;title\x07" + "x" * 500,
        cooldown_until=1e300,
    )
    report = msgspec.structs.replace(
        REPORT,
        log_time=1e300,
        backends=(REPORT.backends[0], odd),
        tenants=(
            msgspec.structs.replace(REPORT.tenants[0], name="\u202eevil", terminal={"a\nb": 1}),
        ),
    )
    lines = render_status(report)
    text = "\n".join(lines)
    assert all(line.isprintable() for line in lines)
    assert "log time far future" in lines[1]
    assert "  \\x1b[31mred " in text
    assert "held \\x1b]0;title\\x07xxx" in text
    assert max(len(line) for line in lines) < 250
    assert "  \\x1b[31mred: 429 from the provider: no call until far future" in text
    assert "  \\u202eevil " in text
    assert "a\\x0ab=1" in text


def test_printable_escapes_only_what_a_terminal_would_act_on() -> None:
    assert printable("groq-llama 8b ü 模型") == "groq-llama 8b ü 模型"
    assert printable("a\tb\x1b[2J\u2028\U000e0001") == "a\\x09b\\x1b[2J\\u2028\\U000e0001"


# ------------------------------------------------- what a checkpoint may hold

#: Backend names no config allows and nats-py refuses as a consumer's (``a.b``, ``x y``,
#: ``*``, ``>``), or a terminal would act on; tenants as odd; times no calendar holds.
ODD_BACKENDS = ("a.b", "x y", "*", ">", "\x1b[31mred", "\u202erev")
ODD_STATE = ProjectionState(
    log_time=1e300,
    backends={
        **{name: BackendState(calls_started=1, in_flight=1) for name in ODD_BACKENDS},
        "b": BackendState(
            quota=Quota(
                cooldown_until=1e300,
                exhausted_until=1e300,
                learned={
                    "requests/day": Learned(
                        kind="requests", window=86400.0, limit=10, remaining=0, reset_at=1e300
                    )
                },
            ),
            consecutive_failures=3,
            last_fault_at=1e300,
        ),
    },
    tenants={
        "\x1b[2Jt": TenantState(submitted=1, terminal={"completed": 1}),
        "\u202eevil": TenantState(),
    },
)


def odd_config(tmp_path: Path, url: str) -> Path:
    file = tmp_path / "renqueue.toml"
    file.write_text(
        f'[nats]\nurl = "{url}"\n'
        '[backends.b]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n'
        '[backends.b.limits]\nrequests = ["5/min"]\ndaily_reset = "us-pacific"\n'
    )
    return file


async def test_status_shows_whatever_a_checkpoint_holds(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    config = odd_config(tmp_path, isolated_server.url)
    nc = await connect(isolated_server.url, name="forger")
    try:
        js = nc.jetstream()
        await provision(js, load_config(config))
        await (await js.key_value("rq-state")).put(STATE_KEY, encode_state(ODD_STATE))
    finally:
        await nc.close()
    base = ("-m", "renqueue", "-c", str(config))

    code, text, err = await run(*base, "status")
    assert code == 0, err
    assert all(line.isprintable() for line in text.splitlines())
    assert "log time far future" in text
    rows = section(text, "Backends")
    for name in ODD_BACKENDS:
        (row,) = (row for row in rows if row.startswith(f"  {printable(name)} "))
        # in flight 1, no consumer: nothing waiting or running shown
        assert row[len(f"  {printable(name)}") :].split()[1:4] == ["1", "-", "-"], row
    assert "  b: quota exhausted until far future" in text
    assert "\\x1b[2Jt" in text
    assert "\\u202eevil" in text

    code, out, err = await run(*base, "status", "--json")
    assert code == 0, err
    report = json.loads(out)
    backends = {b["name"]: b for b in report["backends"]}
    assert set(backends) == {"b", *ODD_BACKENDS}
    assert all(
        (backends[n]["waiting"], backends[n]["running"]) == (None, None) for n in ODD_BACKENDS
    )
    assert report["log_time"] == 1e300

    # The replay names them as escaped too (the log is empty: every field differs).
    code, out, err = await run(*base, "replay", "--verify")
    assert code == 1, err
    assert all(line.isprintable() for line in out.splitlines())
    assert "\\u202erev" in out


async def test_an_unexpected_error_is_one_line_and_exit_2(nats_url: str) -> None:
    """Whatever ``status`` or ``replay`` meets, it ends with 2 and one line on stderr."""
    script = (
        "import sys, renqueue.coordination as state\n"
        "def boom(*args, **kwargs):\n"
        "    raise {error}\n"
        "state.{name} = boom\n"
        "from renqueue.cli import main\n"
        "sys.exit(main(['--nats', sys.argv[1], *sys.argv[2:]]))\n"
    )
    for name, error, command in [
        ("read_status", "RuntimeError('boom\\nsecond line')", ["status"]),
        ("read_status", "OverflowError('timestamp out of range')", ["status", "--json"]),
        ("verify", "KeyError('x')", ["replay", "--verify"]),
    ]:
        code, out, err = await run("-c", script.format(name=name, error=error), nats_url, *command)
        assert code == 2, (command, out, err)
        assert "Traceback" not in err
        (line,) = (line for line in err.splitlines() if "unexpected error" in line)
        assert line.startswith(f"renqueue: {command[0]}: unexpected error: ")
        assert out == ""
    assert line == "renqueue: replay: unexpected error: KeyError: 'x'"


@pytest.mark.parametrize("interval", ["0.1", "0", "-1", "nan", "inf", "soon"])
async def test_a_watch_interval_under_a_fifth_of_a_second_is_refused(interval: str) -> None:
    code, out, err = await run("-m", "renqueue", "status", "--watch", "--interval", interval)
    assert code == 2
    assert "--interval" in err
    assert "at least 0.2" in err
    assert out == ""


async def test_status_watch_rides_out_a_server_restart(tmp_path: Path) -> None:
    """A redraw NATS cannot answer shows the error; the watch goes on until Ctrl-C
    (exit 130, whether NATS is there or not)."""
    store = tmp_path / "nats"
    server = EmbeddedServer(store, port=-1)
    await server.start()
    try:
        port = server.port
        config = odd_config(tmp_path, server.url)
        nc = await connect(server.url, name="provision")
        try:
            await provision(nc.jetstream(), load_config(config))
        finally:
            await nc.close()
        proc = await start_watch(config, "--json")
        stdout = proc.stdout
        assert stdout is not None
        try:
            first = json.loads(await asyncio.wait_for(stdout.readline(), 30))
            assert "backends" in first
            await server.close()  # the broker goes away, store intact ...

            async def next_report(key: str) -> dict[str, object]:
                while True:
                    line = await asyncio.wait_for(stdout.readline(), 30)
                    assert line, "the watch ended"
                    report: dict[str, object] = json.loads(line)
                    if key in report:
                        return report

            failed = await next_report("error")
            assert isinstance(failed["error"], str)
            assert failed["error"]
            server = EmbeddedServer(store, port=port)
            await server.start()  # ... and comes back on the same address
            again = await next_report("backends")
            assert again["at"] > failed["at"]  # type: ignore[operator]
            # Gone again: Ctrl-C while it cannot reach NATS still ends it as Ctrl-C.
            await server.close()
            await next_report("error")
        finally:
            await interrupt(proc)
    finally:
        await server.close()


def test_times_are_shown_in_the_local_time_zone_with_its_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """People read status, audit and the DLQ in their own time zone."""
    import time  # noqa: PLC0415

    from renqueue.text import clock  # noqa: PLC0415

    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        assert clock(0.0) == "1970-01-01T05:30:00+05:30"
        assert clock(float("nan")) == "-"
        assert clock(float("inf")) == "far future"
    finally:
        monkeypatch.undo()
        time.tzset()
