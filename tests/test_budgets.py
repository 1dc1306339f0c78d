"""Tenant budgets per UTC day (issue #10): soft keeps a tenant past its budget
on free and local backends, hard refuses its new requests until 00:00 UTC;
both judged against the projected spend, per tenant and never for another.

The planner's rule as tables; the config; then end to end against a real
nats-server and mock backends, across a restart of the services (the spend is
the log's, not a process's).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from test_fallback import config_for
from test_quota_exhausted import describe
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.config import Config, parse_config
from renqueue.errors import BudgetExhaustedError, ConfigError, RequestRejectedError
from renqueue.ops import EmbeddedServer
from renqueue.policy import (
    BackendView,
    Bind,
    Budget,
    Expire,
    LevelPolicy,
    PlanPolicy,
    RouteRules,
    Wait,
    Waiting,
    budget_of,
    day_ends,
    plan,
    refused,
)
from renqueue.state import utc_day
from renqueue.tools import MockBackend, MockSettings
from renqueue.wire import ChatMessage, EventLog, GenerationParams, InferenceRequest, Routed

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


def test_a_request_only_paid_backends_can_serve_waits_and_says_why() -> None:
    only_paid = PlanPolicy(
        levels=(LevelPolicy(name="normal", rank=0),),
        routes={"chat": ("paid",)},
        budgets={"acme": Budget(daily=0.0)},
    )
    views = {"paid": BackendView(name="paid", capacity=4, in_flight=0, **PRICES)}
    item = Waiting(ref=1, request=request(deadline=NOW + 5), rank=0, submitted=NOW)
    [wait] = [a for a in plan([item], views, NOW, only_paid, {}) if isinstance(a, Wait)]
    assert wait.reason.endswith("tenant budget $0.0000 of $0.0000 spent today: not paid")
    late = Waiting(ref=1, request=request(deadline=NOW - 1), rank=0, submitted=NOW - 10)
    [expire] = [a for a in plan([late], views, NOW, only_paid, {}) if isinstance(a, Expire)]
    assert "tenant budget" in expire.reason


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
    assert config.budgets() == {"*": Budget(daily=1.5), "acme": Budget(daily=10.0, mode="hard")}
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
