"""Tenant budgets per UTC day (issue #10): soft keeps a tenant past its budget
on free and local backends, hard refuses its new requests until 00:00 UTC;
both judged against the projected spend, per tenant and never for another.

The planner's rule as tables; the config; then end to end against a real
nats-server and mock backends, across a restart of the services (the spend is
the log's, not a process's).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_fallback import config_for
from test_quota_exhausted import describe
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config, parse_config
from renqueue.errors import BudgetExhaustedError, ConfigError, RequestRejectedError
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import (
    BackendView,
    Bind,
    Budget,
    Expire,
    LevelPolicy,
    PlanPolicy,
    Refuse,
    RouteRules,
    Wait,
    Waiting,
    budget_exhausted,
    budget_of,
    day_ends,
    estimated_cost,
    over_budget,
    plan,
    refused,
)
from renqueue.schema import (
    ChatMessage,
    Completed,
    Failed,
    GenerationParams,
    InferenceRequest,
    Routed,
    Usage,
)
from renqueue.state import ProjectionState, fold_many, utc_day

NOW = 1_000_000.0
PRICES = {"cost_input_per_mtok": 2.5, "cost_output_per_mtok": 10.0}


def request(tenant: str = "acme", **fields: Any) -> InferenceRequest:
    return InferenceRequest(
        id=fields.pop("id", "r1"),
        tenant=tenant,
        route="chat",
        messages=[ChatMessage(role="user", content="x" * 400)],  # ~100 tokens
        params=GenerationParams(max_tokens=100),
        **fields,
    )


def round_with(budgets: dict[str, Budget], spent: dict[str, float], **fields: Any) -> Any:
    """The one action (bind, wait or expire) of a round holding one request."""
    views = {
        "paid": BackendView(name="paid", capacity=4, in_flight=0, **PRICES),
        "local": BackendView(name="local", capacity=4, in_flight=0),
    }
    policy = PlanPolicy(
        levels=(LevelPolicy(name="normal", rank=0),),
        routes={"chat": ("paid", "local")},
        # The cascade prefers the paid one: only the budget moves it.
        rules={"chat": RouteRules(strategy="cascade")},
        budgets=budgets,
    )
    item = Waiting(ref=1, request=request(**fields), rank=0, submitted=NOW)
    [action] = [
        a for a in plan([item], views, NOW, policy, spent) if isinstance(a, Bind | Wait | Expire)
    ]
    return action


# A call here is estimated at ~104 tokens in x $2.5 + 100 out x $10 per million: ~$0.00126.
@pytest.mark.parametrize(
    ("budgets", "spent", "tenant", "backend"),
    [
        pytest.param({}, {}, "acme", "paid", id="no budget: the route as it is"),
        pytest.param({"acme": Budget(daily=1.0)}, {"acme": 0.5}, "acme", "paid", id="within"),
        pytest.param(
            {"acme": Budget(daily=1.0)},
            {"acme": 0.9995},
            "acme",
            "local",
            id="this call would pass it",
        ),
        pytest.param({"acme": Budget(daily=1.0)}, {"acme": 1.5}, "acme", "local", id="past it"),
        pytest.param(
            {"acme": Budget(daily=1.0)},
            {"acme": 1.5},
            "other",
            "paid",
            id="another tenant's budget",
        ),
        pytest.param({"*": Budget(daily=0.0)}, {}, "anyone", "local", id="every tenant: $0 a day"),
        pytest.param(
            {"*": Budget(daily=0.0), "vip": Budget(daily=10.0)},
            {},
            "vip",
            "paid",
            id="named beats *",
        ),
    ],
)
def test_a_budget_keeps_a_tenant_on_free_backends_once_a_paid_call_would_pass_it(
    budgets: dict[str, Budget], spent: dict[str, float], tenant: str, backend: str
) -> None:
    action = round_with(budgets, spent, tenant=tenant)
    assert isinstance(action, Bind)
    assert action.backend == backend
    if backend == "local":
        assert "tenant budget" in action.reason
        assert "not paid" in action.reason


def test_a_request_the_budget_leaves_no_candidate_is_refused_not_held() -> None:
    """Before: held until midnight (or its deadline), taking a place in its
    level's hold that every tenant's requests need."""
    only_paid = PlanPolicy(
        levels=(LevelPolicy(name="normal", rank=0),),
        routes={"chat": ("paid",)},
        budgets={"acme": Budget(daily=0.001)},
    )
    views = {"paid": BackendView(name="paid", capacity=4, in_flight=0, **PRICES)}
    for fields in ({}, {"deadline": NOW + 5}):
        item = Waiting(ref=1, request=request(**fields), rank=0, submitted=NOW)
        [refuse] = [a for a in plan([item], views, NOW, only_paid, {}) if isinstance(a, Refuse)]
        assert refuse.reason == "tenant budget $0.0000 of $0.0010 spent today: not paid"
        assert (refuse.daily, refuse.spent) == (0.001, 0.0)
    # Another tenant's request on the same route is bound.
    other = Waiting(ref=2, request=request(tenant="globex"), rank=0, submitted=NOW)
    [bind] = [a for a in plan([other], views, NOW, only_paid, {}) if isinstance(a, Bind)]
    assert bind.backend == "paid"


def test_a_soft_budget_refusal_says_what_is_left_and_what_the_request_would_cost() -> None:
    """Before: "spent $0.61605 of its hard daily budget of $1; new requests are
    refused" for a soft budget with $0.38 left and a request that did not fit."""
    paid = BackendView(name="paid", capacity=4, in_flight=0, **PRICES)
    big = msgspec.structs.replace(
        request(), params=GenerationParams(max_tokens=50_000)
    )  # ~$0.50 at $10/M out
    cost = estimated_cost(big, paid)
    assert cost > 1.0 - 0.61605
    error = over_budget(big, [paid], Budget(daily=1.0), 0.61605, NOW)
    assert error is not None
    assert (error.mode, error.cost, error.spent, error.daily) == ("soft", cost, 0.61605, 1.0)
    message = str(error)
    assert "hard" not in message
    assert "has $0.38 left of its soft daily budget of $1.00 ($0.62 spent today)" in message
    assert f"would cost up to ${cost:,.2f} on the cheapest backend of its route (all paid)" in (
        message
    )
    assert "max_tokens" in message
    # One that fits what is left is taken; a spent hard budget says so.
    assert over_budget(request(), [paid], Budget(daily=1.0), 0.61605, NOW) is None
    spent = over_budget(request(), [paid], Budget(daily=1.0, mode="hard"), 1.2, NOW)
    assert spent is not None
    assert spent.cost is None
    assert "spent $1.20 of its hard daily budget of $1.00; new requests are refused" in str(spent)


