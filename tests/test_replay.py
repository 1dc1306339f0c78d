"""`renqueue replay --verify` (issue #8 item 7): the live projection, quota
included, against one rebuilt from the first event, field by field.

First :func:`renqueue.state.diff_states` on tables of states, then the command
as a user runs it (a subprocess) against a real server after a real workload:
equal, then the checkpoint and a view tampered with in KV, each named.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
from _waits import until
from test_cli import run

from renqueue import Client, RequestFailedError, Services, load_config
from renqueue.broker import EmbeddedServer, JetStream, KeyValue, connect
from renqueue.coordination import (
    PROGRESS_KEY,
    _verify,
    backend_view_key,
    decode_backend_view,
    decode_progress,
    encode_view,
    rebuild,
    verify,
)
from renqueue.coordination._verify import replay_log
from renqueue.errors import RenQueueError
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import Learned, Quota, SpendLog
from renqueue.policy._spend import Slot
from renqueue.state import (
    STATE_KEY,
    BackendState,
    Difference,
    InFlight,
    ProjectionState,
    TenantState,
    decode_state,
    diff_states,
    diff_values,
    encode_state,
)

T = 1_780_000_020.0
ABSENT = msgspec.UNSET

QUOTA = Quota(
    spend=SpendLog(slots=(Slot(T, 1.0, 1, 40), Slot(T + 1, 1.0, 2, 90)), newest=T + 1),
    cooldown_until=T + 30,
    learned={"requests/min": Learned(kind="requests", window=60.0, limit=30, remaining=28, at=T)},
)
BASE = ProjectionState(
    last_seq=40,
    events=38,
    log_time=T + 1,
    submitted=3,
    terminal={"completed": 2},
    spend=0.25,
    backends={
        "groq": BackendState(calls_started=3, calls_completed=2, spend=0.25, quota=QUOTA),
        "local": BackendState(calls_started=1, in_flight=1),
    },
    tenants={"t1": TenantState(submitted=3, spend=0.25, terminal={"completed": 2})},
    in_flight={"t1:r3": InFlight("local", T)},
)


def changed(state: ProjectionState, **fields: object) -> ProjectionState:
    return msgspec.structs.replace(state, **fields)


def backend(name: str, **fields: object) -> dict[str, BackendState]:
    return {**BASE.backends, name: msgspec.structs.replace(BASE.backends[name], **fields)}


def slots(*changed_slots: Slot) -> BackendState:
    quota = msgspec.structs.replace(
        QUOTA, spend=SpendLog(slots=changed_slots, newest=QUOTA.spend.newest)
    )
    return msgspec.structs.replace(BASE.backends["groq"], quota=quota)


@pytest.mark.parametrize(
    ("live", "rebuilt", "expected"),
    [
        pytest.param(BASE, BASE, [], id="equal"),
        pytest.param(
            changed(BASE, backends=backend("groq", calls_completed=3)),
            BASE,
            [Difference(path="backends.groq.calls_completed", live=3, rebuilt=2)],
            id="a-backend-counter",
        ),
        pytest.param(
            changed(
                BASE,
                backends={
                    **BASE.backends,
                    "groq": slots(Slot(T, 1.0, 1, 40), Slot(T + 1, 1.0, 2, 99)),
                },
            ),
            BASE,
            [Difference(path="backends.groq.quota.spend.slots[1].tokens", live=99, rebuilt=90)],
            id="a-quota-slot-by-field-name",
        ),
        pytest.param(
            changed(BASE, backends={**BASE.backends, "groq": slots(Slot(T, 1.0, 1, 40))}),
            BASE,
            [Difference(path="backends.groq.quota.spend.slots[1]", rebuilt=[T + 1, 1.0, 2, 90])],
            id="a-slot-only-the-rebuilt-state-has",
        ),
        pytest.param(
            changed(BASE, backends=backend("groq", quota=None)),
            BASE,
            [Difference(path="backends.groq.quota", live=None, rebuilt=msgspec.to_builtins(QUOTA))],
            id="no-quota-against-a-quota",
        ),
        pytest.param(
            changed(BASE, backends=backend("local", last_fault_at=T)),
            BASE,
            [Difference(path="backends.local.last_fault_at", live=T, rebuilt=None)],
            id="a-value-against-none",
        ),
        pytest.param(
            BASE,
            changed(BASE, backends={**BASE.backends, "new": BackendState(calls_started=1)}),
            [Difference(path="backends.new", rebuilt={"calls_started": 1})],
            id="a-backend-only-the-log-names",
        ),
        pytest.param(
            changed(BASE, tenants={**BASE.tenants, "t2": TenantState(submitted=1)}),
            BASE,
            [Difference(path="tenants.t2", live={"submitted": 1})],
            id="a-tenant-only-the-live-state-has",
        ),
        pytest.param(
            changed(BASE, terminal={"completed": 2, "failed": 1}, last_seq=41),
            BASE,
            [
                Difference(path="last_seq", live=41, rebuilt=40),
                Difference(path="terminal.failed", live=1),
            ],
            id="several-in-field-order",
        ),
        pytest.param(
            changed(BASE, in_flight={"t1:r.3": InFlight("local", T)}),
            BASE,
            [
                Difference(path='in_flight["t1:r.3"]', live=["local", T, 0]),
                Difference(path="in_flight.t1:r3", rebuilt=["local", T, 0]),
            ],
            id="a-key-with-a-dot-is-quoted",
        ),
        pytest.param(
            changed(BASE, in_flight={"t1:r3": InFlight("groq", T)}),
            BASE,
            [Difference(path="in_flight.t1:r3.backend", live="groq", rebuilt="local")],
            id="an-array-like-struct-by-field-name",
        ),
    ],
)
def test_diff_states(
    live: ProjectionState, rebuilt: ProjectionState, expected: list[Difference]
) -> None:
    assert diff_states(live, rebuilt) == expected


@pytest.mark.parametrize(
    ("live", "rebuilt", "expected"),
    [
        pytest.param(1, 1.0, [Difference(path="x", live=1, rebuilt=1.0)], id="int-is-not-float"),
        pytest.param([1, 2, 3], [1, 2], [Difference(path="x[2]", live=3)], id="a-longer-list"),
        pytest.param({"a": {"b": 1}}, {"a": {"b": 1}}, [], id="equal-nested"),
        pytest.param(
            {"a": {"b": 1}},
            {"a": {"b": 2}},
            [Difference(path="x.a.b", live=1, rebuilt=2)],
            id="nested",
        ),
    ],
)
def test_diff_values(live: object, rebuilt: object, expected: list[Difference]) -> None:
    assert diff_values(live, rebuilt, "x") == expected


def test_a_missing_side_is_left_out_of_the_json() -> None:
    (only,) = diff_states(BASE, changed(BASE, tenants={}))
    assert json.loads(msgspec.json.encode(only)) == {
        "path": "tenants.t1",
        "live": {"submitted": 3, "spend": 0.25, "terminal": {"completed": 2}},
    }


# ------------------------------------------------------------------ the command


def write_config(tmp_path: Path, url: str, free: str, paid: str, broken: str) -> Path:
    file = tmp_path / "renqueue.toml"
    file.write_text(
        f'[nats]\nurl = "{url}"\n'
        '[router]\ncapacity_refresh = "20ms"\n'
        '[worker]\nmax_deliver = 2\nretry_delay = "50ms"\ndrain_timeout = "500ms"\n'
        f'[backends.free]\nbase_url = "{free}"\nmodel = "m"\n'
        '[backends.free.limits]\nconcurrency = 8\nrequests = ["100/min"]\n'
        'tokens = ["50000/min"]\n'
        f'[backends.paid]\nbase_url = "{paid}"\nmodel = "m"\n'
        "cost_input_per_mtok = 1000.0\ncost_output_per_mtok = 2000.0\n"
        f'[backends.broken]\nbase_url = "{broken}"\nmodel = "m"\n'
        '[routes.free]\nbackends = ["free"]\n'
        '[routes.paid]\nbackends = ["paid"]\n'
        '[routes.broken]\nbackends = ["broken"]\nfallback = { on = [] }\n'
    )
    return file


async def replay(config: Path, *args: str) -> tuple[int, str, str]:
    return await run("-m", "renqueue", "-c", str(config), "replay", *args)


async def views_at_checkpoint(kv: KeyValue) -> bool:
    checkpoint = decode_state((await kv.get(STATE_KEY)).value)
    return decode_progress((await kv.get(PROGRESS_KEY)).value).last_seq == checkpoint.last_seq


async def test_replay_verify_finds_the_live_projection_equal_then_names_what_was_tampered(
    tmp_path: Path, isolated_server: EmbeddedServer
) -> None:
    async with (
        MockBackend(MockSettings(output_tokens=3, rpm=1000, tpm=1_000_000)) as free,
        MockBackend(MockSettings(output_tokens=5)) as paid,
        MockBackend(MockSettings(failure_rate=1.0, failure_status=500)) as broken,
    ):
        config = write_config(tmp_path, isolated_server.url, free.url, paid.url, broken.url)
        async with (
            Services(load_config(config)) as services,
            Client(services.nc, tenant="t1") as t1,
            Client(services.nc, tenant="t2") as t2,
        ):
            handles = [await t1.submit(f"f{n}", route="free") for n in range(4)]
            handles += [await t2.submit(f"p{n}", route="paid") for n in range(3)]
            await asyncio.gather(*(h.result(timeout=30) for h in handles))
            doomed = await t2.submit("never", route="broken")
            with pytest.raises(RequestFailedError):
                await doomed.result(timeout=30)
            assert services.projector is not None
            live = await services.projector.sync()
            kv = await services.js.key_value("rq-state")
            await until(lambda: views_at_checkpoint(kv), "the views are at the checkpoint")

            code, out, err = await replay(config, "--verify")
            assert code == 0, (out, err)
            assert out.splitlines() == [
                f"equal ({live.events} events, last_seq {live.last_seq})",
                "views: 3 backend views compared",
            ]
        # What the workload folded: quota on the limited backend (declared and
        # learned), a failed backend, spend on the paid one.
        free_quota = live.backend("free").quota
        assert free_quota is not None
        assert free_quota.spend.slots
        assert free_quota.learned
        assert live.backend("broken").calls_failed == 2
        assert live.backend("broken").consecutive_failures == 2
        assert live.backend("paid").spend > 0

        nc = await connect(isolated_server.url, name="tamper")
        try:
            kv = await nc.jetstream().key_value("rq-state")
            await tamper_and_verify(config, kv, live)
        finally:
            await nc.close()


async def tamper_and_verify(config: Path, kv: KeyValue, live: ProjectionState) -> None:
    original = (await kv.get(STATE_KEY)).value
    assert decode_state(original) == live

    code, out, _ = await replay(config, "--json")
    assert code == 0
    assert decode_state(out.strip().encode()) == live
    code, out, _ = await replay(config)
    assert code == 0
    assert out.splitlines()[0].startswith(
        f"Replayed {live.events} events (last_seq {live.last_seq}"
    )

    # The checkpoint: one counter and one quota slot changed, last_seq kept.
    free = live.backend("free")
    assert free.quota is not None
    first = free.quota.spend.slots[0]
    tampered_free = msgspec.structs.replace(
        free,
        calls_completed=free.calls_completed + 1,
        quota=msgspec.structs.replace(
            free.quota,
            spend=msgspec.structs.replace(
                free.quota.spend,
                slots=(
                    Slot(first.start, first.length, first.requests, first.tokens + 7),
                    *free.quota.spend.slots[1:],
                ),
            ),
        ),
    )
    tampered = msgspec.structs.replace(live, backends={**live.backends, "free": tampered_free})
    await kv.put(STATE_KEY, encode_state(tampered))
    code, out, _ = await replay(config, "--verify")
    assert code == 1, out
    lines = out.splitlines()
    assert lines[0].startswith("different: 2 field(s) differ from the log replayed")
    assert any(
        line.split()
        == [
            "backends.free.calls_completed",
            str(free.calls_completed + 1),
            str(free.calls_completed),
        ]
        for line in lines
    ), out
    assert any(
        line.split()
        == ["backends.free.quota.spend.slots[0].tokens", str(first.tokens + 7), str(first.tokens)]
        for line in lines
    ), out

    # A backend view: reported under its key, beside the checkpoint's.
    paid_key = backend_view_key("paid")
    view = decode_backend_view((await kv.get(paid_key)).value)
    await kv.put(
        paid_key,
        encode_view(
            msgspec.structs.replace(
                view, backend=msgspec.structs.replace(view.backend, calls_failed=9)
            )
        ),
    )
    code, out, _ = await replay(config, "--verify", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["equal"] is False
    assert report["views_compared"] is True
    assert {d["path"]: (d.get("live"), d.get("rebuilt")) for d in report["differences"]} == {
        "backends.free.calls_completed": (free.calls_completed + 1, free.calls_completed),
        "backends.free.quota.spend.slots[0].tokens": (first.tokens + 7, first.tokens),
        "view.backend.paid.calls_failed": (9, 0),
    }

    # Restored, but the views behind the checkpoint: the checkpoint alone is compared.
    await kv.put(STATE_KEY, original)
    await kv.put(paid_key, encode_view(view))
    behind = live.last_seq - 1
    progress = decode_progress((await kv.get(PROGRESS_KEY)).value)
    await kv.put(PROGRESS_KEY, encode_view(msgspec.structs.replace(progress, last_seq=behind)))
    code, out, _ = await replay(config, "--verify")
    assert code == 0, out
    assert (
        out.splitlines()[1]
        == f"views not compared: progress {behind} behind checkpoint {live.last_seq}"
    )

    # No checkpoint at all: it cannot be read.
    await kv.delete(STATE_KEY)
    code, out, err = await replay(config, "--verify")
    assert code == 2
    assert "no projection is stored" in err


async def test_replay_verify_says_it_cannot_verify_a_log_cut_short(
    tmp_path: Path, isolated_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A comparison with a partial replay is not a difference: exit 2 and why."""
    async with (
        MockBackend(MockSettings(output_tokens=3)) as free,
        MockBackend(MockSettings(output_tokens=5)) as paid,
    ):
        config = write_config(tmp_path, isolated_server.url, free.url, paid.url, "http://x/v1")
        async with (
            Services(load_config(config)) as services,
            Client(services.nc, tenant="t1") as t1,
            Client(services.nc, tenant="t2") as t2,
        ):
            handles = [await t1.submit(f"f{n}", route="free") for n in range(3)]
            handles += [await t2.submit(f"p{n}", route="paid") for n in range(2)]
            await asyncio.gather(*(h.result(timeout=30) for h in handles))
            assert services.projector is not None
            live = await services.projector.sync()
            kv = await services.js.key_value("rq-state")
            await until(lambda: views_at_checkpoint(kv), "the views are at the checkpoint")

    last = live.last_seq
    nc = await connect(isolated_server.url, name="cut")
    try:
        js = nc.jetstream()
        kv = await js.key_value("rq-state")
        assert (await verify(js)).equal

        # A replay that stops short: rebuild gives up when no event comes for
        # 2 s (a server too slow to answer), here two events before the end.
        whole = rebuild

        async def slow_server(js: JetStream, *, upto: int | None = None) -> ProjectionState:
            return await whole(js, upto=(last if upto is None else upto) - 2)

        monkeypatch.setattr(_verify, "rebuild", slow_server)
        stopped = f"^replay stopped at {last - 2} of {last}"
        with pytest.raises(RenQueueError, match=f"{stopped}: cannot verify \\(no event came"):
            await verify(js)
        with pytest.raises(RenQueueError, match=f"{stopped} \\(no event came"):
            await replay_log(js)
        monkeypatch.setattr(_verify, "rebuild", whole)

        # A checkpoint past the log's end (the events stream made again since).
        original = (await kv.get(STATE_KEY)).value
        await kv.put(STATE_KEY, encode_state(msgspec.structs.replace(live, last_seq=last + 5)))
        code, out, err = await replay(config, "--verify")
        assert (code, out) == (2, ""), err
        assert f"the log no longer holds events 1..{last + 5}: cannot verify" in err
        assert f"RQ_EVENTS ends at sequence {last}" in err
        await kv.put(STATE_KEY, original)

        # One tenant's events purged: the log still starts at 1, with holes.
        await js.context.purge_stream("RQ_EVENTS", subject="rq.evt.t2.>")
        holes = (await js.stream_info("RQ_EVENTS")).state
        assert (holes.first_seq, holes.last_seq) == (1, last)
        code, out, err = await replay(config, "--verify", "--json")
        assert (code, out) == (2, ""), err
        assert f"the log no longer holds events 1..{last}: cannot verify (" in err
        assert f"({holes.num_deleted} of them were purged)" in err

        # Events gone from the front (max_age, or a purge): it starts later.
        await js.context.purge_stream("RQ_EVENTS", keep=3)
        first = (await js.stream_info("RQ_EVENTS")).state.first_seq
        assert first > 1
        code, out, err = await replay(config, "--verify")
        assert (code, out) == (2, ""), err
        assert (
            f"the log no longer holds events 1..{last}: cannot verify"
            f" (RQ_EVENTS now starts at sequence {first}:"
        ) in err
        assert "Traceback" not in err

        # A plain replay folds what is left, and says where it starts.
        code, out, err = await replay(config)
        assert code == 0, err
        assert f"  not in this replay: it starts at sequence {first} (those before" in out
    finally:
        await nc.close()
