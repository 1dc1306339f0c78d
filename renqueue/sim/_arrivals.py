"""The router's intake in a simulation: requests arrive, wait on their
level's subject until a router reads them into its hold (``router.hold_limit``
per level), are admitted or refused as the router admits them, and leave the
hold once bound or ended.

A request read for the first time is checked as the router checks it
(:func:`renqueue.policy.validate`, a hard budget: :func:`renqueue.policy.over_budget`),
placed on its A/B split's arm (:func:`renqueue.policy.on_arm`, a live split:
rollbacks are not simulated) and given its route's complexity estimate
(:meth:`renqueue.config.Config.estimated`); one whose deadline passed before
it was read ends expired (:func:`renqueue.policy.expired_waiting`). A request
that shared a call in the log (coalescing) follows its leader again, when the
leader is in the trace and still running.
"""

from __future__ import annotations

import collections

import msgspec

from ..errors import InvalidRequestError, UnknownPriorityError
from ..policy import (
    SplitPolicy,
    Waiting,
    budget_of,
    expired_waiting,
    on_arm,
    over_budget,
    past_deadline,
    rejection,
    validate,
)
from ..schema import Fallback, InferenceRequest, submitted
from ._outcomes import Outcome
from ._world import CANCEL, READ, Item, World

__all__ = ["Arrivals"]