def test_the_documented_soft_budget_refusal_is_what_the_error_says() -> None:
    midnight = datetime.datetime(2026, 5, 29, tzinfo=datetime.UTC).timestamp()
    error = BudgetExhaustedError("acme", 1.0, 0.62, midnight, mode="soft", cost=0.5)
    docs = (Path(__file__).parents[1] / "docs" / "routing.md").read_text()
    assert f"`{error}`" in " ".join(docs.split())


def test_a_round_refusal_carries_the_budget_mode_and_the_cost() -> None:
    only_paid = PlanPolicy(
        levels=(LevelPolicy(name="normal", rank=0),),
        routes={"chat": ("paid",)},
        budgets={"acme": Budget(daily=1.0)},
    )
    paid = BackendView(name="paid", capacity=4, in_flight=0, **PRICES)
    big = msgspec.structs.replace(request(), params=GenerationParams(max_tokens=50_000))
    item = Waiting(ref=1, request=big, rank=0, submitted=NOW)
    [refuse] = [
        a
        for a in plan([item], {"paid": paid}, NOW, only_paid, {"acme": 0.7})
        if isinstance(a, Refuse)
    ]
    assert (refuse.mode, refuse.cost) == ("soft", estimated_cost(big, paid))
    error = budget_exhausted(
        big, refuse.daily, refuse.spent, NOW, mode=refuse.mode, cost=refuse.cost
    )
    assert "$0.30 left of its soft daily budget of $1.00" in str(error)


