"""What the parts of a simulation share (:mod:`renqueue.sim._simulator`):
simulated time and the happenings scheduled in it, the requests (one
:class:`Item` each, and where it stands), the backends' slots, and the
projection every event of the simulated services is folded into with the
live fold (:func:`renqueue.state.fold`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping
from typing import Final

from ..config import Config
from ..policy import PlanPolicy, Waiting
from ..schema import ComplexityEstimate, Event, InferenceRequest, Run
from ..state import ProjectionState, fold, utc_day
from ._models import BackendModel, Drawn
from ._outcomes import Outcome
from ._trace import Arrival, Trace

__all__ = [
    "ARRIVE",
    "CANCEL",
    "CUT",
    "DONE",
    "END",
    "FAIL",
    "FREE",
    "READ",
    "RERUN",
    "WAKE",
    "Item",
    "World",
]

# Kinds of scheduled happenings, in the order they are handled at one moment.
FREE, END, RERUN, CANCEL, ARRIVE, READ, WAKE = range(7)
#: How a run ends: done, failed, or cut at its request's deadline.
DONE: Final = "done"
FAIL: Final = "fail"
CUT: Final = "cut"


class Item:
    """One request in the simulation, and where it stands."""

    __slots__ = (
        "arrival",
        "attempt",
        "backend",
        "done",
        "drawn",
        "ending",
        "estimate",
        "failed_runs",
        "followers",
        "outcome",
        "output",
        "probe",
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
        self.request: InferenceRequest = arrival.request
        self.waiting: Waiting | None = None
        #: The tier its route's estimator gave it, when it named none.
        self.estimate: ComplexityEstimate | None = None
        #: Its dispatch's attempt (one per bind), its runs over its life, the
        #: runs of this attempt that failed.
        self.attempt = 0
        self.run = 0
        self.failed_runs = 0
        self.backend: str | None = None
        #: Its run is the probe of its backend's half-open circuit (``Bind.probe``).
        self.probe = False
        self.reserved = 0
        #: Voids scheduled ends of a call cut short (a cancellation).
        self.token = 0
        self.drawn: Drawn | None = None
        #: How its current run ends: done, failed, or cut at its deadline.
        self.ending = DONE
        self.done = False
        #: Stored on its level's subject, not read yet (its router's hold is full).
        self.stored = False
        self.outcome: Outcome | None = None
        self.followers: list[Item] = []
        recorded = arrival.recorded
        self.output = recorded.output_tokens if recorded.kind == "completed" else None
        self.prompt = recorded.prompt_tokens if recorded.kind == "completed" else None


class World:
    """Simulated time, the requests, the backends' slots and the projection."""

    def __init__(
        self, trace: Trace, config: Config, models: Mapping[str, BackendModel], seed: int
    ) -> None:
        self.trace = trace
        self.config = config
        self.models = models
        self.seed = seed
        self.policy: PlanPolicy = config.plan_policy()
        self.state: ProjectionState = trace.prior
        self.names = list(config.backends)
        #: Slots taken per backend.
        self.in_flight = dict.fromkeys(self.names, 0)
        self.items = [Item(ref, arrival) for ref, arrival in enumerate(trace.arrivals)]
        self.by_key = {item.arrival.key: item for item in self.items}
        #: Scheduled happenings: (at, kind, order, ref, token).
        self.queue: list[tuple[float, int, int, int, int]] = []
        self.order = 0
        self.now = trace.since
        #: The random source of the failure policy's jitter.
        self.rng = random.Random(f"{seed}:jitter")

    def push(self, at: float, kind: int, ref: int = -1, token: int = 0) -> None:
        """Schedule a happening of ``kind`` at ``at`` (for item ``ref``, with its ``token``)."""
        self.order += 1
        heapq.heappush(self.queue, (at, kind, self.order, ref, token))

    def fold(self, event: Event) -> None:
        """One event of the simulated services, folded into the projection."""
        self.state = fold(self.state, event)

    def run_of(self, item: Item) -> Run:
        """``item``'s current run on its backend."""
        backend = item.backend
        assert backend is not None
        request = item.request
        return Run(
            request_id=request.id,
            tenant=request.tenant,
            backend=backend,
            attempt=item.attempt,
            delivery=item.run,
        )

    def spent_today(self, tenant: str) -> float:
        """What a budget judges ``tenant`` by: its spend today and the estimated
        cost of its calls bound and not ended, as the router counts them."""
        spend = self.state.tenants.get(tenant)
        return 0.0 if spend is None else spend.spend_on(utc_day(self.now)) + spend.committed
