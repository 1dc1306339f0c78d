"""The worker's failure policy: what to do after a run failed, as a plain function.

:func:`after_failure` takes the error a run ended with, how many runs of the
same dispatch failed before it (counted from the log's ``retrying`` events),
the worker's :class:`FailurePolicy`, and, for a request of a route, the
route's :class:`FallbackPolicy` and what is known of its candidates
(:class:`RouteFacts`). It answers one of:

- :class:`Retry`: run it again on the same backend after ``delay`` (a
  ``retrying`` event, then a delayed ``nak``).
- :class:`FallBack`: put the request back to routing, to be bound to another
  candidate of its route (a ``fell_back`` event, then the request on its
  level's requeue subject, keeping its wait), with the backends it must not
  go to and the constraints the next candidate must meet (a larger context
  window, no lower tier, free only).
- :class:`RequeueElsewhere`: the provider's quota is spent (hours away): put
  the request back to routing, and this backend is left out for everyone
  until the quota comes back (``hold`` when the provider did not say until
  when: its ``retry-after`` if longer, else ``quota_hold``). Not a fallback
  of the request's: it uses none of its attempts, and its next dispatch starts
  a budget of its own.
- :class:`Fail`: end the request ``failed`` (with a dead-letter copy).

The failure's class (:class:`~renqueue.errors.FailureClass`, set by the
adapter), not its exception type, decides:

1. A spent quota: :class:`RequeueElsewhere`, whatever the budget.
2. A class the route falls back on (``FallbackPolicy.on``):

   - a transient one of :data:`RETRY_HERE_FIRST` (a refused connection, a
     timeout before the first token, a silence, a 5xx, a malformed answer)
     is retried here first, ``FallbackPolicy.retries`` times, unless the run
     was a half-open circuit's probe (one probe decides);
   - an overloaded or rate-limited answer (:data:`WAIT_HERE_IF_ALONE`) is
     retried here, after the provider's ``retry-after`` (or the backoff),
     only when no other candidate could take the request (a route of one,
     or the others excluded): the provider said when to come back;
   - then, and at once for the others (overloaded, rate-limited, a backend
     that cannot serve, a context too long, a stream broken after tokens
     were sent, a whole call too long), :class:`FallBack`: the failed
     backend joins ``excluded``; a context-length failure asks for a larger
     window than the failed backend's; without ``downgrade`` the next
     candidate's tier may not be lower; without ``paid`` it must be free.
     ``excluded`` is a preference, not a rule: when no other candidate can
     take the request (down, open, out of quota, over its cost cap), the
     router binds it to one that failed it again, but not before
     ``not_before`` (the capped, jittered :func:`backoff` by fallbacks so
     far): the request waits for a backend to recover rather than fail, and
     never hammers the ones that failed. A context-length failure with no
     larger window anywhere fails; so does a failure with no candidate
     meeting the constraints at all.
   - Each fallback uses one of the request's ``FallbackPolicy.attempts``
     (backends tried, the first included), except after a 429 (the provider
     said "not now": the backend cools down for everyone, and the request
     is not charged) and after a failure as a half-open circuit's probe call
     (the backend's state, not the request's; ``probes`` counts them, and
     the router gives each probe to a waiting request that has failed as
     one the fewest times). With no attempt left: :class:`Fail`.
3. Any other class: a retryable one (see ``BackendError.retryable``) is
   retried here while the budget lasts; a bad request, a content filter or
   a backend that cannot serve fails at once.
4. A worker error (``internal``: any exception that is not a
   :class:`~renqueue.errors.BackendError`) is retried while the budget lasts.

The budget (``FailurePolicy.budget``, ``worker.max_deliver``) bounds the
runs of one dispatch whatever the class. A retry is never later than the
request's deadline (``deadline``): it expires on time instead.

The delay before a retry is the provider's ``retry-after`` when it gives a
usable one (finite and positive), **not capped**: it names the moment the
provider will take calls again, and a retry before it is a run certain to fail
(using up the budget) that may also extend the provider's penalty. Otherwise it
is a capped exponential backoff with *equal jitter*
(:func:`backoff`): for the ``n``-th failed run, ``d = min(max_retry_delay,
retry_delay * 2 ** (n - 1))`` and the delay is ``d / 2 + random() * d / 2``:
never more than the cap, never less than half the step, and spread so that
runs failed together (a backend outage) do not come back together.

The random source is a parameter (a function returning a float in ``[0, 1)``,
``random.random`` in the worker), so the policy is deterministic under test.

What the worker records of the answer, the what-if simulator records too,
from the same functions: the failure's class (:func:`error_class_of`), when a
spent quota comes back (:func:`exhausted_until`), how long a backend whose
quota is spent is left out (:func:`left_out_for`), how long one that answered
429 cools down (:func:`cool_down_for`), and the failure of a request that was
put back to routing too often to be put back again (:func:`put_back_refused`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import msgspec
from msgspec import Struct

from ..errors import BackendError, FailureClass, RateLimitedError
from ..schema import MAX_REQUEUES, ErrorType, Fallback, error_type_of
from ._features import ALL_FEATURES
from ._routing import meets

#: ``error_type`` of a failure that is the worker's, not the backend's.
INTERNAL: Final[ErrorType] = "internal"
#: ``error_type`` of a request that fails because its provider's quota is spent
#: and it cannot be put back to routing again (put back ``MAX_REQUEUES`` times).
QUOTA_EXHAUSTED: Final = "quota_exhausted"


class FailurePolicy(Struct, frozen=True, kw_only=True):
    """The rules :func:`after_failure` applies: the ``[worker]`` settings
    (:meth:`renqueue.config.WorkerConfig.failure_policy`)."""

    #: Runs of one dispatch that may fail before the request fails (``max_deliver``).
    budget: int = 5
    #: Seconds: the first backoff step (``retry_delay``), doubling per failed run.
    retry_delay: float = 1.0
    #: Seconds: the largest backoff (``max_retry_delay``); a provider's
    #: ``retry-after`` is not held to it.
    max_retry_delay: float = 30.0
    #: Seconds a backend whose provider says its quota is spent, without saying
    #: until when (OpenAI ``insufficient_quota``), is left out (``quota_hold``).
    quota_hold: float = 600.0


#: Transient classes worth a retry on the same backend before falling back.
RETRY_HERE_FIRST: Final = frozenset(
    {
        FailureClass.CONNECT,
        FailureClass.CONNECT_TIMEOUT,
        FailureClass.FIRST_TOKEN_TIMEOUT,
        FailureClass.STALL,
        FailureClass.SERVER_ERROR,
        FailureClass.MALFORMED,
    }
)

#: A request's 429 fallbacks use no attempt up to this many per attempt
#: (``fallback.attempts``); past that each uses one, so two backends answering
#: 429 to each other's fallbacks cannot pass a request between them forever.
_FREE_429S: Final = 3

#: The most backend names a failure's reason lists.
_NAMES_SHOWN: Final = 5

#: Classes that say "not now" (a 429, an overloaded server): they fall back at
#: once, unless no other candidate could take the request, and then it waits
#: here for the time the provider named (or the backoff), as the budget allows.
WAIT_HERE_IF_ALONE: Final = frozenset({FailureClass.RATE_LIMITED, FailureClass.OVERLOADED})

#: The classes a route falls back on unless its ``fallback.on`` says otherwise:
#: every one but a bad request and a content filter (no backend should be
#: asked again to take what one refused as invalid or unsafe).
DEFAULT_FALLBACK_ON: Final = frozenset(FailureClass) - {
    FailureClass.BAD_REQUEST,
    FailureClass.CONTENT_FILTER,
}


class FallbackPolicy(Struct, frozen=True, kw_only=True):
    """A route's fallback rules (``[routes.<name>.fallback]``)."""

    #: The failure classes that send a request down the route.
    on: frozenset[FailureClass] = DEFAULT_FALLBACK_ON
    #: Backends a request may be tried on (the first included); each
    #: fallback uses one.
    attempts: int = 3
    #: Retries on the same backend of a transient failure before falling back.
    retries: int = 1
    #: Whether a fallback may go to a lower tier than the backend that failed
    #: (recorded as a quality downgrade in the routing decision).
    downgrade: bool = True
    #: Whether a fallback may go to a paid backend (within the request's ``max_cost``).
    paid: bool = True