def test_a_named_tenant_without_a_budget_is_not_under_everyones() -> None:
    config = parse_config(
        {"tenants": {"*": {"daily_budget": 0, "budget": "hard"}, "vip": {"budget": "soft"}}}
    )
    assert budget_of("vip", config.budgets()) is None
    assert budget_of("anyone", config.budgets()) == Budget(daily=0.0, mode="hard")


def test_a_hard_budget_refuses_once_spent_and_the_day_ends_at_midnight_utc() -> None:
    hard = Budget(daily=2.0, mode="hard")
    assert not refused(hard, 1.99)
    assert refused(hard, 2.0)
    assert not refused(Budget(daily=2.0), 5.0)  # soft never refuses
    assert not refused(None, 5.0)
    assert day_ends(86_400 * 3 + 5) == 86_400 * 4
    assert day_ends(86_400 * 4) == 86_400 * 5
    assert budget_of("x", {"*": hard}) is hard
    assert budget_of("x", {}) is None


def test_tenants_config_reads_budgets_and_refuses_bad_ones() -> None:
    config = parse_config(
        {
            "tenants": {
                "*": {"daily_budget": 1.5},
                "acme": {"daily_budget": 10, "budget": "hard"},
                "free": {},
            }
        }
    )
    assert config.budgets() == {
        "*": Budget(daily=1.5),
        "acme": Budget(daily=10.0, mode="hard"),
        "free": None,  # named: "*" is not its budget
    }
    assert config.plan_policy().budgets == config.budgets()
    for bad, path in [
        ({"acme": {"daily_budget": -1}}, "$.tenants.acme.daily_budget"),
        ({"acme": {"budget": "strict"}}, "$.tenants.acme.budget"),
        ({"acme": {"daily": 3}}, "$.tenants.acme"),
        ({"a.b": {"daily_budget": 3}}, "$.tenants.a.b"),
        ({"acme": 3}, "$.tenants.acme"),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_config({"tenants": bad})
        assert caught.value.path == path, caught.value
    with pytest.raises(ConfigError):
        parse_config({"tenants": ["acme"]})


# ---------------------------------------------------------------- end to end


async def until_logged(log: EventLog, request_id: str, kind: str, within: float = 15.0) -> None:
    """Until the log has a ``kind`` event of the request."""
    give_up = time.monotonic() + within
    while not await log.history(TENANT, request_id, kind=kind):
        assert time.monotonic() < give_up, f"no {kind} event of {request_id}"
        await asyncio.sleep(0.02)


async def spent_seen(services: Services, tenant: str, within: float = 20.0) -> float:
    """Until the router's view of the projection shows a spend today for ``tenant``."""
    router = services.routers[0]
    give_up = time.monotonic() + within
    while True:
        projection = router.projection
        spent = 0.0 if projection is None else projection.spent(tenant, utc_day(time.time()))
        if spent > 0:
            return spent
        assert time.monotonic() < give_up, f"no spend of {tenant} seen after {within} s"
        await asyncio.sleep(0.05)


def with_budget(config: Config, **tenant: Any) -> Config:
    return parse_config(
        {
            "nats": {"url": config.nats.url},
            "backends": {
                name: {
                    "base_url": backend.base_url,
                    "model": backend.model,
                    "cost_input_per_mtok": backend.cost_input_per_mtok,
                    "cost_output_per_mtok": backend.cost_output_per_mtok,
                }
                for name, backend in config.backends.items()
            },
            "routes": {"chat": {"backends": ["paid", "local"], "strategy": "cascade"}},
            "router": {"capacity_refresh": "20ms"},
            "tenants": {TENANT: tenant},
        }
    )


async def test_past_its_budget_a_tenant_goes_free_or_is_refused_and_others_are_not(
    isolated_server: EmbeddedServer,
) -> None:
    """The same log across three configs: no budget (it spends), soft (it may
    not spend more: local), hard (refused, until 00:00 UTC); another tenant is
    untouched by either."""
    fast = MockSettings(ttft=0.01, output_tokens=8)
    async with MockBackend(fast) as paid, MockBackend(fast) as local:
        base = config_for(
            isolated_server.url, {"paid": paid, "local": local}, backends={"paid": PRICES}
        )
        async with (
            Services(with_budget(base)) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            handle = await client.submit("hello", route="chat", max_tokens=8)
            assert (await handle.result(timeout=15)).backend == "paid"
            spent = await spent_seen(services, TENANT)
        soft = with_budget(base, daily_budget=spent * 1.01)
        async with Services(soft) as services, Client(services.nc, tenant=TENANT) as client:
            await spent_seen(services, TENANT)
            log = EventLog(client.js)
            handle = await client.submit("hello", route="chat", max_tokens=8)
            result = await handle.result(timeout=15)
            events = await log.history(TENANT, handle.id)
            async with Client(services.nc, tenant="someone-else") as other:
                theirs = await other.submit("hello", route="chat", max_tokens=8)
                assert (await theirs.result(timeout=15)).backend == "paid"
        assert result.backend == "local", describe(events)
        [decision] = [e for e in events if isinstance(e, Routed)]
        assert "tenant budget" in decision.reason
        hard = with_budget(base, daily_budget=spent, budget="hard")
        async with Services(hard) as services, Client(services.nc, tenant=TENANT) as client:
            await spent_seen(services, TENANT)
            handle = await client.submit("hello", route="chat", max_tokens=8)
            with pytest.raises(RequestRejectedError) as caught:
                await handle.result(timeout=15)
            async with Client(services.nc, tenant="someone-else") as other:
                theirs = await other.submit("hello", route="chat", max_tokens=8)
                assert (await theirs.result(timeout=15)).backend == "paid"
    assert caught.value.error_type == BudgetExhaustedError.code
    assert "hard daily budget" in str(caught.value)
    assert "T00:00:00Z" in str(caught.value)


async def test_a_request_admitted_before_a_hard_budget_ran_out_is_not_refused_when_handed_back(
    isolated_server: EmbeddedServer,
) -> None:
    """Before: a held request handed back by a restart (or a lease change) was
    judged as new at its next delivery, and rejected ``budget_exhausted``."""
    async with (
        MockBackend(MockSettings(ttft=0.01, output_tokens=8)) as paid,
        MockBackend(MockSettings(ttft=1.5, output_tokens=8)) as local,
    ):

        def config(**tenant: Any) -> Config:
            return parse_config(
                {
                    "nats": {"url": isolated_server.url},
                    "backends": {
                        "paid": {"base_url": paid.url, "model": "m", **PRICES},
                        "local": {
                            "base_url": local.url,
                            "model": "m",
                            "limits": {"concurrency": 1},
                        },
                    },
                    "routes": {"chat": {"backends": ["paid"]}, "slow": {"backends": ["local"]}},
                    "router": {"capacity_refresh": "20ms"},
                    "tenants": {TENANT: tenant} if tenant else {},
                }
            )

        async with Services(config()) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            first = await client.submit("hello", route="chat", max_tokens=8)
            assert (await first.result(timeout=15)).backend == "paid"
            spent = await spent_seen(services, TENANT)
            blocker = await client.submit("block", route="slow", max_tokens=8)
            held = await client.submit("waiting", route="slow", max_tokens=8)
            await until_logged(log, held.id, "submitted")
        # Restarted with a hard budget already spent: the held request comes
        # back (delivered again) and runs; a new one is refused.
        hard = config(daily_budget=spent, budget="hard")
        async with Services(hard) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            await spent_seen(services, TENANT)
            late = await client.submit("hello", route="slow", max_tokens=8)
            with pytest.raises(RequestRejectedError):
                await late.result(timeout=15)
            assert (await client.handle(held.id).result(timeout=20)).backend == "local"
            assert (await client.handle(blocker.id).result(timeout=20)).backend == "local"
            events = await log.history(TENANT, held.id)
    assert not [e for e in events if type(e).__name__ == "Rejected"], describe(events)


def test_calls_bound_and_not_ended_count_against_the_budget() -> None:
    """Before: a budget saw completed calls only, and every round bound as many
    paid calls as had slots (the review measured 2.3x a hard budget spent)."""

    def routed(rid: str, cost: float, tenant: str = "acme") -> Routed:
        return Routed(
            request_id=rid,
            tenant=tenant,
            at=NOW,
            backend="paid",
            attempt=1,
            priority="normal",
            queue_wait=0.0,
            estimated_cost=cost,
        )

    state = fold_many(
        ProjectionState(),
        [routed("a", 0.25), routed("b", 0.5), routed("c", 0.125, tenant="other")],
    )
    assert state.tenants["acme"].committed == 0.75
    assert state.tenants["other"].committed == 0.125
    # A decision made again for the same request replaces its estimate.
    state = fold_many(state, [routed("a", 0.0625)])
    assert state.tenants["acme"].committed == 0.5625
    done = Completed(
        request_id="b",
        tenant="acme",
        at=NOW + 1,
        backend="paid",
        attempt=1,
        delivery=1,
        text="x",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        cost=0.4,
    )
    failed = Failed(request_id="a", tenant="acme", at=NOW + 1, error_type="x", reason="x")
    state = fold_many(state, [done, failed])
    assert state.tenants["acme"].committed == 0.0
    assert state.tenants["acme"].day_spend == 0.4


async def test_requests_submitted_together_do_not_spend_past_a_budget(
    isolated_server: EmbeddedServer,
) -> None:
    """A budget with room for one paid call: of eight requests at once, one is
    paid (the others go to the free backend), whichever rounds bind them."""
    fast = MockSettings(ttft=0.2, output_tokens=8)
    async with MockBackend(fast) as paid, MockBackend(fast) as local:
        base = config_for(
            isolated_server.url, {"paid": paid, "local": local}, backends={"paid": PRICES}
        )
        one = request(tenant=TENANT)
        estimate = estimated_cost(
            msgspec.structs.replace(
                one,
                messages=[ChatMessage(role="user", content="hello")],
                params=GenerationParams(max_tokens=8),
            ),
            base.backends["paid"],
        )
        soft = with_budget(base, daily_budget=estimate * 1.5)
        async with Services(soft) as services, Client(services.nc, tenant=TENANT) as client:
            handles = [await client.submit("hello", route="chat", max_tokens=8) for _ in range(8)]
            results = [await handle.result(timeout=20) for handle in handles]
    assert sorted(result.backend for result in results) == ["local"] * 7 + ["paid"]


async def test_a_soft_budget_refuses_a_request_that_cannot_fit_and_says_why(
    isolated_server: EmbeddedServer,
) -> None:
    """A paid-only route, a soft budget with less left than the request would
    cost: refused `budget_exhausted`, its reason naming the soft budget, what is
    left and the cost (it said "hard daily budget" before)."""
    async with MockBackend(MockSettings(ttft=0.01, output_tokens=8)) as paid:
        config = parse_config(
            {
                "nats": {"url": isolated_server.url},
                "backends": {"paid": {"base_url": paid.url, "model": "m", **PRICES}},
                "routes": {"chat": {"backends": ["paid"]}},
                "router": {"capacity_refresh": "20ms"},
                "tenants": {TENANT: {"daily_budget": 0.0001}},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            handle = await client.submit("hello", route="chat", max_tokens=100)
            with pytest.raises(RequestRejectedError) as caught:
                await handle.result(timeout=15)
    assert caught.value.error_type == BudgetExhaustedError.code
    reason = str(caught.value)
    assert "left of its soft daily budget of $0.0001" in reason
    assert "would cost up to $" in reason
    assert "hard" not in reason
    assert paid.stats().requests == 0
