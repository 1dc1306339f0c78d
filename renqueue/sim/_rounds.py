"""The router's rounds in a simulation, and when the next one is due.

A round is the real one, :func:`renqueue.policy.plan`, over the requests the
hold has (:class:`~renqueue.policy.Waiting`) and views built as the router
builds them (:func:`~renqueue.sim.backend_view`); its actions are carried out
as the router carries them out (the endings and refusals it records, the
promise to wait it keeps: :func:`renqueue.policy.promise`), and a bind by the
workers' side (:class:`~renqueue.sim._calls.Calls`).

Rounds happen when something arrives or ends, and whenever a waiting
request's decision may change with time alone (:meth:`Rounds.next_change`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from ..config import parse_duration
from ..policy import (
    BackendView,
    Bind,
    Cost,
    Expire,
    Inherit,
    Promote,
    Quota,
    Refuse,
    RouteRules,
    Wait,
    budget_exhausted,
    budget_of,
    check,
    estimate_request_tokens,
    expired_waiting,
    plan,
    predict,
    promise,
    promotions,
    rejection,
    typical_call,
)
from ..schema import InferenceRequest
from ._arrivals import Arrivals
from ._backends import backend_view
from ._calls import Calls
from ._world import WAKE, Item, World

__all__ = ["Rounds"]

_CHEAPEST: Final = RouteRules()
_ONE: Final = Cost(requests=1)


class Rounds:
    """The planner's rounds over the hold (module docstring)."""

    def __init__(self, world: World, arrivals: Arrivals, calls: Calls) -> None:
        self.world = world
        self.arrivals = arrivals
        self.calls = calls
        self.policy = world.policy
        self.gap = max(parse_duration(world.config.router.capacity_refresh), 1e-3)
        #: Rounds planned.
        self.rounds = 0
        #: When the next wake-up is scheduled (``inf``: none).
        self.wake_at = math.inf

    def views(self) -> dict[str, BackendView]:
        world = self.world
        return {
            name: backend_view(
                name, backend, in_flight=world.in_flight[name], state=world.state.backends.get(name)
            )
            for name, backend in world.config.backends.items()
        }

    def round(self) -> None:
        """One round over the hold, its actions carried out."""
        world, waiting = self.world, self.arrivals.waiting
        self.rounds += 1
        views = self.views()
        spent = {
            tenant: world.spent_today(tenant)
            for tenant in {item.request.tenant for item in waiting.values()}
            if budget_of(tenant, self.policy.budgets) is not None
        }
        snapshot = [item.waiting for item in waiting.values() if item.waiting is not None]
        for action in plan(snapshot, views, world.now, self.policy, spent):
            item = world.items[action.ref]
            held = item.waiting
            if held is None:
                continue
            if isinstance(action, Promote):
                item.waiting = msgspec.structs.replace(held, promoted=action.promoted)
            elif isinstance(action, Inherit):
                item.waiting = msgspec.structs.replace(held, inherited=action.rank)
            elif isinstance(action, Expire):
                world.fold(expired_waiting(item.request, world.now, action.reason))
                self.arrivals.end(item, "expired")
            elif isinstance(action, Refuse):
                request = item.request
                error = budget_exhausted(
                    request,
                    action.daily,
                    action.spent,
                    world.now,
                    mode=action.mode,
                    cost=action.cost,
                )
                world.fold(rejection(request.id, request.tenant, world.now, error))
                self.arrivals.end(item, "rejected")
            elif isinstance(action, Bind):
                self.calls.bind(item, action)
            elif isinstance(action, Wait):
                kept = promise(held.waiting_for, action)
                if kept != held.waiting_for:
                    item.waiting = msgspec.structs.replace(held, waiting_for=kept)
        if waiting:
            self.schedule_wake()

    def schedule_wake(self) -> None:
        """A round again at the next moment a decision may change (at the
        earliest the refresh interval from now), or now when requests were read."""
        world, arrivals = self.world, self.arrivals
        change = world.now if arrivals.admitted else self.next_change()
        arrivals.admitted = False
        wake = max(change, world.now + self.gap)
        if math.isfinite(wake) and wake < self.wake_at:
            self.wake_at = wake
            world.push(wake, WAKE)

    def next_change(self) -> float:
        """The earliest moment a waiting request's decision may change with
        time alone (see the module docstring); ``inf``: none.

        It may be early (a round that changes nothing), never late: each
        backend's quota is judged once, for the smallest cost a waiting
        request reserves there; predictions are made without the quota (a
        quota's hold does not move with time, its end is judged apart)."""
        now, waiting = self.world.now, self.arrivals.waiting
        views = self.views()
        smallest: dict[str, Cost] = {}
        for item in waiting.values():
            names = self.policy.routes.get(item.request.route, ())
            cost = self.reservation(item.request, names, views)
            for name in names:
                known = smallest.get(name)
                if known is None or cost.tokens < known.tokens:
                    smallest[name] = cost
        times = [
            check(views[name].quota or Quota(), views[name].limits, cost, now).until
            for name, cost in smallest.items()
            if name in views and (views[name].limits or views[name].quota is not None)
        ]
        unlimited = {
            name: msgspec.structs.replace(view, limits=(), quota=None)
            for name, view in views.items()
        }
        times.extend(self.change_of(item, unlimited) for item in waiting.values())
        return min((at for at in times if now < at < math.inf), default=math.inf)

    def reservation(
        self, request: InferenceRequest, names: Sequence[str], views: Mapping[str, BackendView]
    ) -> Cost:
        """What a bind of ``request`` reserves, as the planner reckons it."""
        limited = any(name in views and views[name].limits for name in names)
        tokens = (
            estimate_request_tokens(request, default_max_tokens=self.policy.default_max_tokens)
            if limited
            else 0
        )
        return Cost(requests=1, tokens=tokens)

    def change_of(self, item: Item, views: Mapping[str, BackendView]) -> float:
        """The earliest moment ``item``'s decision may change with time alone,
        its quotas aside (``views`` have none)."""
        now, request, waiting = self.world.now, item.request, item.waiting
        if waiting is None:
            return math.inf
        levels = self.policy.levels
        times = [math.inf if request.deadline is None else request.deadline]
        fallback = request.fallback
        if fallback is not None and fallback.not_before is not None:
            times.append(fallback.not_before)
        times.extend(
            waiting.submitted + after for _rank, after in promotions(waiting.rank, math.inf, levels)
        )
        if waiting.waiting_for is not None:
            # The promise to wait for a backend is given up once overdue.
            name, promised = waiting.waiting_for
            view = views.get(name)
            typical = None if view is None else typical_call(view)
            times.append(math.nextafter(promised + max(1.0, typical or 0.0), math.inf))
        # What the choice is judged against: the deadline, or the level's patience.
        patience = levels[waiting.rank].patience if waiting.rank < len(levels) else None
        deadline = request.deadline
        if deadline is None and patience is not None:
            deadline = waiting.submitted + patience
        if deadline is not None:
            spread = self.policy.rules.get(request.route, _CHEAPEST).spread
            for name in self.policy.routes.get(request.route, ()):
                view = views.get(name)
                if view is None:
                    continue
                # When it stops being predicted in time, or its mean service
                # time no longer fits (the hopeless verdict).
                prediction = predict(request, view, now, cost=_ONE, spread=spread)
                if prediction.finish is not None and prediction.finish <= deadline:
                    times.append(now + (deadline - prediction.finish))
                if prediction.mean_service is not None:
                    times.append(deadline - prediction.mean_service)
        return min((at for at in times if now < at < math.inf), default=math.inf)