class Candidate(Struct, frozen=True, kw_only=True):
    """What the failure policy knows of one backend of the route."""

    name: str
    tier: int = 1
    #: Declared context window in tokens; ``None``: unknown.
    context_window: int | None = None
    #: Whether calls there cost money.
    paid: bool = False
    #: The estimated cost of this request there (US dollars), when known.
    cost: float | None = None
    #: What it can do beyond text (``policy.needs``).
    features: frozenset[str] = ALL_FEATURES


class RouteFacts(Struct, frozen=True, kw_only=True):
    """The route a failed request belongs to, as the failure policy needs it."""

    policy: FallbackPolicy
    #: Its candidates in cascade order.
    candidates: tuple[Candidate, ...]
    #: The backend whose run failed.
    backend: Candidate
    #: The request's place in the cascade so far.
    fallback: Fallback = Fallback()
    #: The failed run was the probe of a half-open circuit.
    probe: bool = False
    #: When it failed (Unix time): a backend that failed it may be tried again a backoff after.
    now: float = 0.0
    #: The request's ``complexity``: a candidate of a lower tier cannot take it.
    complexity: int | None = None
    #: The request's ``max_cost``: a candidate estimated above it cannot take it.
    max_cost: float | None = None
    #: What the request needs of a backend (``policy.needs``): a candidate
    #: without it cannot take it.
    needs: frozenset[str] = frozenset()


