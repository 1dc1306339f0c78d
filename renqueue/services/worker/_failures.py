"""What a failed run leads to: decided, recorded, carried out.

What a failed run leads to is the failure policy's decision
(:func:`renqueue.policy.after_failure`): transient failures (rate-limited,
server errors, worker errors) are retried with a delayed hand-back (the
provider's ``retry-after``, else a capped, jittered backoff) and a
``retrying`` event; a failure its route falls back on puts the request back
to routing with a ``fell_back`` event; a provider that says its quota is
spent (hours away) gets a ``retrying`` event that says ``requeued``, and the
request goes back to routing for another candidate, keeping its wait (as
after a preemption), instead of waiting for the reset here; anything else,
or a run past the budget, fails the request. The budget,
``worker.max_deliver`` failed runs per dispatch, is counted from those
events, so redeliveries for other reasons (a worker killed or shut down, a
broker that does not answer: handed back after the same backoff by
delivery count) do not use it up.

:class:`Failures` turns the exception of a run into that action, records its
event and answers the delivery through :class:`~._outcomes.Outcomes`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from ... import metrics
from ...backends.base import Backend
from ...broker import EventLog
from ...errors import BackendError, NatsPayloadTooLargeError, NatsUnavailableError
from ...logs import get_logger
from ...policy import (
    INTERNAL,
    FailureAction,
    FailurePolicy,
    FallBack,
    RequeueElsewhere,
    Retry,
    RouteFacts,
    after_failure,
    cool_down_for,
    error_class_of,
    exhausted_until,
    left_out_for,
    put_back_refused,
)
from ...schema import Dispatch, Retrying
from ._call import reported_limits
from ._delivery import Delivery
from ._outcomes import Outcomes

__all__ = ["Failures"]

log = get_logger("worker")


class Failures:
    """Handles the failed runs of one backend's worker."""

    def __init__(
        self,
        events: EventLog,
        outcomes: Outcomes,
        backend_name: str,
        *,
        backend: Backend,
        policy: FailurePolicy,
        route: Callable[[Dispatch], RouteFacts | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._events = events
        self._outcomes = outcomes
        self._backend_name = backend_name
        self._backend = backend
        self._policy = policy
        #: The request's route and cascade state for the policy (the worker's).
        self._route = route
        self._clock = clock

    async def unexpected(self, delivery: Delivery, exc: Exception) -> None:
        """A bug mid-run: a failed run like any other, retried within the
        budget, then the request fails; if not even that can be recorded, the
        message is left for redelivery (the broker's delivery limit is the
        backstop). A broker that does not answer (a stream leader election, a
        reconnect) is not the request's failure: the run is handed back with a
        backoff that grows with its deliveries, and no retry is counted."""
        if _broker_unavailable(exc):
            delay = self._outcomes.backoff(delivery)
            log.warning("the broker did not answer mid-run; the request will run again",
                        error=repr(exc), retry_in=delay)  # fmt: skip
            await self._outcomes.hand_back(delivery, after=delay)
            return
        try:
            await self.after(delivery, exc)
        except Exception:
            log.exception("could not record the failed run; leaving the request for redelivery")
            await self._outcomes.hand_back(delivery)

    async def after(self, delivery: Delivery, exc: Exception) -> None:
        """Carry out what the failure policy decides for a failed run: retry it
        here after a delay, put it back to routing (a spent quota, a
        fallback), or fail the request (:func:`renqueue.policy.after_failure`).

        A run whose answer, as the services write it, is over the broker's
        ``max_payload`` fails at once: running it again would pay the backend
        for the same answer, which would not fit either."""
        if isinstance(exc, NatsPayloadTooLargeError):
            log.error(
                "the answer is over the broker's largest message; request fails", error=str(exc)
            )
            # Streamed, unless its client said it would not read the stream.
            streamed = delivery.dispatch.request.stream is not False
            await self._outcomes.fail(
                delivery,
                error_type="answer_too_large",
                reason=(
                    f"its answer was streamed, but is too big to record whole: {exc}"
                    if streamed
                    else f"its answer is too big to record whole (not streamed): {exc}"
                ),
                error_class=INTERNAL,
            )
            return
        action = await self._decide(delivery.dispatch, exc)
        internal = not isinstance(exc, BackendError)
        if isinstance(action, Retry):
            if internal:
                log.error("unexpected error; the request will run again",
                          exc_info=exc, delay=action.delay)  # fmt: skip
            else:
                log.warning("backend call failed; will retry", error=str(exc), delay=action.delay)
            await self._retry(delivery, action, exc)
        elif isinstance(action, RequeueElsewhere):
            await self._requeue_elsewhere(delivery, action, exc)
        elif isinstance(action, FallBack):
            await self._fall_back(delivery, action, exc)
        else:
            if internal:
                log.error("unexpected error on the last allowed run; request fails", exc_info=exc)
            else:
                log.error("request failed", error=str(exc), run=delivery.number)
            await self._outcomes.fail(
                delivery,
                error_type=action.error_type,
                reason=action.reason,
                error_class=error_class_of(exc),
            )

    async def _decide(self, dispatch: Dispatch, exc: Exception) -> FailureAction:
        """The failure policy's action for a run of ``dispatch`` that failed
        with ``exc``; a retry is never handed back past the request's deadline
        (it expires on time instead)."""
        return after_failure(
            exc,
            failed_runs=await self._failed_runs(dispatch),
            policy=self._policy,
            random=random.random,
            route=self._route(dispatch),
            deadline=dispatch.request.deadline,
            now=self._clock(),
        )

    async def _failed_runs(self, dispatch: Dispatch) -> int:
        """Runs of this dispatch (attempt) that failed and were retried, from the log."""
        request = dispatch.request
        retries = await self._events.history(request.tenant, request.id, kind="retrying")
        return sum(1 for e in retries if isinstance(e, Retrying) and e.attempt == dispatch.attempt)

    async def _retry(self, delivery: Delivery, action: Retry, exc: Exception) -> None:
        """Record the failed run (``retrying``: what the budget counts), then
        hand the delivery back after the action's delay.

        What the provider said of its limits goes with it, for every router.
        """
        retrying = delivery.run.retrying(
            at=self._clock(),
            error_type=action.error_type,
            reason=action.reason,
            retry_after=action.delay,
            error_class=error_class_of(exc),
            limits=reported_limits(self._backend),
            quota_exhausted_until=exhausted_until(exc),
        )
        await self._events.append(retrying)
        await delivery.hand_back(after=action.delay)

    async def _requeue_elsewhere(
        self, delivery: Delivery, action: RequeueElsewhere, exc: Exception
    ) -> None:
        """The provider's quota is spent: record why, then put the request back
        to routing, keeping its wait, for another candidate of its route.

        The ``retrying`` event (``requeued``, with what the provider said of
        its quota and how long this backend is left out) is stored *before*
        the copy is published: the binder reads it when it fetches the copy
        and binds nothing to this backend until the time it names, whatever
        its view of the projection says (see the router's admission and
        ledger). It is a failed run of this attempt only: the next dispatch is
        a new attempt, with a budget of its own. A put-back that fails is
        handed back (:meth:`Outcomes.put_back`); a redelivery of this dispatch
        finds the event and puts the request back again without calling the
        backend (the :class:`~._gate.Gate`). A request put back
        :data:`MAX_REQUEUES` times already cannot be put back again: it fails
        (``quota_exhausted``).
        """
        until = exhausted_until(exc)
        refused = put_back_refused(action, delivery.dispatch.attempt)
        if refused is not None:
            # Its copy would carry more requeues than admission accepts.
            log.error("quota exhausted and the request was put back too often; it fails")
            await self._outcomes.fail(
                delivery,
                error_type=refused.error_type,
                reason=refused.reason,
                exhausted_until=until,
            )
            return
        now = self._clock()
        hold = left_out_for(action, exc, now)
        log.warning(
            "backend quota exhausted; the request goes back to routing",
            error=str(exc),
            quota_exhausted_until=until,
            backend_left_out_for=round(hold, 3),
        )
        requeued = delivery.run.retrying(
            at=now,
            error_type=action.error_type,
            reason=action.reason,
            retry_after=hold,
            limits=reported_limits(self._backend),
            quota_exhausted_until=until,
            requeued=True,
        )
        await self._events.append(requeued)
        await self._outcomes.put_back(delivery)

    async def _fall_back(self, delivery: Delivery, action: FallBack, exc: Exception) -> None:
        """The backend failed the request in a way its route falls back on:
        record why (``fell_back``), then put it back to routing, keeping its
        wait, with where it may not go next (``InferenceRequest.fallback``).

        As for a spent quota (:meth:`_requeue_elsewhere`): the event is stored
        before the copy, a redelivery finds it and puts the request back
        again without a call, and a request put back :data:`MAX_REQUEUES`
        times already fails instead.
        """
        dispatch = delivery.dispatch
        refused = put_back_refused(action, dispatch.attempt)
        if refused is not None:
            log.error("the request fell back too often; it fails")
            await self._outcomes.fail(
                delivery,
                error_type=refused.error_type,
                reason=refused.reason,
                error_class=action.error_class,
            )
            return
        log.warning(
            "backend failed the request; it falls back down its route",
            error=action.reason,
            error_class=action.error_class,
            excluded=list(action.fallback.excluded),
            probe=dispatch.probe,
        )
        fell_back = delivery.run.fell_back(
            at=self._clock(),
            error_type=action.error_type,
            error_class=action.error_class,
            reason=action.reason,
            fallback=action.fallback,
            probe=dispatch.probe,
            limits=reported_limits(self._backend),
            retry_after=cool_down_for(action, exc, self._policy, random.random),
        )
        await self._events.append(fell_back)
        metrics.FALLBACKS.labels(self._backend_name, action.error_class).inc()
        await self._outcomes.put_back(delivery, fallback=action.fallback)


def _broker_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker did not answer (no stream leader, a
    reconnect, a timeout), rather than that something is wrong with the run."""
    return isinstance(exc, NatsUnavailableError | TimeoutError)
