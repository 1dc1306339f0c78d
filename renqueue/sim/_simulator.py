"""The what-if simulator: a recorded workload run through the planner under a
config, in simulated time.

:func:`simulate` is a discrete-event simulation, pure and deterministic for a
seed (no NATS, no clock, no sleep). Each request of a :class:`~renqueue.sim.Trace`
arrives when it really did. The simulated services follow the services' own
rules, through the same functions (one copy of each rule, in
:mod:`renqueue.policy`, :mod:`renqueue.schema` and the config), and are in
parts:

- what they share (``_world``): simulated time and the happenings scheduled
  in it, the requests, the backends' slots, and the projection;
- the router's intake (``_arrivals``): a request is stored on its level's
  subject, read into the router's hold when it has room, admitted or
  rejected as the router admits it (and placed on its A/B arm, given its
  complexity estimate), expired if its deadline passed before it was read,
  cancelled at the moment the log says; a request that shared a call
  (coalescing) shares its leader's again, when the leader is in the trace;
- the router's rounds (``_rounds``): the real one, :func:`renqueue.policy.plan`,
  over :class:`~renqueue.policy.Waiting` requests and views built as the
  router builds them (:func:`~renqueue.sim.backend_view`); an
  :class:`~renqueue.policy.Expire` ends a request expired, a
  :class:`~renqueue.policy.Refuse` rejects it;
- the workers (``_calls``): a :class:`~renqueue.policy.Bind` takes one of the
  backend's slots (``limits.concurrency``) and spends its quota; the call's
  times come from the backend's model (:class:`~renqueue.sim.BackendModel`,
  fitted from the log), for the request's real output length when the log
  has it; a call still running at the request's deadline is cut there and
  expires, as the worker cuts it; a run may fail as the backend's runs
  failed in the log, and the worker's failure policy
  (:func:`renqueue.policy.after_failure`, with the route facts the worker
  gives it, its probe flag included) decides what follows: a retry on the
  same backend after its delay (the slot held meanwhile), a fallback to
  another candidate (the request waits again, keeping its wait), a requeue
  past a spent quota, or a failure.

Everything the simulated services do is an event, built by the services' own
constructors and folded into the simulation's own projection with the live
fold (:func:`renqueue.state.fold`): the quota a round judges (reserved at each
decision, reconciled with the usage at each completion, cooled down after a
429), the speed model (:func:`~renqueue.policy.learn_call`,
:func:`~renqueue.policy.learn_fault`), the mean call duration and each
tenant's spend today (for budgets) are exactly what the live projection would
hold after the same events. It starts from the projection of the warm-up
before the trace (``Trace.prior``), with the calls then running holding their
slots until they really ended.

Rounds happen when something arrives or ends, and whenever a waiting
request's decision may change with time alone: a deadline, an aging
promotion, a quota window making room, a fallback's backoff ending, a promise
to wait for a backend becoming overdue, the moment a candidate stops being
predicted in time (against the deadline, or a level's patience). Not
simulated: preemption, circuit breakers (so no bind is a half-open circuit's
probe), work stealing, A/B rollbacks, and 429s beyond the rates the log shows
(docs/what-if.md).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Final

from ..config import Config
from ._arrivals import Arrivals
from ._calls import Calls
from ._models import BackendModel
from ._outcomes import Outcome, Simulation
from ._rounds import Rounds
from ._trace import Trace
from ._world import ARRIVE, CANCEL, END, FREE, READ, RERUN, WAKE, Item, World

__all__ = ["HORIZON", "MAX_ROUNDS", "Outcome", "Simulation", "simulate"]

#: How long past its last arrival a simulation may run (seconds): a request
#: waiting for a daily window still gets its turn.
HORIZON: Final = 2 * 86_400.0
#: Rounds after which a simulation stops, whatever still waits (a guard: a
#: config whose waits never end must not hold the command forever).
MAX_ROUNDS: Final = 2_000_000


class _Simulator:
    """The event loop: each happening in time order, handed to the part it
    concerns; a round after each moment while requests wait."""

    def __init__(
        self,
        trace: Trace,
        config: Config,
        models: Mapping[str, BackendModel],
        seed: int,
        max_rounds: int,
    ) -> None:
        self.max_rounds = max_rounds
        self.world = World(trace, config, models, seed)
        self.arrivals = Arrivals(self.world)
        self.calls = Calls(self.world, self.arrivals)
        self.rounds = Rounds(self.world, self.arrivals, self.calls)

    def run(self) -> Simulation:
        world = self.world
        trace = world.trace
        for busy in trace.busy:
            if busy.backend in world.in_flight and (busy.until is None or busy.until > world.now):
                world.in_flight[busy.backend] += 1
                if busy.until is not None:
                    world.push(busy.until, FREE, world.names.index(busy.backend))
        for item in world.items:
            world.push(item.arrival.at, ARRIVE, item.ref)
        last = max((item.arrival.at for item in world.items), default=trace.until)
        end = max(last, trace.until) + HORIZON
        stopped = False
        queue = world.queue
        while queue:
            at = queue[0][0]
            if at > end or self.rounds.rounds >= self.max_rounds:
                stopped = bool(self.arrivals.waiting) or any(not item.done for item in world.items)
                break
            world.now = max(world.now, at)
            while queue and queue[0][0] <= at:
                _, kind, _, ref, token = heapq.heappop(queue)
                self.handle(kind, ref, token)
            if self.arrivals.waiting:
                self.rounds.round()
        return Simulation(
            outcomes=tuple(item.outcome or _unfinished(item) for item in world.items),
            rounds=self.rounds.rounds,
            runs=self.calls.runs,
            assumed=tuple(sorted(self.calls.assumed)),
            stopped_early=stopped,
        )

    def handle(self, kind: int, ref: int, token: int) -> None:
        world = self.world
        if kind == FREE:
            # A slot frees: a call's release passed, or one running at the start ended.
            name = world.names[ref]
            world.in_flight[name] = max(0, world.in_flight[name] - 1)
        elif kind == ARRIVE:
            self.arrivals.arrive(world.items[ref])
        elif kind == READ:
            if not world.items[ref].done:
                self.arrivals.store(world.items[ref])
        elif kind == WAKE:
            if world.now >= self.rounds.wake_at:
                self.rounds.wake_at = math.inf
        else:
            item = world.items[ref]
            if item.done or token != item.token:
                return  # its call was cut short, or it ended otherwise
            if kind == END:
                self.calls.call_ended(item)
            elif kind == RERUN:
                self.calls.start_run(item)
            elif kind == CANCEL:
                self.calls.cancel(item)


def _unfinished(item: Item) -> Outcome:
    request = item.arrival.request
    return Outcome(
        request_id=request.id,
        tenant=request.tenant,
        level=request.priority,
        deadline=request.deadline,
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
