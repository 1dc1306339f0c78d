"""How a request ends outside the failure policy, as the services record it.

Its deadline passes (:func:`past_deadline`) while it waits to be routed
(:func:`expired_waiting`, the router's), before its backend call or during it
(:func:`expired_before_call`, :func:`expired_running`, the worker's); it is
cancelled while it waits (:func:`cancelled_waiting`, the router's) or at its
worker (:func:`cancelled_at_worker`); it is refused (:func:`rejection`). The
router and the worker build these endings here, and the what-if simulator
with them, so the stage and the reason each carries are written once. A
worker's endings are of its run (:class:`~renqueue.schema.Run`) and name it
(backend, attempt): the projection's fold matches them with a decision
logged after them.
"""

from __future__ import annotations

from ..schema import (
    Cancelled,
    Expired,
    InferenceRequest,
    Rejected,
    Run,
    arm_of,
    cancelled,
    error_type_of,
    expired,
    rejected,
)
from ._planner import DEADLINE_PASSED


def past_deadline(request: InferenceRequest, now: float) -> bool:
    """Whether ``request``'s deadline has passed at ``now`` (it ends expired)."""
    return request.deadline is not None and now >= request.deadline


def expired_waiting(request: InferenceRequest, at: float, reason: str = DEADLINE_PASSED) -> Expired:
    """The router ends ``request`` (``queued``): its deadline passed while it
    waited to be routed (``reason``: the round's, when it says more)."""
    split, arm = arm_of(request)
    return expired(
        request.id, request.tenant, at=at, stage="queued", reason=reason, split=split, arm=arm
    )


def expired_before_call(run: Run, at: float) -> Expired:
    """The worker ends ``run``'s request (``queued``): its deadline passed before its
    backend call. The event names the run (its backend and attempt): its decision
    may be logged after it (see :mod:`renqueue.state._fold`)."""
    return run.expired(at=at, stage="queued", reason="deadline passed before the backend call")


def expired_running(run: Run, at: float) -> Expired:
    """The worker ends ``run``'s request (``running``): its deadline passed during
    generation (the call runs under a timeout of the time left)."""
    return run.expired(at=at, stage="running", reason="deadline passed during generation")


def cancelled_waiting(request: InferenceRequest, at: float) -> Cancelled:
    """The router ends ``request`` (``queued``): cancelled before it was routed."""
    return cancelled(
        request.id,
        request.tenant,
        at=at,
        stage="queued",
        reason="cancelled by request before it was routed",
    )


def cancelled_at_worker(run: Run, at: float, stage: str) -> Cancelled:
    """The worker ends ``run``'s request: cancelled before its call (``queued``) or
    during it (``running``). The event names the run, as :func:`expired_before_call`'s."""
    return run.cancelled(at=at, stage=stage, reason="cancelled by request")


def rejection(request_id: str, tenant: str, at: float, error: Exception) -> Rejected:
    """The router refuses a request (recorded under ``request_id`` and
    ``tenant``) for ``error``: its ``code`` (``malformed`` if it has none),
    its message."""
    code = error_type_of(getattr(error, "code", "malformed"))
    return rejected(request_id, tenant, at=at, error_type=code, reason=str(error)[:1000])