class Arrivals:
    """The level subjects, the router's hold and its admission (module docstring)."""

    def __init__(self, world: World) -> None:
        self.world = world
        config = world.config
        self.estimators = config.estimators()
        self.splits: dict[str, SplitPolicy] = {
            name: route.ab.policy(name) for name, route in config.routes.items() if route.ab
        }
        #: The requests the router holds, by ref; how many per level; and per
        #: level those stored but not read yet (the hold was full).
        self.waiting: dict[int, Item] = {}
        self.held: dict[str, int] = {}
        self.stream: dict[str, collections.deque[Item]] = {}
        self.hold_limit = config.router.hold_limit
        #: Requests were read into the hold since the last round.
        self.admitted = False

    def arrive(self, item: Item) -> None:
        """``item`` is stored on its level's subject: a router reads it when
        its hold for that level has room (``router.hold_limit``)."""
        world = self.world
        if item.arrival.cancelled_at is not None:
            world.push(item.arrival.cancelled_at, CANCEL, item.ref, item.token)
        leader = self.leader_of(item)
        if leader is not None:
            leader.followers.append(item)
            return
        read_at = item.arrival.read_at
        if read_at is not None and read_at > world.now:
            # The services' reading delay, as the log shows it for this request.
            world.push(read_at, READ, item.ref)
        else:
            self.store(item)

    def store(self, item: Item) -> None:
        """``item`` waits on its level's subject (new, or put back to routing)."""
        level = item.arrival.request.priority
        if self.held.get(level, 0) < self.hold_limit:
            self.admit(item)
        else:
            item.stored = True
            self.stream.setdefault(level, collections.deque()).append(item)

    def admit(self, item: Item) -> None:
        """A router reads ``item``: rejects it, ends it if its deadline passed,
        or holds it for the planner."""
        item.stored = False
        if item.waiting is None and not self.first_read(item):
            return
        world, request = self.world, item.request
        if past_deadline(request, world.now):
            world.fold(expired_waiting(request, world.now))
            self.end(item, "expired")
            return
        level = item.arrival.request.priority
        self.held[level] = self.held.get(level, 0) + 1
        self.waiting[item.ref] = item

    def first_read(self, item: Item) -> bool:
        """Admission of a new request, as the router's: ``False`` if it is rejected."""
        world, request = self.world, item.request
        config = world.config
        error = self.refusal(request, at=item.arrival.at)
        if error is not None:
            world.fold(rejection(request.id, request.tenant, world.now, error))
            self.end(item, "rejected")
            return False
        placed = on_arm(
            self.splits, lambda _route: None, request, lambda route: config.serves(request, route)
        )
        request, item.estimate = config.estimated(placed, self.estimators)
        item.request = request
        at = item.arrival.at
        world.fold(submitted(request, at=at))
        item.waiting = Waiting(
            ref=item.ref,
            request=request,
            rank=config.priority_rank(request.priority),
            submitted=at,
            parent=self.parent_of(request),
        )
        return True

    def refusal(
        self, request: InferenceRequest, *, at: float | None = None
    ) -> InvalidRequestError | None:
        """Why the router would reject ``request`` under this config (``None``: it would not).
        ``at``: when it was stored, which bounds how far ahead its deadline may be."""
        config = self.world.config
        if request.priority not in config.priorities:
            return UnknownPriorityError(request.priority, request_id=request.id)
        try:
            validate(request, level=request.priority, tenant=request.tenant, config=config, now=at)
        except InvalidRequestError as exc:
            return exc
        budget = budget_of(request.tenant, self.world.policy.budgets)
        spent = self.world.spent_today(request.tenant)
        priced = [config.backends[name] for name in config.routes[request.route].backends]
        return over_budget(request, priced, budget, spent, self.world.now)

    def unhold(self, item: Item) -> None:
        """``item`` leaves its router's hold (bound, ended): the next request
        stored at its level is read."""
        if self.waiting.pop(item.ref, None) is None:
            return
        level = item.arrival.request.priority
        self.held[level] = max(0, self.held.get(level, 0) - 1)
        stored = self.stream.get(level)
        while stored and self.held[level] < self.hold_limit:
            waiting = stored.popleft()
            if not waiting.done:
                self.admit(waiting)
                self.admitted = True

    def requeue(self, item: Item, fallback: Fallback | None) -> None:
        """Back to routing, keeping its wait (a fallback, a spent quota)."""
        request = msgspec.structs.replace(
            item.request, fallback=fallback, requeues=item.request.requeues + 1
        )
        item.request = request
        item.backend = None
        waiting = item.waiting
        assert waiting is not None
        item.waiting = msgspec.structs.replace(waiting, request=request, waiting_for=None)
        self.store(item)

    def leader_of(self, item: Item) -> Item | None:
        """The simulated request whose call ``item`` shared in the log, while it runs."""
        leader_id = item.arrival.recorded.leader
        if leader_id is None:
            return None
        leader = self.world.by_key.get(f"{item.request.tenant}:{leader_id}")
        if leader is None or leader.done or leader is item or leader.arrival.at > item.arrival.at:
            return None
        return leader

    def parent_of(self, request: InferenceRequest) -> tuple[int, float] | None:
        """The parent's level and submit time, as the router finds them in its
        ``submitted`` event (none before it arrived)."""
        config = self.world.config
        if request.parent_id is None:
            return None
        parent = self.world.by_key.get(f"{request.tenant}:{request.parent_id}")
        if parent is None or (parent.waiting is None and not parent.done):
            return None  # not arrived yet: the router would find no submitted event
        level = parent.arrival.request.priority
        if level not in config.priorities:
            return None
        return config.priority_rank(level), parent.arrival.at

    def end(self, item: Item, kind: str, *, backend: str | None = None, cost: float = 0.0) -> None:
        """``item`` ends (``kind``), and so do the requests that shared its call."""
        self.unhold(item)
        item.done = True
        item.token += 1
        request = item.arrival.request
        item.outcome = Outcome(
            request_id=request.id,
            tenant=request.tenant,
            level=request.priority,
            deadline=request.deadline,
            kind=kind,
            at=self.world.now,
            backend=backend,
            cost=cost,
        )
        for follower in item.followers:
            if follower.done:
                continue  # cancelled before its leader ended
            follower.done = True
            follower.outcome = msgspec.structs.replace(
                item.outcome,
                request_id=follower.request.id,
                level=follower.request.priority,
                deadline=follower.request.deadline,
                cost=0.0,
            )
