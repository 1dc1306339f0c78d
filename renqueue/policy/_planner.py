"""The round planner: what a router does with everything it holds, at one moment.

:func:`plan` is a plain function of a snapshot: the requests waiting in a
router (:class:`Waiting`, plain data, no NATS messages), what is known of each
backend (:class:`~renqueue.policy.BackendView`: slots, health, tier, expected
call duration), the time, and the rules (:class:`PlanPolicy`). It returns the
round's decisions as actions, each carrying the reason that goes into its
event; the router carries them out (the publishes, the acks) and keeps the
bookkeeping they name.

The rules, in the order the planner applies them:

1. Order: most urgent *effective* level first (after aging, parent
   inheritance and a coalesced follower's boost, :func:`pick_key`), then the
   oldest (server time); ties keep the order the waiting requests were given in.
2. For each request in that order, announce what changed about its level: each
   promotion it earned by aging and has not announced yet (:class:`Promote`),
   and a more urgent level inherited from its parent (:class:`Inherit`).
3. :class:`Expire` it if its deadline passed, or if every healthy candidate's
   expected call duration ends past the deadline (:func:`hopeless`: a candidate
   with no estimate yet may still make it, so it is never hopeless).
4. Else :class:`Bind` it to the first candidate of its route, in cascade order,
   that is healthy, of a tier the request needs, has a free slot and whose
   quota has room for it now (one request, and its token estimate: prompt +
   the most it may generate, :func:`estimate_request_tokens`); the slot and
   the quota are used up for the rest of the round. A candidate passed over
   for its quota is named in the bind's reason (``quota:requests/min 30/30,
   resets in 12 s``): traffic moves down the cascade as a backend nears its
   limit, and comes back when its window frees.
5. Else it waits (:class:`Wait`), and if every capable candidate is full and its
   level preempts (:func:`may_preempt`, at :func:`preempting_rank`), it asks
   for a preemptible run's slot (:class:`AskPreemption`), unless a run was
   already preempted for it (one per request) or it asked less than
   ``preempt_retry`` seconds ago.

Every waiting request gets exactly one of :class:`Expire`, :class:`Bind` or
:class:`Wait`, after its announcements and before the next request's actions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal, TypeVar

import msgspec
from msgspec import Struct

from ..schema import InferenceRequest
from ._aging import LevelPolicy, effective_rank, pick_key, promotions
from ._budget import Budget, budget_of, cheapest, within_budget
from ._predict import Pick, Prediction, RouteRules, choose_in_time, service_time, typical_call
from ._preemption import may_preempt, preempting_rank
from ._quota import Cost, Quota, QuotaVerdict, reserve
from ._routing import BackendView, NoRoom, capable, estimated_cost, hopeless
from ._tokens import DEFAULT_MAX_TOKENS, estimate_request_tokens

#: Seconds before an urgent request that is still waiting asks for preemption again.
PREEMPT_RETRY = 2.0

_NO_SPEND = Quota()

#: ``Routed.reason`` of a binding.
BIND_REASON = "first candidate in cascade order with a free slot"
#: ``Expired.reason`` of a request whose deadline passed while it waited.
DEADLINE_PASSED = "deadline passed while waiting to be routed"


class PlanPolicy(Struct, frozen=True, kw_only=True):
    """The rules a round is planned by: levels, routes and the preemption pace
    (:meth:`renqueue.config.Config.plan_policy`)."""

    #: Every level, most urgent first (index = rank).
    levels: tuple[LevelPolicy, ...]
    #: Each route's candidate backends, in cascade order (first = preferred).
    routes: Mapping[str, tuple[str, ...]]
    #: Seconds before a request whose ask found nothing to preempt asks again.
    preempt_retry: float = PREEMPT_RETRY
    #: Tokens reserved for a request's output when it sets no ``max_tokens``.
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    #: How each route chooses among its candidates (a route not named:
    #: :class:`RouteRules` ``()``, the cheapest in time).
    rules: Mapping[str, RouteRules] = {}
    #: Tenants' daily budgets (``"*"``: every tenant not named; ``None``:
    #: named with no budget).
    budgets: Mapping[str, Budget | None] = {}


class Waiting(Struct, frozen=True, kw_only=True):
    """One request a router holds, as the planner sees it.

    ``ref`` is the router's handle for it, echoed in every action about it.
    """

    ref: int
    request: InferenceRequest
    #: The rank of the level it was submitted at.
    rank: int
    #: When its wait began, in server time.
    submitted: float
    #: The parent's (rank, submitted), when the request names a known parent.
    parent: tuple[int, float] | None = None
    #: The most urgent (rank, submitted) among requests that coalesced onto it.
    boost: tuple[int, float] | None = None
    #: Aging promotions already announced.
    promoted: int = 0
    #: The most urgent rank already announced as inherited.
    inherited: int | None = None
    #: When it last asked for a preemption.
    preempt_asked: float | None = None
    #: A run was preempted for it (or a confirm went unanswered): it never asks again.
    preempted_one: bool = False
    #: The cheaper backend it was first told to wait for, and the start predicted
    #: then (``Wait.wait_for``): once that has long passed, it waits no more.
    waiting_for: tuple[str, float] | None = None


class Promote(Struct, frozen=True, kw_only=True, tag=True):
    """Announce an aging promotion (a ``promoted`` event, stamped ``at``)."""

    ref: int
    from_level: str
    to_level: str
    #: When it was earned: submit time + ``waited`` (not when it was noticed).
    at: float
    waited: float
    #: Aging promotions announced once this one is: the new ``Waiting.promoted``.
    promoted: int
    #: ``Promoted.reason``: empty for aging (the event's schema says so).
    reason: str = ""


class Inherit(Struct, frozen=True, kw_only=True, tag=True):
    """Announce that a child competes at its parent's more urgent level."""

    ref: int
    from_level: str
    to_level: str
    #: The rank inherited: the new ``Waiting.inherited``.
    rank: int
    at: float
    waited: float
    reason: str