class Retry(Struct, frozen=True, kw_only=True, tag=True):
    """Run the request again on this backend after ``delay`` seconds."""

    delay: float
    #: The ``retrying`` event's ``error_type`` and ``reason``.
    error_type: ErrorType
    reason: str


class RequeueElsewhere(Struct, frozen=True, kw_only=True, tag=True):
    """Put the request back to routing, to be bound to another candidate of its route.

    The worker records a ``retrying`` event that says so (``requeued``, with
    ``error_type``, ``reason`` and what the provider said of its quota), then
    puts the request back on its level's requeue subject, keeping its wait.
    """

    error_type: ErrorType
    reason: str
    #: Seconds to leave this backend out when the provider did not say until
    #: when its quota comes back; ``None`` when it did (that time holds it).
    hold: float | None = None


class FallBack(Struct, frozen=True, kw_only=True, tag=True):
    """Put the request back to routing for another candidate of its route.

    The worker records a ``fell_back`` event (the failed backend, the class,
    the reason, ``fallback``), then puts the request back on its level's requeue
    subject, keeping its wait, with ``fallback`` as its ``InferenceRequest.fallback``.
    """

    error_type: ErrorType
    error_class: str
    reason: str
    #: The request's new place in the cascade: where it may not go next.
    fallback: Fallback


class Fail(Struct, frozen=True, kw_only=True, tag=True):
    """End the request ``failed`` (``error_type``, ``reason``), with a dead-letter copy."""

    error_type: ErrorType
    reason: str


FailureAction = Retry | FallBack | RequeueElsewhere | Fail


def backoff(step: int, policy: FailurePolicy, random: Callable[[], float]) -> float:
    """The jittered, capped delay before try ``step + 1`` (``step`` >= 1 tries failed).

    ``d = min(max_retry_delay, retry_delay * 2 ** (step - 1))``, then equal
    jitter: ``d / 2 + random() * d / 2``, in ``[d / 2, d)``.
    """
    exponent = min(max(step, 1) - 1, 62)
    ceiling = min(policy.max_retry_delay, policy.retry_delay * 2.0**exponent)
    return ceiling / 2 + random() * ceiling / 2


def retry_after(error: BaseException) -> float | None:
    """The provider's ``retry-after`` carried by ``error``, if it is usable.

    Finite and positive only: a zero says nothing about how long to wait (the
    backoff applies), and a non-finite value from a broken header must not
    become a delay.
    """
    value = getattr(error, "retry_after", None)
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def after_failure(
    error: BaseException,
    *,
    failed_runs: int,
    policy: FailurePolicy,
    random: Callable[[], float],
    route: RouteFacts | None = None,
    deadline: float | None = None,
    now: float = 0.0,
) -> FailureAction:
    """What to do after a run of a dispatch failed with ``error``.

    ``failed_runs``: runs of the same dispatch that failed before this one.
    ``route``: the request's route and cascade state; ``None``: no fallback
    (retry here or fail). ``deadline``: the request's (Unix time), judged at
    ``now``: a retry is never handed back past it. See the module docstring
    for the rules.
    """
    action = _decide(error, failed_runs=failed_runs, policy=policy, random=random, route=route)
    if isinstance(action, Retry) and deadline is not None:
        # Never handed back past its deadline: it expires on time instead.
        left = max(0.0, deadline - now)
        action = msgspec.structs.replace(action, delay=min(action.delay, left))
    return action


