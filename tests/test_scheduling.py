"""Aging: pure rules, then the bound under sustained urgent load end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from _waits import until

from renqueue import Client, Config, ConfigError, RequestExpiredError, Services, parse_config
from renqueue.broker import EventLog
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import LevelPolicy, aging_bound, effective_rank, hopeless, pick_key, promotions
from renqueue.schema import (
    SYSTEM_TENANT,
    Coalesced,
    Dispatch,
    GenerationParams,
    Preempted,
    Probed,
    Promoted,
    Routed,
    Started,
    Stolen,
    Tool,
    dispatch_subject,
    encode,
    msg_id,
)

POLICIES = [
    LevelPolicy(name="critical", rank=0),
    LevelPolicy(name="high", rank=1, age_after=10),
    LevelPolicy(name="normal", rank=2, age_after=20),
    LevelPolicy(name="low", rank=3, age_after=30, promote_to=1),
    LevelPolicy(name="batch", rank=4, age_after=None),
]


def one_backend(tmp_path: Path, url: str, *, slots: int = 4) -> Config:
    """One backend ``one`` at ``url`` with ``slots`` slots, behind the route ``chat``."""
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {"one": {"base_url": url, "model": "m", "limits": {"concurrency": slots}}},
            "routes": {"chat": {"backends": ["one"]}},
        }
    )


def test_a_request_climbs_one_level_per_age_after() -> None:
    assert effective_rank(2, 19.9, POLICIES) == 2
    assert effective_rank(2, 20, POLICIES) == 1
    assert effective_rank(2, 29.9, POLICIES) == 1
    assert effective_rank(2, 30, POLICIES) == 0
    assert promotions(2, 1000, POLICIES) == [(1, 20), (0, 30)]


def test_promote_to_can_skip_levels_and_a_level_without_aging_stays() -> None:
    assert promotions(3, 45, POLICIES) == [(1, 30), (0, 40)]
    assert effective_rank(4, 1e9, POLICIES) == 4
    assert aging_bound(4, POLICIES) is None
    assert aging_bound(3, POLICIES) == 40
    assert aging_bound(0, POLICIES) == 0


def test_pick_order_is_effective_level_then_age() -> None:
    now = 100.0
    fresh_critical = pick_key(0, 99.0, now, POLICIES)
    old_normal = pick_key(2, 60.0, now, POLICIES)  # waited 40 s: now at critical
    fresh_high = pick_key(1, 99.5, now, POLICIES)
    assert sorted([fresh_high, fresh_critical, old_normal]) == [
        old_normal,
        fresh_critical,
        fresh_high,
    ]


def test_a_child_competes_at_its_parents_effective_rank_never_below_its_own() -> None:
    now = 100.0
    assert pick_key(4, 99.0, now, POLICIES, parent=(1, 95.0)) == (1, 99.0)
    # The parent has aged to critical: so does the child.
    assert pick_key(4, 99.0, now, POLICIES, parent=(1, 80.0)) == (0, 99.0)
    # A less urgent parent does not demote the child.
    assert pick_key(1, 99.0, now, POLICIES, parent=(4, 0.0)) == (1, 99.0)


def test_default_levels_age_to_the_top_and_low_levels_are_preemptible() -> None:
    policies = parse_config({}).level_policies()
    assert [aging_bound(p.rank, policies) for p in policies] == [0, 30, 90, 210, 510]
    assert [p.name for p in policies if p.preemptible] == ["low", "batch"]
    assert [p.name for p in policies if p.preempts] == ["critical"]


@pytest.mark.parametrize(
    ("levels", "path"),
    [
        ({"urgent": {}}, "$.levels.urgent"),
        ({"normal": {"promote_to": "batch"}}, "$.levels.normal.promote_to"),
        ({"normal": {"age_after": "soon"}}, "$.levels.normal.age_after"),
    ],
)
def test_bad_level_settings_name_the_field(levels: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"levels": levels})
    assert info.value.path == path


@pytest.mark.timeout(240)  # a bound for a lost request (see the waits below)
async def test_batch_request_starts_within_its_aging_bound_under_urgent_load(
    tmp_path: Path,
) -> None:
    age = 0.25  # per level: batch competes at critical after 4 x 0.25 s
    async with MockBackend(MockSettings(ttft=0.08, output_tokens=2)) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "levels": {
                    name: {"age_after": f"{int(age * 1000)}ms"}
                    for name in ("high", "normal", "low", "batch")
                },
                "backends": {
                    "one": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 1}}
                },
                "routes": {"chat": {"backends": ["one"]}},
                # The lone router's lease outlasts a starved renewal (under load
                # it lapsed at 1 s again and again, and the router stood by):
                # the lease is not what this test is about.
                "router": {"capacity_refresh": "10ms", "lease_ttl": "10s"},
            }
        )
        bound = 4 * age
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            # Urgent work already waiting, then the batch request, then more
            # urgent work arriving faster than the one slot serves it (every
            # 25 ms, 80 ms each): without aging the batch request never runs.
            earlier = [
                await client.submit("first", route="chat", priority="critical") for _ in range(5)
            ]
            batch = await client.submit("patient", route="chat", priority="batch")
            urgent = []
            for _ in range(60):
                urgent.append(await client.submit("now", route="chat", priority="critical"))
                await asyncio.sleep(0.025)
            # Bounds for a lost request, not timings: 66 calls through one slot
            # take a loaded machine well over half a minute.
            await batch.result(timeout=90)
            await asyncio.gather(*(h.result(timeout=90) for h in [*earlier, *urgent]))
            events = await EventLog(client.js).history("t", batch.id)
            # The urgent work submitted after the batch request (the earlier
            # five are older: once it is critical they still go first, and on
            # a loaded machine some are still waiting when it gets there).
            urgent_starts = []
            for handle in urgent:
                history = await EventLog(client.js).history("t", handle.id)
                urgent_starts += [e.at for e in history if isinstance(e, Started)]

    [started] = [e for e in events if isinstance(e, Started)]
    promoted = [e for e in events if isinstance(e, Promoted)]
    submitted_at = events[0].at
    assert [(p.from_level, p.to_level) for p in promoted] == [
        ("batch", "low"),
        ("low", "normal"),
        ("normal", "high"),
        ("high", "critical"),
    ]
    # It ran once it had aged to the top (not before: the slot was never
    # free of urgent work), and then ahead of every urgent request submitted
    # after it: at most the call in service and one already handed to the
    # worker of those started between its promotion to critical and its own
    # start (counted in events, not seconds: a loaded machine stretches the
    # seconds, not the order), while the rest were still waiting.
    assert started.at - submitted_at >= bound - 0.05
    to_critical = promoted[-1].at
    overtook = sum(1 for at in urgent_starts if to_critical < at < started.at)
    assert overtook <= 2, (overtook, sorted(at - to_critical for at in urgent_starts))
    assert sum(1 for at in urgent_starts if at > started.at) >= 10


async def test_effective_priority_is_passed_to_backends_that_ask_for_it(tmp_path: Path) -> None:
    async with MockBackend() as vllm, MockBackend() as other:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    "vllm": {"base_url": vllm.url, "model": "m", "send_priority": True},
                    "other": {"base_url": other.url, "model": "m"},
                },
                "routes": {"a": {"backends": ["vllm"]}, "b": {"backends": ["other"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            await (await client.submit("x", route="a", priority="low")).result(timeout=10)
            await (await client.submit("x", route="b", priority="low")).result(timeout=10)
        sent = vllm.stats().last_request
        plain = other.stats().last_request
    assert sent is not None
    assert sent["priority"] == 3  # "low" is rank 3 and had no time to age
    assert plain is not None
    assert "priority" not in plain


async def test_a_child_never_runs_below_its_parents_priority(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(ttft=0.3, output_tokens=2)) as mock:
        config = one_backend(tmp_path, mock.url, slots=1)
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            parent = await client.submit("plan the work", route="chat", priority="high")
            await parent.result(timeout=10)
            blocker = await client.submit("hold the slot", route="chat", priority="critical")
            await asyncio.sleep(0.1)
            older = await client.submit("older batch", route="chat", priority="batch")
            child = await client.submit(
                "a step of the plan", route="chat", priority="batch", parent_id=parent.id
            )
            orphan = await client.submit(
                "unknown parent", route="chat", priority="batch", parent_id="no-such-parent"
            )
            for handle in (blocker, older, child, orphan):
                await handle.result(timeout=20)
            starts = {}
            for name, handle in (("older", older), ("child", child), ("orphan", orphan)):
                history = await EventLog(client.js).history("t", handle.id)
                starts[name] = next(e.at for e in history if isinstance(e, Started))
                if name == "child":
                    inherited = [e for e in history if isinstance(e, Promoted)]
    # The child inherits "high" and overtakes the older batch request; a request
    # naming an unknown parent keeps its own level.
    assert starts["child"] < starts["older"] < starts["orphan"]
    assert [(e.from_level, e.to_level) for e in inherited] == [("batch", "high")]
    assert inherited[0].reason == f"inherited from parent {parent.id}"


async def test_critical_request_preempts_running_batch_work(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(tokens_per_second=25, output_tokens=40)) as mock:
        config = one_backend(tmp_path, mock.url, slots=1)
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            batch = await client.submit("a long batch job", route="chat", priority="batch")
            stream = batch.stream(timeout=20)
            first = [await anext(stream) for _ in range(3)]  # it is generating
            urgent = await client.submit("now!", route="chat", priority="critical")
            urgent_result = await urgent.result(timeout=20)
            batch_result = await batch.result(timeout=30)
            rest = [chunk async for chunk in stream]
            batch_events = await EventLog(client.js).history("t", batch.id)
            urgent_events = await EventLog(client.js).history("t", urgent.id)

    preempted = [e for e in batch_events if isinstance(e, Preempted)]
    assert [p.by for p in preempted] == [urgent.id]
    runs = [e for e in batch_events if isinstance(e, Started)]
    assert len(runs) == 2
    # The urgent request ran between the batch request's two runs.
    [urgent_start] = [e.at for e in urgent_events if isinstance(e, Started)]
    assert runs[0].at < preempted[0].at <= urgent_start < runs[1].at
    assert urgent_result.usage.completion_tokens == 40
    # The subscriber saw an explicit restart, then the whole answer again.
    assert first[0].delivery == 1
    restarted = [c for c in rest if c.restart]
    assert len(restarted) == 1
    second_run = rest[rest.index(restarted[0]) :]
    assert "".join(c.text for c in second_run) == batch_result.text
    # It kept its original submit time (its aging credit): the second
    # routing measures its wait from the first submit, not from the requeue.
    submitted = batch_events[0]
    routed = [e for e in batch_events if isinstance(e, Routed)]
    assert [e.attempt for e in routed] == [1, 2]
    assert routed[1].queue_wait == pytest.approx(routed[1].at - submitted.at, abs=0.05)


def test_hopeless_only_when_every_candidate_is_known_to_be_too_slow() -> None:
    assert hopeless(10.0, 9.0, [2.0, 3.0]) == 11.0
    assert hopeless(10.0, 9.0, [0.5, 3.0]) is None
    assert hopeless(10.0, 9.0, [2.0, None]) is None  # unknown: might make it
    assert hopeless(10.0, 9.0, []) is None


async def test_a_request_that_cannot_meet_its_deadline_is_told_before_any_call(
    tmp_path: Path,
) -> None:
    async with MockBackend(MockSettings(ttft=0.8, output_tokens=2)) as mock:
        config = one_backend(tmp_path, mock.url, slots=8)
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            warm = [await client.submit("warm up", route="chat") for _ in range(5)]
            await asyncio.gather(*(h.result(timeout=10) for h in warm))
            assert services.projector is not None
            await asyncio.wait_for(services.projector.sync(), 10)
            await asyncio.sleep(0.3)  # routers' state view follows the KV bucket
            served = mock.stats().requests
            # Calls here take ~0.8 s: a 0.6 s deadline is hopeless, and the
            # client hears so well before the deadline itself.
            doomed = await client.submit("too tight", route="chat", timeout=0.6)
            with pytest.raises(RequestExpiredError, match="cannot meet the deadline"):
                await doomed.result(timeout=0.4)
            fine = await client.submit("enough time", route="chat", timeout=5.0)
            await fine.result(timeout=10)
    assert mock.stats().requests == served + 1


async def test_an_idle_replica_steals_work_queued_on_a_busy_sibling(tmp_path: Path) -> None:
    async with (
        MockBackend(MockSettings(ttft=1.5, output_tokens=2)) as slow,
        MockBackend(MockSettings(output_tokens=2)) as fast,
    ):
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    name: {
                        "base_url": mock.url,
                        "model": "m",
                        "pool": "llama-8b",
                        "limits": {"concurrency": 1},
                    }
                    for name, mock in (("replica-a", slow), ("replica-b", fast))
                },
                "routes": {"chat": {"backends": ["replica-a", "replica-b"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            # Work already bound to replica-a (as several routers over-filling
            # it would leave it): its one slot is busy, four wait on its subject.
            handles = []
            for index in range(5):
                request = client.build_request(f"job {index}", route="chat")
                await client.js.publish(
                    dispatch_subject("replica-a"),
                    encode(Dispatch(request=request, backend="replica-a")),
                    headers={"Nats-Msg-Id": msg_id("t", request.id, "dispatch", 1)},
                )
                handles.append(client.handle(request.id))
            results = [await h.result(timeout=20) for h in handles]
            stolen = []
            for handle in handles:
                history = await EventLog(client.js).history("t", handle.id)
                stolen += [e for e in history if isinstance(e, Stolen)]
    by_backend = [r.backend for r in results]
    assert by_backend.count("replica-b") >= 3
    assert len(stolen) == by_backend.count("replica-b")
    assert {(e.from_backend, e.to_backend) for e in stolen} == {("replica-a", "replica-b")}
    assert slow.stats().requests + fast.stats().requests == 5


async def test_a_replica_without_a_feature_steals_no_request_that_needs_it(
    tmp_path: Path,
) -> None:
    """A pool's replicas may differ in what they can do (a text-only build):
    requests with tools queued on the replica that has them stay there."""
    async with (
        MockBackend(MockSettings(ttft=0.3, output_tokens=2)) as slow,
        MockBackend(MockSettings(output_tokens=2)) as fast,
    ):
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    "replica-a": {
                        "base_url": slow.url,
                        "model": "m",
                        "pool": "llama-8b",
                        "limits": {"concurrency": 1},
                    },
                    "replica-b": {
                        "base_url": fast.url,
                        "model": "m",
                        "pool": "llama-8b",
                        "limits": {"concurrency": 1},
                        "features": [],
                    },
                },
                "routes": {"chat": {"backends": ["replica-a", "replica-b"]}},
            }
        )
        tools = GenerationParams(tools=(Tool(name="lookup", parameters={"type": "object"}),))
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            handles = []
            for index in range(4):
                request = client.build_request(f"job {index}", route="chat", params=tools)
                await client.js.publish(
                    dispatch_subject("replica-a"),
                    encode(Dispatch(request=request, backend="replica-a")),
                    headers={"Nats-Msg-Id": msg_id("t", request.id, "dispatch", 1)},
                )
                handles.append(client.handle(request.id))
            results = [await h.result(timeout=20) for h in handles]
    assert [r.backend for r in results] == ["replica-a"] * 4
    assert fast.stats().requests == 0


async def test_identical_requests_share_one_backend_call(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(ttft=0.3, output_tokens=6)) as mock:
        config = one_backend(tmp_path, mock.url)
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            same = [
                await client.submit("same question", route="chat", coalesce=True) for _ in range(3)
            ]
            keyed = [
                await client.submit(text, route="chat", dedupe_key="report-42")
                for text in ("phrased one way", "phrased another way")
            ]
            alone = await client.submit("same question", route="chat")  # did not ask
            results = [await h.result(timeout=10) for h in [*same, *keyed, alone]]
            streamed = [
                "".join([c.text async for c in h.stream(timeout=10)]) for h in [*same, *keyed]
            ]
            coalesced = []
            for handle in [*same, *keyed]:
                history = await EventLog(client.js).history("t", handle.id)
                coalesced += [e for e in history if isinstance(e, Coalesced)]
    # Three backend calls in all: the coalesced group, the keyed group, the loner.
    assert mock.stats().requests == 3
    assert len({r.text for r in results[:3]}) == 1
    assert results[3].text == results[4].text
    assert streamed == [r.text for r in results[:5]]
    leaders = {same[0].id, keyed[0].id}
    assert {e.leader for e in coalesced} == leaders
    assert len(coalesced) == 3
    shared = [r for r in results[:5] if r.request_id not in leaders]
    assert all(r.cost == 0.0 for r in shared)


async def test_a_shared_call_runs_at_the_most_urgent_waiters_level(tmp_path: Path) -> None:
    async with MockBackend(MockSettings(ttft=0.3, output_tokens=2)) as mock:
        config = one_backend(tmp_path, mock.url, slots=1)
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            blocker = await client.submit("hold the slot", route="chat", priority="critical")
            await asyncio.sleep(0.1)
            leader = await client.submit("q", route="chat", priority="batch", coalesce=True)
            other = await client.submit("older normal work", route="chat", priority="normal")
            await asyncio.sleep(0.05)
            follower = await client.submit("q", route="chat", priority="high", coalesce=True)
            for handle in (blocker, leader, other, follower):
                await handle.result(timeout=10)
            starts = {}
            for name, handle in (("leader", leader), ("other", other)):
                history = await EventLog(client.js).history("t", handle.id)
                starts[name] = next(e.at for e in history if isinstance(e, Started))
    # The batch leader ran before the normal request: its follower is "high".
    assert starts["leader"] < starts["other"]
    assert mock.stats().requests == 3


async def test_a_replica_that_looks_down_steals_nothing_from_its_busy_sibling(
    tmp_path: Path,
) -> None:
    """replica-b is down (its health probe says so): its slots are free only
    because nothing can run there, so it takes none of replica-a's queued work
    (before, it stole it and every stolen request failed there first)."""
    async with (
        MockBackend(MockSettings(ttft=0.2, output_tokens=2)) as slow,
        MockBackend(MockSettings(output_tokens=2, down=True)) as down,
    ):
        probe = {"path": "/health", "interval": "100ms", "timeout": "500ms"}
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {
                    "replica-a": {
                        "base_url": slow.url,
                        "model": "m",
                        "pool": "llama-8b",
                        "limits": {"concurrency": 1},
                    },
                    "replica-b": {
                        "base_url": down.url,
                        "model": "m",
                        "pool": "llama-8b",
                        "limits": {"concurrency": 1},
                        "probe": probe,
                    },
                },
                "routes": {"chat": {"backends": ["replica-a", "replica-b"]}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            log = EventLog(client.js)

            async def probed_down() -> bool:
                answers = [
                    e.ok for e in await log.history(SYSTEM_TENANT, "replica-b")
                    if isinstance(e, Probed)
                ]  # fmt: skip
                return answers[-1:] == [False]

            await until(probed_down, "replica-b's probe found it down")
            handles = []
            for index in range(4):
                request = client.build_request(f"job {index}", route="chat")
                await client.js.publish(
                    dispatch_subject("replica-a"),
                    encode(Dispatch(request=request, backend="replica-a")),
                    headers={"Nats-Msg-Id": msg_id("t", request.id, "dispatch", 1)},
                )
                handles.append(client.handle(request.id))
            results = [await h.result(timeout=20) for h in handles]
            stolen = [
                e
                for handle in handles
                for e in await log.history("t", handle.id)
                if isinstance(e, Stolen)
            ]
    assert stolen == []
    assert [r.backend for r in results] == ["replica-a"] * 4