class Expire(Struct, frozen=True, kw_only=True, tag=True):
    """End the request ``expired`` (stage ``queued``): it cannot finish in time."""

    ref: int
    reason: str


class Refuse(Struct, frozen=True, kw_only=True, tag=True):
    """End the request ``rejected`` (``budget_exhausted``): its tenant's budget
    leaves it no candidate of its route (every one is paid, and over it)."""

    ref: int
    reason: str
    #: The tenant's daily budget and what it spent today (with this round's binds).
    daily: float
    spent: float
    #: The budget's mode, and what the request would cost at the cheapest
    #: candidate of its route (``None``: unknown).
    mode: Literal["soft", "hard"] = "soft"
    cost: float | None = None


class Bind(Struct, frozen=True, kw_only=True, tag=True):
    """Dispatch the request to ``backend`` (a ``routed`` event with ``reason``)."""

    ref: int
    backend: str
    #: The rank it competed at (passed down to backends that take a priority).
    effective_rank: int
    reason: str = BIND_REASON
    #: Tokens reserved of the backend's token quota (its estimate).
    reserved_tokens: int = 0
    #: The backend's circuit is half-open: this call is its probe.
    probe: bool = False
    #: Seconds to its predicted finish (``None``: no model) and its estimated cost.
    predicted: float | None = None
    estimated_cost: float = 0.0


class AskPreemption(Struct, frozen=True, kw_only=True, tag=True):
    """Ask the workers of ``backends`` to free a slot for the request, at ``rank``.

    Carrying it out sets ``Waiting.preempt_asked`` to the round's time.
    """

    ref: int
    rank: int
    #: Its capable candidates, in cascade order (every one of them full).
    backends: tuple[str, ...]
    reason: str


class Wait(Struct, frozen=True, kw_only=True, tag=True):
    """Keep holding the request: no candidate can take it now, or it waits for
    a cheaper one (``wait_for``) predicted to start at ``wait_start``."""

    ref: int
    #: The backends whose freed slots could change that: its route's candidates.
    backends: tuple[str, ...]
    reason: str
    wait_for: str | None = None
    wait_start: float = 0.0


