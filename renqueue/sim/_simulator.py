"""The what-if simulator: a recorded workload run through the planner under a
config, in simulated time.

:func:`simulate` is a discrete-event simulation, pure and deterministic for a
seed (no NATS, no clock, no sleep). Each request of a :class:`~renqueue.sim.Trace`
arrives when it really did. The router's round is the real one,
:func:`renqueue.policy.plan`, over :class:`~renqueue.policy.Waiting` requests
and views built as the router builds them (:func:`~renqueue.sim.backend_view`),
and the simulated services carry out its actions:

- a :class:`~renqueue.policy.Bind` takes one of the backend's slots
  (``limits.concurrency``) and spends its quota; the call's times come from the
  backend's model (:class:`~renqueue.sim.BackendModel`, fitted from the log),
  for the request's real output length when the log has it; a call still
  running at the request's deadline is cut there and expires, as the worker
  cuts it;
- a run may fail as the backend's runs failed in the log; the worker's
  failure policy (:func:`renqueue.policy.after_failure`, with the route's
  fallback rules) decides what follows: a retry on the same backend after its
  delay (the slot held meanwhile), a fallback to another candidate (the
  request waits again, keeping its wait), a requeue past a spent quota, or a
  failure;
- an :class:`~renqueue.policy.Expire` ends it expired; a request cancelled in
  the log is cancelled at the same moment; a request that shared a call
  (coalescing) shares its leader's again, when the leader is in the trace.

Everything the simulated services do is an event, folded into the
simulation's own projection with the live fold (:func:`renqueue.state.fold`):
the quota a round judges (reserved at each decision, reconciled with the
usage at each completion, cooled down after a 429), the speed model
(:func:`~renqueue.policy.learn_call`, :func:`~renqueue.policy.learn_fault`),
the mean call duration and each tenant's spend today (for budgets) are
exactly what the live projection would hold after the same events. It starts
from the projection of the warm-up before the trace (``Trace.prior``), with
the calls then running holding their slots until they really ended.

Rounds happen when something arrives or ends, and whenever a waiting
request's decision may change with time alone: a deadline, an aging
promotion, a quota window making room, a fallback's backoff ending, a promise
to wait for a backend becoming overdue, the moment a candidate stops being
predicted in time (against the deadline, or a level's patience). Not
simulated: preemption, circuit breakers, work stealing, A/B rollbacks, and
429s beyond the rates the log shows (docs/what-if.md).
"""

from __future__ import annotations

import collections
import heapq
import math
import random
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec
from msgspec import Struct

from ..config import Config, parse_duration
from ..errors import (
    BackendError,
    BadRequestError,
    BudgetExhaustedError,
    FailureClass,
    FatalBackendError,
    InvalidRequestError,
    RateLimitedError,
    RetryableBackendError,
    UnknownPriorityError,
)
from ..policy import (
    DEADLINE_PASSED,
    BackendView,
    Bind,
    Cost,
    Expire,
    FallBack,
    Inherit,
    Promote,
    Quota,
    Refuse,
    RequeueElsewhere,
    Retry,
    RouteFacts,
    RouteRules,
    SplitPolicy,
    Wait,
    Waiting,
    affordable,
    after_failure,
    budget_of,
    check,
    day_ends,
    estimate_complexity,
    estimate_input_tokens,
    estimate_request_tokens,
    place,
    plan,
    predict,
    promotions,
    refused,
    typical_call,
    validate,
)
from ..schema import (
    Cancelled,
    Completed,
    Event,
    Expired,
    Failed,
    Fallback,
    FellBack,
    InferenceRequest,
    Rejected,
    Retrying,
    Routed,
    Started,
    Submitted,
    Usage,
)
from ..state import ProjectionState, fold, utc_day
from ._backends import backend_view
from ._models import BackendModel, Drawn
from ._trace import UNFINISHED, Arrival, FailureRecord, Trace