def _decide(
    error: BaseException,
    *,
    failed_runs: int,
    policy: FailurePolicy,
    random: Callable[[], float],
    route: RouteFacts | None,
) -> FailureAction:
    """:func:`after_failure`, its deadline aside."""
    failed = failed_runs + 1
    given = retry_after(error)
    if isinstance(error, RateLimitedError) and error.quota_exhausted:
        known = error.quota_exhausted_until is not None
        return RequeueElsewhere(
            error_type=error_type_of(error.code),
            reason=f"{str(error)[:1000]} (quota exhausted: back to routing)",
            hold=None if known else max(policy.quota_hold, given or 0.0),
        )
    if isinstance(error, BackendError):
        error_type, reason = error_type_of(error.code), str(error)[:1000]
        if route is not None and error.failure in route.policy.on:
            here = (
                error.failure in RETRY_HERE_FIRST
                and not route.probe
                and failed_runs < route.policy.retries
                and failed < policy.budget
            ) or (
                error.failure in WAIT_HERE_IF_ALONE
                and not route.probe
                and failed < policy.budget
                and not _elsewhere(route)
            )
            if not here:
                return _fall_back(error, error_type, reason, route, policy=policy, random=random)
        elif not error.retryable:
            return Fail(error_type=error_type, reason=reason)
        if failed >= policy.budget:
            return Fail(error_type=error_type, reason=reason + " (retries exhausted)")
    else:
        name = type(error).__name__
        error_type, reason = INTERNAL, f"worker error: {name}"
        if failed >= policy.budget:
            return Fail(
                error_type=error_type, reason=f"worker error on the last allowed run: {name}"
            )
    delay = given if given is not None else backoff(failed, policy, random)
    # A provider's retry-after is not capped by max_retry_delay (it names when
    # calls are taken again), but nothing waits here longer than quota_hold.
    return Retry(delay=min(delay, policy.quota_hold), error_type=error_type, reason=reason)


def _fall_back(
    error: BackendError,
    error_type: ErrorType,
    reason: str,
    route: RouteFacts,
    *,
    policy: FailurePolicy,
    random: Callable[[], float],
) -> Fail | FallBack:
    """The fallback after ``error`` on ``route.backend``, or the failure when none is left."""
    fallback, failed = route.fallback, route.backend
    # A 429 says "not now", not that the request failed; a failed probe call
    # is the backend's state (the router gives the next probe to a request
    # that has failed as one the fewest times: one cannot hold a circuit).
    limited = fallback.rate_limited + (1 if error.failure is FailureClass.RATE_LIMITED else 0)
    free = route.probe or (
        error.failure is FailureClass.RATE_LIMITED and limited <= _FREE_429S * route.policy.attempts
    )
    count = fallback.count + (0 if free else 1)
    if count >= route.policy.attempts:
        tried = tuple(dict.fromkeys((*fallback.excluded, failed.name)))
        return Fail(error_type=error_type, reason=f"{reason} ({_used_up(count, tried)})"[:1000])
    min_context = fallback.min_context
    if error.failure is FailureClass.CONTEXT_LENGTH and failed.context_window is not None:
        min_context = max(min_context or 0, failed.context_window + 1)
    min_tier = fallback.min_tier
    if not route.policy.downgrade:
        min_tier = max(min_tier or 0, failed.tier)
    too_small = fallback.too_small
    if error.failure is FailureClass.CONTEXT_LENGTH:
        too_small = tuple(dict.fromkeys((*too_small, failed.name)))
    constraints = Fallback(
        too_small=too_small,
        count=count,
        min_context=min_context,
        min_tier=min_tier,
        free_only=fallback.free_only or not route.policy.paid,
        from_tier=failed.tier,
        probes=fallback.probes + (1 if route.probe else 0),
        rate_limited=limited,
    )
    able = [c.name for c in route.candidates if _can_take(c, route, constraints)]
    if error.failure is FailureClass.CONTEXT_LENGTH:
        # Never again where the context did not fit (its window may be unknown).
        able = [name for name in able if name not in too_small]
        if not able:
            return Fail(
                error_type=error_type,
                reason=f"{reason} (no candidate of the route has a larger context window)"[:1000],
            )
    elif not able:
        return Fail(
            error_type=error_type,
            reason=f"{reason} (no candidate of the route meets the fallback rules)"[:1000],
        )
    # Every backend that failed it stays excluded: preferred against, never
    # ruled out. When no other candidate can take it, the router binds it to
    # one of them again, but not before ``not_before`` (a backoff by the
    # fallbacks so far): the failures reach the circuits first, and it waits
    # for a backend to recover instead of hammering the ones that failed.
    return FallBack(
        error_type=error_type,
        error_class=str(error.failure),
        reason=reason,
        fallback=msgspec.structs.replace(
            constraints,
            excluded=tuple(dict.fromkeys((*fallback.excluded, failed.name))),
            not_before=route.now + backoff(max(count, 1), policy, random),
        ),
    )