Action = Promote | Inherit | Expire | Refuse | Bind | AskPreemption | Wait


def promise(kept: tuple[str, float] | None, action: Wait) -> tuple[str, float] | None:
    """The promise to wait for a backend a router keeps for a request
    (:attr:`Waiting.waiting_for`) after a round answered ``action``: from the
    first round that names that backend (``kept`` stands while rounds name
    it, and when they name none)."""
    if action.wait_for is None or (kept is not None and kept[0] == action.wait_for):
        return kept
    return (action.wait_for, action.wait_start)


def urgency(item: Waiting, now: float, levels: Sequence[LevelPolicy]) -> tuple[int, float]:
    """The sort key of a waiting request: (effective rank, submit time); smaller first."""
    return pick_key(item.rank, item.submitted, now, levels, parent=item.parent, boost=item.boost)


def plan(
    waiting: Sequence[Waiting],
    backends: Mapping[str, BackendView],
    now: float,
    policy: PlanPolicy,
    spent: Mapping[str, float] | None = None,
) -> list[Action]:
    """The round's decisions for ``waiting`` at ``now`` (see the module docstring).

    ``backends`` is the load and health at the start of the round; a binding
    uses up its slot for the requests after it. ``spent``: what each tenant
    spent today (US dollars), for its budget (:mod:`._budget`). Pure: no
    clock, no I/O, the arguments are not changed.
    """
    round_ = _Round(waiting, backends, now, policy, spent or {})
    actions: list[Action] = []
    for item in sorted(waiting, key=lambda item: urgency(item, now, policy.levels)):
        actions.extend(_announcements(item, now, policy.levels))
        actions.extend(round_.decide(item))
    return actions