__all__ = ["Outcome", "Simulation", "simulate"]

#: How long past its last arrival a simulation may run (seconds): a request
#: waiting for a daily window still gets its turn.
HORIZON: Final = 2 * 86_400.0
#: Rounds after which a simulation stops, whatever still waits (a guard: a
#: config whose waits never end must not hold the command forever).
MAX_ROUNDS: Final = 2_000_000

# Kinds of scheduled happenings, in the order they are handled at one moment.
_FREE, _END, _RERUN, _CANCEL, _ARRIVE, _READ, _WAKE = range(7)
_DONE, _FAIL, _CUT = "done", "fail", "cut"
_CHEAPEST: Final = RouteRules()
_ONE: Final = Cost(requests=1)


class Outcome(Struct, frozen=True, kw_only=True):
    """How one request ended, in the log or in a simulation."""

    request_id: str
    tenant: str
    #: The level it was submitted at.
    level: str
    deadline: float | None = None
    #: ``completed``, ``failed``, ``expired``, ``cancelled``, ``rejected`` or ``unfinished``.
    kind: str = UNFINISHED
    at: float | None = None
    #: The backend that completed it (or, failed, the last that failed it).
    backend: str | None = None
    #: US dollars.
    cost: float = 0.0

    @property
    def in_time(self) -> bool:
        """Completed, and before its deadline if it had one."""
        return self.kind == "completed" and (
            self.deadline is None or (self.at is not None and self.at <= self.deadline)
        )


class Simulation(Struct, frozen=True, kw_only=True):
    """What :func:`simulate` found: each request's outcome, in arrival order."""

    outcomes: tuple[Outcome, ...]
    #: Planner rounds and backend runs simulated.
    rounds: int = 0
    runs: int = 0
    #: Backends some run was simulated on with an assumed model (no calls in the log).
    assumed: tuple[str, ...] = ()
    #: Stopped at :data:`MAX_ROUNDS` or the horizon with requests still waiting.
    stopped_early: bool = False


class _Item:
    """One request in the simulation, and where it stands."""

    __slots__ = (
        "arrival",
        "attempt",
        "backend",
        "done",
        "drawn",
        "ending",
        "failed_runs",
        "followers",
        "outcome",
        "output",
        "prompt",
        "ref",
        "request",
        "reserved",
        "run",
        "stored",
        "token",
        "waiting",
    )

    def __init__(self, ref: int, arrival: Arrival) -> None:
        self.ref = ref
        self.arrival = arrival
        self.request = arrival.request
        self.waiting: Waiting | None = None
        self.attempt = 0
        self.run = 0
        self.failed_runs = 0
        self.backend: str | None = None
        self.reserved = 0
        #: Voids scheduled ends of a call cut short (a cancellation).
        self.token = 0
        self.drawn: Drawn | None = None
        #: How its current run ends: done, failed, or cut at its deadline.
        self.ending = _DONE
        self.done = False
        #: Stored on its level's subject, not read yet (its router's hold is full).
        self.stored = False
        self.outcome: Outcome | None = None
        self.followers: list[_Item] = []
        recorded = arrival.recorded
        self.output = recorded.output_tokens if recorded.kind == "completed" else None
        self.prompt = recorded.prompt_tokens if recorded.kind == "completed" else None