def _used_up(count: int, tried: tuple[str, ...]) -> str:
    """What a request that used all its attempts was tried on, truthfully: its
    charged attempts, and the distinct backends they ran on (one backend may
    take several, when no other candidate could)."""
    shown = ", ".join(tried[:_NAMES_SHOWN]) + (", ..." if len(tried) > _NAMES_SHOWN else "")
    backends = "1 backend" if len(tried) == 1 else f"{len(tried)} backends"
    attempts = "1 attempt" if count == 1 else f"{count} attempts"
    return f"{attempts}, the route's fallback.attempts, used on {backends}: {shown}"


def _elsewhere(route: RouteFacts) -> bool:
    """Whether a candidate other than the failed backend could take the request
    next (outside its exclusions, within its constraints)."""
    fallback = route.fallback
    return any(
        c.name != route.backend.name and c.name not in fallback.excluded and _can_take(c, route)
        for c in route.candidates
    )


def _can_take(candidate: Candidate, route: RouteFacts, fallback: Fallback | None = None) -> bool:
    """Whether ``candidate`` could take the request at all: its fallback
    constraints, its complexity, its cost cap (the estimate for this request),
    the features it needs."""
    return (
        meets(candidate, fallback or route.fallback)
        and route.needs <= candidate.features
        and (route.complexity is None or candidate.tier >= route.complexity)
        and (route.max_cost is None or candidate.cost is None or candidate.cost <= route.max_cost)
    )


def error_class_of(error: BaseException) -> str:
    """The ``error_class`` a failed run's events carry: the adapter's
    :class:`~renqueue.errors.FailureClass`, or :data:`INTERNAL` for a worker error."""
    return str(error.failure) if isinstance(error, BackendError) else INTERNAL


def exhausted_until(error: BaseException) -> float | None:
    """When a provider whose quota is spent said it comes back (``None``: not that, or unknown)."""
    if isinstance(error, RateLimitedError) and error.quota_exhausted:
        return error.quota_exhausted_until
    return None


def left_out_for(action: RequeueElsewhere, error: BaseException, now: float) -> float:
    """Seconds the backend whose quota is spent is left out, for everyone (the
    ``retry_after`` of the ``retrying`` event that puts the request back):
    until the provider's reset when it named one (or its ``retry-after``, if
    later), else the policy's hold (``action.hold``)."""
    until = exhausted_until(error)
    if action.hold is not None or until is None:
        return action.hold or 0.0
    return max(0.0, until - now, retry_after(error) or 0.0)


def cool_down_for(
    action: FallBack, error: BaseException, policy: FailurePolicy, random: Callable[[], float]
) -> float:
    """How long a backend that answered 429 is left out, for everyone (the
    ``retry_after`` of its ``fell_back`` event; 0 for any other class): its
    ``retry-after``, else the first backoff step (a 429 without one still
    says "not now")."""
    if action.error_class != "rate_limited":
        return 0.0
    given = retry_after(error) or backoff(1, policy, random)
    # A retry-after of days is a spent quota by another name: held as one
    # (quota_hold), never longer, so a hostile header cannot shut it out for a year.
    return min(given, policy.quota_hold)


def put_back_refused(action: FallBack | RequeueElsewhere, attempt: int) -> Fail | None:
    """The failure of a request whose dispatch ``attempt`` was put back to
    routing :data:`~renqueue.schema.MAX_REQUEUES` times already, so that it
    cannot be again (its copy would carry more requeues than admission
    accepts); ``None``: it may be put back."""
    if attempt <= MAX_REQUEUES:
        return None
    if isinstance(action, RequeueElsewhere):
        return Fail(
            error_type=QUOTA_EXHAUSTED,
            reason=(
                f"put back {MAX_REQUEUES} times, the most a request may be, "
                f"and its backend's quota is spent: {action.reason}"
            )[:1000],
        )
    return Fail(
        error_type=action.error_type,
        reason=f"put back {MAX_REQUEUES} times, the most a request may be: {action.reason}"[:1000],
    )