class _Round:
    """One round's state while its requests are decided in order: what is
    left of each backend (slots, quota, places in line) and of each tenant's
    budget, as earlier decisions of the round used them."""

    def __init__(
        self,
        waiting: Sequence[Waiting],
        backends: Mapping[str, BackendView],
        now: float,
        policy: PlanPolicy,
        spent: Mapping[str, float],
    ) -> None:
        self.views = dict(backends)
        self.now = now
        self.policy = policy
        self.floors = _probe_floors(waiting, self.views, policy)
        #: Today's spend, with what this round's binds are estimated to add.
        self.today = dict(spent)

    def decide(self, item: Waiting) -> list[Action]:
        """``item``'s decision (and a preemption ask before a wait), using up
        what it takes for the requests after it."""
        request, views, now = item.request, self.views, self.now
        budget = budget_of(request.tenant, self.policy.budgets)
        candidates, note = _affordable(request, budget, views, self.policy, self.today)
        if not candidates and self.policy.routes.get(request.route) and budget is not None:
            spent = self.today.get(request.tenant, 0.0)
            priced = [views[n] for n in self.policy.routes[request.route] if n in views]
            return [
                Refuse(
                    ref=item.ref,
                    reason=note,
                    daily=budget.daily,
                    spent=spent,
                    mode=budget.mode,
                    cost=cheapest(request, priced),
                )
            ]
        expire = _expiry(item, candidates, views, now)
        if expire is not None:
            return [_noted(expire, note)]
        seen = _probe_turn(request, candidates, views, self.floors)
        patient = _patient(item, self.policy)
        if _full_for(item, patient, candidates, seen):
            # What the choice below answers then, without its predictions: a
            # held backlog is mostly this, and a round plans all of it.
            return self._wait_full(item, candidates, note)
        cost = _reservation(request, candidates, views, self.policy)
        rules = self.policy.rules.get(request.route, _CHEAPEST)
        overdue = _overdue(item, views, now)
        pick = choose_in_time(patient, candidates, seen, cost, now, rules=rules, overdue=overdue)
        fallback = request.fallback
        if (
            isinstance(pick.backend, NoRoom)
            and pick.wait_for is None
            and fallback is not None
            and fallback.excluded
            and (
                pick.backend is NoRoom.NONE_CAPABLE
                or _all_passed(request, candidates, views, pick.passed)
            )
        ):
            # No other candidate can take it: back to one that failed it, once
            # its backoff is over (a preference, never a rule: it must not wait
            # forever on candidates that cannot serve it).
            if fallback.not_before is not None and now < fallback.not_before:
                reason = (
                    "no candidate that has not failed it can take it; back to one that did"
                    f" in {fallback.not_before - now:.1f} s"
                )
                return [_noted(Wait(ref=item.ref, backends=tuple(candidates), reason=reason), note)]
            pick = choose_in_time(
                _unexcluded(patient),
                candidates,
                seen,
                cost,
                now,
                rules=rules,
                overdue=overdue,
            )
        if isinstance(pick.backend, NoRoom):
            return self._wait(item, pick, candidates=candidates, seen=seen, cost=cost, note=note)
        return [_noted(self._bind(item, pick, pick.backend, cost, budget), note)]

    def _wait_full(self, item: Waiting, candidates: Sequence[str], note: str) -> list[Action]:
        """:meth:`_wait` for a request every capable slot of which is taken
        and that has no deadline to predict against (:func:`_full_for`)."""
        ask = _preemption(item, candidates, self.views, self.now, self.policy)
        wait = Wait(ref=item.ref, backends=tuple(candidates), reason=NoRoom.FULL.value)
        return [ask, _noted(wait, note)] if ask is not None else [_noted(wait, note)]

    def _wait(
        self,
        item: Waiting,
        pick: Pick,
        *,
        candidates: Sequence[str],
        seen: Mapping[str, BackendView],
        cost: Cost,
        note: str,
    ) -> list[Action]:
        """A wait (after a preemption ask, if every capable slot is taken and
        its level preempts); one waiting for a cheaper candidate holds its place there."""
        actions: list[Action] = []
        choice, passed = pick.backend, pick.passed
        assert isinstance(choice, NoRoom)
        full = (
            choice is NoRoom.FULL
            and not passed
            and all(view.free <= 0 for view in capable(item.request, candidates, seen))
        )
        if full:
            ask = _preemption(item, candidates, self.views, self.now, self.policy)
            if ask is not None:
                actions.append(ask)
        if pick.wait_for is not None:
            quota = pick.prediction is not None and pick.prediction.quota_held
            _hold_place(self.views, pick.wait_for, pick.wait_start, cost if quota else None)
            reason = f"{choice.value}; {pick.reason}" if full else pick.reason
        else:
            reason = choice.value if not passed else _passed_reason(passed, "no candidate left")
        wait = Wait(
            ref=item.ref,
            backends=tuple(candidates),
            reason=reason,
            wait_for=pick.wait_for,
            wait_start=pick.wait_start,
        )
        actions.append(_noted(wait, note))
        return actions

    def _bind(
        self, item: Waiting, pick: Pick, choice: str, cost: Cost, budget: Budget | None
    ) -> Bind:
        """Bind ``item`` to ``choice``: its slot, its quota and its tenant's
        ``budget`` are used up for the rest of the round."""
        request, now = item.request, self.now
        view = self.views[choice]
        # Tokens are reserved where a token limit applies; elsewhere the
        # call's reported usage is recorded when it ends.
        if not any(limit.kind == "tokens" for limit in view.limits):
            cost = Cost(requests=1)
        self.views[choice] = msgspec.structs.replace(
            view,
            in_flight=view.in_flight + 1,
            quota=reserve(view.quota or _NO_SPEND, cost, now) if view.limits else view.quota,
        )
        passed = pick.passed
        reason = pick.reason or (
            BIND_REASON if not passed else _passed_reason(passed, f"bound to {choice}")
        )
        price = estimated_cost(request, view)
        if view.paid and budget is not None:
            self.today[request.tenant] = self.today.get(request.tenant, 0.0) + price
        return Bind(
            ref=item.ref,
            backend=choice,
            effective_rank=urgency(item, now, self.policy.levels)[0],
            reason=_fallback_reason(request, view, reason),
            reserved_tokens=cost.tokens,
            probe=view.half_open,
            predicted=_seconds_to(pick.prediction, now),
            estimated_cost=price,
        )


