"""The worker's failure policy: what to do after a run failed, as a plain function.

:func:`after_failure` takes the error a run ended with, how many runs of the
same dispatch failed before it (counted from the log's ``retrying`` events)
and the :class:`FailurePolicy`, and answers one of:

- :class:`RequeueElsewhere`: put the request back to routing, to be bound to
  another candidate of its route (the fallback down the cascade). For a
  :class:`~renqueue.errors.RateLimitedError` that says the provider's quota is
  spent (``quota_exhausted``: OpenAI's ``insufficient_quota``, a per-day quota
  id, a daily window at 0): no retry here can succeed before the quota comes
  back, hours away, so the request must not wait for it on this backend.
  Whatever the budget: the request has not failed, it goes elsewhere, and its
  next dispatch (a new attempt) starts a budget of its own. ``hold`` says how
  long this backend is left out when the provider did not say until when
  (``quota_exhausted_until`` unknown): its ``retry-after`` if longer, else
  ``quota_hold``.
- :class:`Retry`: run it again on the same backend after ``delay`` (a
  ``retrying`` event, then a delayed ``nak``). For any other retryable error
  (:class:`~renqueue.errors.RateLimitedError`,
  :class:`~renqueue.errors.RetryableBackendError`) or a worker error
  (``internal``: any exception that is not a :class:`~renqueue.errors.BackendError`),
  while this run is not the budget's last (``failed_runs + 1 < budget``).
- :class:`Fail`: end the request ``failed`` (with a dead-letter copy): at once
  for a fatal or bad-request error, or once the budget is used up.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable

from msgspec import Struct

from ..errors import BackendError, RateLimitedError

#: ``error_type`` of a failure that is the worker's, not the backend's.
INTERNAL = "internal"


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


class Retry(Struct, frozen=True, kw_only=True, tag=True):
    """Run the request again on this backend after ``delay`` seconds."""

    delay: float
    #: The ``retrying`` event's ``error_type`` and ``reason``.
    error_type: str
    reason: str


class RequeueElsewhere(Struct, frozen=True, kw_only=True, tag=True):
    """Put the request back to routing, to be bound to another candidate of its route.

    The worker records a ``retrying`` event that says so (``requeued``, with
    ``error_type``, ``reason`` and what the provider said of its quota), then
    puts the request back on its level's requeue subject, keeping its wait.
    """

    error_type: str
    reason: str
    #: Seconds to leave this backend out when the provider did not say until
    #: when its quota comes back; ``None`` when it did (that time holds it).
    hold: float | None = None


class Fail(Struct, frozen=True, kw_only=True, tag=True):
    """End the request ``failed`` (``error_type``, ``reason``), with a dead-letter copy."""

    error_type: str
    reason: str


FailureAction = Retry | RequeueElsewhere | Fail


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
) -> FailureAction:
    """What to do after a run of a dispatch failed with ``error``.

    ``failed_runs``: runs of the same dispatch that failed before this one.
    See the module docstring for the rules.
    """
    failed = failed_runs + 1
    given = retry_after(error)
    if isinstance(error, RateLimitedError) and error.quota_exhausted:
        known = error.quota_exhausted_until is not None
        return RequeueElsewhere(
            error_type=error.code,
            reason=f"{str(error)[:1000]} (quota exhausted: back to routing)",
            hold=None if known else max(policy.quota_hold, given or 0.0),
        )
    if isinstance(error, BackendError):
        error_type, reason = error.code, str(error)[:1000]
        if not error.retryable:
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
    return Retry(delay=delay, error_type=error_type, reason=reason)