class _Simulator:
    def __init__(
        self,
        trace: Trace,
        config: Config,
        models: Mapping[str, BackendModel],
        seed: int,
        max_rounds: int,
    ) -> None:
        self.trace = trace
        self.config = config
        self.models = models
        self.seed = seed
        self.max_rounds = max_rounds
        self.policy = config.plan_policy()
        self.estimators = config.estimators()
        self.splits: dict[str, SplitPolicy] = {
            name: route.ab.policy(name) for name, route in config.routes.items() if route.ab
        }
        self.failure_policy = config.worker.failure_policy()
        self.gap = max(parse_duration(config.router.capacity_refresh), 1e-3)
        self.state: ProjectionState = trace.prior
        self.names = list(config.backends)
        self.in_flight = dict.fromkeys(self.names, 0)
        self.items = [_Item(ref, arrival) for ref, arrival in enumerate(trace.arrivals)]
        self.by_key = {item.arrival.key: item for item in self.items}
        #: The requests the router holds, by ref; how many per level; and per
        #: level those stored but not read yet (the hold was full).
        self.waiting: dict[int, _Item] = {}
        self.held: dict[str, int] = {}
        self.stream: dict[str, collections.deque[_Item]] = {}
        self.hold_limit = config.router.hold_limit
        #: Requests were read into the hold since the last round.
        self.admitted = False
        self.queue: list[tuple[float, int, int, int, int]] = []
        self.order = 0
        self.now = trace.since
        self.rounds = 0
        self.runs = 0
        self.assumed: set[str] = set()
        self.wake_at = math.inf
        self.rng = random.Random(f"{seed}:jitter")

    # ------------------------------------------------------------- the loop

    def push(self, at: float, kind: int, ref: int = -1, token: int = 0) -> None:
        self.order += 1
        heapq.heappush(self.queue, (at, kind, self.order, ref, token))

    def run(self) -> Simulation:
        for busy in self.trace.busy:
            if busy.backend in self.in_flight and (busy.until is None or busy.until > self.now):
                self.in_flight[busy.backend] += 1
                if busy.until is not None:
                    self.push(busy.until, _FREE, self.names.index(busy.backend))
        for item in self.items:
            self.push(item.arrival.at, _ARRIVE, item.ref)
        last = max((item.arrival.at for item in self.items), default=self.trace.until)
        end = max(last, self.trace.until) + HORIZON
        stopped = False
        while self.queue:
            at = self.queue[0][0]
            if at > end or self.rounds >= self.max_rounds:
                stopped = bool(self.waiting) or any(not item.done for item in self.items)
                break
            self.now = max(self.now, at)
            while self.queue and self.queue[0][0] <= at:
                _, kind, _, ref, token = heapq.heappop(self.queue)
                self.handle(kind, ref, token)
            if self.waiting:
                self.round()
        outcomes = tuple(item.outcome or self.unfinished(item) for item in self.items)
        return Simulation(
            outcomes=outcomes,
            rounds=self.rounds,
            runs=self.runs,
            assumed=tuple(sorted(self.assumed)),
            stopped_early=stopped,
        )

    def handle(self, kind: int, ref: int, token: int) -> None:
        if kind == _FREE:
            # A slot frees: a call's release passed, or one running at the start ended.
            name = self.names[ref]
            self.in_flight[name] = max(0, self.in_flight[name] - 1)
        elif kind == _ARRIVE:
            self.arrive(self.items[ref])
        elif kind == _READ:
            if not self.items[ref].done:
                self.store(self.items[ref])
        elif kind == _WAKE:
            if self.now >= self.wake_at:
                self.wake_at = math.inf
        else:
            item = self.items[ref]
            if item.done or token != item.token:
                return  # its call was cut short, or it ended otherwise
            if kind == _END:
                self.call_ended(item)
            elif kind == _RERUN:
                self.start_run(item)
            elif kind == _CANCEL:
                self.cancel(item)

    def fold(self, event: Event) -> None:
        self.state = fold(self.state, event)

    # ------------------------------------------------------------ arrivals

    def arrive(self, item: _Item) -> None:
        """``item`` is stored on its level's subject: a router reads it when
        its hold for that level has room (``router.hold_limit``)."""
        if item.arrival.cancelled_at is not None:
            self.push(item.arrival.cancelled_at, _CANCEL, item.ref, item.token)
        leader = self.leader_of(item)
        if leader is not None:
            leader.followers.append(item)
            return
        read_at = item.arrival.read_at
        if read_at is not None and read_at > self.now:
            # The services' reading delay, as the log shows it for this request.
            self.push(read_at, _READ, item.ref)
        else:
            self.store(item)

    def store(self, item: _Item) -> None:
        """``item`` waits on its level's subject (new, or put back to routing)."""
        level = item.arrival.request.priority
        if self.held.get(level, 0) < self.hold_limit:
            self.admit(item)
        else:
            item.stored = True
            self.stream.setdefault(level, collections.deque()).append(item)

    def admit(self, item: _Item) -> None:
        """A router reads ``item``: rejects it, ends it if its deadline passed,
        or holds it for the planner."""
        item.stored = False
        if item.waiting is None and not self.first_read(item):
            return
        request, waiting = item.request, item.waiting
        assert waiting is not None
        if request.deadline is not None and self.now >= request.deadline:
            self.fold(_expired(request, self.now, "queued", DEADLINE_PASSED))
            self.end(item, "expired")
            return
        level = item.arrival.request.priority
        self.held[level] = self.held.get(level, 0) + 1
        self.waiting[item.ref] = item

    def first_read(self, item: _Item) -> bool:
        """Admission of a new request, as the router's: ``False`` if it is rejected."""
        request = item.request
        error = self.invalid(request)
        if error is not None:
            self.fold(_rejected(request, self.now, error))
            self.end(item, "rejected")
            return False
        budget = budget_of(request.tenant, self.policy.budgets)
        spent = self.spent_today(request.tenant)
        priced = [self.config.backends[name] for name in self.config.routes[request.route].backends]
        if refused(budget, spent) or not affordable(request, priced, budget, spent):
            assert budget is not None
            error = BudgetExhaustedError(
                request.tenant, budget.daily, spent, day_ends(self.now), request_id=request.id
            )
            self.fold(_rejected(request, self.now, error))
            self.end(item, "rejected")
            return False
        request = self.estimated(self.placed(request))
        item.request = request
        submitted = item.arrival.at
        self.fold(
            Submitted(request_id=request.id, tenant=request.tenant, at=submitted, request=request)
        )
        item.waiting = Waiting(
            ref=item.ref,
            request=request,
            rank=self.config.priority_rank(request.priority),
            submitted=submitted,
            parent=self.parent_of(request),
        )
        return True

    def unhold(self, item: _Item) -> None:
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

    def invalid(self, request: InferenceRequest) -> InvalidRequestError | None:
        """Why the router would reject ``request`` under this config (``None``: it would not)."""
        if request.priority not in self.config.priorities:
            return UnknownPriorityError(request.priority, request_id=request.id)
        try:
            validate(request, level=request.priority, tenant=request.tenant, config=self.config)
        except InvalidRequestError as exc:
            return exc
        return None

    def leader_of(self, item: _Item) -> _Item | None:
        """The simulated request whose call ``item`` shared in the log, while it runs."""
        leader_id = item.arrival.recorded.leader
        if leader_id is None:
            return None
        leader = self.by_key.get(f"{item.request.tenant}:{leader_id}")
        if leader is None or leader.done or leader is item or leader.arrival.at > item.arrival.at:
            return None
        return leader

    def estimated(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` with the tier its route's estimator gives it, as the router does."""
        rules = self.config.routes[request.route].complexity
        if rules is None or request.complexity is not None:
            return request
        highest = max(1, self.config.highest_tier(request.route))
        estimate = estimate_complexity(
            request,
            rules.thresholds,
            highest=highest,
            estimator=self.estimators.get(request.route),
        )
        return msgspec.structs.replace(request, complexity=estimate.tier)

    def placed(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` on its A/B split's arm, as the binder places it (a live
        split: rollbacks are not simulated)."""
        split = self.splits.get(request.route)
        if split is None:
            return request
        arm = place(split, None, request, lambda route: self.config.serves(request, route))
        if arm is None:
            return request
        return msgspec.structs.replace(request, route=arm, split=split.route)

    def parent_of(self, request: InferenceRequest) -> tuple[int, float] | None:
        if request.parent_id is None:
            return None
        parent = self.by_key.get(f"{request.tenant}:{request.parent_id}")
        if parent is None or (parent.waiting is None and not parent.done):
            return None  # not arrived yet: the router would find no submitted event
        level = parent.arrival.request.priority
        if level not in self.config.priorities:
            return None
        return self.config.priority_rank(level), parent.arrival.at

    def spent_today(self, tenant: str) -> float:
        """What a budget judges ``tenant`` by: its spend today and the estimated
        cost of its calls bound and not ended, as the router counts them."""
        spend = self.state.tenants.get(tenant)
        return 0.0 if spend is None else spend.spend_on(utc_day(self.now)) + spend.committed

    # --------------------------------------------------------------- rounds

    def views(self) -> dict[str, BackendView]:
        return {
            name: backend_view(
                name, backend, in_flight=self.in_flight[name], state=self.state.backends.get(name)
            )
            for name, backend in self.config.backends.items()
        }

    def round(self) -> None:
        self.rounds += 1
        views = self.views()
        spent = {
            tenant: self.spent_today(tenant)
            for tenant in {item.request.tenant for item in self.waiting.values()}
            if budget_of(tenant, self.policy.budgets) is not None
        }
        snapshot = [item.waiting for item in self.waiting.values() if item.waiting is not None]
        for action in plan(snapshot, views, self.now, self.policy, spent):
            item = self.items[action.ref]
            waiting = item.waiting
            if waiting is None:
                continue
            if isinstance(action, Promote):
                item.waiting = msgspec.structs.replace(waiting, promoted=action.promoted)
            elif isinstance(action, Inherit):
                item.waiting = msgspec.structs.replace(waiting, inherited=action.rank)
            elif isinstance(action, Expire):
                self.fold(_expired(item.request, self.now, "queued", action.reason))
                self.end(item, "expired")
            elif isinstance(action, Refuse):
                request = item.request
                error = BudgetExhaustedError(
                    request.tenant,
                    action.daily,
                    action.spent,
                    day_ends(self.now),
                    request_id=request.id,
                )
                self.fold(_rejected(request, self.now, error))
                self.end(item, "rejected")
            elif isinstance(action, Bind):
                self.bind(item, action)
            elif isinstance(action, Wait):
                self.promise(item, waiting, action)
        if self.waiting:
            self.schedule_wake()

    def promise(self, item: _Item, waiting: Waiting, action: Wait) -> None:
        """Keep a round's promise to wait for a cheaper candidate, as the router
        keeps it: from the first round that names that candidate."""
        if action.wait_for is None:
            return
        if waiting.waiting_for is None or waiting.waiting_for[0] != action.wait_for:
            item.waiting = msgspec.structs.replace(
                waiting, waiting_for=(action.wait_for, action.wait_start)
            )

    def schedule_wake(self) -> None:
        change = self.now if self.admitted else self.next_change()
        self.admitted = False
        wake = max(change, self.now + self.gap)
        if math.isfinite(wake) and wake < self.wake_at:
            self.wake_at = wake
            self.push(wake, _WAKE)

    def next_change(self) -> float:
        """The earliest moment a waiting request's decision may change with
        time alone (see the module docstring); ``inf``: none.

        It may be early (a round that changes nothing), never late: each
        backend's quota is judged once, for the smallest cost a waiting
        request reserves there; predictions are made without the quota (a
        quota's hold does not move with time, its end is judged apart)."""
        views = self.views()
        smallest: dict[str, Cost] = {}
        for item in self.waiting.values():
            names = self.policy.routes.get(item.request.route, ())
            cost = self.reservation(item.request, names, views)
            for name in names:
                known = smallest.get(name)
                if known is None or cost.tokens < known.tokens:
                    smallest[name] = cost
        times = [
            check(views[name].quota or Quota(), views[name].limits, cost, self.now).until
            for name, cost in smallest.items()
            if name in views and (views[name].limits or views[name].quota is not None)
        ]
        unlimited = {
            name: msgspec.structs.replace(view, limits=(), quota=None)
            for name, view in views.items()
        }
        times.extend(self.change_of(item, unlimited) for item in self.waiting.values())
        return min((at for at in times if self.now < at < math.inf), default=math.inf)

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

    def change_of(self, item: _Item, views: Mapping[str, BackendView]) -> float:
        """The earliest moment ``item``'s decision may change with time alone,
        its quotas aside (``views`` have none)."""
        now, request, waiting = self.now, item.request, item.waiting
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

    # ---------------------------------------------------------------- calls

    def bind(self, item: _Item, action: Bind) -> None:
        self.unhold(item)
        item.attempt += 1
        item.failed_runs = 0
        item.backend = action.backend
        item.reserved = action.reserved_tokens
        self.in_flight[action.backend] += 1
        request = item.request
        waiting = item.waiting
        assert waiting is not None
        self.fold(
            Routed(
                request_id=request.id,
                tenant=request.tenant,
                at=self.now,
                backend=action.backend,
                attempt=item.attempt,
                priority=self.policy.levels[action.effective_rank].name,
                queue_wait=self.now - waiting.submitted,
                reason=action.reason,
                reserved_tokens=action.reserved_tokens,
                probe=action.probe,
                predicted=action.predicted,
                estimated_cost=action.estimated_cost,
                split=request.split or "",
                arm=request.route if request.split is not None else "",
            )
        )
        self.start_run(item)

    def start_run(self, item: _Item) -> None:
        """A run of ``item`` on its backend begins now (its first, or a retry)."""
        request, backend = item.request, item.backend
        assert backend is not None
        if request.deadline is not None and self.now >= request.deadline:
            self.leave(item)
            self.fold(
                _expired(request, self.now, "dispatch", "deadline passed before the backend call")
            )
            self.end(item, "expired")
            return
        item.run += 1
        self.runs += 1
        model = self.models[backend]
        if model.assumed:
            self.assumed.add(backend)
        key = item.arrival.key
        tokens = self.output_tokens(item, model)
        draw = random.Random(f"{self.seed}:{key}:{backend}:{item.attempt}:{item.run}")
        drawn = model.draw(draw, tokens, self.now)
        own = item.arrival.refused.get(backend)
        if own is not None:
            drawn = Drawn(overhead=drawn.overhead, failure=own)
        item.drawn = drawn
        self.fold(
            Started(
                request_id=request.id,
                tenant=request.tenant,
                at=self.now,
                backend=backend,
                attempt=item.attempt,
                delivery=item.run,
                worker="whatif",
            )
        )
        length = drawn.failure.after if drawn.failure is not None else drawn.duration
        ends = self.now + drawn.overhead + length
        item.ending = _FAIL if drawn.failure is not None else _DONE
        if request.deadline is not None and ends > request.deadline:
            # The worker's call runs under a timeout of the time left: cut there.
            ends = max(request.deadline, self.now)
            item.ending = _CUT
        self.push(ends, _END, item.ref, item.token)

    def output_tokens(self, item: _Item, model: BackendModel) -> int:
        """``item``'s output: its real length when the log has it, else one of
        the backend's, capped by its ``max_tokens``."""
        tokens = item.output
        if tokens is None:
            draw = random.Random(f"{self.seed}:{item.arrival.key}:{model.name}:output")
            tokens = model.output(draw, item.arrival.at)
        cap = item.request.params.max_tokens
        return tokens if cap is None else min(tokens, cap)

    def call_ended(self, item: _Item) -> None:
        drawn = item.drawn
        assert drawn is not None
        if item.ending == _CUT:
            self.leave(item)
            self.fold(
                _expired(item.request, self.now, "running", "deadline passed during generation")
            )
            self.end(item, "expired")
        elif drawn.failure is not None:
            self.run_failed(item, drawn.failure)
        else:
            self.completed(item, drawn)

    def completed(self, item: _Item, drawn: Drawn) -> None:
        backend, request = item.backend, item.request
        assert backend is not None
        model = self.models[backend]
        output = self.output_tokens(item, model)
        prompt = item.prompt if item.prompt is not None else estimate_input_tokens(request)
        # The worker's own formula, with this config's prices.
        cost = self.config.backends[backend].cost(prompt, output)
        self.fold(
            Completed(
                request_id=request.id,
                tenant=request.tenant,
                at=self.now,
                backend=backend,
                attempt=item.attempt,
                delivery=item.run,
                text="",
                usage=Usage(prompt_tokens=prompt, completion_tokens=output),
                cost=cost,
                ttft=drawn.ttft,
                duration=drawn.duration,
                reserved_tokens=item.reserved,
            )
        )
        self.leave(item)
        self.end(item, "completed", backend=backend, cost=cost)

    def run_failed(self, item: _Item, failure: FailureRecord) -> None:
        """What the worker's failure policy makes of a failed run."""
        backend, request = item.backend, item.request
        assert backend is not None
        error = _error(failure, backend, self.now)
        error_class = str(error.failure) if isinstance(error, BackendError) else "internal"
        action = after_failure(
            error,
            failed_runs=item.failed_runs,
            policy=self.failure_policy,
            random=self.rng.random,
            route=self.route_facts(item),
        )
        item.failed_runs += 1
        rid, tenant, now, attempt = request.id, request.tenant, self.now, item.attempt
        if isinstance(action, Retry):
            delay = action.delay
            if request.deadline is not None:
                delay = min(delay, max(0.0, request.deadline - self.now))
            self.fold(
                Retrying(
                    request_id=rid,
                    tenant=tenant,
                    at=now,
                    backend=backend,
                    attempt=attempt,
                    delivery=item.run,
                    error_type=action.error_type,
                    reason=action.reason[:200],
                    retry_after=delay,
                    error_class=error_class,
                )
            )
            self.push(self.now + delay, _RERUN, item.ref, item.token)
        elif isinstance(action, RequeueElsewhere):
            exhausted = failure.exhausted_for
            hold = action.hold if action.hold is not None else (exhausted or 0.0)
            self.fold(
                Retrying(
                    request_id=rid,
                    tenant=tenant,
                    at=now,
                    backend=backend,
                    attempt=attempt,
                    delivery=item.run,
                    error_type=action.error_type,
                    reason=action.reason[:200],
                    retry_after=hold,
                    quota_exhausted_until=None if exhausted is None else self.now + exhausted,
                    requeued=True,
                    error_class=error_class,
                )
            )
            self.leave(item)
            self.requeue(item, item.request.fallback)
        elif isinstance(action, FallBack):
            self.fold(
                FellBack(
                    request_id=rid,
                    tenant=tenant,
                    at=now,
                    backend=backend,
                    attempt=attempt,
                    delivery=item.run,
                    error_type=action.error_type,
                    error_class=action.error_class,
                    reason=action.reason[:200],
                    fallback=action.fallback,
                    retry_after=failure.retry_after
                    if error_class == FailureClass.RATE_LIMITED
                    else 0.0,
                )
            )
            self.leave(item)
            self.requeue(item, action.fallback)
        else:
            self.fold(
                Failed(
                    request_id=rid,
                    tenant=tenant,
                    at=now,
                    backend=backend,
                    attempt=attempt,
                    error_type=action.error_type,
                    reason=action.reason[:200],
                    error_class=error_class,
                )
            )
            self.leave(item)
            self.end(item, "failed", backend=backend)

    def route_facts(self, item: _Item) -> RouteFacts | None:
        """The request's route and cascade state, as a worker gives them to the failure policy."""
        if item.backend is None:
            return None
        return self.config.route_facts(item.request, item.backend, probe=False, now=self.now)

    def requeue(self, item: _Item, fallback: Fallback | None) -> None:
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

    def leave(self, item: _Item) -> None:
        """``item``'s run left its backend: its slot is free for the next
        request once the run's drawn release has passed."""
        backend = item.backend
        if backend is None:
            return
        release = 0.0 if item.drawn is None else item.drawn.release
        if release > 0:
            self.push(self.now + release, _FREE, self.names.index(backend))
        else:
            self.in_flight[backend] = max(0, self.in_flight[backend] - 1)

    def cancel(self, item: _Item) -> None:
        stage = "queued"
        if item.backend is not None:
            stage = "running"
            self.leave(item)
        self.fold(
            Cancelled(
                request_id=item.request.id, tenant=item.request.tenant, at=self.now, stage=stage
            )
        )
        self.end(item, "cancelled")

    # -------------------------------------------------------------- endings

    def end(self, item: _Item, kind: str, *, backend: str | None = None, cost: float = 0.0) -> None:
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
            at=self.now,
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

    def unfinished(self, item: _Item) -> Outcome:
        request = item.arrival.request
        return Outcome(
            request_id=request.id,
            tenant=request.tenant,
            level=request.priority,
            deadline=request.deadline,
        )


def _rejected(request: InferenceRequest, at: float, error: InvalidRequestError) -> Rejected:
    return Rejected(
        request_id=request.id,
        tenant=request.tenant,
        at=at,
        error_type=error.code,
        reason=str(error)[:200],
    )


def _expired(request: InferenceRequest, at: float, stage: str, reason: str) -> Expired:
    return Expired(request_id=request.id, tenant=request.tenant, at=at, stage=stage, reason=reason)


_ERRORS: Final[dict[str, type[BackendError]]] = {
    "backend_unavailable": RetryableBackendError,
    "backend_fatal": FatalBackendError,
    "backend_bad_request": BadRequestError,
}


def _error(failure: FailureRecord, backend: str, now: float) -> Exception:
    """The error a recorded failure stands for, as an adapter would raise it."""
    try:
        failure_class: FailureClass | None = FailureClass(failure.error_class)
    except ValueError:
        failure_class = None
    if failure.error_type == "rate_limited" or failure_class in (
        FailureClass.RATE_LIMITED,
        FailureClass.QUOTA_EXHAUSTED,
    ):
        exhausted = failure_class is FailureClass.QUOTA_EXHAUSTED or (
            failure.exhausted_for is not None
        )
        return RateLimitedError(
            "rate limited (simulated)",
            backend=backend,
            retry_after=failure.retry_after or None,
            quota_exhausted=exhausted,
            quota_exhausted_until=None
            if failure.exhausted_for is None
            else now + failure.exhausted_for,
        )
    kind = _ERRORS.get(failure.error_type)
    if kind is None and failure_class is None:
        return RuntimeError("worker error (simulated)")
    return (kind or RetryableBackendError)(
        f"{failure.error_type} (simulated)", backend=backend, failure=failure_class
    )


def simulate(
    trace: Trace,
    config: Config,
    models: Mapping[str, BackendModel],
    *,
    seed: int = 0,
    max_rounds: int = MAX_ROUNDS,
) -> Simulation:
    """Run ``trace``'s requests through the planner under ``config``, on
    ``models`` (one per backend of ``config``: :func:`~renqueue.sim.fit_models`).

    Deterministic: the same arguments give the same :class:`Simulation`. Each
    run's draws are seeded by ``seed``, its request, backend, attempt and run,
    so two configs that make the same choice for a request draw the same call.
    """
    return _Simulator(trace, config, models, seed, max_rounds).run()