def _patient(item: Waiting, policy: PlanPolicy) -> InferenceRequest:
    """``item``'s request as its choice sees it: one with no deadline, at a
    level with ``patience``, chooses as if it had a deadline that long after
    its submit (it may wait for a free backend rather than pay now)."""
    request = item.request
    patience = policy.levels[item.rank].patience if item.rank < len(policy.levels) else None
    if request.deadline is not None or patience is None:
        return request
    return msgspec.structs.replace(request, deadline=item.submitted + patience)


def _full_for(
    item: Waiting,
    patient: InferenceRequest,
    candidates: Sequence[str],
    seen: Mapping[str, BackendView],
) -> bool:
    """Whether ``item`` can only wait, with no prediction to make: it has no
    deadline (``patient``, its :func:`_patient` request: nor a level's
    patience, which lends it one), and some capable
    candidate exists but every capable slot is taken.

    :func:`choose_in_time` (either strategy) then finds nothing that can start,
    nothing to wait for (that needs a deadline) and no candidate passed over
    for its quota (only one with a free slot is), so the request waits
    ``NoRoom.FULL``, asking for a preemption if its level may: exactly what
    :meth:`_Round._wait` answers for it, without a prediction per candidate.
    """
    if patient.deadline is not None:
        return False
    able = capable(item.request, candidates, seen)
    return bool(able) and all(view.free <= 0 for view in able)


def _overdue(item: Waiting, views: Mapping[str, BackendView], now: float) -> frozenset[str]:
    """The backend ``item`` was waiting for, if the start it was promised has
    passed by more than a typical call there (at least a second): its
    predictions were wrong (a call that never ends, a quota that keeps moving),
    so it is not waited for again; it may still be bound if it has room."""
    if item.waiting_for is None:
        return frozenset()
    name, promised = item.waiting_for
    view = views.get(name)
    typical = None if view is None else typical_call(view)
    return frozenset({name}) if now > promised + max(1.0, typical or 0.0) else frozenset()


def _reservation(
    request: InferenceRequest,
    candidates: Sequence[str],
    views: Mapping[str, BackendView],
    policy: PlanPolicy,
) -> Cost:
    """What a call of ``request`` is reserved of a quota: one request, and its
    token estimate where a candidate has limits."""
    limited = any(name in views and views[name].limits for name in candidates)
    tokens = (
        estimate_request_tokens(request, default_max_tokens=policy.default_max_tokens)
        if limited
        else 0
    )
    return Cost(requests=1, tokens=tokens)


def _seconds_to(prediction: Prediction | None, now: float) -> float | None:
    if prediction is None or prediction.finish is None:
        return None
    return prediction.finish - now


def _hold_place(views: dict[str, BackendView], name: str, start: float, cost: Cost | None) -> None:
    """A request waits for backend ``name`` from ``start``: later requests in
    the round queue behind it there, for a slot (if all are taken) and, when
    its quota is what it waits for (``cost``), for its quota from then."""
    view = views[name]
    views[name] = msgspec.structs.replace(
        view,
        queued=view.queued + (1 if view.free <= 0 else 0),
        quota=reserve(view.quota or _NO_SPEND, cost, start)
        if view.limits and cost is not None
        else view.quota,
    )


_Reasoned = TypeVar("_Reasoned", Expire, Wait, Bind)


def _noted(action: _Reasoned, note: str) -> _Reasoned:
    """``action`` with ``note`` added to its reason (none if ``note`` is empty)."""
    if not note:
        return action
    return msgspec.structs.replace(action, reason=f"{action.reason}; {note}")


