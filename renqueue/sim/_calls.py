"""The workers' side of a simulation: runs on backends, and how each ends.

A :class:`~renqueue.policy.Bind` takes one of the backend's slots
(``limits.concurrency``) and spends its quota; the call's times come from the
backend's model (:class:`~renqueue.sim.BackendModel`), for the request's real
output length when the log has it. A call still running at the request's
deadline is cut there and expires, as the worker cuts it. A run may fail as
the backend's runs failed in the log (:func:`error_of` gives the error an
adapter would have raised); what follows is the worker's own decision and
record of it, from the same functions: :func:`renqueue.policy.after_failure`
over the route facts the worker gives it (:meth:`renqueue.config.Config.route_facts`,
with the run's probe flag), the cool-down after a 429
(:func:`~renqueue.policy.cool_down_for`), how long a backend whose quota is
spent is left out (:func:`~renqueue.policy.left_out_for`), and a request put
back to routing too often (:func:`~renqueue.policy.put_back_refused`).
"""

from __future__ import annotations

import random
from typing import Final

from ..errors import (
    BackendError,
    BadRequestError,
    FailureClass,
    FatalBackendError,
    RateLimitedError,
    RetryableBackendError,
)
from ..policy import (
    Bind,
    FallBack,
    RequeueElsewhere,
    Retry,
    RouteFacts,
    after_failure,
    cancelled_at_worker,
    cancelled_waiting,
    cool_down_for,
    error_class_of,
    estimate_input_tokens,
    exhausted_until,
    expired_before_call,
    expired_running,
    left_out_for,
    past_deadline,
    put_back_refused,
)
from ..schema import Failed, Usage, routed
from ._arrivals import Arrivals
from ._models import BackendModel, Drawn
from ._trace import FailureRecord
from ._world import CUT, DONE, END, FAIL, FREE, RERUN, Item, World

__all__ = ["Calls", "error_of"]


