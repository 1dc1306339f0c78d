"""Tenant budgets per UTC day, from the projected spend.

A tenant's budget (``[tenants.<name>]``, or ``[tenants."*"]`` for every
tenant not named) is ``daily`` US dollars per UTC day, judged against what the
log says it spent that day (the projection's ``completed`` costs: calls still
running are not in it yet, so a day can end a few calls over).

- **soft**: a request may go to a paid backend only while the day's spend plus
  the request's estimated cost there stays within the budget; past that, its
  tenant's requests go to free and local backends only, and wait for them
  within their deadlines.
- **hard**: as soft, and once the day's spend reaches the budget, new requests
  are refused at admission (``budget_exhausted``) until the day ends at 00:00
  UTC. A request already admitted is held to free backends.

Either way, a request the budget leaves no backend of its route at all (a
paid-only route) is refused (``budget_exhausted``), at admission or, if the
budget runs out while it waits, then: it is never held until midnight, taking
a place in its level's hold that other tenants' requests need.

Both refusals are one :class:`~renqueue.errors.BudgetExhaustedError`, made by
:func:`over_budget` (at admission) and :func:`budget_exhausted` (a round's
``Refuse``), for the router and the what-if simulator alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal

from msgspec import Struct

from ..errors import BudgetExhaustedError
from ..schema import InferenceRequest
from ._routing import Priced, estimated_cost

#: The ``[tenants]`` key whose budget applies to every tenant not named.
EVERY_TENANT: Final = "*"

_DAY: Final = 86_400.0


class Budget(Struct, frozen=True, kw_only=True):
    """A tenant's daily budget (US dollars per UTC day) and what happens past it."""

    daily: float
    mode: Literal["soft", "hard"] = "soft"


def budget_of(tenant: str, budgets: Mapping[str, Budget | None]) -> Budget | None:
    """``tenant``'s budget: its own if it is named (``None``: named with no
    budget), else the one for every tenant, else none."""
    if tenant in budgets:
        return budgets[tenant]
    return budgets.get(EVERY_TENANT)


def within_budget(
    request: InferenceRequest, backend: Priced, budget: Budget | None, spent: float
) -> bool:
    """Whether ``request`` may go to ``backend`` when its tenant spent ``spent``
    today: a free backend always; a paid one while the day's spend plus the
    estimated cost there stays within the budget."""
    if budget is None:
        return True
    cost = estimated_cost(request, backend)
    return cost <= 0 or spent + cost <= budget.daily


def refused(budget: Budget | None, spent: float) -> bool:
    """Whether a hard budget refuses new requests: the day's spend reached it."""
    return budget is not None and budget.mode == "hard" and spent >= budget.daily


def affordable(
    request: InferenceRequest, backends: Sequence[Priced], budget: Budget | None, spent: float
) -> bool:
    """Whether any of ``backends`` (a route's) may take ``request`` within the
    budget (:func:`within_budget`); a route with none is always affordable."""
    return not backends or any(within_budget(request, b, budget, spent) for b in backends)


def day_ends(now: float) -> float:
    """When the UTC day of ``now`` ends (the next 00:00 UTC), as Unix time."""
    return (now // _DAY + 1) * _DAY


def budget_exhausted(
    request: InferenceRequest,
    daily: float,
    spent: float,
    now: float,
    *,
    mode: Literal["soft", "hard"] = "hard",
    cost: float | None = None,
) -> BudgetExhaustedError:
    """Why ``request`` is refused: its tenant spent ``spent`` of its ``daily``
    budget (``mode``), until the UTC day of ``now`` ends; ``cost``: what the
    request would cost at the cheapest backend of its route, when that is why
    (``None``: a hard budget spent)."""
    return BudgetExhaustedError(
        request.tenant, daily, spent, day_ends(now), request_id=request.id, mode=mode, cost=cost
    )


def cheapest(request: InferenceRequest, backends: Sequence[Priced]) -> float | None:
    """The lowest estimated cost of ``request`` on ``backends`` (``None``: none)."""
    return min((estimated_cost(request, b) for b in backends), default=None)


def over_budget(
    request: InferenceRequest,
    backends: Sequence[Priced],
    budget: Budget | None,
    spent: float,
    now: float,
) -> BudgetExhaustedError | None:
    """Why a new ``request`` is refused at admission when its tenant spent
    ``spent`` today (``None``: it is not): its hard budget is spent
    (:func:`refused`), or its budget, soft or hard, leaves none of its
    route's ``backends`` (:func:`affordable`: every one is paid and would
    cost more than is left), which the error says with the cheapest cost."""
    if budget is None:
        return None
    if refused(budget, spent):
        return budget_exhausted(request, budget.daily, spent, now)
    if affordable(request, backends, budget, spent):
        return None
    return budget_exhausted(
        request, budget.daily, spent, now, mode=budget.mode, cost=cheapest(request, backends)
    )