def _affordable(
    request: InferenceRequest,
    budget: Budget | None,
    views: Mapping[str, BackendView],
    policy: PlanPolicy,
    spent: Mapping[str, float],
) -> tuple[list[str], str]:
    """``request``'s route candidates that its tenant's ``budget`` allows
    (:func:`within_budget`), and a note for its reasons when the budget left
    some out."""
    candidates = list(policy.routes.get(request.route, ()))
    if budget is None:
        return candidates, ""
    today = spent.get(request.tenant, 0.0)
    allowed = [
        name
        for name in candidates
        if name not in views or within_budget(request, views[name], budget, today)
    ]
    if len(allowed) == len(candidates):
        return candidates, ""
    note = (
        f"tenant budget ${today:.4f} of ${budget.daily:.4f} spent today:"
        f" not {', '.join(name for name in candidates if name not in allowed)}"
    )
    return allowed, note


_CHEAPEST: Final = RouteRules()


def _expiry(
    item: Waiting, candidates: Sequence[str], views: Mapping[str, BackendView], now: float
) -> Expire | None:
    """An :class:`Expire` if ``item``'s deadline passed, or if no capable
    candidate's mean service time (:func:`service_time`, no caution) ends
    before it (:func:`hopeless`); else ``None``."""
    request = item.request
    if request.deadline is None:
        return None
    if now >= request.deadline:
        return Expire(ref=item.ref, reason=_why_late(request, candidates, views))
    able = capable(request, candidates, views) or capable(_unexcluded(request), candidates, views)
    finish = hopeless(
        request.deadline, now, [service_time(request, view, spread=0.0) for view in able]
    )
    if finish is None:
        return None
    late = finish - request.deadline
    return Expire(
        ref=item.ref,
        reason="cannot meet the deadline on any candidate: "
        f"the fastest would finish {late:.1f} s late",
    )


def _fallback_reason(request: InferenceRequest, view: BackendView, reason: str) -> str:
    """``reason``, with what a request that fell back was bound under: the
    backends it left out, a quality downgrade, and a half-open probe."""
    notes: list[str] = []
    fallback = request.fallback
    if fallback is not None:
        if view.name in fallback.excluded:
            notes.append(f"fell back, and back to {view.name}: no other candidate could take it")
        elif fallback.excluded:
            notes.append(f"fell back (not to {', '.join(fallback.excluded)})")
        else:
            notes.append("fell back")
        if fallback.from_tier is not None and view.tier < fallback.from_tier:
            notes.append(f"quality downgrade: tier {fallback.from_tier} -> {view.tier}")
    if view.half_open:
        notes.append(f"probe of {view.name}'s half-open circuit")
    return "; ".join([reason, *notes]) if notes else reason


def _probes(request: InferenceRequest) -> int:
    return 0 if request.fallback is None else request.fallback.probes


def _probe_floors(
    waiting: Sequence[Waiting], views: Mapping[str, BackendView], policy: PlanPolicy
) -> dict[str, int]:
    """For each half-open backend, the fewest times a request waiting for it
    failed as a probe call: its probe goes to one of those."""
    half_open = {name for name, view in views.items() if view.half_open}
    floors: dict[str, int] = {}
    if not half_open:
        return floors
    for item in waiting:
        request = item.request
        probes = _probes(request)
        for name in policy.routes.get(request.route, ()):
            # Only a request that could be bound there holds the floor down.
            if name in half_open and capable(request, [name], views):
                floors[name] = min(floors.get(name, probes), probes)
    return floors


def _probe_turn(
    request: InferenceRequest,
    candidates: Sequence[str],
    views: dict[str, BackendView],
    floors: Mapping[str, int],
) -> dict[str, BackendView]:
    """``views`` as ``request`` may use them: a half-open backend is not its to
    probe while another waiting request has failed as a probe fewer times (no
    one request can hold a circuit open by failing as its probe again and again)."""
    if not floors:
        return views
    probes = _probes(request)
    turn = [name for name in candidates if name in floors and probes > floors[name]]
    if not turn:
        return views
    return {**views, **{name: msgspec.structs.replace(views[name], healthy=False) for name in turn}}