class Calls:
    """Runs on backends and their endings (module docstring)."""

    def __init__(self, world: World, arrivals: Arrivals) -> None:
        self.world = world
        self.arrivals = arrivals
        self.failure_policy = world.config.worker.failure_policy()
        #: Backend runs simulated.
        self.runs = 0
        #: Backends some run was simulated on with an assumed model.
        self.assumed: set[str] = set()

    def bind(self, item: Item, action: Bind) -> None:
        """Carry out a round's binding: the router's ``routed``, then the run."""
        world = self.world
        self.arrivals.unhold(item)
        item.attempt += 1
        item.failed_runs = 0
        item.backend = action.backend
        item.probe = action.probe
        item.reserved = action.reserved_tokens
        world.in_flight[action.backend] += 1
        waiting = item.waiting
        assert waiting is not None
        world.fold(
            routed(
                item.request,
                at=world.now,
                backend=action.backend,
                attempt=item.attempt,
                priority=world.config.priorities[waiting.rank],
                queue_wait=max(0.0, world.now - waiting.submitted),
                reason=action.reason,
                reserved_tokens=action.reserved_tokens,
                probe=action.probe,
                complexity_estimate=item.estimate,
                predicted=action.predicted,
                estimated_cost=action.estimated_cost,
            )
        )
        self.start_run(item)

    def start_run(self, item: Item) -> None:
        """A run of ``item`` on its backend begins now (its first, or a retry)."""
        world, request, backend = self.world, item.request, item.backend
        assert backend is not None
        if past_deadline(request, world.now):
            self.leave(item)
            world.fold(expired_before_call(world.run_of(item), world.now))
            self.arrivals.end(item, "expired")
            return
        item.run += 1
        self.runs += 1
        model = world.models[backend]
        if model.assumed:
            self.assumed.add(backend)
        key = item.arrival.key
        tokens = self.output_tokens(item, model)
        draw = random.Random(f"{world.seed}:{key}:{backend}:{item.attempt}:{item.run}")
        drawn = model.draw(draw, tokens, world.now)
        own = item.arrival.refused.get(backend)
        if own is not None:
            drawn = Drawn(overhead=drawn.overhead, failure=own)
        item.drawn = drawn
        world.fold(world.run_of(item).started(at=world.now, worker="whatif"))
        length = drawn.failure.after if drawn.failure is not None else drawn.duration
        ends = world.now + drawn.overhead + length
        item.ending = FAIL if drawn.failure is not None else DONE
        if request.deadline is not None and ends > request.deadline:
            # The worker's call runs under a timeout of the time left: cut there.
            ends = max(request.deadline, world.now)
            item.ending = CUT
        world.push(ends, END, item.ref, item.token)

    def output_tokens(self, item: Item, model: BackendModel) -> int:
        """``item``'s output: its real length when the log has it, else one of
        the backend's, capped by its ``max_tokens``."""
        tokens = item.output
        if tokens is None:
            draw = random.Random(f"{self.world.seed}:{item.arrival.key}:{model.name}:output")
            tokens = model.output(draw, item.arrival.at)
        cap = item.request.params.max_tokens
        return tokens if cap is None else min(tokens, cap)

    def call_ended(self, item: Item) -> None:
        """``item``'s run ends as it was drawn: done, failed, or cut at its deadline."""
        drawn = item.drawn
        assert drawn is not None
        if item.ending == CUT:
            self.leave(item)
            self.world.fold(expired_running(self.world.run_of(item), self.world.now))
            self.arrivals.end(item, "expired")
        elif drawn.failure is not None:
            self.run_failed(item, drawn.failure)
        else:
            self.completed(item, drawn)

    def completed(self, item: Item, drawn: Drawn) -> None:
        world, backend, request = self.world, item.backend, item.request
        assert backend is not None
        model = world.models[backend]
        output = self.output_tokens(item, model)
        prompt = item.prompt if item.prompt is not None else estimate_input_tokens(request)
        # The worker's own formula, with this config's prices.
        cost = world.config.backends[backend].cost(prompt, output)
        world.fold(
            world.run_of(item).completed(
                at=world.now,
                text="",
                usage=Usage(prompt_tokens=prompt, completion_tokens=output),
                cost=cost,
                ttft=drawn.ttft,
                duration=drawn.duration,
                reserved_tokens=item.reserved,
            )
        )
        self.leave(item)
        self.arrivals.end(item, "completed", backend=backend, cost=cost)

    def run_failed(self, item: Item, failure: FailureRecord) -> None:
        """What the worker's failure policy makes of a failed run, recorded as
        the worker records it: a retry here after its delay (the slot held
        meanwhile), back to routing (a fallback, a spent quota: the request
        waits again, keeping its wait), or the request fails."""
        world, request = self.world, item.request
        run = world.run_of(item)
        now = world.now
        error = error_of(failure, run.backend, now)
        action = after_failure(
            error,
            failed_runs=item.failed_runs,
            policy=self.failure_policy,
            random=world.rng.random,
            route=self.route_facts(item),
            deadline=request.deadline,
            now=now,
        )
        item.failed_runs += 1
        if isinstance(action, FallBack | RequeueElsewhere):
            refused = put_back_refused(action, item.attempt)
            if refused is not None:
                failed = run.failed(
                    at=now,
                    error_type=refused.error_type,
                    reason=refused.reason,
                    error_class=action.error_class if isinstance(action, FallBack) else "",
                    quota_exhausted_until=exhausted_until(error),
                )
                self.failed(item, failed)
                return
        if isinstance(action, Retry):
            world.fold(
                run.retrying(
                    at=now,
                    error_type=action.error_type,
                    reason=action.reason,
                    retry_after=action.delay,
                    error_class=error_class_of(error),
                    quota_exhausted_until=exhausted_until(error),
                )
            )
            world.push(now + action.delay, RERUN, item.ref, item.token)
        elif isinstance(action, RequeueElsewhere):
            world.fold(
                run.retrying(
                    at=now,
                    error_type=action.error_type,
                    reason=action.reason,
                    retry_after=left_out_for(action, error, now),
                    quota_exhausted_until=exhausted_until(error),
                    requeued=True,
                )
            )
            self.leave(item)
            self.arrivals.requeue(item, request.fallback)
        elif isinstance(action, FallBack):
            world.fold(
                run.fell_back(
                    at=now,
                    error_type=action.error_type,
                    error_class=action.error_class,
                    reason=action.reason,
                    fallback=action.fallback,
                    probe=item.probe,
                    retry_after=cool_down_for(action, error, self.failure_policy, world.rng.random),
                )
            )
            self.leave(item)
            self.arrivals.requeue(item, action.fallback)
        else:
            failed = run.failed(
                at=now,
                error_type=action.error_type,
                reason=action.reason,
                error_class=error_class_of(error),
            )
            self.failed(item, failed)

    def failed(self, item: Item, event: Failed) -> None:
        """``item`` fails for good on its backend (``event``)."""
        self.world.fold(event)
        self.leave(item)
        self.arrivals.end(item, "failed", backend=event.backend)

    def route_facts(self, item: Item) -> RouteFacts | None:
        """The request's route and cascade state, as a worker gives them to the
        failure policy (the run's probe flag included)."""
        if item.backend is None:
            return None
        return self.world.config.route_facts(
            item.request, item.backend, probe=item.probe, now=self.world.now
        )

    def leave(self, item: Item) -> None:
        """``item``'s run left its backend: its slot is free for the next
        request once the run's drawn release has passed."""
        world, backend = self.world, item.backend
        if backend is None:
            return
        release = 0.0 if item.drawn is None else item.drawn.release
        if release > 0:
            world.push(world.now + release, FREE, world.names.index(backend))
        else:
            world.in_flight[backend] = max(0, world.in_flight[backend] - 1)

    def cancel(self, item: Item) -> None:
        """``item`` is cancelled now: by its router while it waits, by its
        worker once it was bound."""
        world = self.world
        if item.backend is not None:
            self.leave(item)
            world.fold(cancelled_at_worker(world.run_of(item), world.now, "running"))
        else:
            world.fold(cancelled_waiting(item.request, world.now))
        self.arrivals.end(item, "cancelled")


_ERRORS: Final[dict[str, type[BackendError]]] = {
    "backend_unavailable": RetryableBackendError,
    "backend_fatal": FatalBackendError,
    "backend_bad_request": BadRequestError,
}


def error_of(failure: FailureRecord, backend: str, now: float) -> Exception:
    """The error a recorded failure stands for, as an adapter would raise it at ``now``."""
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
