"""What each tenant has spent today, as its hard daily budget judges it here.

The projection folds each call's cost, and the estimated cost of the calls
bound and not ended (``committed``); between a bind and the projection
folding its decision, the binder counts its own paid binds itself.
:class:`Spending` adds the three up for admission (is a new request within
its tenant's budget?) and for the round (:func:`renqueue.policy.plan`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ...config import Config
from ...coordination import LiveState
from ...policy import Budget, budget_of
from ...state import utc_day

__all__ = ["Spending"]


class Spending:
    """The tenants' spending as this router judges budgets by (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self._budgets = config.budgets()
        #: (when, tenant, estimated cost) of this router's paid binds, until
        #: the projection has folded them (:meth:`spent`).
        self._recent: deque[tuple[float, str, float]] = deque()

    def budget(self, tenant: str) -> Budget | None:
        """``tenant``'s hard daily budget, if it has one."""
        return budget_of(tenant, self._budgets)

    def bound(self, tenant: str, estimated_cost: float, now: float) -> None:
        """This router bound a call of ``tenant``'s, estimated at ``estimated_cost``."""
        if estimated_cost > 0 and self.budget(tenant) is not None:
            self._recent.append((now, tenant, estimated_cost))

    def today(
        self, projected: LiveState | None, tenants: Iterable[str], now: float
    ) -> dict[str, float]:
        """What each of ``tenants`` that has a budget has spent today (:meth:`spent`)."""
        if not self._budgets or projected is None:
            return {}
        return {
            tenant: self.spent(projected, tenant, now)
            for tenant in set(tenants)
            if self.budget(tenant) is not None
        }

    def spent(self, projected: LiveState, tenant: str, now: float) -> float:
        """What a budget judges ``tenant`` by: the projection's spend today,
        the estimated cost of its calls bound and not ended (``committed``),
        and of this router's paid binds the projection has not folded yet
        (decided after its log time)."""
        folded = projected.log_time
        while self._recent and self._recent[0][0] <= folded:
            self._recent.popleft()
        unfolded = sum(cost for at, who, cost in self._recent if who == tenant)
        return projected.spent(tenant, utc_day(now)) + projected.committed(tenant) + unfolded