def _unexcluded(request: InferenceRequest) -> InferenceRequest:
    """``request`` with no backend excluded (its other fallback constraints kept)."""
    fallback = request.fallback
    if fallback is None or not fallback.excluded:
        return request
    return msgspec.structs.replace(request, fallback=msgspec.structs.replace(fallback, excluded=()))


def _all_passed(
    request: InferenceRequest,
    candidates: Sequence[str],
    views: Mapping[str, BackendView],
    passed: list[tuple[str, QuotaVerdict]],
) -> bool:
    """Whether every capable candidate was passed over for its quota (none is merely full)."""
    names = {name for name, _ in passed}
    return all(view.name in names for view in capable(request, candidates, views))


def _why_late(
    request: InferenceRequest, candidates: Sequence[str], views: Mapping[str, BackendView]
) -> str:
    """:data:`DEADLINE_PASSED`, and why it waited when no candidate could take it at all."""
    if capable(request, candidates, views):
        return DEADLINE_PASSED
    down = [name for name in candidates if name in views and not views[name].healthy]
    if down and len(down) == len([name for name in candidates if name in views]):
        return f"{DEADLINE_PASSED}: every candidate is down (circuit open: {', '.join(down)})"
    return f"{DEADLINE_PASSED}: {NoRoom.NONE_CAPABLE.value}"


def nothing_could_serve(reason: str) -> bool:
    """Whether an expiry's ``reason`` (:func:`_why_late`) says that no candidate
    of its route could take it at all while it waited (all down, or none
    healthy and capable), rather than that they were busy or out of quota."""
    return reason.startswith(f"{DEADLINE_PASSED}: ") and (
        "every candidate is down" in reason or NoRoom.NONE_CAPABLE.value in reason
    )


def _passed_reason(passed: list[tuple[str, QuotaVerdict]], then: str) -> str:
    return "; ".join([*(f"{name} {verdict.reason}" for name, verdict in passed), then])


def _announcements(
    item: Waiting, now: float, levels: Sequence[LevelPolicy]
) -> list[Promote | Inherit]:
    """The promotions ``item`` earned and has not announced, then a new inheritance."""
    waited = max(0.0, now - item.submitted)
    steps = promotions(item.rank, waited, levels)
    ranks = [item.rank] + [rank for rank, _after in steps]
    announced: list[Promote | Inherit] = [
        Promote(
            ref=item.ref,
            from_level=levels[ranks[index]].name,
            to_level=levels[to_rank].name,
            at=item.submitted + after,
            waited=after,
            promoted=index + 1,
        )
        for index, (to_rank, after) in enumerate(steps)
        if index >= item.promoted
    ]
    if item.parent is None:
        return announced
    own = effective_rank(item.rank, waited, levels)
    # The parent's level only: a coalesced follower's boost is not an inheritance.
    inherited = min(own, effective_rank(item.parent[0], max(0.0, now - item.parent[1]), levels))
    if inherited < own and (item.inherited is None or inherited < item.inherited):
        announced.append(
            Inherit(
                ref=item.ref,
                from_level=levels[own].name,
                to_level=levels[inherited].name,
                rank=inherited,
                at=now,
                waited=waited,
                reason=f"inherited from parent {item.request.parent_id}",
            )
        )
    return announced


def _preemption(
    item: Waiting,
    candidates: Sequence[str],
    views: Mapping[str, BackendView],
    now: float,
    policy: PlanPolicy,
) -> AskPreemption | None:
    """An ask for a slot, if ``item`` (every capable slot full) may and should ask now."""
    rank = preempting_rank(item.rank, item.parent)
    if not may_preempt(rank, policy.levels):
        return None
    if item.preempted_one or (
        item.preempt_asked is not None and now - item.preempt_asked < policy.preempt_retry
    ):
        return None
    level = policy.levels[rank].name
    return AskPreemption(
        ref=item.ref,
        rank=rank,
        backends=tuple(view.name for view in capable(item.request, candidates, views)),
        reason=f"every capable slot is taken and level {level} preempts",
    )
